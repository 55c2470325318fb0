"""Open-loop load generator for OpenAI-compatible LLM endpoints (through Envoy or direct).

The clients (timeouts per attempt, the OpenAI SDK's retries, when an answer is good) and the
simulated time they run on: docs/benchmarks.md, "What the simulator models". What the code
relies on besides:

* Open loop: the whole schedule is computed up front from the class specs and a seed
  (:mod:`.workload`), and each request is sent at its scheduled time whatever happened to
  earlier ones. Latencies are measured from the *scheduled* arrival, so a late sender cannot
  hide queueing; its own lateness is reported as ``loadgen_lag_s_max``.
* Every duration is in simulated seconds, divided by ``speedup`` on the wall clock (as
  ``bench.sim --speedup``); a client that gives up closes its connection, and the backend
  aborts the request.
* Every run ends: arrivals stop at ``duration_s`` or ``max_requests``, each request is bounded
  by its timeouts and retries, and a hard cap cancels what is left after ``max_run_s``.

Modules: :mod:`.client` (one attempt at one request; the open-loop sender), :mod:`.presets`
(what each benchmark sends), :mod:`.workload` (classes, lengths, traces, the schedule; pure),
:mod:`.retry` (the SDK's retry policy; pure), :mod:`.summary` (the records; pure) and
:mod:`.runner` (a schedule sent with retries, as records).
"""
