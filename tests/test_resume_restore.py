"""Restoring a checkpoint (ckagent.resume.restore) from a master in memory (harness.CheckpointMaster over
``httpx.MockTransport``, the real MasterClient), on Trio's autojump clock: the state dir gets the exact
files, modes and owner (the spider's uid), and nothing hostile gets through — a manifest that climbs out
or is over the task's disk limit, a chunk whose bytes are not its name, a gzip bomb, a state dir the
spider replaced by a link; a master blip is waited out, a master that never answers fails the restore in
time. Real HTTP against the reference master: tests/test_resume_master.py.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import stat
import zlib
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import CheckpointMaster, checkpoint_client, snapshot_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckagent.master.protocol.checkpoints import CHUNK_BYTES, CheckpointRef
from ckagent.node.runas import RunAs
from ckagent.resume.restore import RestoreError, RestoreLimits, gunzip_chunk, restore
from ckagent.resume.ship import CheckpointShipper
from ckagent.resume.snapshot import PackLimits, pack

pytestmark = pytest.mark.usefixtures("inline_threads")

TASK = "t1"
LIMITS = RestoreLimits(max_bytes=1 << 30, timeout=600)
SPIDER_UID = 61997


def ref(checkpoint: str = "1-1") -> CheckpointRef:
    return CheckpointRef(id=checkpoint, attempt=1, item_seq=0, log_seq=0)


async def shipped(master: CheckpointMaster, tmp_path: Path, files: dict[str, bytes],
                  modes: dict[str, int] | None = None) -> dict[str, tuple[bytes | None, int]]:
    """``files`` shipped as checkpoint 1-1 of TASK (dirs as made by snapshot_tree, ``modes`` applied);
    the snapshot's tree (:func:`tree_of`) as it was shipped."""
    task_dir = tmp_path / "node-a"
    snap = snapshot_tree(task_dir, 1, files)
    for rel, mode in (modes or {}).items():
        (snap / rel).chmod(mode)
    tree = tree_of(snap)
    ship = CheckpointShipper(checkpoint_client(master), TASK, task_dir, attempt=1, limits=PackLimits(1 << 30))
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        await ship.submit(1, item_seq=0, log_seq=0, reason="interval",
                          created=datetime(2026, 12, 5, tzinfo=timezone.utc))
        with trio.move_on_after(600):
            await ship.wait_idle()
        nursery.cancel_scope.cancel()
    assert ship.last is not None
    return tree


def tree_of(top: Path) -> dict[str, tuple[bytes | None, int]]:
    out: dict[str, tuple[bytes | None, int]] = {}
    for dirpath, dirs, names in os.walk(top):
        for name in [*dirs, *names]:
            path = Path(dirpath) / name
            mode = stat.S_IMODE(path.lstat().st_mode)
            out[path.relative_to(top).as_posix()] = (None if path.is_dir() else path.read_bytes(), mode)
    return out


def node_b(tmp_path: Path) -> Path:
    task_dir = tmp_path / "node-b"
    task_dir.mkdir(mode=0o700)
    return task_dir / "state"


