"""The Python SDK's state API and the spider's side of the control channel (issue 38), with real processes.

Each test starts a real spider process (the SDK importable, never imported here) and plays the agent:
it appends requests to the control file, reads the answers, and checks the snapshot dir and the items
offset against the items the spider wrote (tests/harness/spiderstate.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import (
    SPIDER_TIMEOUT,
    Spiders,
    TaskFiles,
    find_python,
    missing_python,
    read_jsonl,
    sdk_env,
    small_disk,
    start_spider,
)


@pytest.fixture
def spiders() -> Iterator[Spiders]:
    group = Spiders()
    yield group
    group.close()


def snapshot_state(task: TaskFiles, answer: dict[str, Any]) -> Any:
    path = task.snapshots / answer["snapshot"] / "state.json"
    return json.loads(path.read_text())


# Three threads save items as fast as they can, each under state_lock() with the state change that
# accounts for the item; the persist callback returns the live counts.
HAMMER = """
import threading, time, sys
import crawlerkeeper_sdk as ck
counts = {"a": 0, "b": 0, "c": 0}
stop = threading.Event()
def writer(k):
    while not stop.is_set():
        with ck.state_lock():
            ck.save_item({"w": k, "i": counts[k], "pad": "x" * (counts[k] % 50)})
            counts[k] += 1
        if counts[k] % 5 == 0:
            time.sleep(0.001)
def noise():  # items no state accounts for, written without the state lock
    n = 0
    while not stop.is_set():
        ck.save_item({"noise": n}); n += 1
        time.sleep(0.001)
ck.on_persist(lambda: {"counts": counts})
threads = [threading.Thread(target=writer, args=(k,)) for k in counts] + [threading.Thread(target=noise)]
for t in threads: t.start()
print("ready", flush=True)
sys.stdin.read()
stop.set()
for t in threads: t.join()
"""


def test_each_snapshot_holds_the_state_of_exactly_the_items_before_its_offset(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    proc = spiders.start(HAMMER, task.env())
    answers = []
    for rid in range(1, 9):
        task.request(rid, reason="interval")
        answers.append(task.wait_ack(rid, proc=proc))
    spiders.finish(proc)
    offsets = [a["itemsOffset"] for a in answers]
    assert offsets == sorted(offsets) and offsets[0] > 0
    for answer in answers:
        assert answer["snapshot"] == str(answer["id"]) and isinstance(answer["pauseMs"], float), answer
        counts = snapshot_state(task, answer)["counts"]
        kept = [item for item in task.items_before(answer["itemsOffset"]) if "w" in item]
        for writer in ("a", "b", "c"):
            # exactly the items the state accounts for: none missing, none beyond
            assert [item["i"] for item in kept if item["w"] == writer] == list(range(counts[writer])), answer
    assert sorted(p.name for p in task.snapshots.iterdir()) == sorted(str(rid) for rid in range(1, 9))
    assert [a["id"] for a in task.acks()] == list(range(1, 9))  # each answered once


def test_without_callbacks_the_offset_is_that_of_the_last_persist_state(tmp_path: Path, spiders: Spiders) -> None:
    # The spider persists its state itself after each item; requests come at any moment: the items
    # offset is the one at its last persist_state(), not the items file's size at the copy.
    code = """
        import sys, threading, time
        import crawlerkeeper_sdk as ck
        stop = threading.Event()
        def crawl():
            n = ck.load_state({"n": 0})["n"]
            while not stop.is_set():
                ck.save_item({"n": n})
                n += 1
                time.sleep(0.0005)  # an item the next persist_state() has not accounted for yet
                ck.persist_state({"n": n})
        def noise():
            while not stop.is_set():
                ck.save_item({"noise": 1}); time.sleep(0.0003)
        threads = [threading.Thread(target=crawl), threading.Thread(target=noise)]
        for t in threads: t.start()
        print("ready", flush=True)
        sys.stdin.read(); stop.set()
        for t in threads: t.join()
    """
    task = TaskFiles(tmp_path / "task")
    proc = spiders.start(code, task.env())
    answers = []
    for rid in range(1, 11):
        task.request(rid)
        answers.append(task.wait_ack(rid, proc=proc))
    spiders.finish(proc)
    size = task.items.stat().st_size
    for answer in answers:
        n = snapshot_state(task, answer)["n"]
        assert n > 0 and answer["itemsOffset"] <= size
        assert [i["n"] for i in task.items_before(answer["itemsOffset"]) if "n" in i] == list(range(n))


QUIET = """
import sys, time, json
import crawlerkeeper_sdk as ck
calls = []
ck.on_migrating(lambda left: calls.append(["migrating", left]))
def persist():
    calls.append(["persist"])
    return {"calls": calls}
