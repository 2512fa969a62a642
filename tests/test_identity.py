"""Whom spiders run as (ckagent.node.identity): the identity level decided at start, each spider's uid of
its own at ``spider-uids`` — handed out once, recorded in the state store, kept across tasks and restarts,
never one that /etc/passwd, /etc/group, NSS or a running process has — and what happens when the range is
used up. The walk that gives a spider its files (RunAs.chown_tree) follows nothing out of the tree.

Each test that hands out uids uses a range of its own (tests run side by side: a process one of them
starts as a uid must not move another's choice)."""

from __future__ import annotations

import logging
import os
import pwd
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from harness import id_files, spider_python, spider_reachable

from ckagent.code.pyplan import bundled_sdk_dir
from ckagent.node.configvalues import UidRange
from ckagent.node.identity import (
    Identities,
    IdentityError,
    UidsExhausted,
    judge_identities,
    open_identities,
)
from ckagent.node.levels import Blocker, IdentityLevel
from ckagent.node.runas import RunAs
from ckagent.node.state import SCHEMA_VERSION, StateStore

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing out uids needs an agent running as root")


def _open(work: Path, store: StateStore, uids: UidRange, *, taken: tuple[list[int], list[int]] = ([], []),
          retention: float = 3600.0, busy: tuple[str, ...] = (), run_as_user: str | None = None,
          euid: int | None = None) -> Identities:
    passwd, group = id_files(work.parent, *taken)
    return open_identities(run_as_user, uids, work, store, python=spider_python(), sdk_dir=bundled_sdk_dir(),
                           dirs_of=lambda sid: (work / "spider-data" / sid, work / "spider-home" / sid),
                           retention=retention, busy=lambda: busy, passwd=passwd, group=group, euid=euid)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    path = tmp_path / "node"
    path.mkdir()
    return spider_reachable(path)


def test_the_identity_level_is_its_text_and_says_what_it_gives() -> None:
    assert [level.value for level in IdentityLevel] == ["spider-uids", "one-user", "agent-user", "root"]
    assert [level.per_spider for level in IdentityLevel] == [True, False, False, False]
    assert [level.switches_user for level in IdentityLevel] == [True, True, False, False]
    assert [level.as_root for level in IdentityLevel] == [False, False, False, True]
    for level in IdentityLevel:
        assert IdentityLevel.parse(str(level)) is level and level.guarantees and level.needs
    assert "task.spider_uids" in IdentityLevel.SPIDER_UIDS.guarantees
    for blocker in (Blocker.NOT_ROOT, Blocker.NO_FREE_UIDS, Blocker.UNREACHABLE, Blocker.RUN_AS_USER):
        assert blocker.summary and blocker.remedy
    assert "AGENT_DEPS_PYTHON" in Blocker.UNREACHABLE.remedy and "chmod o+x" in Blocker.UNREACHABLE.remedy


