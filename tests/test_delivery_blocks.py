"""Blocks of plain log lines (LineSplitter.feed_block, encode_block, Pending.add_block) behave exactly
like one element per line: the same batch bodies, sizes, cuts and acknowledged positions; so do the
item lines of a read encoded together."""

from __future__ import annotations

import json
import random

import pytest

from ckagent.delivery.lines import LineSplitter, encode_block, encode_item, encode_lines
from ckagent.delivery.pending import Pending
from ckagent.delivery.readers import _ItemLines, oversize_placeholder
from ckagent.node.logs import Masker

SECRET = "s3cr3t-value-0042"


def plain_heavy_text(rng: random.Random, lines: int) -> bytes:
    """Mostly printable-ASCII lines; now and then a line that needs the per-line path (a secret,
    a quote, a tab, non-ASCII, a \\r) or is longer than the 64-byte line limit used here."""
    out = []
    for _ in range(lines):
        roll = rng.random()
        if roll < 0.03:
            text = rng.choice([SECRET, 'say "hi"', "tab\there", "中文", "bar\rprogress", "x" * 150, ""])
        else:
            text = "".join(rng.choice("abcdefghij klmnop0123456789.,;:") for _ in range(rng.randint(0, 40)))
        out.append(text.encode())
    return b"\n".join(out) + (b"\n" if rng.random() < 0.7 else b"")


def fill(data: bytes, chunks: list[int], blocks: bool, masker: Masker, prefix: str) -> Pending:
    """Everything in ``data`` read in ``chunks`` into a Pending, as _JournalReader._emit_fed does
    (``blocks``) or one element per line (the reference)."""
    splitter = LineSplitter(0, 64)
    pending = Pending()
    at = 0
    for size in [*chunks, len(data)]:
        piece, at = data[at : at + size], at + size
        if not piece:
            continue
        fed = splitter.feed_block(piece) if blocks else None
        if fed is None:
            lines, ends = splitter.feed(piece)
            pending.add(encode_lines(lines, masker, prefix), ends, ("tag", 0))
            continue
        block, start, count = fed
        encoded = encode_block(block, masker, prefix)
        if encoded is None:
            lines, ends = LineSplitter.split_block(block, start)
            pending.add(encode_lines(lines, masker, prefix), ends, ("tag", 0))
        else:
            pending.add_block(encoded[0], count, start, start + len(block) + 1, encoded[1], ("tag", 0))
    lines, ends = splitter.flush()
    pending.add(encode_lines(lines, masker, prefix), ends, ("tag", 1))
    return pending


