"""Policies the benchmarks generate: built as data, validated when built, written as YAML.

A benchmark states a policy as plain data, the dicts and lists a policy file parses into, and
:func:`policy_yaml` checks it with the product's own loader
(``extproc.config.policy.policy_from_mapping``) before it returns the YAML a sidecar is
started with: a misspelt key, a duration out of range or a share above 1 fails when the
strategy is built, with the loader's message, not later when a sidecar refuses to start. A
value a harness fills in only when it runs (``{redis}``: the Redis URL ``testing.gateways``
writes in) is validated with a stand-in (``stand_ins``) and written as the placeholder.

Durations are the policy's strings (``1s``, ``250ms``); :func:`wall_ms` turns simulated
seconds into whole milliseconds of wall clock at a speedup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import yaml

from extproc.config.policy import Policy, policy_from_mapping

__all__ = [
    "REDIS_PLACEHOLDER",
    "REDIS_STAND_IN",
    "STAND_INS",
    "policy_yaml",
    "validated",
    "wall_ms",
]

# Where a policy names the Redis that testing.gateways.Gateways (or the overhead bench) starts.
REDIS_PLACEHOLDER: Final = "{redis}"
# A well-formed URL in its place, for validation (nothing connects to it).
REDIS_STAND_IN: Final = "redis://127.0.0.1:6379/0"
STAND_INS: Final = {REDIS_PLACEHOLDER: REDIS_STAND_IN}


def wall_ms(sim_s: float, speedup: float = 1.0) -> str:
    """A policy duration: ``sim_s`` simulated seconds on the wall clock at ``speedup``, in
    whole milliseconds (at least 1)."""
    return f"{max(1, round(1000 * sim_s / speedup))}ms"


def _filled(value: Any, stand_ins: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return stand_ins.get(value, value)
    if isinstance(value, Mapping):
        return {k: _filled(v, stand_ins) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_filled(v, stand_ins) for v in value]
    return value


def validated(
    data: Mapping[str, Any], source: str, stand_ins: Mapping[str, str] | None = None
) -> Policy:
    """The resolved policy of ``data`` (placeholders replaced by their ``stand_ins``); raises
    ``PolicyError`` naming ``source`` and the field."""
    return policy_from_mapping(_filled(data, STAND_INS if stand_ins is None else stand_ins), source)


class _Dumper(yaml.SafeDumper):
    """Block style; a string that needs quotes gets double quotes (``redis: "{redis}"``)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True  # a value used twice is written twice, not as an anchor and an alias

    def choose_scalar_style(self) -> str:
        style: str = super().choose_scalar_style()
        return '"' if style == "'" else style


def policy_yaml(
    data: Mapping[str, Any],
    *,
    source: str,
    comment: str = "",
    stand_ins: Mapping[str, str] | None = None,
) -> str:
    """``data`` as a policy file, after :func:`validated` accepted it; ``comment`` (lines) on
    top, each line as a YAML comment."""
    validated(data, source, stand_ins)
    head = "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines())
    plain = _filled(data, {})  # plain dicts and lists, as YAML's safe dumper wants them
    body = yaml.dump(plain, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    return head + body
