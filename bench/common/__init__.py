"""What every benchmark shares: one percentile definition (``stats``), one table formatter
(``table``). Processes are started and stopped by ``testing.stack.Proc``, the same runner the
tests use."""
