"""The OpenAI Python SDK's retry policy, pure: whether to retry, and how long to wait."""

from __future__ import annotations

import time
from collections.abc import Mapping
from email.utils import mktime_tz, parsedate_tz
from typing import Final

INITIAL_RETRY_DELAY_S: Final = 0.5
MAX_RETRY_DELAY_S: Final = 8.0


def should_retry(status: int | None, headers: Mapping[str, str] | None = None) -> bool:
    """Whether the SDK would retry: ``x-should-retry`` wins; else 408/409/429/5xx, and
    connection errors or timeouts (``status=None``)."""
    if headers is not None:
        hint = headers.get("x-should-retry")
        if hint == "true":
            return True
        if hint == "false":
            return False
    if status is None:
        return True
    return status in (408, 409, 429) or status >= 500


def retry_after_s(
    headers: Mapping[str, str] | None, *, now_epoch_s: float | None = None
) -> float | None:
    """Server-requested delay: ``retry-after-ms``, else ``retry-after`` (seconds or HTTP date)."""
    if not headers:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    parsed = parsedate_tz(value)
    if parsed is None:
        return None
    if now_epoch_s is None:
        now_epoch_s = time.time()
    return float(mktime_tz(parsed) - now_epoch_s)


def retry_delay_s(
    retries_taken: int, headers: Mapping[str, str] | None = None, *, rand: float = 0.0
) -> float:
    """Delay before retry number ``retries_taken + 1``, as the SDK computes it.

    A ``retry-after(-ms)`` value in (0, 60] s is obeyed exactly; otherwise
    ``min(0.5 * 2**retries_taken, 8) * (1 - 0.25 * rand)`` with ``rand`` uniform in [0, 1).
    """
    hinted = retry_after_s(headers)
    if hinted is not None and 0 < hinted <= 60:
        return hinted
    base = min(INITIAL_RETRY_DELAY_S * 2.0 ** min(retries_taken, 1000), MAX_RETRY_DELAY_S)
    return max(0.0, base * (1 - 0.25 * rand))
