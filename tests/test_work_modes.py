"""The agent's own files in its work dir are unreadable to every spider (ckagent.node.workmodes): a
work dir an older agent left (0755 folders, 0644 files) is fixed at the start, what spiders pass through
is traversable only, and nothing is followed or removed. Read by another uid where the test is root.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from harness import NOBODY, another_user_cannot, run_as, spider_reachable

from ckagent.node.workmodes import seal_work_dir, spiders_apart


def _old_layout(work: Path) -> None:
    """A work dir as an agent before issue 35 left it: everything readable by everyone."""
    for folder in ("tasks/t1", "spider-data/s1", "spider-home/s1", "spiders/s1/v1", "spiders/.runs/t2",
                   "envs/py-1", "builder-home", "cache"):
        (work / folder).mkdir(parents=True)
    for file in ("state.db", "state.db-wal", "node_uid", "runtimes.json", "egress-proxy.key", "tasks/t1/items.jsonl"):
        (work / file).write_text("secret of the node\n")
    (work / "link").symlink_to("/etc/hostname")
    for path in [work, *work.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_apart_the_work_dir_is_traversable_only_and_the_agents_files_its_own(tmp_path: Path) -> None:
    work = tmp_path / "work"
    _old_layout(work)
    config = tmp_path / "agent.yaml"
    config.write_text("agent:\n  registration_token: secret\n")
    config.chmod(0o644)
    changed = seal_work_dir(work, apart=True, config_file=config)
    assert changed
    assert _mode(work) == 0o711
    for folder in ("tasks", "spider-data", "spider-home", "spiders", "spiders/.runs"):
        assert _mode(work / folder) == 0o711, folder
    for folder in ("tasks/t1", "spider-data/s1", "spider-home/s1", "spiders/s1", "spiders/.runs/t2", "cache"):
        assert _mode(work / folder) == 0o700, folder
    for file in ("state.db", "state.db-wal", "node_uid", "runtimes.json", "egress-proxy.key"):
        assert _mode(work / file) == 0o600, file
    assert _mode(work / "envs") == 0o755 and _mode(work / "builder-home") == 0o755  # the builder's: left
    assert _mode(config) == 0o600 and (work / "link").is_symlink()
    assert seal_work_dir(work, apart=True, config_file=config) == []  # once: nothing left to change


def test_spiders_as_the_agents_uid_get_nothing_to_pass_through(tmp_path: Path) -> None:
    work = tmp_path / "work"
    _old_layout(work)
    seal_work_dir(work, apart=False)
    assert _mode(work) == 0o700 and _mode(work / "tasks") == 0o700 and _mode(work / "spiders/.runs") == 0o700


def test_which_levels_keep_spiders_apart() -> None:
    assert spiders_apart(0, None) and spiders_apart(0, "crawler")
    assert not spiders_apart(0, "root") and not spiders_apart(1000, None)


@pytest.mark.skipif(another_user_cannot() is not None, reason=str(another_user_cannot()))
def test_another_uid_can_reach_its_own_dir_and_read_nothing_of_the_agents(tmp_path: Path) -> None:
    work = spider_reachable(tmp_path / "work")
    _old_layout(work)
    os.chown(work / "tasks" / "t1", NOBODY, NOBODY)
    os.chown(work / "tasks" / "t1" / "items.jsonl", NOBODY, NOBODY)
    seal_work_dir(work, apart=True)
    probe = ("import os, sys\n"
             "work = sys.argv[1]\n"
             "def can(f):\n"
             "    try:\n"
             "        f(); return 'yes'\n"
             "    except OSError as exc:\n"
             "        return exc.strerror\n"
             "print(can(lambda: open(work + '/tasks/t1/items.jsonl').read()))\n"  # its own: yes
             "for path in ('state.db', 'egress-proxy.key', 'node_uid'):\n"
             "    print(can(lambda: open(work + '/' + path).read()))\n"
             "for path in ('', '/tasks', '/spiders', '/spider-data'):\n"
             "    print(can(lambda: os.listdir(work + path)))\n")
    done = run_as(NOBODY, probe, str(work))
    lines = done.stdout.split("\n")
    assert lines[0] == "yes", done
    assert all(line == "Permission denied" for line in lines[1:8]), done
