"""Scrapy crawls that checkpoint and resume with no change to the project (issue 38).

``crawlerkeeper_sdk._scrapy_hook`` adds :class:`CrawlerKeeperState` to Scrapy's extensions and sets
Scrapy's default ``JOBDIR`` to ``$CK_STATE_DIR/jobdir`` when ``CK_SCRAPY_HOOK`` names ``state``. A
project's own ``JOBDIR`` (settings.py, ``-s``, ``custom_settings``) is used instead: it is copied
into every snapshot as ``jobdir/`` and, at the start of a resumed attempt, put back in its place
from the restored state when it is missing or empty.

The agent appends persist requests to ``CK_CONTROL_FILE``; a ``LoopingCall`` stats it every 0.2 s.
For request N, within one reactor step (so no request, response or item moves meanwhile):

1. what Scrapy's close would write is taken from the live objects (``_scrapy_jobdir``): the
   dupefilter's ``requests.seen`` flushed, the priority queue's ``active.json``, each disk queue's
   ``info.json`` / size header, ``spider.state``; the queues stay open;
2. the requests in flight (taken from the scheduler, their responses not fully processed: the
   engine slot's ``inprogress``, which spans the downloader and the scraper) are kept with Scrapy's
   ``Request.to_dict``; requests only in the memory queue (not serializable) are counted and said;
3. holding the SDK's items lock: ``itemsOffset`` = the size of ``CK_ITEMS_FILE``; ``CK_STATE_DIR``
   (and a project's own JOBDIR) is copied to ``CK_SNAPSHOT_DIR/N.tmp`` and the close-time files are
   written into the copy — but for the append-only files (the dupefilter's ``requests.seen``, the
   hook's ``start.seen``), which are opened and measured in the step and whose bytes up to that size
   (they never change) are copied right after it, in a thread, so the pause does not grow with the
   crawl's seen set. ``pauseMs`` is the step. Then ``N.tmp`` is renamed ``N`` and the ack line goes to
   ``CK_CONTROL_ACK_FILE`` (``{"id", "itemsOffset", "snapshot", "pauseMs"}``, or ``{"id", "error"}``);
   requests seen meanwhile wait for it.

Exactly once: the items of a response still in flight are held back (:meth:`CrawlerKeeperState.hold`)
and written when Scrapy finishes that response, so the items file never holds part of an in-flight
response's items: a resumed crawl fetches those requests again (``dont_filter``: they are in
``requests.seen``) and their items come once. Start requests already scheduled before the checkpoint
(Scrapy makes them ``dont_filter``) are not scheduled again by the resumed crawl (their fingerprints:
``scrapy/start.seen``). Items written by the project itself (the SDK's pipeline, ``save_item`` in a
callback) are not held: those of a response in flight at the checkpoint may come twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pickle
import shutil
import time
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from crawlerkeeper_sdk import _control, _state
from crawlerkeeper_sdk._scrapy_jobdir import (
    JobdirError,
    close_later,
    copy_later,
    copy_tree_now_and_later,
    jobdir_view,
    write_patches,
)

__all__ = ["JOBDIR_NAME", "TICK_SECONDS", "CrawlerKeeperState", "default_jobdir"]

_log = logging.getLogger("crawlerkeeper_sdk.scrapy")

JOBDIR_NAME = "jobdir"
"""The JOBDIR's name inside ``CK_STATE_DIR`` and inside every snapshot."""
OWN_DIR = "scrapy"
"""The hook's own files inside ``CK_STATE_DIR``: ``inflight.pickle``, ``start.seen``."""
TICK_SECONDS = 0.2
"""How often the control file is looked at (a stat)."""
_claimed = False  # a crawl of this process keeps the task's state


def default_jobdir() -> Optional[str]:
    """``$CK_STATE_DIR/jobdir`` when the hook's ``state`` mode is on, else None."""
    state_dir = os.environ.get("CK_STATE_DIR")
    if not state_dir or "state" not in os.environ.get("CK_SCRAPY_HOOK", "").split(","):
        return None
    return os.path.join(state_dir, JOBDIR_NAME)


