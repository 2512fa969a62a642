"""The agent's own log: level, text or JSON lines, stderr in the foreground, a rotating file if set.

- ``text``: ``2026-11-29 16:03:50,123 INFO    ckagent.agent: message`` — for people.
- ``json``: one object per line — ``time`` (ISO-8601 UTC), ``level``, ``logger``, ``message``, the
  record's structured ``fields`` as top-level keys (the canonical task line's ``task_id``,
  ``status``, ...), ``exception`` — for Loki/ELK.
- Where: the file ``logging.file`` (rotated at ``logging.max_bytes``, keeping
  ``logging.backup_count`` old files) and stderr. With a file, stderr gets the log only when it is
  a terminal (running in the foreground) or the systemd journal (``JOURNAL_STREAM`` names stderr);
  a daemon whose stderr is redirected writes each line once. When stdout/stderr are that very file
  (run.sh's daemon mode), they follow it at each rotation (:class:`FollowingRotatingFileHandler`),
  so a traceback written to stderr lands in the current file, not in a rotated one.
- One record, one line: control characters (C0, DEL, C1) and the Unicode line and paragraph
  separators in a message are escaped (``\\n``, ``\\x1b``, ``\\u2028``: :func:`escape_controls`), so a
  task id, spider name or any other text from the master or a spider cannot forge a line nor drive
  a terminal; a traceback's lines are indented under their record; a JSON line escapes them in
  its strings (decoding gives the original text back).
- Secrets given to :func:`setup_logging` are replaced by ``***`` in every line, whatever logged them
  (:class:`Masker`, which the delivery of spider logs uses too: a secret of at least
  ``MASK_ANYWHERE_CHARS`` characters is masked wherever it occurs, a shorter one only where it stands
  alone, so a token ``agent`` neither turns ``ckagent.agent`` into ``ck***.***`` nor shows where it is).
- Quiet libraries: httpx/httpcore/hypercorn access lines and stamina's retry lines stay out (see
  :func:`setup_logging`).

:func:`log_task_finished` writes the one "canonical" line per finished task.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import logging.handlers
import os
import re
import sys
import urllib.parse
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_BACKUP_COUNT = 5


_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""What can end or rewrite a line: C0 and C1 controls, DEL, the Unicode line and paragraph separators
(every character ``str.splitlines`` breaks at is among them)."""

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escape_controls(text: str) -> str:
    """``text`` with every control character and line separator written as a Python-style escape
    (``\\n``, ``\\t``, ``\\x1b``, ``\\u2028``); other text, backslashes included, is unchanged, so
    an ordinary message reads as before. The result holds no line break of any kind."""
    return _CONTROLS.sub(_escaped, text) if _CONTROLS.search(text) else text


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT` lines whose message is one line whatever it holds (:func:`escape_controls`);
    a traceback or stack follows on lines of its own, each indented by two spaces, so every line that
    starts in the first column starts a record."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The record's line with its message escaped (the record itself is left as it was)."""
        message = record.message
        record.message = escape_controls(message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message

    def formatException(self, ei: Any) -> str:
        """The traceback, control characters other than line breaks escaped, each line indented."""
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        """The stack, as :meth:`formatException`."""
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join("  " + escape_controls(line) for line in text.split("\n"))


_JSON_BREAKS = re.compile("[\x7f-\x9f\u2028\u2029]")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO-8601 UTC), level, logger, message, fields, exception text.

    No line break of any kind stays raw: json escapes C0 controls, and DEL, C1 controls and the
    Unicode separators (which ``ensure_ascii=False`` would leave raw) are written as ``\\uXXXX``."""

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
        line = json.dumps(entry, ensure_ascii=False, default=str)
        return _JSON_BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


MASK_ANYWHERE_CHARS = 8
"""A secret this long (characters) is masked wherever it occurs; a shorter one only where it stands alone."""

SHORT_TOKEN_CHARS = 16
"""A registration token shorter than this (characters) gets a warning at start."""


def _secret_regex(value: str) -> str:
    """The pattern of one secret: the text itself, or for a short one, the text standing alone.

    "Standing alone" = not preceded or followed by a letter, digit or underscore (``\\w``: Unicode
    for text patterns, ASCII for bytes patterns). Masking a short secret inside words would
    corrupt ordinary text (``0`` in every timestamp) and the stars would spell out the secret.
    The literal comes first and the character before it is checked after it matched (a lookbehind
    as wide as the secret plus one): a pattern starting with a literal is searched ~8x faster.
    """
    escaped = re.escape(value)
    return escaped if len(value) >= MASK_ANYWHERE_CHARS else rf"{escaped}(?<!\w{escaped})(?!\w)"


def secret_variants(value: str) -> list[str]:
    """``value`` and the simple transforms of it a spider could print to slip past the masking: reversed,
    base64 (standard and URL-safe, of the longest prefix of whole 3-byte groups, so ``echo $X | base64``
    is caught too), hex (lower and upper case) and URL-encoded (``%XX`` and ``+`` for spaces).

    Only for a value of at least :data:`MASK_ANYWHERE_CHARS` characters (a short one would mask
    ordinary text); variants shorter than that are left out. Masking cannot catch every transform:
    a spider that holds a secret can always encode it some other way (docs/operations.md).
    """
    if len(value) < MASK_ANYWHERE_CHARS:
        return [value]
    raw = value.encode("utf-8", "surrogatepass")
    whole = raw[: len(raw) - len(raw) % 3]
    variants = [value, value[::-1], base64.b64encode(whole).decode(), base64.urlsafe_b64encode(whole).decode(),
                raw.hex(), raw.hex().upper(), urllib.parse.quote(value, safe=""), urllib.parse.quote(value),
                urllib.parse.quote_plus(value, safe=""), urllib.parse.quote_plus(value)]
    return list(dict.fromkeys(v for v in variants if len(v) >= MASK_ANYWHERE_CHARS))


class Masker:
    """Replaces the given secret values with ``***`` (``bool(masker)``: any secret).

    Each value is masked with its simple transforms (:func:`secret_variants`: reversed, base64, hex,
    URL-encoded).

    A value of at least :data:`MASK_ANYWHERE_CHARS` characters is masked wherever it occurs; a
    shorter one only where it stands alone (not next to a letter, digit or underscore: ``token=abc``
    becomes ``token=***``, ``abcdef`` stays). Empty values are ignored. Unless ``multiline``, values
    holding a line break are ignored too: they can never be inside one line, and leaving them out
    lets callers mask many lines joined with ``\\n`` at once without changing the line count.

    Call it on text; :meth:`mask_bytes` does the same on UTF-8 bytes (the same result for valid UTF-8).
    """

    def __init__(self, secrets: Iterable[str], *, multiline: bool = False) -> None:
        # Longest first: where one secret holds another, the longer one is masked whole.
        kept = [s for s in secrets if s and (multiline or ("\n" not in s and "\r" not in s))]
        self._values = sorted({v for s in kept for v in secret_variants(s)}, key=len, reverse=True)
        self._bytes_values = [v.encode("utf-8", "surrogatepass") for v in self._values]
        self._patterns: dict[tuple[int, ...], tuple[re.Pattern[str], re.Pattern[bytes]]] = {}

    def __bool__(self) -> bool:
        return bool(self._values)

    def _pattern(self, present: tuple[int, ...]) -> tuple[re.Pattern[str], re.Pattern[bytes]]:
        """The text and bytes patterns matching the values at indexes ``present`` (compiled once)."""
        patterns = self._patterns.get(present)
        if patterns is None:
            source = "|".join(_secret_regex(self._values[i]) for i in present)
            patterns = re.compile(source), re.compile(source.encode("utf-8", "surrogatepass"))
            self._patterns[present] = patterns
        return patterns

    def __call__(self, text: str) -> str:
        """Return ``text`` with secrets masked."""
        # A substring search (`in`, fast) for each value first: almost no text holds a secret, and a
        # regex of only the values found is faster than one of all of them.
        present = tuple(i for i, v in enumerate(self._values) if v in text)
        return self._pattern(present)[0].sub("***", text) if present else text

    def mask_bytes(self, data: bytes) -> bytes:
        """Return UTF-8 ``data`` with secrets masked (invalid UTF-8 is kept as it is)."""
        present = tuple(i for i, v in enumerate(self._bytes_values) if v in data)
        if not present:
            return data
        if data.isascii():  # bytes patterns know only ASCII letters: the same as text for ASCII data
            return self._pattern(present)[1].sub(b"***", data)
        # A non-ASCII letter may stand next to a short secret: only the text pattern knows it is one.
        return self(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


class RedactingFormatter(logging.Formatter):
    """Wraps a formatter and masks each secret value (see :class:`Masker`) in the formatted line."""

    def __init__(self, inner: logging.Formatter, secrets: Iterable[str]) -> None:
        super().__init__()
        self._inner = inner
        self._mask = Masker(secrets, multiline=True)

    def format(self, record: logging.LogRecord) -> str:
        """The inner formatter's line, secrets masked."""
        return self._mask(self._inner.format(record))


class FollowingRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A RotatingFileHandler that, after each rotation, points the file descriptors ``follow_fds``
    (1 and 2 when they were the log file) at the new file (``os.dup2``).

    Without it, stderr of a daemon started as ``agent >>agent.log 2>&1`` would keep writing into
    ``agent.log.1`` after the first rotation. Raises OSError as RotatingFileHandler does.
    """

    def __init__(self, filename: Path, *, max_bytes: int, backup_count: int, follow_fds: tuple[int, ...]) -> None:
        super().__init__(filename, maxBytes=max_bytes, backupCount=backup_count, encoding="utf-8")
        self.follow_fds = follow_fds

    def _open(self) -> Any:
        """Open the log file (as RotatingFileHandler) and make it this user's alone (0600) when it is
        this user's: it names every task and spider of the node, and no spider is to read it."""
        stream = super()._open()
        with contextlib.suppress(OSError):
            st = os.fstat(stream.fileno())
            if st.st_uid == os.geteuid() and st.st_mode & 0o077:
                os.fchmod(stream.fileno(), st.st_mode & 0o600)
        return stream

    def doRollover(self) -> None:
        """Rotate (as RotatingFileHandler), then re-point ``follow_fds`` at the new file."""
        for fd in self.follow_fds:  # what the fds buffered belongs to the old file
            with contextlib.suppress(OSError, ValueError):
                (sys.stdout if fd == 1 else sys.stderr).flush()
        super().doRollover()
        if self.stream is not None:
            for fd in self.follow_fds:
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(self.stream.fileno(), fd)


def _same_file_fds(file: Path) -> tuple[int, ...]:
    """Which of the fds 1 and 2 are open on ``file`` (same device and inode)."""
    try:
        target = os.stat(file)
    except OSError:
        return ()
    fds = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            fds.append(fd)
    return tuple(fds)


def stderr_is_journal(environ: Mapping[str, str] | None = None) -> bool:
    """Whether stderr is connected to the systemd journal (``JOURNAL_STREAM`` = "device:inode" of it)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    try:
        st = os.fstat(2)
        return bool(device) and (st.st_dev, st.st_ino) == (int(device), int(inode))
    except (OSError, ValueError):
        return False


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
    value in ``secrets`` (the agent's registration token and API key) is masked in every line (see
    :class:`Masker`); when one is shorter than :data:`SHORT_TOKEN_CHARS`, one WARNING advises a long
    random token. Raises OSError if the file cannot be opened.
    """
    secrets = [s for s in secrets if s]
    inner: logging.Formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    formatter = RedactingFormatter(inner, secrets)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    if stderr is None:
        stderr = file is None or _isatty(sys.stderr) or stderr_is_journal()
    handlers: list[logging.Handler] = []
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = FollowingRotatingFileHandler(file, max_bytes=max_bytes, backup_count=backup_count,
                                                    follow_fds=())
        file_handler.follow_fds = _same_file_fds(file)
        if 2 in file_handler.follow_fds:
            stderr = False  # stderr is the file: each line once
        handlers.append(file_handler)
    if stderr:
        handlers.insert(0, logging.StreamHandler(sys.stderr))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "hypercorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # stamina logs a WARNING "stamina.retry_scheduled" (no reason, no wait) before every retry, forever
    # while the master is unreachable; master.Connectivity already logs one line per change of state.
    logging.getLogger("stamina").setLevel(logging.ERROR)
    if any(len(s) < SHORT_TOKEN_CHARS for s in secrets):
        # Neither the value nor its length: either would help a guesser.
        logging.getLogger(__name__).warning(
            "the registration token (or API key) is short, under %d characters: it is easy to guess, and "
            "log lines mask it only where it stands alone; a long random one is advised, e.g. "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'", SHORT_TOKEN_CHARS)


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
