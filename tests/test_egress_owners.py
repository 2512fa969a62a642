"""Whose nftables table is it (ckagent.containment.egress.owners): an agent's start never deletes the
table of an agent in another mount namespace that shares the network namespace (pods or containers on
the host network, the suite's pod box) — there a work dir missing here proves nothing, and the other
agent's tasks would crawl without their policy.

Found by the suite: a pod box's agent (its own mount namespace, /tmp a volume of its own, the host's
network) deleted the table of an agent on the host whose work dir it could not see.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckagent.containment.egress.owners import (
    MNTNS_COMMENT,
    OWNER_COMMENT,
    legacy_table_name,
    mount_namespace,
    owner_comment,
    remove_legacy,
    remove_orphans,
    table_name,
    table_owner,
)
from ckagent.containment.hierarchy import agent_group_name

REPO = Path(__file__).resolve().parent.parent


def _nft_can() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN)"
    if shutil.which("nft") is None:
        return "the nft program is not installed (apt-get install nftables)"
    if shutil.which("unshare") is None:
        return "no unshare"
    return None


needs_nft = pytest.mark.skipif(_nft_can() is not None, reason=str(_nft_can()))


def _nft(*commands: str) -> None:
    subprocess.run(["nft", "-f", "-"], input="\n".join(commands) + "\n", text=True, check=True, capture_output=True)


def _names() -> set[str]:
    done = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in done.stdout.splitlines() if line.startswith("table inet ")}


@pytest.fixture
def made() -> Iterator[list[str]]:
    """Names of the tables a test made: deleted at its end, also when it failed."""
    names: list[str] = []
    yield names
    for name in names:
        subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, check=False)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (removed at the end)."""
    path = Path(tempfile.mkdtemp(prefix="ckown", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _make(made: list[str], comment: str) -> str:
    name = f"ckagent_t{uuid.uuid4().hex[:10]}"
    _nft(f'add table inet {name} {{ comment "{comment}"; }}')
    made.append(name)
    return name


def test_one_work_dir_path_in_two_mount_namespaces_names_two_tables() -> None:
    group = agent_group_name(Path("/var/lib/ckagent/data"))  # every pod's work dir path
    first, second = table_name(group, mntns=4026531841), table_name(group, mntns=4026532999)
    assert first != second and first.startswith("ckagent_") and len(first) == len("ckagent_") + 10
    assert table_name(group) == table_name(group, mntns=mount_namespace())
    assert legacy_table_name(group) == group.replace("-", "_")
    with pytest.raises(ValueError, match="group name"):
        table_name("")


def test_owner_comments_read_back() -> None:
    assert table_owner(owner_comment("/srv/ck")) == (mount_namespace(), "/srv/ck")
    assert table_owner(OWNER_COMMENT + "/srv/old") == (None, "/srv/old")
    for stranger in ("", "firewalld", MNTNS_COMMENT + "xyz work_dir=/a", MNTNS_COMMENT + "12 /a",
                     MNTNS_COMMENT + "12 work_dir=", MNTNS_COMMENT + " work_dir=/a", MNTNS_COMMENT + "f" * 17 + " work_dir=/a"):
        assert table_owner(stranger) is None


@given(st.text(max_size=200))
def test_any_comment_is_an_owner_or_none_and_never_raises(comment: str) -> None:
    owner = table_owner(comment)
    assert owner is None or (isinstance(owner[1], str) and owner[1])


@needs_nft
def test_an_agent_in_another_mount_namespace_leaves_a_live_neighbours_table(short_dir: Path, made: list[str]) -> None:
    """The neighbour's work dir exists here and is hidden from the starting agent (a tmpfs over it, in a
    mount namespace of its own): its start deletes its own namespace's orphans, never the neighbour's."""
    tmp_path = short_dir  # (a comment holds at most 127 bytes: a work dir too long for one is never an orphan)
    hidden = tmp_path / "volumes"
    (hidden / "agent-a").mkdir(parents=True)
    neighbour = _make(made, owner_comment(str(hidden / "agent-a")))
    # a table of a third namespace whose work dir exists nowhere: no agent of ours may judge it (the
    # suite's other agents starting meanwhile leave it alone too, so this stays deterministic)
    foreign = _make(made, f"{MNTNS_COMMENT}{mount_namespace() + 1:x} work_dir={tmp_path / 'never-made'}")
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
              "from ckagent.containment.egress.owners import remove_orphans\n"
              "print(' '.join(remove_orphans()))\n")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           'mount -t tmpfs none "$1" && test ! -e "$1/agent-a" && exec "$2" -c "$3"', "sh",
                           str(hidden), sys.executable, script],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    removed = done.stdout.split()
    assert neighbour not in removed and neighbour in _names(), "a neighbour's live table was deleted"
    assert foreign not in removed and foreign in _names()
    # here: the live one stays, the foreign one too; an orphan of this namespace goes
    orphan = _make(made, owner_comment(str(tmp_path / "gone")))
    remove_orphans(lambda work_dir: not Path(work_dir).exists() and work_dir.startswith(str(tmp_path)))
    assert orphan not in _names() and {neighbour, foreign} <= _names()


@needs_nft
def test_a_legacy_table_goes_only_for_its_own_work_dir(tmp_path: Path, made: list[str]) -> None:
    group = agent_group_name(tmp_path)
    legacy = legacy_table_name(group)
    (tmp_path / "elsewhere").mkdir()  # (exists: no other agent starting meanwhile takes it for an orphan)
    _nft(f'add table inet {legacy} {{ comment "{OWNER_COMMENT}{tmp_path / "elsewhere"}"; }}')
    made.append(legacy)
    assert not remove_legacy(group, str(tmp_path)) and legacy in _names()  # another work dir's comment
    _nft(f"delete table inet {legacy}", f'add table inet {legacy} {{ comment "{OWNER_COMMENT}{tmp_path}"; }}')
    assert remove_legacy(group, str(tmp_path)) and legacy not in _names()
    assert not remove_legacy(group, str(tmp_path))  # none left: nothing to do, no error
