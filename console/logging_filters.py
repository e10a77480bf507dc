"""Logging filters the settings' LOGGING wires in (no Django imports: read at configure time)."""

from __future__ import annotations

import logging

from console import tracing
from console.requestctx import current_request_id, log_fields


class BelowLevelFromLoggers(logging.Filter):
    """Drops records below `level` from the named loggers (and their children).

    RQ logs four INFO lines for every job it runs, and the cron process enqueues the
    reconciler every 5 s and housekeeping every 30 s: about 140 lines a minute on an idle
    `make run`, in which the URL and login scroll away. Those lines say only that routine
    work ran; what the engine did is logged by `airlock.*` loggers, and RQ's warnings and
    errors (a failed job, a lost worker) still pass.
    """

    def __init__(self, prefixes: str = "", level: str = "WARNING") -> None:
        super().__init__()
        self.prefixes = tuple(p.strip() for p in prefixes.split(",") if p.strip())
        self.level = logging.getLevelName(level.upper())
        if not isinstance(self.level, int):
            raise ValueError(f"unknown log level {level!r}")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            return True
        name = record.name
        return not any(name == p or name.startswith(p + ".") for p in self.prefixes)


class LogContext(logging.Filter):
    """Adds the current request id and the request's or job's fields (principal, run,
    action, resource, fence, job; with tracing on, the trace and span ids) to every
    record, for the JSON lines and for `%(...)s`."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = {"request_id": current_request_id(), **log_fields()}
        # Django logs a 4xx/5xx answer (django.request) after the middlewares have
        # returned, outside the request's context: read it from the request it names.
        request = getattr(record, "request", None)
        if request is not None:
            fields["request_id"] = fields["request_id"] or getattr(request, "request_id", "")
            principal = getattr(request, "principal", None)
            if principal is not None and "principal" not in fields:
                fields["principal"] = f"{principal.kind}:{principal.label}"
        ids = tracing.current_ids()  # None unless tracing is on and a span is current
        if ids is not None:
            fields["trace_id"], fields["span_id"] = ids
        for key, value in fields.items():
            if value and not hasattr(record, key):
                setattr(record, key, value)
        return True
