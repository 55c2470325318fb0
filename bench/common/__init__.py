"""What every benchmark shares: one percentile definition (``stats``), one table formatter
(``table``), and generated policies built as data and validated by the product's loader
(``policy``). Processes are started and stopped by ``testing.stack.Proc``, the same runner the
tests use; requests are sent by ``bench.load.client``."""
