"""Open-loop load generator for OpenAI-compatible LLM endpoints (through Envoy or direct).

Design
------
* **Schedule first** (:mod:`.workload`): the whole arrival schedule is computed up front from
  the class specs and a seed, so runs are reproducible. A class's rate may be piecewise
  constant (``rate_schedule``: a scenario's quiet phase, flood or spike); ``mix="long"``
  swaps the traces' lengths for long prompts. Arrivals are *open loop*: each request is
  sent at its scheduled time whatever happens to earlier ones, and latencies are measured from
  the *scheduled* arrival (a late sender cannot hide queueing; the sender's own lateness is
  reported as ``loadgen_lag_s_max``).
* **Simulated time**: every duration in the configuration and the results (arrival times,
  client timeouts, retry backoffs, ``retry-after`` values, latencies) is in simulated seconds;
  on the wall clock they are divided by ``speedup``, matching ``bench.sim --speedup``.
* **Clients** behave like application clients: a request that exceeds its class's timeout is
  abandoned and its connection closed (the backend then aborts it); optional retries follow the
  OpenAI Python SDK (:mod:`.retry`). The timeout applies per attempt, like the SDK's; a
  request is *good* if its final answer is a complete 200 whose end-to-end time from the
  original arrival (retries included) is within the class timeout.
* **Wasted work**: if ``stats_url`` points at the simulator's ``/sim/stats``, counters are read
  before and after the run; tokens generated for requests that were later aborted measure the
  work the backend wasted on clients that had already given up.
* **Always terminates**: arrivals stop at ``duration_s`` or ``max_requests``; each request is
  bounded by its timeouts and retries; a hard cap cancels anything left after ``max_run_s``.

Modules: :mod:`.client` (the one HTTP client of every benchmark: one attempt at one request,
the open-loop sender), :mod:`.presets` (what each benchmark sends: compare's two-class mix,
the demo's burst, the storm's, the soak's arrivals), :mod:`.workload` (classes, length
distributions, traces, the schedule; pure), :mod:`.retry` (the SDK's retry policy; pure),
:mod:`.summary` (records, per-class summaries, the printed table; pure), :mod:`.runner` (a
schedule sent with retries, as records) and the CLI, ``python -m bench.load --url
http://127.0.0.1:10000 --rate 5 --duration 60``.
"""
