"""The reload the pool's controllers refuse (pure): one that changes ``pool.shared``.

Its ``redis`` or ``key_prefix``, its ``lease``, ``timeout`` or ``replicas``, or shared mode
turned on or off: a running pool is not moved to another Redis or lease manager; a restart (a
rolling restart) applies it. ``shared_change`` says why, the refusal's message.
"""

from __future__ import annotations

from dataclasses import fields

from extproc.config.policy import PoolPolicy

__all__ = ["shared_change"]


def shared_change(before: PoolPolicy | None, after: PoolPolicy | None) -> str | None:
    """Why a reload from the pool ``before`` to ``after`` is refused: its ``pool.shared``
    changed (None: it did not). A restart applies it."""
    old, new = (p.shared if p is not None else None for p in (before, after))
    if old == new:
        return None
    if old is None or new is None:
        why = f"pool.shared {'added' if old is None else 'removed'}: a reload cannot turn "
        why += f"shared mode {'on' if old is None else 'off'}"
    else:
        changed = [f.name for f in fields(old) if getattr(old, f.name) != getattr(new, f.name)]
        if "redis" in changed:
            why = "pool.shared.redis changed: a reload cannot move a running pool to another Redis"
        elif "key_prefix" in changed:
            why = "pool.shared.key_prefix changed: a reload cannot move a running pool to another"
            why += " pool on its Redis"
        else:
            keys = " and ".join(f"pool.shared.{n.removesuffix('_s')}" for n in changed)
            why = f"{keys} changed: a reload cannot change a running pool's lease manager"
    return f"{why}; restart the sidecar (a rolling restart) to apply it"
