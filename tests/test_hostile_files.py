"""What a spider plants in its own trees, as each reader and mover of the agent meets it (real files).

A spider owns its working copy, task dir and data dir: it may put a symlink to another spider's files,
to the node's secrets or to ``/etc/shadow`` where the agent expects a file, a FIFO (it would block the
agent), a hard link, or swap a folder for a link. The agent's collection, its artifact upload, its
journal replay, its monitor's files must never ship, move, write or block on any of them. (The same
matrix with a real agent and the master's stored items: test_hostile_files_e2e.py.)
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

import pytest
import trio
from harness import bounded

from ckagent.code.scrapyhook import uses_sdk_pipeline
from ckagent.containment.monitor import read_status, spawn_monitored
from ckagent.containment.process_group import ProcessGroupJail
from ckagent.delivery.artifacts import _keep, read_state
from ckagent.delivery.journal import LogJournal, scan_log_files
from ckagent.delivery.lines import Masker
from ckagent.delivery.outputs import collect, kept_dir, read_artifact
from ckagent.delivery.outputs.files import read_checked
from ckagent.delivery.outputs.live import LiveItemFiles
from ckagent.delivery.pending import Pending
from ckagent.delivery.readers import _JournalReader
from ckagent.master.protocol import ArtifactRef, TaskOutputs
from ckagent.node.beneath import NotBeneath
from ckagent.task.outcome import output_tail
from ckagent.task.recovery import _append

SECRET = b'{"secret": "the node\'s, never a task\'s"}\n'
OTHER_UID = 61998


@pytest.fixture
def node(tmp_path: Path) -> dict[str, Path]:
    """A work dir with a task (its code version, working copy, task dir, spider data dir) and a secret
    of the node's beside them."""
    work_dir = tmp_path / "work"
    paths = {"code": work_dir / "spiders" / "s1" / "v1", "work": work_dir / "spiders" / ".runs" / "t1",
             "task": work_dir / "tasks" / "t1", "data": work_dir / "spider-data" / "s1"}
    for path in paths.values():
        path.mkdir(parents=True)
    (paths["code"] / "main.py").write_text("print()")
    (paths["work"] / "main.py").write_text("print()")
    paths["secret"] = work_dir / "state.db"
    paths["secret"].write_bytes(SECRET)
    paths["outside"] = tmp_path / "outside"
    paths["outside"].mkdir()
    paths["keep"] = kept_dir(work_dir, "s1", "t1")
    return paths


def _collect(node: dict[str, Path], items: list[str] | None = None, budget: int = 1 << 20) -> object:
    return bounded(collect, work=node["work"], code_dir=node["code"], since=time.time() - 5, task_dir=node["task"],
                   outputs=TaskOutputs(items=items) if items else None, budget_bytes=budget,
                   master_takes_artifacts=True, keep_dir=node["keep"])


def _everything_under(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink())


def test_links_and_fifos_in_the_working_copy_are_neither_items_nor_artifacts(node: dict[str, Path]) -> None:
    work = node["work"]
    (work / "results.json").symlink_to(node["secret"])  # a declared item file that is a link
    (work / "out").symlink_to(node["secret"].parent)  # a folder that is a link
    os.mkfifo(work / "feed.jsonl")  # a FIFO where an item file is declared: must not block
    (work / "real.json").write_text('[{"ok": 1}]')
    got = _collect(node, items=["results.json", "out/*", "feed.jsonl", "real.json"])
    assert got.items == [("real.json", 1)]  # type: ignore[attr-defined]
    spool = (node["task"] / "items.jsonl").read_bytes()
    assert spool == b'{"ok": 1}\n' and b"secret" not in _everything_under(node["task"])
    assert node["secret"].read_bytes() == SECRET and not got.artifacts  # type: ignore[attr-defined]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a working copy owned by another uid")
def test_a_hard_link_to_a_file_the_task_does_not_own_is_not_collected_and_said(node: dict[str, Path]) -> None:
    work = node["work"]
    os.chown(work, OTHER_UID, OTHER_UID)
    os.link(node["secret"], work / "stolen.json")  # what fs.protected_hardlinks=0 lets a spider do
    os.link(node["secret"], work / "stolen.bin")
    got = _collect(node, items=["*.json"])
    assert not got.items and not got.artifacts and not got.kept  # type: ignore[attr-defined]
    assert "stolen.bin: a hard link to a file the task does not own: not collected" in got.line()  # type: ignore[attr-defined]
    assert b"secret" not in _everything_under(node["task"]) + _everything_under(node["data"])
    assert node["secret"].read_bytes() == SECRET


def test_a_planted_artifacts_link_or_items_link_in_the_task_dir_is_never_written_through(node: dict[str, Path]) -> None:
    work, task = node["work"], node["task"]
    (work / "page.html").write_text("<p>the task's</p>")
    (task / "artifacts").symlink_to(node["outside"])  # the spider's task dir: it planted this
    got = _collect(node)
    assert not list(node["outside"].iterdir())  # nothing moved or written through the link
    assert "page.html: cannot collect" in got.line()  # type: ignore[attr-defined]
    (task / "items.jsonl").symlink_to(node["secret"])
    (work / "more.json").write_text('[{"n": 1}]')
    with pytest.raises(NotBeneath):
        _collect(node, items=["more.json"])
    assert node["secret"].read_bytes() == SECRET


