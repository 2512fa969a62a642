"""What ``ckagent exec`` shows while a task runs: the task's log on stdout, its items in the
``--items`` file, and a progress line at the bottom of stderr when it is a terminal.

The items are the ones the exec's private master stored, in the stream's order, whichever road they
took on the node (CK_ITEMS_FILE / the SDK, declared JSON Lines files streamed live, .json / .csv files
read at the end, crawlee datasets): :class:`Follower` reads the master's item chunks
(:meth:`ckagent.devmaster.store.Store.item_chunks_from`), not one file of the task directory. Each
item is written as the master stored its text — the bytes the spider (or Scrapy's own exporter)
wrote, not encoded again: a Scrapy project's ``--items`` file holds the lines its own
``-o items.jsonl`` would. Before the task, :func:`say_identity` says whom the spider will run as; after
it, :func:`attempt_lines` say its attempts, why each ended (the cause class) and its last checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import trio

from ckagent.delivery.crawlstats import STATS_FILE, read_last_snapshot
from ckagent.delivery.spool import open_spool
from ckagent.node.identity import Identities, IdentityError, runs_as_text
from ckagent.port.statusrows import attempt_text, cause_text, checkpoint_text

READ_BYTES = 4 << 20
"""Bytes of the log read at a time."""

ItemChunks = Callable[[int], list[tuple[int, str]]]
"""``chunks(seq)`` → the master's stored item chunks from item ``seq`` on: ``(count, JSON array text)``."""
_DECODER = json.JSONDecoder()
_JSON_SPACE = " \t\r\n"
_LINE_BREAK = re.compile(r"[\r\n][ \t\r\n]*")


def element_texts(array: str) -> list[str]:
    """The texts of a JSON array's elements, each as it stands in ``array`` (one line each: a raw
    line break is white space between tokens, dropped). Raises ValueError for text that is not an array."""
    pos = len(array) - len(array.lstrip(_JSON_SPACE))
    if array[pos:pos + 1] != "[":
        raise ValueError("not a JSON array")
    pos += 1
    texts: list[str] = []
    while True:
        while pos < len(array) and (array[pos] in _JSON_SPACE or (array[pos] == "," and texts)):
            pos += 1
        if array[pos:pos + 1] == "]":
            return texts
        _value, end = _DECODER.raw_decode(array, pos)
        text = array[pos:end]
        texts.append(_LINE_BREAK.sub("", text) if "\n" in text or "\r" in text else text)
        pos = end


class Terminal:
    """Log bytes to ``out``; a one-line progress at the bottom of ``err`` when it is a terminal."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self.live = err.isatty()
        self._progress = ""
        self._line_open = False  # the last log bytes written did not end a line

    def write_log(self, data: bytes) -> None:
        """Write ``data`` (bytes of the log) to ``out``, keeping the progress line below it."""
        if not data:
            return
        if self.live and self._progress:
            self.err.write("\r\033[K")
            self.err.flush()
        buffer = getattr(self.out, "buffer", None)
        if buffer is not None:
            self.out.flush()
            buffer.write(data)
            buffer.flush()
        else:
            self.out.write(data.decode("utf-8", "replace"))
            self.out.flush()
        self._line_open = not data.endswith(b"\n")
        if self.live and self._progress:
            self.err.write(self._progress)
            self.err.flush()

    def end_line(self) -> None:
        """End the log's last line when it has no line end yet, so what follows starts a line."""
        if self._line_open:
            self.write_log(b"\n")

    def progress(self, text: str) -> None:
        """Show ``text`` as the progress line (only on a terminal)."""
        if not self.live:
            return
        self._progress = text
        self.err.write("\r\033[K" + text)
        self.err.flush()

    def done(self) -> None:
        """Clear the progress line."""
        if self.live and self._progress:
            self.err.write("\r\033[K")
            self.err.flush()
        self._progress = ""


