"""deploy/k8s's overlays as the tests read them: built here without kubectl, or by the real
`kubectl kustomize` where it is installed.

:func:`build` reads only the kustomization fields deploy/k8s uses, each as kustomize (v4.5 and
later) applies it, in kustomize's order within a kustomization:

1. ``resources``: a file's documents, or a folder's kustomization built on its own;
2. ``components``: each, in order, applied to what its parent holds so far (its own resources,
   generators and patches, by these same rules);
3. ``configMapGenerator``: a ConfigMap whose keys are the files' names, added, or with
   ``behavior: replace`` replacing the one of that name; never a hash suffix
   (``generatorOptions.disableNameSuffixHash`` must say so);
4. ``patches``: strategic merge patches from files, each applied to the one object of its kind,
   name and namespace. Here maps merge, ``null`` deletes a key, and lists and scalars are
   replaced, which is what a strategic merge does with every list deploy/k8s's patches touch
   (none that has a merge key).

Any other field is refused. tests/deploy/test_k8s.py compares :func:`build` with `kubectl
kustomize` for every overlay, so the two cannot part unnoticed; the objects come in the order
they were read, not in kustomize's (Namespace first: :func:`kubectl_build` has that).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from testing.stack import REPO
from testing.tools import optional_tool

__all__ = ["K8S", "OVERLAYS", "build", "key", "kubectl", "kubectl_build", "named"]

K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("plain", "shared", "istio")
FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "configMapGenerator",
    "generatorOptions",
    "patches",
}
# kubectl 1.24 embeds kustomize v4.5.4; Kubernetes 1.24 is what the gRPC probes need anyway.
KUSTOMIZE_MIN = (4, 5)

Object = dict[str, Any]


def key(obj: Object) -> tuple[str, str, str]:
    """(kind, namespace, name): what identifies an object in an overlay."""
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def named(objects: list[Object], kind: str, name: str, namespace: str = "llm-extproc") -> Object:
    """The one object of ``kind`` called ``name`` (Namespaces have no namespace)."""
    ns = "" if kind == "Namespace" else namespace
    (obj,) = [o for o in objects if key(o) == (kind, ns, name)]
    return obj


def build(folder: Path) -> list[Object]:
    """The objects the kustomization in ``folder`` makes."""
    objects: list[Object] = []
    _accumulate(folder, "Kustomization", objects)
    return objects


def _accumulate(folder: Path, kind: str, objects: list[Object]) -> None:
    path = folder / "kustomization.yaml"
    k = yaml.safe_load(path.read_text())
    assert k["kind"] == kind, f"{path}: a {k['kind']} where a {kind} was expected"
    unknown = set(k) - FIELDS
    assert not unknown, f"{path}: {sorted(unknown)} not read by tests/deploy/kustomize.py"
    for entry in k.get("resources", []):
        source = folder / entry
        if source.is_dir():
            objects.extend(build(source))
        else:
            objects.extend(d for d in yaml.safe_load_all(source.read_text()) if d)
    for entry in k.get("components", []):
        _accumulate(folder / entry, "Component", objects)
    generators = k.get("configMapGenerator", [])
    if generators:
        assert k.get("generatorOptions") == {"disableNameSuffixHash": True}, path
    for gen in generators:
        assert set(gen) <= {"name", "namespace", "behavior", "files"}, (path, gen)
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": gen["name"], "namespace": gen["namespace"]},
            "data": {Path(f).name: (folder / f).read_text() for f in gen["files"]},
        }
        same = [i for i, o in enumerate(objects) if key(o) == key(config_map)]
        if gen.get("behavior", "create") == "replace":
            (i,) = same
            objects[i] = config_map
        else:
            assert gen.get("behavior", "create") == "create" and not same, (path, gen)
            objects.append(config_map)
    for entry in k.get("patches", []):
        assert set(entry) == {"path"}, (path, entry)
        patch = yaml.safe_load((folder / entry["path"]).read_text())
        (target,) = [o for o in objects if key(o) == key(patch)]
        _merge(target, patch)


def _merge(target: Object, patch: Object) -> None:
    for name, value in patch.items():
        if value is None:
            target.pop(name, None)
        elif isinstance(value, dict) and isinstance(target.get(name), dict):
            _merge(target[name], value)
        else:
            target[name] = copy.deepcopy(value)


def kubectl() -> str:
    """kubectl's path, if it embeds kustomize v4.5 or later; else skip (or fail in CI)."""
    found = shutil.which("kubectl")
    name = "kubectl"
    if found is not None:
        out = subprocess.run(
            [found, "version", "--client", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        # kubectl before 1.21 (kustomize v2.0.3, e.g. Debian 12's kubernetes-client) does not
        # say; a dispatcher or dev build may add a suffix to the version.
        version = json.loads(out.stdout).get("kustomizeVersion", "v0 (older than v4)")
        parts = tuple(int(p) for p in version.lstrip("v").split()[0].split("-")[0].split("."))
        if parts[:2] < KUSTOMIZE_MIN:
            found, name = None, f"kubectl with kustomize v4.5+ (its kustomize: {version})"
    how = "kubectl 1.24 or later, from kubernetes.io or your cloud's SDK"
    return optional_tool("kubectl", found, name, how)


def kubectl_build(folder: Path) -> list[Object]:
    """The objects `kubectl kustomize` makes of ``folder``, in its order."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert not out.stderr, out.stderr  # no deprecation warnings either
    return [d for d in yaml.safe_load_all(out.stdout) if d]
