"""``python -m bench.compare``: admission strategies side by side, same workload, same simulator.

What it runs and how to read it (the strategies, the workload and clients, capacity and C, the
simulated time and the measurement window ``[--warmup, --duration)``, the figures, the noisy
neighbour, the replicas, the conditions and the latest results) is docs/benchmarks.md; every
option is in ``python -m bench.compare --help``. Each run starts a *fresh* backend and sends
the *same* open-loop schedule (one seed) to every strategy; a run whose simulator or load
generator lagged more than ``--max-lag-s`` is flagged, its latencies include the host's.

Outputs (``--out``, default ``bench/results/``): ``compare.json`` (settings, capacity, every
strategy's configuration, per-run summaries, target checks), ``records.json`` (per-request
outcomes), ``timelines.json`` (the samples), ``goodput.png`` and ``latency_cdf.png`` (steady),
``timeline_<scenario>.png`` (the others); process logs, Envoy configs and policies under
``logs/<run>/<strategy>``.

Modules: :mod:`.options` (the options, the simulator's command line), :mod:`.capacity` (the
closed-loop model, C, the live check), :mod:`.scenarios` (each run's rates and events, pure),
:mod:`.baselines` (the peers and their configurations), :mod:`.strategies` (the sidecar's
policies, as data), :mod:`.deploy` (each strategy's processes), :mod:`.run` (one strategy on
one run: the load, round robin over several gateways, counters, samples, the in-flight polls,
speed changes), then the figures in two layers: :mod:`.slo` (the window and the SLO),
:mod:`.measure` (raw results to one record of figures per run, pure; per tenant:
:mod:`.tenants`) and :mod:`.report` (tables, targets PASS/MISS; the noisy neighbour's:
:mod:`.noisy`) with :mod:`.plots`; ``__main__`` (the whole comparison, the CLI). Readers of
finished outputs: :mod:`.classes`, :mod:`.attain`.
"""
