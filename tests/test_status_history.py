"""Seen on the page (issue 36, item 6): /status and the status page show the agent's uptime, the tasks
re-adopted at start and handed over at a stop, the last upgrade or rollback and the failed versions
(run.sh's ``$STATE_DIR/last-change.json`` and ``failed_versions``, read as hostile input:
ckagent.port.statusrunsh), the egress and identity levels, and a full disk's culprit."""

from __future__ import annotations

import html
import json
import os
import re
import string
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    Releases,
    RunShNode,
    agent_settings,
    eventually,
    failed_versions,
    no_strays,
    out,
    running_agent,
    stand_in_release,
    submit,
    wait_for_log,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckagent
from ckagent.port.status import AgentStatus
from ckagent.port.statusrows import node_history_rows
from ckagent.port.statusrunsh import (
    FAILED_VERSIONS_FILE,
    LAST_CHANGE_FILE,
    MAX_FAILED_SHOWN,
    MAX_RECORD_BYTES,
    MAX_TEXT_CHARS,
    STATE_DIR_ENV,
    read_runsh_state,
    state_dir_from,
)

RECORD = {"action": "upgrade", "from": "0.1.0", "to": "0.2.0", "outcome": "healthy", "at": 1764950400,
          "reason": "asked by the master (desiredAgentVersion)"}


def _state(tmp_path: Path, last: bytes | None = None, failed: bytes | None = None) -> Path:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    if last is not None:
        (state / LAST_CHANGE_FILE).write_bytes(last)
    if failed is not None:
        (state / FAILED_VERSIONS_FILE).write_bytes(failed)
    return state


def _page_text(rows: list[tuple[str, str]]) -> str:
    """The rows as the page renders them (escaped)."""
    return "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)


# --------------------------------------------------------------------------- run.sh's records


def test_a_record_written_by_run_sh_is_read_field_by_field(tmp_path: Path) -> None:
    state = _state(tmp_path, json.dumps(RECORD).encode(), b"0.3.0\n0.3.1\n")
    read = read_runsh_state(state).to_json()
    assert read["lastChange"] == RECORD and read["lastChangeUnknown"] is None
    assert read["failedVersions"] == ["0.3.0", "0.3.1"] and read["failedVersionsCount"] == 2
    assert read["failedVersionsUnknown"] is None and read["stateDir"] == str(state)
    rows = dict(node_history_rows({"upgrades": {**read, "lastChange": {**RECORD, "at": "2025-12-05T16:00:00.000Z"}}}))
    assert rows["last upgrade / rollback"] == (
        "upgrade 0.1.0 → 0.2.0: healthy, at 2025-12-05T16:00:00.000Z (asked by the master (desiredAgentVersion))")
    assert rows["failed versions"] == "2: 0.3.0, 0.3.1"


def test_not_started_by_run_sh_and_nothing_recorded_yet(tmp_path: Path) -> None:
    assert state_dir_from({}) is None and state_dir_from({STATE_DIR_ENV: ""}) is None
    assert state_dir_from({STATE_DIR_ENV: "relative/dir"}) is None
    assert state_dir_from({STATE_DIR_ENV: "/opt/ck/.ckagent"}) == Path("/opt/ck/.ckagent")
    assert state_dir_from({"CKAGENT_RUN_SH": "/opt/ck/run.sh"}) == Path("/opt/ck/.ckagent")  # (an older run.sh)
    assert state_dir_from({STATE_DIR_ENV: "/s", "CKAGENT_RUN_SH": "/opt/ck/run.sh"}) == Path("/s")
    none = read_runsh_state(None).to_json()
    assert none["lastChange"] is None and "not started by run.sh" in none["lastChangeUnknown"]
    assert none["failedVersions"] is None and STATE_DIR_ENV in none["failedVersionsUnknown"]
    empty = read_runsh_state(_state(tmp_path)).to_json()  # run.sh's dir, no upgrade yet, none failed
    assert (empty["lastChange"], empty["lastChangeUnknown"]) == (None, "none recorded")
    assert (empty["failedVersions"], empty["failedVersionsUnknown"]) == ([], None)
    rows = dict(node_history_rows({"upgrades": empty}))
    assert rows["last upgrade / rollback"] == "unknown (none recorded)" and rows["failed versions"] == "none"
    gone = read_runsh_state(tmp_path / "no-such-dir").to_json()
    assert gone["lastChangeUnknown"] == "none recorded" and gone["failedVersions"] == []


