"""The agent's own log: level, text or JSON lines, stderr in the foreground, a rotating file if set."""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
from datetime import datetime, timezone
from pathlib import Path

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO-8601 UTC), level, logger, message, and exception text."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as one JSON line."""
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(
    level: str,
    file: Path | None,
    fmt: str = "text",
    *,
    stderr: bool = True,
    max_bytes: int = 10 * 1024 * 1024,
    backup_count: int = 5,
) -> None:
    """Configure the root logger (replacing earlier handlers). Raises OSError if the file cannot be opened."""
    formatter: logging.Formatter = JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
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
