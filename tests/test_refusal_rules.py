"""The pure rules behind issue 23: which 422 drops an element, Retry-After, the disk watch's choice,
SQLite's and the kernel's "disk full", the journal that never tears a record on ENOSPC."""

from __future__ import annotations

import errno
import os
import sqlite3
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import pytest

from ckagent.delivery import LogJournal, parse_journal
from ckagent.delivery.diskwatch import FULL_BYTES, DiskWatch
from ckagent.delivery.shipper import refused_element
from ckagent.master.client import (
    RETRY_AFTER_MAX,
    MasterRejected,
    MasterUnavailable,
    parse_retry_after,
    retry_wait,
)
from ckagent.node.diskfull import SpaceReserve, is_disk_full
from ckagent.node.state import StateStore, StateStoreFull

MIB = 1024 * 1024


@pytest.mark.parametrize(("body", "index"), [
    ({"error": "bad", "field": "items[3]"}, 3),
    ({"error": "bad", "field": "items[0].price"}, 0),
    ({"error": "bad", "field": "lines[1]"}, None),  # another stream's field
    ({"error": "bad", "field": "seq"}, None),  # not an element
    ({"error": "bad", "field": "items[9]"}, None),  # not in this batch of 5
    ({"error": "bad"}, None),
])
def test_only_a_422_naming_an_element_drops_it(body: dict[str, str], index: int | None) -> None:
    assert refused_element(MasterRejected("items", 422, body), "items", 5) == index
    assert refused_element(MasterRejected("items", 400, body), "items", 5) is None


def test_retry_after_in_seconds_or_as_a_date_bounded() -> None:
    now = 1_800_000_000.0
    assert parse_retry_after("30") == 30.0
    date = format_datetime(datetime.fromtimestamp(now, timezone.utc) + timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(date, now=now) == pytest.approx(90.0)
    assert parse_retry_after("86400") == RETRY_AFTER_MAX
    assert parse_retry_after("0") is None and parse_retry_after("soon") is None and parse_retry_after(None) is None
    assert retry_wait(MasterUnavailable("x", 30.0)) == 30.0 and retry_wait(MasterUnavailable("x")) is True
    assert retry_wait(ValueError()) is False


def test_the_disk_watch_stops_the_task_that_grows_before_it_crosses_the_floor() -> None:
    watch = DiskWatch(floor_bytes=100 * MIB, interval=1.0)
    assert watch.observe(0.0, 500 * MIB, {"a": 0, "b": 0}) == []
    assert watch.observe(1.0, 480 * MIB, {"a": 20 * MIB, "b": 10}) == []  # far from the floor
    assert watch.next_interval() == 1.0
    stop = watch.observe(2.0, 200 * MIB, {"a": 300 * MIB, "b": 20})  # 280 MiB/s: the floor within a look
    assert [task for task, _ in stop] == ["a"] and "280.0 MiB/s" in stop[0][1]
    assert watch.observe(3.0, 150 * MIB, {"a": 350 * MIB, "b": 30}) == []  # each task once
    assert watch.next_interval() < 1.0  # the free space falls fast: look sooner


def test_below_the_floor_a_trickle_is_not_blamed_but_on_a_full_disk_any_growth_is() -> None:
    watch = DiskWatch(floor_bytes=100 * MIB, interval=1.0)
    watch.observe(0.0, 50 * MIB, {"log": 0})
    assert watch.observe(1.0, 50 * MIB, {"log": 4096}) == []  # someone else filled it
    assert [t for t, _ in watch.observe(2.0, FULL_BYTES - 1, {"log": 8192})] == ["log"]  # full: any growth
    full = DiskWatch(floor_bytes=0)
    full.observe(0.0, 10 * MIB, {"t": 0})
    assert [t for t, _ in full.observe(1.0, 10 * MIB, {"t": 100}, disk_was_full=True)] == ["t"]


def test_disk_full_errors_are_recognised() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))
    assert not is_disk_full(OSError(errno.EIO, "I/O error"))
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))


def test_a_full_state_store_releases_the_reserve_then_says_so(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    reserve = store.reserve = SpaceReserve(tmp_path, 64 * 1024)
    assert reserve.restore() and reserve.held
    calls = []

    def full_once(*args: object) -> list[tuple[object, ...]]:
        calls.append(args)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return []

    assert store._unless_full(full_once, "x") == [] and len(calls) == 2  # retried after the release
    assert not reserve.held and reserve.released_at is not None

    def always_full(*args: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    with pytest.raises(StateStoreFull, match="disk is full"):
        store._unless_full(always_full)
    store.close()


def test_the_journal_keeps_records_a_full_disk_refused_and_never_tears_one(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    journal = LogJournal(tmp_path)
    journal.open()
    journal.note({"output.log": 10})
    real_write = os.write
    full = True

    def write(fd: int, data: bytes | memoryview) -> int:
        if full and fd == journal._fd:
            real_write(fd, bytes(data)[:3])  # a torn start, then no space
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    journal.note({"output.log": 20})
    assert journal.unwritten and not journal.flush()
    records, good = parse_journal((tmp_path / "output.journal").read_bytes())
    assert good == len((tmp_path / "output.journal").read_bytes())  # nothing torn
    full = False
    journal.end({"output.log": 30})
    assert journal.flush()
    records, _ = parse_journal((tmp_path / "output.journal").read_bytes())
    assert [(kind, arg) for _, kind, _, arg in records if kind == "D"] == [("D", "10"), ("D", "20"), ("D", "30")]
    assert records[-1][1] == "E"
    journal.close()
