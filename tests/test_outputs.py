"""ckagent.delivery.outputs: item files by extension, the cache rule, globs, what becomes of each file (real files)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ckagent.delivery.outputs import collect, is_cache, itemfiles, load_manifest, match_glob
from ckagent.delivery.outputs.itemfiles import ItemFileError, append_item_file
from ckagent.master.protocol import ProtocolError, TaskOutputs


def read_items(source: Path, tmp_path: Path) -> tuple[int, list[object]]:
    spool = tmp_path / "spool.jsonl"
    spool.unlink(missing_ok=True)
    with open(spool, "ab") as out:
        count = append_item_file(source.parent, source.name, out)
    return count, [json.loads(line) for line in spool.read_text().splitlines() if line.strip()]


def test_json_lines_are_copied_as_they_are(tmp_path: Path) -> None:
    source = tmp_path / "q.jsonl"
    source.write_text('{"a": 1}\n\n{"a": 2}\n[3]\n{"a": 4}')  # a blank line, a non-object, no final newline
    count, items = read_items(source, tmp_path)
    assert count == 4
    assert items == [{"a": 1}, {"a": 2}, [3], {"a": 4}]  # the items reader wraps [3] when it ships


def test_the_count_of_copied_json_lines_is_what_the_spool_makes_items_of(tmp_path: Path) -> None:
    # An unterminated last line of blanks gets its line end in the spool and is a blank line there:
    # the items reader skips it, so it is not counted either.
    for data in (b'{"a": 1}\n \t', b'{"a": 1}\n\n  \n{"b": 2}', b"", b"\n\n", b'{"a": 1}'):
        source = tmp_path / "q.jsonl"
        source.write_bytes(data)
        count, items = read_items(source, tmp_path)
        assert count == len(items), data
        assert (tmp_path / "spool.jsonl").read_bytes() == data + (b"\n" if data and not data.endswith(b"\n") else b"")


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_a_json_array_is_read_element_by_element(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(itemfiles, "CHUNK_BYTES", chunk)  # elements, numbers and commas cut by chunk ends
    source = tmp_path / "r.json"
    values = [{"n": i, "t": "é" * i, "f": 12345.678} for i in range(20)]
    source.write_text("\ufeff [\n" + ",\n  ".join(json.dumps(v) for v in values) + "\n] \n", encoding="utf-8")
    count, items = read_items(source, tmp_path)
    assert (count, items) == (20, values)


def test_json_one_object_an_empty_array_and_broken_files(tmp_path: Path) -> None:
    one = tmp_path / "one.json"
    one.write_text('{"only": true}')
    assert read_items(one, tmp_path) == (1, [{"only": True}])
    empty = tmp_path / "empty.json"
    empty.write_text("[ ]")
    assert read_items(empty, tmp_path) == (0, [])
    broken = tmp_path / "broken.json"
    broken.write_text('[{"a": 1}, {"a": ')
    with pytest.raises(ItemFileError) as caught:
        read_items(broken, tmp_path)
    assert caught.value.items == 1 and "broken.json" in str(caught.value)
    scalar = tmp_path / "scalar.json"
    scalar.write_text("42")
    with pytest.raises(ItemFileError, match="array of objects or one object"):
        read_items(scalar, tmp_path)


def test_csv_rows_become_objects(tmp_path: Path) -> None:
    source = tmp_path / "rows.csv"
    source.write_text("title,price\r\n\"A, b\",1.5\r\nC,2,extra\r\n", encoding="utf-8")
    count, items = read_items(source, tmp_path)
    assert count == 2
    assert items == [{"title": "A, b", "price": "1.5"}, {"title": "C", "price": "2", "_extra": ["extra"]}]


def test_the_cache_rule_and_globs() -> None:
    assert is_cache("__pycache__/x.cpython-312.pyc") and is_cache("a/.scrapy/httpcache/x") and is_cache("m.pyc")
    assert is_cache("storage/request_queues/default/1.json")
    assert is_cache("storage/key_value_stores/default/SDK_SESSION_POOL_STATE.json")
    assert not is_cache("storage/key_value_stores/default/OUTPUT.json") and not is_cache("cache.db")
    assert match_glob("out/a.jsonl", "out/*.jsonl") and not match_glob("out/x/a.jsonl", "out/*.jsonl")
    assert match_glob("out/x/a.jsonl", "out/**/*.jsonl") and match_glob("out/a.jsonl", "out/**/*.jsonl")
    assert match_glob("images/full/a.jpg", "images") and match_glob("images/a.jpg", "./images/")
    assert not match_glob("images2/a.jpg", "images")


def test_bad_globs_are_refused() -> None:
    for bad in ("/etc/passwd", "../up.json", "a/../../b", "C:\\x", "a\x00b", ""):
        with pytest.raises(ProtocolError):
            TaskOutputs.from_json({"items": [bad]})


def test_collect_gives_each_file_its_fate(tmp_path: Path) -> None:
    code, work, task_dir, keep = (tmp_path / n for n in ("code", "work", "task", "keep"))
    for d in (code, work, task_dir):
        d.mkdir()
    (code / "main.py").write_text("print()")
    (code / "same.txt").write_text("same")
    (code / "edited.txt").write_text("1234")
    for name in ("main.py", "same.txt", "edited.txt"):
        (work / name).write_bytes((code / name).read_bytes())
    since = time.time() - 1
    (work / "edited.txt").write_text("4321")  # the same size, other bytes, newer
    (work / "results.json").write_text('[{"a": 1}, {"a": 2}]')
    (work / "big.bin").write_bytes(b"x" * 5000)
    (work / "__pycache__").mkdir()
    (work / "__pycache__" / "m.pyc").write_bytes(b"c")
    os.symlink("/etc/hostname", work / "link")
    got = collect(work=work, code_dir=code, since=since, task_dir=task_dir,
                  outputs=TaskOutputs(items=["results.json"]), budget_bytes=1000,
                  master_takes_artifacts=True, keep_dir=keep)
    assert got.items == [("results.json", 2)]
    assert [a.path for a in got.artifacts] == ["edited.txt"]
    assert got.kept == [("big.bin", 5000)] and (keep / "big.bin").stat().st_size == 5000
    assert (task_dir / "artifacts" / "edited.txt").read_text() == "4321"
    # The working copy became the artifacts folder in one rename; all that is not an artifact is gone.
    assert not work.exists()
    assert sorted(str(p.relative_to(task_dir / "artifacts")) for p in (task_dir / "artifacts").rglob("*")) == ["edited.txt"]
    refs, keep_dir = load_manifest(task_dir)
    assert refs == got.artifacts and keep_dir == keep
    assert (task_dir / "items.jsonl").read_text().splitlines() == ['{"a": 1}', '{"a": 2}']  # as written
    line = got.line()
    assert line.startswith("outputs: results.json → 2 items; edited.txt (4 B) → artifacts; big.bin (")
    assert f"kept at {keep}/ (over the artifact budget of " in line


def test_collect_when_nothing_was_written(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "work").mkdir()
    got = collect(work=tmp_path / "work", code_dir=tmp_path / "code", since=time.time(), task_dir=tmp_path,
                  outputs=None, budget_bytes=10, master_takes_artifacts=True, keep_dir=tmp_path / "k")
    assert got.line() == "outputs: no file created or changed in the working copy"
    assert not (tmp_path / "artifacts.json").exists()


def _dirs(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    code, work, task_dir, keep = (tmp_path / n for n in ("code", "work", "task", "keep"))
    for d in (code, work, task_dir):
        d.mkdir()
    return code, work, task_dir, keep


def test_a_file_an_items_glob_names_that_is_not_an_item_file_is_an_artifact_not_deleted(tmp_path: Path) -> None:
    code, work, task_dir, keep = _dirs(tmp_path)
    since = time.time() - 1
    (work / "data").mkdir()
    (work / "data" / "products.json").write_text('[{"a": 1}]')
    (work / "data" / "state.db").write_bytes(b"s" * 8192)
    got = collect(work=work, code_dir=code, since=since, task_dir=task_dir, outputs=TaskOutputs(items=["data/*"]),
                  budget_bytes=1 << 20, master_takes_artifacts=True, keep_dir=keep)
    assert got.items == [("data/products.json", 1)]
    assert [a.path for a in got.artifacts] == ["data/state.db"]
    assert (task_dir / "artifacts" / "data" / "state.db").read_bytes() == b"s" * 8192  # not deleted
    assert not (task_dir / "artifacts" / "data" / "products.json").exists()
    line = got.line()
    assert "data/ (1 file, 8 KiB) → artifacts" in line
    assert "data/state.db is named by outputs.items but is not an item file (.jsonl" in line
    assert "treated as other files" in line and "left as it is" not in line


def test_non_item_files_of_a_double_star_items_glob_are_kept_or_shipped_and_said_once(tmp_path: Path) -> None:
    code, work, task_dir, keep = _dirs(tmp_path)
    since = time.time() - 1
    (work / "images").mkdir()
    for i in range(30):
        (work / "images" / f"{i:02}.png").write_bytes(b"p" * 100)
    (work / "out.jsonl").write_text('{"a": 1}\n')
    # Over the budget: 10 images ship, the other 20 are kept on the node; none is deleted.
    got = collect(work=work, code_dir=code, since=since, task_dir=task_dir, outputs=TaskOutputs(items=["**"]),
                  budget_bytes=1000, master_takes_artifacts=True, keep_dir=keep)
    assert got.items == [("out.jsonl", 1)]
    assert len(got.artifacts) == 10 and len(got.kept) == 20
    shipped = sorted((task_dir / "artifacts" / "images").iterdir())
    assert len(shipped) == 10 and all(p.read_bytes() == b"p" * 100 for p in shipped)
    assert len(list((keep / "images").iterdir())) == 20
    line = got.line()
    assert line.count("not an item file") + line.count("not item files") == 1
    assert "30 files named by outputs.items are not item files (.jsonl, .ndjson, .jl, .json, .csv): " \
           "treated as other files" in line


def test_an_item_file_that_cannot_be_read_is_an_artifact_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, work, task_dir, keep = _dirs(tmp_path)
    since = time.time() - 1
    (work / "good.json").write_text('[{"a": 1}]')
    (work / "bad.json").write_text('[{"b": 2}]')
    (work / "page.html").write_text("<p>x</p>")  # an artifact: the working copy becomes the artifacts dir
    real = append_item_file

    def failing(top: Path, rel: str, spool: object, start: int = 0) -> int:
        if rel == "bad.json":
            raise OSError(5, "Input/output error")
        return real(top, rel, spool, start)  # type: ignore[arg-type]

    monkeypatch.setattr("ckagent.delivery.outputs.append_item_file", failing)
    got = collect(work=work, code_dir=code, since=since, task_dir=task_dir, outputs=TaskOutputs(items=["*.json"]),
                  budget_bytes=1 << 20, master_takes_artifacts=True, keep_dir=keep)
    assert got.items == [("good.json", 1)]
    assert sorted(a.path for a in got.artifacts) == ["bad.json", "page.html"]
    assert (task_dir / "artifacts" / "bad.json").read_text() == '[{"b": 2}]'  # not pruned with the item files
    assert not (task_dir / "artifacts" / "good.json").exists()
    assert "bad.json: cannot read (Input/output error): treated as other files" in got.line()


def test_an_items_glob_that_matches_no_file_is_said(tmp_path: Path) -> None:
    code, work, task_dir, keep = _dirs(tmp_path)
    since = time.time() - 1
    (work / "quotes.jsonl").write_text('{"q": 1}\n')
    got = collect(work=work, code_dir=code, since=since, task_dir=task_dir,
                  outputs=TaskOutputs(items=["quotes.json", "nothing_here/*.jsonl"]),
                  budget_bytes=1 << 20, master_takes_artifacts=True, keep_dir=keep)
    assert got.items == []
    line = got.line()
    assert "outputs.items 'quotes.json' matched no file" in line
    assert "outputs.items 'nothing_here/*.jsonl' matched no file" in line
    assert "quotes.jsonl (" in line  # an artifact, as any other file
    (tmp_path / "empty").mkdir()
    got = collect(work=tmp_path / "empty", code_dir=code, since=since, task_dir=tmp_path,
                  outputs=TaskOutputs(items=["a.jsonl"]), budget_bytes=10, master_takes_artifacts=True, keep_dir=keep)
    assert got.line() == "outputs: outputs.items 'a.jsonl' matched no file"
