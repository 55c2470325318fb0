"""The pool: the buckets' slots, who gets a freed one, and the controllers of its limit and cut.

Floors, lowest first (``tests/unit/test_imports.py`` keeps a floor from importing one above):

- ``view``: a gauge is a snapshot field's metadata; gauges and /debug/queues rendered from
  ``snapshot()``s (pure);
- ``core/``: admission, pure and synchronous (``now`` passed in): values, state, the orders,
  tenants, relegation, deadlines, bands and demand;
- the asyncio shell, here: ``gate`` (futures, one eviction timer, ``Slot.release()``),
  ``shares`` (route shares: buckets of a second gate), ``refused`` and ``ends`` (what a
  refusal and an end tell the controllers);
- ``shared/``: the pool shared by several replicas through Redis: the leases, and
  ``adapter``, the local pool as the lease manager sees it;
- ``control/``: the adaptive limit, the band cut, staged recovery, the poller, and
  ``wiring`` (``PoolControl``) with its parts (``recovery``, ``headers``, ``reload``).

Nothing is imported here, so that each module can be imported alone.
"""
