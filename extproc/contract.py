"""What the sidecar and Envoy's configuration must agree on, in one place both sides import.

Each value is a fact about Envoy 1.40's ext_proc filter that the code relies on; the test named
beside it runs the real Envoy and fails if the fact stops holding (docs/envoy.md has the list).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "APIS",
    "EXT_PROC_SERVICE",
    "LLM_PATHS",
    "MESSAGE_TIMEOUT_MARGIN_S",
    "METADATA_NAMESPACE",
    "PASS_THROUGH",
    "PATH_NORMALISATION",
    "PROCESSING_MODE",
    "PROCESS_METHOD",
    "ROUTE_ATTRIBUTE",
    "ROUTE_ATTRIBUTES_KEY",
]

# The gRPC service and method Envoy calls; one bidirectional stream per HTTP request.
EXT_PROC_SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_METHOD: Final = f"/{EXT_PROC_SERVICE}/Process"

# What the sidecar expects Envoy to send: request headers, then the whole request body in one
# message, nothing of the response. Envoy keeps the stream open until the HTTP stream is done
# (the last byte of a streamed response), which is how the slot is held for exactly the
# backend's work (tests/e2e/test_e2e.py). Request headers must stay SEND: with SKIP, Envoy
# forwards the request upstream while we still hold its body (tests/e2e/test_envoy_facts.py).
PROCESSING_MODE: Final[dict[str, str]] = {
    "request_header_mode": "SEND",
    "response_header_mode": "SKIP",
    "request_body_mode": "BUFFERED",
    "response_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SKIP",
}

# While a request waits, the sidecar overrides Envoy's message timeout with the queue timeout
# plus this margin, so its own eviction (429 + Retry-After) always comes before Envoy's 504.
# Envoy refuses overrides above the filter's max_message_timeout, which must therefore be at
# least the longest queue timeout plus this margin (tests/e2e/test_e2e.py).
MESSAGE_TIMEOUT_MARGIN_S: Final = 1.0

# Namespace of the route metadata the sidecar reads, and of the dynamic metadata it writes
# for the access log (Envoy accepts it only with metadata_options.receiving_namespaces).
METADATA_NAMESPACE: Final = "llm_extproc"

# Route metadata arrives when the filter asks for the ``xds.route_metadata`` attribute: on the
# request_headers message, under this key, as the text format of envoy.config.core.v3.Metadata
# (tests/e2e/test_ops.py).
ROUTE_ATTRIBUTE: Final = "xds.route_metadata"
ROUTE_ATTRIBUTES_KEY: Final = "envoy.filters.http.ext_proc"

# The door (extproc.request.endpoints says how it works). Envoy normalises every path before it
# routes: RFC 3986 (percent-decoded unreserved characters, dot segments), repeated slashes
# merged, an escaped slash or backslash refused with 400 (tests/e2e/test_door.py).
PATH_NORMALISATION: Final[dict[str, object]] = {
    "normalize_path": True,
    "merge_slashes": True,
    "path_with_escaped_slashes_action": "REJECT_REQUEST",
}
# Every POST path where vLLM (0.32) computes, in the order of the shipped routes, and the API
# the sidecar parses it as (extproc.request.endpoints); None: one it cannot bound, which it
# refuses (404 unsupported_endpoint). Each goes through the sidecar.
LLM_PATHS: Final[dict[str, str | None]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",  # the OpenAI Responses API
    "/v1/messages": "messages",  # Anthropic's Messages API
    "/invocations": None,  # SageMaker's entry point: the API is in the body
    "/v1/audio/transcriptions": None,  # multipart uploads, not JSON
    "/v1/audio/translations": None,
    "/v1/embeddings": "pooling",
    "/pooling": "pooling",
    "/classify": "pooling",
    "/score": "pooling",
    "/v1/score": "pooling",
    "/rerank": "pooling",
    "/v1/rerank": "pooling",
    "/v2/rerank": "pooling",
}
# The APIs a policy may admit (its ``endpoints`` key; all of them by default).
APIS: Final = ("chat", "completions", "responses", "messages", "pooling")
# What passes without the sidecar: (method, path, whether the path is a prefix). Reads that
# cost the backend next to nothing. vLLM's /metrics is not among them: a backend's internals do
# not belong on the public listener (scrape it on its own port). Any other path has no route,
# and Envoy answers 404 unknown_url.
PASS_THROUGH: Final[tuple[tuple[str, str, bool], ...]] = (
    ("GET", "/v1/models", False),
    ("GET", "/v1/models/", True),
    ("GET", "/health", False),
    ("GET", "/ping", False),
    ("GET", "/version", False),
    ("POST", "/tokenize", False),
    ("POST", "/detokenize", False),
)
