"""The sdk/examples spiders, run once per session on each path (``ckagent exec``, an agent), and the README's exec recipe."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import trio
import yaml

import ckagent
from ckagent.containment.process import find_marked
from ckagent.devmaster.client import zip_directory
from harness.core import agent_settings, running_agent
from harness.identities import spider_uid_env


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


#
# Each sdk/examples spider runs once per session on each path, and every test that asserts on that
# run reads the same one.
#
# Several test files ask the same example the same question on one path: the README's exec recipe runs
# every example with ``ckagent exec`` (tests/test_readme_exec.py), tests/test_exec.py runs seven of
# them with ``ckagent exec`` and through an agent and compares the two, tests/test_outputs_examples.py
# does the same for the two that deliver files, and tests/test_frameworks.py runs four through an
# agent. A real run costs seconds to a minute (an interpreter, a master, an agent, an install, a
# browser), so the session fixture ``example_runs`` (conftest.py) keeps what each run gave:
#
# - :meth:`ExampleRuns.exec` runs ``ckagent exec <words>`` as a real subprocess, the words exactly as
#   written after ``ckagent exec`` (``$URL`` for the demo site's address, as in the README's recipe),
#   plus only where the items, the artifacts and the work dir go. The same words give the same run:
#   the README line of an example and a test that asks for that line share it. Every exec run of the
#   session shares one work dir, as a user's runs share ``~/.cache/ckagent/exec``.
# - :meth:`ExampleRuns.agent` uploads the example to the test's dev master as a spider (framework,
#   name, outputs) and runs one task (params) on a fresh in-process agent; it keeps the final task,
#   its items, log lines, artifacts, the node's runtimes and the task's leftover processes. Its
#   work dir's ``envs/`` is the exec runs' (content-addressed: the same key is the same environment),
#   so each example's dependencies are installed once in the session, by whichever path runs it
#   first — the node's pipeline either way (crawlee's npm install alone is ~13 s of CPU). The key
#   holds the builder's uid: as root both paths run at spider-uids, and a fresh work dir's builder
#   takes the lowest free uid of the range, so they share — unless another test's process held that
#   uid at the start (a parallel suite), when that example is installed once more.
#
# A run crawls the demo site of the dev master of the test that made it; :meth:`ExecRun.at` and
# :meth:`AgentRun.at` give the run as the demo site at another address would have given it (the
# demo site is the same everywhere; only its address is in the items and the log). The fixture is
# per process: under pytest-xdist, SERIAL_GROUPS (conftest.py) keeps the files that share runs in
# one worker, so each run happens once in the session (a test that finds no run makes it).

REPO = Path(ckagent.__file__).resolve().parent.parent
EXAMPLES = REPO / "sdk" / "examples"
RUN_TIMEOUT = 900.0
"""Seconds for one run, cold caches included (an npm install of crawlee, Playwright's ~40 MB)."""


@dataclass(frozen=True)
class RecipeLine:
    """One line of the README's exec recipe: the example, the words after ``ckagent exec`` (``$URL``
    as written) and the exit code its comment promises (``exit N``, else 0)."""

    example: str
    words: tuple[str, ...]
    expected: int


def recipe() -> list[RecipeLine]:
    """The README's exec recipe (between its ``exec-recipe`` markers), line by line."""
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- exec-recipe:start -->", 1)[1].split("<!-- exec-recipe:end -->", 1)[0]
    lines = []
    for line in block.splitlines():
        if not line.startswith(".venv/bin/ckagent exec "):
            continue
        comment = line.split("#", 1)[1] if "#" in line else ""
        words = tuple(shlex.split(line, comments=True)[2:])
        expected = int(m.group(1)) if (m := re.search(r"exit (\d+)", comment)) else 0
        source = Path(words[0])  # an example's folder, or a file in it (scrapyd_shop/scrapyd_shop.egg)
        example = source.relative_to("sdk/examples").parts[0] if source.is_relative_to("sdk/examples") else source.name
        lines.append(RecipeLine(example, words, expected))
    return lines


def recipe_words(example: str) -> tuple[str, ...]:
    """The README's words for ``example`` (KeyError if the recipe has no line for it)."""
    return {line.example: line.words for line in recipe()}[example]


def _relocated(value: Any, old: str, new: str) -> Any:
    return value if old == new else json.loads(json.dumps(value).replace(old, new))


@dataclass(frozen=True)
class ExecRun:
    """What one ``ckagent exec`` run gave: its exit code, stdout (the task's log) and stderr (the
    summary) as text, the items it wrote, the files it wrote to its artifacts folder (relative paths
    → bytes) and the base URL of the dev master whose demo site it crawled."""

    words: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    items: list[dict[str, Any]]
    artifacts: dict[str, bytes]
    base_url: str

    def at(self, base_url: str) -> ExecRun:
        """The run as if it had crawled the demo site at ``base_url``."""
        old = self.base_url
        return replace(self, stdout=self.stdout.replace(old, base_url), stderr=self.stderr.replace(old, base_url),
                       items=_relocated(self.items, old, base_url), base_url=base_url)


@dataclass(frozen=True)
class AgentRun:
    """What one task through the dev master and an agent gave: the final task record, its items and
    log lines as the master holds them, its artifacts' paths, the node's runtimes (as its heartbeat
    reported them), the task's processes left after it ended (ckagent.containment.process.find_marked)
    and the base URL of the dev master."""

    task: dict[str, Any]
    items: list[dict[str, Any]]
    logs: list[str]
    artifacts: list[str]
    runtimes: dict[str, Any]
    leftovers: list[Any]
    base_url: str

    def at(self, base_url: str) -> AgentRun:
        """The run as if it had gone through (and crawled) the dev master at ``base_url``."""
        old = self.base_url
        return replace(self, task=_relocated(self.task, old, base_url), items=_relocated(self.items, old, base_url),
                       logs=_relocated(self.logs, old, base_url), base_url=base_url)


def exec_env(shared: Path | None = None, work_dir: Path | None = None) -> dict[str, str]:
    """The environment of an exec run: this one without the agent's and the suite's settings, at the
    ``proxy`` egress level — the level a non-root node or a pod gets, forced here so every example
    crawls through the agent's forward proxy on every machine (the agent runs are at the node's best
    level: the tests comparing the two paths compare the levels too). ``shared``: a directory the
    spiders still see in their private /tmp (the session's runs share environments: their scripts
    name the work dir of the run that built them). ``work_dir``: the exec runs' work dir, made
    reachable so that, as root, each spider runs under a uid of its own as on a node (the default
    identity level: harness.identities.spider_uid_env)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    if work_dir is not None:
        env.update(spider_uid_env(work_dir))
    env["AGENT_UV_SYNC_TIMEOUT"] = "600"
    env["AGENT_TASK_EGRESS"] = "proxy"
    if shared is not None:
        env["AGENT_TASK_PRIVATE_TMP_SHARED"] = str(shared)
    return env


class ExampleRuns:
    """The session's runs (see the module docstring); ``root`` holds their files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._exec: dict[tuple[str, ...], ExecRun] = {}
        self._agent: dict[str, AgentRun] = {}
        self.made = {"exec": 0, "agent": 0}
        """How many runs this session made on each path (the rest were read)."""

    async def exec(self, words: Sequence[str], base_url: str) -> ExecRun:
        """``ckagent exec`` with ``words`` (``$URL`` → the demo site of ``base_url``), run once; the
        run as at ``base_url``."""
        key = tuple(words)
        run = self._exec.get(key)
        if run is None:
            run = await self._run_exec(key, base_url)
            self._exec[key] = run
            self.made["exec"] += 1
        return run.at(base_url)

    async def _run_exec(self, words: tuple[str, ...], base_url: str) -> ExecRun:
        n = len(self._exec)
        items, artifacts = self.root / f"exec-{n}.items.jsonl", self.root / f"exec-{n}.artifacts"
        url = f"{base_url}/demo-site/"
        source = words[0] if Path(words[0]).is_absolute() else str(REPO / words[0])
        argv = [sys.executable, "-m", "ckagent", "exec", source, *[w.replace("$URL", url) for w in words[1:]],
                "--items", str(items), "--artifacts", str(artifacts), "--work-dir", str(self.root / "exec-work")]
        done = await trio.to_thread.run_sync(lambda: subprocess.run(
            argv, capture_output=True, env=exec_env(self.root, self.root / "exec-work"), timeout=RUN_TIMEOUT,
            check=False, cwd=self.root))
        got = [json.loads(line) for line in items.read_text("utf-8").splitlines()] if items.exists() else []
        written = ({str(p.relative_to(artifacts)): p.read_bytes() for p in sorted(artifacts.rglob("*")) if p.is_file()}
                   if artifacts.exists() else {})
        return ExecRun(words, done.returncode, done.stdout.decode("utf-8", "replace"),
                       done.stderr.decode("utf-8", "replace"), got, written, base_url)

    async def agent(self, dev_master: Any, nursery: trio.Nursery, example: str, framework: str, *,
                    name: str | None = None, outputs: dict[str, Any] | None = None,
                    params: dict[str, Any] | None = None) -> AgentRun:
        """sdk/examples/``example`` as the spider ``name`` (default the example's) of ``framework``
        with ``outputs``, one task with ``params`` and ``start_url`` = the demo site, on a fresh agent
        against ``dev_master`` — run once; the run as at ``dev_master``."""
        key = json.dumps([example, framework, name, outputs, params], sort_keys=True)
        run = self._agent.get(key)
        if run is None:
            run = await self._run_agent(dev_master, nursery, example, framework, name, outputs, params)
            self._agent[key] = run
            self.made["agent"] += 1
        return run.at(dev_master.base_url)

    async def _run_agent(self, dev_master: Any, nursery: trio.Nursery, example: str, framework: str,
                         name: str | None, outputs: dict[str, Any] | None, params: dict[str, Any] | None) -> AgentRun:
        admin = dev_master.admin
        spider_id = await admin.create_spider(name=name or example, framework=framework, outputs=outputs)
        await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / example))
        work_dir = self.root / f"agent-{len(self._agent)}"
        shared_envs = self.root / "exec-work" / "envs"  # where the exec runs keep theirs (module comment)
        shared_envs.mkdir(parents=True, exist_ok=True)
        work_dir.mkdir(parents=True)
        (work_dir / "envs").symlink_to(shared_envs, target_is_directory=True)
        settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                                  AGENT_UV_SYNC_TIMEOUT="600")
        async with running_agent(nursery, settings):
            task_id = await admin.create_task(
                spider_id, params={"start_url": f"{dev_master.base_url}/demo-site/", **(params or {})})
            with trio.fail_after(RUN_TIMEOUT):
                task = await admin.wait_task_final(task_id, RUN_TIMEOUT)
            # The runtime scan runs in the background at start and reaches the master with a heartbeat.
            for _ in range(100):
                nodes = await admin.list_nodes()
                if "python" in nodes[0]["runtimes"]:
                    break
                await trio.sleep(0.1)
        leftovers = await trio.to_thread.run_sync(find_marked, task_id)
        return AgentRun(task, await admin.get_items(task_id), await admin.get_logs(task_id),
                        [a["path"] for a in await admin.list_artifacts(task_id)], nodes[0]["runtimes"],
                        leftovers, dev_master.base_url)
