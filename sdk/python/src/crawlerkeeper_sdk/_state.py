"""State that travels: what a spider persists so that its next attempt, on any node, resumes the crawl.

The agent gives every task a state directory (``CK_STATE_DIR``), restored from the last checkpoint
before the spider starts. :func:`load_state` reads the JSON state saved there, :func:`persist_state`
writes it, :func:`on_persist` registers a callback the agent's requests run (Apify's
``Actor.on("persistState")``), :func:`on_migrating` one that hears the node is being left (with the
seconds left), :func:`state_dir` is the directory for state files of your own.

The first call of any of these (or of :func:`state_lock`) starts the watcher: a daemon thread that looks
at ``CK_CONTROL_FILE`` every 0.2 s and answers each request of the agent: it runs the migrating
callbacks (for a ``migrating`` request), then, holding :func:`state_lock`, the persist callbacks (a
value returned → :func:`persist_state`), then, holding the SDK's items lock too (no item is written
meanwhile by this process), takes the items offset, copies the state dir to ``CK_SNAPSHOT_DIR/<id>``
and answers in ``CK_CONTROL_ACK_FILE`` (``crawlerkeeper_sdk._control`` has the file formats). A failure
is answered as one (``{"id": N, "error": "..."}``) and never stops the spider. Using any of these
functions is what tells the agent this spider can resume; a spider that never does restarts from
scratch on its next attempt.

The items offset of a snapshot is the size of ``CK_ITEMS_FILE`` when the state was last made current:
right after the persist callbacks ran (when any are registered), else at the last :func:`persist_state`
call (else at the copy). The master keeps the items before it; the next attempt makes the rest again.

Outside an agent (no ``CK_STATE_DIR``): :func:`load_state` returns the default (or what
:func:`persist_state` kept in memory), callbacks never run, :func:`state_dir` is a temporary directory
removed at exit.

One process of a spider answers the agent (the watcher holds an exclusive ``flock`` on the ack file);
another process of the same spider that uses this API takes over if that one exits. After a ``fork``,
the child has no watcher until it calls this API.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, ContextManager, List, Optional, TypeVar

from crawlerkeeper_sdk import _control
from crawlerkeeper_sdk._control import (
    ENV_CONTROL_ACK_FILE,
    ENV_CONTROL_FILE,
    ENV_SNAPSHOT_DIR,
    ENV_STATE_DIR,
    Request,
)

try:
    import fcntl
except ImportError:  # not on Windows: there the SDK never runs in an agent
    fcntl = None  # type: ignore[assignment]

STATE_FILE = "state.json"
"""The file :func:`persist_state` writes in the state dir."""

PersistCallback = Callable[[], Any]
MigratingCallback = Callable[[Optional[float]], Any]
F = TypeVar("F", bound=Callable[..., Any])

_state_lock = threading.RLock()
_start_lock = threading.Lock()
_persist_callbacks: List[PersistCallback] = []
_migrating_callbacks: List[MigratingCallback] = []
_memory_state: Optional[str] = None  # persist_state() outside an agent: the JSON text
_marked_offset: Optional[int] = None  # the items offset at the last persist_state()
_watcher: Optional[_Watcher] = None
_local_dir: Optional[str] = None


def _env(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value if value else None


def state_lock() -> ContextManager[bool]:
    """The lock the watcher holds while it runs the persist callbacks and copies the state dir (a
    re-entrant ``threading.RLock``).

    Hold it around each step of your crawl that changes the state and saves the items that go with
    it (``with state_lock(): save_item(...); frontier.popleft()``), never around a download: a
    snapshot then never falls between an item and the state that accounts for it, and the spider is
    paused only for the copy. Starts the watcher.
    """
    _ensure_watcher()
    return _state_lock


def state_dir() -> Path:
    """The directory of the state that travels with the task (``CK_STATE_DIR``): files you write
    there are in the next checkpoint and back in place when a later attempt starts. Write them from
    a persist callback, or under :func:`state_lock`, so a copy never sees one half-written.

    Outside an agent: a temporary directory, removed when the process exits. Starts the watcher.
    Raises ``OSError`` if the directory cannot be made.
    """
    global _local_dir
    _ensure_watcher()
    path = _env(ENV_STATE_DIR)
    if path is not None:
        os.makedirs(path, exist_ok=True)
        return Path(path)
    with _start_lock:
        if _local_dir is None:
            _local_dir = tempfile.mkdtemp(prefix="ck-state-")
            atexit.register(shutil.rmtree, _local_dir, True)
        return Path(_local_dir)


def load_state(default: Any = None) -> Any:
    """The state saved by the last :func:`persist_state` (of this attempt, or of the checkpoint this
    attempt resumes from): a fresh copy of the JSON value, or ``default`` when none was saved.

    Starts the watcher. Raises ``ValueError`` if the state file is not JSON (it is written atomically,
    so only a foreign writer can cause that), ``OSError`` if it cannot be read.
    """
    _ensure_watcher()
    directory = _env(ENV_STATE_DIR)
    if directory is None:
        return default if _memory_state is None else json.loads(_memory_state)
    path = os.path.join(directory, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        return default
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the saved state {path} is not JSON ({exc}); remove it to start afresh") from exc


def persist_state(state: Any) -> None:
    """Save ``state`` (a JSON value: dicts, lists, str, int, float, bool, None) as the task's state, at
    once and atomically (``state.json`` in the state dir, replaced through a rename).

    Call it where your state and the items you saved agree (after a page's items and the frontier
    change they go with): the next snapshot pairs it with the items saved up to this call, unless a
    persist callback makes the state current later. Convert sets and other types yourself.

    Starts the watcher. Raises ``TypeError`` for a value JSON cannot hold, ``ValueError`` for a
    circular one or a NaN/infinity, ``OSError`` if the file cannot be written. Outside an agent the
    state is kept in memory for :func:`load_state`.
    """
    global _memory_state, _marked_offset
    _ensure_watcher()
    text = json.dumps(state, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    directory = _env(ENV_STATE_DIR)
    with _state_lock:
        if directory is None:
            _memory_state = text
            return
        offset = _items_offset_now()
        os.makedirs(directory, exist_ok=True)
        temporary = os.path.join(directory, "." + STATE_FILE + ".tmp")
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, os.path.join(directory, STATE_FILE))
        _marked_offset = offset


def on_persist(callback: F) -> F:
    """Run ``callback()`` on every persist request of the agent (every checkpoint interval, and before
    a stop meant to be resumed): it returns the state to save (→ :func:`persist_state`), or None
    having written its files in :func:`state_dir` itself. Returns ``callback`` (a decorator).

    It runs in the watcher thread holding :func:`state_lock`: keep it short (the spider's other
    threads wait for the lock), and return your live state rather than a copy made earlier. An
    exception it raises fails that checkpoint (the agent keeps the previous one), printed on stderr.
    Starts the watcher. Outside an agent it never runs.
    """
    _ensure_watcher()
    _persist_callbacks.append(callback)
    return callback


def on_migrating(callback: F) -> F:
    """Run ``callback(seconds_left)`` when the agent is about to stop this spider to resume it
    elsewhere (a migration, a memory ceiling): ``seconds_left`` is a float of seconds until the stop
    (None if the agent did not say). The persist callbacks run right after it. Returns ``callback``.

    It runs in the watcher thread, not holding :func:`state_lock`: stop starting new work there
    (set a flag your crawl loop reads), do not wait for the crawl. An exception it raises is printed
    on stderr and the persist goes on. Starts the watcher. Outside an agent it never runs.
    """
    _ensure_watcher()
    _migrating_callbacks.append(callback)
    return callback


def _items_lock() -> Any:
    import crawlerkeeper_sdk  # the package's own lock, looked up now: a fork replaces it

    return crawlerkeeper_sdk._lock


def _items_offset_now() -> int:
    import crawlerkeeper_sdk

    with _items_lock():
        return _control.items_offset(_env(crawlerkeeper_sdk.ENV_ITEMS_FILE))


def _ensure_watcher() -> None:
    global _watcher
    if _watcher is not None:
        return
    paths = [_env(name) for name in (ENV_STATE_DIR, ENV_CONTROL_FILE, ENV_CONTROL_ACK_FILE, ENV_SNAPSHOT_DIR)]
    if any(path is None for path in paths):
        return
    with _start_lock:
        if _watcher is None:
            watcher = _Watcher(*paths)  # type: ignore[arg-type]
            watcher.start()
            _watcher = watcher


def _note(message: str) -> None:
    with contextlib.suppress(Exception):
        print(f"crawlerkeeper_sdk: {message}", file=sys.stderr, flush=True)


class _Watcher:
    """The daemon thread that answers the agent's requests (see the module docstring)."""

    def __init__(self, state_dir: str, control: str, ack: str, snapshots: str) -> None:
        self.state_dir = state_dir
        self.control = control
        self.ack = ack
        self.snapshots = snapshots
        self.ack_fd: Optional[int] = None  # open, flock'ed: this process answers
        self.reader: Optional[_control.ControlReader] = None
        self.answered: set[int] = set()
        self.thread = threading.Thread(target=self._run, name="crawlerkeeper-state", daemon=True)
        self._last_error = ""

    def start(self) -> None:
        self.thread.start()

    def forget_in_child(self) -> None:
        # After a fork: the thread is not in the child; its copy of the locked descriptor is closed (the
        # lock stays with the parent's, which shares the open file).
        if self.ack_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.ack_fd)
            self.ack_fd = None

    def _run(self) -> None:
        while True:
            time.sleep(_control.POLL_INTERVAL)
            try:
                self.tick()
            except Exception as exc:  # never end the watcher, never the spider
                text = f"{type(exc).__name__}: {exc}"
                if text != self._last_error:
                    _note(f"state watcher: {text}")
                    self._last_error = text

    def _hold(self) -> bool:
        """Whether this process answers the agent (it holds the ack file's lock)."""
        if self.ack_fd is not None:
            return True
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(self.ack, flags, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
        self.ack_fd = fd
        self.answered = _control.answered_ids(self.ack)
        self.reader = _control.ControlReader(self.control)
        return True

    def tick(self) -> None:
        """One look at the control file; answers what is new."""
        if not self._hold():
            return
        assert self.reader is not None
        pending: List[Request] = []
        for request in self.reader.poll():
            if request.id not in self.answered and all(request.id != p.id for p in pending):
                pending.append(request)
        if self.reader.skipped_bytes:
            _note(f"{self.control}: skipped {self.reader.skipped_bytes} bytes of backlog")
            self.reader.skipped_bytes = 0
        if pending:
            self.answer(pending)

    def _ack(self, answer: dict[str, Any]) -> None:
        assert self.ack_fd is not None
        _control.append_line(self.ack_fd, answer)
        self.answered.add(answer["id"])

    def answer(self, pending: List[Request]) -> None:
        """Answer requests seen together: one snapshot for the newest, the older ones superseded."""
        known = [r for r in pending if r.event in _control.EVENTS]
        for request in pending:
            if request.event not in _control.EVENTS:
                self._ack({"id": request.id, "error": f"unknown event {request.event!r}"})
        if not known:
            return
        newest = known[-1]
        for request in known[:-1]:
            self._ack({"id": request.id, "error": f"superseded by request {newest.id}"})
        migrating = [r for r in known if r.event == _control.EVENT_MIGRATING]
        started = time.monotonic()
        try:
            if migrating:
                self._run_migrating(migrating[-1].seconds_left)
            answer = self._persist_and_copy(newest)
        except Exception as exc:
            answer = {"id": newest.id, "error": f"{type(exc).__name__}: {exc}"[:1000]}
        else:
            answer["pauseMs"] = round((time.monotonic() - started) * 1000, 1)
        self._ack(answer)

    def _run_migrating(self, seconds_left: Optional[float]) -> None:
        for callback in list(_migrating_callbacks):
            try:
                callback(seconds_left)
            except Exception:
                _note("a migrating callback failed:\n" + traceback.format_exc())

    def _persist_and_copy(self, request: Request) -> dict[str, Any]:
        import crawlerkeeper_sdk

        with _state_lock:
            callbacks = list(_persist_callbacks)
            for callback in callbacks:
                try:
                    value = callback()
                except Exception:
                    _note("a persist callback failed:\n" + traceback.format_exc())
                    raise
                if value is not None:
                    persist_state(value)
            with _items_lock():
                offset = _control.items_offset(_env(crawlerkeeper_sdk.ENV_ITEMS_FILE))
                if not callbacks and _marked_offset is not None:
                    offset = min(offset, _marked_offset)
                name = str(request.id)
                skipped = _control.take_snapshot(self.state_dir, self.snapshots, name)
        answer: dict[str, Any] = {"id": request.id, "itemsOffset": offset, "snapshot": name}
        if skipped:
            answer["skipped"] = skipped
        return answer


def _after_fork_in_child() -> None:
    global _state_lock, _start_lock, _watcher
    _state_lock = threading.RLock()
    _start_lock = threading.Lock()
    if _watcher is not None:
        _watcher.forget_in_child()
        _watcher = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