@pytest.mark.parametrize(("content", "why"), [
    (b"", "not JSON"),
    (b"<html>upgrade</html>", "not JSON"),
    (b'{"action": "upgrade", "to": "0.2', "not JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'["upgrade", "0.2.0"]', "not a JSON object (a list)"),
    (b"null", "not a JSON object (a NoneType)"),
    (b"7", "not a JSON object (a int)"),
    (b"{}", "none of action"),
    (b'{"action": 5, "from": [], "to": {}, "outcome": null, "at": "yesterday", "reason": false}', "none of action"),
    (b"[" * 100_000, "larger than 64 KiB"),
    (b"[" * 50_000 + b"]" * 10_000, "not JSON"),  # deep: RecursionError, caught
    (b" " * (MAX_RECORD_BYTES + 1), "larger than 64 KiB"),
])
def test_garbage_huge_and_wrong_shapes_are_unknown(tmp_path: Path, content: bytes, why: str) -> None:
    read = read_runsh_state(_state(tmp_path, content)).to_json()
    assert read["lastChange"] is None and why in read["lastChangeUnknown"], read
    json.dumps(read)


def test_a_field_of_the_wrong_type_is_unknown_alone(tmp_path: Path) -> None:
    record = {**RECORD, "at": True, "from": 1, "reason": "a\nforged line\x1b[31m" + "x" * 5000}
    read = read_runsh_state(_state(tmp_path, json.dumps(record).encode())).to_json()["lastChange"]
    assert read["action"] == "upgrade" and read["to"] == "0.2.0" and read["from"] is None and read["at"] is None
    assert read["reason"].startswith("a?forged line?[31m") and len(read["reason"]) == MAX_TEXT_CHARS
    for at in ("NaN", "Infinity", "-1", "0", "1e300", "99999999999999"):
        text = json.dumps({**RECORD}).replace("1764950400", at).encode()
        assert read_runsh_state(_state(tmp_path, text)).to_json()["lastChange"]["at"] is None, at


def test_not_a_regular_file_is_unknown_and_never_blocks(tmp_path: Path) -> None:
    state = _state(tmp_path)
    os.mkfifo(state / LAST_CHANGE_FILE)  # a reader of a FIFO without a writer would wait for ever
    (state / FAILED_VERSIONS_FILE).mkdir()
    read = read_runsh_state(state).to_json()
    assert read["lastChangeUnknown"] == f"{LAST_CHANGE_FILE}: not a regular file"
    assert read["failedVersions"] is None and read["failedVersionsUnknown"] == f"{FAILED_VERSIONS_FILE}: not a regular file"
    (state / LAST_CHANGE_FILE).unlink()
    (state / LAST_CHANGE_FILE).symlink_to("/etc/shadow")
    assert "a symlink" in read_runsh_state(state).to_json()["lastChangeUnknown"]


def test_failed_versions_hostile_lines(tmp_path: Path) -> None:
    lines = b"".join(f"0.{i}.0\n".encode() for i in range(100)) + b"\n\n  \n\xff\xfe<b>bad</b>\x00\n"
    read = read_runsh_state(_state(tmp_path, failed=lines)).to_json()
    assert read["failedVersionsCount"] == 101 and len(read["failedVersions"]) == MAX_FAILED_SHOWN
    assert read["failedVersions"][-1] == "\ufffd\ufffd<b>bad</b>?"  # kept as text, escaped by the page
    page = _page_text(node_history_rows({"upgrades": read}))
    assert "<b>" not in page and "&lt;b&gt;bad&lt;/b&gt;" in page and "(+81 more)" in page


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(last=st.one_of(st.binary(max_size=600), st.builds(
           lambda d: json.dumps(d).encode(),
           st.dictionaries(st.sampled_from(["action", "from", "to", "outcome", "at", "reason", "x"]),
                           st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40),
                                     st.lists(st.integers(), max_size=3)), max_size=7))),
       failed=st.binary(max_size=600))
