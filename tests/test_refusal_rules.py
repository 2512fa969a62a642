"""The pure rules behind issue 23: which 422 drops an element, Retry-After, the journal that never
tears a record on ENOSPC (the disk watch's choice and "disk full": tests/test_diskfull_logic.py)."""

from __future__ import annotations

import errno
import os
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import pytest

from ckagent.delivery import LogJournal, parse_journal
from ckagent.delivery.flight import refused_element
from ckagent.master.client import (
    RETRY_AFTER_MAX,
    MasterRejected,
    MasterUnavailable,
    parse_retry_after,
    retry_wait,
)

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
