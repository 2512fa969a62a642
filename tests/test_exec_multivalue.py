"""``ckagent exec … --env A=1 B=2`` gives two variables and ``--param`` takes several values too, in
every order the command line allows (one option per value, several values per option, the PATH before,
between or after them); the running line shows the command the spider ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from ckagent.cli import main
from ckagent.cli.localrun import ExecRequest


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[ExecRequest]:
    """What the command line hands to exec (the parsing only: the run itself is the e2e test below)."""
    seen: list[ExecRequest] = []

    def capture(request: ExecRequest) -> int:
        seen.append(request)
        return 0

    monkeypatch.setattr("ckagent.cli.localrun.exec_main", capture)
    return seen


@pytest.mark.parametrize("words", [
    "exec D --env A=1 B=2 --param n=3 tag=x",
    "exec --env A=1 B=2 --param n=3 tag=x D",
    "exec --env A=1 B=2 D --param n=3 tag=x",
    "exec D --env A=1 --env B=2 --param n=3 --param tag=x",
    "exec --env A=1 --param n=3 tag=x --env B=2 D",
    "exec --env=A=1 B=2 --param=n=3 tag=x -- D",
    "exec --param n=3 tag=x --env A=1 B=2 --spider s D",
])
def test_env_and_param_take_several_values_in_any_order(words: str, requests: list[ExecRequest],
                                                         tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["exec", "--work-dir", str(tmp_path / "w"), *words.replace(" D", f" {tmp_path}").split()[1:]])
    assert exited.value.code == 0
    (request,) = requests
    assert request.source == tmp_path
    assert request.env == {"A": "1", "B": "2"}
    assert request.params == {"n": 3, "tag": "x"}
    assert request.spider == ("s" if "--spider" in words else None)


@pytest.mark.parametrize(("words", "message"), [
    ("exec D --env A=1 B", "--env 'B': expected NAME=VALUE"),
    ("exec --env A=1 B=2", "PATH is missing"),
    ("exec --env A=1 X --param n=1 Y", "PATH is missing"),
])
def test_what_is_not_name_value_is_refused_naming_it(words: str, message: str, requests: list[ExecRequest],
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(words.replace(" D", f" {tmp_path}").split())
    assert exited.value.code == 2 and not requests
    assert message in capsys.readouterr().err


SPIDER = """\
import json, os, sys
print('env', os.environ.get('A'), os.environ.get('B'), 'params', os.environ['CK_PARAMS'], flush=True)
"""


async def test_a_real_exec_gets_every_variable_and_param(tmp_path: Path) -> None:
    spider = tmp_path / "multi"
    spider.mkdir()
    (spider / "main.py").write_text(SPIDER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    argv = [sys.executable, "-m", "ckagent", "exec", "--env", "A=1", "B=two words", "--param", "n=3", "tag=x",
            str(spider), "--work-dir", str(tmp_path / "w"), "--items", str(tmp_path / "items.jsonl"),
            "--args=--api-key k3y-k3y-k3y --pages 2"]
    with trio.fail_after(240):
        done = await trio.to_thread.run_sync(lambda: subprocess.run(
            argv, capture_output=True, text=True, timeout=230, check=False, env=env, cwd=tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(text for text in done.stdout.splitlines() if text.startswith("env "))
    _, a, b1, b2, _, params = line.split(" ", 5)
    assert (a, f"{b1} {b2}", json.loads(params)) == ("1", "two words", {"n": 3, "tag": "x"})
    running = next(text for text in done.stdout.splitlines() if "] running " in text)
    shown = running.split("] running ", 1)[1]
    assert "main.py --api-key '***' --pages 2 (timeout" in shown, running
    assert "k3y-k3y-k3y" not in done.stdout
