"""``ckagent exec`` at its edges: every item the task delivered reaches ``--items`` whatever road it
took, the log is shown to its end, the user's files are said before they are replaced and the exec's
own output is not packaged, and what cannot run is one line with exit 2 (no traceback)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from ckagent.cli.execview import READ_BYTES, Follower, Terminal, element_texts
from ckagent.cli.localrun import ExecRequest, ExecUsageError, run_exec

SPIDER = """\
import json, os
print('files', sorted(os.listdir('.')), flush=True)
with open(os.environ['CK_ITEMS_FILE'], 'a') as fh:
    for n in range(2):
        fh.write(json.dumps({'road': 'sdk', 'n': n}) + '\\n')
with open('quotes.jsonl', 'w') as fh:
    for n in range(3):
        fh.write(json.dumps({'road': 'jsonl', 'n': n}) + '\\n')
with open('results.json', 'w') as fh:
    json.dump([{'road': 'json', 'n': n} for n in range(2)], fh)
print('done', flush=True)
"""


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith(("AGENT_", "CK_"))]:
        monkeypatch.delenv(key)


async def test_exec_writes_every_item_and_keeps_its_own_output_out_of_the_package(
        tmp_path: Path, clean_env: None) -> None:
    spider = tmp_path / "roads"
    spider.mkdir()
    (spider / "main.py").write_text(SPIDER)
    items = spider / "items.jsonl"  # `exec .` inside the spider folder: the defaults land in it
    items.write_text('{"old": 1}\n{"old": 2}\n{"old": 3}')
    (spider / "artifacts").mkdir()
    (spider / "artifacts" / "old.txt").write_text("last run's")
    out, err = io.StringIO(), io.StringIO()
    request = ExecRequest(source=spider, items=items, work_dir=tmp_path / "w", artifacts=spider / "artifacts",
                          outputs={"items": ["quotes.jsonl", "results.json"]})
    assert await run_exec(request, out, err) == 0, err.getvalue()[-3000:]
    said = err.getvalue()
    assert f"[ckagent exec] replacing {items} (3 lines)" in said, said
    assert "[ckagent exec] left out of the package (exec's own output): items.jsonl, artifacts/" in said, said
    # the package's one file, beside the link to the spider's kept Scrapy data dir (ckagent.code.scrapydata)
    assert "files ['.scrapy', 'main.py']" in out.getvalue(), out.getvalue()[-3000:]
    got = [json.loads(line) for line in items.read_text().splitlines()]
    # Each road's items, each in its order; all of them, as the summary counts them.
    for road, count in (("sdk", 2), ("jsonl", 3), ("json", 2)):
        assert [i["n"] for i in got if i["road"] == road] == list(range(count)), got
    assert len(got) == 7
    assert f"[ckagent exec] counts: 7 items -> {items}" in said, said


def test_the_last_look_reads_the_log_to_its_end_and_ends_its_line(tmp_path: Path) -> None:
    big = b"x" * (2 * READ_BYTES + 5)  # a long last line without a line end
    (tmp_path / "output.log").write_bytes(b"start\n" + big)
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    terminal = Terminal(out, io.StringIO())
    follower = Follower(tmp_path, tmp_path / "items.jsonl", terminal, lambda seq: [])
    follower.step()  # while the task runs: one read
    assert follower.log_offset == READ_BYTES
    follower.step(final=True)
    terminal.end_line()
    out.flush()
    assert out.buffer.getvalue() == b"start\n" + big + b"\n"  # type: ignore[attr-defined]
    terminal.end_line()  # a line already ended is left alone
    out.flush()
    assert out.buffer.getvalue().endswith(b"x\n")  # type: ignore[attr-defined]


def test_the_follower_copies_the_masters_items_in_order(tmp_path: Path) -> None:
    chunks = [(2, json.dumps([{"a": 1}, {"a": "é"}])), (1, json.dumps([{"a": 3}]))]
    asked: list[int] = []

    def from_seq(seq: int) -> list[tuple[int, str]]:
        asked.append(seq)
        done = 0
        rest = []
        for count, data in chunks:
            if done >= seq:
                rest.append((count, data))
            done += count
        return rest[:1]  # one chunk a look

    follower = Follower(tmp_path, tmp_path / "items.jsonl", Terminal(io.StringIO(), io.StringIO()), from_seq)
    follower.step()
    assert follower.items == 2
    follower.step(final=True)
    assert asked == [0, 2, 3]
    # As the master stored each item's text (not encoded again).
    assert (tmp_path / "items.jsonl").read_text("utf-8") == '{"a": 1}\n{"a": "\\u00e9"}\n{"a": 3}\n'


async def test_what_cannot_run_is_a_usage_error(tmp_path: Path, clean_env: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    spider = tmp_path / "s"
    spider.mkdir()
    (spider / "main.py").write_text("print(1)\n")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("task:\n  kill_grace: [\n")

    def request(**options: object) -> ExecRequest:
        return ExecRequest(source=spider, items=tmp_path / "items.jsonl", work_dir=tmp_path / "w", **options)  # type: ignore[arg-type]

    with pytest.raises(ExecUsageError, match=r"--env HOME: HOME is set by the agent"):
        await run_exec(request(env={"HOME": "/tmp"}), io.StringIO(), io.StringIO())
    with pytest.raises(ExecUsageError, match=r"config error: .*bad\.yaml:\d+"):
        await run_exec(request(config=bad_yaml), io.StringIO(), io.StringIO())
    monkeypatch.setenv("AGENT_TASK_KILL_GRACE", "soon")
    with pytest.raises(ExecUsageError, match=r"config error: .*AGENT_TASK_KILL_GRACE"):
        await run_exec(request(), io.StringIO(), io.StringIO())
    assert not (tmp_path / "items.jsonl").exists()  # refused before anything was touched
    # As a real process: one line, exit 2, no traceback.
    (tmp_path / "notzip.zip").write_text("not a zip\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    for words, message in ((["notzip.zip"], "notzip.zip: not a zip file"),
                           (["s", "-c", "bad.yaml"], "bad.yaml:")):
        done = await trio.to_thread.run_sync(lambda words=words: subprocess.run(
            [sys.executable, "-m", "ckagent", "exec", *words, "--work-dir", str(tmp_path / "w")],
            capture_output=True, text=True, timeout=60, check=False, env=env, cwd=tmp_path))
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and re.search(rf"^ckagent exec: .*{re.escape(message)}", done.stderr,
                                                             re.MULTILINE), done.stderr


def test_the_items_file_holds_each_items_text_as_the_master_stored_it() -> None:
    # Scrapy's own encoding (spaces after separators, raw UTF-8, a raw U+2028 in a string) is kept;
    # an element an old master stored indented is joined onto one line.
    stored = '[{"when": "1907-02-01T00:00:00", "t": "caf\u00e9 \u2028 x"} ,{"n": 1.10},\n {\n  "a": [1, 2]\n}]'
    assert element_texts(stored) == ['{"when": "1907-02-01T00:00:00", "t": "caf\u00e9 \u2028 x"}', '{"n": 1.10}',
                                     '{"a": [1, 2]}']
    assert element_texts(" [ ] ") == []
    with pytest.raises(ValueError):
        element_texts('{"a": 1}')