async def test_a_checkpoint_is_restored_with_its_bytes_modes_and_dirs(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    files = {"jobdir/requests.seen": os.urandom(CHUNK_BYTES * 2 + 17), "jobdir/requests.queue/p0": b"q" * 300,
             "jobdir/empty": b"", "state.json": b'{"page": 7}', "a/b/c/new\nline": b"x", "same1": b"s" * 10,
             "same2": b"s" * 10}
    tree = await shipped(master, tmp_path, files, {"jobdir/requests.queue": 0o550, "state.json": 0o640, "jobdir": 0o700})
    state = node_b(tmp_path)
    manifest = await restore(checkpoint_client(master), TASK, ref(), state, LIMITS)
    assert manifest.id == "1-1" and len(manifest.files) == 12
    assert tree_of(state) == tree
    assert tree["jobdir/requests.queue"] == (None, 0o550) and tree["state.json"][1] == 0o640
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files given to the spider's uid")
async def test_files_and_dirs_belong_to_the_spider_and_the_state_dir_too(tmp_path: Path,
                                                                          autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    await shipped(master, tmp_path, {"jobdir/requests.seen": b"a" * 41, "s.json": b"{}"})
    state = node_b(tmp_path)
    os.chown(state.parent, SPIDER_UID, SPIDER_UID)  # the task dir is the spider's (the runner gives it)
    await restore(checkpoint_client(master), TASK, ref(), state, LIMITS, RunAs.of_uid(SPIDER_UID, "/nonexistent"))
    for path in [state, *state.rglob("*")]:
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (SPIDER_UID, SPIDER_UID), path


async def test_a_state_dir_the_spider_replaced_by_a_link_is_replaced_not_followed(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    await shipped(master, tmp_path, {"passwd": b"owned\n"})
    outside = tmp_path / "etc"
    outside.mkdir()
    (outside / "keep").write_text("the node's")
    state = node_b(tmp_path)
    os.symlink(outside, state)
    await restore(checkpoint_client(master), TASK, ref(), state, LIMITS)
    assert sorted(os.listdir(outside)) == ["keep"] and not state.is_symlink()
    assert (state / "passwd").read_bytes() == b"owned\n"


async def test_what_an_earlier_attempt_left_in_the_state_dir_is_gone(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    await shipped(master, tmp_path, {"kept": b"1"})
    state = node_b(tmp_path)
    (state / "old" / "deep").mkdir(parents=True)
    (state / "old" / "deep" / "x").write_text("stale")
    os.symlink("/etc/shadow", state / "link")
    await restore(checkpoint_client(master), TASK, ref(), state, LIMITS)
    assert sorted(os.listdir(state)) == ["kept"]


def _tamper(master: CheckpointMaster, **changes: object) -> None:
    body = master.manifests[f"{TASK}/1-1"]
    body.update(changes)


@pytest.mark.parametrize("hostile", ["climbs", "absolute", "twice", "count", "sha"])
async def test_a_hostile_manifest_is_refused_and_nothing_is_written(tmp_path: Path, autojump_clock: trio.abc.Clock,
                                                                   hostile: str) -> None:
    master = CheckpointMaster()
    await shipped(master, tmp_path, {"a": b"1", "b": b"2"})
    files = master.manifests[f"{TASK}/1-1"]["files"]
    if hostile == "climbs":
        files[0]["path"] = "../../escaped"
    elif hostile == "absolute":
        files[0]["path"] = "/etc/cron.d/x"
    elif hostile == "twice":
        files[1]["path"] = files[0]["path"]
    elif hostile == "count":
        files[0]["chunks"] = files[0]["chunks"] * 2
    else:
        files[0]["chunks"] = ["../" + "0" * 61]
    state = node_b(tmp_path)
    with pytest.raises(RestoreError, match="the checkpoint 1-1 could not be restored: the master's answer is not"):
        await restore(checkpoint_client(master), TASK, ref(), state, LIMITS)
    assert not state.exists() and not (tmp_path / "escaped").exists()


async def test_a_checkpoint_over_the_tasks_disk_limit_is_refused_before_a_byte_is_fetched(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    await shipped(master, tmp_path, {"big": b"b" * 5000})
    state = node_b(tmp_path)
    fetched = len(master.requests)
    with pytest.raises(RestoreError, match="holds 5000 bytes, more than the task's disk limit \\(4999 bytes\\)"):
        await restore(checkpoint_client(master), TASK, ref(), state, RestoreLimits(max_bytes=4999))
    assert [kind for kind, _ in master.requests[fetched:]] == ["get"] and os.listdir(state) == []


def bomb(size: int) -> bytes:
    """gzip bytes (~64 KiB) that unpack to ``size`` zero bytes."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    return deflate.compress(b"\0" * size) + deflate.flush()


def _replace_chunk(master: CheckpointMaster, gz: bytes) -> str:
    sha = next(iter(master.chunks))
    master.chunks[sha] = gz
    return sha


@pytest.mark.parametrize("bad", ["other bytes", "bomb", "not gzip", "two members", "short"])
async def test_a_chunk_that_is_not_its_name_fails_the_restore_and_empties_the_dir(
        tmp_path: Path, autojump_clock: trio.abc.Clock, bad: str) -> None:
    master = CheckpointMaster()
    await shipped(master, tmp_path, {"f": b"x" * 1000})
    gz = {"other bytes": gzip.compress(b"y" * 1000), "bomb": bomb(64 << 20),
          "not gzip": b"x" * 1000, "two members": gzip.compress(b"x" * 1000) + gzip.compress(b"x"),
          "short": gzip.compress(b"x" * 999)}[bad]
    _replace_chunk(master, gz)
    state = node_b(tmp_path)
    expected = {"other bytes": "do not match its sha256", "bomb": f"unpacks to more than {CHUNK_BYTES} bytes",
                "not gzip": "is not gzip", "two members": "not one whole gzip member",
                "short": "holds 999 bytes, its place in the file 1000"}[bad]
    with pytest.raises(RestoreError, match=f"the checkpoint 1-1 could not be restored: chunk .*{expected}"):
        await restore(checkpoint_client(master), TASK, ref(), state, LIMITS)
    assert os.listdir(state) == []


async def test_a_master_blip_is_waited_out(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    files = {"a": os.urandom(CHUNK_BYTES + 5), "b": b"bee"}
    await shipped(master, tmp_path, files)
    blips: Iterator[httpx.Response | Exception] = iter([httpx.Response(503, text="down"), httpx.ReadTimeout("slow"), httpx.Response(429, json={"error": "x"}),
                  httpx.Response(200, text="<html>portal</html>")])
    master.fault = lambda kind, request: next(blips, None) if kind in ("get", "chunk") else None
    state = node_b(tmp_path)
    await restore(checkpoint_client(master), TASK, ref(), state, LIMITS)
    assert {p: (state / p).read_bytes() for p in files} == files


async def test_a_master_that_never_answers_fails_the_restore_at_its_timeout(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    await shipped(master, tmp_path, {"a": b"1"})
    master.fault = lambda kind, request: httpx.Response(503, text="down")
    started = trio.current_time()
    with pytest.raises(RestoreError, match="no complete answer from the master within 120 s"):
        await restore(checkpoint_client(master), TASK, ref(), node_b(tmp_path), RestoreLimits(1 << 30, timeout=120))
    assert trio.current_time() - started == pytest.approx(120)


async def test_a_checkpoint_the_master_does_not_hold_is_a_clear_error(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    with pytest.raises(RestoreError, match=r"the checkpoint 1-4 could not be restored: .*404.*no such checkpoint"):
        await restore(checkpoint_client(CheckpointMaster()), TASK, ref("1-4"), node_b(tmp_path), LIMITS)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=5000), noise=st.binary(max_size=64), cut=st.integers(0, 200))
def test_gunzip_gives_the_named_bytes_or_refuses(data: bytes, noise: bytes, cut: int) -> None:
    sha = hashlib.sha256(data).hexdigest()
    gz = gzip.compress(data, 1)
    assert gunzip_chunk(gz, sha, len(data)) == data
    for hostile in (gz[: max(0, len(gz) - 1 - cut)], gz + noise, noise + gz, noise):
        if hostile == gz:
            continue
        try:
            out = gunzip_chunk(hostile, sha, len(data))
        except ValueError:
            continue
        assert out == data  # only ever the named bytes


_names = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=["Cs"]), min_size=1, max_size=10
                 ).filter(lambda n: n not in (".", ".."))
_trees = st.recursive(st.tuples(st.binary(max_size=2000), st.sampled_from([0o600, 0o644, 0o755, 0o400])),
                      lambda kids: st.dictionaries(_names, kids, max_size=4), max_leaves=10)


def _plant(path: Path, tree: Any) -> None:
    if isinstance(tree, tuple):
        path.write_bytes(tree[0])
        path.chmod(tree[1])
        return
    path.mkdir()
    for name, kid in tree.items():
        _plant(path / name, kid)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(_names, _trees, max_size=5))
def test_any_packed_tree_is_restored_exactly(tmp_path: Path, tree: dict[str, Any]) -> None:
    top = tmp_path / f"t-{os.urandom(6).hex()}"
    top.mkdir()
    _plant(top / "snap", tree)
    packed = pack(top / "snap", set(), PackLimits(1 << 30))
    master = CheckpointMaster()
    master.chunks.update(packed.gz)
    master.manifests[f"{TASK}/1-1"] = {
        "id": "1-1", "attempt": 1, "createdAt": "2026-12-05T19:00:00.000Z", "reason": "interval", "itemSeq": 0,
        "logSeq": 0, "sizeBytes": packed.size_bytes, "packedBytes": packed.packed_bytes,
        "files": [f.to_json() for f in packed.files]}
    (top / "node").mkdir()

    async def restoring() -> None:
        client = checkpoint_client(master)
        try:
            await restore(client, TASK, ref(), top / "node" / "state", LIMITS)
        finally:
            await client.aclose()

    trio.run(restoring)
    assert tree_of(top / "node" / "state") == tree_of(top / "snap")
