"""A task claimed by this run starts both streams at (0, None) without asking SQLite (a thread hop
per stream saved per task); anything saved since, or a task the store already knew, is read as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckagent.node.state import AsyncStateStore, StateStore


async def test_a_new_task_s_streams_start_at_zero_without_a_thread_hop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(10):
        store = AsyncStateStore(StateStore(tmp_path / "state.db"))
        await store.add_task("t1", "s1", {"id": "t1"}, tmp_path / "t1")
        hops = []
        original = trio.to_thread.run_sync

        async def counting(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
            hops.append(fn)
            return await original(fn, *args, **kwargs)

        monkeypatch.setattr(trio.to_thread, "run_sync", counting)
        assert await store.stream_position("t1", "log") == (0, None)
        assert await store.stream_position("t1", "items") == (0, None)
        assert hops == []
        # Saved since: the database (or the noted position) answers, never the fresh start.
        await store.save_stream_position("t1", "log", 5, {"j": 0, "p": {"0": 50}})
        assert await store.stream_position("t1", "log") == (5, {"j": 0, "p": {"0": 50}})
        monkeypatch.setattr(trio.to_thread, "run_sync", original)
        store.sync.close()


async def test_a_task_the_store_already_had_is_read_from_the_database(tmp_path: Path) -> None:
    with trio.fail_after(10):
        first = StateStore(tmp_path / "state.db")
        first.add_task("t1", "s1", {"id": "t1"}, tmp_path / "t1")
        first.save_stream_position("t1", "items", 3, {"offset": 30})
        first.close()
        store = AsyncStateStore(StateStore(tmp_path / "state.db"))
        await store.add_task("t1", "s1", {"id": "t1"}, tmp_path / "t1")  # idempotent: not new
        assert await store.stream_position("t1", "items") == (3, {"offset": 30})
        assert await store.stream_position("t1", "log") == (0, None)
        store.sync.close()
