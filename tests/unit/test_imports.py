"""The product's imports: no cycles, and no module imports from a layer above its own.

Every module under extproc/ is parsed (``ast``, nothing is imported) and every import counts:
at the top, under ``if TYPE_CHECKING:`` (a cycle in the types is a cycle in the design) and
inside functions (a deferred import is still a dependency). ``from P import name`` is an edge
to the module ``P.name`` when there is one, else to ``P`` (a package's ``__init__``); a
package's own ``__init__``, which Python runs before any of its modules, is not an edge of
them.

``LAYERS`` is the order, lowest first: a module may import only from its own layer or lower
ones. A module's layer is that of the longest prefix in the table that names it
(``pool.shared.leases`` -> ``pool.shared``, ``pool.gate`` -> ``pool``), so a sub-floor is one more
row above or below its package's. A new top-level module or package needs its row: the test says
which.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2] / "extproc"
PACKAGE: Final = "extproc"
Graph = Mapping[str, frozenset[str]]

# Lowest first: each layer's top-level modules and packages (relative to extproc; ``__init__``:
# the package's own), with one line saying what the layer is.
LAYERS: Final[tuple[tuple[str, ...], ...]] = (
    # Leaves, importing nothing of extproc: shared tables, version(), loops' guard, generated.
    ("__init__", "contract", "outcome", "objectives", "loops", "_proto"),
    # The policy: load, validate, resolve, print; what it implies for Envoy.
    ("config",),
    # The backend's own view of its load, read from its metrics.
    ("backend",),
    # The pool, in floors: a gauge as a snapshot field's metadata, and their rendering (pure).
    ("pool.view",),
    # The pool's core: admission, pure and synchronous, ``now`` passed in.
    ("pool.core",),
    # The pool's asyncio shell: the gate, route shares, what refusals and ends tell.
    ("pool",),
    # The pool shared through Redis: the leases, and the local pool as they see it.
    ("pool.shared",),
    # The pool's controllers: the adaptive law, the band cut, staged recovery, their wiring.
    ("pool.control",),
    # One request's path: parse, classify, route, deadline, tenant, the answers to Envoy.
    ("request",),
    # What one request went through (RequestRecord), decided once.
    ("record",),
    # Operations: Prometheus metrics and the HTTP port, the logs.
    ("ops",),
    # The servicer's per-stream state; the gRPC transport and its server.
    ("stream", "transport"),
    # The servicer: headers -> body -> admit -> hold -> finish.
    ("service",),
    # Assembly: policy, gate, controllers, metrics, servicer, transport, reload, stop.
    ("app",),
    # The command line.
    ("cli", "__main__"),
)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package under ``root``, by its dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports(source: str, name: str, is_package: bool, known: Iterable[str]) -> frozenset[str]:
    """The modules of ``known`` that the module ``name`` (its ``source``) imports, wherever the
    import is (module docstring: the rules)."""
    names = set(known)
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                up = here[: len(here) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names]
            targets = [t if t in names else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in names:  # ``import a.b.c`` of a name in a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return frozenset(out)


def graph(root: Path = ROOT) -> dict[str, frozenset[str]]:
    found = modules(root)
    return {
        name: imports(path.read_text(), name, path.name == "__init__.py", found)
        for name, path in found.items()
    }


def tangles(g: Graph) -> list[frozenset[str]]:
    """The modules of ``g`` that import one another in a circle: its strongly connected
    components of two modules or more, and a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[frozenset[str]] = []

    def strong(v: str) -> None:  # Tarjan's
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in g.get(v, ()):
                found.append(frozenset(component))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return sorted(found, key=min)


def cycles(g: Graph) -> list[list[str]]:
    """A cycle through each tangle, from its first module: [a, b, ..., a]."""
    return [_around(g, min(t), t) for t in tangles(g)]


