"""``python -m bench.overhead``: what ext_proc, and this sidecar in particular, adds to a request.

One run, one Envoy process (the real 1.40 binary, ``--concurrency 1``), one fast backend, six
ways through it, measured side by side:

1. **floor**: the LLM route with ext_proc disabled (``ExtProcPerRoute.disabled``), as every
   non-LLM route is in ``envoy/envoy.yaml``;
2. **naive**: ext_proc to ``bench/overhead/naive.py``, a bare grpc.aio pass-through that parses
   the JSON body and answers CONTINUE (what a first attempt costs);
3. **sidecar-grpc**: the sidecar on grpc.aio, the tests' oracle (``python -m
   testing.grpc_sidecar``, ``serve``'s flags; not part of the product);
4. **sidecar**: ext_proc to ``python -m extproc serve`` (the h2 transport) with a realistic
   policy whose buckets are big enough that nothing queues; **sidecar+rw** is the same with a
   body that lacks ``max_tokens``, so the sidecar adds it and rewrites the body.
5. **sidecar+redis**: a second h2 sidecar whose buckets are the bands of one static pool
   (their slots together) shared through a local ``redis-server`` (``pool.shared``, one
   replica, the default lease and timeout; ``testing.redis.RedisServer``): local mode and
   shared mode in the same run, at the same rates, so the report shows what the Redis round
   trips add at 500 req/s (p50, p99) next to **sidecar**. A request pays a round trip only
   when its replica holds no spare lease (a freed lease nobody waits for stays as a spare
   until a renewal finds it unused), so the report also counts Redis's script calls per
   request (``INFO commandstats``); the redis-server's CPU is counted with the sidecar's, as
   that way's server CPU.

The ext_proc ways use the same filter configuration as the shipped one (request headers SEND,
request body BUFFERED, response SKIP/NONE, ``allow_mode_override``); each way is its own
listener of the same Envoy process, so they share the binary, the worker thread and the
backend.

The backend is Envoy itself: the route answers with a ``direct_response`` (a ~300-byte chat
completion). No backend process competes for the two cores, and nothing upstream adds noise
to the differences. A ``buffer`` filter sits before the router on every listener, so the floor
also reads the whole request body before it answers, as a real backend would; behind ext_proc
(BUFFERED) the body is already complete when it gets there.

Measured, one module each (the in-process one in :mod:`bench.micro`):

- ``openloop``: **open loop** at fixed rates (default 100, 500, 1000 req/s) with a small
  generator (h2load's ``--rps`` sends in 10 ms bursts, so it is not used for this): HTTP/1.1
  keep-alive, request i sent at t0 + i/rate on an idle connection (a new one if none is idle),
  so a slow answer never delays the next send. Latency = request written to last byte read.
  The sender's lateness against the schedule and its own CPU are printed with every run, to
  show it is not the bottleneck. Rounds alternate the order of the ways; samples are pooled
  across rounds;
- ``h2load``: **closed loop**: h2load over HTTP/1.1, 32 connections, one request each at a
  time: the maximum sustainable rate of each way on this machine;
- ``meters``: **CPU per request** of the ext_proc server (sidecar+redis: and of its
  redis-server) and of Envoy: utime+stime from /proc/<pid>/stat (all threads) before and
  after each run, over the requests of that run. The machine's other load during each run
  (CPU not used by any process of the bench) is printed too: on a shared 2-core box it is
  what makes a run noisy;
- ``held``: **held queue**: a second sidecar whose one bucket has one slot, held by a direct
  gRPC stream, then N (default 10,000) requests through Envoy queue behind it, paced at
  500 req/s. Sidecar and Envoy RSS at rest and with all N held, Envoy's ext_proc counters, then
  the time to drain the queue once the slot is freed. The same N sent at once (what a burst
  gets);
- ``bench.micro.admission_cost`` (also runnable alone): **admission cost vs queue length**:
  ``extproc.pool.gate.Gate`` and ``extproc.pool.core.admission.Admission`` in process, at 10,
  1,000 and 10,000 waiters: enqueue, admit (release + hand-over), cancel, evict (a real timer)
  must not grow with the queue;
- ``profile``: ``--profile`` adds a py-spy profile of the sidecar under closed-loop load (needs
  ``py-spy`` in the venv).

``ways`` holds the ways, bodies, policies and the Envoy config (from ``testing.envoy``'s
building blocks), ``procs`` the processes (``Bench``), ``report`` the targets and the printed
tables, ``__main__`` the command line and the order of the steps. A step that fails fails the
run (non-zero exit). Percentiles are ``bench.common.stats.percentile`` (linear interpolation).

It needs ``h2load`` and ``redis-server`` (both checked before anything starts).

Targets are printed as PASS or MISS; the benchmark is not tuned to hide a miss. sidecar+redis
is held to the sidecar's added-latency target at 500 req/s too, its difference to the local
sidecar printed with it. Method and
figures: docs/performance.md. Everything started here is stopped at the end
(``testing.stack.Proc`` kills process groups).
"""
