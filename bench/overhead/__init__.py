"""``python -m bench.overhead``: what ext_proc, and this sidecar in particular, adds to a request.

The ways, the method, the targets and the figures: docs/performance.md ("Method", "The
reference run"). For ``sidecar+redis`` the report also counts Redis's script calls per request,
and that way's server CPU is the sidecar's and the redis-server's together. Besides ``h2load``
it needs ``redis-server``; both are checked before anything starts.

One module per step: ``openloop`` (fixed rates), ``h2load`` (closed loop, the maximum rate),
``meters`` (CPU per request from /proc, the machine's other load), ``held`` (the held queue),
``profile`` (``--profile``: py-spy on the sidecar), and in process
:mod:`bench.micro.admission_cost` and :mod:`bench.micro.tenant_cost`. ``ways`` holds the ways,
bodies, policies and the Envoy config, ``procs`` the processes (``Bench``; ``testing.stack.Proc``
kills process groups), ``report`` the targets and the printed tables, ``__main__`` the command
line and the order of the steps.
"""