def test_kept_files_never_go_through_a_link_in_the_spiders_data_dir(node: dict[str, Path]) -> None:
    (node["data"] / "outputs").symlink_to(node["outside"])  # the spider's data dir: it planted this
    (node["work"] / "big.bin").write_bytes(b"x" * 5000)
    got = _collect(node, budget=10)
    assert not list(node["outside"].iterdir())
    assert "big.bin: cannot keep" in got.line()  # type: ignore[attr-defined]


def test_a_forged_manifest_moves_nothing_outside_this_tasks_folder_and_reads_nothing(node: dict[str, Path]) -> None:
    task, work_dir = node["task"], node["task"].parent.parent
    other = work_dir / "spider-data" / "victim"
    other.mkdir()
    (task / "artifacts").mkdir()
    (task / "artifacts" / "a.txt").write_text("mine")
    if os.geteuid() == 0:  # another spider's data dir: another owner (at one uid for all, the level's limit)
        os.chown(other, OTHER_UID, OTHER_UID)
    for keep_dir in (other / "outputs" / "t1", node["outside"], work_dir / "spider-data" / "s1" / ".." / "victim"):
        body = {"artifacts": [{"path": "a.txt", "sizeBytes": 4, "sha256": "0" * 64}], "keepDir": str(keep_dir)}
        (task / "artifacts.json").write_text(json.dumps(body))
        _refs, found, _sent = read_state(task)
        bounded(_keep, task, found, ["a.txt"])
        if os.geteuid() != 0 and keep_dir == other / "outputs" / "t1":
            # One uid for all (no root to give the victim another owner): its data dir is the task
            # owner's too, so this place passes kept_place's owner check — the level's limit. The file
            # went there and nowhere else; it is put back so the next places are tried with it.
            assert (keep_dir / "a.txt").read_text() == "mine"
            (keep_dir / "a.txt").rename(task / "artifacts" / "a.txt")
        assert (task / "artifacts" / "a.txt").read_text() == "mine", keep_dir
    assert not list(node["outside"].iterdir())
    assert not (other / "outputs").exists() or os.geteuid() != 0
    # The artifact page reads only the manifest's paths below the task dir, never a link there.
    (task / "artifacts" / "a.txt").unlink()
    (task / "artifacts" / "a.txt").symlink_to(node["secret"])
    assert bounded(read_artifact, task, "a.txt", 1 << 20) is None


def test_the_agents_files_in_the_task_dir_replaced_by_fifos_or_links_never_block_or_leak(node: dict[str, Path]) -> None:
    task = node["task"]
    os.mkfifo(task / "artifacts.sent")
    (task / "artifacts.json").write_text('{"artifacts": []}')
    with pytest.raises(NotBeneath):
        bounded(read_state, task)
    (task / "artifacts.json").unlink()
    os.mkfifo(task / "artifacts.json")
    with pytest.raises(NotBeneath):
        bounded(read_state, task)
    os.mkfifo(task / "exit-status")
    assert bounded(read_status, task / "exit-status") is None
    (task / "exit-status").unlink()
    (task / "exit-status").symlink_to(node["secret"])
    assert bounded(read_status, task / "exit-status") is None
    (task / "output.journal").symlink_to(node["secret"])
    with pytest.raises(NotBeneath):
        bounded(LogJournal(task).open)
    assert node["secret"].read_bytes() == SECRET


async def test_a_forged_journal_never_names_a_file_outside_the_task_dir(node: dict[str, Path]) -> None:
    task = node["task"]
    (task / "output.log").write_bytes(b"own line\n")
    (task / "logs").symlink_to(node["secret"].parent)  # a folder of the task dir that is a link
    forged = (f"S 0 output.log\nD 0 9\nS 1 {node['secret']}\nD 1 40\nS 2 ../../state.db\nD 2 40\n"
              "S 3 logs/state.db\nD 3 40\nF 0\nF 1\nF 2\nF 3\nE\n")
    (task / "output.journal").write_text(forged)
    reader = _JournalReader(task, Masker([]))
    await reader.restore(None)
    pending = Pending()
    with trio.fail_after(10):
        while await reader.read(pending):
            pass
    reader.close()
    shipped = b"".join(pending.encoded())
    assert b"own line" in shipped and b"secret" not in shipped


def test_log_file_globs_never_reach_through_a_link(node: dict[str, Path]) -> None:
    task = node["task"]
    (task / "logs").symlink_to(node["outside"])
    (node["outside"] / "x.log").write_text("outside\n")
    (task / "fifo.log").unlink(missing_ok=True)
    os.mkfifo(task / "fifo.log")
    (task / "mine.log").write_text("mine\n")
    assert bounded(scan_log_files, task, ["*.log", "logs/*.log", "**/*.log"]) == {"mine.log": 5}