def test_any_bytes_are_read_without_a_crash_and_shown_escaped(tmp_path: Path, last: bytes, failed: bytes) -> None:
    read = read_runsh_state(_state(tmp_path, last, failed)).to_json()
    json.dumps(read)  # the /status answer can always be encoded
    change = read["lastChange"]
    assert (change is None) != (read["lastChangeUnknown"] is None)
    if change is not None:
        assert set(change) == {"action", "from", "to", "outcome", "at", "reason"}
        for key, value in change.items():
            if key == "at":
                assert value is None or (isinstance(value, float) and value > 0)
            else:
                assert value is None or (isinstance(value, str) and len(value) <= MAX_TEXT_CHARS
                                         and not any(ord(c) < 32 for c in value))
    assert isinstance(read["failedVersions"], list) and read["failedVersionsUnknown"] is None
    assert all("\n" not in v and "\x00" not in v for v in read["failedVersions"])
    rows = node_history_rows({"upgrades": read})
    page = _page_text(rows)
    assert "<" not in page.replace("<tr>", "").replace("</tr>", "").replace("<th>", "").replace(
        "</th>", "").replace("<td>", "").replace("</td>", "")


@settings(max_examples=200, deadline=None)
@given(status=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=10)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.sampled_from(
                                                       ["tasksAtStart", "readopted", "notReadopted", "handedOver",
                                                        "upgrades", "lastChange", "failedVersions", "count", "ids",
                                                        "tasks", "diskCulprit", "uptimeSeconds", "startedAt"]),
                                                       inner, max_size=5)), max_leaves=20))
def test_the_page_rows_take_any_status_shape(status: Any) -> None:
    rows = node_history_rows(status if isinstance(status, dict) else {})
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in rows)


# --------------------------------------------------------------------------- a real agent


