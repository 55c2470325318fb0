"""One pool for several gateway replicas: slots leased from Redis (or Valkey).

``scripts``: the keys and the Lua scripts (the pool's state, changed atomically on the server's
clock). ``leases``: the asyncio lease manager of one replica (acquire, give back, renew,
degraded mode, rejoin). The design is in ``extproc.shared.leases``.
"""

from extproc.shared.leases import LeaseManager, LocalPool, Mode

__all__ = ["LeaseManager", "LocalPool", "Mode"]
