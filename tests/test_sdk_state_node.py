"""The Node SDK's state API (sdk/node/crawlerkeeper-sdk.cjs) and the spider's side of the control channel
(issue 38), with real node processes; the test plays the agent (tests/harness/spiderstate.py)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import (
    NODE_SDK,
    SPIDER_TIMEOUT,
    Spiders,
    TaskFiles,
    read_jsonl,
    sdk_env,
    small_disk,
    start_spider,
)

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")

# The end of every spider here: wait for the test to close stdin, then run `atEnd` and exit.
UNTIL_STDIN_ENDS = """
process.stdin.on("data", () => {});
process.stdin.on("end", () => { atEnd(); process.exit(0); });
console.log("ready");
"""


@pytest.fixture
def spiders() -> Iterator[Spiders]:
    group = Spiders()
    yield group
    group.close()


def start(spiders: Spiders, task: TaskFiles, code: str) -> Any:
    return spiders.start(code + UNTIL_STDIN_ENDS, task.env(), node=True, cwd=task.dir)


def snapshot_state(task: TaskFiles, answer: dict[str, Any]) -> Any:
    return json.loads((task.snapshots / answer["snapshot"] / "state.json").read_text())


def test_the_examples_ship_the_sdk_as_it_is() -> None:
    for copy in ("node_esm_crawler/src/crawlerkeeper-sdk.cjs", "node_resume/crawlerkeeper-sdk.cjs"):
        assert (REPO / "sdk" / "examples" / copy).read_bytes() == NODE_SDK.read_bytes(), copy


def test_each_snapshot_holds_the_state_of_exactly_the_items_before_its_offset(
        tmp_path: Path, spiders: Spiders) -> None:
    # Two async loops save items between awaits; a sync callback returns the live counts, an async one
    # writes a file of its own (awaited: the loops run on meanwhile, the counts are read after it).
    code = """
    const ck = require("./ck.cjs");
    const fs = require("fs"), path = require("path");
    const counts = { a: 0, b: 0 };
    let stop = false, persisted = 0;
    ck.onPersist(() => ({ counts }));
    ck.onPersist(async () => {
      await new Promise((resolve) => setTimeout(resolve, 5));
      await fs.promises.writeFile(path.join(ck.stateDir(), "own.txt"), `persist ${++persisted}`);
    });
    async function writer(k) {
      while (!stop) {
        await new Promise((resolve) => (counts[k] % 5 ? setImmediate(resolve) : setTimeout(resolve, 1)));
        ck.saveItem({ w: k, i: counts[k], pad: "x".repeat(counts[k] % 50) });
        counts[k] += 1;
      }
    }
    writer("a"); writer("b");
    function atEnd() { stop = true; }
    """
    task = TaskFiles(tmp_path / "task")
    proc = start(spiders, task, code)
    answers = []
    for rid in range(1, 9):
        task.request(rid, reason="interval")
        answers.append(task.wait_ack(rid, proc=proc))
    spiders.finish(proc)
    for n, answer in enumerate(answers, 1):
        assert answer["snapshot"] == str(answer["id"]) and answer["pauseMs"] >= 0, answer
        counts = snapshot_state(task, answer)["counts"]
        kept = task.items_before(answer["itemsOffset"])
        for writer in ("a", "b"):
            assert [item["i"] for item in kept if item["w"] == writer] == list(range(counts[writer])), answer
        assert (task.snapshots / answer["snapshot"] / "own.txt").read_text() == f"persist {n}"
    assert [a["id"] for a in task.acks()] == list(range(1, 9))


def test_without_callbacks_the_offset_is_that_of_the_last_persist_state(tmp_path: Path, spiders: Spiders) -> None:
    code = """
    const ck = require("./ck.cjs");
    let stop = false;
    (async () => {
      let n = ck.loadState({ n: 0 }).n;
      while (!stop) {
        ck.saveItem({ n });
        n += 1;
        await new Promise((resolve) => setTimeout(resolve, 1));  // an item not yet accounted for
        ck.persistState({ n });
      }
    })();
    function atEnd() { stop = true; }
    """
    task = TaskFiles(tmp_path / "task")
    proc = start(spiders, task, code)
    answers = []
    for rid in range(1, 7):
        task.request(rid)
        answers.append(task.wait_ack(rid, proc=proc))
    spiders.finish(proc)
    for answer in answers:
        n = snapshot_state(task, answer)["n"]
        assert n > 0 and [i["n"] for i in task.items_before(answer["itemsOffset"])] == list(range(n))


QUIET = """
const ck = require("./ck.cjs");
const calls = [];
ck.onMigrating(async (left) => { await new Promise((r) => setTimeout(r, 5)); calls.push(["migrating", left]); });
ck.onPersist(() => { calls.push(["persist"]); return { calls }; });
function atEnd() { console.log(JSON.stringify(calls)); }
"""


def test_a_hostile_control_file_is_read_for_its_whole_requests_only(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    proc = start(spiders, task, QUIET)
    task.append(b"\x00\xff\xfe not json\n[1, 2]\n\"text\"\n{}\n")
    task.append(b'{"event": "persistState", "id": "7"}\n{"event": "persistState", "id": -1}\n')
    task.append(b'{"event": "persistState", "id": 1.5}\n{"event": "persistState", "id": true}\n')
    task.append(b'{"event": "persistState", "id": 9007199254740993}\n')
    task.append(b"[" * 60000 + b"\n")
    task.append(b'{"event": "persistState", "pad": "' + b"x" * 70000 + b'", "id": 8}\n')
    task.append(b'{"event": "persistState", "id": 1}\n')
    assert task.wait_ack(1, proc=proc)["snapshot"] == "1"
    task.append(b'{"event": "persistState", "reason": "interval", "i')
    task.append(b'{"event": "persi{"event": "persistState", "id": 3}\n')
    assert task.wait_ack(3, proc=proc)["snapshot"] == "3"
    task.append(b'{"event": "persistState", "id"')
    task.append(b": 4}\n")
    assert task.wait_ack(4, proc=proc)["snapshot"] == "4"
    task.request(5, "reboot")
    assert task.wait_ack(5, proc=proc) == {"id": 5, "error": 'unknown event "reboot"'}
    task.request(4)
    task.request(6, reason="interval")
    task.wait_ack(6, proc=proc)
    task.append((b"garbage " * 1000 + b"\n") * 3000)  # 24 MB
    task.request(9)
    assert task.wait_ack(9, timeout=10, proc=proc)["snapshot"] == "9"
    replacement = tmp_path / "new-control"
    replacement.write_bytes(b'{"event": "persistState", "id": 9}\n{"event": "persistState", "id": 10}\n')
    os.replace(replacement, task.control)  # a new file: read from its start, 9 not answered again
    task.wait_ack(10, proc=proc)
    out, err = spiders.finish(proc)
    assert [a["id"] for a in task.acks()] == [1, 3, 4, 5, 6, 9, 10]
    assert "bytes of backlog" in err
    assert json.loads(out) == [["persist"]] * 6


def test_migrating_awaits_its_callbacks_with_the_seconds_left_then_persists(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    proc = start(spiders, task, QUIET)
    task.request(1, "migrating", reason="migrate", secondsLeft=18.5)
    assert snapshot_state(task, task.wait_ack(1, proc=proc)) == {"calls": [["migrating", 18.5], ["persist"]]}
    task.append(b'{"event": "persistState", "id": 2, "reason": "interval"}\n'
                b'{"event": "migrating", "id": 3, "reason": "migrate", "secondsLeft": 7.25}\n')
    assert task.wait_ack(3, proc=proc)["snapshot"] == "3"
    assert task.wait_ack(2) == {"id": 2, "error": "superseded by request 3"}
    out, _ = spiders.finish(proc)
    assert json.loads(out) == [["migrating", 18.5], ["persist"], ["migrating", 7.25], ["persist"]]


def test_a_resumed_attempt_loads_the_restored_state_and_the_snapshot_follows_no_link(
        tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task", attempt=3)
    (task.state / "state.json").write_text(json.dumps({"frontier": ["/p/3/"], "pages": 2}))
    (task.state / "own" / "deep").mkdir(parents=True)
    (task.state / "own" / "deep" / "data.txt").write_text("kept")
    (tmp_path / "secret").write_text("not the spider's")
    (task.state / "link").symlink_to(tmp_path / "secret")
    (task.state / "dirlink").symlink_to(tmp_path)
    os.mkfifo(task.state / "fifo")
    code = """
    const ck = require("./ck.cjs");
    const fs = require("fs"), path = require("path");
    const state = ck.loadState({ frontier: ["/p/1/"] });
    const own = fs.readFileSync(path.join(ck.stateDir(), "own", "deep", "data.txt"), "utf8");
    function atEnd() { console.log(JSON.stringify({ state, own, attempt: ck.taskContext().attempt })); }
    """
    proc = start(spiders, task, code)
    task.request(1)
    answer = task.wait_ack(1, proc=proc)
    out, _ = spiders.finish(proc)
    assert json.loads(out) == {"state": {"frontier": ["/p/3/"], "pages": 2}, "own": "kept", "attempt": 3}
    snap = task.snapshots / "1"
    assert answer["skipped"] == 3 and answer["itemsOffset"] == 0
    assert sorted(str(p.relative_to(snap)) for p in snap.rglob("*")) == [
        "own", "own/deep", "own/deep/data.txt", "state.json"]


def test_a_failure_is_answered_and_the_spider_goes_on(tmp_path: Path, spiders: Spiders) -> None:
    code = """
    const ck = require("./ck.cjs");
    let calls = 0;
    ck.onPersist(async () => { calls += 1; if (calls === 1) throw new RangeError("the frontier is busy"); return { calls }; });
    ck.onMigrating(() => { throw new Error("a migrating callback's own trouble"); });
    function atEnd() { ck.saveItem({ still: "saving" }); }
    """
    task = TaskFiles(tmp_path / "task")
    proc = start(spiders, task, code)
    task.request(1)
    assert task.wait_ack(1, proc=proc) == {"id": 1, "error": "RangeError: the frontier is busy"}
    task.request(2, "migrating", secondsLeft=3)
    assert snapshot_state(task, task.wait_ack(2, proc=proc)) == {"calls": 2}
    task.snapshots.rename(tmp_path / "elsewhere")
    task.snapshots.write_text("not a directory")
    task.request(3)
    assert "error" in task.wait_ack(3, proc=proc)
    _, err = spiders.finish(proc)
    assert "the frontier is busy" in err and "a migrating callback's own trouble" in err
    assert read_jsonl(task.items) == [{"still": "saving"}]


def test_a_new_process_answers_what_was_never_answered_and_nothing_twice(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    first = start(spiders, task, QUIET)
    task.request(1)
    task.wait_ack(1, proc=first)
    spiders.finish(first)
    task.request(2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the spider's")
    (task.snapshots / "2").symlink_to(outside)  # a leftover in the way is replaced, never followed
    (task.snapshots / "2.tmp").symlink_to(outside)
    second = start(spiders, task, QUIET)
    task.wait_ack(2, proc=second)
    spiders.finish(second)
    assert [a["id"] for a in task.acks()] == [1, 2]
    assert not (task.snapshots / "2").is_symlink() and (task.snapshots / "2" / "state.json").is_file()
    assert [p.name for p in outside.iterdir()] == ["keep"]


def test_the_watcher_never_keeps_a_finished_spider_alive(tmp_path: Path) -> None:
    task = TaskFiles(tmp_path / "task")
    code = """
    const ck = require("./ck.cjs");
    ck.onPersist(() => ({ done: true }));
    ck.persistState({ done: false });
    console.log("finished");
    """
    started = time.monotonic()
    proc = start_spider(code, task.env(), node=True, cwd=task.dir)
    out, err = proc.communicate(timeout=SPIDER_TIMEOUT)
    assert proc.returncode == 0 and out == "finished\n", err
    assert time.monotonic() - started < 5  # node's start, not a watcher's timer, sets the pace
    assert json.loads((task.state / "state.json").read_text()) == {"done": False}


def test_outside_an_agent_state_lives_in_memory_and_nothing_watches(tmp_path: Path) -> None:
    code = """
    const ck = require("./ck.cjs");
    const assert = require("assert"), fs = require("fs");
    assert.strictEqual(ck.loadState(), null);
    assert.deepStrictEqual(ck.loadState({ a: 1 }), { a: 1 });
    ck.onPersist(() => { throw new Error("never called"); });
    ck.persistState({ frontier: ["x"] });
    const state = ck.loadState("default");
    state.frontier.push("mutated");
    assert.deepStrictEqual(ck.loadState(), { frontier: ["x"] });
    assert.throws(() => ck.persistState(undefined), TypeError);
    assert.throws(() => ck.persistState({ big: 1n }), TypeError);
    const dir = ck.stateDir();
    assert.ok(fs.statSync(dir).isDirectory() && dir === ck.stateDir());
    assert.strictEqual(ck.taskContext().attempt, 1);
    console.log(dir);
    """
    shutil.copy(NODE_SDK, tmp_path / "ck.cjs")
    proc = start_spider(code.replace("./ck.cjs", str(tmp_path / "ck.cjs")), sdk_env(), node=True, cwd=tmp_path)
    out, err = proc.communicate(timeout=SPIDER_TIMEOUT)
    assert proc.returncode == 0, err
    assert not Path(out.strip()).exists()  # removed at exit


def test_a_snapshot_that_does_not_fit_fails_and_leaves_nothing_behind(tmp_path: Path, spiders: Spiders) -> None:
    task = TaskFiles(tmp_path / "task")
    with small_disk(task.snapshots, 1 << 20):
        (task.state / "big.bin").write_bytes(b"x" * (3 << 20))
        proc = start(spiders, task, QUIET)
        task.request(1)
        answer = task.wait_ack(1, proc=proc)
        assert answer["id"] == 1 and "ENOSPC" in answer["error"], answer
        assert list(task.snapshots.iterdir()) == []
        (task.state / "big.bin").unlink()
        task.request(2)
        assert task.wait_ack(2, proc=proc)["snapshot"] == "2"
        spiders.finish(proc)
