"""Ids from the master are data: what the agent accepts, and the one way each becomes a name or a URL.

The protocol's ids (task id, spider id, node id, code version, spider name) are opaque strings chosen by
the master. A hostile or broken master may send ``/abs/path``, ``../x``, ``%2e%2e%2f``, ``.``, control
characters or NUL. Three rules keep them data:

- **Accepted** (:func:`check_id`, at the protocol's edge): any non-empty string of at most
  :data:`MAX_ID_CHARS` characters without NUL that is valid Unicode (no lone surrogates: it must encode
  as UTF-8). Anything else fails that one task with BAD_TASK (docs/protocol.md, "Ids").
- **On the file system and in cgroups** (:func:`safe_name`): a bounded, collision-free name — the id
  itself when it is an ordinary name, otherwise a readable sanitized prefix plus a hash of the raw id.
- **In a URL** (:func:`api_path`): percent-encoded as exactly one path segment (``/``, ``%``, ``?``,
  ``#``, control characters, and the dot segments ``.``/``..`` included), never URL text.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.parse import quote

__all__ = ["MAX_ID_CHARS", "MAX_NAME_CHARS", "IdError", "api_path", "check_id", "safe_name", "shown_id", "task_dir", "url_path", "url_segment"]

MAX_ID_CHARS = 512
"""Longest id (characters) the agent carries; a longer one fails its task with BAD_TASK."""

MAX_NAME_CHARS = 100
"""Longest name :func:`safe_name` returns (well under a file system's 255-byte component limit)."""

_PLAIN = re.compile(r"[A-Za-z0-9._-]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_HASH_CHARS = 10
_HASHED = re.compile(r"_[A-Za-z0-9._-]{0,80}-[0-9a-f]{10}")


class IdError(ValueError):
    """An id the agent cannot carry; ``str()`` says what is wrong with it (never the whole id)."""


def check_id(value: str) -> str:
    """Return ``value`` when the agent can carry it as an id; raise IdError saying why not.

    Refused: the empty string, a string with NUL, one longer than MAX_ID_CHARS characters, one that is
    not valid Unicode (lone surrogates from ``\\ud800`` escapes). Everything else is accepted, control
    characters and path syntax included: such ids are mapped by :func:`safe_name` and :func:`api_path`.
    """
    if not value:
        raise IdError("must not be empty")
    if "\x00" in value:
        raise IdError("must not contain NUL (\\u0000)")
    if len(value) > MAX_ID_CHARS:
        raise IdError(f"is {len(value)} characters long; at most {MAX_ID_CHARS} are accepted")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise IdError(f"is not valid Unicode text ({exc.reason} at character {exc.start})") from None
    return value


def safe_name(text: str) -> str:
    """A file or cgroup name standing for ``text``: at most MAX_NAME_CHARS characters of
    ``[A-Za-z0-9._-]``, never empty, ``.``/``..`` or hidden, and two different ids never share one.

    An ordinary id (those characters only, not starting with ``.``, short enough) is its own name;
    any other gets ``_<sanitized prefix>-<10 hex of sha256(id)>``. An ordinary id that has that very
    shape is treated as any other, so an id can never take the name of another one's hash form. (The
    names are those of earlier versions, so a restarted agent finds the directories it made before.)
    """
    if len(text) <= MAX_NAME_CHARS and _PLAIN.fullmatch(text) and not text.startswith(".") \
            and not _HASHED.fullmatch(text):
        return text
    prefix = _UNSAFE.sub("_", text)[:MAX_NAME_CHARS].lstrip(".")[:80]
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    return f"_{prefix}-{digest}"


def shown_id(value: str, max_chars: int = 80) -> str:
    """``value`` for a log line: as it is when it is printable and short, else its ``repr`` cut to
    ``max_chars`` (a control character or a 5,000-character id never makes a log line of its own)."""
    if value.isprintable() and len(value) <= max_chars:
        return value
    text = repr(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def task_dir(work_dir: Path, task_id: str) -> Path:
    """The directory of a task's own files: ``work_dir/tasks/<safe_name(task_id)>`` (never elsewhere)."""
    return work_dir / "tasks" / safe_name(task_id)


def url_segment(value: str) -> str:
    """``value`` percent-encoded as one URL path segment: every byte but ``A-Za-z0-9_.-~`` is escaped,
    and the dot segments ``.`` and ``..`` (which a URL parser would resolve away) become ``%2E``."""
    if value in (".", ".."):
        return "%2E" * len(value)
    return quote(value, safe="")


def url_path(value: str) -> str:
    """A relative path (``a/b c.txt``) as URL path segments, each quoted by :func:`url_segment`."""
    return "/".join(url_segment(part) for part in value.split("/"))


def api_path(template: str, **ids: str) -> str:
    """A master path with ids put in as single path segments: ``api_path("/api/tasks/{task}/result",
    task=task_id)``. ``{node}`` may stay in the template (the master client fills it in the same way).
    Raises KeyError when the template lacks a placeholder it is given."""
    path = template
    for name, value in ids.items():
        slot = "{" + name + "}"
        if slot not in path:
            raise KeyError(f"{template!r} has no {slot}")
        path = path.replace(slot, url_segment(value))
    return path
