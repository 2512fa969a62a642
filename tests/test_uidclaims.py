"""Two agents on one host (different work dirs, one claims dir: ckagent.node.uidclaims) never give one uid
to a spider of each, nor one agent's builder uid to the other's spider: every uid handed out is claimed
host-wide first. A claim whose work dir is gone is taken over; an entry nobody can read (a link, a FIFO,
junk) keeps its uid from being handed out and never makes anything raise; a uid two agents' stores both
hold is given up, at start, by the agent that finds it claimed by the other.

Each test hands out uids from a range of its own, far from any real one (tests run side by side)."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from pathlib import Path

import pytest
from harness import agent_settings, id_files, spider_python, spider_reachable

from ckagent.code.pyplan import bundled_sdk_dir
from ckagent.code.workcopy import spider_dirs
from ckagent.node.configvalues import UidRange
from ckagent.node.identity import Identities, open_identities
from ckagent.node.runas import RunAs
from ckagent.node.state import StateStore
from ckagent.node.uidclaims import UidClaims, UidClaimsError, parse_claim
from ckagent.node.uidpool import SPIDER, Census, UidPool
from ckagent.task.runconfig import node_identities

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing out uids needs an agent running as root")


def _agent(tmp_path: Path, name: str) -> tuple[Path, StateStore]:
    work = spider_reachable(tmp_path / name / "data")
    work.mkdir(parents=True)
    return work, StateStore(work / "state.db")


def _open(work: Path, store: StateStore, uids: UidRange, claims: Path) -> Identities:
    passwd, group = id_files(work.parent, [], [])
    return open_identities(None, uids, work, store, python=spider_python(), sdk_dir=bundled_sdk_dir(),
                           dirs_of=lambda sid: (work / "spider-data" / sid, work / "spider-home" / sid),
                           retention=3600.0, passwd=passwd, group=group, claims=claims, node=work.parent.name)


def _pool(work: Path, store: StateStore, uids: UidRange, claims: Path) -> UidPool:
    return UidPool(store, Census(uids, frozenset()), lambda sid: (work / "d" / sid, work / "h" / sid), 3600.0,
                   tuple, UidClaims(claims, work, work.parent.name))


@needs_root
def test_two_agents_hand_out_disjoint_uids_to_builders_and_spiders(tmp_path: Path) -> None:
    uids = UidRange(3_210_100_000, 3_210_100_019)
    claims = tmp_path / "claims"
    (a_work, a_store), (b_work, b_store) = _agent(tmp_path, "a"), _agent(tmp_path, "b")
    try:
        a = _open(a_work, a_store, uids, claims)
        b = _open(b_work, b_store, uids, claims)
        assert a.dedicated_builder is not None and b.dedicated_builder is not None
        a_uids = {a.dedicated_builder.uid} | {a.for_spider(s).uid for s in ("s1", "s2", "s3")}  # type: ignore[union-attr]
        b_uids = {b.dedicated_builder.uid} | {b.for_spider(s).uid for s in ("s1", "s2", "s3")}  # type: ignore[union-attr]
        assert len(a_uids) == len(b_uids) == 4 and not a_uids & b_uids, (a_uids, b_uids)
        assert a.dedicated_builder.uid == 3_210_100_000 and b.dedicated_builder.uid == 3_210_100_001
        st = os.stat(claims)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
        for uid in a_uids | b_uids:
            entry = json.loads((claims / str(uid)).read_text())
            owner = a_work if uid in a_uids else b_work
            assert entry == {"ckagent": "uid-claim/1", "workDir": str(owner.resolve()), "node": owner.parent.name}
        assert sorted(p.name for p in claims.iterdir()) == sorted(str(u) for u in a_uids | b_uids)  # no temp left
        a_store.close()  # a restart of agent a: it keeps its uids (its own claims), b's stay b's
        a_store = StateStore(a_work / "state.db")
        again = _open(a_work, a_store, uids, claims)
        assert again.dedicated_builder == a.dedicated_builder and again.held() == a.held()
        assert again.for_spider("s4").uid == 3_210_100_008  # type: ignore[union-attr]
    finally:
        a_store.close()
        b_store.close()


@needs_root
def test_agents_allocating_at_once_never_share_a_uid(tmp_path: Path) -> None:
    """The flock and the O_EXCL link: threads of two pools racing for the same lowest uids."""
    uids = UidRange(3_210_101_000, 3_210_101_099)
    claims = tmp_path / "claims"
    agents = [_agent(tmp_path, name) for name in ("a", "b", "c")]
    got: dict[str, list[int]] = {}
    try:
        pools = {str(work): _pool(work, store, uids, claims) for work, store in agents}
        barrier = threading.Barrier(len(pools))

        def run(key: str) -> None:
            barrier.wait()
            got[key] = [pools[key].uid_of(SPIDER, f"s{i}") for i in range(15)]

        threads = [threading.Thread(target=run, args=(key,)) for key in pools]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        everything = [uid for handed in got.values() for uid in handed]
        assert len(got) == 3 and len(everything) == len(set(everything)) == 45
    finally:
        for _work, store in agents:
            store.close()


@needs_root
def test_a_stale_claim_is_taken_over_and_a_release_unclaims(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    uids = UidRange(3_210_102_000, 3_210_102_009)
    claims = tmp_path / "claims"
    (a_work, a_store), (b_work, b_store) = _agent(tmp_path, "a"), _agent(tmp_path, "b")
    try:
        a = _pool(a_work, a_store, uids, claims)
        assert [a.uid_of(SPIDER, s) for s in ("x", "y")] == [3_210_102_000, 3_210_102_001]
        a_store.close()
        (a_work / "state.db").unlink()  # agent a is gone: its work dir holds no state store any more
        with caplog.at_level(logging.WARNING, "ckagent.node.identity"):
            b = _pool(b_work, b_store, uids, claims)
            assert b.uid_of(SPIDER, "z") == 3_210_102_000
        assert json.loads((claims / "3210102000").read_text())["workDir"] == str(b_work.resolve())
        assert any(f"uid 3210102000 was claimed by work dir {a_work.resolve()}" in r.getMessage() and "taken over by "
                   f"work dir {b_work.resolve()}" in r.getMessage() for r in caplog.records), caplog.text
        b_store.close()  # b restarts with a range that no longer holds z's uid: z's claim is removed
        b_store = StateStore(b_work / "state.db")
        moved = _pool(b_work, b_store, UidRange(3_210_102_005, 3_210_102_009), claims)
        assert not (claims / "3210102000").exists() and (claims / "3210102001").exists()  # a's stale one: untouched
        assert moved.uid_of(SPIDER, "z") == 3_210_102_005 and (claims / "3210102005").exists()
        (claims / "3210102009").write_text(json.dumps({"ckagent": "uid-claim/1", "workDir": str(b_work.resolve()),
                                                       "node": "b"}))  # claimed, never held (a crash between)
        b_store.close()
        b_store = StateStore(b_work / "state.db")
        _pool(b_work, b_store, UidRange(3_210_102_005, 3_210_102_009), claims)
        assert not (claims / "3210102009").exists() and (claims / "3210102005").exists()
    finally:
        b_store.close()


@needs_root
def test_planted_and_garbled_entries_keep_their_uid_and_raise_nothing(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    uids = UidRange(3_210_103_000, 3_210_103_019)
    claims = tmp_path / "claims"
    claims.mkdir(mode=0o700)
    first = uids.first
    target = tmp_path / "target"
    target.write_text("untouched")
    os.symlink(target, claims / str(first))  # a link: not followed, not removed
    os.mkfifo(claims / str(first + 1))  # a FIFO without a writer: never blocks
    (claims / str(first + 2)).write_bytes(b"\xff\xfe junk \x00")
    (claims / str(first + 3)).mkdir()
    (claims / str(first + 4)).write_bytes(b"{" * 200_000)  # too large / too deep
    (claims / str(first + 5)).write_text(json.dumps({"ckagent": "uid-claim/1", "workDir": "relative/path"}))
    (claims / str(first + 6)).write_text(json.dumps({"ckagent": "uid-claim/1", "workDir": 7, "node": []}))
    (claims / str(first + 7)).write_text("")  # an entry cut short
    (claims / "not-a-uid").write_text("x")
    os.symlink("/nonexistent", claims / "0042")
    work, store = _agent(tmp_path, "a")
    try:
        with caplog.at_level(logging.WARNING, "ckagent.node.identity"):
            pool = _pool(work, store, uids, claims)
            assert pool.uid_of(SPIDER, "s") == first + 8
            assert pool.uid_of(SPIDER, "t") == first + 9
        assert target.read_text() == "untouched" and os.readlink(claims / str(first)) == str(target)
        assert stat.S_ISFIFO(os.lstat(claims / str(first + 1)).st_mode)
        assert (claims / str(first + 2)).read_bytes() == b"\xff\xfe junk \x00"
        warned = {r.getMessage().split()[2] for r in caplog.records if "is not a claim this agent can read" in
                  r.getMessage()}
        assert warned == {f"{claims}/{first + i}" for i in range(8)}, warned  # once per uid
    finally:
        store.close()
    for data in (b"", b"null", b"[]", b'{"ckagent": "uid-claim/2", "workDir": "/x"}', b"\xff" * 10, b"1" * 5000):
        assert parse_claim(1, data) is None


@needs_root
def test_a_claims_dir_that_is_a_link_or_someone_elses_is_refused(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(UidClaimsError, match="cannot open"):
        UidClaims(tmp_path / "link", tmp_path, "n")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 3_210_104_000, 3_210_104_000)
    with pytest.raises(UidClaimsError, match="owned by uid 3210104000"):
        UidClaims(theirs, tmp_path, "n")
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    UidClaims(loose, tmp_path, "n").close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    work, store = _agent(tmp_path, "a")  # the agent still starts (its store's uids only), and says why
    try:
        with caplog.at_level(logging.WARNING, "ckagent.node.identity"):
            identities = _open(work, store, UidRange(3_210_104_100, 3_210_104_109), tmp_path / "link")
        assert identities.dedicated_builder is not None and not any(real.iterdir())
        assert any("spiders' uids are not recorded host-wide" in r.getMessage() for r in caplog.records)
    finally:
        store.close()


@needs_root
def test_a_uid_both_agents_hold_is_given_up_at_start_and_the_spider_keeps_its_files(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two agents that handed out uids before claims existed: the second to start gives its holder a new
    uid, a warning names both work dirs, and the spider's dirs are given to the new uid at its next task."""
    uids = UidRange(3_210_105_000, 3_210_105_009)
    claims = tmp_path / "claims"
    (a_work, a_store), (b_work, b_store) = _agent(tmp_path, "a"), _agent(tmp_path, "b")
    try:
        a = _open(a_work, a_store, uids, claims)
        a_spider = a.for_spider("spider-a")
        assert a.dedicated_builder is not None and a_spider is not None
        shared = (a.dedicated_builder.uid, a_spider.uid)
        b_store.hold_identity("builder", "", shared[0], 1.0)  # what agent b's store says from before
        b_store.hold_identity("spider", "spider-b", shared[1], 1.0)
        data, home = spider_dirs(b_work, "spider-b", RunAs.of_uid(shared[1], str(b_work / "spider-home" / "spider-b")))
        (data / "kept.txt").write_text("b's")
        os.lchown(data / "kept.txt", shared[1], shared[1])
        with caplog.at_level(logging.WARNING, "ckagent.node.identity"):
            b = _open(b_work, b_store, uids, claims)
        assert b.dedicated_builder is not None and b.dedicated_builder.uid not in shared
        b_spider = b.for_spider("spider-b")
        assert b_spider is not None and b_spider.uid not in shared and b_spider.uid != b.dedicated_builder.uid
        lines = [r.getMessage() for r in caplog.records if "also claims" in r.getMessage()]
        assert len(lines) == 2, lines
        assert all(str(a_work.resolve()) in line and str(b_work.resolve()) in line for line in lines), lines
        assert f"'spider-b' held uid {shared[1]}" in "".join(lines)
        for uid in shared:  # a's claims are a's still
            assert json.loads((claims / str(uid)).read_text())["workDir"] == str(a_work.resolve())
        spider_dirs(b_work, "spider-b", b_spider)  # the spider's next task: its dirs change hands
        for path in (data, home, data / "kept.txt"):
            assert os.lstat(path).st_uid == b_spider.uid
        assert (data / "kept.txt").read_text() == "b's"
    finally:
        a_store.close()
        b_store.close()


@needs_root
def test_an_agents_settings_name_its_claims_dir_and_node(tmp_path: Path) -> None:
    """The wiring: task.uid_claims (AGENT_TASK_UID_CLAIMS) and agent.name reach the claims an agent makes."""
    work = spider_reachable(tmp_path / "node" / "data")
    work.mkdir(parents=True)
    claims = tmp_path / "claims"
    settings = agent_settings(work, "http://127.0.0.1:9", "token", AGENT_TASK_UID_CLAIMS=str(claims),
                              AGENT_TASK_SPIDER_UIDS="3210106000-3210106009", AGENT_NAME="node-7")
    assert settings.task.uid_claims == claims
    store = StateStore(work / "state.db")
    try:
        identities = node_identities(settings, store, tuple)
        assert identities.dedicated_builder is not None
        spider = identities.for_spider("s")
        assert spider is not None
        for uid in (identities.dedicated_builder.uid, spider.uid):
            assert json.loads((claims / str(uid)).read_text()) == {"ckagent": "uid-claim/1", "node": "node-7",
                                                                 "workDir": str(work.resolve())}
    finally:
        store.close()
