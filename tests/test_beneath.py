"""A spider's tree as the agent reads and changes it (ckagent.node.beneath): never a link out, never a
FIFO that blocks, never another's hard link, never a device read — whatever the spider planted.

Each hostile entry is planted the way a spider would (symlinks to files and directories outside the
tree, ``..``, FIFOs, a device file, hard links, a directory swapped for a link after the agent looked)
and each operation is run by :func:`harness.bounded`: a FIFO that blocked the agent would fail the test
instead of hanging it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import bounded

from ckagent.node import beneath
from ckagent.node.beneath import NotBeneath

SECRET = b"node secret: never this task's\n"
OTHER_UID = 61999
"""A uid that owns the trees of the root-only tests (a spider's, no passwd entry needed)."""


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)``, bounded: a blocked call fails the test (its thread is left)."""
    return bounded(fn, *args, **kwargs)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A spider's tree with one regular file (``ok.jsonl``) and one folder, beside an outside secret."""
    top = tmp_path / "tree"
    (top / "sub").mkdir(parents=True)
    (top / "ok.jsonl").write_bytes(b'{"a": 1}\n')
    (top / "sub" / "deep.log").write_bytes(b"deep\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_bytes(SECRET)
    return top


def test_regular_files_below_the_top_are_read(tree: Path) -> None:
    assert call(beneath.read_bytes, tree, "ok.jsonl", 100) == b'{"a": 1}\n'
    assert call(beneath.read_bytes, tree, "./sub//deep.log", 100) == b"deep\n"
    assert (call(beneath.stat_entry, tree, "sub/deep.log")).st_size == 5


@pytest.mark.parametrize("rel", ["../outside/secret", "/etc/passwd", "sub/../../outside/secret", "", ".", "a\0b"])
def test_paths_that_leave_the_tree_are_refused_before_anything_is_opened(tree: Path, rel: str) -> None:
    with pytest.raises(NotBeneath) as refused:
        call(beneath.open_file, tree, rel)
    assert refused.value.errno == errno.EINVAL


def test_a_symlink_at_the_end_or_on_the_way_is_never_followed(tree: Path) -> None:
    outside = tree.parent / "outside"
    (tree / "items.jsonl").symlink_to(outside / "secret")
    (tree / "logs").symlink_to(outside)
    (tree / "rel").symlink_to("../outside/secret")
    for rel in ("items.jsonl", "logs/secret", "rel"):
        with pytest.raises(NotBeneath) as refused:
            call(beneath.read_bytes, tree, rel, 1 << 20)
        assert refused.value.errno in (errno.ELOOP, errno.ENOTDIR), rel
        with pytest.raises(NotBeneath):
            call(beneath.stat_entry, tree, rel) if rel.startswith("logs/") else call(
                beneath.open_file, tree, rel)
    # Writing through one (O_CREAT, O_APPEND) is refused too: nothing reaches the outside file.
    with pytest.raises(NotBeneath):
        call(beneath.open_file, tree, "items.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with pytest.raises(NotBeneath):
        call(beneath.open_file, tree, "logs/new", os.O_WRONLY | os.O_CREAT)
    assert (outside / "secret").read_bytes() == SECRET and not (outside / "new").exists()


def test_a_top_that_is_a_symlink_is_refused(tree: Path) -> None:
    link = tree.parent / "top-link"
    link.symlink_to(tree)
    with pytest.raises(NotBeneath):
        call(beneath.read_bytes, link, "ok.jsonl", 100)


def test_a_fifo_never_blocks_and_is_never_read(tree: Path) -> None:
    os.mkfifo(tree / "items.jsonl")
    os.mkfifo(tree / "sub" / "out.log")
    for rel in ("items.jsonl", "sub/out.log"):
        with pytest.raises(NotBeneath, match="FIFO"):
            call(beneath.read_bytes, tree, rel, 100)
        with pytest.raises(NotBeneath, match="FIFO"):  # for writing, without a reader: ENXIO, refused too
            call(beneath.open_file, tree, rel, os.O_WRONLY | os.O_APPEND)


def test_a_directory_where_a_file_should_be_is_not_a_file(tree: Path) -> None:
    with pytest.raises(NotBeneath, match="directory"):
        call(beneath.read_bytes, tree, "sub", 100)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root makes device files (a spider as root could)")
def test_a_device_file_is_never_read(tree: Path) -> None:
    os.mknod(tree / "zero.jsonl", stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero: endless bytes
    with pytest.raises(NotBeneath, match="character device"):
        call(beneath.read_bytes, tree, "zero.jsonl", 1 << 30)


def test_a_file_larger_than_asked_is_not_read_into_memory(tree: Path) -> None:
    (tree / "big.json").write_bytes(b"x" * 5000)
    with pytest.raises(OSError) as refused:
        call(beneath.read_bytes, tree, "big.json", 4096)
    assert refused.value.errno == errno.EFBIG


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a tree owned by another uid")
def test_another_owners_hard_link_is_refused_the_owners_own_is_read(tree: Path) -> None:
    os.chown(tree, OTHER_UID, OTHER_UID)
    root_file = tree.parent / "outside" / "secret"  # root's, as the agent's state.db is
    os.link(root_file, tree / "items.jsonl")  # what protected_hardlinks=0 would let a spider do
    with pytest.raises(NotBeneath, match="hard link") as refused:
        call(beneath.read_bytes, tree, "items.jsonl", 1 << 20)
    assert refused.value.errno == errno.EPERM
    own = tree / "ok.jsonl"
    os.chown(own, OTHER_UID, OTHER_UID)
    os.link(own, tree / "again.jsonl")  # the spider's own file, twice: its own business
    assert call(beneath.read_bytes, tree, "again.jsonl", 100) == b'{"a": 1}\n'


def test_the_hosts_protected_hardlinks_setting_is_reported() -> None:
    """Where fs.protected_hardlinks is 1 a spider cannot even make such a link; the agent refuses it
    either way (the test above). This records which case this machine is."""
    value = Path("/proc/sys/fs/protected_hardlinks").read_text().strip()
    assert value in ("0", "1")


def test_a_directory_swapped_for_a_link_after_the_walk_leads_nowhere(tree: Path) -> None:
    seen = [rel_dir + name for rel_dir, _dirs, entries in call(lambda: list(beneath.walk(tree)))
            for name, _st in entries]
    assert "sub/deep.log" in seen
    # The spider swaps the folder for a link to the outside between the agent's walk and its use.
    os.rename(tree / "sub", tree / "sub.old")
    (tree / "sub").symlink_to(tree.parent / "outside")
    (tree.parent / "outside" / "deep.log").write_bytes(SECRET)
    with pytest.raises(NotBeneath) as refused:
        call(beneath.read_bytes, tree, "sub/deep.log", 1 << 20)
    assert refused.value.errno == errno.ELOOP
    with pytest.raises(NotBeneath):
        call(beneath.move, tree, "sub/deep.log", tree, "moved.log")
    assert (tree.parent / "outside" / "deep.log").read_bytes() == SECRET


def test_walk_lists_links_and_specials_as_entries_and_enters_real_directories_only(tree: Path) -> None:
    (tree / "to-outside").symlink_to(tree.parent / "outside")
    os.mkfifo(tree / "pipe")
    (tree / "skipped").mkdir()
    walked = call(lambda: list(beneath.walk(tree, skip_dir=lambda rel: rel == "skipped")))
    dirs_seen = [rel_dir for rel_dir, _dirs, _entries in walked]
    assert dirs_seen == ["", "sub/"]
    top_entries = {name: st for name, st in walked[0][2]}
    assert stat.S_ISLNK(top_entries["to-outside"].st_mode) and stat.S_ISFIFO(top_entries["pipe"].st_mode)
    assert "skipped" in top_entries and "secret" not in {n for _, _, entries in walked for n, _ in entries}


def test_move_makes_missing_folders_for_the_trees_owner_and_never_writes_through_a_link(
        tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    st = call(beneath.move, tree, "ok.jsonl", dest, "outputs/t1/ok.jsonl")
    assert st.st_size == 9 and (dest / "outputs" / "t1" / "ok.jsonl").read_bytes() == b'{"a": 1}\n'
    assert stat.S_IMODE((dest / "outputs").stat().st_mode) == 0o700
    (dest / "evil").symlink_to(tmp_path / "outside")
    with pytest.raises(NotBeneath):
        call(beneath.move, tree, "sub/deep.log", dest, "evil/deep.log")
    assert not (tmp_path / "outside" / "deep.log").exists() and (tree / "sub" / "deep.log").exists()
    (tree / "link").symlink_to(tmp_path / "outside" / "secret")
    with pytest.raises(NotBeneath):  # a symlink is not a file to move (it would name the outside there)
        call(beneath.move, tree, "link", dest, "link")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: folders given to another uid")
def test_folders_made_in_a_spiders_tree_are_the_spiders(tree: Path, tmp_path: Path) -> None:
    dest = tmp_path / "spider-data"
    dest.mkdir()
    os.chown(dest, OTHER_UID, OTHER_UID)
    call(beneath.move, tree, "ok.jsonl", dest, "outputs/t1/x/ok.jsonl")
    for folder in ("outputs", "outputs/t1", "outputs/t1/x"):
        st = (dest / folder).stat()
        assert (st.st_uid, st.st_gid) == (OTHER_UID, OTHER_UID), folder


def test_link_never_links_what_a_symlink_names(tree: Path) -> None:
    st = call(beneath.link, tree, "ok.jsonl", tree, "item-files/0-ok.jsonl")
    assert st.st_nlink == 2 and (tree / "item-files" / "0-ok.jsonl").read_bytes() == b'{"a": 1}\n'
    (tree / "swapped.jsonl").symlink_to(tree.parent / "outside" / "secret")
    with pytest.raises(NotBeneath):
        call(beneath.link, tree, "swapped.jsonl", tree, "item-files/1-swapped.jsonl")
    assert not (tree / "item-files" / "1-swapped.jsonl").exists()
    assert (tree.parent / "outside" / "secret").stat().st_nlink == 1


def test_remove_takes_the_tree_and_leaves_what_links_name(tree: Path) -> None:
    outside = tree.parent / "outside"
    (tree / "sub" / "to-outside").symlink_to(outside)
    (tree / "to-secret").symlink_to(outside / "secret")
    call(beneath.remove, tree, "sub")
    call(beneath.remove, tree, "missing/also")
    assert not (tree / "sub").exists() and (outside / "secret").read_bytes() == SECRET
    call(beneath.remove, tree)  # everything below the top; the top stays
    assert tree.is_dir() and not list(tree.iterdir()) and (outside / "secret").exists()


def test_write_new_replaces_a_planted_link_instead_of_writing_through_it(tree: Path) -> None:
    outside = tree.parent / "outside"
    (tree / "artifacts.json").symlink_to(outside / "secret")
    os.mkfifo(tree / "artifacts.sent")
    call(beneath.write_new, tree, "artifacts.json", b"{}")
    call(beneath.write_new, tree, "artifacts.sent", b"a\n")
    assert (outside / "secret").read_bytes() == SECRET
    assert (tree / "artifacts.json").read_bytes() == b"{}" and not (tree / "artifacts.json").is_symlink()
    assert (tree / "artifacts.sent").read_bytes() == b"a\n"


def test_remove_empty_dirs_keeps_folders_with_files(tree: Path) -> None:
    (tree / "a" / "b" / "c").mkdir(parents=True)
    (tree / "d" / "e").mkdir(parents=True)
    (tree / "d" / "e" / "f").write_text("x")
    call(beneath.remove_empty_dirs, tree)
    assert not (tree / "a").exists() and (tree / "d" / "e" / "f").exists() and (tree / "sub").exists()
