"""The control channel's files as hostile input (ckagent.task.control) and a checkpoint's items position
(ckagent.delivery.itemscan.count_items): real files in tmp_path, hypothesis on the answer parser.

- every byte string either parses into an answer of the protocol's shape or raises BadAck, nothing else;
- the ack file is followed from an offset: garbage, wrong ids, a huge line, a torn last line, a link in
  its place — each said as a problem or left for the next read, never followed;
- a snapshot is a directory of the snapshot dir, never a link or a file;
- an items offset becomes the number of items the items reader makes of the lines before it: blank
  lines skipped, an over-long line one placeholder, a line torn at the offset not counted.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from ckagent.delivery.itemscan import count_items
from ckagent.delivery.lines import encode_item
from ckagent.delivery.pending import Pending
from ckagent.delivery.readers import _FileReader
from ckagent.task.control import (
    MAX_ACK_LINE_BYTES,
    Ack,
    AckReader,
    BadAck,
    append_request,
    last_request_id,
    parse_ack,
    request_line,
    snapshot_problem,
)


@given(st.binary(max_size=600))
def test_any_bytes_are_an_answer_or_bad_ack(line: bytes) -> None:
    try:
        ack = parse_ack(line)
    except BadAck:
        return
    assert ack.id >= 1
    assert (ack.error is not None) or (ack.snapshot == str(ack.id) and ack.items_offset is not None)


@given(st.integers(1, 2**50), st.integers(0, 2**50), st.none() | st.floats(0, 1e6))
def test_an_answer_of_the_protocols_shape_is_read_as_written(ack_id: int, offset: int, pause: float | None) -> None:
    line = {"id": ack_id, "itemsOffset": offset, "snapshot": str(ack_id)}
    if pause is not None:
        line["pauseMs"] = pause
    assert parse_ack(json.dumps(line).encode()) == Ack(ack_id, offset, str(ack_id), pause)


@given(st.dictionaries(st.sampled_from(["id", "itemsOffset", "snapshot", "pauseMs", "error", "x"]),
                       st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
                       | st.lists(st.integers(), max_size=2)))
def test_json_objects_of_any_shape_never_raise_anything_else(obj: dict) -> None:
    with contextlib.suppress(BadAck):
        parse_ack(json.dumps(obj).encode())


@pytest.mark.parametrize("line, why", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"id": 0, "itemsOffset": 1, "snapshot": "0"}', "id"),
    (b'{"id": true, "itemsOffset": 1, "snapshot": "1"}', "id"),
    (b'{"id": 1.5, "itemsOffset": 1, "snapshot": "1"}', "id"),
    (b'{"id": 3, "itemsOffset": -1, "snapshot": "3"}', "itemsOffset"),
    (b'{"id": 3, "itemsOffset": 10, "snapshot": "../../etc"}', "snapshot"),
    (b'{"id": 3, "itemsOffset": 10, "snapshot": "4"}', "snapshot"),
    (b'{"id": 3, "itemsOffset": 10, "snapshot": "03"}', "snapshot"),
    (b'{"id": 3, "itemsOffset": 10, "snapshot": "3", "pauseMs": -1}', "pauseMs"),
    (b'{"id": 3, "itemsOffset": 10, "snapshot": "3", "pauseMs": NaN}', "pauseMs"),
    (b'{"id": 3, "error": 5}', "error"),
    (b"\xff\xfe{}", "not JSON"),
    (b"[" * 100000, "a line of"),
])
def test_answers_that_are_not_the_protocols_say_why(line: bytes, why: str) -> None:
    with pytest.raises(BadAck, match=why):
        parse_ack(line)


def test_an_error_answer_is_kept_short() -> None:
    ack = parse_ack(json.dumps({"id": 7, "error": "x" * (MAX_ACK_LINE_BYTES - 40)}).encode())
    assert ack.id == 7 and ack.error is not None and len(ack.error) <= 300


def test_the_reader_follows_the_file_skips_garbage_and_huge_lines_and_waits_for_a_torn_one(tmp_path: Path) -> None:
    ack_file = tmp_path / "control-ack.jsonl"
    reader = AckReader(tmp_path)
    assert reader.read() == ([], [])  # no file yet
    ack_file.write_bytes(b'garbage\n{"id": 1, "itemsOffset": 0, "snapshot": "1"}\n' + b"y" * 10000)
    acks, problems = reader.read()
    assert acks == [Ack(1, 0, "1")]
    assert len(problems) == 2 and "not JSON" in problems[0] and "longer than" in problems[1]
    with ack_file.open("ab") as fh:  # the huge line ends; then a torn line
        fh.write(b'yyy\n{"id": 2, "error": "disk full"}\n{"id": 3, "itemsOff')
    acks, problems = reader.read()
    assert acks == [Ack(2, error="disk full")] and problems == []
    with ack_file.open("ab") as fh:
        fh.write(b'set": 5, "snapshot": "3"}\n')
    assert reader.read() == ([Ack(3, 5, "3")], [])
    assert reader.offset == ack_file.stat().st_size


def test_a_link_in_place_of_the_ack_file_is_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"id": 1, "itemsOffset": 0, "snapshot": "1"}\n')
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    (task_dir / "control-ack.jsonl").symlink_to(secret)
    acks, problems = AckReader(task_dir).read()
    assert acks == [] and len(problems) == 1 and "symlink" in problems[0]
    (task_dir / "control-ack.jsonl").unlink()
    os.mkfifo(task_dir / "control-ack.jsonl")  # a FIFO never blocks the reader
    acks, problems = AckReader(task_dir).read()
    assert acks == [] and "not a regular file" in problems[0]


def test_requests_are_appended_never_through_a_link_and_numbered_on_after_a_restart(tmp_path: Path) -> None:
    assert last_request_id(tmp_path) == 0
    append_request(tmp_path, request_line(1, "interval"))
    append_request(tmp_path, request_line(2, "migrate", seconds_left=18.46))
    lines = [json.loads(line) for line in (tmp_path / "control.jsonl").read_text().splitlines()]
    assert lines == [{"event": "persistState", "id": 1, "reason": "interval"},
                     {"event": "migrating", "id": 2, "reason": "migrate", "secondsLeft": 18.5}]
    assert last_request_id(tmp_path) == 2
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "control.jsonl").unlink()
    (tmp_path / "control.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        append_request(tmp_path, request_line(3, "interval"))
    assert target.read_text() == ""


def test_a_snapshot_must_be_a_directory_not_a_link(tmp_path: Path) -> None:
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    (snapshots / "1").mkdir()
    (snapshots / "2").symlink_to(tmp_path)
    (snapshots / "3").write_text("")
    assert snapshot_problem(tmp_path, "1") is None
    assert "not a directory" in (snapshot_problem(tmp_path, "2") or "")
    assert "not a directory" in (snapshot_problem(tmp_path, "3") or "")
    assert "cannot be seen" in (snapshot_problem(tmp_path, "4") or "")
    (tmp_path / "moved").mkdir()
    snapshots.rename(tmp_path / "moved" / "snapshots")
    snapshots.symlink_to(tmp_path / "moved" / "snapshots")  # a link on the way
    assert snapshot_problem(tmp_path, "1") is not None


def _reader_count(path: Path) -> list[int]:
    """The items reader's elements' ends for the whole file (what the items stream makes of it)."""
    async def main() -> list[int]:
        reader = _FileReader(path, encode_item, 64, cr_breaks=False)
        reader.finished = True
        pending = Pending()
        while not reader.done:
            await reader.read(pending)
        reader.close()
        return pending.marks

    return trio.run(main)


@given(st.lists(st.sampled_from([b'{"a": 1}', b"", b"   ", b"not json", b'{"b": "' + b"x" * 100 + b'"}',
                                 b'{"c": "\xc3\xa9"}', b"\xff"]), max_size=30),
       st.data())
@settings(max_examples=60, deadline=None)  # a file and a Trio run per example
def test_an_offset_becomes_the_items_the_reader_makes_before_it(tmp_path_factory: pytest.TempPathFactory,
                                                                lines: list[bytes], data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("items") / "items.jsonl"
    content = b"".join(line + b"\n" for line in lines)
    path.write_bytes(content)
    ends = _reader_count(path)
    offset = data.draw(st.integers(0, len(content)))
    middle = data.draw(st.integers(0, offset))
    expected = sum(1 for end in ends if end <= offset)
    count, last = count_items(path, 0, offset, encode_item, 64)
    assert count == expected
    assert last <= offset and (last == 0 or content[last - 1:last] == b"\n")
    # From an earlier answer's position on (where its last counted line ended): the same total.
    first, at = count_items(path, 0, middle, encode_item, 64)
    rest, _ = count_items(path, at, offset, encode_item, 64)
    assert first + rest == expected


def test_a_line_torn_at_the_offset_is_not_counted(tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": 3')
    assert count_items(path, 0, path.stat().st_size, encode_item, 64) == (2, 18)
    assert count_items(path, 0, 12, encode_item, 64) == (1, 9)
    assert count_items(path, 0, 0, encode_item, 64) == (0, 0)
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    assert count_items(link, 0, 18, encode_item, 64) == (0, 0)  # never through a link
