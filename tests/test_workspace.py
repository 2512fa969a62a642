"""Code deployment: hostile and broken packages are refused, naming the entry and the rule, and leave
nothing behind; good ones are deployed atomically, reused, pruned; spider files are synced with
unchanged files copied instead of downloaded.

Three levels: ``extract_zip`` on files, ``Workspaces`` against the real dev master (in-process,
real HTTP), and the whole agent (hostile package rows written straight into the dev master's SQLite,
since its upload endpoint validates zips itself).
"""

from __future__ import annotations

import hashlib
import io
import os
import sqlite3
import stat
import struct
import warnings
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from harness import agent_settings, running_agent, spider_zip

from ckagent.code.workspace import KEEP_VERSIONS, DeployError, Limits, Workspaces, extract_zip, safe_name
from ckagent.master.client import MasterClient
from ckagent.master.protocol import CodePackage, RegisterRequest

# --------------------------------------------------------------------------- zip builders


def _zip(entries: list[tuple[str, bytes, int]], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    """A zip of (name, data, unix mode) entries, names kept exactly as given."""
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w", method) as zf:
        warnings.simplefilter("ignore")  # "Duplicate name": one of the hostile cases, on purpose
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = mode << 16
            info.compress_type = method
            zf.writestr(info, data)
    return buf.getvalue()


REG = stat.S_IFREG | 0o644
GOOD = _zip([("main.py", b"print('hi')\n", REG), ("pkg/run.sh", b"#!/bin/sh\necho hi\n", stat.S_IFREG | 0o755)])


def _bomb(megabytes: int = 20) -> bytes:
    return _zip([("main.py", b"print(1)\n", REG), ("zeros.bin", bytes(megabytes << 20), REG)])


def _lying_sizes() -> bytes:
    """A zip whose central directory declares 10 bytes for a 200 KiB entry."""
    data = bytearray(_zip([("big.txt", os.urandom(200_000), REG)], zipfile.ZIP_STORED))
    central = data.rfind(b"PK\x01\x02")
    data[central + 24 : central + 28] = struct.pack("<I", 10)  # uncompressed size
    local = data.find(b"PK\x03\x04")
    data[local + 22 : local + 26] = struct.pack("<I", 10)
    return bytes(data)


def _corrupt_data() -> bytes:
    data = bytearray(_zip([("main.py", os.urandom(5000).hex().encode(), REG)]))
    for i in range(60, 400):
        data[i] ^= 0x5A
    return bytes(data)


HOSTILE: dict[str, tuple[bytes, str]] = {
    # case: (zip bytes, text the error must contain)
    "traversal": (_zip([("ok.py", b"", REG), ("a/../../evil.py", b"x", REG)]),
                  "entry 'a/../../evil.py': '..' path components are not allowed"),
    "absolute": (_zip([("/tmp/evil.py", b"x", REG)]), "entry '/tmp/evil.py': absolute paths are not allowed"),
    "drive": (_zip([("C:\\evil.py", b"x", REG)]), "entry 'C:\\\\evil.py': drive letters are not allowed"),
    "symlink": (_zip([("link", b"../../../etc/passwd", stat.S_IFLNK | 0o777)]),
                "entry 'link': symlinks are not allowed (it points to '../../../etc/passwd')"),
    "device": (_zip([("dev", b"", stat.S_IFCHR | 0o644)]), "entry 'dev': device files, fifos and sockets"),
    "bomb_ratio": (_bomb(), "entry 'zeros.bin': compression ratio"),
    "duplicate": (_zip([("a.py", b"1", REG), ("a.py", b"2", REG)]), "entry 'a.py': appears more than once"),
    "file_and_dir": (_zip([("a", b"1", REG), ("a/b.py", b"2", REG)]),
                     "entry 'a': is a file and also a directory of 'a/b.py'"),
    "truncated": (GOOD[: len(GOOD) // 2], "package: not a readable zip"),
    "wrong_magic": (b"GIF89a" + bytes(100), "package: not a zip file (wrong magic bytes)"),
    "lying_sizes": (_lying_sizes(), "entry 'big.txt': cannot be read"),
    "corrupt_data": (_corrupt_data(), "entry 'main.py': cannot be read"),
}


MASTER_DB = ("master.sqlite", "master.sqlite-wal", "master.sqlite-shm")


def _tree(root: Path, skip: tuple[str, ...] = MASTER_DB) -> dict[str, tuple[str, int]]:
    """Every path under ``root`` (relative) → (kind, size): a snapshot to compare before/after."""
    out: dict[str, tuple[str, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if os.path.normpath(os.path.join(rel_dir, d)) not in skip]
        for name in dirnames + filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel in skip:
                continue
            st = os.lstat(os.path.join(dirpath, name))
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
            out[rel] = (kind, 0 if kind == "dir" else st.st_size)
    return out


def _evil_written(tmp_path: Path) -> bool:
    """True when a hostile entry landed beside the work dir or at its absolute path."""
    return (tmp_path / "evil.py").exists() or (tmp_path.parent / "evil.py").exists() or Path("/tmp/evil.py").exists()


# --------------------------------------------------------------------------- extract_zip


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_extract_zip_refuses_hostile_and_broken(case: str, tmp_path: Path) -> None:
    data, expected = HOSTILE[case]
    (tmp_path / "in").mkdir()
    zip_path = tmp_path / "in" / "package.zip"
    zip_path.write_bytes(data)
    dest = tmp_path / "box" / "code"
    dest.mkdir(parents=True)
    before = _tree(tmp_path, skip=("box",))
    with pytest.raises(DeployError) as caught:
        extract_zip(zip_path, dest, Limits())
    assert expected in str(caught.value)
    assert _tree(tmp_path, skip=("box",)) == before  # nothing outside the temp dir
    assert not _evil_written(tmp_path)


def test_extract_zip_total_size_cap_declared_and_entry_count(tmp_path: Path) -> None:
    zip_path = tmp_path / "p.zip"
    zip_path.write_bytes(_zip([(f"f{i}.bin", os.urandom(300_000), REG) for i in range(4)], zipfile.ZIP_STORED))
    dest = tmp_path / "d"
    dest.mkdir()
    with pytest.raises(DeployError, match=r"entry 'f3.bin': the package unpacks to more than 1000000 bytes"):
        extract_zip(zip_path, dest, Limits(max_total_bytes=1_000_000))
    with pytest.raises(DeployError, match=r"package: 4 entries; the limit is 3"):
        extract_zip(zip_path, dest, Limits(max_entries=3))
    assert list(dest.iterdir()) == []  # both refused before writing anything


def test_extract_zip_writes_good_package_with_modes(tmp_path: Path) -> None:
    zip_path = tmp_path / "p.zip"
    zip_path.write_bytes(GOOD)
    dest = tmp_path / "d"
    dest.mkdir()
    assert extract_zip(zip_path, dest, Limits()) == 2
    assert (dest / "main.py").read_text() == "print('hi')\n"
    assert os.access(dest / "pkg" / "run.sh", os.X_OK)
    assert not os.access(dest / "main.py", os.X_OK)


def test_safe_name_never_escapes_and_never_collides() -> None:
    assert safe_name("abc-1.2_x") == "abc-1.2_x"
    names = {safe_name(s) for s in ("..", ".", "a/b", "a_b", "a\\b", ".hidden", "")}
    assert len(names) == 7
    for name in names:
        assert "/" not in name and not name.startswith(".") and name


# --------------------------------------------------------------------------- Workspaces + dev master


@pytest.fixture
async def master(dev_master) -> AsyncIterator[MasterClient]:
    body = RegisterRequest(name="ws-node", ip="127.0.0.1", port=0, version="t", os="linux", arch="x86_64",
                           python="3", cpu_count=1, memory_total_bytes=1, max_workers=1)
    client = MasterClient(dev_master.base_url, dev_master.registration_token, lambda: body)
    try:
        yield client
    finally:
        await client.aclose()


async def _package(dev_master, spider_id: str, files: dict[str, str | bytes]) -> tuple[str, CodePackage]:
    answer = await dev_master.admin.upload_package(spider_id, spider_zip(files))
    url = f"{dev_master.base_url}/api/packages/{spider_id}/{answer['codeVersion']}.zip"
    return answer["codeVersion"], CodePackage(url=url, sha256=answer["sha256"], size_bytes=answer["sizeBytes"])


async def test_package_deploy_reuse_and_prune(dev_master, master: MasterClient, tmp_path: Path) -> None:
    ws = Workspaces(tmp_path / "spiders", master)
    spider = await dev_master.admin.create_spider(name="p", framework="python")
    with trio.fail_after(30):
        deployed = []
        for n in range(KEEP_VERSIONS + 2):
            version, pkg = await _package(dev_master, spider, {"main.py": f"print({n})\n"})
            path = await ws.deploy_package(spider, version, pkg)
            assert path == ws.spider_dir(spider) / version
            assert (path / "main.py").read_text() == f"print({n})\n"
            deployed.append((version, pkg, path))
            if n == 0:
                ws.acquire(path)  # a running task uses the first version: never pruned
            await trio.sleep(0.01)  # distinct mtimes
        assert ws.downloads == KEEP_VERSIONS + 2
        kept = sorted(p.name for p in ws.spider_dir(spider).iterdir())
        expected = sorted([deployed[0][0]] + [v for v, _, _ in deployed[-KEEP_VERSIONS:]])
        assert kept == expected
        # A version already present is reused, not downloaded again.
        again = await ws.deploy_package(spider, deployed[-1][0], deployed[-1][1])
        assert again == deployed[-1][2] and ws.downloads == KEEP_VERSIONS + 2
        ws.release(deployed[0][2])
    assert list(ws.staging.iterdir()) == []


async def _set_package_row(db_path: Path, spider_id: str, data: bytes, *, sha256: str | None = None,
                           size: int | None = None) -> None:
    """Replace the spider's current package bytes in the dev master's SQLite (bypassing its validation)."""

    def write() -> None:
        with sqlite3.connect(db_path, timeout=10) as db:
            (version,) = db.execute("SELECT code_version FROM spiders WHERE id = ?", (spider_id,)).fetchone()
            db.execute(
                "UPDATE packages SET data = ?, sha256 = ?, size_bytes = ? WHERE spider_id = ? AND code_version = ?",
                (data, sha256 or hashlib.sha256(data).hexdigest(), len(data) if size is None else size,
                 spider_id, version),
            )
        db.close()

    await trio.to_thread.run_sync(write)


@pytest.mark.parametrize("case", ["sha_mismatch", "oversized_announced", "oversized_streamed", "short"])
async def test_package_download_checks(dev_master, master: MasterClient, tmp_path: Path, case: str) -> None:
    ws = Workspaces(tmp_path / "spiders", master, Limits(max_package_bytes=100_000))
    spider = await dev_master.admin.create_spider(name="p", framework="python")
    version, pkg = await _package(dev_master, spider, {"main.py": "print(1)\n"})
    payload = os.urandom(50_000)
    sha = hashlib.sha256(payload).hexdigest()
    announced = {
        "sha_mismatch": CodePackage(pkg.url, hashlib.sha256(b"other").hexdigest(), len(payload)),
        "oversized_announced": CodePackage(pkg.url, sha, 200_000),
        "oversized_streamed": CodePackage(pkg.url, sha, 1000),
        "short": CodePackage(pkg.url, sha, 60_000),
    }[case]
    expected = {
        "sha_mismatch": "package: sha256 mismatch",
        "oversized_announced": "package: 200000 bytes announced; the limit is 100000",
        "oversized_streamed": "package: the master sent more than 1000 bytes (size cap; download aborted)",
        "short": "package: expected 60000 bytes, got 50000",
    }[case]
    await _set_package_row(dev_master.db_path, spider, payload)
    before = _tree(tmp_path)
    with trio.fail_after(20), pytest.raises(DeployError) as caught:
        await ws.deploy_package(spider, version, announced)
    assert expected in str(caught.value)
    assert _tree(tmp_path) == before


async def test_spider_files_sync(dev_master, master: MasterClient, tmp_path: Path) -> None:
    ws = Workspaces(tmp_path / "spiders", master)
    spider = await dev_master.admin.create_spider(name="f", framework="python", code_mode="files")
    await dev_master.admin.upload_package(spider, spider_zip({
        "main.py": "print('v1')\n", "lib/util.py": "X = 1\n", "old.py": "gone\n",
    }))
    with trio.fail_after(30):
        first = await ws.deploy_files(spider)
        assert ws.downloads == 3
        assert (first / "lib" / "util.py").read_text() == "X = 1\n"
        # Same listing: the same version dir, nothing downloaded.
        assert await ws.deploy_files(spider) == first and ws.downloads == 3
        await dev_master.admin.upload_package(spider, spider_zip({
            "main.py": "print('v2')\n", "lib/util.py": "X = 1\n", "new.py": "N = 2\n",
        }))
        second = await ws.deploy_files(spider)
    assert second != first and second.parent == first.parent
    assert ws.downloads == 5  # main.py and new.py; lib/util.py was copied from the previous version
    assert sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file()) == [
        "lib/util.py", "main.py", "new.py"]
    assert (second / "main.py").read_text() == "print('v2')\n"
    assert (first / "old.py").exists()  # the older version is untouched (a task may still use it)
    assert list(ws.staging.iterdir()) == []


async def test_spider_files_refused(dev_master, master: MasterClient, tmp_path: Path) -> None:
    ws = Workspaces(tmp_path / "spiders", master)
    bad_path = await dev_master.admin.create_spider(name="t", framework="python", code_mode="files")
    await dev_master.admin.upload_package(bad_path, spider_zip({"main.py": "x\n", "../evil.py": "x\n"}))
    bad_sha = await dev_master.admin.create_spider(name="s", framework="python", code_mode="files")
    await dev_master.admin.upload_package(bad_sha, spider_zip({"main.py": "print(1)\n"}))

    def tamper() -> None:
        with sqlite3.connect(dev_master.db_path, timeout=10) as db:
            db.execute("UPDATE spider_files SET data = ? WHERE spider_id = ?", (b"print(2)\n", bad_sha))
        db.close()

    await trio.to_thread.run_sync(tamper)
    before = _tree(tmp_path)
    with trio.fail_after(20):
        with pytest.raises(DeployError, match=r"entry '\.\./evil\.py': '\.\.' path components are not allowed"):
            await ws.deploy_files(bad_path)
        with pytest.raises(DeployError, match=r"entry 'main\.py': sha256 mismatch"):
            await ws.deploy_files(bad_sha)
    assert _tree(tmp_path) == before


# --------------------------------------------------------------------------- through the agent


AGENT_CASES: dict[str, tuple[bytes, dict[str, int | str], str]] = {
    # case: (package bytes, row overrides, text the task's errorMessage must contain)
    "traversal": (HOSTILE["traversal"][0], {}, HOSTILE["traversal"][1]),
    "absolute": (HOSTILE["absolute"][0], {}, HOSTILE["absolute"][1]),
    "symlink": (HOSTILE["symlink"][0], {}, HOSTILE["symlink"][1]),
    "bomb": (HOSTILE["bomb_ratio"][0], {}, HOSTILE["bomb_ratio"][1]),
    "truncated": (HOSTILE["truncated"][0], {}, HOSTILE["truncated"][1]),
    "wrong_magic": (HOSTILE["wrong_magic"][0], {}, HOSTILE["wrong_magic"][1]),
    "sha_mismatch": (GOOD, {"sha256": "0" * 64}, "package: sha256 mismatch"),
    "oversized": (GOOD, {"size": 1 << 40}, f"package: {1 << 40} bytes announced; the limit is"),
    "more_than_announced": (GOOD, {"size": 100}, "package: the master sent more than 100 bytes"),
}


@pytest.mark.slow
async def test_agent_refuses_hostile_packages_and_keeps_running(dev_master, nursery: trio.Nursery,
                                                                 tmp_path: Path) -> None:
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_MAX_WORKERS="3")
    tasks: dict[str, str] = {}
    for case, (data, overrides, _) in AGENT_CASES.items():
        spider = await dev_master.admin.create_spider(name=f"hostile-{case}", framework="python")
        await dev_master.admin.upload_package(spider, spider_zip({"main.py": "print('never')\n"}))
        await _set_package_row(dev_master.db_path, spider, data, sha256=str(overrides.get("sha256") or "") or None,
                               size=int(overrides["size"]) if "size" in overrides else None)
        tasks[case] = await dev_master.admin.create_task(spider)
    outside_skip = ("agent/tasks", "agent/state.db", "agent/state.db-wal", "agent/state.db-shm",
                    "agent/runtimes.json", "agent/runtimes.tmp", "agent/.uid-claims", *MASTER_DB)  # the agent's own bookkeeping
    async with running_agent(nursery, settings):
        before = _tree(tmp_path, skip=outside_skip)
        with trio.fail_after(60):  # noqa: ASYNC100 - the comprehension awaits
            results = {case: await dev_master.admin.wait_task_final(task_id, 60) for case, task_id in tasks.items()}
        after = _tree(tmp_path, skip=outside_skip)
        ok = await dev_master.admin.create_spider(name="good", framework="python")
        await dev_master.admin.upload_package(ok, spider_zip({
            "main.py": "import crawlerkeeper_sdk as ck\nck.save_item({'ok': True})\n"}))
        good = await dev_master.admin.create_task(ok)
        with trio.fail_after(60):
            good_task = await dev_master.admin.wait_task_final(good, 60)
    for case, (_, _, expected) in AGENT_CASES.items():
        task = results[case]
        assert (task["status"], task["errorCode"]) == ("FAILED", "DEPLOY_FAILED"), (case, task)
        assert expected in task["errorMessage"], (case, task["errorMessage"])
        assert any("deploy failed" in line for line in await dev_master.admin.get_logs(tasks[case])), case
    assert after == before, "a refused package wrote outside its temp dir"
    assert not _evil_written(tmp_path)
    assert good_task["status"] == "SUCCESS", good_task
    assert await dev_master.admin.get_items(good) == [{"ok": True}]
