"""The pool's controllers, on the event loop and off the request path.

- ``adaptive``: the adaptive limit (``AdaptiveLimit``, a pure law); ``bandcut``: the cut of
  the least urgent band (pure); ``overload``: staged recovery (``OverloadMonitor``, pure);
- ``poller``: scrapes the backend (``extproc.backend.scrape``) on an interval and feeds the
  law; ``recovery``: the overload monitor on the gate; ``headers``: the tenant-header watch;
- ``reload``: the reload refused, one that changes ``pool.shared`` (pure);
- ``wiring``: ``PoolControl``, which wires them (and the shared leases) to the gate, and
  follows policy reloads.
"""
