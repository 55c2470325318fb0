"""The background loops' guard, ``extproc.loops``, by its name under ops.

The guard imports nothing of extproc and lives below the pool, whose loops run under it
(tests/unit/test_imports.py: the pool imports nothing of ops); these names stay for its readers.
"""

from extproc.loops import LOOPS, MAX_BACKOFF_S, Guard

__all__ = ["LOOPS", "MAX_BACKOFF_S", "Guard"]
