"""The state store: real SQLite files in tmp_path, reopened the way a restarted agent does."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from ckagent.node.state import AsyncStateStore, StateStore, StateStoreError


def test_a_task_survives_a_reopen_until_its_result_is_acknowledged(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = StateStore(db)
    store.add_task("t1", "s1", {"id": "t1", "spiderId": "s1"}, tmp_path / "tasks" / "t1")
    store.add_task("t1", "s1", {"id": "t1", "spiderId": "other"}, tmp_path / "x")  # idempotent: first wins
    store.set_process("t1", 4242, 4242)
    store.save_stream_position("t1", "log", 10, {"j": 120, "p": {"0": 999}})
    store.close()

    store = StateStore(db)
    (record,) = store.pending_delivery()
    assert (record.task_id, record.spider_id, record.pgid, record.result) == ("t1", "s1", 4242, None)
    assert record.task_json["spiderId"] == "s1" and record.task_dir == tmp_path / "tasks" / "t1"
    assert store.stream_position("t1", "log") == (10, {"j": 120, "p": {"0": 999}})
    assert store.stream_position("t1", "items") == (0, None)
    assert store.streams("t1") == {"log": 10}

    store.set_result("t1", {"status": "SUCCESS"})
    first_finish = store.get("t1").finished_at  # type: ignore[union-attr]
    store.set_result("t1", {"status": "SUCCESS", "logLines": 10})  # counts added later: time kept
    record = store.get("t1")
    assert record is not None and record.result == {"status": "SUCCESS", "logLines": 10}
    assert record.finished_at == first_finish and record.pgid is None
    assert store.pending_delivery()[0].task_id == "t1"
    store.mark_result_acked("t1")
    assert store.pending_delivery() == []
    store.close()


def test_retention_candidates_and_forget(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    for task_id in ("old", "new", "unsent"):
        store.add_task(task_id, "s", {}, tmp_path / task_id)
        store.set_result(task_id, {"status": "SUCCESS"})
    store.mark_result_acked("old")
    store.mark_result_acked("new")
    store._exec("UPDATE tasks SET finished_at=? WHERE task_id='old'", (time.time() - 3600,))
    assert [r.task_id for r in store.delivered_before(time.time() - 60)] == ["old"]
    assert {r.task_id for r in store.delivered_before(time.time() + 1)} == {"old", "new"}  # never "unsent"
    store.save_stream_position("old", "log", 3, {"offset": 30})
    store.forget("old")
    assert store.get("old") is None and store.streams("old") == {}
    assert store.task_ids() == {"new", "unsent"}


def test_a_state_db_from_before_json_positions_is_upgraded(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    old = sqlite3.connect(db)
    old.executescript(
        "CREATE TABLE streams (task_id TEXT NOT NULL, stream TEXT NOT NULL, acked_seq INTEGER NOT NULL,"
        " acked_offset INTEGER NOT NULL, PRIMARY KEY (task_id, stream));"
        "INSERT INTO streams VALUES ('t', 'items', 5, 77);"
    )
    old.commit()
    old.close()
    store = StateStore(db)
    assert store.stream_position("t", "items") == (5, {"offset": 77})
    store.save_stream_position("t", "items", 6, {"offset": 90})
    assert store.stream_position("t", "items") == (6, {"offset": 90})


def test_an_unusable_path_raises_state_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StateStoreError, match="cannot open the state store"):
        StateStore(blocker / "state.db")


async def test_the_async_store_runs_the_same_operations(tmp_path: Path) -> None:
    store = AsyncStateStore(StateStore(tmp_path / "state.db"))
    await store.add_task("t", "s", {}, tmp_path / "t")
    await store.save_stream_position("t", "log", 2, {"j": 0, "p": {}})
    assert await store.stream_position("t", "log") == (2, {"j": 0, "p": {}})
    await store.set_result("t", {"status": "FAILED"})
    assert [r.task_id for r in await store.pending_delivery()] == ["t"]
    await store.mark_result_acked("t")
    assert await store.pending_delivery() == []
    assert await store.task_ids() == {"t"}
    await store.forget("t")
    assert await store.get("t") is None


def test_state_db_is_owner_only_because_it_holds_task_env(tmp_path: Path) -> None:
    """Task records carry every task's env (its secrets): spiders running as another user must not read them."""
    store = StateStore(tmp_path / "state.db")
    store.add_task("t1", "s1", {"env": {"DB_PASSWORD": "x"}}, tmp_path / "tasks" / "t1")
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        path = tmp_path / name
        if path.exists():
            assert path.stat().st_mode & 0o777 == 0o600, name
    store.close()
    (tmp_path / "state.db").chmod(0o644)  # an older agent's file is tightened on open
    StateStore(tmp_path / "state.db").close()
    assert (tmp_path / "state.db").stat().st_mode & 0o777 == 0o600