def test_streamed_item_files_are_never_links_to_outside(node: dict[str, Path]) -> None:
    work, task = node["work"], node["task"]
    (work / "out").mkdir()
    (work / "out" / "a.jsonl").write_text('{"a": 1}\n')
    (work / "b.jsonl").symlink_to(node["secret"])
    live = LiveItemFiles(task, work, ["out/*.jsonl", "b.jsonl"])
    sizes = bounded(live.scan)
    assert list(sizes.values()) == [9] and node["secret"].stat().st_nlink == 1
    # The spider swaps its folder for a link after the first look: the next look links nothing new.
    os.rename(work / "out", work / "out.old")
    (work / "out").symlink_to(node["secret"].parent)
    (node["secret"].parent / "c.jsonl").write_bytes(SECRET)
    bounded(live.scan)
    assert bounded(live.link, "out/c.jsonl") is None
    assert (node["secret"].parent / "c.jsonl").stat().st_nlink == 1
    links = list((task / "item-files").iterdir())
    assert len(links) == 1 and links[0].read_bytes() == b'{"a": 1}\n'


def test_the_monitor_never_opens_output_log_through_a_link(node: dict[str, Path]) -> None:
    task = node["task"]
    (task / "output.log").symlink_to(node["secret"])
    jail = ProcessGroupJail("t1")
    with pytest.raises(NotBeneath):
        spawn_monitored(["/bin/true"], cwd=node["work"], env={"CK_TASK_ID": "t1", "PATH": "/usr/bin:/bin"},
                        task_id="t1", task_dir=task, output_path=task / "output.log", jail=jail, run_as=None,
                        deadline_at=None, work=node["work"], stall_timeout=0)
    assert node["secret"].read_bytes() == SECRET


def test_an_artifact_replaced_after_its_hash_is_not_sent(node: dict[str, Path]) -> None:
    task = node["task"]
    (task / "artifacts").mkdir()
    (task / "artifacts" / "a.bin").symlink_to(node["secret"])
    ref = ArtifactRef(path="a.bin", size_bytes=len(SECRET), sha256=hashlib.sha256(SECRET).hexdigest())
    assert bounded(read_checked, task, ref) is None  # even a manifest naming the secret's own hash
    assert stat.S_ISLNK(os.lstat(task / "artifacts" / "a.bin").st_mode)


def test_the_failure_message_and_the_recovery_note_never_go_through_a_link_or_wait_on_a_fifo(
        node: dict[str, Path]) -> None:
    """output.log replaced by the spider: its tail goes into a failed task's result (stored by the master),
    and crash recovery appends its note to it — neither may read or write another file, nor block."""
    task = node["task"]
    (task / "output.log").symlink_to(node["secret"])
    assert bounded(output_tail, task / "output.log") == b""
    bounded(_append, task / "output.log", b"[ckagent] agent lost\n")
    assert node["secret"].read_bytes() == SECRET
    (task / "output.log").unlink()
    os.mkfifo(task / "output.log")
    assert bounded(output_tail, task / "output.log") == b""
    bounded(_append, task / "output.log", b"[ckagent] agent lost\n")
    (task / "output.log").unlink()
    (task / "output.log").write_bytes(b"the spider's last line without its end")
    bounded(_append, task / "output.log", b"[ckagent] agent lost\n")
    assert (task / "output.log").read_bytes() == b"the spider's last line without its end\n[ckagent] agent lost\n"
    assert bounded(output_tail, task / "output.log").startswith(b"the spider's last line without its end\n")


def test_the_scrapy_hook_looks_at_no_link_and_waits_on_no_fifo(node: dict[str, Path]) -> None:
    work = node["work"]
    (work / "settings.py").symlink_to(node["secret"])
    os.mkfifo(work / "pipelines.py")
    assert bounded(uses_sdk_pipeline, work) is False
    (work / "items.py").write_text("from crawlerkeeper_sdk.scrapy import CrawlerKeeperPipeline\n")
    assert bounded(uses_sdk_pipeline, work) is True


def test_the_failure_message_holds_the_spiders_lines_not_the_agents_or_the_installers(tmp_path: Path) -> None:
    """A spider that dies right after its install: the tail a failed result carries is its own output,
    not the agent's notices nor the installer lines the agent wrote before it ("[ckagent] $ uv venv ...")."""
    log = tmp_path / "output.log"
    log.write_bytes(b"[ckagent] building environment py-1 (packages) as the node's builder, uid 61184 (ck-61184)\n"
                    b"[ckagent] $ uv venv --quiet py-1\n"
                    b"[ckagent 2026-12-05 12:00:00] running python main.py\n"
                    b"about to die\n"
                    b"[ckagentish] a spider's own line\n")
    assert output_tail(log) == b"about to die\n[ckagentish] a spider's own line\n"
