"""A vLLM-like OpenAI-compatible inference server simulator, the backend of the tests and
benchmarks. What it models and what it does not, and how it is held to a real vLLM:
docs/benchmarks.md, "What the simulator models".

Design
------
Three layers, one module each, plus :mod:`.profiles` (step-time model, engine limits),
:mod:`.api` (the OpenAI wire format, pure), :mod:`.metrics` (Prometheus) and the CLI
(``__main__``):

1. **Pure core** (:class:`.scheduler.Scheduler`): the V1-style scheduler state machine, no I/O,
   no clock. A step is two calls, mirroring vLLM's ``schedule()`` / ``update_from_output()``:

   * :meth:`Scheduler.schedule` picks the work of one step at simulated time ``start_s`` and
     allocates its KV cache: first the running requests in admission order (a decoding request
     needs 1 token, a prefilling one the rest of its prompt, chunked to the remaining token
     budget); if the KV cache cannot hold a running request's new tokens, the most recently
     admitted running request is preempted (KV freed, progress discarded, put back at the front
     of the waiting queue, recomputed later -- vLLM's recompute preemption). Then, only if no
     request was preempted, waiting requests are admitted FCFS while there is token budget, a
     free sequence slot (``max_num_seqs``) and KV space for their first chunk (head-of-line
     blocking, no skipping). It returns a :class:`StepPlan` whose duration is
     ``(b0 + b1 * prefill_tokens + b2 * decode_tokens) / speed_factor``; the speed factor (1 by
     default, 0.5 for a GPU that got half as fast) changes between steps, never during one.
   * :meth:`Scheduler.complete` applies the step's results at ``end_s``: computed tokens advance,
     every request whose tokens are all computed samples one output token (the step that finishes
     a prefill yields the first token; each later token records its gap since the previous
     one, the inter-token latency), requests that reached ``max_tokens`` finish and free
     their KV. Requests aborted between the two calls are skipped (their output is dropped, as
     in vLLM).

   The KV cache is accounted in tokens (no 16-token blocks): a request holds
   ``prompt + generated`` tokens of KV, allocated as they are scheduled. ``max_model_len`` must
   not exceed the KV capacity (vLLM refuses to start otherwise), which guarantees progress: a
   single request always fits once the others are preempted.

2. **Async engine** (:class:`.engine.SimEngine`): drives the core on a *virtual clock* tied to
   the wall clock, ``sim_now = (loop.time() - t0) * speedup``. Steps are laid back to back in
   simulated time (step ``k+1`` starts exactly where step ``k`` ended), and the loop sleeps until
   the wall time at which the step ends. When the loop oversleeps (asyncio sleeps have 1 ms
   resolution on Linux) or Python is slower than the scaled step, the next steps run without
   sleeping (yielding to the handlers every 2 ms of wall time) until the engine has caught up;
   timestamps stay those of the model, so throughput and server-side latencies are exact, and
   the delay with which results reach the sockets is measured as *lag*
   (``vllm_sim:engine_lag_seconds`` gauge, ``lag_s_max`` / ``lag_s_mean`` in ``/sim/stats``).
   A request arriving while the engine is behind is stamped with its real arrival time and only
   joins steps that start after it. A lag that keeps growing means the machine cannot run this
   speedup: lower ``--speedup``. Speed changes (``POST /sim/speed``) reach
   the core between steps.

3. **HTTP layer** (:mod:`.server`, aiohttp): parses requests (:func:`.api.parse_request`),
   submits them to the engine and streams tokens as they are produced; a client disconnect
   aborts the request in the core at once. Metrics come from a per-instance
   :class:`prometheus_client.CollectorRegistry`.

All times reported (metrics, ``/sim/stats``, ``x-sim-*`` response headers) are simulated seconds.

Token accounting (prompt tokens from characters / 4, exactly ``max_tokens`` generated): see
:mod:`.api`.

Run: ``python -m bench.sim --host 127.0.0.1 --port 8000 --profile h100 --speedup 1``.
"""
