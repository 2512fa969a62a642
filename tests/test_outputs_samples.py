"""Items are what this run wrote: an item file the package ships is its author's sample, not output.

ckagent.delivery.outputs.samples records the package's item files when the working copy is staged
(inode, size, mtime, the hash of its start); at the end of the task, and while it runs for declared
JSON Lines files (ckagent.delivery.outputs.live), only what the run appended to or wrote anew counts.
Each way a run can write a file: rewrite in place, append, truncate-then-write, rename-into-place,
and the sample left untouched. Real files, a real working copy (ckagent.code.workcopy).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from ckagent.code.workcopy import make_working_copy
from ckagent.delivery.journal import LogJournal
from ckagent.delivery.lines import encode_item
from ckagent.delivery.outputs import Collected, collect, item_candidates
from ckagent.delivery.outputs import samples as output_samples
from ckagent.delivery.outputs.live import LiveItemFiles, link_starts
from ckagent.delivery.pending import Pending
from ckagent.delivery.readers import _ItemJournalReader
from ckagent.delivery.spool import ITEMS_FILE, ITEMS_JOURNAL
from ckagent.master.protocol import TaskOutputs

SAMPLE = [{"n": i, "from": "the author's sample"} for i in range(3)]
NEW = [{"n": 100 + i, "from": "this run"} for i in range(2)]
SIZE = 120
"""Bytes of the sample as JSON Lines."""


def _lines(items: list[dict]) -> str:
    return "".join(json.dumps(item) + "\n" for item in items)


assert len(_lines(SAMPLE)) == SIZE


def _staged(tmp_path: Path, files: dict[str, str], globs: list[str]) -> tuple[Path, Path, Path, TaskOutputs]:
    """(code version, working copy, task dir, outputs): the copy staged and its samples recorded as the
    deployer does (ckagent.task.deploy)."""
    code, work, task_dir = tmp_path / "code", tmp_path / "work", tmp_path / "task"
    for rel, text in files.items():
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        (code / rel).write_text(text)
    task_dir.mkdir()
    make_working_copy(code, work)
    outputs = TaskOutputs(items=tuple(globs))
    output_samples.save(task_dir, output_samples.snapshot(work, item_candidates(work, outputs)))
    return code, work, task_dir, outputs


def _collect(tmp_path: Path, code: Path, work: Path, task_dir: Path, outputs: TaskOutputs,
             since: float) -> tuple[Collected, list[dict]]:
    collected = collect(work=work, code_dir=code, since=since, task_dir=task_dir, outputs=outputs,
                        budget_bytes=1 << 20, master_takes_artifacts=True, keep_dir=tmp_path / "kept",
                        samples=output_samples.load(task_dir))
    spool = task_dir / ITEMS_FILE
    items = [json.loads(line) for line in spool.read_text().splitlines()] if spool.exists() else []
    return collected, items


def _rewrite(path: Path) -> None:  # open("w"): the same inode, truncated, written longer
    path.write_text(_lines(NEW + NEW + NEW))


def _append(path: Path) -> None:
    with path.open("a") as out:
        out.write(_lines(NEW))


def _truncate_then_write(path: Path) -> None:  # the same inode, shorter than the sample
    with path.open("r+") as out:
        out.truncate(0)
        out.write(_lines(NEW[:1]))


def _same_size_rewrite(path: Path) -> None:  # the same inode and size, other bytes, a new mtime
    data = path.read_bytes()
    path.write_bytes(data.replace(b"sample", b"SAMPLE"))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # (a coarse clock: still a new mtime)


def _rename_into_place(path: Path) -> None:  # written anew beside it and renamed over: another inode
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_lines(NEW))
    os.replace(tmp, path)


def _untouched(path: Path) -> None:
    pass


KINDS = {
    "rewrite": (_rewrite, NEW + NEW + NEW, None),
    "append": (_append, NEW, "after the package's sample of"),
    "truncate-then-write": (_truncate_then_write, NEW[:1], None),
    "same-size-rewrite": (_same_size_rewrite, [{**item, "from": "the author's SAMPLE"} for item in SAMPLE], None),
    "rename-into-place": (_rename_into_place, NEW, None),
    "untouched": (_untouched, [], "the package's sample"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_only_what_the_run_wrote_of_a_shipped_item_file_is_items(tmp_path: Path, kind: str) -> None:
    write, expected, said = KINDS[kind]
    code, work, task_dir, outputs = _staged(tmp_path, {"output.jsonl": _lines(SAMPLE), "main.py": ""},
                                            ["output.jsonl"])
    since = (work / "output.jsonl").stat().st_mtime
    write(work / "output.jsonl")
    collected, items = _collect(tmp_path, code, work, task_dir, outputs, since)
    line = collected.line()
    assert items == expected, (kind, line)
    assert "matched no file" not in line  # an untouched sample is said as such, not as a glob matching nothing
    if kind == "untouched":
        assert collected.items == []
        assert line == (f"outputs: output.jsonl: the package's sample ({SIZE} B), not written by this run: left alone"), line
        assert not (task_dir / "artifacts" / "output.jsonl").exists() and not collected.artifacts
    else:
        assert collected.items == [("output.jsonl", len(expected))], line
        assert (said in line) if said else ("sample" not in line), line


def test_a_glob_matching_only_what_the_run_did_not_write_is_said_and_a_missing_file_too(tmp_path: Path) -> None:
    code, work, task_dir, outputs = _staged(tmp_path, {"data/old.jsonl": _lines(SAMPLE)}, ["data/*.jsonl", "nothing.json"])
    collected, items = _collect(tmp_path, code, work, task_dir, outputs, 0.0)
    assert items == []
    assert collected.line() == (f"outputs: data/old.jsonl: the package's sample ({SIZE} B), not written by this run: "
                                "left alone; outputs.items 'nothing.json' matched no file")


def test_a_folder_of_samples_is_said_once(tmp_path: Path) -> None:
    # A crawlee project that commits its dataset (no outputs.items: the convention's files).
    dataset = {f"storage/datasets/default/{i:09d}.json": json.dumps({"n": i}) for i in range(1, 4)}
    code, work, task_dir, _outputs = _staged(tmp_path, {**dataset, "main.js": ""}, [])
    (work / "storage/datasets/default/000000004.json").write_text(json.dumps({"n": 4}))  # this run's one item
    collected = collect(work=work, code_dir=code, since=0.0, task_dir=task_dir, outputs=None, budget_bytes=0,
                        master_takes_artifacts=True, keep_dir=tmp_path / "kept", samples=output_samples.load(task_dir))
    assert (task_dir / ITEMS_FILE).read_text() == '{"n": 4}\n'
    assert collected.line() == ("outputs: storage/datasets/ (1 file) → 1 item; storage/ (3 files, 24 B): the "
                                "package's samples, not written by this run: left alone")


def test_csv_and_json_samples(tmp_path: Path) -> None:
    header_and_rows = "name,price\r\nold,1.10\r\n"
    code, work, task_dir, outputs = _staged(
        tmp_path, {"scraped.csv": header_and_rows, "again.csv": header_and_rows, "results.json": json.dumps(SAMPLE),
                   "kept.json": json.dumps(SAMPLE)}, ["*.csv", "*.json"])
    with (work / "scraped.csv").open("a", newline="") as out:  # appended rows, no header
        csv.writer(out).writerow(["new", "2.50"])
    with (work / "again.csv").open("a", newline="") as out:  # an appending writer that repeats the header
        csv.writer(out).writerows([["name", "price"], ["newer", "3.00"]])
    (work / "results.json").write_text(json.dumps(NEW, indent=2))  # a document rewritten: all of it
    collected, items = _collect(tmp_path, code, work, task_dir, outputs, 0.0)
    assert items == [{"name": "newer", "price": "3.00"}, *NEW, {"name": "new", "price": "2.50"}]
    assert collected.samples == [("kept.json", len(json.dumps(SAMPLE)))]
    assert "again.csv → 1 item (after the package's sample of" in collected.line()


def test_a_file_new_to_the_package_is_all_the_runs(tmp_path: Path) -> None:
    code, work, task_dir, outputs = _staged(tmp_path, {"main.py": ""}, ["output.jsonl"])
    assert output_samples.load(task_dir) == {} and not (task_dir / output_samples.SAMPLES_FILE).exists()
    (work / "output.jsonl").write_text(_lines(NEW))
    collected, items = _collect(tmp_path, code, work, task_dir, outputs, 0.0)
    assert items == NEW and collected.line() == "outputs: output.jsonl → 2 items"


def test_a_damaged_record_counts_every_file_as_the_runs(tmp_path: Path) -> None:
    _code, _work, task_dir, _outputs = _staged(tmp_path, {"output.jsonl": _lines(SAMPLE)}, ["output.jsonl"])
    assert set(output_samples.load(task_dir)) == {"output.jsonl"}
    for body in (b"{", b"[1, 2]", b'[{"rel": "x"}]', b"x" * 10):
        (task_dir / output_samples.SAMPLES_FILE).write_bytes(body)
        assert output_samples.load(task_dir) == {}


# ------------------------------------------------------------------------------- streamed while it runs


async def _stream(task_dir: Path, position: object = None) -> tuple[list[dict], _ItemJournalReader, Pending]:
    reader = _ItemJournalReader(task_dir, encode_item, 1 << 20)
    await reader.restore(position)
    pending = Pending()
    while not reader.done and await reader.read(pending):
        pass
    return [json.loads(e) for e in pending.encoded()], reader, pending


def _note(journal: LogJournal, task_dir: Path, live: LiveItemFiles) -> None:
    """One scan of the outbox (ckagent.delivery.taskdelivery.TaskDelivery.scan/scanned)."""
    items = task_dir / ITEMS_FILE
    sizes = {**live.scan(), ITEMS_FILE: items.stat().st_size if items.exists() else 0}
    journal.note(sizes, live.starts)


async def test_a_live_tailed_sample_streams_from_its_end_and_an_untouched_one_not_at_all(tmp_path: Path) -> None:
    _code, work, task_dir, _outputs = _staged(
        tmp_path, {"output.jsonl": _lines(SAMPLE), "untouched.jsonl": _lines(SAMPLE)}, ["*.jsonl"])
    journal = LogJournal(task_dir, ITEMS_JOURNAL, ITEMS_FILE, "item file")
    journal.open()
    live = LiveItemFiles(task_dir, work, ["*.jsonl"])  # its samples read from the task dir's record
    _note(journal, task_dir, live)
    assert live.scan() == {}  # nothing linked: the samples as staged are not this run's
    _append(work / "output.jsonl")
    _note(journal, task_dir, live)
    assert [text.split(": ", 1)[1] for text in live.take_notices()] == [
        f"output.jsonl is the package's sample ({SIZE} bytes) and this run appends to it: streaming the items it appends"]
    # A restarted agent: the journal read back, the links found again by inode, the start with them.
    journal.close()
    journal = LogJournal(task_dir, ITEMS_JOURNAL, ITEMS_FILE, "item file")
    journal.open()
    live = LiveItemFiles(task_dir, work, ["*.jsonl"])
    _append(work / "output.jsonl")
    _note(journal, task_dir, live)
    assert live.starts == {"item-files/0-output.jsonl": SIZE}
    assert live.link("output.jsonl") == (task_dir / "item-files/0-output.jsonl", SIZE)
    assert live.link("untouched.jsonl") is None
    journal.end({ITEMS_FILE: 0, **live.scan()}, live.starts)
    journal.close()
    everything, reader, _ = await _stream(task_dir)
    reader.close()
    assert everything == NEW + NEW
    _, reader, pending = await _stream(task_dir)  # resumed after the first: the rest, once
    position = json.loads(json.dumps(reader.commit(pending.take(1))))
    reader.close()
    rest, reader, _ = await _stream(task_dir, position)
    reader.close()
    assert rest == everything[1:]
    # At the end the collection counts the streamed file's items from the same start.
    collected = collect(work=work, code_dir=tmp_path / "code", since=0.0, task_dir=task_dir,
                        outputs=TaskOutputs(items=("*.jsonl",)), budget_bytes=0, master_takes_artifacts=True,
                        keep_dir=tmp_path / "kept", streamed=live.link, samples=output_samples.load(task_dir))
    assert collected.items == [("output.jsonl", 4)]
    assert collected.line().startswith(f"outputs: output.jsonl → 4 items (after the package's sample of {SIZE} B); "
                                       f"untouched.jsonl: the package's sample ({SIZE} B), not written by this run"), \
        collected.line()


async def test_a_live_tailed_sample_truncated_after_its_appends_streams_its_new_content(tmp_path: Path) -> None:
    _code, work, task_dir, _outputs = _staged(tmp_path, {"output.jsonl": _lines(SAMPLE)}, ["output.jsonl"])
    journal = LogJournal(task_dir, ITEMS_JOURNAL, ITEMS_FILE, "item file")
    journal.open()
    live = LiveItemFiles(task_dir, work, ["output.jsonl"])
    reader = _ItemJournalReader(task_dir, encode_item, 1 << 20)
    await reader.restore(None)
    pending = Pending()

    async def step() -> None:  # a scan of the outbox, then the shipper reads what was recorded
        _note(journal, task_dir, live)
        while await reader.read(pending):
            pass

    _append(work / "output.jsonl")
    await step()
    _truncate_then_write(work / "output.jsonl")  # shorter than the sample: all of it is new
    await step()
    journal.end({ITEMS_FILE: 0, **live.scan()}, live.starts)
    journal.close()
    while not reader.done and await reader.read(pending):
        pass
    reader.close()
    assert [json.loads(e) for e in pending.encoded()] == NEW + NEW[:1]


async def test_a_link_made_just_before_a_crash_starts_at_the_samples_end_in_a_resumed_delivery(tmp_path: Path) -> None:
    _code, work, task_dir, _outputs = _staged(tmp_path, {"output.jsonl": _lines(SAMPLE)}, ["output.jsonl"])
    _append(work / "output.jsonl")
    LiveItemFiles(task_dir, work, ["output.jsonl"]).link("output.jsonl")  # linked; the agent dies before noting it
    journal = LogJournal(task_dir, ITEMS_JOURNAL, ITEMS_FILE, "item file")  # the next agent's resumed delivery
    journal.open()
    assert link_starts(task_dir) == {"item-files/0-output.jsonl": SIZE}
    journal.end({ITEMS_FILE: 0, "item-files/0-output.jsonl": SIZE + len(_lines(NEW))}, link_starts(task_dir))
    journal.close()
    everything, reader, _ = await _stream(task_dir)
    reader.close()
    assert everything == NEW
