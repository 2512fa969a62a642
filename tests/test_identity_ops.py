"""The identity level (whom spiders run as: ckagent.node.identity) as an operator sees it: the start's
log line, ``/status``'s ``identity`` object, the status page, the ``ckagent_identity_level`` gauge, the
registration the master stores (``containment.spiderUser``, the dev master's ``identity``), the
notices of the levels where spiders share a uid with the agent or run as root, and ``ckagent exec``,
which runs the spider under the agent's identity rules and says whom as.
"""

from __future__ import annotations

import io
import logging
import os
import re
from pathlib import Path

import httpx
import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    RecordingMaster,
    agent_settings,
    no_strays,
    running_agent,
    spider_uid_env,
)

from ckagent.cli.localrun import ExecRequest, run_exec
from ckagent.node.configvalues import UidRange
from ckagent.node.identity import open_identities
from ckagent.node.levels import Blocker, IdentityLevel
from ckagent.node.state import StateStore

LEVELS = [level.value for level in IdentityLevel]


def _gauge(metrics: str, level: str) -> float:
    """The value of ``ckagent_identity_level{level="<level>"}`` in a Prometheus text exposition."""
    prefix = f'ckagent_identity_level{{level="{level}"}} '
    [line] = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(line[len(prefix):])


@pytest.mark.skipif(os.geteuid() != 0, reason="spider-uids needs a root agent")
async def test_the_default_level_is_shown_in_status_page_metrics_and_registration(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    work = tmp_path / "node"
    settings = agent_settings(work, recording_master.base_url, recording_master.registration_token)
    with trio.fail_after(60), caplog.at_level(logging.INFO, "ckagent.node.identity"):
        async with running_agent(nursery, settings) as agent:
            identities = agent.identities
            assert identities is not None and identities.level is IdentityLevel.SPIDER_UIDS
            assert identities.dedicated_builder is not None
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}", timeout=10) as client:
                status = (await client.get("/status")).json()
                page = (await client.get("/")).text
                metrics = (await client.get("/metrics")).text
            [node] = await recording_master.admin.list_nodes()
    starts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("identity: spider-uids — ")]
    assert len(starts) == 1, starts  # said once, at start
    identity = status["identity"]
    assert identity["level"] == "spider-uids" and identity["details"] == identities.details
    assert identity["builderUid"] == identities.dedicated_builder.uid
    assert identity["passedOver"] == [] and identity["spiders"] == 0 and identity["free"] > 0
    assert identity["uidRange"] == str(settings.task.spider_uids)
    assert (identity["name"], identity["uid"], identity["root"]) == ("ck-<uid>", None, False)  # older masters' fields
    assert not [w for w in status["warnings"] if w.startswith("spiders run as")]  # no notice at this level
    assert "<th>identity</th><td>spider-uids: each spider its own uid" in page
    assert _gauge(metrics, "spider-uids") == 1
    assert [_gauge(metrics, level) for level in LEVELS if level != "spider-uids"] == [0, 0, 0]
    registered = node["containment"]["spiderUser"]  # what the master stored of the registration
    assert registered["level"] == "spider-uids" and registered["builderUid"] == identity["builderUid"]
    assert node["identity"] == registered  # the dev master's admin listing shows it on its own