async def _get(port: int, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        return await http.get(path)


@pytest.mark.parametrize("levels", [{}, {"AGENT_TASK_EGRESS": "proxy", "AGENT_TASK_CONTAINMENT": "process-group"},
                                    {"AGENT_TASK_EGRESS": "off"}], ids=["auto", "proxy+process-group", "egress-off"])
async def test_status_and_page_show_uptime_levels_upgrades_and_culprit(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, levels: dict[str, str]
) -> None:
    state = _state(tmp_path, json.dumps({**RECORD, "reason": "<script>alert(1)</script>"}).encode(),
                   b"0.3.0\n<img src=x onerror=alert(2)>\n")
    monkeypatch.setenv(STATE_DIR_ENV, str(state))  # what run.sh exports
    settings_ = agent_settings(tmp_path / "w", dev_master.base_url, dev_master.registration_token, **levels)
    with trio.fail_after(60):
        async with running_agent(nursery, settings_) as agent:
            assert agent.status_port is not None
            await eventually(lambda: _truthy(agent.heartbeat is not None and agent.heartbeat.last_success))
            status = (await _get(agent.status_port, "/status")).json()
            assert isinstance(status["uptimeSeconds"], float) and 0 <= status["uptimeSeconds"] < 60
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", status["startedAt"])
            assert agent.egress is not None and agent.identities is not None
            assert status["egress"]["level"] == agent.egress.to_json()["level"]
            if levels:
                assert status["egress"]["level"] == levels["AGENT_TASK_EGRESS"]
            if "AGENT_TASK_CONTAINMENT" in levels:
                assert status["containment"]["level"] == "process-group"
            assert status["identity"]["level"] == agent.identities.to_json()["level"]
            assert status["tasksAtStart"] == {"readopted": {"count": 0, "ids": []},
                                              "notReadopted": {"count": 0, "tasks": []}}
            assert status["handedOver"] == {"count": 0, "ids": []}
            upgrades = status["upgrades"]
            assert upgrades["lastChange"] == {**RECORD, "reason": "<script>alert(1)</script>",
                                              "at": "2025-12-05T16:00:00.000Z"}
            assert upgrades["failedVersions"] == ["0.3.0", "<img src=x onerror=alert(2)>"]
            assert status["diskCulprit"] is None
            page = (await _get(agent.status_port, "/")).text
            assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
            assert "<img src=x" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page
            assert "upgrade 0.1.0 → 0.2.0: healthy, at 2025-12-05T16:00:00.000Z" in page
            assert "<th>egress</th><td>" + html.escape(str(status["egress"]["level"])) in page
            assert "<th>up since</th>" in page and "<th>full disk: culprit</th><td>none</td>" in page

            # read at each request: run.sh rewrites its record after the agent started (a rollback)
            (state / LAST_CHANGE_FILE).write_bytes(b"\x00garbage" * 20_000)
            status = (await _get(agent.status_port, "/status")).json()
            assert status["upgrades"]["lastChange"] is None
            assert status["upgrades"]["lastChangeUnknown"] == f"{LAST_CHANGE_FILE}: larger than 64 KiB"
            assert "unknown (last-change.json: larger than 64 KiB)" in (await _get(agent.status_port, "/")).text
            (state / LAST_CHANGE_FILE).unlink()
            os.mkfifo(state / LAST_CHANGE_FILE)  # never blocks the port
            assert (await _get(agent.status_port, "/status")).json()["upgrades"]["lastChangeUnknown"] == (
                f"{LAST_CHANGE_FILE}: not a regular file")

            # the disk watch's culprit (ckagent.delivery.diskwatch's DiskCulprit: task_id, used_bytes, at, reason)
            assert agent.outbox is not None
            # (set by name: before the disk watch keeps a culprit the attribute does not exist on main)
            culprit_attr = "last_culprit"
            setattr(agent.outbox.disk, culprit_attr, SimpleNamespace(
                task_id="t<1>", used_bytes=300 << 20, at=1764950400.0, reason="filled the disk: <300 MiB>"))
            status = (await _get(agent.status_port, "/status")).json()
            assert status["diskCulprit"] == {"taskId": "t<1>", "usedBytes": 300 << 20,
                                             "at": "2025-12-05T16:00:00.000Z", "reason": "filled the disk: <300 MiB>"}
            page = (await _get(agent.status_port, "/")).text
            assert "task t&lt;1&gt;, 300.0 MiB at 2025-12-05T16:00:00.000Z: filled the disk: &lt;300 MiB&gt;" in page


async def _truthy(value: Any) -> bool:
    return bool(value)


async def test_an_agent_not_started_by_run_sh_says_unknown(dev_master: Any, nursery: trio.Nursery, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    monkeypatch.delenv("CKAGENT_RUN_SH", raising=False)
    settings_ = agent_settings(tmp_path / "w", dev_master.base_url, dev_master.registration_token)
    with trio.fail_after(60):
        async with running_agent(nursery, settings_) as agent:
            assert agent.status_port is not None
            upgrades = (await _get(agent.status_port, "/status")).json()["upgrades"]
            assert upgrades["lastChange"] is None and "not started by run.sh" in upgrades["lastChangeUnknown"]
            page = (await _get(agent.status_port, "/")).text
            assert "unknown (not started by run.sh (CK_RUNSH_STATE_DIR and CKAGENT_RUN_SH not set))" in page


SPIDER = "import time\nfor i in range(600):\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n"


@pytest.mark.slow
# In this process the handed-over spider is this process's child: its Popen object is dropped while the
# spider runs (an agent process would have exited), which Python warns about.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_handed_over_and_re_adopted_tasks_are_shown(dev_master: Any, nursery: trio.Nursery,
                                                          tmp_path: Path) -> None:
    """A hand-over lists the tasks it leaves running (while the agent stops); the next agent on the same
    work dir lists them as re-adopted at its start, on /status and the page."""
    admin = dev_master.admin
    settings_ = agent_settings(tmp_path / "w", dev_master.base_url, dev_master.registration_token)
    with trio.fail_after(120):
        async with running_agent(nursery, settings_) as agent:
            task_id = await submit(admin, "ticker", {"main.py": SPIDER})
            await wait_for_log(admin, task_id, "tick 3", 30)
            agent.hand_over()  # (the agent stops within moments: /status rendered here, not over HTTP)
            assert agent.statistics().handed_over_ids == (task_id,)
            status = await AgentStatus(agent.statistics, agent.metrics, agent.outbox).status()
            assert status["handedOver"] == {"count": 1, "ids": [task_id]}
            assert ("handed over to the next agent", f"1: {task_id}") in node_history_rows(status)
        async with running_agent(nursery, settings_) as again:
            assert again.status_port is not None
            status = (await _get(again.status_port, "/status")).json()
            assert status["tasksAtStart"]["readopted"] == {"count": 1, "ids": [task_id]}
            assert status["handedOver"] == {"count": 0, "ids": []}
            assert f"<th>re-adopted at start</th><td>1: {html.escape(task_id)}</td>" in (
                await _get(again.status_port, "/")).text
            await admin.cancel_task(task_id)
            task = await admin.wait_task_final(task_id, 30)
            assert task["status"] == "CANCELLED"


def test_duration_and_ids_texts() -> None:
    rows = dict(node_history_rows({"startedAt": "2026-01-01T00:00:00.000Z", "uptimeSeconds": 90061.5,
                                   "tasksAtStart": {"readopted": {"count": 12, "ids": list(string.ascii_lowercase[:12])},
                                                    "notReadopted": {"count": 1, "tasks": [{"id": "x", "why": "gone"}]}}}))
    assert rows["up since"] == "2026-01-01T00:00:00.000Z UTC (1 d 1 h)"
    assert rows["re-adopted at start"] == "12: a, b, c, d, e, f, g, h, i, j (+2 more)"
    assert rows["not re-adopted (AGENT_LOST)"] == "1: x (gone)"
    assert dict(node_history_rows({"uptimeSeconds": 125}))["up since"] == "— UTC (2 min 5 s)"
    assert dict(node_history_rows({"uptimeSeconds": float("nan")}))["up since"] == "— UTC (—)"


@pytest.mark.slow
async def test_a_real_run_sh_rollback_is_on_the_page_of_the_agent_it_left_running(
        node: RunShNode, releases: Releases, pyz: Path, tmp_path: Path, dev_master: Any) -> None:
    """run.sh starts the agent (exporting CK_RUNSH_STATE_DIR), an upgrade to a release that never
    becomes healthy is rolled back: the agent running afterwards shows run.sh's record of it and the
    failed version, on /status and on the page."""
    releases.publish(pyz, ckagent.__version__)
    env = {"AGENT_RELEASE_URL": releases.url, "AGENT_UPGRADE_HEALTH_TIMEOUT": "5"}
    started = await node.sh("start", "--daemon=on", **env)
    assert started.returncode == 0, out(started)
    assert (await _get(node.port, "/status")).json()["upgrades"]["lastChangeUnknown"] == "none recorded"
    releases.publish(stand_in_release(tmp_path / "sick.pyz", "104.0.0"), "104.0.0")
    upgraded = await node.sh("upgrade", "104.0.0", **env)
    assert upgraded.returncode != 0 and "rolled back" in out(upgraded), out(upgraded)
    assert await node.healthz() == 200
    upgrades = (await _get(node.port, "/status")).json()["upgrades"]
    assert upgrades["stateDir"] == str(node.directory / ".ckagent")
    change = upgrades["lastChange"]
    assert {k: change[k] for k in ("action", "from", "to", "outcome")} == {
        "action": "upgrade", "from": ckagent.__version__, "to": "104.0.0", "outcome": "rolled-back"}, change
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.000Z", change["at"]) and change["reason"]
    assert upgrades["failedVersions"] == ["104.0.0"] == failed_versions(node)
    page = (await _get(node.port, "/")).text
    assert f"<th>last upgrade / rollback</th><td>upgrade {ckagent.__version__} → 104.0.0: rolled-back" in page
    assert "<th>failed versions</th><td>1: 104.0.0</td>" in page
    stopped = await node.sh("stop")
    assert stopped.returncode == 0, out(stopped)