def test_a_schema_2_store_gets_the_identities_table(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE tasks (task_id TEXT PRIMARY KEY, spider_id TEXT NOT NULL, task_json TEXT NOT NULL,"
                     " task_dir TEXT NOT NULL, pid INTEGER, pgid INTEGER, claimed_at REAL NOT NULL, result_json TEXT,"
                     " result_acked INTEGER NOT NULL DEFAULT 0, finished_at REAL, handle TEXT);"
                     "PRAGMA user_version=2;")
    db.close()
    store = StateStore(path)
    try:
        store.hold_identity("spider", "s", 70001, 5.0)
        store.touch_identity("spider", "s", 6.0)
        [record] = store.identities()
        assert (record.kind, record.name, record.uid, record.allocated_at, record.last_used) == ("spider", "s", 70001,
                                                                                                5.0, 6.0)
        with pytest.raises(sqlite3.IntegrityError):
            store.hold_identity("spider", "other", 70001, 7.0)  # one holder per uid
        store.release_identity("spider", "s")
        assert store.identities() == []
    finally:
        store.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3


@needs_root
def test_each_spider_gets_a_uid_of_its_own_kept_across_tasks_and_restarts(work: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    uids = UidRange(3_210_000_000, 3_210_000_009)
    taken = ([3_210_000_000], [3_210_000_002])  # named by passwd (a uid) and by group (a gid): both skipped
    store = StateStore(work / "state.db")
    with caplog.at_level(logging.INFO, "ckagent.node.identity"):
        identities = _open(work, store, uids, taken=taken)
    assert identities.level is IdentityLevel.SPIDER_UIDS and identities.passed_over == ()
    assert identities.dedicated_builder is not None and identities.dedicated_builder.uid == 3_210_000_001
    assert identities.builder == identities.dedicated_builder  # installers run as the builder uid (ckagent.code.builder)
    start = [r.getMessage() for r in caplog.records if r.getMessage().startswith("identity: spider-uids")]
    assert start and "(10 ids, 2 named by /etc/passwd or /etc/group)" in start[0] and "7 free" in start[0], start
    a, b = identities.for_spider("spider-a"), identities.for_spider("spider-b")
    assert a is not None and b is not None
    assert (a.uid, a.gid, a.groups, a.dynamic) == (3_210_000_003, 3_210_000_003, (), True)
    assert b.uid == 3_210_000_004 != a.uid
    assert a.env() == {"HOME": str(work / "spider-home" / "spider-a"), "USER": "ck-3210000003",
                       "LOGNAME": "ck-3210000003"}
    with pytest.raises(KeyError):
        pwd.getpwuid(a.uid)  # no passwd entry is made
    assert identities.for_spider("spider-a") == a  # the next task of the spider
    assert identities.held() == {"spider-a": a.uid, "spider-b": b.uid}
    assert identities.to_json() == {
        "level": "spider-uids", "details": identities.details, "name": "ck-<uid>", "uid": None, "root": False,
        "uidRange": "3210000000-3210000009", "spiders": 2, "free": 5, "passedOver": [], "builderUid": 3_210_000_001}
    store.close()
    store = StateStore(work / "state.db")  # an agent restart
    try:
        again = _open(work, store, uids, taken=taken)
        assert again.for_spider("spider-b") == b and again.for_spider("spider-a") == a
        assert again.dedicated_builder == identities.dedicated_builder
        assert again.for_spider("spider-c").uid == 3_210_000_005  # type: ignore[union-attr]
    finally:
        store.close()


@needs_root
def test_a_uid_in_use_is_never_handed_out(work: Path) -> None:
    """NSS knows it (a user of the system), or a process runs as it (someone else's): skipped."""
    uids = UidRange(3_210_000_100, 3_210_000_109)
    sleeper = subprocess.Popen(["sleep", "60"], user=3_210_000_102, group=3_210_000_102, extra_groups=[])
    try:
        store = StateStore(work / "state.db")
        try:
            identities = _open(work, store, uids)
            assert identities.dedicated_builder.uid == 3_210_000_100  # type: ignore[union-attr]
            assert identities.for_spider("a").uid == 3_210_000_101  # type: ignore[union-attr]
            assert identities.for_spider("b").uid == 3_210_000_103  # type: ignore[union-attr]
        finally:
            store.close()
    finally:
        sleeper.kill()
        sleeper.wait()
    store = StateStore(work.parent / "nss.db")
    try:
        nobody = UidRange(65530, 65534)  # nobody (65534) is in the real /etc/passwd, not in the test's file
        identities = _open(work, store, nobody)
        held = {identities.dedicated_builder.uid} | {identities.for_spider(s).uid for s in "abc"}  # type: ignore[union-attr]
        assert 65534 not in held and len(held) == 4
    finally:
        store.close()


@needs_root
def test_a_recorded_uid_that_became_a_users_or_left_the_range_is_replaced(work: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    uids = UidRange(3_210_000_200, 3_210_000_209)
    store = StateStore(work / "state.db")
    try:
        first = _open(work, store, uids)
        assert first.for_spider("a").uid == 3_210_000_201  # type: ignore[union-attr]
        with caplog.at_level(logging.WARNING, "ckagent.node.identity"):
            named = _open(work, store, uids, taken=([3_210_000_201], []))  # an operator made a user of it
        assert named.for_spider("a").uid == 3_210_000_202  # type: ignore[union-attr]
        assert any("held uid 3210000201, which /etc/passwd or /etc/group names now" in r.getMessage()
                   for r in caplog.records)
        moved = _open(work, store, UidRange(3_210_000_300, 3_210_000_309))
        assert moved.dedicated_builder.uid == 3_210_000_300  # type: ignore[union-attr]
        assert moved.for_spider("a").uid == 3_210_000_301  # type: ignore[union-attr]
    finally:
        store.close()


@needs_root
def test_a_used_up_range_releases_the_least_recently_used_idle_spider(work: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    uids = UidRange(3_210_000_400, 3_210_000_403)  # the builder and three spiders
    store = StateStore(work / "state.db")
    try:
        identities = _open(work, store, uids, retention=60.0, busy=("b",))
        for spider in "abc":
            identities.for_spider(spider)
            for path in (work / "spider-data" / spider, work / "spider-home" / spider):
                path.mkdir(parents=True)
                (path / "kept.txt").write_text(spider)
        a_uid = identities.held()["a"]
        with pytest.raises(UidsExhausted, match=r"every spider holding one ran a task within task.retention \(60 s\)"):
            identities.for_spider("d")  # all three ran just now
        long_ago = time.time() - 3600
        for spider in "ab":
            store.touch_identity("spider", spider, long_ago)  # b is older, but has a task here now
        store.touch_identity("spider", "b", long_ago - 1)
        # Something still runs as a: killed on release, through its proven pidfd (ckagent.node.procid).
        left = subprocess.Popen(["sleep", "60"], user=a_uid, group=a_uid, extra_groups=[])
        try:
            with caplog.at_level(logging.WARNING, "ckagent.node.identity"):
                d = identities.for_spider("d")
            assert left.wait(timeout=10) == -signal.SIGKILL
        finally:
            left.kill()
            left.wait()
        assert d is not None and d.uid == a_uid
        assert not (work / "spider-data" / "a").exists() and not (work / "spider-home" / "a").exists()
        assert (work / "spider-data" / "b" / "kept.txt").read_text() == "b"
        assert identities.held() == {"b": identities.held()["b"], "c": identities.held()["c"], "d": a_uid}
        [line] = [r.getMessage() for r in caplog.records if "is used up" in r.getMessage()]
        assert f"spider 'a' (idle 3600 s) gives its uid {a_uid} to a new spider" in line
        assert str(work / "spider-data" / "a") in line
        assert line.endswith("; 1 process(es) still running as it killed"), line
    finally:
        store.close()


@needs_root
def test_a_used_up_range_with_files_kept_forever_refuses_new_spiders(work: Path) -> None:
    store = StateStore(work / "state.db")
    try:
        identities = _open(work, store, UidRange(3_210_000_500, 3_210_000_501), retention=0.0)
        assert identities.for_spider("a").uid == 3_210_000_501  # type: ignore[union-attr]
        with pytest.raises(UidsExhausted) as refused:
            identities.for_spider("b")
        text = str(refused.value)
        assert "no uid of task.spider_uids (3210000500-3210000501) is free for a new spider" in text
        assert "task.retention is 0" in text and "AGENT_TASK_SPIDER_UIDS" in text
        assert refused.value.blocker is Blocker.NO_FREE_UIDS
    finally:
        store.close()


@needs_root
def test_spider_uids_is_passed_over_with_why_when_it_cannot_be_had(tmp_path: Path) -> None:
    private = tmp_path / "private"  # pytest's tmp_path: 0700 root, so a spider's uid cannot reach in
    private.mkdir()
    work = private / "node"
    store = StateStore(tmp_path / "state.db")
    try:
        os.chmod(tmp_path, 0o700)
        identities = _open(work, store, UidRange(3_210_000_600, 3_210_000_609))
        assert identities.level is IdentityLevel.ROOT and identities.for_spider("a") is None
        [why] = identities.passed_over
        assert (why.level, why.blocker) == (IdentityLevel.SPIDER_UIDS, Blocker.UNREACHABLE)
        assert "cannot reach" in why.message, why
        notice = identities.as_root_notice()
        assert notice is not None and notice.startswith("spiders run as root: spider-uids (a uid per spider) is "
                                                        "not available here")
        assert "chmod o+x" in notice
        # The work dir's own parent is closed (0700) though everything above it is searchable: a spider's
        # uid reaches the parent's entry but not into it (the probe stats "<parent>/.", not "<parent>").
        (tmp_path / "open").mkdir()
        closed = spider_reachable(tmp_path / "open") / "closed"
        closed.mkdir(mode=0o700)
        shut = _open(closed / "node", store, UidRange(3_210_000_613, 3_210_000_619))
        assert shut.level is IdentityLevel.ROOT and shut.passed_over[0].blocker is Blocker.UNREACHABLE
        assert f"cannot reach {closed}/." in shut.passed_over[0].message, shut.passed_over
        full = _open(spider_reachable(tmp_path / "full"), store, UidRange(3_210_000_610, 3_210_000_612),
                     taken=([3_210_000_610, 3_210_000_611], []))
        assert full.level is IdentityLevel.ROOT and full.passed_over[0].blocker is Blocker.NO_FREE_UIDS
    finally:
        store.close()


def test_task_run_as_user_and_the_agents_user_decide_the_level(work: Path) -> None:
    store = StateStore(work / "state.db")
    me = pwd.getpwuid(os.geteuid()).pw_name
    try:
        not_root = _open(work, store, UidRange(3_210_000_700, 3_210_000_709), euid=4321)
        assert not_root.level is IdentityLevel.AGENT_USER and not_root.for_spider("a") is None
        assert [(u.level, u.blocker) for u in not_root.passed_over] == [(IdentityLevel.SPIDER_UIDS, Blocker.NOT_ROOT)]
        assert not_root.to_json()["root"] is (os.geteuid() == 0)  # the uid of this process, whoever runs the test
        with pytest.raises(IdentityError, match="no user 'no-such-user-ck35' on this node"):
            _open(work, store, UidRange(3_210_000_700, 3_210_000_709), run_as_user="no-such-user-ck35")
        if os.geteuid() != 0:
            return
        with pytest.raises(IdentityError, match=r"task.run_as_user='root' needs the agent to run as root"):
            _open(work, store, UidRange(3_210_000_700, 3_210_000_709), run_as_user="root", euid=4321)
        root = _open(work, store, UidRange(3_210_000_700, 3_210_000_709), run_as_user=me)
        assert root.level is IdentityLevel.ROOT and root.to_json()["root"] is True
        assert root.as_root_notice() == ("spiders run as root: task.run_as_user is root, so any spider can read this "
                                         "node's files, the agent's memory and its credentials; unset it to give "
                                         "each spider a uid of its own (spider-uids)")
        assert [(u.level, u.blocker) for u in root.passed_over] == [(IdentityLevel.SPIDER_UIDS, Blocker.RUN_AS_USER)]
        nobody = _open(work, store, UidRange(3_210_000_700, 3_210_000_709), run_as_user="nobody")
        assert nobody.level is IdentityLevel.ONE_USER and nobody.builder == nobody.for_spider("x")
        assert nobody.for_spider("x").uid == 65534  # type: ignore[union-attr]
        assert nobody.to_json() == {"level": "one-user", "details": "every spider as nobody (uid 65534, gid 65534)",
                                    "name": "nobody", "uid": 65534, "root": False, "builderUid": 65534,
                                    "passedOver": [{"level": "spider-uids", "blocker": "run-as-user",
                                                    "message": "task.run_as_user is nobody",
                                                    "remedy": Blocker.RUN_AS_USER.remedy}]}
    finally:
        store.close()


@needs_root
def test_config_check_judges_the_level_without_recording_anything(work: Path) -> None:
    passwd, group = id_files(work.parent, [], [])
    judged = judge_identities(None, UidRange(3_210_000_800, 3_210_000_809), work / "new", python=spider_python(),
                              sdk_dir=bundled_sdk_dir(), passwd=passwd, group=group)
    assert judged.level is IdentityLevel.SPIDER_UIDS and judged.passed_over == ()
    assert "from task.spider_uids 3210000800-3210000809" in judged.details
    assert not (work / "new").exists()
    forced = judge_identities("nobody", UidRange(3_210_000_800, 3_210_000_809), work, python=spider_python(),
                              sdk_dir=bundled_sdk_dir(), passwd=passwd, group=group)
    assert forced.level is IdentityLevel.ONE_USER
    assert [(u.level, u.blocker) for u in forced.passed_over] == [(IdentityLevel.SPIDER_UIDS, Blocker.RUN_AS_USER)]


@needs_root
def test_giving_a_tree_follows_nothing_out_of_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret"
    secret.write_text("agent's")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "own.txt").write_text("mine")
    (tree / "link-to-outside").symlink_to(outside)
    (tree / "sub" / "file-link").symlink_to(secret)
    os.link(secret, tree / "hard")  # a hard link to a file outside the tree
    os.mknod(tree / "disk", 0o666 | 0o020000, os.makedev(1, 3))  # a character device (/dev/null's numbers)
    spider = RunAs.of_uid(3_210_000_900, str(tmp_path / "home"))
    given = spider.chown_tree(tree)
    assert (given.copied, given.removed) == (1, 1)
    for path in (tree, tree / "sub", tree / "sub" / "own.txt", tree / "link-to-outside", tree / "sub" / "file-link",
                 tree / "hard"):
        assert (path.lstat().st_uid, path.lstat().st_gid) == (3_210_000_900, 3_210_000_900), path
    for path in (outside, secret):
        assert path.lstat().st_uid == 0, path
    assert (tree / "hard").read_text() == "agent's" and (tree / "hard").stat().st_ino != secret.stat().st_ino
    assert secret.stat().st_nlink == 1
    assert not (tree / "disk").exists()
    assert spider.chown_tree(tree).changed == 0  # done trees are left as they are
