"""``python -m bench.gateway``: a simple shared-pool priority gateway, the ``priority-gateway``
strategy of :mod:`bench.compare`.

Why it exists: it is the fair stand-in for what a team writes in an afternoon in front of vLLM
(a small proxy with one semaphore and a "small requests first" rule), so the sidecar is compared
with the simple idea done honestly, not only with Envoy's generic limits. It is kept
deliberately simple; every shortcut below is one such a gateway takes.

Theory of operation
-------------------
* **One pool of C workers** shared by every request, whatever its class: at most C requests are
  forwarded to the backend at once.
* **Two FIFO queues**: a request whose prompt *and* ``max_tokens`` are both under their
  thresholds (``--short-prompt``, ``--short-output``) is *short* and waits in the first queue;
  every other request waits in the second. A free worker always takes the head of the short
  queue first. Nothing else is known about the request (no class priority, no cost order, no
  aging: a long request can starve behind a stream of short ones).
* **Queue timeout checked at dequeue only**: each request has a queue timeout (by its
  ``x-llm-class`` header, else the default), but nothing watches the clock. When a worker picks
  a request whose timeout has passed, the gateway answers it 503 then (late: it may have waited
  far longer than its timeout). A full queue (``--max-queue``) is answered 503 at once.
* **Clients that leave while queued** (their handler is cancelled: aiohttp's
  ``handler_cancellation``) are dropped from the queue, as any asyncio semaphore does; a client
  that leaves while running closes the upstream connection, and the backend aborts the request.
* Prompt tokens are counted as the simulator counts them (characters / 4).

Shape: :mod:`.core` is the pure pool (``enqueue / release / cancel`` with ``now`` passed in,
returning who runs and who is answered 503), :mod:`.server` the aiohttp proxy around it, and
``__main__`` the CLI. ``GET /gateway/stats`` returns the counters, ``GET /health`` 200.
"""
