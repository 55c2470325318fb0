"""``python -m bench.compare``: admission strategies side by side, same workload, same simulator.

What it runs and how to read the results: docs/benchmarks.md; every option: ``python -m
bench.compare --help``. Each run starts a *fresh* backend and sends the *same* open-loop
schedule (one seed) to every strategy.

Outputs (``--out``, default ``bench/results/``): ``compare.json`` (settings, capacity, every
strategy's configuration, per-run summaries, target checks), ``records.json`` (per-request
outcomes), ``timelines.json`` (the samples); process logs, Envoy configs and policies under
``logs/<run>/<strategy>``.

Modules beyond those CONTRIBUTING.md's tree names: :mod:`.options` (the options, the
simulator's command line), :mod:`.capacity` (the closed-loop model, C, the live check),
:mod:`.scenarios` (each run's rates and events, pure), :mod:`.deploy` (each strategy's
processes) and ``__main__`` (the whole comparison, the CLI).
"""
