"""Structured logs: one JSON object per line.

Finished requests go to the ``extproc.requests`` logger at their outcome's level
(``extproc.outcome.OUTCOMES``: refusals and evictions at INFO, the rest at DEBUG; any request
with a shadow outcome at INFO). Fields are bounded (bucket, outcome, code, token counts, timings,
Envoy's x-request-id); prompt text is never logged.
"""

from __future__ import annotations

import json
import logging
import time

from extproc.outcome import OUTCOMES
from extproc.record import RequestRecord

__all__ = ["JsonFormatter", "configure", "log_finished"]

requests_log = logging.getLogger("extproc.requests")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


def configure(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_finished(rec: RequestRecord) -> None:
    assert rec.outcome is not None
    level = logging.INFO if rec.shadow_outcome else OUTCOMES[rec.outcome].log_level
    if requests_log.isEnabledFor(level):
        requests_log.log(level, "request finished", extra={"fields": rec.as_log()})
