"""The backend pool's own view of its load, read from vLLM's Prometheus metrics.

One round of reading, a module a stage: ``http`` (a bounded HTTP/1.1 GET), ``prometheus`` (the
sample lines of named families in a text page; pure), ``vllm`` (what is read from one
endpoint's page; pure), ``window`` (cumulative histograms -> windowed quantiles; pure, ``now``
passed in), and ``scrape``, the asyncio shell: it resolves every address of each URL, GETs and
reads each, and folds them into one ``Signals``. What the pool does with the signals
(the adaptive limit, staged recovery) is ``extproc.pool``'s.
"""
