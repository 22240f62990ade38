"""Logging, set up the same way in every process: `specmesh` and each service.

One line per record on stderr, as text (`time service LEVEL logger: message`, then the
record's ids as `request_id=... trace_id=...`) or, with `--log-format json`, as one JSON
object (time, level, service, logger, message and the ids and HTTP fields it carries), which
log collectors parse without a pattern. A record logged inside a trace span carries that
span's trace id, so a line leads to its trace (when tracing is on, see shared/telemetry.py).
`specmesh up` hands its settings to the services it starts through their environment.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from datetime import UTC, datetime

from opentelemetry import trace
from specmesh.shared.config import env_name, option

# What a record may carry besides its message (`extra=`): its ids, which text lines end with,
# and an access line's HTTP fields, which its message already says (JSON has them all).
IDS = ("request_id", "trace_id")
FIELDS = (*IDS, "method", "path", "status", "duration_ms")


@dataclass(frozen=True)
class LogConfig:
    """Options of every process (`--log-level` is also SGLang's flag)."""

    log_level: str = option(
        "info", "for every process", choices=("debug", "info", "warning", "error", "critical")
    )
    log_format: str = option(
        "text", "for every process (json: one object per line)", choices=("text", "json")
    )

    def environ(self) -> dict[str, str]:
        """The variables that give processes started from here these settings."""
        return {env_name(f.name): getattr(self, f.name) for f in fields(self)}


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        service = service.replace("%", "%%")  # it becomes part of a %-style format
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The line before any traceback, its ids at the end."""
        ids = [f"{key}={value}" for key in IDS if (value := getattr(record, key, None))]
        return " ".join([super().formatMessage(record), *ids])


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry |= {key: value for key in FIELDS if (value := getattr(record, key, None)) is not None}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATTERS: dict[str, type[logging.Formatter]] = {"text": TextFormatter, "json": JsonFormatter}


class TraceIds(logging.Filter):
    """Gives a record logged inside a recording span that span's trace id."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid and getattr(record, "trace_id", None) is None:
            record.trace_id = trace.format_trace_id(context.trace_id)
        return True


def configure_logging(service: str, level: str, fmt: str) -> None:
    """Every record of this process to stderr as `fmt` ("text" or "json") says, from `level`
    up; `service` names the process on each line."""
    if level.upper() not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS).lower()}, not {level!r}")
    if fmt not in FORMATTERS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATTERS)}, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(FORMATTERS[fmt](service))
    handler.addFilter(TraceIds())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
