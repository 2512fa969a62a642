"""FileWatch: a file's modifications from inotify, its instances kept for reuse (closing one makes the
kernel wait for a grace period: 10–20 ms on the Trio loop, see ckagent/containment/filewatch.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from ckagent.containment import filewatch
from ckagent.containment.filewatch import KEPT_INSTANCES, FileWatch


@pytest.fixture(autouse=True)
def no_kept_instances() -> None:
    """Each test starts with no kept instances (and closes what it left)."""
    while filewatch._kept:
        os.close(filewatch._kept.pop())


async def test_a_write_is_reported_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "output.log"
    path.write_text("")
    with FileWatch(path) as watch:
        assert not watch.drain()
        with trio.move_on_after(0.2) as quiet:
            await watch.changed()
        assert quiet.cancelled_caught, "no write, no report"
        with path.open("a") as fh:
            fh.write("x")
        with trio.fail_after(5):
            await watch.changed()
        assert not watch.drain(), "changed() consumed the event"


async def test_a_reused_instance_reports_only_its_own_file(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_text("")
    second.write_text("")
    watch = FileWatch(first)
    fd = watch.fd
    first.write_text("left unread")  # queued on the instance, never consumed by its user
    watch.close()
    assert watch.fd == -1
    os.fstat(fd)  # kept open for the next watch, not closed
    again = FileWatch(second)
    assert again.fd == fd, "the kept instance is reused"
    assert not again.drain(), "the first file's modification is not the second's"
    first.write_text("after the close")
    with trio.move_on_after(0.2) as quiet:
        await again.changed()
    assert quiet.cancelled_caught, "the first file is no longer watched"
    second.write_text("now")
    with trio.fail_after(5):
        await again.changed()
    again.close()
    again.close()  # idempotent


def test_at_most_kept_instances_stay_open(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("")
    watches = [FileWatch(path) for _ in range(KEPT_INSTANCES + 3)]
    fds = [w.fd for w in watches]
    for w in watches:
        w.close()
    assert sorted(filewatch._kept) == sorted(fds[:KEPT_INSTANCES])
    for fd in fds[KEPT_INSTANCES:]:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_file_that_cannot_be_watched_raises_and_keeps_the_instance(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="inotify_add_watch"):
        FileWatch(tmp_path / "missing")
    assert len(filewatch._kept) == 1
