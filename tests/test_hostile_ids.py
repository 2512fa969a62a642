"""A master that sends hostile ids: nothing is written outside the work dir, nothing crashes the agent.

The reference master refuses to create such ids itself, so they are put into its SQLite file: each
task row gets its hostile id, spider id, code version and spider name (with a copy of the package under
the new spider id and version, so the tasks that the agent accepts really run).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, running_agent, spider_zip

from ckagent.devmaster.client import AdminApiError

SPIDER = {
    "main.py": (
        "import os, pathlib\n"
        "pathlib.Path(os.environ['CK_TASK_DIR'], 'mine.txt').write_text('ok')\n"
        "pathlib.Path(os.environ['CK_DATA_DIR'], 'kept.txt').write_text('ok')\n"
        "print('ran', repr(os.environ['CK_TASK_ID'])[:40])\n"
    )
}


def _accepted(outside: Path) -> list[str]:
    """Ids the agent carries (mapped to safe names and encoded URL segments), one class each."""
    return [
        "../../../escape-rel",            # relative traversal
        f"{outside}/abs",                 # absolute path
        "%2e%2e%2f%2e%2e%2fescape-pct",   # percent-encoded traversal
        ".",                              # dot names
        "..",
        "a\nb",                           # control characters
        "tab\there\r\x1b[31m",
        "q?x=1#frag",                     # URL syntax
        "_ordinary-0123456789",           # the shape of a hashed name
        "爬虫/任务",                        # non-ASCII with a slash
    ]


def _refused() -> dict[str, list[str]]:
    """Per field, the values the agent cannot carry (BAD_TASK for that task alone)."""
    nul, huge = "nul\x00x", "x" * 5000
    return {"id": ["", nul, huge], "spider_id": ["", nul, huge], "spider_name": [nul, huge],
            "code_version": [nul, huge]}


def _rewrite(db_path: Path, rows: list[tuple[str, dict[str, str]]]) -> None:
    """Give each created task (by its id) the given columns, and copy the package to its spider id/version."""
    db = sqlite3.connect(db_path)
    try:
        with db:
            for task_id, columns in rows:
                old = db.execute("SELECT spider_id, code_version FROM tasks WHERE id = ?", (task_id,)).fetchone()
                sets = ", ".join(f"{name} = ?" for name in columns)
                db.execute(f"UPDATE tasks SET {sets} WHERE id = ?", (*columns.values(), task_id))
                spider_id, version = columns.get("spider_id", old[0]), columns.get("code_version", old[1])
                db.execute(
                    "INSERT OR IGNORE INTO packages (spider_id, code_version, sha256, size_bytes, data, uploaded_at)"
                    " SELECT ?, ?, sha256, size_bytes, data, uploaded_at FROM packages"
                    " WHERE spider_id = ? AND code_version = ?", (spider_id, version, old[0], old[1]),
                )
    finally:
        db.close()


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


async def test_hostile_ids_stay_data(dev_master: Any, nursery: trio.Nursery, tmp_path: Path,
                                     caplog: pytest.LogCaptureFixture) -> None:
    work_dir = tmp_path / "agent"
    outside = tmp_path / "outside"
    admin = dev_master.admin
    spider_id = await admin.create_spider(name="probe", framework="python")
    await admin.upload_package(spider_id, spider_zip(SPIDER))

    rows: list[tuple[str, dict[str, str]]] = []
    accepted = _accepted(outside)
    for value in accepted:  # the same hostile value as task id, spider id, code version and spider name
        rows.append((await admin.create_task(spider_id),
                     {"id": value, "spider_id": value, "code_version": value, "spider_name": value}))
    refused: list[tuple[str, str, str]] = []  # (task id it is reported under, "" for none; field; value)
    for column, values in _refused().items():
        for i, value in enumerate(values):
            created = await admin.create_task(spider_id)
            # A task refused for another field keeps a readable id; each one gets a spider of its own
            # (the master hands out one task per spider at a time).
            good_id = f"refused-{column}-{i}"
            columns = {"id": good_id, "spider_id": f"spider-{good_id}", column: value}
            rows.append((created, columns))
            refused.append((value if column == "id" else good_id, column, value))
    _rewrite(dev_master.db_path, rows)
    before = _tree(tmp_path) - {p for p in _tree(tmp_path) if p.startswith("agent")}

    caplog.set_level(logging.INFO)
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_MAX_WORKERS="4")
    async with running_agent(nursery, settings) as agent:
        finals = {value: await admin.wait_task_final(value, 120) for value in accepted}
        reported = {}
        for task_id, column, value in refused:
            if task_id:  # an empty id cannot name the task: it is only logged (and stays pending)
                reported[(column, value)] = await admin.wait_task_final(task_id, 60)
        after_id = await admin.create_task(spider_id)
        after = await admin.wait_task_final(after_id, 60)
        assert agent.state == "RUNNING"

    for value, final in finals.items():
        assert final["status"] == "SUCCESS", (value, final)
        assert "ran" in "\n".join(await admin.get_logs(value)), value
    for (column, value), final in reported.items():
        assert final["status"] == "FAILED" and final["errorCode"] == "BAD_TASK", (column, value[:20], final)
        wire = {"id": "id", "spider_id": "spiderId", "spider_name": "spiderName", "code_version": "codeVersion"}
        assert wire[column] in final["errorMessage"], final["errorMessage"]
    assert len(reported) == len(refused) - 1 and ("spider_id", "") in reported
    assert after["status"] == "SUCCESS", after

    # Nothing outside the agent's work dir; inside, every task dir is one safe name under tasks/.
    assert not outside.exists()
    now = _tree(tmp_path) - {p for p in _tree(tmp_path) if p.startswith("agent")}
    assert now - before <= {"master.sqlite-wal", "master.sqlite-shm"}, now - before
    for entry in (work_dir / "tasks").iterdir():
        assert entry.parent == work_dir / "tasks" and not entry.name.startswith(".") and len(entry.name) <= 100
    written = sorted(p.parent.name for p in (work_dir / "tasks").glob("*/mine.txt"))
    assert len(written) == len(accepted) + 1, written
    data_dirs = sorted(p.parent.name for p in (work_dir / "spider-data").glob("*/kept.txt"))
    assert len(set(data_dirs)) == len(accepted) + 1  # one per spider id, none shared
    # The refusal of each task is logged once, however often the master offers it.
    lines = [r.getMessage() for r in caplog.records if "breaks the protocol" in r.getMessage()]
    assert len(lines) == len(refused), lines


@pytest.mark.parametrize("name", ["a\x00b", "x" * 5000, "two\nlines", "tab\there", "   "])
async def test_reference_master_refuses_names_it_would_not_hand_out(dev_master: Any, name: str) -> None:
    admin = dev_master.admin
    with pytest.raises(AdminApiError) as created:
        await admin.create_spider(name=name, framework="python")
    assert created.value.status_code == 422 and "name" in created.value.message, created.value.message
    spider_id = await admin.create_spider(name="fine 名字", framework="python")
    with pytest.raises(AdminApiError) as patched:
        await admin.update_spider(spider_id, name=name)
    assert patched.value.status_code == 422 and "name" in patched.value.message
