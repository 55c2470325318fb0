"""Which requests are LLM work, by path: the door's lists are in ``extproc.contract``, read by
the sidecar here and by ``render-envoy`` (``extproc.config.envoy``), so the two cannot disagree.

Admission is only worth what gets past it unseen, so the door is default deny. Envoy normalises
the path first (``normalize_path``: percent-decoded unreserved characters, dot segments;
``merge_slashes``; an escaped slash or backslash refused with 400), then routes:

- ``LLM_PATHS``: every API where vLLM computes goes through the sidecar, which parses, bounds
  and admits those it knows (chat, completions, the Responses API, Anthropic's Messages, the
  pooling endpoints) and refuses the rest (audio, ``/invocations``: 404
  ``unsupported_endpoint``, counted) rather than let them reach the backend unadmitted; a
  policy's ``endpoints`` may admit fewer;
- ``PASS_THROUGH``: a short allowlist of cheap reads (models, health, version, tokenizer),
  which skip the sidecar;
- anything else has no route: Envoy answers 404 ``unknown_url`` itself.

The sidecar does not trust Envoy's configuration to have done this: :func:`canonical` repeats
the normalisation (and ignores case and a trailing slash, which a server behind Envoy may
ignore too), so a request routed to it under any spelling is recognised.
"""

from __future__ import annotations

from enum import StrEnum
from urllib.parse import unquote

from extproc.contract import LLM_PATHS

__all__ = [
    "ADMITTED",
    "Endpoint",
    "canonical",
    "endpoint_for_path",
    "refused_api",
]


class Endpoint(StrEnum):
    """The APIs the sidecar parses (``contract.APIS``)."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"
    MESSAGES = "messages"
    POOLING = "pooling"  # embeddings, classify, score, rerank: a prompt, no output to bound


# POST paths the sidecar parses, and as which API; the others of contract.LLM_PATHS it refuses.
ADMITTED: dict[str, Endpoint] = {
    path: Endpoint(api) for path, api in LLM_PATHS.items() if api is not None
}
_REFUSED = frozenset(path for path, api in LLM_PATHS.items() if api is None)


def canonical(path: str) -> str:
    """``path`` as the list above spells it: without query or fragment, percent-decoded
    (repeatedly: ``%2563`` too), backslashes as slashes, dot segments resolved, repeated and
    trailing slashes dropped, in lower case. Only for recognising a path; the request keeps
    its own."""
    path = path.split("?", 1)[0].split("#", 1)[0]
    for _ in range(3):  # bounded: each round only shortens the text
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    segments: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments).lower()


def endpoint_for_path(method: str, path: str) -> Endpoint | None:
    """The API a request targets if the sidecar admits it; None otherwise."""
    if method != "POST":
        return None
    if path in ADMITTED:  # the usual spelling: no work
        return ADMITTED[path]
    return ADMITTED.get(canonical(path))  # linear in the path, which Envoy bounds (60 KiB)


def refused_api(method: str, path: str) -> str | None:
    """The canonical path of an API that makes the backend compute but is not admitted here
    (``contract.LLM_PATHS`` without an API), for a POST; None for anything else."""
    if method != "POST":
        return None
    api = canonical(path)
    return api if api in _REFUSED else None
