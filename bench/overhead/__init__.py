"""``python -m bench.overhead``: what ext_proc, and this sidecar in particular, adds to a request.

One Envoy process (the real binary, ``--concurrency 1``) with one listener per way, the backend
Envoy's own ``direct_response`` behind a ``buffer`` filter, five ways measured side by side:
**floor** (ext_proc disabled on the route), **naive** (``bench/overhead/naive.py``, a bare
grpc.aio pass-through), **sidecar** (``python -m extproc serve``, nothing queues),
**sidecar+rw** (a body without ``max_tokens``: the sidecar rewrites it) and **sidecar+redis**
(a static pool shared through a local ``redis-server``; the report counts Redis's script calls
per request, and the redis-server's CPU is that way's server CPU with the sidecar's). The
method, the targets and the figures are docs/performance.md ("Method", "The reference run").

The steps, one module each: ``openloop`` (fixed rates, request i at t0 + i / rate on an idle
connection, rounds alternating the order of the ways), ``h2load`` (closed loop, the maximum
rate), ``meters`` (CPU per request from /proc, and the machine's other load), ``held`` (a queue
held behind one slot: RSS, Envoy's counters, the drain), ``profile`` (``--profile``: py-spy on
the sidecar), and in process :mod:`bench.micro.admission_cost` and
:mod:`bench.micro.tenant_cost`. ``ways`` holds the ways, bodies, policies and the Envoy config,
``procs`` the processes (``Bench``), ``report`` the targets and the printed tables,
``__main__`` the command line and the order of the steps. A step that fails fails the run; it
needs ``h2load`` and ``redis-server`` (checked before anything starts); everything started is
stopped at the end (``testing.stack.Proc`` kills process groups). Targets are printed as PASS or
MISS; the benchmark is not tuned to hide a miss.
"""
