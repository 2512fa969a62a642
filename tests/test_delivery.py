"""Delivery logic: line splitting, masking, the log journal, the shipper's seq handling, the disk budget.

Pure logic runs against an in-memory master behind ``httpx.MockTransport`` (the protocol's seq rules,
plus scripted faults) with real SQLite state files and real spool files in tmp_path; waits use
Trio's autojump clock. Against the real dev master: tests/test_delivery_faults.py.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import BatchMaster, master_client

from ckagent.delivery import (
    JOURNAL_FILE,
    DiskGuard,
    LineSplitter,
    LogJournal,
    LogSink,
    Masker,
    StreamShipper,
    cleanup_task_dirs,
    decode_lines,
    encode_lines,
    item_object,
    scan_log_files,
    secret_values,
    send_result,
)
from ckagent.delivery.capture import LOG_CUT_SLACK_BYTES
from ckagent.delivery.pending import Pending
from ckagent.delivery.readers import _JournalReader
from ckagent.delivery.spool import BATCH_AGE
from ckagent.master.client import MasterClient
from ckagent.master.protocol import TaskResult
from ckagent.node.state import AsyncStateStore, StateStore

# ---------------------------------------------------------------------------------------------- lines


def split_all(data: bytes, chunks: list[int], max_line: int = 64, cr: bool = True) -> list[tuple[bytes, int]]:
    splitter = LineSplitter(0, max_line, cr)
    out: list[tuple[bytes, int]] = []
    pos = 0
    for size in chunks:
        out += zip(*splitter.feed(data[pos : pos + size]), strict=True)
        pos += size
    out += zip(*splitter.feed(data[pos:]), strict=True)
    out += zip(*splitter.flush(), strict=True)
    return out


def random_text(rng: random.Random, n: int) -> bytes:
    pieces = [b"a", b"bc", b"\n", b"\r", b"\r\n", "中".encode(), "é".encode(), b"\xff", b"x" * 70, b"\t"]
    return b"".join(rng.choice(pieces) for _ in range(n))


@pytest.mark.parametrize("seed", range(20))
def test_lines_do_not_depend_on_how_the_bytes_were_chunked(seed: int) -> None:
    rng = random.Random(seed)
    data = random_text(rng, 400)
    whole = split_all(data, [])
    assert whole == split_all(data, [rng.randint(1, 40) for _ in range(60)])
    assert whole == split_all(data, [1] * len(data))
    # Restarting at any returned end gives exactly the rest (what a resumed shipper relies on).
    for k in range(0, len(whole), 7):
        end = whole[k][1]
        splitter = LineSplitter(end, 64)
        rest = list(zip(*splitter.feed(data[end:]), strict=True)) + list(zip(*splitter.flush(), strict=True))
        assert rest == whole[k + 1 :]
    # Lossless: the pieces and the terminators between them rebuild the input.
    assert all(len(line) <= 64 for line, _ in whole)
    assert whole[-1][1] == len(data)


def test_terminators_and_a_trailing_cr() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"a\r\nb\nprogress 1/3\rprogress 2/3\r") == ([b"a", b"b", b"progress 1/3"], [3, 5, 18])
    assert splitter.offset == 18  # "progress 2/3\r" waits: the \r may be the start of \r\n
    assert splitter.feed(b"\ndone") == ([b"progress 2/3"], [32])
    assert splitter.flush() == ([b"done"], [36])
    items = LineSplitter(0, 1024, cr_breaks=False)
    assert items.feed(b'{"a": "x\ry"}\n') == ([b'{"a": "x\ry"}'], [13])


def test_a_utf8_character_split_across_reads_stays_whole() -> None:
    data = "日本語のログ\n".encode()
    splitter = LineSplitter()
    lines: list[bytes] = []
    for i in range(len(data)):
        lines += splitter.feed(data[i : i + 1])[0]
    assert decode_lines(lines) == ["日本語のログ"]


def test_invalid_bytes_become_replacement_characters() -> None:
    assert decode_lines([b"ok \xff\xfe end", b"\xe4\xb8", b"fine"]) == ["ok \ufffd\ufffd end", "\ufffd", "fine"]


def test_a_5_mib_line_is_cut_into_pieces_at_character_boundaries() -> None:
    line = ("价格" * (5 * 1024 * 1024 // 6 + 1)).encode()[: 5 * 1024 * 1024]  # no newline at all
    splitter = LineSplitter()
    pieces: list[bytes] = []
    for pos in range(0, len(line), 65536):
        pieces += splitter.feed(line[pos : pos + 65536])[0]
    pieces += splitter.flush()[0]
    assert b"".join(pieces) == line
    assert all(0 < len(p) <= 64 * 1024 for p in pieces)
    assert len(pieces) == -(-len(line) // (64 * 1024 - 2))  # cuts step back to a character start
    assert all("\ufffd" not in text for text in decode_lines(pieces[:-1]))


def test_encoded_lines_are_the_json_of_the_shipped_texts() -> None:
    """encode_lines (the batch body's elements) == json.dumps of decode_lines, on both of its paths."""
    rng = random.Random(7)
    masker = Masker(["s3cret-value", "ключ-секрет", 'q"uote', "yz", "9"])  # the short ones: standing alone
    plain_seen = general_seen = 0
    for round_ in range(400):
        if round_ % 2:  # printable ASCII only (the path that never decodes), sometimes with a secret
            lines = [bytes(rng.choice(b"abc xyz-019=;:[]{}~") for _ in range(rng.randint(0, 30)))
                     + (b" s3cret-value" if rng.random() < 0.3 else b"") for _ in range(5)]
        else:
            lines = [random_text(rng, rng.randint(0, 30)).replace(b"\n", b"").replace(b"\r", b"")
                     + bytes([rng.choice([0, 1, 7, 9, 34, 92, 127])]) * rng.randint(0, 1)
                     + "ключ-секрет".encode() * rng.randint(0, 1) for _ in range(5)]
        if all(32 <= b < 127 and b not in (34, 92) for b in b"".join(lines)):
            plain_seen += 1
        else:
            general_seen += 1
        for mask, prefix in ((None, ""), (masker, ""), (masker, '[dir/"x".log] '), (None, "[лог.log] ")):
            expected = [json.dumps(t, ensure_ascii=False).encode() for t in decode_lines(lines, mask, prefix)]
            assert encode_lines(lines, mask, prefix) == expected, (lines, prefix)
    assert plain_seen > 100 and general_seen > 100
    assert encode_lines([]) == []
    assert encode_lines([b"token s3cret-value"], masker) == [b'"token ***"']


# ---------------------------------------------------------------------------------------------- secrets


def test_secrets_are_masked_in_shipped_lines() -> None:
    env = {"API_TOKEN": "tok-12345", "DB_PASSWORD": "hunter22", "MY_KEY": "k3y-value", "HOME": "/root",
           "SHORT_SECRET": "abc", "PLAIN": "tok-12345-not-a-name"}
    values = secret_values({**env, "EMPTY_KEY": ""}, ["agent-registration-token", ""])
    assert "/root" not in values and "tok-12345-not-a-name" not in values and "" not in values
    masker = Masker([*values, "multi\nline"])
    lines = [b"token=tok-12345 pw=hunter22", b"key k3y-value and agent-registration-token", b"multi", b"nothing"]
    assert decode_lines(lines, masker) == ["token=*** pw=***", "key *** and ***", "multi", "nothing"]
    assert not Masker([]) and Masker(["x" * 8])
    # A short secret (< 8 characters) is masked where it stands alone, never inside a word: masking
    # "abc" in "abcdef" would corrupt the line and the stars would give the secret away.
    lines = [b"short=abc abcdef xabc abc_1 (abc)", "abc é abcé".encode(), b"2026-11-29 19:02:59 abc"]
    assert decode_lines(lines, masker) == ["short=*** abcdef xabc abc_1 (***)", "*** é abcé",
                                           "2026-11-29 19:02:59 ***"]
    assert encode_lines(lines, masker) == [json.dumps(t, ensure_ascii=False).encode()
                                           for t in decode_lines(lines, masker)]
    zero = Masker(secret_values({"PIN_KEY": "0"}))
    assert decode_lines([b"2026-11-29 19:02:59,100 pin 0"], zero) == ["2026-11-29 19:02:59,100 pin ***"]
    assert encode_lines([b'{"time": "2026-11-29T19:02:59.100Z", "n": 10}'], zero) == [
        b'"{\\"time\\": \\"2026-11-29T19:02:59.100Z\\", \\"n\\": 10}"']


def test_items_are_parsed_and_anything_else_is_kept_wrapped() -> None:
    assert item_object(b'{"a": 1}') == {"a": 1}
    assert item_object(b"   ") is None
    assert item_object(b"[1, 2]")["_error"] == "not a JSON object"
    assert "not JSON" in item_object(b'{"a": NaN}')["_error"]
    assert item_object(b'{"big": 1e999}') == {"big": "1e999"}  # JSON cannot carry Infinity
    assert item_object(b"\xff{")["_invalidItem"] == "\ufffd{"


# ---------------------------------------------------------------------------------------------- journal


async def read_all(reader: _JournalReader) -> tuple[list[str], Pending]:
    pending = Pending()
    while not reader.done:
        if not await reader.read(pending):
            break
    return [json.loads(e) for e in pending.encoded()], pending


async def test_the_journal_replays_the_same_stream_from_any_acknowledged_element(tmp_path: Path) -> None:
    """Exactly once across restarts: resuming after element k yields exactly elements k+1..."""
    rng = random.Random(3)
    out, extra = tmp_path / "output.log", tmp_path / "spider.log"
    journal = LogJournal(tmp_path)
    journal.open()
    expected_out = bytearray()
    for step in range(60):
        target, buffer = (out, expected_out) if rng.random() < 0.6 else (extra, None)
        chunk = random_text(rng, rng.randint(1, 12))
        with target.open("ab") as fh:
            fh.write(chunk)
        if buffer is not None:
            buffer += chunk
        if step % 3 == 0:  # records are written now and then, as the journal task does
            journal.note({p.name: p.stat().st_size for p in (out, extra) if p.exists()})
    journal.end({p.name: p.stat().st_size for p in (out, extra)})
    journal.close()

    reader = _JournalReader(tmp_path, Masker([]), max_line_bytes=64)
    await reader.restore(None)
    everything, _ = await read_all(reader)
    assert reader.done
    plain = [t for t in everything if not t.startswith("[spider.log] ")]
    splitter = LineSplitter(0, 64)
    direct = splitter.feed(bytes(expected_out))[0] + splitter.flush()[0]
    assert plain == decode_lines(direct)  # stdout lines are unmarked and complete
    assert any(t.startswith("[spider.log] ") for t in everything)

    for k in range(1, len(everything), 5):
        first = _JournalReader(tmp_path, Masker([]), max_line_bytes=64)
        await first.restore(None)
        pending = Pending()
        while len(pending) < k:
            assert await first.read(pending)
        position = first.commit(pending.take(k))
        position = json.loads(json.dumps(position))  # as stored in SQLite
        resumed = _JournalReader(tmp_path, Masker([]), max_line_bytes=64)
        await resumed.restore(position)
        rest, _ = await read_all(resumed)
        assert rest == everything[k:], k
        first.close()
        resumed.close()


def test_journal_open_drops_a_torn_record_and_keeps_what_was_recorded(tmp_path: Path) -> None:
    (tmp_path / "output.log").write_bytes(b"one\ntwo\n")
    journal = LogJournal(tmp_path)
    journal.open()
    journal.note({"output.log": 4})
    journal.close()
    with (tmp_path / JOURNAL_FILE).open("ab") as fh:
        fh.write(b"D 0 8")  # the agent died in the middle of a record
    again = LogJournal(tmp_path)
    again.open()
    assert again.recorded == {0: 4} and not again.ended
    again.end({"output.log": 8})
    again.end({"output.log": 8})  # idempotent
    again.close()
    assert (tmp_path / JOURNAL_FILE).read_text() == "S 0 output.log\nD 0 4\nD 0 8\nF 0\nE\n"


def test_a_rotated_log_file_continues_as_a_new_source(tmp_path: Path) -> None:
    journal = LogJournal(tmp_path)
    journal.open()
    journal.note({"output.log": 0, "app.log": 100})
    journal.note({"app.log": 10})
    journal.close()
    assert (tmp_path / JOURNAL_FILE).read_text() == "S 0 output.log\nS 1 app.log\nD 1 100\nF 1\nS 2 app.log\nD 2 10\n"


def test_log_files_are_found_by_glob_inside_the_task_dir_only(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    for name in ("output.log", "scrapy.log", "logs/a.log", "items.jsonl", "notes.txt"):
        (tmp_path / name).write_text("x")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.log"
    outside.write_text("secret")
    (tmp_path / "link.log").symlink_to(outside)
    found = scan_log_files(tmp_path, ["*.log", "logs/*.log", "../*.log", "/etc/*"])
    assert found == {"scrapy.log": 1, "logs/a.log": 1}


# ---------------------------------------------------------------------------------------------- a master in memory


def write_task(task_dir: Path, lines: list[str], items: list[dict[str, Any]]) -> None:
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / "output.log").write_text("".join(f"{line}\n" for line in lines))
    (task_dir / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    journal = LogJournal(task_dir)
    journal.open()
    journal.end({"output.log": (task_dir / "output.log").stat().st_size})
    journal.close()


async def ship(master: MasterClient, store: AsyncStateStore, task_dir: Path) -> tuple[StreamShipper, StreamShipper]:
    logs = StreamShipper.logs(master, store, "t1", task_dir, Masker([]))
    items = StreamShipper.items(master, store, "t1", task_dir)
    items.finish()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(logs.run)
        nursery.start_soon(items.run)
    return logs, items


@pytest.fixture
def store(tmp_path: Path) -> AsyncStateStore:
    return AsyncStateStore(StateStore(tmp_path / "state.db"))


LINES = [f"line {i:05d} " + "x" * (i % 50) for i in range(12000)]
ITEMS = [{"n": i, "title": f"商品 {i}"} for i in range(3000)]


async def test_everything_arrives_once_in_order_and_the_position_is_stored(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock
) -> None:
    fake = BatchMaster()
    write_task(tmp_path / "t1", LINES, ITEMS)
    logs, items = await ship(master_client(fake), store, tmp_path / "t1")
    assert fake.logs == LINES and fake.items == ITEMS
    assert (logs.acked, items.acked) == (len(LINES), len(ITEMS))
    assert all(count <= 5000 for _, _, _, count in fake.requests)
    assert (await store.stream_position("t1", "items"))[0] == len(ITEMS)
    # A restart ships nothing twice: the stored positions are at the end.
    before = len(fake.requests)
    await ship(master_client(fake), store, tmp_path / "t1")
    assert len(fake.requests) == before and fake.logs == LINES


async def test_a_master_that_already_holds_more_is_skipped_and_one_that_lost_data_is_refilled(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock
) -> None:
    fake = BatchMaster()
    fake.logs = LINES[:7000]  # e.g. the agent crashed after the master stored, before it saved its position
    write_task(tmp_path / "t1", LINES, ITEMS)
    await store.save_stream_position("t1", "items", 2500, None)  # ... and a master restored from a backup
    fake.items = ITEMS[:1000]
    await ship(master_client(fake), store, tmp_path / "t1")
    assert fake.logs == LINES and fake.items == ITEMS
    log_seqs = [seq for _, kind, seq, _ in fake.requests if kind == "logs"]
    assert log_seqs[0] == 0 and 7000 in log_seqs  # told 7000, skipped what the master had
    item_seqs = [seq for _, kind, seq, _ in fake.requests if kind == "items"]
    assert item_seqs[0] == 2500 and 1000 in item_seqs  # 409 expectedSeq 1000: rewound to the start


async def test_unavailable_master_is_retried_with_growing_backoff(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock
) -> None:
    fake = BatchMaster()
    failures = {"left": 8}

    def fault(kind: str, seq: int, batch: list[Any]) -> httpx.Response | None:
        if kind == "logs" and failures["left"]:
            failures["left"] -= 1
            return httpx.Response(503, json={"error": "busy"})
        return None

    fake.fault = fault
    write_task(tmp_path / "t1", LINES[:10], [])
    await ship(master_client(fake), store, tmp_path / "t1")
    assert fake.logs == LINES[:10]
    times = [t for t, kind, _, _ in fake.requests if kind == "logs"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) == 8 and min(gaps) >= 0.25 and max(gaps) >= 8  # 0.5, 1, 2, ... with jitter


async def test_too_large_batches_are_halved_and_a_refused_element_becomes_a_placeholder(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock
) -> None:
    fake = BatchMaster()

    def fault(kind: str, seq: int, batch: list[Any]) -> httpx.Response | None:
        if kind == "logs" and len(batch) > 1000:
            return httpx.Response(413, json={"error": "too large"})
        bad = [i for i, item in enumerate(batch) if item.get("n") == 3] if kind == "items" else []
        if bad:  # the protocol's word to drop one element: a 422 naming it
            return httpx.Response(422, json={"error": "bad item", "field": f"items[{bad[0]}].n"})
        return None

    fake.fault = fault
    write_task(tmp_path / "t1", LINES[:3000], ITEMS[:6])
    await ship(master_client(fake), store, tmp_path / "t1")
    assert fake.logs == LINES[:3000]
    assert fake.items[:3] == ITEMS[:3] and fake.items[4:] == ITEMS[4:6]
    assert "refused by the master" in fake.items[3]["_error"]
    log_counts = [count for _, kind, _, count in fake.requests if kind == "logs"]
    assert log_counts[:4] == [3000, 1500, 750, 750]  # halved, then never above what failed


async def test_a_stream_refused_for_good_ends_and_the_result_still_goes(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock
) -> None:
    fake = BatchMaster()
    fake.fault = lambda kind, seq, batch: httpx.Response(409, json={"error": "not claimed by this node"})
    write_task(tmp_path / "t1", LINES[:100], ITEMS[:10])
    master = master_client(fake)
    logs, items = await ship(master, store, tmp_path / "t1")
    assert logs.refused and items.refused
    assert len(fake.requests) == 2  # one attempt each, no loop
    await store.add_task("t1", "s", {}, tmp_path / "t1")
    await send_result(master, store, "t1", TaskResult(status="SUCCESS", exit_code=0))
    assert fake.results == [{"status": "SUCCESS", "exitCode": 0}]
    assert await store.pending_delivery() == []


async def test_lines_arrive_while_the_file_grows(tmp_path: Path, store: AsyncStateStore) -> None:
    """A live task: lines are shipped about a second after they were written, before the end."""
    fake = BatchMaster()
    task_dir = tmp_path / "t1"
    task_dir.mkdir()
    journal = LogJournal(task_dir)
    journal.open()
    logs = StreamShipper.logs(master_client(fake), store, "t1", task_dir, Masker([]))
    journal.on_record = logs.notify
    sink = LogSink(task_dir / "output.log")
    with trio.fail_after(10):  # noqa: ASYNC912 - the nursery's exit checkpoints
        async with trio.open_nursery() as nursery:
            nursery.start_soon(logs.run)
            sink.write(b"first\nsecond")
            journal.note({"output.log": sink.size})
            for _ in range(200):  # about a second: the batch age
                if fake.logs:
                    break
                await trio.sleep(0.05)
            assert fake.logs == ["first"]
            sink.write(b" half\n")
            sink.close()
            journal.end({"output.log": sink.size})
    assert fake.logs == ["first", "second half"]


# ---------------------------------------------------------------------------------------------- disk budget


def test_the_log_budget_drops_output_and_leaves_one_marker(tmp_path: Path) -> None:
    sink = LogSink(tmp_path / "output.log", max_bytes=100)
    for _ in range(10):
        sink.write(b"0123456789abcdefghijklmnopqrstuvwxyz\n")  # 37 bytes
    sink.close()
    sink.close()
    lines = (tmp_path / "output.log").read_bytes().split(b"\n")
    assert lines[:2] == [b"0123456789abcdefghijklmnopqrstuvwxyz"] * 2
    assert lines[2] == b"0123456789abcdefghijklmnop"  # cut at exactly 100 bytes
    assert b"output truncated: 270 bytes dropped" in lines[3] and b"task.max_log_bytes" in lines[3]
    assert lines[4:] == [b""]
    assert (sink.dropped_bytes, sink.bytes_written) == (270, 100)


def test_a_spider_writing_past_the_budget_is_cut_rarely_and_counted_exactly(tmp_path: Path) -> None:
    """The spider appends to output.log itself (another descriptor): past the budget the file is cut
    back only once LOG_CUT_SLACK_BYTES gathered, and at the end, when the spider is gone, exactly."""
    path = tmp_path / "output.log"
    sink = LogSink(path, max_bytes=100)
    with open(path, "ab", buffering=0) as spider:
        spider.write(b"x" * 60)
        assert sink.grown() == 60 and path.stat().st_size == 60
        spider.write(b"y" * 1000)  # 40 kept, 960 past the budget: not cut yet
        assert sink.grown() == 1000
        assert (sink.size, path.stat().st_size, sink.dropped_bytes) == (100, 1060, 0)
        assert sink.grown() == 0  # nothing new: the waiting bytes are not news again
        spider.write(b"z" * LOG_CUT_SLACK_BYTES)  # the slack reached: cut now
        assert sink.grown() == LOG_CUT_SLACK_BYTES
        assert (path.stat().st_size, sink.dropped_bytes) == (100, 960 + LOG_CUT_SLACK_BYTES)
        spider.write(b"w" * 500)
        sink.grown()
    sink.close()  # the last look cuts what waits, and counts it
    assert sink.dropped_bytes == 960 + LOG_CUT_SLACK_BYTES + 500
    text = path.read_bytes()
    assert text.startswith(b"x" * 60 + b"y" * 40 + b"\n[ckagent ")
    assert f"output truncated: {960 + LOG_CUT_SLACK_BYTES + 500} bytes dropped".encode() in text


async def test_the_free_space_floor_never_cuts_output(tmp_path: Path) -> None:
    """Below the floor output.log is not cut (a full disk is the writer's problem: the disk watch
    stops the task that filled it, ckagent.delivery.diskwatch)."""
    guard = DiskGuard(tmp_path, min_free_bytes=1)
    await guard.refresh()
    assert guard.free_bytes is not None and guard.allows(10)
    guard.min_free_bytes = guard.free_bytes - 50  # 50 bytes left above the floor
    assert not guard.allows(100)
    sink = LogSink(tmp_path / "output.log")
    sink.write(b"a" * 40 + b"\n")
    sink.write(b"b" * 40 + b"\n")
    sink.write(b"c\n")
    sink.close()
    assert (tmp_path / "output.log").read_text() == "a" * 40 + "\n" + "b" * 40 + "\nc\n"


def test_a_failing_write_truncates_instead_of_raising(tmp_path: Path) -> None:
    sink = LogSink(tmp_path / "output.log")
    sink.write(b"kept\n")
    os.close(sink._fd)
    sink._fd = os.open(tmp_path / "output.log", os.O_RDONLY)  # writes now fail with EBADF
    sink.write(b"lost\n")
    assert sink.truncated is not None and "writing output.log failed" in sink.truncated
    sink.close()


# ---------------------------------------------------------------------------------------------- retention


async def test_cleanup_deletes_only_acknowledged_task_dirs_past_retention(tmp_path: Path, store: AsyncStateStore) -> None:
    tasks = tmp_path / "tasks"
    for task_id in ("old", "recent", "unsent", "running"):
        (tasks / task_id).mkdir(parents=True)
        (tasks / task_id / "output.log").write_text("x")
        await store.add_task(task_id, "s", {}, tasks / task_id)
    for task_id in ("old", "recent", "unsent"):
        await store.set_result(task_id, {"status": "SUCCESS"})
    await store.mark_result_acked("old")
    await store.mark_result_acked("recent")
    store.sync._exec("UPDATE tasks SET finished_at=? WHERE task_id='old'", (time.time() - 8 * 86400,))
    assert await cleanup_task_dirs(store, tasks, 7 * 86400) == 1
    assert sorted(p.name for p in tasks.iterdir()) == ["recent", "running", "unsent"]
    assert await store.get("old") is None
    assert await cleanup_task_dirs(store, tasks, 0) == 1  # --cleanup-temp-files: every delivered one
    assert sorted(p.name for p in tasks.iterdir()) == ["running", "unsent"]


async def test_rejected_log_file_globs_are_named_in_the_task_log_not_dropped_silently(
    tmp_path: Path, store: AsyncStateStore, caplog: pytest.LogCaptureFixture
) -> None:
    from ckagent.delivery import Outbox
    from ckagent.master.protocol import Task

    task = Task.from_json({"id": "t-globs", "spiderId": "s", "framework": "python",
                           "params": {"logFiles": ["logs/*.log", "../secret.log", "/etc/*", 5]}})
    outbox = Outbox(master_client(BatchMaster()), store, tmp_path)
    task_dir = tmp_path / "tasks" / task.id
    task_dir.mkdir(parents=True)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            delivery = await outbox.open_task(task, task_dir)
            assert "logs/*.log" in delivery.globs and "../secret.log" not in delivery.globs
            nursery.cancel_scope.cancel()
    log_text = (task_dir / "output.log").read_text()
    assert "params.logFiles: ignored '../secret.log', '/etc/*', 5: each must be a glob relative to the task dir" in log_text
    assert log_text.startswith("[ckagent ") and log_text.count("\n") == 1
    assert "t-globs: params.logFiles: ignored" in caplog.text


@pytest.mark.parametrize("hurry", [False, True])
async def test_a_hand_over_flush_sends_what_was_read_at_once(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock, hurry: bool
) -> None:
    """Read items wait up to BATCH_AGE for a fuller batch; a hurried shipper (the hand-over's last
    flush, ckagent.delivery.outbox.HAND_OVER_FLUSH_TIMEOUT) sends them at once and says when nothing waits."""
    fake = BatchMaster()
    write_task(tmp_path / "t1", [], ITEMS[:5])
    items = StreamShipper.items(master_client(fake), store, "t1", tmp_path / "t1")
    idle = trio.Event()
    items.hurry, items.on_idle = hurry, idle.set
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(items.run)
        await idle.wait()
        nursery.cancel_scope.cancel()  # the task runs on: its items stream never ends by itself
    assert fake.items == ITEMS[:5]
    [(sent, _, _, _)] = fake.requests
    assert (sent - started < BATCH_AGE / 10) if hurry else (sent - started >= BATCH_AGE)
