"""The backend pool's own view of its load, read from vLLM's Prometheus metrics.

``scrape`` reads every vLLM endpoint behind the configured names and folds their pages into one
``Signals``; ``adaptive`` turns those signals and the user's latency objectives into the pool's
concurrency limit; ``overload`` watches the protected traffic's evictions and tells the
lower-priority bands when to give way and when to come back.
"""
