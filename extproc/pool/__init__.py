"""The pool: the buckets' slots, who gets a freed one, and the controllers of its limit and cut.

Data plane (per request):

- ``values``: the core's value types (``Entry``, ``Ticket``, ``Decision``, ``Verdict``,
  ``BucketStats``, ``PoolStats``); ``state``: its mutable state; ``core``: ``Admission``, the
  pure state machine (``now`` passed in); ``order``: its named decisions (in a bucket, across
  buckets); ``demand``: the bands and demand questions, each answered once.
- ``gate``: the asyncio shell (futures, one eviction timer, ``Slot.release()``); ``shares``:
  route shares, buckets of a second gate.

Control plane (on the event loop, off the request path):

- ``adaptive``: the adaptive limit (``AdaptiveLimit``, pure); ``poller``: its ``Poller``,
  which scrapes the backend (``extproc.backend.scrape``) on an interval; ``overload``: staged
  recovery (``OverloadMonitor``, pure); ``lease_adapter``: the local pool as the lease manager
  of a shared pool (``extproc.pool.shared``) sees it; ``control``: ``PoolControl``, which wires the
  three controllers (adaptive limit, staged recovery, shared leases) to the gate.
- ``view``: gauges and /debug/queues rendered from the controllers' ``snapshot()``.

Nothing is imported here, so that each module can be imported alone.
"""