def _around(g: Graph, start: str, component: frozenset[str]) -> list[str]:
    """A shortest path from ``start`` back to it inside ``component`` (breadth first)."""
    came: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(g.get(v, ())):
                if w == start:
                    path = [v]
                    while (before := came[path[-1]]) is not None:
                        path.append(before)
                    return [*reversed(path), start]
                if w in component and w not in came:
                    came[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def layer_of(name: str, layers: Sequence[Sequence[str]] = LAYERS) -> int | None:
    """The index of ``name``'s layer: its longest prefix in ``layers`` (None: in none)."""
    relative = "__init__" if name == PACKAGE else name.removeprefix(PACKAGE + ".")
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, members in enumerate(layers):
        for m in members:
            if relative == m or relative.startswith(m + "."):
                if best is None or len(m) > best[0]:
                    best = (len(m), i)
    return None if best is None else best[1]


def upward(g: Graph, layers: Sequence[Sequence[str]] = LAYERS) -> list[str]:
    """Each import of a module from a layer above its own, and each module in no layer."""
    out = []
    for name in sorted(g):
        here = layer_of(name, layers)
        if here is None:
            out.append(f"{name} is in no layer: give it a row in LAYERS")
            continue
        for target in sorted(g[name]):
            there = layer_of(target, layers)
            if there is not None and there > here:
                out.append(f"{name} ({layers[here][0]}) imports {target} ({layers[there][0]})")
    return out


def test_no_cycles_and_no_upward_imports() -> None:
    g = graph()
    assert (
        len(g) > 50 and "extproc.pool.core.state" in g["extproc.pool.core.admission"]
    )  # it did read them
    found = [
        f"{' -> '.join(_around(g, min(t), t))} (in the circle: {', '.join(sorted(t))})"
        for t in tangles(g)
    ]
    assert not found, "import cycles:\n" + "\n".join(found)
    wrong = upward(g)
    assert not wrong, "imports from a higher layer (LAYERS):\n" + "\n".join(wrong)


def test_the_checker_fails_on_a_cycle_and_on_an_upward_import() -> None:
    """The checks find what they are for, on small graphs and sources made up here."""
    known = {"extproc.a", "extproc.b", "extproc.c", "extproc.p", "extproc.p.m"}
    source = """
from typing import TYPE_CHECKING
import extproc.a
from extproc.p import m, NAME
from . import c
if TYPE_CHECKING:
    from extproc.c import Thing
def late():
    from extproc.b import f
"""
    assert imports(source, "extproc.x", False, known) == {
        "extproc.a",
        "extproc.b",
        "extproc.c",
        "extproc.p",
        "extproc.p.m",
    }
    relative = "from .m import y\nfrom .. import a\n"
    assert imports(relative, "extproc.p", True, known) == {"extproc.p.m", "extproc.a"}

    assert cycles({"extproc.a": frozenset({"extproc.b"}), "extproc.b": frozenset()}) == []
    looped = {
        "extproc.a": frozenset({"extproc.b"}),
        "extproc.b": frozenset({"extproc.c"}),
        "extproc.c": frozenset({"extproc.a"}),
        "extproc.d": frozenset({"extproc.d"}),
    }
    assert cycles(looped) == [
        ["extproc.a", "extproc.b", "extproc.c", "extproc.a"],
        ["extproc.d", "extproc.d"],
    ]

    layers = (("low",), ("high", "side"))
    flat = {
        "extproc.high.x": frozenset({"extproc.low", "extproc.side"}),
        "extproc.low": frozenset(),
    }
    assert upward(flat, layers) == []
    up = {**flat, "extproc.low": frozenset({"extproc.high.x"}), "extproc.new": frozenset()}
    assert upward(up, layers) == [
        "extproc.low (low) imports extproc.high.x (high)",
        "extproc.new is in no layer: give it a row in LAYERS",
    ]
    assert layer_of("extproc.pool.gate") == layer_of("extproc.pool")
    assert (
        layer_of("extproc.pool.core") < layer_of("extproc.pool") < layer_of("extproc.pool.shared")
    )
    assert layer_of("extproc") == 0 and layer_of("extproc.cli") == len(LAYERS) - 1
