"""The pool's core: pure and synchronous, ``now`` passed in, no event loop.

- ``values``: the value types (``Entry``, what a request brings; ``Ticket``; ``Decision``,
  ``Verdict``; the stats) and ``slots(share, limit)``;
- ``admission``: ``Admission``, the state machine (enqueue, release, expire, cancel in;
  tickets to admit or refuse out);
- ``state``: a bucket's and the pool's mutable state, and ``BucketRule`` (a bucket's policy as
  the core applies it); ``order``: the order within a bucket and the choice across buckets;
  ``tenants``: fairness and bounds between tenants; ``relegate``: moving a late request to
  another bucket; ``deadlines``: the earliest deadline; ``demand``: the bands and demand
  questions, each answered once.

Nothing here imports the shell (``extproc.pool.gate`` and its neighbours), the controllers
(``extproc.pool.control``) or the shared pool (``extproc.pool.shared``).
"""