ck.on_persist(persist)
print("ready", flush=True)
sys.stdin.read()
print(json.dumps(calls), flush=True)
"""


def test_a_hostile_control_file_is_read_for_its_whole_requests_only(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    proc = spiders.start(QUIET, task.env())
    task.append(b"\x00\xff\xfe not json\n[1, 2]\n\"text\"\n{}\n")
    task.append(b'{"event": "persistState", "id": "7"}\n{"event": "persistState", "id": -1}\n')
    task.append(b'{"event": "persistState", "id": 1.5}\n{"event": "persistState", "id": true}\n')
    task.append(b'{"event": "persistState", "id": 9007199254740993}\n')  # beyond 2**53
    task.append(b"[" * 60000 + b"\n")  # nesting that would overflow a recursive parser
    task.append(b'{"event": "persistState", "pad": "' + b"x" * 70000 + b'", "id": 8}\n')  # over 64 KiB
    task.append(b'{"event": "persistState", "id": 1}\n')
    assert task.wait_ack(1, proc=proc)["snapshot"] == "1"
    # A partial line waits for its end; a line torn at its start (a writer that died) keeps its whole tail.
    task.append(b'{"event": "persistState", "reason": "interval", "i')
    task.append(b'{"event": "persi{"event": "persistState", "id": 3}\n')
    assert task.wait_ack(3, proc=proc)["snapshot"] == "3"
    task.append(b'{"event": "persistState", "id"')
    task.append(b": 4}\n")
    assert task.wait_ack(4, proc=proc)["snapshot"] == "4"
    # An event this SDK does not know is answered with an error; an id seen again is not answered again.
    task.request(5, "reboot")
    assert task.wait_ack(5, proc=proc) == {"id": 5, "error": "unknown event 'reboot'"}
    task.request(4)
    task.request(6, reason="interval")
    task.wait_ack(6, proc=proc)
    # A backlog far over what a request line needs is skipped but for its end: still answered at once.
    task.append((b"garbage " * 1000 + b"\n") * 3000)  # 24 MB
    task.request(9)
    assert task.wait_ack(9, timeout=10, proc=proc)["snapshot"] == "9"
    out, err = spiders.finish(proc)
    assert [a["id"] for a in task.acks()] == [1, 3, 4, 5, 6, 9]
    assert "skipped" in err and "bytes of backlog" in err
    assert json.loads(out) == [["persist"]] * 5


def test_a_replaced_or_truncated_control_file_is_read_again_never_answering_twice(
        tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    proc = spiders.start(QUIET, task.env())
    task.request(1)
    task.wait_ack(1, proc=proc)
    task.control.write_bytes(b"")  # truncated
    task.request(1)
    task.request(2)
    task.wait_ack(2, proc=proc)
    replacement = tmp_path / "new-control"
    replacement.write_bytes(b'{"event": "persistState", "id": 2}\n{"event": "persistState", "id": 3}\n')
    os.replace(replacement, task.control)  # a new file (new inode), shorter or not
    task.wait_ack(3, proc=proc)
    spiders.finish(proc)
    assert [a["id"] for a in task.acks()] == [1, 2, 3]


def python_candidates() -> list[Any]:
    python38 = find_python("3.8")
    return [pytest.param(sys.executable, id="current-python"),
            pytest.param(str(python38), id="python3.8",
                         marks=pytest.mark.skipif(python38 is None, reason=missing_python("3.8")))]


@pytest.mark.parametrize("python", python_candidates())
def test_migrating_runs_its_callbacks_with_the_seconds_left_then_persists(
        tmp_path: Path, spiders: Spiders, python: str) -> None:
    task = TaskFiles(tmp_path / "task")
    proc = spiders.start(QUIET, task.env(), python=python)
    task.request(1, "migrating", reason="migrate", secondsLeft=18.5)
    answer = task.wait_ack(1, proc=proc)
    assert snapshot_state(task, answer) == {"calls": [["migrating", 18.5], ["persist"]]}
    # Two requests seen at once (an interval one, then the migrate): one snapshot, for the newest.
    task.append(b'{"event": "persistState", "id": 2, "reason": "interval"}\n'
                b'{"event": "migrating", "id": 3, "reason": "migrate", "secondsLeft": 7.25}\n')
    third = task.wait_ack(3, proc=proc)
    assert task.wait_ack(2) == {"id": 2, "error": "superseded by request 3"}
    assert third["snapshot"] == "3" and not (task.snapshots / "2").exists()
    task.request(4, "migrating", secondsLeft="soon")  # not a number: the callback hears None
    task.wait_ack(4, proc=proc)
    out, _ = spiders.finish(proc)
    assert json.loads(out) == [["migrating", 18.5], ["persist"], ["migrating", 7.25], ["persist"],
                               ["migrating", None], ["persist"]]


def test_a_resumed_attempt_loads_the_restored_state_and_files(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task", attempt=2)
    (task.state / "state.json").write_text(json.dumps({"frontier": ["/p/3/"], "seen": ["/p/1/", "/p/2/"]}))
    (task.state / "own" / "deep").mkdir(parents=True)
    (task.state / "own" / "deep" / "data.txt").write_text("kept")
    code = """
        import json, sys
        import crawlerkeeper_sdk as ck
        state = ck.load_state({"frontier": ["/p/1/"], "seen": []})
        print("ready", flush=True)
        sys.stdin.read()
        print(json.dumps({"state": state, "attempt": ck.task_context().attempt,
                          "own": (ck.state_dir() / "own" / "deep" / "data.txt").read_text()}), flush=True)
    """
    proc = spiders.start(code, task.env())
    task.request(1)
    answer = task.wait_ack(1, proc=proc)
    out, _ = spiders.finish(proc)
    assert json.loads(out) == {"state": {"frontier": ["/p/3/"], "seen": ["/p/1/", "/p/2/"]}, "attempt": 2,
                               "own": "kept"}
    # Untouched, the restored state travels on as it came.
    assert (task.snapshots / "1" / "own" / "deep" / "data.txt").read_text() == "kept"
    assert answer["itemsOffset"] == 0


def test_the_snapshot_copies_files_and_dirs_and_follows_no_link(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not the spider's")
    (task.state / "data").mkdir()
    (task.state / "data" / "seen.bin").write_bytes(os.urandom(3 << 20))
    (task.state / "data" / "empty").write_bytes(b"")
    (task.state / "link-to-file").symlink_to(outside / "secret")
    (task.state / "link-to-dir").symlink_to(outside)
    os.mkfifo(task.state / "fifo")  # opening it would block a copy that does not look first
    proc = spiders.start(QUIET, task.env())
    task.request(1)
    answer = task.wait_ack(1, proc=proc)
    spiders.finish(proc)
    snap = task.snapshots / "1"
    assert answer["skipped"] == 3
    assert sorted(str(p.relative_to(snap)) for p in snap.rglob("*")) == [
        "data", "data/empty", "data/seen.bin", "state.json"]
    assert (snap / "data" / "seen.bin").read_bytes() == (task.state / "data" / "seen.bin").read_bytes()
    assert not any(p.name.endswith(".tmp") for p in task.snapshots.iterdir())


def test_a_new_process_answers_what_was_never_answered_and_nothing_twice(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    first = spiders.start(QUIET, task.env())
    task.request(1)
    task.wait_ack(1, proc=first)
    spiders.finish(first)
    task.request(2)  # asked while no process of the spider ran
    (task.snapshots / "2.tmp").mkdir()  # an answer that never finished
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the spider's")
    (task.snapshots / "3").symlink_to(outside)  # a leftover in the way is replaced, never followed
    (task.snapshots / "3.tmp").symlink_to(outside)
    second = spiders.start(QUIET, task.env())
    task.wait_ack(2, proc=second)
    task.request(3)
    task.wait_ack(3, proc=second)
    spiders.finish(second)
    assert [a["id"] for a in task.acks()] == [1, 2, 3]
    assert sorted(p.name for p in task.snapshots.iterdir()) == ["1", "2", "3"]
    assert not (task.snapshots / "3").is_symlink() and (task.snapshots / "3" / "state.json").is_file()
    assert [p.name for p in outside.iterdir()] == ["keep"]


def test_one_process_answers_a_forked_child_takes_over_when_it_is_gone(tmp_path: Path, spiders: Spiders) -> None:
    code = """
        import os, sys, time
        import crawlerkeeper_sdk as ck
        ck.on_persist(lambda: {"pid": os.getpid()})
        time.sleep(0.5)  # the parent's watcher holds the ack file's lock before the fork
        child = os.fork()
        if child == 0:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)  # the parent's pipes end with the parent
            ck.load_state()  # the child uses the API too: it must wait its turn
            time.sleep(60)
            os._exit(0)
        print("ready", flush=True)
        print(child, flush=True)
        sys.stdin.read()
    """
    task = TaskFiles(tmp_path / "task")
    parent = spiders.start(code, task.env())
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        for rid in (1, 2):
            task.request(rid)
            assert snapshot_state(task, task.wait_ack(rid, proc=parent)) == {"pid": parent.pid}
        spiders.finish(parent)
        task.request(3)
        assert snapshot_state(task, task.wait_ack(3)) == {"pid": child}
    finally:
        os.kill(child, signal.SIGKILL)
    assert [a["id"] for a in task.acks()] == [1, 2, 3]


def test_a_failure_is_answered_and_the_spider_goes_on(tmp_path: Path, spiders: Spiders) -> None:
    code = """
        import sys
        import crawlerkeeper_sdk as ck
        calls = []
        def persist():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("the frontier is busy")
            return {"calls": len(calls)}
        ck.on_persist(persist)
        ck.on_migrating(lambda left: 1 / 0)  # its failure is printed; the persist goes on
        print("ready", flush=True)
        sys.stdin.read()
        ck.save_item({"still": "saving"})
    """
    task = TaskFiles(tmp_path / "task")
    proc = spiders.start(code, task.env())
    task.request(1)
    assert task.wait_ack(1, proc=proc) == {"id": 1, "error": "RuntimeError: the frontier is busy"}
    task.request(2, "migrating", secondsLeft=3)
    assert snapshot_state(task, task.wait_ack(2, proc=proc)) == {"calls": 2}
    snapshots = task.snapshots
    snapshots.rename(tmp_path / "elsewhere")
    snapshots.write_text("not a directory")  # the snapshot cannot be written
    task.request(3)
    assert "error" in task.wait_ack(3, proc=proc)
    _, err = spiders.finish(proc)
    assert "the frontier is busy" in err and "ZeroDivisionError" in err
    assert read_jsonl(task.items) == [{"still": "saving"}]


def test_outside_an_agent_state_lives_in_memory_and_nothing_watches(tmp_path: Path) -> None:
    code = """
        import json, math, os, threading
        import crawlerkeeper_sdk as ck
        assert ck.load_state() is None and ck.load_state({"a": 1}) == {"a": 1}
        ck.on_persist(lambda: 1 / 0)
        ck.on_migrating(lambda left: 1 / 0)
        ck.persist_state({"frontier": ["x"]})
        state = ck.load_state("default")
        state["frontier"].append("mutated")  # a copy: the kept state is not changed
        assert ck.load_state() == {"frontier": ["x"]}
        for bad, error in (({1, 2}, TypeError), (math.nan, ValueError), (object(), TypeError)):
            try:
                ck.persist_state(bad)
            except error:
                pass
            else:
                raise AssertionError(bad)
        directory = ck.state_dir()
        assert directory.is_dir() and directory == ck.state_dir()
        with ck.state_lock():
            with ck.state_lock():  # re-entrant
                pass
        print(json.dumps({"dir": str(directory), "threads": threading.active_count()}))
    """
    proc = start_spider(code, sdk_env(CK_ITEMS_FILE=str(tmp_path / "items.jsonl")))
    out, err = proc.communicate(timeout=SPIDER_TIMEOUT)
    assert proc.returncode == 0, err
    said = json.loads(out)
    assert said["threads"] == 1  # no watcher
    assert not Path(said["dir"]).exists()  # removed at exit


def test_a_snapshot_that_does_not_fit_fails_and_leaves_nothing_behind(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    with small_disk(task.snapshots, 1 << 20):
        (task.state / "big.bin").write_bytes(b"x" * (3 << 20))
        proc = spiders.start(QUIET, task.env())
        task.request(1)
        answer = task.wait_ack(1, proc=proc)
        assert answer["id"] == 1 and "No space left" in answer["error"], answer
        assert list(task.snapshots.iterdir()) == []  # no 1.tmp
        (task.state / "big.bin").unlink()
        task.request(2)
        assert task.wait_ack(2, proc=proc)["snapshot"] == "2"
        spiders.finish(proc)
