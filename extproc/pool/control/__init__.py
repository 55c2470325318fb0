"""The pool's controllers, on the event loop and off the request path.

- ``adaptive``: the adaptive limit (``AdaptiveLimit``, a pure law); ``bandcut``: the cut of
  the least urgent band (pure); ``overload``: staged recovery (``OverloadMonitor``, pure);
- ``poller``: scrapes the backend (``extproc.backend.scrape``) on an interval and feeds the
  law;
- ``wiring``: ``PoolControl``, which wires the three controllers (adaptive limit, staged
  recovery, shared leases) to the gate, and follows policy reloads.
"""
