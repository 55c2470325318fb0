"""What one admitted-path request went through, gathered along its stream.

The servicer fills a ``RequestRecord`` as the stream advances; ``decide`` is the one place a
request's ``Outcome`` is assigned (when the sidecar answers or admits, or, for a client that
left first, when the stream ends). The record goes once to ``Metrics.finish`` and
``log_finished`` when the stream ends: the only place a request is counted or logged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from extproc.outcome import Outcome

if TYPE_CHECKING:
    from extproc.request.classify import Classification

__all__ = ["NO_BUCKET", "RequestRecord"]

# Bucket label of requests refused before a bucket was chosen (bad input, prompt too long).
NO_BUCKET = "none"


class RequestRecord:
    __slots__ = (
        "anthropic",
        "arrived_at",
        "bucket",
        "code",
        "decided_at",
        "ended_at",
        "max_tokens",
        "max_tokens_action",
        "outcome",
        "prompt_tokens",
        "relegated_to",
        "request_id",
        "shadow_outcome",
        "stream",
    )

    def __init__(self, request_id: str = "", *, anthropic: bool = False) -> None:
        self.request_id = request_id
        # Its API is Anthropic's Messages: refusals take Anthropic's error shape.
        self.anthropic = anthropic
        self.bucket = NO_BUCKET
        # Set when the sidecar answered (or decided to admit); None until then.
        self.outcome: Outcome | None = None
        # In shadow mode: what enforcement would have done, when that differs from admitting.
        self.shadow_outcome: Outcome | None = None
        self.code: str | None = None  # error code of a refusal
        self.arrived_at: float | None = None  # body received
        self.decided_at: float | None = None  # admitted, refused, or found gone
        self.ended_at: float | None = None  # stream ended
        self.prompt_tokens: int | None = None
        self.max_tokens: int | None = None
        self.max_tokens_action: str | None = None
        self.stream = False
        self.relegated_to: str | None = None  # the bucket it was relegated to, if it was

    def classified(self, cls: Classification) -> None:
        """What classification found: the bucket and the token counts."""
        self.bucket = cls.bucket.name
        self.prompt_tokens = cls.prompt_tokens
        self.max_tokens = cls.max_tokens
        self.max_tokens_action = str(cls.max_tokens_action)

    def relegated(self, source: str | None, target: str) -> None:
        """Where the ticket that decided was: relegated from ``source`` to ``target``, or not
        relegated (``source`` None)."""
        if source is not None:
            self.relegated_to = target

    def decide(self, outcome: Outcome, now: float, code: str | None = None) -> None:
        """The request's outcome, decided at ``now``; a request is decided once."""
        if self.outcome is not None:
            raise RuntimeError(f"request already decided: {self.outcome}, then {outcome}")
        self.outcome = outcome
        self.decided_at = now
        if code is not None:
            self.code = code

    @property
    def queue_s(self) -> float:
        if self.arrived_at is None:
            return 0.0
        end = self.decided_at if self.decided_at is not None else self.ended_at
        return max(0.0, (end or self.arrived_at) - self.arrived_at)

    @property
    def hold_s(self) -> float | None:
        if self.outcome is not Outcome.ADMITTED or self.decided_at is None:
            return None
        return max(0.0, (self.ended_at or self.decided_at) - self.decided_at)

    def as_log(self) -> dict[str, object]:
        """The request as a log line: bounded fields only, never prompt text."""
        out: dict[str, object] = {
            "request_id": self.request_id,
            "bucket": self.bucket,
            "outcome": str(self.outcome),
            "queue_ms": round(self.queue_s * 1000, 1),
        }
        for key in ("code", "prompt_tokens", "max_tokens", "max_tokens_action", "relegated_to"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.shadow_outcome is not None:
            out["shadow_outcome"] = str(self.shadow_outcome)
        hold = self.hold_s
        if hold is not None:
            out["hold_ms"] = round(hold * 1000, 1)
        return out
