"""The agent's own log: level, text or JSON lines, stderr in the foreground, a rotating file if set.

- ``text``: ``2026-11-29 16:03:50,123 INFO    ckagent.agent: message`` — for people.
- ``json``: one object per line — ``time`` (ISO-8601 UTC), ``level``, ``logger``, ``message``, the
  record's structured ``fields`` as top-level keys (the canonical task line's ``task_id``,
  ``status``, ...), ``exception`` — for Loki/ELK.
- Where: the file ``logging.file`` (rotated at ``logging.max_bytes``, keeping
  ``logging.backup_count`` old files) and stderr. With a file, stderr gets the log only when it is
  a terminal (running in the foreground); a daemon whose stderr is redirected writes each line once.
- Secrets given to :func:`setup_logging` are replaced by ``***`` in every line, whatever logged them.

:func:`log_task_finished` writes the one "canonical" line per finished task.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_BACKUP_COUNT = 5


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO-8601 UTC), level, logger, message, fields, exception text."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as one JSON line (never containing a raw newline)."""
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            for key, value in fields.items():
                entry.setdefault(str(key), value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class RedactingFormatter(logging.Formatter):
    """Wraps a formatter and replaces each secret value by ``***`` in the formatted line."""

    def __init__(self, inner: logging.Formatter, secrets: Iterable[str]) -> None:
        super().__init__()
        self._inner = inner
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        """The inner formatter's line, secrets masked."""
        text = self._inner.format(record)
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text


def setup_logging(
    level: str,
    file: Path | None,
    fmt: str = "text",
    *,
    stderr: bool | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    backup_count: int = DEFAULT_BACKUP_COUNT,
    secrets: Iterable[str] = (),
) -> None:
    """Configure the root logger (replacing earlier handlers).

    ``fmt`` is "text" or "json". ``stderr`` None = automatic: stderr when there is no ``file`` or
    stderr is a terminal. ``max_bytes`` (> 0) and ``backup_count`` (>= 0) rotate ``file``. Every
    value in ``secrets`` is masked in every line. Raises OSError if the file cannot be opened.
    """
    inner: logging.Formatter = JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)
    formatter = RedactingFormatter(inner, secrets)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    if stderr is None:
        stderr = file is None or _isatty(sys.stderr)
    handlers: list[logging.Handler] = []
    if stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.handlers.RotatingFileHandler(file, maxBytes=max_bytes,
                                                             backupCount=backup_count, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "hypercorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


CANONICAL_MESSAGE = "task finished"


def log_task_finished(logger: logging.Logger, fields: Mapping[str, Any]) -> None:
    """Log the canonical line of a finished task at INFO.

    ``fields`` (in order): task_id, spider, status, error_code, exit_code, duration_seconds, items,
    log_lines, install_seconds, cache_hit — None for what is unknown. Text format renders
    ``task finished task_id=… spider=… …`` (values with spaces or quotes are JSON-quoted, None is
    ``-``); JSON format carries each field as a top-level key.
    """
    text = " ".join(f"{key}={_logfmt(value)}" for key, value in fields.items())
    logger.info("%s %s", CANONICAL_MESSAGE, text, extra={"fields": {"event": "task_finished", **fields}})


def _logfmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    if not text or any(c in text for c in ' "=\\') or not text.isprintable():
        return json.dumps(text, ensure_ascii=False)
    return text
