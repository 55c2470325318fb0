"""Envoy's own answers get stable error codes: the HCM ``local_reply_config``.

When Envoy answers by itself (the sidecar down or silent, the backend down or slow, a body over
the buffer limit, a client too slow), its reply has an empty or plain-text body and a
"response code detail" that is Envoy's internal wording. ``local_reply_config`` turns each into
the same OpenAI-style JSON error the sidecar sends, with a fixed ``code`` from the table below;
the detail itself goes to the access log only. The sidecar's own refusals are local replies
too (ImmediateResponse), already JSON, and no mapper touches them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ENVOY_ANSWER_CODES", "EnvoyAnswer", "local_reply_config"]

CEL_FILTER_TYPE = (
    "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvoyAnswer:
    """One of Envoy's own answers: the stable ``error.code`` and OpenAI error type it gets, the
    CEL condition on the response that picks it, the message (``{buffer}``: the body limit)."""

    code: str
    error_type: str
    condition: str
    message: str


# The stable error codes of Envoy's own answers, first match wins. The conditions read Envoy
# 1.40's response code details (docs/envoy.md, "When something fails", names the test pinning
# each): a gRPC failure of the ext_proc stream is ``ext_proc_error_gRPC_error_<status>{...}``
# (sidecar down, refused, or its circuit breakers full), a message timeout
# ``ext_proc_error_per-message_timeout_exceeded``, a backend failure
# ``upstream_reset_before_response_started{...}`` (refused, reset, or its circuit breakers full)
# or ``no_healthy_upstream``, the route timeout ``response_timeout`` (a retry's
# ``upstream_per_try_timeout``, not pinned: no shipped route retries); the buffer limit
# ``request_payload_too_large``; the request and header timeouts ``request_overall_timeout`` and
# ``request_header_timeout``; no route for the path ``route_not_found`` (the door's default deny,
# ``extproc.request.endpoints``); a path with an escaped slash ``path_normalization_failed``.
ENVOY_ANSWER_CODES: tuple[EnvoyAnswer, ...] = (
    EnvoyAnswer(
        code="sidecar_timeout",
        error_type="server_error",
        condition=(
            "response.code == 504 && response.code_details.startsWith('ext_proc_error_per-message')"
        ),
        message="The admission service did not answer in time.",
    ),
    EnvoyAnswer(
        code="sidecar_unavailable",
        error_type="server_error",
        condition="response.code == 500 && response.code_details.startsWith('ext_proc_error_gRPC')",
        message="The admission service is unavailable.",
    ),
    EnvoyAnswer(
        code="backend_unavailable",
        error_type="server_error",
        condition=(
            "response.code == 503 && (response.code_details.startsWith('upstream_')"
            " || response.code_details == 'no_healthy_upstream')"
        ),
        message="The model server is unavailable.",
    ),
    EnvoyAnswer(
        code="backend_timeout",
        error_type="server_error",
        condition=(
            "response.code == 504 && (response.code_details == 'response_timeout'"
            " || response.code_details.startsWith('upstream_'))"
        ),
        message="The model server did not answer in time.",
    ),
    EnvoyAnswer(
        code="body_too_large",
        error_type="invalid_request_error",
        condition="response.code == 413",
        message="The request body is larger than the gateway accepts ({buffer} bytes).",
    ),
    EnvoyAnswer(
        code="request_timeout",
        error_type="invalid_request_error",
        condition="response.code == 408",
        message="The request was not received in time.",
    ),
    EnvoyAnswer(
        code="unknown_url",
        error_type="invalid_request_error",
        condition=(
            "response.code == 404 && (response.code_details == 'direct_response'"
            " || response.code_details == 'route_not_found')"
        ),
        message="No such endpoint on this gateway: %REQ(:METHOD)% %REQ(:PATH):200%.",
    ),
    EnvoyAnswer(
        code="invalid_path",
        error_type="invalid_request_error",
        condition="response.code == 400 && response.code_details == 'path_normalization_failed'",
        message="The request path is not valid here (an escaped slash or backslash, or a path "
        "that cannot be normalised).",
    ),
    EnvoyAnswer(
        code="gateway_error",
        error_type="invalid_request_error",
        condition="response.code >= 400 && response.code < 500",
        message="The gateway refused the request (%RESPONSE_CODE%).",
    ),
    EnvoyAnswer(
        code="gateway_error",
        error_type="server_error",
        condition="response.code >= 500",
        message="The gateway could not complete the request (%RESPONSE_CODE%).",
    ),
)
# Envoy's own 1xx-3xx local replies (a direct_response 200, a redirect) match no entry and keep
# their body: on Istio these mappers merge into every route of the gateway.
# The sidecar's own answers (ImmediateResponse details ``llm_extproc_<code>``) are local
# replies too, already JSON: no mapper may touch them.
_NOT_THE_SIDECARS = "!response.code_details.startsWith('llm_extproc_')"


def local_reply_config(buffer: int) -> dict[str, Any]:
    """The HCM's ``local_reply_config``: one mapper per entry of ``ENVOY_ANSWER_CODES``;
    ``buffer`` is the body limit the 413 message names."""
    mappers = []
    for answer in ENVOY_ANSWER_CODES:
        expression = f"{_NOT_THE_SIDECARS} && {answer.condition}"
        mappers.append(
            {
                "filter": {
                    "extension_filter": {
                        "name": "envoy.access_loggers.extension_filters.cel",
                        "typed_config": {
                            "@type": CEL_FILTER_TYPE,
                            "expression": expression,
                        },
                    }
                },
                "body_format_override": {
                    "json_format": {
                        "error": {
                            "message": answer.message.format(buffer=buffer),
                            "type": answer.error_type,
                            "param": None,
                            "code": answer.code,
                        }
                    }
                },
            }
        )
    return {"mappers": mappers}