@pytest.mark.skipif(os.geteuid() != 0, reason="root is chosen by a root agent")
async def test_root_chosen_is_a_notice_in_status_and_on_the_page(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    work = tmp_path / "node"
    settings = agent_settings(work, recording_master.base_url, recording_master.registration_token,
                              AGENT_TASK_RUN_AS_USER="root")
    with trio.fail_after(60):
        async with running_agent(nursery, settings) as agent, httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{agent.status_port}", timeout=10) as client:
            status = (await client.get("/status")).json()
            page = (await client.get("/")).text
            metrics = (await client.get("/metrics")).text
    identity = status["identity"]
    assert (identity["level"], identity["uid"], identity["root"], identity["builderUid"]) == ("root", 0, True, None)
    assert [(p["level"], p["blocker"]) for p in identity["passedOver"]] == [("spider-uids", "run-as-user")]
    assert [w for w in status["warnings"] if w.startswith("spiders run as root: task.run_as_user is root")]
    assert "<th>identity</th><td>root: spiders as root</td>" in page and "<th>warning</th><td>spiders run as root" in page
    assert _gauge(metrics, "root") == 1 and _gauge(metrics, "spider-uids") == 0


def test_a_non_root_agent_says_spiders_share_its_uid(tmp_path: Path) -> None:
    """agent-user: the level, why spider-uids is not had and what would give it, and the notice (said
    once by the agent: ckagent.node.notices) — judged for an agent that is not root (``euid``)."""
    store = StateStore(tmp_path / "state.db")
    try:
        identities = open_identities(None, UidRange(3_210_001_000, 3_210_001_009), tmp_path / "work", store,
                                     python="/usr/bin/python3", sdk_dir=None, retention=0.0,
                                     dirs_of=lambda spider: (tmp_path / "d" / spider, tmp_path / "h" / spider),
                                     euid=4321)
    finally:
        store.close()
    assert identities.level is IdentityLevel.AGENT_USER and identities.as_root_notice() is None
    notice = identities.notice()
    assert notice is not None
    key, text = notice
    assert key == "spiders-as-agent" and text.startswith("spiders run as the agent's own user ")
    assert f"(uid {os.geteuid()}; identity agent-user)" in text  # this process's uid, as the agent's own
    assert Blocker.NOT_ROOT.remedy in text
    wire = identities.to_json()
    assert wire["level"] == "agent-user" and wire["builderUid"] is None
    assert wire["passedOver"] == [{"level": "spider-uids", "blocker": "not-root",
                                   "message": "the agent runs as uid 4321, not root", "remedy": Blocker.NOT_ROOT.remedy}]


WHOAMI = "import os\nprint('whoami', os.getuid(), os.getgid(), os.getgroups(), flush=True)\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="spiders get uids of their own only from a root agent")
async def test_exec_runs_the_spider_under_the_agents_identity_rules_and_says_whom_as(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith(("AGENT_", "CK_"))]:
        monkeypatch.delenv(key)
    work = tmp_path / "w"
    for key, value in spider_uid_env(work).items():  # the interpreter every uid can run (the suite's is root's)
        monkeypatch.setenv(key, value)
    spider = tmp_path / "whoami"
    spider.mkdir()
    (spider / "main.py").write_text(WHOAMI)
    request = ExecRequest(source=spider, items=tmp_path / "items.jsonl", work_dir=work,
                          artifacts=tmp_path / "artifacts")
    out, err = io.StringIO(), io.StringIO()
    with trio.fail_after(180):
        assert await run_exec(request, out, err) == 0, err.getvalue()[-3000:]
    header = re.search(r"^\[ckagent exec\] the spider runs as ck-(\d+) \(uid (\d+), gid (\d+); identity "
                       r"spider-uids\): each spider its own uid and gid from task.spider_uids ", err.getvalue(), re.M)
    assert header is not None, err.getvalue()[-3000:]
    uid = int(header[1])
    assert int(header[2]) == int(header[3]) == uid and 61184 <= uid <= 65519
    assert f"whoami {uid} {uid} []" in out.getvalue(), out.getvalue()[-3000:]  # what the spider itself saw
    assert "[ckagent exec] note:" not in err.getvalue()
    monkeypatch.setenv("AGENT_TASK_RUN_AS_USER", "root")  # root, an explicit choice: said, with why it matters
    out, err = io.StringIO(), io.StringIO()
    with trio.fail_after(180):
        assert await run_exec(request, out, err) == 0, err.getvalue()[-3000:]
    said = err.getvalue()
    assert "[ckagent exec] the spider runs as root (uid 0; identity root): spiders as root\n" in said, said[-3000:]
    assert "[ckagent exec] note: spiders run as root: task.run_as_user is root" in said
    assert "whoami 0 0 " in out.getvalue()
