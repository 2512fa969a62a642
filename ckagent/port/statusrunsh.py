"""What run.sh recorded about this installation, for /status and the status page: the last upgrade,
rollback or restart (``$STATE_DIR/last-change.json``) and the versions that failed their health check
here (``$STATE_DIR/failed_versions``, one version a line).

run.sh exports its state dir to the agent as ``CK_RUNSH_STATE_DIR`` (:data:`STATE_DIR_ENV`); a run.sh
that exports only its own path (``CKAGENT_RUN_SH``, :data:`RUN_SH_ENV`) has it at ``.ckagent`` beside
itself. An agent started otherwise has neither, and both facts are unknown. The files are read as hostile input: missing,
a directory, a FIFO, a symlink, larger than :data:`MAX_RECORD_BYTES`, not UTF-8, not JSON, a JSON of
the wrong shape or with fields of the wrong type — each becomes "unknown" with the reason in one line
(a field of the wrong type alone: that field is None), never an exception. Texts are cut to
:data:`MAX_TEXT_CHARS` and control characters replaced; escaping for HTML is the page's.

``last-change.json`` (written by run.sh)::

    {"action": "upgrade"|"rollback"|"restart", "from": "0.1.0", "to": "0.2.0",
     "outcome": "healthy"|"rolled-back"|"refused"|…, "at": <epoch seconds>, "reason": "…"}
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_DIR_ENV = "CK_RUNSH_STATE_DIR"
"""The environment variable through which run.sh tells the agent its state dir (``<dir of run.sh>/.ckagent``)."""
RUN_SH_ENV = "CKAGENT_RUN_SH"
"""The path of the run.sh that started the agent (exported by run.sh); its state dir is ``.ckagent`` beside it."""
LAST_CHANGE_FILE = "last-change.json"
FAILED_VERSIONS_FILE = "failed_versions"
MAX_RECORD_BYTES = 64 * 1024
"""Largest file read (bytes); a larger one is unknown ("larger than 64 KiB")."""
MAX_TEXT_CHARS = 300
"""Longest text kept of one field (a reason, a version); longer ones are cut with "…"."""
MAX_FAILED_SHOWN = 20
"""Failed versions listed (the newest: the last lines); ``failedVersionsCount`` counts them all."""
LATEST_EPOCH = 2**36
"""Later ``at`` values (epoch seconds, year ~4147) are not a time: unknown."""


@dataclass(frozen=True)
class RunshState:
    """What run.sh recorded (see module docstring). ``last_change``: the record's fields (JSON keys of
    the file; a field missing or of the wrong type is None; ``at`` epoch seconds), None when unknown —
    ``last_change_unknown`` says why. ``failed_versions``: the newest MAX_FAILED_SHOWN (file order),
    None when unknown (``failed_unknown`` says why); an absent file under a known state dir is ``()``:
    none failed. ``failed_count``: every version listed."""

    state_dir: str | None
    last_change: tuple[tuple[str, Any], ...] | None
    last_change_unknown: str | None
    failed_versions: tuple[str, ...] | None
    failed_count: int
    failed_unknown: str | None

    def to_json(self) -> dict[str, Any]:
        """The /status fields (``at`` still epoch seconds: the caller formats times)."""
        return {
            "stateDir": self.state_dir,
            "lastChange": dict(self.last_change) if self.last_change is not None else None,
            "lastChangeUnknown": self.last_change_unknown,
            "failedVersions": list(self.failed_versions) if self.failed_versions is not None else None,
            "failedVersionsCount": self.failed_count,
            "failedVersionsUnknown": self.failed_unknown,
        }


def state_dir_from(environ: Mapping[str, str]) -> Path | None:
    """run.sh's state dir from ``environ``: :data:`STATE_DIR_ENV`, else ``.ckagent`` beside
    :data:`RUN_SH_ENV`; None when neither is set to an absolute path."""
    value = environ.get(STATE_DIR_ENV, "")
    if value and os.path.isabs(value) and "\0" not in value:
        return Path(value)
    run_sh = environ.get(RUN_SH_ENV, "")
    return Path(run_sh).parent / ".ckagent" if run_sh and os.path.isabs(run_sh) and "\0" not in run_sh else None


class _Unknown(Exception):
    """A record that cannot be read; the message says why in a few words."""


def _read(path: Path) -> bytes | None:
    """A regular file's bytes (at most MAX_RECORD_BYTES), None when it does not exist. Never follows a
    symlink, never blocks on a FIFO. Raises _Unknown."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Unknown("a symlink, not read") from None
        raise _Unknown(f"cannot be read ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Unknown("not a regular file")
        if info.st_size > MAX_RECORD_BYTES:
            raise _Unknown(f"larger than {MAX_RECORD_BYTES // 1024} KiB")
        data = os.read(fd, MAX_RECORD_BYTES + 1)
        if len(data) > MAX_RECORD_BYTES:  # (grew since the fstat)
            raise _Unknown(f"larger than {MAX_RECORD_BYTES // 1024} KiB")
        return data
    except OSError as exc:
        raise _Unknown(f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def clean_text(value: str) -> str:
    """``value`` with control characters (C0, DEL, C1; line breaks too) replaced by ``?`` and cut to
    MAX_TEXT_CHARS (``…`` at the end when cut): one line, whatever the file said."""
    text = "".join("?" if (ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029") else c
                   for c in value[: MAX_TEXT_CHARS + 1])
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "…"


def _text_field(record: dict[Any, Any], key: str) -> str | None:
    value = record.get(key)
    return clean_text(value) if isinstance(value, str) and value else None


def _epoch_field(record: dict[Any, Any], key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and 0 < number < LATEST_EPOCH else None


def _last_change(data: bytes) -> tuple[tuple[str, Any], ...]:
    try:
        record = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise _Unknown("not UTF-8") from None
    except (ValueError, RecursionError):
        raise _Unknown("not JSON") from None
    if not isinstance(record, dict):
        raise _Unknown(f"not a JSON object (a {type(record).__name__})")
    fields = (("action", _text_field(record, "action")), ("from", _text_field(record, "from")),
              ("to", _text_field(record, "to")), ("outcome", _text_field(record, "outcome")),
              ("at", _epoch_field(record, "at")), ("reason", _text_field(record, "reason")))
    if all(value is None for _, value in fields):
        raise _Unknown("none of action, from, to, outcome, at, reason")
    return fields


def _failed(data: bytes) -> tuple[tuple[str, ...], int]:
    text = data.decode("utf-8", errors="replace")
    versions = [clean_text(line.strip()) for line in text.splitlines() if line.strip()]
    return tuple(versions[-MAX_FAILED_SHOWN:]), len(versions)


def read_runsh_state(state_dir: Path | None) -> RunshState:
    """Read both records under ``state_dir`` (None: not started by run.sh). Blocking (two small reads:
    call it in a thread); never raises."""
    if state_dir is None:
        why = f"not started by run.sh ({STATE_DIR_ENV} and {RUN_SH_ENV} not set)"
        return RunshState(None, None, why, None, 0, why)
    shown = clean_text(str(state_dir))
    last: tuple[tuple[str, Any], ...] | None = None
    last_unknown: str | None = None
    try:
        data = _read(state_dir / LAST_CHANGE_FILE)
        if data is None:
            last_unknown = "none recorded"
        else:
            last = _last_change(data)
    except _Unknown as exc:
        last_unknown = f"{LAST_CHANGE_FILE}: {exc}"
    failed: tuple[str, ...] | None = None
    count, failed_unknown = 0, None
    try:
        data = _read(state_dir / FAILED_VERSIONS_FILE)
        failed, count = ((), 0) if data is None else _failed(data)
    except _Unknown as exc:
        failed_unknown = f"{FAILED_VERSIONS_FILE}: {exc}"
    return RunshState(shown, last, last_unknown, failed, count, failed_unknown)
