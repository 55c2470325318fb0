"""One pool for several gateway replicas: slots leased from Redis (or Valkey).

``decide``: the pure lease decisions and the theory of operation (start there). ``ledger``:
what one replica knows, without I/O. ``scripts``: the keys and the Lua scripts (the pool's
state, changed atomically on the server's clock). ``replies``: the scripts' replies and the
events decoded. ``client``: the Redis connections and the calls under their deadline.
``leases``: the asyncio lease manager of one replica (acquire, give back, renew, degraded
mode, rejoin).
"""

from extproc.pool.shared.leases import LeaseManager, LocalPool, Mode

__all__ = ["LeaseManager", "LocalPool", "Mode"]
