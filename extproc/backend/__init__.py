"""The backend pool's own view of its load, read from vLLM's Prometheus metrics.

``scrape`` reads every vLLM endpoint behind the configured names and folds their pages into one
``Signals``. What the pool does with them (the adaptive limit, staged recovery) is in
``extproc.pool``.
"""
