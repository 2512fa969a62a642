"""A full disk is the writer's problem: the pure rules (who is blamed, when) and the parts that hold
the agent's room beforehand, each on real files (a tmpfs the test mounts where it needs a full disk).

- the judgement: accounted use against a share, not who grew between two looks (over_share,
  DiskWatch.observe / judge_end); a disk limit of a task's own; the culprit kept for the status page;
- the accounting (hard links once, the data dir's kept outputs left out) and the scratch reclaim
  (spool kept, nothing followed through a link);
- room owned beforehand: blocks held beyond a spool file's end, the state store's own free pages —
  its writes go on while a burst holds every other byte of the disk; output.log never cut for it;
- the SDK waits a full disk out instead of losing an item.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio
from harness import can_mount_tmpfs, fill_disk, small_disk
from hypothesis import given, settings
from hypothesis import strategies as st

from ckagent.delivery import LogJournal, LogSink, parse_journal
from ckagent.delivery.diskwatch import (
    FULL_BYTES,
    MIN_CULPRIT_BYTES,
    Accounted,
    DiskWatch,
    accounted_bytes,
    over_share,
    reclaim_scratch,
    tree_bytes,
)
from ckagent.master.protocol import TaskResources
from ckagent.node.diskfull import (
    OLD_RESERVE_FILE,
    STORE_RESERVE_BYTES,
    is_disk_full,
    preallocate,
    release_beyond,
    remove_old_reserve,
)
from ckagent.node.state import StateStore, StateStoreFull

MIB = 1024 * 1024
SDK_SRC = Path(__file__).resolve().parents[1] / "sdk" / "python" / "src"
NODE_SDK = Path(__file__).resolve().parents[1] / "sdk" / "node" / "crawlerkeeper-sdk.cjs"


# ---------------------------------------------------------------------------------------------- judgement


def test_the_task_holding_the_disk_is_blamed_not_the_one_that_grew_since_the_last_look() -> None:
    watch = DiskWatch(floor_bytes=16 * MIB, interval=1.0, clock=lambda: 1234.0)
    assert watch.observe(0.0, 100 * MIB, {"burst": 1 * MIB, "quiet": 1 * MIB}) == []
    # Between two looks the burst took the disk (0 free) and stopped writing; the quiet one went on.
    stops = watch.observe(1.0, 0, {"burst": 101 * MIB, "quiet": 1 * MIB + 20_000})
    assert [task for task, _ in stops] == ["burst"]
    assert "held 101.0 MiB" in stops[0][1] and "the disk was full" in stops[0][1]
    assert watch.last_culprit is not None and watch.last_culprit.task_id == "burst"
    assert watch.last_culprit.used_bytes == 101 * MIB and watch.last_culprit.at == 1234.0
    # While it is being stopped, its bytes count as coming back: the neighbour is never blamed for them.
    assert watch.observe(2.0, 0, {"burst": 101 * MIB, "quiet": 1 * MIB + 40_000}) == []
    watch.reclaimed("burst")
    assert watch.blamed("burst") is None and watch.last_culprit.task_id == "burst"  # kept for the page


def test_a_disk_filled_by_another_program_blames_no_task() -> None:
    watch = DiskWatch(floor_bytes=40 * MIB)
    watch.observe(0.0, 200 * MIB, {"a": 3 * MIB, "b": 2 * MIB})
    assert watch.observe(1.0, 1 * MIB, {"a": 3 * MIB + 4096, "b": 2 * MIB}) == []
    assert watch.last_culprit is None
    # The pure rule: nobody holds the deficit → nobody; one task over its share holding it → that one.
    assert over_share({"a": 3 * MIB, "b": 2 * MIB}, 0, 40 * MIB) is None
    assert over_share({"a": 90 * MIB, "b": 2 * MIB}, 0, 40 * MIB) == ("a", 26 * MIB)
    assert over_share({"only": 90 * MIB}, 10 * MIB, 40 * MIB) == ("only", 60 * MIB)
    assert over_share({"a": 60 * MIB, "b": 60 * MIB}, 0, 16 * MIB, blamed={"a"}) == ("b", 52 * MIB)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 1 << 40), min_size=1, max_size=8),
       st.integers(0, 1 << 40), st.integers(0, 1 << 36))
def test_the_blamed_task_holds_the_missing_bytes_and_more_than_its_share(sizes: dict[str, int], free: int,
                                                                        critical: int) -> None:
    verdict = over_share(sizes, free, critical)
    least = max(MIN_CULPRIT_BYTES, critical - free)
    if verdict is None:  # then nobody is over its share while holding the missing bytes
        share = (sum(sizes.values()) + free - critical) / len(sizes)
        assert not any(used > share and used >= least for used in sizes.values())
        return
    task, share = verdict
    assert sizes[task] > share and sizes[task] >= least
    assert sizes[task] == max(used for used in sizes.values() if used > share and used >= least)
    assert over_share(sizes, free, critical, blamed={task}) != (task, share)  # never twice


def test_a_fast_writer_is_stopped_before_it_crosses_the_floor() -> None:
    watch = DiskWatch(floor_bytes=100 * MIB, interval=1.0)
    assert watch.observe(0.0, 500 * MIB, {"a": 0, "b": 0}) == []
    assert watch.observe(1.0, 480 * MIB, {"a": 20 * MIB, "b": 10}) == []  # far from the floor
    assert watch.next_interval() == 1.0
    stop = watch.observe(2.0, 200 * MIB, {"a": 300 * MIB, "b": 20})  # 280 MiB/s: the floor within a look
    assert [task for task, _ in stop] == ["a"] and "280.0 MiB/s" in stop[0][1]
    assert watch.observe(3.0, 150 * MIB, {"a": 350 * MIB, "b": 30}) == []  # each task once
    assert watch.next_interval() < 1.0  # the free space falls fast: look sooner


def test_a_burst_that_exited_before_any_look_is_judged_at_its_end() -> None:
    watch = DiskWatch(floor_bytes=16 * MIB)
    watch.observe(0.0, 100 * MIB, {"quiet": 2 * MIB})
    watch.observe(1.0, 100 * MIB, {"quiet": 2 * MIB})  # the burst ran and exited between these looks
    reason = watch.judge_end("burst", 98 * MIB, 0)
    assert reason is not None and "when it ended" in reason and watch.blamed("burst") == reason
    assert watch.judge_end("quiet", 2 * MIB, 0) is None  # the neighbour ending meanwhile: not blamed
    assert watch.judge_end("fine", 50 * MIB, 60 * MIB) is None  # a disk above the floor blames nobody


def test_a_task_over_its_own_disk_limit_is_stopped_whatever_the_free_space() -> None:
    watch = DiskWatch(floor_bytes=0)
    watch.set_limit("capped", 8 * MIB)
    assert watch.observe(0.0, 10_000 * MIB, {"capped": 7 * MIB, "free": 500 * MIB}) == []
    stops = watch.observe(1.0, 10_000 * MIB, {"capped": 9 * MIB, "free": 600 * MIB})
    assert [t for t, _ in stops] == ["capped"] and "disk limit of 8.0 MiB" in stops[0][1]
    assert watch.observe(2.0, 10_000 * MIB, {"capped": 12 * MIB, "free": 700 * MIB}) == []  # once
    other = DiskWatch(floor_bytes=0)
    other.set_limit("ended", 8 * MIB)
    assert "disk limit" in (other.judge_end("ended", 9 * MIB, 10_000 * MIB) or "")
    assert DiskWatch(floor_bytes=0).critical_bytes == FULL_BYTES


def test_resources_carry_the_disk_limit() -> None:
    resources = TaskResources.from_json({"diskBytes": 64 * MIB, "cpus": 1}, "resources")
    assert resources.disk_bytes == 64 * MIB and resources.to_json()["diskBytes"] == 64 * MIB
    assert TaskResources.from_json(None, "resources").disk_bytes is None


# ---------------------------------------------------------------------------------------------- accounting


def test_the_accounting_counts_a_hard_link_once_and_leaves_kept_outputs_out(tmp_path: Path) -> None:
    task_dir, work, data = (tmp_path / name for name in ("task", "work", "data"))
    for path in (task_dir, work, data / "outputs" / "old-task"):
        path.mkdir(parents=True)
    (work / "big.bin").write_bytes(b"x" * (2 * MIB))
    os.link(work / "big.bin", task_dir / "linked.bin")  # e.g. a declared item file's link
    (data / "cache.bin").write_bytes(b"y" * MIB)
    (data / "outputs" / "old-task" / "kept.bin").write_bytes(b"z" * (4 * MIB))
    (task_dir / "escape").symlink_to(data / "outputs")  # never followed
    used = accounted_bytes(Accounted((task_dir, work, data)))
    assert 3 * MIB <= used < 3 * MIB + 64 * 1024
    assert tree_bytes(data) >= 5 * MIB and tree_bytes(data, skip_top=("outputs",)) < 2 * MIB


def test_reclaim_removes_scratch_and_keeps_the_spool(tmp_path: Path) -> None:
    task_dir, work, data = (tmp_path / name for name in ("task", "work", "data"))
    for path in (task_dir / "logs", task_dir / "tmp", task_dir / "artifacts", work, data / "outputs" / "t0", data / "db"):
        path.mkdir(parents=True)
    for name in ("output.log", "items.jsonl", "output.journal", "exit-status", "stats.jsonl", "artifacts.json",
                 "blob.bin", "logs/scrapy.log", "tmp/x", "artifacts/a.csv"):
        (task_dir / name).write_bytes(b"data\n")
    (task_dir / "blob.bin").write_bytes(b"x" * MIB)
    (work / "main.py").write_text("print(1)\n")
    (data / "db" / "cache.sqlite").write_bytes(b"c" * MIB)
    (data / "outputs" / "t0" / "kept.csv").write_text("kept\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("not the task's\n")
    (task_dir / "link-out").symlink_to(outside)
    removed, freed = reclaim_scratch(Accounted((task_dir, work, data)), keep={"logs/scrapy.log"})
    assert sorted(p.name for p in task_dir.iterdir()) == sorted(
        ["output.log", "items.jsonl", "output.journal", "exit-status", "stats.jsonl", "artifacts.json", "logs",
         "artifacts"])
    assert not work.exists() and sorted(p.name for p in data.iterdir()) == ["outputs"]
    assert outside.read_text() == "not the task's\n" and (data / "outputs" / "t0" / "kept.csv").exists()
    assert freed >= 2 * MIB and any("blob.bin" in words for words in removed) and "working copy" in " ".join(removed)


# ---------------------------------------------------------------------------------------------- room owned beforehand


def test_disk_full_errors_are_recognised() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))
    assert not is_disk_full(OSError(errno.EIO, "I/O error"))
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))


def test_an_earlier_agents_spare_file_is_removed(tmp_path: Path) -> None:
    (tmp_path / OLD_RESERVE_FILE).write_bytes(b"\0" * 4096)
    remove_old_reserve(tmp_path)
    remove_old_reserve(tmp_path)  # gone already: no error
    assert not (tmp_path / OLD_RESERVE_FILE).exists()


def test_the_state_store_keeps_free_pages_of_its_own(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    try:
        held = store.keep_reserve()
        assert held >= STORE_RESERVE_BYTES
        size = (tmp_path / "state.db").stat().st_size
        assert store.keep_reserve() == held  # held already: nothing written again
        for i in range(200):
            store.add_task(f"t{i}", "s", {"id": f"t{i}", "env": {"A": "x" * 500}}, tmp_path / f"t{i}")
        assert (tmp_path / "state.db").stat().st_size == size  # the rows went into its own pages
    finally:
        store.close()


@pytest.mark.skipif(can_mount_tmpfs() is not None, reason=f"a small disk of the test's own: {can_mount_tmpfs()}")
async def test_on_a_full_disk_the_state_store_journal_and_a_spiders_stdout_go_on(tmp_path: Path) -> None:
    """A burst takes every byte of the disk: the agent's books and a neighbour's output go on in the
    room they own beforehand; output.log is never cut for the full disk; the SDK waits the disk out."""
    with trio.fail_after(60), small_disk(tmp_path / "disk", 48 * MIB) as disk:
        store = StateStore(disk / "state.db")
        store.keep_reserve()
        store.add_task("n", "s", {"id": "n"}, disk / "n")
        bare = StateStore(disk / "bare.db")  # the same store without pages of its own
        bare.add_task("n", "s", {"id": "n"}, disk / "n")
        task_dir = disk / "n"
        task_dir.mkdir()
        sink = LogSink(task_dir / "output.log")
        journal = LogJournal(task_dir)
        journal.open()
        items = task_dir / "items.jsonl"
        fd = os.open(items, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        assert preallocate(fd, MIB) == MIB
        os.close(fd)
        blob = fill_disk(disk / "burst.bin")
        assert os.statvfs(disk).f_bavail == 0
        # The state store: positions and a result, in its own pages.
        for i in range(50):
            store.save_stream_positions({("n", "logs"): (i, {"j": i})})
        store.set_result("n", {"status": "SUCCESS", "pad": "r" * 2000})
        with pytest.raises(StateStoreFull):  # without them the first writes fail on the full disk
            for i in range(50):
                bare.save_stream_positions({("n", "logs"): (i, {"j": i})})
            bare.set_result("n", {"status": "SUCCESS", "pad": "r" * 2000})
        bare.close()
        # A spider writing its stdout straight into output.log (as the monitor arranges): not refused.
        spider = os.open(task_dir / "output.log", os.O_WRONLY | os.O_APPEND)
        for i in range(200):
            os.write(spider, f"quiet line {i:04d}\n".encode())
        os.close(spider)
        assert sink.grown() == 200 * 16 and sink.truncated is None
        journal.note({"output.log": sink.size})
        assert not journal.unwritten
        # The SDK on the full disk (its headroom used up): it waits, and the item lands once space is back.
        fd = os.open(items, os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"p" * (MIB - 100))  # the headroom nearly used
        os.close(fd)
        code = ("import crawlerkeeper_sdk as ck, time\n"
                "t = time.monotonic(); ck.save_item({'n': 1, 'pad': 'q' * 8000}); print(time.monotonic() - t)\n")
        child = subprocess.Popen(  # noqa: ASYNC220 - polled, then waited for in a thread
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(SDK_SRC), "CK_ITEMS_FILE": str(items)})
        await trio.sleep(0.5)  # the child blocks on the full disk meanwhile
        assert child.poll() is None
        blob.unlink()  # the culprit's scratch reclaimed
        out, _ = await trio.to_thread.run_sync(child.communicate)
        assert child.returncode == 0 and float(out) >= 0.2  # it waited for the room
        assert items.read_bytes().endswith(b'{"n": 1, "pad": "' + b"q" * 8000 + b'"}\n')
        node = shutil.which("node")
        if node is not None:  # the Node SDK waits the same way
            hog = fill_disk(disk / "hog.bin")
            script = (f"const ck = require({json.dumps(str(NODE_SDK))}); const t = Date.now();"
                      "ck.saveItem({n: 2, pad: 'w'.repeat(9000)}); console.log((Date.now() - t) / 1000);")
            child = subprocess.Popen(  # noqa: ASYNC220 - polled, then waited for in a thread
                [node, "-e", script], stdout=subprocess.PIPE, text=True,
                env={**os.environ, "CK_ITEMS_FILE": str(items)})
            await trio.sleep(0.5)
            assert child.poll() is None
            hog.unlink()
            out, _ = await trio.to_thread.run_sync(child.communicate)
            assert child.returncode == 0 and float(out) >= 0.2
            assert items.read_bytes().endswith(b'{"n":2,"pad":"' + b"w" * 9000 + b'"}\n')
        sink.close()
        journal.close()
        records, _ = parse_journal((task_dir / "output.journal").read_bytes())
        assert ("D", str(200 * 16)) in [(kind, arg) for _, kind, _, arg in records]
        assert (task_dir / "output.log").read_bytes() == b"".join(f"quiet line {i:04d}\n".encode()
                                                                  for i in range(200))
        assert store.get("n") is not None and store.stream_position("n", "logs")[0] == 49
        store.close()


def test_the_agents_own_output_waits_for_room_instead_of_being_dropped(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    sink = LogSink(tmp_path / "output.log", headroom=0)
    real_write = os.write
    full = True

    def write(fd: int, data: bytes | memoryview) -> int:
        if full and fd == sink.fileno():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    sink.write(b"installing 1\n")
    sink.write(b"installing 2\n")
    assert sink.size == 0 and sink.full_since is not None and sink.truncated is None
    full = False
    assert sink.retry() and sink.full_since is None
    sink.write_line(b"[ckagent] done\n")
    sink.close()
    assert (tmp_path / "output.log").read_bytes() == b"installing 1\ninstalling 2\n[ckagent] done\n"


def test_blocks_held_beyond_the_end_are_given_back(tmp_path: Path) -> None:
    path = tmp_path / "output.log"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"line\n")
        if preallocate(fd, MIB) == 0:
            pytest.skip("this filesystem cannot preallocate")
        st = os.fstat(fd)
        assert st.st_size == 5 and st.st_blocks * 512 >= MIB
        release_beyond(fd)
        st = os.fstat(fd)
        assert st.st_size == 5 and st.st_blocks * 512 < 64 * 1024
    finally:
        os.close(fd)


def test_a_write_after_the_reserve_is_used_up_says_so(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")

    def always_full(*args: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    with pytest.raises(StateStoreFull, match="disk is full"):
        store._unless_full(always_full)
    store.close()


@pytest.mark.skipif(can_mount_tmpfs() is not None, reason=f"a small disk of the test's own: {can_mount_tmpfs()}")
@pytest.mark.parametrize("run_as_other", [False, True], ids=["agent-uid", "spider-uid"])
def test_a_spider_that_fills_the_disk_still_has_its_exit_status_recorded(run_as_other: bool) -> None:
    """The monitor writes the spider's ``$?`` into a file made beforehand with its block held: a spider
    that took every byte of the disk before it exited still has its true exit kept for a later agent."""
    from ckagent.containment.monitor import STATUS_FILE, read_status, spawn_monitored
    from ckagent.containment.process_group import ProcessGroupJail
    from ckagent.node.runas import RunAs

    # The spider's uid must reach its task dir, as it does on a node: not below pytest's private tmp.
    top = Path(tempfile.mkdtemp(prefix="ck-exit-status-"))
    top.chmod(0o711)
    with contextlib.ExitStack() as undo:
        undo.callback(shutil.rmtree, top, True)
        disk = undo.enter_context(small_disk(top / "disk", 8 * MIB))
        task_dir, work = disk / "task", disk / "work"
        task_dir.mkdir()
        work.mkdir()
        run_as = None
        if run_as_other:  # a uid of no passwd entry, as the spider-uids level gives
            os.chown(task_dir, 64123, 64123)
            os.chown(work, 64123, 64123)
            run_as = RunAs("ck-64123", 64123, 64123, (), str(work), dynamic=True)
        env = {"PATH": "/usr/bin:/bin", "CK_TASK_ID": "filler"}
        filler = "head -c 64000000 /dev/zero >big 2>/dev/null; exit 3"
        mon = spawn_monitored(["sh", "-c", filler], cwd=work, env=env, task_id="filler", task_dir=task_dir,
                              output_path=task_dir / "output.log", jail=ProcessGroupJail("filler"), run_as=run_as,
                              deadline_at=None, work=work, stall_timeout=0.0)
        assert mon.popen.wait(timeout=30) == 3
        assert os.statvfs(disk).f_bavail == 0  # the spider did take every byte
        st = os.stat(task_dir / STATUS_FILE)
        assert (st.st_uid, st.st_size) == ((64123 if run_as_other else 0), 2), (st, (task_dir / STATUS_FILE).read_bytes())
        assert read_status(task_dir / STATUS_FILE) == 3
