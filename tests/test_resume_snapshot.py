"""Packing a snapshot dir (ckagent.resume.snapshot): the manifest and chunks are the files' bytes exactly,
incremental against the chunks the master holds, and nothing a hostile spider plants in its snapshot —
a symlink to /etc/shadow, a FIFO, a device, another owner's hard link, a sparse terabyte, a tree deeper
than the bound, 10^5 files, a file that keeps changing — is read, blocks the agent or escapes the bounds.

Every pack runs through :func:`harness.bounded`: a FIFO that blocked the agent fails the test.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import threading
from pathlib import Path

import pytest
from harness import NOBODY, another_user_cannot, bounded, run_as, world_directory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckagent.master.protocol.checkpoints import CHUNK_BYTES, CheckpointManifest
from ckagent.resume.restore import gunzip_chunk
from ckagent.resume.snapshot import ChunkAt, Packed, PackError, PackLimits, chunk_places, pack, read_chunk

LIMITS = PackLimits(max_bytes=1 << 30)
SECRET = b"root:$6$secret-hash:19000:0:99999:7:::\n"
OTHER_UID = 61998


def packed(top: Path | int, known: set[str] | None = None, limits: PackLimits = LIMITS) -> Packed:
    return bounded(pack, top, known or set(), limits)


def files_of(result: Packed) -> dict[str, bytes]:
    """The files as the chunks carry them: every chunk from ``gz`` (gunzipped, checked)."""
    places = dict(chunk_places(result.files))
    out: dict[str, bytes] = {}
    for entry in result.files:
        if entry.type == "file":
            out[entry.path] = b"".join(
                gunzip_chunk(result.gz[sha], sha, places[sha].length) for sha in entry.chunks)
    return out


def manifest_of(result: Packed) -> CheckpointManifest:
    body = {"id": "1-1", "attempt": 1, "createdAt": "2026-12-05T18:00:00.000Z", "reason": "interval", "itemSeq": 0,
            "logSeq": 0, "sizeBytes": result.size_bytes, "packedBytes": result.packed_bytes,
            "files": [f.to_json() for f in result.files]}
    return CheckpointManifest.from_json(body)  # the master's own checks


def jobdir(top: Path, seen: int) -> Path:
    (top / "jobdir" / "requests.queue").mkdir(parents=True)
    lines = "".join(hashlib.sha1(str(i).encode()).hexdigest() + "\n" for i in range(seen))
    (top / "jobdir" / "requests.seen").write_text(lines)
    (top / "jobdir" / "spider.state").write_bytes(b"\x80\x04}\x94.")
    (top / "jobdir" / "requests.queue" / "active.json").write_text("[]")
    return top


def test_a_jobdir_packs_into_its_exact_bytes_with_modes_and_dirs(tmp_path: Path) -> None:
    top = jobdir(tmp_path / "snap", 50_000)
    (top / "jobdir" / "spider.state").chmod(0o640)
    result = packed(top)
    assert [(f.path, f.type) for f in result.files] == [
        ("jobdir", "dir"), ("jobdir/requests.queue", "dir"), ("jobdir/requests.queue/active.json", "file"),
        ("jobdir/requests.seen", "file"), ("jobdir/spider.state", "file")]
    seen = (top / "jobdir" / "requests.seen").read_bytes()
    assert files_of(result)["jobdir/requests.seen"] == seen
    assert len(result.files[3].chunks) == -(-len(seen) // CHUNK_BYTES) == 2
    assert result.files[4].mode == 0o640
    assert result.size_bytes == sum(f.size for f in result.files)
    assert result.packed_bytes == sum(len(gz) for gz in result.gz.values()) < result.size_bytes
    assert manifest_of(result).size_bytes == result.size_bytes
    assert result.skipped == []


def test_an_append_only_file_resends_only_its_tail(tmp_path: Path) -> None:
    top = jobdir(tmp_path / "snap", 100_000)  # 4.1 MB: four full chunks and a partial one
    first = packed(top)
    known = {sha for f in first.files for sha in f.chunks}
    with open(top / "jobdir" / "requests.seen", "a") as seen:
        seen.write("".join(hashlib.sha1(f"more{i}".encode()).hexdigest() + "\n" for i in range(1000)))
    second = packed(top, known)
    seen_entry = next(f for f in second.files if f.path == "jobdir/requests.seen")
    assert len(seen_entry.chunks) == 4
    assert seen_entry.chunks[:3] == next(f for f in first.files if f.path == "jobdir/requests.seen").chunks[:3]
    assert list(second.new) == [seen_entry.chunks[3]]  # only the last, grown chunk travels again
    assert second.packed_bytes < first.packed_bytes / 3


def test_the_same_bytes_twice_are_one_chunk(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    top.mkdir()
    for name in ("a", "b", "c"):
        (top / name).write_bytes(b"x" * 1000)
    result = packed(top)
    assert len(result.new) == 1 and len({f.chunks[0] for f in result.files}) == 1


def test_a_symlink_fifo_socket_and_bad_names_are_left_out_with_one_line(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    (top / "jobdir").mkdir(parents=True)
    (top / "jobdir" / "requests.seen").write_bytes(b"a" * 41)
    os.symlink("/etc/shadow", top / "jobdir" / "shadow")
    os.symlink("/etc", top / "etc")
    os.mkfifo(top / "jobdir" / "fifo")
    os.mkfifo(top / "fifo")
    (top / "new\nline").write_bytes(b"kept")
    (top / os.fsdecode(b"bad-\xff-utf8")).write_bytes(b"left out")
    result = packed(top)
    assert {f.path for f in result.files} == {"jobdir", "jobdir/requests.seen", "new\nline"}
    assert sorted(result.skipped) == sorted([
        "'etc' (a symlink)", "'fifo' (a FIFO)", "'jobdir/fifo' (a FIFO)", "'jobdir/shadow' (a symlink)",
        "'bad-\\udcff-utf8' (a name that is not UTF-8)"])
    line = result.skipped_line()
    assert line is not None and line.startswith("5 entries of the snapshot left out") and "\n" not in line
    assert all(SECRET not in gz for gz in result.gz.values())
    assert manifest_of(result).files[2].path == "new\nline"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a device file, another owner's hard link")
def test_a_device_and_another_owners_hard_link_are_never_read(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    top = tmp_path / "snap"
    top.mkdir()
    os.chown(top, OTHER_UID, OTHER_UID)  # the spider's snapshot
    os.mknod(top / "zero", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: never opened
    os.link(secret, top / "linked")  # root's file, linked into the spider's tree
    (top / "own").write_bytes(b"mine")
    os.chown(top / "own", OTHER_UID, OTHER_UID)
    result = packed(top)
    assert [f.path for f in result.files] == ["own"]
    assert sorted(result.skipped) == ["'linked' (a hard link to a file of uid 0, not the tree's owner (uid 61998); not read)",
                                      "'zero' (a character device)"]
    assert all(SECRET not in gz and b"\0" * 100 not in gz for gz in result.gz.values())


def test_the_top_itself_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "snap")
    with pytest.raises(PackError, match="symlink"):
        packed(tmp_path / "snap")


def test_a_sparse_terabyte_is_refused_unread(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    top.mkdir()
    with open(top / "huge", "wb") as huge:
        huge.truncate(1 << 40)
    with pytest.raises(PackError, match=r"'huge': the snapshot holds more than 1073741824 bytes"):
        bounded(pack, top, set(), LIMITS, timeout=2)


def test_the_total_is_bounded_across_files(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    top.mkdir()
    for i in range(3):
        (top / f"f{i}").write_bytes(b"z" * 400)
    assert packed(top, limits=PackLimits(max_bytes=1200)).size_bytes == 1200
    with pytest.raises(PackError, match="more than 1199 bytes"):
        packed(top, limits=PackLimits(max_bytes=1199))


def test_a_tree_deeper_than_the_bound_is_refused(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    deep = top
    for _ in range(10):
        deep = deep / "d"
    deep.mkdir(parents=True)
    assert len(packed(top, limits=PackLimits(max_bytes=1, max_depth=10)).files) == 10
    with pytest.raises(PackError, match="more than 9 directory levels"):
        packed(top, limits=PackLimits(max_bytes=1, max_depth=9))


def test_two_hundred_levels_are_refused_without_a_descriptor_per_level(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    (top / "/".join(["d"] * 200)).mkdir(parents=True)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(PackError, match="more than 64 directory levels"):
        packed(top)
    assert len(os.listdir("/proc/self/fd")) == before


def test_more_entries_than_the_bound_are_refused(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    top.mkdir()
    for i in range(20):
        (top / f"f{i:02}").write_bytes(b"")
    assert len(packed(top, limits=PackLimits(max_bytes=1, max_files=20)).files) == 20
    with pytest.raises(PackError, match="more than 19 files and directories"):
        packed(top, limits=PackLimits(max_bytes=1, max_files=19))


@pytest.mark.slow
def test_a_hundred_thousand_files_pack_and_one_more_is_refused(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    for d in range(100):
        (top / f"d{d:02}").mkdir(parents=True)
        for i in range(999):
            fd = os.open(top / f"d{d:02}" / f"f{i:03}", os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"%d\n" % (d * 1000 + i))
            os.close(fd)
    result = bounded(pack, top, set(), LIMITS, timeout=120)
    assert len(result.files) == 100_000 and len(result.new) == 99_900
    manifest_of(result)  # the master takes a manifest of 10^5 entries
    (top / "one-more").write_bytes(b"")
    with pytest.raises(PackError, match="more than 100000 files"):
        bounded(pack, top, set(), LIMITS, timeout=120)


def test_a_file_that_keeps_changing_fails_the_pack_and_a_steady_one_does_not(tmp_path: Path) -> None:
    top = tmp_path / "snap"
    top.mkdir()
    path = top / "busy"
    path.write_bytes(b"x" * (3 * CHUNK_BYTES))
    stop = threading.Event()

    def scribble() -> None:
        with open(path, "r+b") as f:
            while not stop.is_set():
                f.seek(0)
                f.write(os.urandom(64))
                f.flush()

    writer = threading.Thread(target=scribble)
    writer.start()
    try:
        outcomes = []
        for _ in range(5):
            try:
                result = packed(top)
            except PackError as exc:
                outcomes.append(str(exc))
            else:  # a read that saw no change is one consistent state
                outcomes.append("packed")
                assert files_of(result)["busy"][64:] == b"x" * (3 * CHUNK_BYTES - 64)
    finally:
        stop.set()
        writer.join()
    assert all(o == "packed" or "'busy': changed every time it was read (3 times)" in o for o in outcomes), outcomes


def test_a_chunk_read_again_is_checked_against_its_name(tmp_path: Path) -> None:
    top = jobdir(tmp_path / "snap", 40_000)
    result = packed(top)
    sha, at = next(iter(result.new.items()))
    assert hashlib.sha256(read_chunk(top, at, sha)).hexdigest() == sha
    with open(top / at.path, "r+b") as f:
        f.write(b"changed")
    with pytest.raises(PackError, match="changed after it was packed"):
        read_chunk(top, at, sha)
    os.unlink(top / at.path)
    os.symlink("/etc/shadow", top / at.path)
    with pytest.raises(PackError) as refused:
        read_chunk(top, at, sha)
    assert "symlink" in str(refused.value)
    with pytest.raises(PackError):
        read_chunk(top, ChunkAt("../../etc/shadow", 0, 10), sha)


def test_a_descriptor_top_packs_what_is_below_it(tmp_path: Path) -> None:
    top = jobdir(tmp_path / "snap", 10)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert packed(fd).size_bytes == packed(top).size_bytes
    finally:
        os.close(fd)


def test_an_unreadable_file_fails_the_pack_with_its_name(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads a 0000 file")
    top = tmp_path / "snap"
    top.mkdir()
    (top / "locked").write_bytes(b"x")
    (top / "locked").chmod(0)
    with pytest.raises(PackError, match="'locked': cannot open") as refused:
        packed(top)
    assert isinstance(refused.value.__cause__, OSError) and refused.value.__cause__.errno == errno.EACCES


_names = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=["Cs"]), min_size=1, max_size=12
                 ).filter(lambda n: n not in (".", ".."))
_trees = st.recursive(st.binary(max_size=3000) | st.sampled_from([b"", b"\0" * 5000]),
                      lambda kids: st.dictionaries(_names, kids, max_size=4), max_leaves=12)


def _plant(path: Path, tree: bytes | dict[str, object]) -> None:
    if isinstance(tree, bytes):
        path.write_bytes(tree)
        return
    path.mkdir()
    for name, kid in tree.items():
        _plant(path / name, kid)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(_names, _trees, max_size=5))
def test_any_tree_packs_into_a_manifest_the_master_takes_and_its_exact_bytes(tmp_path: Path,
                                                                           tree: dict[str, object]) -> None:
    top = tmp_path / f"snap-{os.urandom(6).hex()}"
    _plant(top, tree)
    result = packed(top)
    manifest = manifest_of(result)
    on_disk = {}
    for dirpath, _dirs, names in os.walk(top):
        for name in names:
            path = Path(dirpath) / name
            on_disk[path.relative_to(top).as_posix()] = path.read_bytes()
    assert files_of(result) == on_disk
    assert {f.path for f in manifest.files if f.type == "file"} == set(on_disk)


_AS_A_USER = r"""
import json, os, sys
from pathlib import Path
from ckagent.resume.snapshot import PackError, PackLimits, pack
top = Path(sys.argv[1])
try:
    result = pack(top, set(), PackLimits(1 << 20))
    print(json.dumps({"files": [f.path for f in result.files], "skipped": result.skipped}))
except PackError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.skipif(another_user_cannot() is not None, reason=str(another_user_cannot()))
def test_an_agent_that_is_not_root_packs_its_own_and_says_what_it_cannot_read() -> None:
    with world_directory() as world:
        top = world / "snap"
        (top / "jobdir").mkdir(parents=True)
        (top / "jobdir" / "requests.seen").write_bytes(b"x" * 41)
        os.symlink("/etc/shadow", top / "jobdir" / "shadow")
        for path in (top, top / "jobdir", top / "jobdir" / "requests.seen"):
            os.lchown(path, NOBODY, NOBODY)
        done = run_as(NOBODY, _AS_A_USER, str(top))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"files": ["jobdir", "jobdir/requests.seen"],
                                           "skipped": ["'jobdir/shadow' (a symlink)"]}
        (top / "jobdir" / "locked").write_bytes(b"root's")
        (top / "jobdir" / "locked").chmod(0o600)
        done = run_as(NOBODY, _AS_A_USER, str(top))
        assert json.loads(done.stdout) == {"error": "'jobdir/locked': cannot open: [Errno 13] Permission denied: 'locked'"}
