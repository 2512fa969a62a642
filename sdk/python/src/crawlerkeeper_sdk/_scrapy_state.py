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
   (and a project's own JOBDIR) is copied to ``CK_SNAPSHOT_DIR/N.tmp``, the close-time files are
   written into the copy, which is renamed ``N``; the ack line goes to ``CK_CONTROL_ACK_FILE``
   (``{"id", "itemsOffset", "snapshot", "pauseMs"}``, or ``{"id", "error"}``).

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
import json
import logging
import os
import pickle
import shutil
import time
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

from crawlerkeeper_sdk._scrapy_jobdir import JobdirError, copy_tree, jobdir_view, write_patches

__all__ = ["JOBDIR_NAME", "TICK_SECONDS", "CrawlerKeeperState", "default_jobdir"]

_log = logging.getLogger("crawlerkeeper_sdk.scrapy")

JOBDIR_NAME = "jobdir"
"""The JOBDIR's name inside ``CK_STATE_DIR`` and inside every snapshot."""
OWN_DIR = "scrapy"
"""The hook's own files inside ``CK_STATE_DIR``: ``inflight.pickle``, ``start.seen``."""
TICK_SECONDS = 0.2
"""How often the control file is looked at (a stat)."""


def default_jobdir() -> Optional[str]:
    """``$CK_STATE_DIR/jobdir`` when the hook's ``state`` mode is on, else None."""
    state_dir = os.environ.get("CK_STATE_DIR")
    if not state_dir or "state" not in os.environ.get("CK_SCRAPY_HOOK", "").split(","):
        return None
    return os.path.join(state_dir, JOBDIR_NAME)


def _read_ids(path: Optional[str]) -> Set[int]:
    answered: Set[int] = set()
    if not path:
        return answered
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                answered.add(int(json.loads(line)["id"]))
    return answered


class _Channel:
    """The control file (requests in) and the ack file (answers out) of ``CK_CONTROL_FILE`` / ``_ACK_FILE``."""

    def __init__(self, control: str, ack: str) -> None:
        self.control = control
        self.ack = ack
        self.offset = 0
        self.answered = _read_ids(ack)
        self.fd: Optional[int] = None

    def _locked(self) -> bool:
        """Whether this process answers (it holds flock on the ack file, as the SDK's watcher does)."""
        if self.fd is not None:
            return True
        try:
            fd = os.open(self.ack, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.fd = fd
        self.answered |= _read_ids(self.ack)
        return True

    def poll(self) -> List[Dict[str, Any]]:
        """New unanswered requests (a stat, then a read of what was appended); [] when none."""
        try:
            size = os.stat(self.control).st_size
        except OSError:
            return []
        if size <= self.offset or not self._locked():
            return []
        with open(self.control, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1
        self.offset += end
        found = []
        for line in data[:end].splitlines():
            try:
                request = json.loads(line)
                ok = isinstance(request, dict) and isinstance(request.get("id"), int) and request["id"] >= 0
            except ValueError:
                ok = False
            if ok and request["id"] not in self.answered:
                found.append(request)
        return found

    def answer(self, record: Dict[str, Any]) -> None:
        """Append one ack line (one write on O_APPEND)."""
        self.answered.add(record["id"])
        assert self.fd is not None
        os.write(self.fd, (json.dumps(record) + "\n").encode())


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

        default = default_jobdir()
        if default is None:
            raise NotConfigured("the agent asked for no state (CK_SCRAPY_HOOK, CK_STATE_DIR)")
        ext = cls(crawler, Path(os.environ["CK_STATE_DIR"]), default)
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
        self.loop: Any = None
        control, ack = os.environ.get("CK_CONTROL_FILE"), os.environ.get("CK_CONTROL_ACK_FILE")
        self.channel = _Channel(control, ack) if control and ack else None
        if self.own_jobdir:
            self._restore_own_jobdir()
        elif not jobdir:
            _log.warning("crawlerkeeper: the project turned JOBDIR off: this crawl's state cannot be saved, "
                         "a new attempt starts from scratch")

    # -- start and resume ---------------------------------------------------------------------------

    def _restore_own_jobdir(self) -> None:
        assert self.jobdir is not None
        restored = self.state_dir / JOBDIR_NAME
        target = Path(self.jobdir)
        with contextlib.suppress(OSError):
            if any(target.iterdir()):
                _log.info("crawlerkeeper: the project's JOBDIR %s is kept in every checkpoint", self.jobdir)
                return
        if not restored.is_dir():
            _log.info("crawlerkeeper: the project's JOBDIR %s is kept in every checkpoint", self.jobdir)
            return
        with contextlib.suppress(FileNotFoundError):
            target.rmdir()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(restored, target, symlinks=True)
        _log.info("crawlerkeeper: the project's JOBDIR %s is put back from the checkpoint", self.jobdir)

    def spider_opened(self, spider: Any) -> None:
        """Resume what the checkpoint kept in flight, start the control file's watch."""
        self.own.mkdir(parents=True, exist_ok=True)
        start_path = self.own / "start.seen"
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
        fingerprint = self.crawler.request_fingerprinter.fingerprint(request).hex()
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
        if request is None or slot is None or request not in slot.inprogress or request in self.done:
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
            requests = self.channel.poll()
            if not requests:
                return
            newest = requests[-1]
            for older in requests[:-1]:
                self.channel.answer({"id": older["id"], "error": f"superseded by request {newest['id']}"})
            self._answer(newest)
        except Exception:  # never into the crawl
            _log.exception("crawlerkeeper: cannot answer the agent's persist request")

    def _answer(self, request: Dict[str, Any]) -> None:
        assert self.channel is not None
        event, number = request.get("event"), request["id"]
        if event not in ("persistState", "migrating"):
            self.channel.answer({"id": number, "error": f"unknown event {event!r}"})
            return
        try:
            record = self.persist(number)
        except (JobdirError, OSError, ValueError) as exc:
            _log.error("crawlerkeeper: checkpoint %d failed: %s", number, exc)
            self.channel.answer({"id": number, "error": str(exc)[:1000]})
            return
        self.channel.answer(record)
        if event == "migrating":
            _log.info("crawlerkeeper: migrating, %.1f s left: the crawl's state is saved (checkpoint %d)",
                      float(request.get("secondsLeft") or 0.0), number)

    def persist(self, number: int) -> Dict[str, Any]:
        """Snapshot ``number`` (module docstring, steps 1–3) within this reactor step; returns the ack record.

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
        snapshots = Path(os.environ.get("CK_SNAPSHOT_DIR") or self.state_dir.parent / "snapshots")
        snapshots.mkdir(parents=True, exist_ok=True)
        tmp, final = snapshots / f"{number}.tmp", snapshots / str(number)
        for leftover in (tmp, final):
            if leftover.exists():
                shutil.rmtree(leftover)
        import crawlerkeeper_sdk

        with crawlerkeeper_sdk._lock:
            items = os.environ.get("CK_ITEMS_FILE")
            try:
                offset = os.stat(items).st_size if items else 0
            except FileNotFoundError:
                offset = 0
            size, _skipped = copy_tree(self.state_dir, tmp)
            copy = tmp / JOBDIR_NAME
            if self.own_jobdir:
                if copy.exists():
                    shutil.rmtree(copy)
                size += copy_tree(Path(self.jobdir), copy)[0]
            write_patches(view, copy)
            (tmp / OWN_DIR).mkdir(exist_ok=True)
            (tmp / OWN_DIR / "inflight.pickle").write_bytes(inflight)
            os.rename(tmp, final)
        pause_ms = round((time.perf_counter() - started) * 1000, 1)
        said = f"; {memory_only} request(s) only in memory (not serializable) are not kept" if memory_only else ""
        said += f"; {lost} request(s) in flight could not be serialized and are not kept" if lost else ""
        _log.info("crawlerkeeper: checkpoint %d: %d seen, %d pending, %d in flight, %d bytes, paused %.1f ms%s",
                  number, view.seen, view.pending, len(kept), size, pause_ms, said)
        return {"id": number, "itemsOffset": offset, "snapshot": str(number), "pauseMs": pause_ms}
