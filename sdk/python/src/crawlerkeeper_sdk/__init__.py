"""crawlerkeeper_sdk — what spider code imports to talk to the CrawlerKeeper agent that runs it.

The agent starts a spider as a plain process and tells it where things are through environment
variables. The whole contract is small:

``CK_ITEMS_FILE``
    Path of the task's items file. Each line is one JSON object (one scraped item). The agent
    tails this file and ships the items to the master. :func:`save_item` appends to it.
``CK_TASK_ID``, ``CK_SPIDER_ID``, ``CK_SPIDER_NAME``
    Identity of the running task and its spider.
``CK_PARAMS``
    The task's parameters as a JSON object (for example ``{"start_url": "..."}``).
``CK_TASK_DIR``
    The task's own directory (the agent keeps its logs and items there).
``CK_STATS_FILE``
    Where :func:`report_stats` and :func:`progress` write the crawl's statistics (each line one
    complete snapshot, the newest wins); the agent ships them to the master. See ``_stats``.
``CK_STATE_DIR``, ``CK_CONTROL_FILE``, ``CK_CONTROL_ACK_FILE``, ``CK_SNAPSHOT_DIR``, ``CK_ATTEMPT``
    The state that travels with the task across attempts and nodes, and the agent's requests to
    persist it: :func:`load_state`, :func:`persist_state`, :func:`on_persist`, :func:`on_migrating`,
    :func:`state_dir`, :func:`state_lock` (see ``_state``). ``CK_ATTEMPT`` is this run's attempt
    number (1, 2, ...): :attr:`TaskContext.attempt`.
``CK_CHROMIUM_SANDBOX``
    ``1`` when Chromium's own sandbox works for this spider (it is not root and may make user
    namespaces), ``0`` when Chromium needs ``--no-sandbox``: :func:`chromium_sandbox`,
    :func:`chromium_args`.

Outside an agent (no ``CK_ITEMS_FILE``) :func:`save_item` prints each item as one JSON line on
stdout, so a spider still runs on a developer's machine.

Pure Python, no dependencies, Python 3.8+. Importing this package never imports Scrapy; the
Scrapy item pipeline lives in :mod:`crawlerkeeper_sdk.scrapy`.

Errors raised:

- ``TypeError``: an item that is not a mapping (:func:`save_item`, :func:`save_items`).
- ``ValueError``: ``CK_PARAMS`` is not a JSON object (:func:`task_context`).
- The state functions' own (``TypeError``/``ValueError`` for a state JSON cannot hold, ``OSError``):
  see their docstrings.
- ``OSError``: the items file cannot be opened or written (permissions, I/O errors). A full disk
  (ENOSPC, EDQUOT) is waited out: the call blocks until the line is written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from crawlerkeeper_sdk._control import (
    ENV_ATTEMPT,
    ENV_CONTROL_ACK_FILE,
    ENV_CONTROL_FILE,
    ENV_SNAPSHOT_DIR,
    ENV_STATE_DIR,
)
from crawlerkeeper_sdk._state import (
    load_state,
    on_migrating,
    on_persist,
    persist_state,
    state_dir,
    state_lock,
)
from crawlerkeeper_sdk._stats import ENV_STATS_FILE, flush_stats, progress, report_stats

__version__ = "0.1.0"

__all__ = [
    "ENV_ATTEMPT",
    "ENV_CHROMIUM_SANDBOX",
    "ENV_CONTROL_ACK_FILE",
    "ENV_CONTROL_FILE",
    "ENV_ITEMS_FILE",
    "ENV_PARAMS",
    "ENV_SNAPSHOT_DIR",
    "ENV_SPIDER_ID",
    "ENV_SPIDER_NAME",
    "ENV_STATE_DIR",
    "ENV_STATS_FILE",
    "ENV_TASK_DIR",
    "ENV_TASK_ID",
    "TaskContext",
    "__version__",
    "chromium_args",
    "chromium_sandbox",
    "flush_stats",
    "load_state",
    "on_migrating",
    "on_persist",
    "persist_state",
    "progress",
    "report_stats",
    "save_item",
    "save_items",
    "state_dir",
    "state_lock",
    "task_context",
]

ENV_ITEMS_FILE = "CK_ITEMS_FILE"
ENV_TASK_ID = "CK_TASK_ID"
ENV_SPIDER_ID = "CK_SPIDER_ID"
ENV_SPIDER_NAME = "CK_SPIDER_NAME"
ENV_PARAMS = "CK_PARAMS"
ENV_TASK_DIR = "CK_TASK_DIR"
ENV_CHROMIUM_SANDBOX = "CK_CHROMIUM_SANDBOX"

# save_items() joins encoded lines into one write up to about this size (bytes).
_BATCH_BYTES = 1 << 20

# One lock for every writer in this process; the file itself is opened with O_APPEND so that
# whole lines written by other processes (a spider's worker processes) never interleave.
_lock = threading.Lock()
# (path, fd) of the items file opened by this process; reopened when CK_ITEMS_FILE changes.
_open_file: Optional[Tuple[str, int]] = None


def _after_fork_in_child() -> None:
    # A fork while another thread held the lock would leave the child's copy locked forever.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _env(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value if value else None


# ``json.dumps(item, ensure_ascii=False, default=str)`` builds a new encoder per call when given
# arguments; one encoder made once gives the same text about 30 % faster (bench/items.py).
_JSON = json.JSONEncoder(ensure_ascii=False, default=str)


def _encode(item: Any) -> bytes:
    """One item → one UTF-8 JSON line ending in ``\\n``."""
    if type(item) is not dict:  # the common case skips the (slower) ABC check
        if not isinstance(item, Mapping):
            raise TypeError(
                "crawlerkeeper_sdk.save_item() takes a mapping (a dict of field -> value), "
                f"got {type(item).__name__}: {item!r:.200}"
            )
        item = dict(item)
    text = _JSON.encode(item)
    # JSON strings may hold U+2028/U+2029 raw, and some line readers (str.splitlines) break
    # lines there; escaped they mean the same thing and the line stays one line everywhere.
    if "\u2028" in text or "\u2029" in text:
        text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return (text + "\n").encode("utf-8")


def _items_fd(path: str) -> int:
    """The O_APPEND fd of ``path`` for this process (opened once). Caller holds ``_lock``."""
    global _open_file
    if _open_file is not None:
        open_path, fd = _open_file
        if open_path == path:
            return fd
        _open_file = None
        with contextlib.suppress(OSError):
            os.close(fd)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    _open_file = (path, fd)
    return fd


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_RETRY_SECONDS = (0.05, 0.1, 0.2, 0.5, 1.0)


def _write_once(fd: int, data: bytes | memoryview, tries: list[int]) -> int:
    # A full disk is waited out, never a lost item: the agent stops the task that filled it and frees its
    # space; until then this spider blocks here (docs/operations.md, "When the disk fills").
    while True:
        try:
            return os.write(fd, data)
        except OSError as exc:
            if exc.errno not in _FULL_ERRNOS:
                raise
            time.sleep(_FULL_RETRY_SECONDS[min(tries[0], len(_FULL_RETRY_SECONDS) - 1)])
            tries[0] += 1


def _write_all(fd: int, data: bytes) -> None:
    # On a local file one write() of a whole line is appended atomically; the loop only matters
    # for the rare short write (a signal, a full disk), where keeping the bytes beats losing them.
    tries = [0]
    written = _write_once(fd, data, tries)
    if written == len(data):
        return
    view = memoryview(data)[written:]
    while view:
        view = view[_write_once(fd, view, tries):]


def _print_lines(data: bytes) -> None:
    # Write the UTF-8 bytes themselves where possible: a spider run under LANG=C must not fail
    # on a non-ASCII title just because it is not in an agent.
    stdout = sys.stdout
    buffer = getattr(stdout, "buffer", None)
    if buffer is None:
        stdout.write(data.decode("utf-8"))
        stdout.flush()
        return
    stdout.flush()
    buffer.write(data)
    buffer.flush()


def _emit(data: bytes) -> None:
    """Append encoded lines to the items file, or print them on stdout outside an agent."""
    path = _env(ENV_ITEMS_FILE)
    with _lock:
        if path is None:
            _print_lines(data)
            return
        _write_all(_items_fd(path), data)


def save_item(item: Dict[str, Any]) -> None:
    """Save one scraped item.

    Appends one JSON line (``json.dumps(item, ensure_ascii=False, default=str)`` + ``"\\n"``) to
    the file named by ``CK_ITEMS_FILE`` with a single write on an append-mode file descriptor,
    so threads and processes of one spider may all call it. Values JSON cannot represent
    (datetimes, decimals, sets...) are written as ``str(value)``. Without ``CK_ITEMS_FILE`` (not
    run by an agent) the line is printed on stdout instead. Returns once the line is handed to
    the operating system; nothing is buffered in the process.

    Raises ``TypeError`` if ``item`` is not a mapping, ``OSError`` if the file cannot be written (on a
    full disk it waits until there is room instead: the item is never lost).
    """
    _emit(_encode(item))


def save_items(items: Iterable[Dict[str, Any]]) -> int:
    """Save several items, in order; returns how many were saved.

    Lines are appended in batches of whole lines (one write per batch of up to about 1 MiB).
    If an element is not a mapping, the items before it are saved and ``TypeError`` is raised.
    """
    count = 0
    batch = []
    batch_bytes = 0
    try:
        for item in items:
            line = _encode(item)
            batch.append(line)
            batch_bytes += len(line)
            count += 1
            if batch_bytes >= _BATCH_BYTES:
                _emit(b"".join(batch))
                batch = []
                batch_bytes = 0
    finally:
        if batch:
            _emit(b"".join(batch))
    return count


@dataclass(frozen=True)
class TaskContext:
    """What the agent told this spider about the task it runs (read from ``CK_*`` variables).

    Every field but ``params`` is ``None`` outside an agent.

    - ``task_id``, ``spider_id``, ``spider_name``: from ``CK_TASK_ID``, ``CK_SPIDER_ID``,
      ``CK_SPIDER_NAME``.
    - ``params``: the task parameters, ``CK_PARAMS`` parsed as a JSON object (``{}`` if unset).
    - ``task_dir``: the task's directory, ``CK_TASK_DIR``.
    - ``items_file``: where :func:`save_item` appends, ``CK_ITEMS_FILE``.
    - ``attempt``: which run of the task this is, ``CK_ATTEMPT`` (1 when absent or not a number ≥ 1);
      a later attempt resumes from the state :func:`load_state` returns, when the spider saved one.
    """

    task_id: Optional[str] = None
    spider_id: Optional[str] = None
    spider_name: Optional[str] = None
    params: Dict[str, Any] = field(default_factory=dict)
    task_dir: Optional[str] = None
    items_file: Optional[str] = None
    attempt: int = 1

    @property
    def in_agent(self) -> bool:
        """True when run by a CrawlerKeeper agent (``CK_ITEMS_FILE`` is set)."""
        return self.items_file is not None


def _parse_params(raw: Optional[str]) -> Dict[str, Any]:
    if raw is None or not raw.strip():
        return {}
    try:
        params = json.loads(raw)
    except ValueError as exc:
        raise ValueError(
            f"{ENV_PARAMS} is not valid JSON ({exc}); it must hold the task parameters as a JSON "
            'object, for example {"start_url": "https://example.com/"}'
        ) from exc
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ValueError(
            f"{ENV_PARAMS} must be a JSON object of task parameters, got a JSON {type(params).__name__}"
        )
    return params


def task_context() -> TaskContext:
    """Read the task context from the environment (each call reads it afresh).

    Raises ``ValueError`` naming ``CK_PARAMS`` when that variable is not a JSON object.
    """
    return TaskContext(
        task_id=_env(ENV_TASK_ID),
        spider_id=_env(ENV_SPIDER_ID),
        spider_name=_env(ENV_SPIDER_NAME),
        params=_parse_params(os.environ.get(ENV_PARAMS)),
        task_dir=_env(ENV_TASK_DIR),
        items_file=_env(ENV_ITEMS_FILE),
        attempt=_parse_attempt(os.environ.get(ENV_ATTEMPT)),
    )


def _parse_attempt(raw: Optional[str]) -> int:
    try:
        attempt = int(raw or "1")
    except ValueError:
        return 1
    return attempt if attempt >= 1 else 1


def chromium_sandbox() -> bool:
    """Whether to launch Chromium with its own sandbox: what the agent says (``CK_CHROMIUM_SANDBOX``:
    ``1`` when the spider is not root and may make user namespaces, which Chromium's sandbox needs
    where no setuid ``chrome-sandbox`` is installed, as in Debian's Chromium); outside an agent, unless
    running as root (where Chromium refuses its sandbox).

    Playwright: ``p.chromium.launch(chromium_sandbox=chromium_sandbox(), ...)`` (Playwright passes
    ``--no-sandbox`` by default). Selenium and others: :func:`chromium_args`.
    """
    said = os.environ.get(ENV_CHROMIUM_SANDBOX)
    if said in ("0", "1"):
        return said == "1"
    return hasattr(os, "geteuid") and os.geteuid() != 0


def chromium_args() -> List[str]:
    """The switches Chromium needs here to start: ``["--no-sandbox"]`` unless :func:`chromium_sandbox`,
    else none (a list of str, for ``ChromeOptions.add_argument`` or a launcher's ``args``)."""
    return [] if chromium_sandbox() else ["--no-sandbox"]
