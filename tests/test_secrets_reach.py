"""Secrets out of a spider's reach: a real agent process started with its token in the environment,
and a real spider (running as root when the suite does — ``task.run_as_user: root``, the worst case: it
reads every process's environ; else as the agent's own user)
that looks for it in every process's initial environment it can read and prints a secret of its own
transformed (reversed, base64, hex, URL-encoded).

The agent's own initial environment is read from ``/proc/<pid>/environ`` as root; as a plain user that
file of the non-dumpable agent is root's, and :class:`harness.EnvironProbe` records the same bytes when
the agent's Python image starts."""

from __future__ import annotations

import base64
import os
import urllib.parse
from pathlib import Path
from typing import Any

import trio
from harness import AgentProcess, EnvironProbe, submit

from ckagent.node.config import SETTINGS
from ckagent.node.logs import Masker, secret_variants
from ckagent.node.secretenv import SECRET_ENV

LOOK = r"""
import base64, os, sys, urllib.parse
token = os.environ["LOOK_FOR"][::-1]  # the test hands it reversed, so that this env holds no copy of it
holders = []
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if token.encode() in f.read():
                holders.append(pid)
    except OSError:
        pass
print("holders:", len(holders), holders, "agent pid", os.environ["AGENT_PID"])
secret = os.environ["DB_PASSWORD"]
print("reversed", secret[::-1])
print("base64", base64.b64encode((secret + "\n").encode()).decode())
print("hex", secret.encode().hex())
print("url", urllib.parse.quote("q=" + secret + "&x"))
"""

DB_PASSWORD = "s3cr3t/pass word+42"


def test_secret_env_names_match_the_settings() -> None:
    # AGENT_API_KEY is no longer a setting (the config reports it ignored), but it stays out of spiders' reach.
    assert set(SECRET_ENV) == {s.env for s in SETTINGS if s.secret} | {"AGENT_API_KEY"}


def test_masking_catches_the_simple_transforms_and_leaves_short_secrets_alone() -> None:
    masker = Masker(["token-0123456789abcdef"])
    secret = "token-0123456789abcdef"
    for shown in (secret[::-1], base64.b64encode(secret.encode() + b"\n").decode(), secret.encode().hex().upper(),
                  base64.urlsafe_b64encode(secret.encode()).decode(), urllib.parse.quote_plus("a " + secret)):
        assert secret[:6] not in masker(shown) or "***" in masker(shown)
        assert "***" in masker(f"x {shown} y"), shown
    assert secret_variants("short") == ["short"]
    assert masker("nothing secret here") == "nothing secret here"


async def test_no_process_environment_shows_the_token_and_transforms_are_masked(dev_master: Any, tmp_path: Path) -> None:
    token = dev_master.registration_token
    (tmp_path / "a").mkdir()
    worst = {"task__run_as_user": "root"} if os.geteuid() == 0 else {}  # a root spider reads every environ
    agent = AgentProcess(tmp_path / "a", dev_master.base_url, token, agent__registration_token=None, **worst)
    probe = EnvironProbe(tmp_path / "probe")
    await agent.start(extra_env={"AGENT_REGISTRATION_TOKEN": token, **probe.env})
    try:
        assert agent.process is not None
        pid = agent.process.pid
        with trio.fail_after(120):
            task_id = await submit(dev_master.admin, "looker", {"main.py": LOOK},
                                   env={"LOOK_FOR": token[::-1], "AGENT_PID": str(pid), "DB_PASSWORD": DB_PASSWORD})
            task = await dev_master.admin.wait_task_final(task_id, 100)
        assert task["status"] == "SUCCESS", (task, agent.log_text()[-3000:])
        text = "\n".join(await dev_master.admin.get_logs(task_id))
        assert "holders: 0 []" in text, text
        environ = probe.initial_environ(pid)
        assert token.encode() not in environ
        assert token.encode() in probe.images(pid)[0], "started with the token: the agent moved it out itself"
        assert b"CKAGENT_SECRETS_FD=" in environ
        for shown in (DB_PASSWORD[::-1], base64.b64encode(DB_PASSWORD.encode()).decode()[:24],
                      DB_PASSWORD.encode().hex(), urllib.parse.quote(DB_PASSWORD)):
            assert shown not in text, (shown, text)
        assert text.count("***") >= 4, text
        assert ("spiders run as root" in agent.log_text()) == (os.geteuid() == 0), agent.log_text()[-3000:]
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await agent.kill()