@pytest.mark.parametrize("seed", range(12))
async def test_blocks_give_the_same_batches_and_positions_as_one_element_per_line(seed: int) -> None:
    rng = random.Random(seed)
    data = plain_heavy_text(rng, rng.randint(200, 2000))
    chunks = [rng.randint(1, 3000) for _ in range(40)]
    masker = Masker([SECRET])
    prefix = rng.choice(["", "[spider.log] "])
    # async: Pending reads the Trio clock; nothing here waits.
    reference = fill(data, chunks, False, masker, prefix)
    blocked = fill(data, chunks, True, masker, prefix)
    assert len(blocked) == len(reference) and blocked.size == reference.size
    assert blocked.size_of(0) == reference.size_of(0) == 0
    seq = 0
    while len(reference):
        assert blocked.first() == reference.first()
        if rng.random() < 0.05:  # a refused element is replaced by a placeholder
            blocked.replace_first(b'"placeholder"')
            reference.replace_first(b'"placeholder"')
        max_count, max_bytes = rng.randint(1, 700), rng.randint(1, 20000)
        n = reference.batch_len(max_count, max_bytes)
        assert blocked.batch_len(max_count, max_bytes) == n
        assert blocked.size_of(n) == reference.size_of(n)
        body = reference.body(n, seq, "lines")
        assert blocked.body(n, seq, "lines") == body
        assert len(json.loads(body)["lines"]) == n
        take = rng.choice([n, max(1, n // 2), rng.randint(1, len(reference))])
        assert blocked.take(take) == reference.take(take)
        assert len(blocked) == len(reference) and blocked.size == reference.size
        seq += take
    assert not blocked.elements and not blocked._blocks


async def test_blocks_are_used_for_plain_output() -> None:
    rng = random.Random(1)
    data = b"".join(b"%d plain line\n" % i for i in range(3000))
    pending = fill(data, [rng.randint(1000, 5000) for _ in range(20)], True, Masker([SECRET]), "")
    assert pending._blocks and len(pending.elements) < 30 and len(pending) == 3000


async def test_a_block_is_cut_where_a_batch_ends_and_keeps_each_line_s_end() -> None:
    data = b"".join(b"line %d\n" % i for i in range(10))
    splitter = LineSplitter(100, 64)
    block, start, count = splitter.feed_block(data) or (b"", 0, 0)
    assert (start, count, splitter.offset) == (100, 10, 100 + len(data))
    encoded = encode_block(block, None, "")
    assert encoded is not None
    pending = Pending()
    pending.add_block(encoded[0], count, start, start + len(block) + 1, encoded[1], "run")
    assert pending.batch_len(4, 1 << 20) == 4
    assert pending.body(4, 7, "lines") == b'{"seq":7,"lines":["line 0","line 1","line 2","line 3"]}'
    assert pending.take(4) == [("run", 100 + len(b"line 0\nline 1\nline 2\nline 3\n"))]
    assert pending.take(6) == [("run", 100 + len(data))]


def test_feed_block_leaves_what_it_cannot_take_to_feed() -> None:
    splitter = LineSplitter(0, 8)
    assert splitter.feed_block(b"no newline yet") is None
    assert splitter.feed_block(b"a\rb\n") is None  # a \r breaks lines: feed's rules
    assert splitter.feed_block(b"short\n" + b"y" * 9 + b"\n") is None  # a line beyond max_line_bytes
    assert splitter.offset == 0 and splitter.buffered == 0
    assert LineSplitter(0, 8, cr_breaks=False).feed_block(b"a\rb\n") == (b"a\rb", 0, 1)
    assert encode_block(b"a\rb") is None  # \r is not plain: it is escaped one line at a time
    assert encode_block(b"ok\nfine", Masker(["fine"])) is None  # a secret: masked one line at a time
    assert encode_block(b"ok\nfine", None, 'a"b') is None
    assert encode_block(b"ok\nfine", None, "[x] ") == (b'"[x] ok","[x] fine"', 4)


@pytest.mark.parametrize("seed", range(40))
def test_item_lines_read_in_any_chunks_are_each_line_encoded_or_one_placeholder(seed: int) -> None:
    """A read's lines are encoded together when none of them is a piece of a line over the limit,
    one by one otherwise: either way each line is its element (a blank one none), a line over the
    limit one placeholder of its size, marks where each line ends."""
    limit = 16
    rng = random.Random(seed)
    contents = [rng.choice([b'{"a":1}', b"", b"  ", b"[1]", b"x", b'{"b":"' + b"y" * rng.randint(0, 40) + b'"}'])
                for _ in range(rng.randint(1, 30))]
    data = b"\n".join(contents) + (b"\n" if rng.random() < 0.5 else b"")
    want: list[bytes] = []
    marks: list[int] = []
    offset = 0
    for i, content in enumerate(contents):
        terminated = i < len(contents) - 1 or data.endswith(b"\n")
        size = len(content) + terminated
        offset += size
        if not terminated and not content:
            break
        element = oversize_placeholder(size, limit) if len(content) > limit else encode_item(content)
        if element is not None:
            want.append(element)
            marks.append(offset)
    splitter = LineSplitter(0, limit, cr_breaks=False)
    items = _ItemLines(0, encode_item, limit)
    got: list[bytes] = []
    got_marks: list[int] = []
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 60)
        elements, ends = items.elements(*splitter.feed(data[pos:pos + step]), False)
        got += elements
        got_marks += ends
        pos += step
    elements, ends = items.elements(*splitter.flush(), True)
    assert (got + elements, got_marks + ends) == (want, marks), data