class _Channel:
    """The control file (requests in) and the ack file (answers out), read and written with the SDK's
    ``_control`` functions; this process answers while it holds flock on the ack file (as the SDK's watcher)."""

    def __init__(self, control: str, ack: str) -> None:
        self.ack = ack
        self.reader = _control.ControlReader(control)
        self.answered: Set[int] = set()
        self.fd: Optional[int] = None

    def _locked(self) -> bool:
        if self.fd is not None:
            return True
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.ack, flags, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.fd = fd
        self.answered = _control.answered_ids(self.ack)
        return True

    def poll(self) -> List[Any]:
        """New unanswered requests (``_control.Request``; a stat, then a read of what was appended)."""
        if not self._locked():
            return []
        found: List[Any] = []
        for request in self.reader.poll():
            if request.id not in self.answered and all(request.id != r.id for r in found):
                found.append(request)
        return found

    def answer(self, record: Dict[str, Any]) -> None:
        """Append one ack line (one write on O_APPEND)."""
        assert self.fd is not None
        _control.append_line(self.fd, record)
        self.answered.add(record["id"])

    def forget_in_child(self) -> None:
        """After a fork (the SDK calls it on its watcher: this object stands in for it)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class CrawlerKeeperState:
    """Scrapy extension: the crawl's state at the agent's persist requests, and its resume (module docstring).

    Steps aside (``NotConfigured``) unless ``CK_SCRAPY_HOOK`` names ``state`` and ``CK_STATE_DIR`` is set.
    Nothing it does raises into the crawl: a failed persist is acked with its error and logged.
    """

    @classmethod
    def from_crawler(cls, crawler: Any) -> CrawlerKeeperState:
        """Scrapy's factory: puts a project's own JOBDIR back from the restored state, connects the signals."""
        from scrapy import signals
        from scrapy.exceptions import NotConfigured

        global _claimed
        default = default_jobdir()
        if default is None:
            raise NotConfigured("the agent asked for no state (CK_SCRAPY_HOOK, CK_STATE_DIR)")
        if _claimed:  # a second crawl in this process: one JOBDIR, one answer per task
            if os.path.abspath(crawler.settings.get("JOBDIR") or "") == os.path.abspath(default):
                crawler.settings.set("JOBDIR", None, priority="cmdline")
            _log.warning("crawlerkeeper: this process runs more than one crawl: only the first one's state is "
                         "saved at checkpoints, this one (%s) restarts from scratch on a new attempt",
                         getattr(crawler.spidercls, "name", "?"))
            raise NotConfigured("another crawl of this process keeps the task's state")
        try:
            ext = cls(crawler, Path(os.environ["CK_STATE_DIR"]), default)
        except Exception as exc:  # never stop the crawl from starting: it runs without checkpoints
            _log.exception("crawlerkeeper: the crawl's state cannot be kept (%s): no checkpoints", exc)
            raise NotConfigured(f"cannot keep the crawl's state: {exc}") from exc
        _claimed = True
        crawler.signals.connect(ext.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(ext.spider_closed, signal=signals.spider_closed)
        crawler.signals.connect(ext.request_scheduled, signal=signals.request_scheduled)
        crawler._ck_state = ext  # (CrawlerKeeperItems asks it to hold in-flight responses' items)
        return ext

    def __init__(self, crawler: Any, state_dir: Path, default: str) -> None:
        self.crawler = crawler
        self.state_dir = state_dir
        self.own = state_dir / OWN_DIR
        jobdir = crawler.settings.get("JOBDIR")
        self.jobdir: Optional[str] = os.path.abspath(jobdir) if jobdir else None
        self.own_jobdir = bool(jobdir) and self.jobdir != os.path.abspath(default)
        self.held: Dict[Any, List[bytes]] = {}
        self.done: weakref.WeakSet[Any] = weakref.WeakSet()
        self.start_seen: Set[str] = set()
        self.resumed_starts: Set[str] = set()
        self.start_file: Any = None
        self.start_path = str(self.own / "start.seen")
        self.loop: Any = None
        self.waiting: List[Any] = []
        self.finishing = False
        if self.own_jobdir:
            self._restore_own_jobdir()
        elif not jobdir:
            _log.warning("crawlerkeeper: the project turned JOBDIR off: this crawl's state cannot be saved, "
                         "a new attempt starts from scratch")
        control, ack = os.environ.get("CK_CONTROL_FILE"), os.environ.get("CK_CONTROL_ACK_FILE")
        self.channel = _Channel(control, ack) if control and ack else None
        if self.channel is not None:
            with _state._start_lock:
                if _state._watcher is None:  # this crawl answers, running the SDK's callbacks too
                    _state._watcher = self.channel  # type: ignore[assignment]
                else:
                    _log.warning("crawlerkeeper: the SDK's state watcher started before the crawl: it answers "
                                 "the agent, with a copy of CK_STATE_DIR that Scrapy's JOBDIR may not resume from")
                    self.channel = None

    # -- start and resume ---------------------------------------------------------------------------

    def _restore_own_jobdir(self) -> None:
        """The restored ``jobdir/`` goes to the project's JOBDIR when that is missing or empty; either way it
        leaves the state dir (each snapshot copies the project's JOBDIR there)."""
        assert self.jobdir is not None
        restored = self.state_dir / JOBDIR_NAME
        target = Path(self.jobdir)
        used = False
        with contextlib.suppress(OSError):
            used = any(target.iterdir())
        if not used and restored.is_dir():
            with contextlib.suppress(FileNotFoundError):
                target.rmdir()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(restored, target, symlinks=True)
            _log.info("crawlerkeeper: the project's JOBDIR %s is put back from the checkpoint", self.jobdir)
        else:
            _log.info("crawlerkeeper: the project's JOBDIR %s is kept in every checkpoint", self.jobdir)
        if restored.is_dir() and not restored.is_symlink():
            shutil.rmtree(restored)

    def spider_opened(self, spider: Any) -> None:
        """Resume what the checkpoint kept in flight, start the control file's watch (never raises: a
        failure is logged and the crawl goes on without checkpoints)."""
        try:
            self._open(spider)
        except Exception:
            _log.exception("crawlerkeeper: the crawl's state cannot be kept: no checkpoints")
            with _state._start_lock:
                if self.channel is not None and _state._watcher is self.channel:
                    _state._watcher = None
            self.channel = None

    def _open(self, spider: Any) -> None:
        self.own.mkdir(parents=True, exist_ok=True)
        start_path = self.start_path
        with contextlib.suppress(OSError), open(start_path, encoding="ascii") as f:
            self.resumed_starts = {line.strip() for line in f if line.strip()}
        self.start_seen = set(self.resumed_starts)
        self.start_file = open(start_path, "a", encoding="ascii")  # noqa: SIM115 (closed at spider_closed)
        engine = self.crawler.engine
        slot = getattr(engine, "_slot", None) or engine.slot
        scraper_slot = engine.scraper.slot
        finish = scraper_slot.finish_response

        def finish_response(result: Any, request: Any) -> Any:
            try:
                return finish(result, request)
            finally:
                self.done.add(request)
                self._release(request)

        scraper_slot.finish_response = finish_response
        if getattr(slot, "start_requests", None) is not None:  # Scrapy < 2.13 marks no start request
            slot.start_requests = self._mark_start(slot.start_requests)
        self._resume(spider, slot.scheduler)
        if self.channel is not None:
            from twisted.internet import task

            self.loop = task.LoopingCall(self.tick)
            self.loop.start(TICK_SECONDS, now=True)

    @staticmethod
    def _mark_start(requests: Any) -> Any:
        for request in requests:
            request.meta.setdefault("is_start_request", True)
            yield request

    def _resume(self, spider: Any, scheduler: Any) -> None:
        path = self.own / "inflight.pickle"
        try:
            saved = pickle.loads(path.read_bytes())
        except FileNotFoundError:
            return
        except Exception as exc:
            _log.error("crawlerkeeper: the requests in flight at the checkpoint cannot be read (%s)", exc)
            return
        from scrapy.utils.request import request_from_dict

        count = 0
        for data in saved:
            try:
                request = request_from_dict(data, spider=spider).replace(dont_filter=True)
            except Exception as exc:
                _log.error("crawlerkeeper: a request in flight at the checkpoint cannot be rebuilt (%s)", exc)
                continue
            scheduler.enqueue_request(request)
            count += 1
        path.unlink()
        _log.info("crawlerkeeper: resuming from the checkpoint: %d request(s) in flight then are scheduled "
                  "again; %d start request(s) were scheduled before", count, len(self.resumed_starts))

    def request_scheduled(self, request: Any, spider: Any) -> None:
        """A start request the checkpointed crawl had scheduled is not scheduled again (IgnoreRequest)."""
        if not request.meta.get("is_start_request"):
            return
        try:
            fingerprint = self.crawler.request_fingerprinter.fingerprint(request).hex()
        except Exception:  # (a fingerprinter of the project's that fails: the dupefilter says so itself)
            return
        if fingerprint in self.resumed_starts:
            from scrapy.exceptions import IgnoreRequest

            raise IgnoreRequest("scheduled before the checkpoint this crawl resumes from")
        if fingerprint not in self.start_seen and self.start_file is not None:
            self.start_seen.add(fingerprint)
            self.start_file.write(fingerprint + "\n")

    # -- items of responses in flight ---------------------------------------------------------------

    def hold(self, data: bytes, response: Any) -> bool:
        """Keep ``data`` (an item's line) until Scrapy finishes ``response``'s request; False: write it now."""
        request = getattr(response, "request", None)
        slot = getattr(self.crawler.engine, "_slot", None) or getattr(self.crawler.engine, "slot", None)
        try:
            if request is None or slot is None or request not in slot.inprogress or request in self.done:
                return False
        except (AttributeError, TypeError):  # (an engine of another shape: written at once)
            return False
        self.held.setdefault(request, []).append(data)
        return True

    def _release(self, request: Any) -> None:
        from crawlerkeeper_sdk import _emit

        lines = self.held.pop(request, None)
        if lines:
            _emit(b"".join(lines))

    def spider_closed(self, spider: Any, reason: Any = None) -> None:
        """Stop the watch; write every item still held."""
        if self.loop is not None and self.loop.running:
            self.loop.stop()
        for request in list(self.held):
            self._release(request)
        if self.start_file is not None:
            self.start_file.close()
            self.start_file = None

    # -- persist ------------------------------------------------------------------------------------

    def tick(self) -> None:
        """One look at the control file; answers new requests (the newest gets the snapshot)."""
        assert self.channel is not None
        try:
            requests = self.waiting + self.channel.poll()
            self.waiting = []
            if self.finishing:  # the last snapshot is still being completed: these wait for it
                self.waiting = requests
                return
            known = [r for r in requests if r.event in _control.EVENTS]
            for request in requests:
                if request.event not in _control.EVENTS:
                    self.channel.answer({"id": request.id, "error": f"unknown event {request.event!r}"})
            if not known:
                return
            newest = known[-1]
            for older in known[:-1]:
                self.channel.answer({"id": older.id, "error": f"superseded by request {newest.id}"})
            migrating = [r for r in known if r.event == _control.EVENT_MIGRATING]
            self._answer(newest.id, migrating[-1].seconds_left if migrating else None, bool(migrating))
        except Exception:  # never into the crawl
            _log.exception("crawlerkeeper: cannot answer the agent's persist request")

    def _answer(self, number: int, seconds_left: Optional[float], migrating: bool) -> None:
        assert self.channel is not None
        if migrating:
            _log.info("crawlerkeeper: migrating, %.1f s left: saving the crawl's state (checkpoint %d)",
                      seconds_left or 0.0, number)
            for callback in list(_state._migrating_callbacks):  # (a project's own, through the SDK)
                try:
                    callback(seconds_left)
                except Exception:
                    _log.exception("crawlerkeeper: a migrating callback failed")
        try:
            record, later, tmp, final = self.persist(number)
        except Exception as exc:
            self._failed(number, exc)
            return
        from twisted.internet import threads

        def finish() -> None:  # in a thread: the append-only files' prefixes, then the rename
            copy_later(later)
            os.rename(tmp, final)

        def done(_: Any) -> None:
            self.finishing = False
            if self.channel is not None:
                self.channel.answer(record)

        def failed(failure: Any) -> None:
            self.finishing = False
            shutil.rmtree(tmp, ignore_errors=True)
            self._failed(number, failure.value)

        self.finishing = True
        threads.deferToThread(finish).addCallbacks(done, failed)

    def _failed(self, number: int, exc: BaseException) -> None:
        _log.error("crawlerkeeper: checkpoint %d failed: %s: %s", number, type(exc).__name__, exc)
        if self.channel is not None:
            self.channel.answer({"id": number, "error": f"{type(exc).__name__}: {exc}"[:1000]})

    def persist(self, number: int) -> Tuple[Dict[str, Any], Any, str, str]:
        """Snapshot ``number`` (module docstring, steps 1–3) within this reactor step: (the ack record, the
        append-only files to copy after the step (``_scrapy_jobdir.copy_later``), ``N.tmp``, ``N``).

        Raises JobdirError (a state this hook cannot save), OSError (the copy failed; no snapshot ``N``).
        """
        started = time.perf_counter()
        if self.jobdir is None:
            raise JobdirError("the project turned JOBDIR off: the crawl's state cannot be saved")
        engine = self.crawler.engine
        slot = getattr(engine, "_slot", None) or engine.slot
        scheduler = slot.scheduler
        spider = self.crawler.spider
        view = jobdir_view(scheduler, spider, self.jobdir)
        if self.start_file is not None:
            self.start_file.flush()
        flying = [r for r in slot.inprogress if r not in self.done]
        for request in [r for r in self.held if r not in set(flying)]:
            self._release(request)
        kept, lost = [], 0
        for request in flying:
            try:
                data = request.to_dict(spider=spider)
                pickle.dumps(data, protocol=4)
            except Exception:
                lost += 1
                continue
            kept.append(data)
        memory_only = len(getattr(scheduler, "mqs", ()) or ())
        inflight = pickle.dumps(kept, protocol=4)
        snapshots = os.environ.get("CK_SNAPSHOT_DIR") or str(self.state_dir.parent / "snapshots")
        os.makedirs(snapshots, exist_ok=True)
        tmp, final = os.path.join(snapshots, f"{number}.tmp"), os.path.join(snapshots, str(number))
        for leftover in (tmp, final):
            if os.path.lexists(leftover):
                shutil.rmtree(leftover)
        import crawlerkeeper_sdk

        seen_file = getattr(getattr(scheduler, "df", None), "file", None)
        append_only = {os.path.abspath(p) for p in (getattr(seen_file, "name", None), self.start_path) if p}
        later: Any = []
        with _state._state_lock:
            for callback in list(_state._persist_callbacks):  # (a project's own, through the SDK)
                value = callback()
                if value is not None:
                    _state.persist_state(value)
            with crawlerkeeper_sdk._lock:
                offset = _control.items_offset(os.environ.get("CK_ITEMS_FILE"))
                try:
                    skipped, later = copy_tree_now_and_later(str(self.state_dir), tmp, append_only)
                    copy = Path(tmp, JOBDIR_NAME)
                    if self.own_jobdir:
                        if copy.exists():
                            shutil.rmtree(copy)
                        more, later_too = copy_tree_now_and_later(str(self.jobdir), str(copy), append_only)
                        skipped += more
                        later += later_too
                    write_patches(view, copy)
                    Path(tmp, OWN_DIR).mkdir(exist_ok=True)
                    Path(tmp, OWN_DIR, "inflight.pickle").write_bytes(inflight)
                except BaseException:
                    close_later(later)
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
        pause_ms = round((time.perf_counter() - started) * 1000, 1)
        said = f"; {memory_only} request(s) only in memory (not serializable) are not kept" if memory_only else ""
        said += f"; {lost} request(s) in flight could not be serialized and are not kept" if lost else ""
        _log.info("crawlerkeeper: checkpoint %d: %d seen, %d pending, %d in flight kept, paused %.1f ms%s",
                  number, view.seen, view.pending, len(kept), pause_ms, said)
        record: Dict[str, Any] = {"id": number, "itemsOffset": offset, "snapshot": str(number), "pauseMs": pause_ms}
        if skipped:
            record["skipped"] = skipped
        return record, later, tmp, final