class Follower:
    """Copies the task's output.log to the terminal and the master's items to ``items_path`` (JSON
    lines) as they grow. ``chunks``: see :data:`ItemChunks`."""

    def __init__(self, task_dir: Path, items_path: Path, terminal: Terminal, chunks: ItemChunks) -> None:
        self.task_dir = task_dir
        self.items_path = items_path
        self.terminal = terminal
        self.chunks = chunks
        self.log_offset = 0
        self.items = 0
        self.started = time.monotonic()

    def step(self, final: bool = False) -> None:
        """One look (blocking). ``final``: read the log and the items to their ends (the task is over)."""
        while True:
            chunk = read_from(self.task_dir / "output.log", self.log_offset)
            self.log_offset += len(chunk)
            self.terminal.write_log(chunk)
            if not final or len(chunk) < READ_BYTES:
                break
        while True:
            found = self.chunks(self.items)
            if found:
                with self.items_path.open("a", encoding="utf-8") as fh:
                    for count, data in found:
                        fh.writelines(text + "\n" for text in element_texts(data))
                        self.items += count
            if not final or not found:
                break
        if final:
            return
        snap = read_last_snapshot(self.task_dir / STATS_FILE)
        requests = snap.stats.get("requests") if snap is not None else None
        elapsed = time.monotonic() - self.started
        parts = [f"{self.items} items"]
        if isinstance(requests, int):
            parts.append(f"{requests} requests")
        parts.append(f"{int(elapsed // 60):02d}:{int(elapsed % 60):02d} elapsed")
        self.terminal.progress("[ckagent exec] " + ", ".join(parts))


def read_from(path: Path, offset: int) -> bytes:
    """Up to READ_BYTES of ``path`` from ``offset`` (b"" when it does not exist yet, or is not a regular
    file of the task's: the spider's task dir, never followed to another file nor waited on)."""
    try:
        fd = open_spool(path)
    except OSError:
        return b""
    try:
        return os.pread(fd, READ_BYTES, offset)
    finally:
        os.close(fd)


async def say_identity(identities: Identities | None, spider_id: str, err: TextIO) -> None:
    """The header line saying whom the spider will run as (the agent's identity rules: its uid at
    ``spider-uids``, recorded now as the task would), and the level's notice when spiders share the
    agent's uid or run as root. ``identities`` None: the agent's are not built (nothing said). Blocks
    no more than a worker thread's state store write; cancellation: between the lines."""
    if identities is None:
        return
    try:
        run_as = await trio.to_thread.run_sync(identities.for_spider, spider_id)
    except IdentityError as exc:  # (the task then fails saying so)
        err.write(f"[ckagent exec] the spider cannot get an identity: {exc}\n")
        return
    err.write(f"[ckagent exec] the spider {runs_as_text(run_as, identities.level)}: {identities.details}\n")
    notice = identities.notice()
    if notice is not None:
        err.write(f"[ckagent exec] note: {notice[1]}\n")
    err.flush()


def attempt_lines(task: dict[str, Any]) -> list[str]:
    """The summary lines of a task's attempts and checkpoint, from the exec's master's task JSON
    (``attempts``: each one's status, errorCode, causeClass, retryable; ``checkpoint``: the newest):
    ``attempt 1: FAILED (EXIT_NONZERO), cause spider, not retryable`` for each attempt that ended but
    the last (the outcome line says that one's), then ``cause: …`` of the last and ``last checkpoint: 1-4,
    12 s before the end, 5.1 MiB, items 0–449 (interval)`` — or nothing for a task of one attempt
    that shipped no checkpoint and has no cause to say."""
    lines = []
    attempts = [a for a in task.get("attempts") or () if isinstance(a, dict)]
    for a in attempts[:-1]:
        code = f" ({a['errorCode']})" if a.get("errorCode") else ""
        lines.append(f"[ckagent exec] attempt {a.get('attempt')}: {a.get('status')}{code}, cause {cause_text(a)}")
    last = attempts[-1] if attempts else task
    if cause_text(last) != "—":
        lines.append(f"[ckagent exec] attempt {attempt_text(last.get('attempt'))}, cause: {cause_text(last)}")
    checkpoint = task.get("checkpoint")
    if isinstance(checkpoint, dict):
        lines.append(f"[ckagent exec] last checkpoint: {checkpoint_text(checkpoint)}")
    return lines
