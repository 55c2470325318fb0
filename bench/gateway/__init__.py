"""``python -m bench.gateway``: a simple shared-pool priority gateway, the ``priority-gateway``
strategy of :mod:`bench.compare` (docs/benchmarks.md, "The strategies").

It stands in for what a team writes in an afternoon in front of vLLM (a small proxy with one
semaphore and a "small requests first" rule), so the sidecar is also compared with the simple
idea done honestly, not only with Envoy's generic limits. Every shortcut below is one such a
gateway takes:

* One pool of C workers for every request, whatever its class.
* Two FIFO queues: *short* requests (prompt and ``max_tokens`` both under ``--short-prompt``
  and ``--short-output``) and the rest; a free worker takes the short queue's head first. No
  class priority, no cost order, no aging: a long request can starve behind short ones.
* A request's queue timeout (by ``x-llm-class``, else the default) is checked only when a
  worker picks it, so its 503 may come long after the timeout. A full queue (``--max-queue``)
  gets 503 at once.
* A client that leaves while queued is dropped from the queue (aiohttp's
  ``handler_cancellation``); one that leaves while running closes the upstream connection, and
  the backend aborts the request. Prompt tokens are counted as the simulator counts them
  (characters / 4).

:mod:`.core` is the pure pool (``enqueue / release / cancel`` with ``now`` passed in, returning
who runs and who gets 503), :mod:`.server` the aiohttp proxy around it, ``__main__`` the CLI.
``GET /gateway/stats`` returns the counters, ``GET /health`` 200.
"""
