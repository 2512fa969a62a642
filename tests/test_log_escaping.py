"""One record, one line of agent.log: an id from the master (or a spider's name) cannot forge a line.

| input | expected |
| --- | --- |
| any text as a task id in a message, text format | exactly one line; the id's controls escaped (``\\n``, ``\\x1b``) |
| the same, JSON format | exactly one line; decoding gives the id back |
| the id in an exception's message (a traceback) | the traceback's lines indented under their record |
| a real agent given a task whose id holds ``\\n`` and a forged record | no line of agent.log is the forged one |
"""

from __future__ import annotations

import json
import logging
import re
import signal
from pathlib import Path
from typing import Any

import trio
from harness import AgentProcess, eventually, submit
from harness.confusing import rename_task
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckagent.node.logs import escape_controls, setup_logging

FORGED = "2026-12-05 12:00:00,000 ERROR   ckagent.agent: forged by the master"
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ +\S+: ")
SEPARATORS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"




def _lines(path: Path) -> list[str]:
    """The file's lines split at every break any reader knows (``str.splitlines``)."""
    return path.read_text(encoding="utf-8").splitlines()


ids = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    [f"t\n{FORGED}", "t\r\x1b[2K" + FORGED, "a\u2028b\x85c", "\x00\x7f\x9b", "back\\nslash"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(task_id=ids, spider=ids)
def test_any_id_gives_one_text_line(tmp_path: Path, root_logger: logging.Logger, task_id: str, spider: str) -> None:
    log_file = tmp_path / "agent.log"
    log_file.unlink(missing_ok=True)
    setup_logging("INFO", log_file, "text", stderr=False)
    logging.getLogger("ckagent.task.runner").info("task %s of spider %s: claimed", task_id, spider)
    lines = _lines(log_file)
    assert len(lines) == 1, lines
    assert RECORD_START.match(lines[0])
    assert lines[0].endswith(f"task {escape_controls(task_id)} of spider {escape_controls(spider)}: claimed")
    assert not any(c in lines[0] for c in SEPARATORS)
    assert not re.search("[\x00-\x1f\x7f-\x9f]", lines[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(task_id=ids)
def test_any_id_gives_one_json_line_that_decodes_to_it(tmp_path: Path, root_logger: logging.Logger,
                                                       task_id: str) -> None:
    log_file = tmp_path / "agent.log"
    log_file.unlink(missing_ok=True)
    setup_logging("INFO", log_file, "json", stderr=False)
    logging.getLogger("ckagent.task.runner").info("task %s: claimed", task_id, extra={"fields": {"task_id": task_id}})
    lines = _lines(log_file)
    assert len(lines) == 1, lines
    entry = json.loads(lines[0])
    assert entry["message"] == f"task {task_id}: claimed" and entry["task_id"] == task_id


def test_an_id_in_a_traceback_cannot_start_a_record(tmp_path: Path, root_logger: logging.Logger) -> None:
    log_file = tmp_path / "agent.log"
    setup_logging("INFO", log_file, "text", stderr=False)
    try:
        raise ValueError(f"unknown task t\n{FORGED}\r\x1b[31m")
    except ValueError:
        logging.getLogger("ckagent.agent").exception("task %s failed", f"t\n{FORGED}")
    lines = _lines(log_file)
    assert RECORD_START.match(lines[0]) and "t\\n2026" in lines[0]
    assert all(line.startswith("  ") for line in lines[1:]), lines
    assert any(line.strip() == f"{FORGED}\\r\\x1b[31m" for line in lines[1:]), lines
    assert sum(1 for line in lines if RECORD_START.match(line)) == 1


async def test_a_real_agent_logs_a_task_id_with_a_newline_on_one_line(dev_master: Any, tmp_path: Path) -> None:
    """The reference master would not hand out such an id: it is put into its SQLite file."""
    admin = dev_master.admin
    created = await submit(admin, "confusing", {"main.py": "import time\nprint('ran', flush=True)\ntime.sleep(60)\n"})
    hostile = f"t-{created}\n{FORGED}"
    rename_task(dev_master.db_path, created, hostile)
    log_file = tmp_path / "agent-own.log"
    agent = AgentProcess(tmp_path, dev_master.base_url, dev_master.registration_token,
                         logging__format="text", logging__level="DEBUG", logging__file=str(log_file))
    try:
        with trio.fail_after(90):
            await agent.start()
            await eventually(lambda: _running(admin, hostile), 60, "the task running")
            await admin.cancel_task(hostile)  # logged: "task …: stopping (…)"
            final = await admin.wait_task_final(hostile, 60)
            await eventually(lambda: _logged(log_file, CANONICAL), 30, "the canonical line")
            agent.signal(signal.SIGTERM)
            assert await agent.wait() == 0
    finally:
        with trio.move_on_after(10, shield=True):
            await agent.kill()
    assert final["status"] == "CANCELLED", final
    lines = _lines(log_file)
    assert not [line for line in lines if line.startswith(FORGED)], "a forged line"
    assert not [line for line in lines if not RECORD_START.match(line) and not line.startswith("  ")]
    escaped = escape_controls(hostile)
    assert any(escaped in line and "stopping" in line for line in lines), [line for line in lines if "forged" in line]


CANONICAL = "task finished"


async def _running(admin: Any, task_id: str) -> bool:
    return (await admin.get_task(task_id))["status"] == "RUNNING"


async def _logged(log_file: Path, text: str) -> bool:
    found = await trio.to_thread.run_sync(lambda: log_file.exists() and text in log_file.read_text())
    return bool(found)
