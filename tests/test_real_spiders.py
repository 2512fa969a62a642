"""Spiders as their authors wrote them (issue 15): private working copies, per-spider data and home,
content-addressed shared environments with sync semantics, packages as people zip them, failure
messages a person can act on.

Fast tests use a local package index on 127.0.0.1 (no internet): hand-made wheels ``ckdemo-dep``
1.0 and 2.0 and ``ckdemo-extra`` 1.0 — and no ``crawlerkeeper-sdk``, like the mirrors nodes use.
The examples shaped like public projects (sdk/examples) run in tests/test_public_examples.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, package_index, running_agent, spider_zip

import ckagent
from ckagent.code.deps import (
    Dependencies,
    DepsError,
    IndexChooser,
    bundled_sdk_dir,
    python_plan,
    spider_base_env,
)
from ckagent.code.envstore import MARKER, collect, mark_ready
from ckagent.code.scrapyhook import scrapy_hook
from ckagent.code.workcopy import make_working_copy
from ckagent.code.workspace import DeployError
from ckagent.containment.tails import TailBuffer, last_lines
from ckagent.master.protocol import Task
from ckagent.task.commands import resolve_command, runs_in_env

REPO = Path(ckagent.__file__).resolve().parent.parent
SDK_VERSION = "0.1.0"


@pytest.fixture(scope="module")
def index_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A simple index on 127.0.0.1: ckdemo-dep 1.0 and 2.0, ckdemo-extra 1.0."""
    packages = [("ckdemo_dep", "1.0", "VALUE = 1\n"), ("ckdemo_dep", "2.0", "VALUE = 2\n"),
                ("ckdemo_extra", "1.0", "EXTRA = True\n")]
    with package_index(tmp_path_factory.mktemp("index2"), packages) as index:
        yield index.url


def _deps(tmp_path: Path, index: str, **kwargs: Any) -> Dependencies:
    options: dict[str, Any] = {"uv_path": None, "index": IndexChooser(index, index),
                               "uv_cache_dir": tmp_path / "uv-cache", "timeout": 120.0, "base_env": spider_base_env()}
    options.update(kwargs)
    return Dependencies(tmp_path / "envs", **options)


def _code(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


async def _python_says(prepared: Any, code: str) -> str:
    python = Path(prepared.path_prefix[0]) / "python"
    proc = await trio.run_process([str(python), "-c", code], capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode().strip()


VERSIONS = ("import importlib.util as u, ckdemo_dep; "
            "print(ckdemo_dep.VALUE, u.find_spec('ckdemo_extra') is not None)")


# --------------------------------------------------------------------------- environments


async def test_relaxed_pin_and_removed_package_take_effect_and_projects_share(tmp_path: Path, index_url: str) -> None:
    deps = _deps(tmp_path, index_url)
    v1 = {"requirements.txt": "ckdemo-dep<2\nckdemo-extra\n", "main.py": ""}
    with trio.fail_after(180):
        first = await deps.prepare("python", "spider-a", _code(tmp_path / "a1", v1), lambda _: None)
        assert await _python_says(first, VERSIONS) == "1 True"
        # Another spider of the same project (same dependency files): the same environment, nothing runs.
        other = await deps.prepare("scrapy", "spider-b", _code(tmp_path / "b1", v1), lambda _: None)
        assert other.cache_hit and other.env_dir == first.env_dir
        # The pin relaxed and a package removed: the next task gets exactly that.
        v2 = {"requirements.txt": "ckdemo-dep\n", "main.py": ""}
        second = await deps.prepare("python", "spider-a", _code(tmp_path / "a2", v2), lambda _: None)
    assert not second.cache_hit and second.env_dir != first.env_dir
    assert await _python_says(second, VERSIONS) == "2 False"
    # The old environment is still there for spider-b (in use), and still exact.
    assert await _python_says(first, VERSIONS) == "1 True"


async def test_interpreter_and_identity_change_build_new_environments(tmp_path: Path, index_url: str) -> None:
    other_python = tmp_path / "py2"
    await trio.run_process([sys.executable, "-m", "venv", "--without-pip", "--copies", str(other_python)])
    code = _code(tmp_path / "c", {"requirements.txt": "ckdemo-dep==1.0\n"})
    log = bytearray()
    with trio.fail_after(180):
        first = await _deps(tmp_path, index_url).prepare("python", "s", code, log.extend)
        again = await _deps(tmp_path, index_url).prepare("python", "s", code, log.extend)
        moved = await _deps(tmp_path, index_url, python=str(other_python / "bin" / "python")).prepare(
            "python", "s", code, log.extend)
    assert again.cache_hit and again.env_dir == first.env_dir
    assert not moved.cache_hit and moved.env_dir != first.env_dir
    assert await _python_says(moved, VERSIONS) == "1 False"
    # The identity (task.run_as_user) is part of the key too: same files, another user, another env.
    interpreter = {"path": sys.executable, "realpath": "/usr/bin/python3.x", "version": "3"}
    as_agent = python_plan(code, "python", interpreter, "agent", "sdk")
    as_user = python_plan(code, "python", interpreter, "uid=1000,gid=1000", "sdk")
    assert as_agent.key != as_user.key and as_agent.mode == as_user.mode == "requirements"


async def test_sdk_requirement_is_served_by_the_bundled_copy(tmp_path: Path, index_url: str) -> None:
    # The index has no crawlerkeeper-sdk (like PyPI mirrors): the requirement must not reach it.
    deps = _deps(tmp_path, index_url)
    check = "import crawlerkeeper_sdk as ck, ckdemo_dep; print(ck.__version__, ck.__file__)"
    requirements = {"requirements.txt": "crawlerkeeper-sdk>=0.1,<1\nckdemo-dep==1.0\n", "main.py": ""}
    pyproject = {"pyproject.toml": '[project]\nname = "p"\nversion = "1"\n'
                                   'dependencies = ["ckdemo-dep==1.0", "crawlerkeeper-sdk>=0.1"]\n'}
    with trio.fail_after(180):
        for files in (requirements, pyproject):
            prepared = await deps.prepare("python", "s", _code(tmp_path / str(len(files)), files), lambda _: None)
            version, where = (await _python_says(prepared, check)).split(" ", 1)
            assert version == SDK_VERSION and "site-packages" in where
    plain = await deps.prepare("python", "p", _code(tmp_path / "plain", {"main.py": ""}), lambda _: None)
    version, where = (await _python_says(plain, "import crawlerkeeper_sdk as ck; print(ck.__version__, ck.__file__)")
                      ).split(" ", 1)
    assert version == SDK_VERSION and Path(where).is_relative_to(bundled_sdk_dir() or Path("/nowhere"))


async def test_migrate_spiders_output_deploys(tmp_path: Path, index_url: str) -> None:
    project = _code(tmp_path / "legacy", {
        "main.py": "from vendor.crawlerkeeper_sdk import save_item\nsave_item({'a': 1})\n",
        "vendor/__init__.py": "",
        "vendor/crawlerkeeper_sdk.py": "import os\nCK_ITEMS_FILE = 'CK_ITEMS_FILE'\ndef save_item(item):\n    pass\n",
        "requirements.txt": "ckdemo-dep==1.0\n",
    })
    script = REPO / "sdk" / "python" / "migrate_spiders.py"
    done = await trio.run_process([sys.executable, str(script), str(project)], capture_stdout=True,
                                  capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert "crawlerkeeper-sdk" in (project / "requirements.txt").read_text()
    with trio.fail_after(180):
        prepared = await _deps(tmp_path, index_url).prepare("python", "legacy", project, lambda _: None)
    env = {**spider_base_env(prepared.path_prefix), "CK_ITEMS_FILE": str(tmp_path / "items.jsonl")}
    run = await trio.run_process([str(Path(prepared.path_prefix[0]) / "python"), "main.py"], cwd=project, env=env,
                                 capture_stderr=True, check=False)
    assert run.returncode == 0, run.stderr.decode()
    assert json.loads((tmp_path / "items.jsonl").read_text()) == {"a": 1}


async def test_uv_lock_installs_exactly_the_locked_versions(tmp_path: Path, index_url: str) -> None:
    code = _code(tmp_path / "locked", {"pyproject.toml": '[project]\nname = "locked"\nversion = "1"\n'
                                                         'requires-python = ">=3.10"\n'
                                                         'dependencies = ["ckdemo-dep"]\n'})
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv is not None
    # Lock against the index while only 1.0 is acceptable, then relax the pin without re-locking:
    # the lock (1.0) is what gets installed, not the newest the index has (2.0).
    (code / "pyproject.toml").write_text((code / "pyproject.toml").read_text().replace('"ckdemo-dep"', '"ckdemo-dep<2"'))
    env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "uv-cache"), "UV_PYTHON_DOWNLOADS": "never"}
    await trio.run_process([uv, "lock", "--quiet", "--index-url", index_url, "--python", sys.executable], cwd=code,
                           env=env)
    (code / "pyproject.toml").write_text((code / "pyproject.toml").read_text().replace('"ckdemo-dep<2"', '"ckdemo-dep"'))
    log = bytearray()
    with trio.fail_after(180):
        prepared = await _deps(tmp_path, index_url).prepare("python", "locked", code, log.extend)
    assert b"uv export" in log and b"uv pip sync" in log
    assert await _python_says(prepared, VERSIONS) == "1 False"


def test_collection_keeps_the_budget_least_recently_used_first(tmp_path: Path) -> None:
    root = tmp_path / "envs"
    sizes = {}
    for n, name in enumerate(("py-old", "py-mid", "py-new", "py-busy")):
        env = root / name
        env.mkdir(parents=True)
        (env / "blob").write_bytes(b"x" * 40000)
        owner = (0, 0) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
        sizes[name] = mark_ready(env, name, "py", owner=owner, builder="tests")
        os.utime(env / MARKER, (1000 + n, 1000 + n))
    os.utime(root / "py-busy" / MARKER, (1, 1))  # the oldest, but in use
    (root / "py-broken").mkdir()  # a build that never finished, long ago
    os.utime(root / "py-broken", (1, 1))
    (root / "py-building").mkdir()  # a build going on now (no marker yet): left alone
    budget = sizes["py-new"] + sizes["py-busy"] + 10
    asked: list[str] = []

    def busy(path: Path) -> bool:
        asked.append(path.name)
        return path.name == "py-busy"

    removed = collect(root, budget, busy)
    assert sorted(p.name for p in removed) == ["py-broken", "py-mid", "py-old"]
    assert sorted(p.name for p in root.iterdir()) == ["py-building", "py-busy", "py-new"]
    assert "py-busy" in asked  # asked right before removal, not from a snapshot


# --------------------------------------------------------------------------- working copies, packages


def test_working_copy_is_never_hard_links(tmp_path: Path) -> None:
    src = _code(tmp_path / "version", {"config.json": '{"seen": []}', "pkg/mod.py": "X = 1\n"})
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    stats = make_working_copy(src, tmp_path / "copy")
    assert stats.cloned + stats.copied == 3
    for rel in ("config.json", "pkg/mod.py", "run.sh"):
        a, b = (src / rel).stat(), (tmp_path / "copy" / rel).stat()
        assert a.st_ino != b.st_ino and b.st_nlink == 1 and a.st_mode == b.st_mode
    with open(tmp_path / "copy" / "config.json", "r+b") as fh:  # rewritten in place, as root might
        fh.write(b'{"seen": [1]}')
    assert (src / "config.json").read_text() == '{"seen": []}'


def _task(framework: str, **extra: Any) -> Task:
    return Task.from_json({"id": "t1", "spiderId": "s1", "spiderName": "products", "framework": framework,
                           "codeVersion": "v1", **extra})


def test_deploy_failed_names_a_marker_one_folder_down(tmp_path: Path) -> None:
    """A zip of the repository root: the project (scrapy.cfg, package.json) is one folder down."""
    repo = _code(tmp_path / "repo", {"README.md": "", "bookscraper/scrapy.cfg": "", "bookscraper/books/x.py": ""})
    with pytest.raises(DeployError) as caught:
        resolve_command(_task("scrapy"), repo)
    assert "Found bookscraper/scrapy.cfg one folder down" in str(caught.value)
    assert "zip that folder's contents" in str(caught.value)
    node = _code(tmp_path / "node", {"crawler/package.json": "{}"})
    with pytest.raises(DeployError, match=r"Found crawler/package\.json one folder down"):
        resolve_command(_task("node"), node)
    plain = _code(tmp_path / "plain", {"README.md": "", "docs/index.md": ""})
    with pytest.raises(DeployError) as caught:
        resolve_command(_task("scrapy"), plain)
    assert "one folder down" not in str(caught.value)


def test_missing_framework_files_name_what_and_where(tmp_path: Path) -> None:
    code = _code(tmp_path / "code", {"readme.md": "", "shop/settings.py": ""})
    with pytest.raises(DeployError, match=r"scrapy\.cfg is missing.*looked in the package root \(readme.md, shop/\)"):
        resolve_command(_task("scrapy"), code)
    with pytest.raises(DeployError, match=r"main\.py is missing.*looked in the package root"):
        resolve_command(_task("selenium"), code)
    with pytest.raises(DeployError, match=r"scripts\.start.*main.*index\.js"):
        resolve_command(_task("node"), code)
    # A command of its own is the author's business.
    assert resolve_command(_task("scrapy", command="python run.py"), code) == (["python", "run.py"], None)


def test_node_default_command_follows_package_json(tmp_path: Path) -> None:
    start = _code(tmp_path / "a", {"package.json": json.dumps({"scripts": {"start": "node src/main.js"}})})
    assert resolve_command(_task("node", args=["--x"]), start)[0] == ["npm", "start", "--silent", "--", "--x"]
    main = _code(tmp_path / "b", {"package.json": json.dumps({"main": "lib/crawl.js"}), "lib/crawl.js": ""})
    assert resolve_command(_task("node"), main)[0] == ["node", "lib/crawl.js"]
    plain = _code(tmp_path / "c", {"package.json": "{}", "index.js": ""})
    assert resolve_command(_task("node"), plain)[0] == ["node", "index.js"]


def test_scrapy_hook_asks_for_items_unless_the_project_uses_the_sdk(tmp_path: Path) -> None:
    plain = _code(tmp_path / "plain", {"scrapy.cfg": "", "shop/settings.py": "ITEM_PIPELINES = {}\n"})
    assert scrapy_hook("scrapy", ["scrapy", "crawl", "x"], os.environ.get("PATH"), plain, None) == (
        {"CK_SCRAPY_HOOK": "items,stats,state"}, None)
    with_sdk = _code(tmp_path / "sdk", {"scrapy.cfg": "", "shop/settings.py":
                                        'ITEM_PIPELINES = {"crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300}\n'})
    assert scrapy_hook("scrapy", ["scrapy", "crawl", "x"], None, with_sdk, None)[0] == {"CK_SCRAPY_HOOK": "stats,state"}


def test_scrapy_hook_says_plainly_when_it_cannot_attach(tmp_path: Path) -> None:
    """A foreign interpreter gets no hook: the log says items will not be collected, and how to."""
    env_dir = tmp_path / "envs" / "py-abc"
    own = tmp_path / "own-venv"
    for bin_dir in (env_dir / "bin", own / "bin"):
        bin_dir.mkdir(parents=True)
        for name in ("scrapy", "python"):
            (bin_dir / name).write_text("#!/bin/sh\n")
            (bin_dir / name).chmod(0o755)
    code = _code(tmp_path / "code", {"scrapy.cfg": ""})
    path = os.pathsep.join([str(env_dir / "bin"), os.environ.get("PATH", "")])
    for argv in (["scrapy", "crawl", "x"], ["sh", "-c", "python setup.py && scrapy crawl x"],
                 ["python", "-m", "scrapy", "crawl", "x"], ["env", "scrapy", "crawl", "x"]):
        assert scrapy_hook("scrapy", argv, path, code, env_dir)[1] is None, argv
    note = scrapy_hook("scrapy", [str(own / "bin" / "scrapy"), "crawl", "x"], path, code, env_dir)[1]
    assert note is not None and "will not be collected" in note and "outputs.items" in note
    assert '-o "$CK_ITEMS_FILE:jsonlines"' in note and "crawlerkeeper_sdk.save_item" in note
    # The shell finds no environment interpreter either: the same plain note.
    assert scrapy_hook("scrapy", ["sh", "-c", "scrapy crawl x"], os.environ.get("PATH"), code, env_dir)[1]
    # Not a Scrapy project: nothing to say.
    assert scrapy_hook("python", [str(own / "bin" / "python"), "main.py"], path, tmp_path / "none", env_dir)[1] is None


def test_sdk_settings_only_for_a_command_in_the_agents_environment(tmp_path: Path) -> None:
    """The Scrapy stats wrapper imports crawlerkeeper_sdk, which only the agent-built environment is
    sure to have: a command that names another interpreter (a system scrapy, the author's own
    virtualenv) must not get it, or the crawl dies on a ModuleNotFoundError before its first request."""
    env_dir = tmp_path / "envs" / "py-abc"
    own = tmp_path / "own-venv"
    for bin_dir in (env_dir / "bin", own / "bin"):
        bin_dir.mkdir(parents=True)
        for name in ("scrapy", "python"):
            (bin_dir / name).write_text("#!/bin/sh\n")
            (bin_dir / name).chmod(0o755)
    (env_dir / "bin" / "python").unlink()
    (env_dir / "bin" / "python").symlink_to(sys.executable)  # a venv's python points outside it
    path = os.pathsep.join([str(env_dir / "bin"), os.environ.get("PATH", "")])
    assert runs_in_env(["scrapy", "crawl", "x"], path, env_dir)
    assert runs_in_env(["python", "-m", "scrapy", "crawl", "x"], path, env_dir)
    assert runs_in_env([str(env_dir / "bin" / "scrapy"), "crawl", "x"], path, env_dir)
    assert not runs_in_env([str(own / "bin" / "scrapy"), "crawl", "x"], path, env_dir)
    assert not runs_in_env(["no-such-tool-here", "crawl"], path, env_dir)
    assert runs_in_env(["anything"], path, None)  # no environment to compare with: as before


def test_tails_keep_whole_lines() -> None:
    text = "\n".join(f"line {i} " + "x" * 50 for i in range(100)) + "\n\n"
    tail = last_lines(text, 200)
    assert len(tail) <= 200 and tail.endswith("line 99 " + "x" * 50) and tail.startswith("line 9")
    assert last_lines("y" * 500, 100) == "…" + "y" * 99
    buffer = TailBuffer(100)
    for i in range(50):
        buffer.write(f"chunk {i}\n".encode())
    assert buffer.text().splitlines()[-1] == "chunk 49" and not buffer.text().startswith("hunk")


# --------------------------------------------------------------------------- through the agent

STATEFUL_MAIN = """\
import json, os, crawlerkeeper_sdk as ck
leftover = os.path.exists("scratch.txt")
open("scratch.txt", "w").write("run")
with open("config.json", "r+") as fh:  # rewrite a shipped file in place
    shipped = fh.read()
    fh.seek(0)
    fh.write('{"changed": 1}    ')
data = os.environ["CK_DATA_DIR"]
with open(os.path.join(data, "runs.txt"), "a") as fh:
    fh.write("run\\n")
open(os.path.join(os.environ["HOME"], ".tool-state"), "w").write("x")
ck.save_item({"leftover": leftover, "shipped": shipped, "runs": open(os.path.join(data, "runs.txt")).read().count("run"),
              "cwd": os.getcwd(), "home": os.environ["HOME"], "data": data})
"""


async def test_each_run_starts_clean_and_keeps_its_data_dir(dev_master: Any, nursery: trio.Nursery,
                                                            tmp_path: Path) -> None:
    admin = dev_master.admin
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token)
    spider = await admin.create_spider(name="stateful", framework="python")
    await admin.upload_package(spider, spider_zip({"main.py": STATEFUL_MAIN, "config.json": '{"original": 1}'}))
    async with running_agent(nursery, settings):
        with trio.fail_after(120):
            first = await admin.wait_task_final(await admin.create_task(spider), 120)
            second = await admin.wait_task_final(await admin.create_task(spider), 120)
    assert first["status"] == second["status"] == "SUCCESS", (first, second)
    [one], [two] = await admin.get_items(first["id"]), await admin.get_items(second["id"])
    assert (one["leftover"], two["leftover"]) == (False, False)  # run 2 never sees run 1's file
    assert one["shipped"] == two["shipped"] == '{"original": 1}'  # nor its in-place rewrite
    assert (one["runs"], two["runs"]) == (1, 2)  # CK_DATA_DIR keeps what the spider put there
    assert one["data"] == two["data"] and Path(one["data"]).is_relative_to(work_dir / "spider-data")
    assert Path(one["home"]).parent == work_dir / "spider-home" and (Path(one["home"]) / ".tool-state").is_file()
    assert one["cwd"] != two["cwd"] and Path(one["cwd"]).parent == work_dir / "spiders" / ".runs"

    def after() -> tuple[list[str], str]:
        versions = [p for p in (work_dir / "spiders").glob("*/*") if not p.parent.name.startswith(".")]
        return [p.name for p in (work_dir / "spiders" / ".runs").iterdir()], (versions[0] / "config.json").read_text()

    runs_left, cached = await trio.to_thread.run_sync(after)
    assert runs_left == []  # working copies are removed after the run
    assert cached == '{"original": 1}'


def _github_zip(files: dict[str, str], prefix: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr(zipfile.ZipInfo(prefix + "/"), b"")
        for rel, text in files.items():
            zf.writestr(f"{prefix}/{rel}", text)
        zf.writestr("__MACOSX/._main.py", b"\0\0")
    return buffer.getvalue()


async def test_github_zip_missing_files_and_failure_messages(dev_master: Any, nursery: trio.Nursery,
                                                             tmp_path: Path) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_MAX_WORKERS="3")
    github = await admin.create_spider(name="from-github", framework="python")
    await admin.upload_package(github, _github_zip(
        {"main.py": "import crawlerkeeper_sdk as ck, util\nck.save_item({'ok': util.OK})\n", "util.py": "OK = 1\n"},
        "my-spider-main"))
    no_cfg = await admin.create_spider(name="products", framework="scrapy")
    await admin.upload_package(no_cfg, spider_zip({"shop/settings.py": "", "requirements.txt": "scrapy\n"}))
    failing = await admin.create_spider(name="failing", framework="python", env={"API_TOKEN": "s3cr3t-t0ken-value"})
    await admin.upload_package(failing, spider_zip({"main.py": (
        "import sys\nfor i in range(200):\n    print(f'noise {i}', file=sys.stderr)\n"
        "print('cannot log in with s3cr3t-t0ken-value', file=sys.stderr)\n"
        "raise SystemExit('fatal: the site changed its layout')\n")}))
    killed = await admin.create_spider(name="killed", framework="python")
    await admin.upload_package(killed, spider_zip({"main.py": "import os, sys\nprint('about to die', file=sys.stderr,"
                                                              " flush=True)\nos.kill(os.getpid(), 9)\n"}))
    async with running_agent(nursery, settings):
        ids = [await admin.create_task(s) for s in (github, no_cfg, failing, killed)]
        with trio.fail_after(120):
            gh, cfg, fail, kill = [await admin.wait_task_final(t, 120) for t in ids]
    assert gh["status"] == "SUCCESS", (gh, await admin.get_logs(gh["id"]))
    assert await admin.get_items(gh["id"]) == [{"ok": 1}]
    assert (cfg["status"], cfg["errorCode"]) == ("FAILED", "DEPLOY_FAILED")
    assert "scrapy.cfg is missing" in cfg["errorMessage"] and "requirements.txt, shop/" in cfg["errorMessage"]
    assert (fail["errorCode"], fail["exitCode"]) == ("EXIT_NONZERO", 1)
    message = fail["errorMessage"]
    assert message.startswith("exit code 1; last lines of output:\n")
    assert message.endswith("fatal: the site changed its layout") and "noise 199" in message
    assert "s3cr3t-t0ken-value" not in message and "cannot log in with" in message
    assert len(message) < 1700 and "noise 0\n" not in message
    assert (kill["errorCode"], kill["exitCode"]) == ("SIGNALED", -9)  # a signal the agent did not send (docs/protocol.md "Outcomes")
    assert kill["errorMessage"] == "killed by SIGKILL (exit code -9); last lines of output:\nabout to die"


async def test_node_sdk_helper_works_from_esm_and_commonjs(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    helper = REPO / "sdk" / "node" / "crawlerkeeper-sdk.cjs"
    # The example carries a copy of the helper: the two never drift apart.
    assert (REPO / "sdk" / "examples" / "node_esm_crawler" / "src" / "crawlerkeeper-sdk.cjs").read_bytes() == \
        helper.read_bytes()
    shutil.copy(helper, tmp_path / "crawlerkeeper-sdk.cjs")
    (tmp_path / "esm.mjs").write_text("import { saveItem } from './crawlerkeeper-sdk.cjs';\nsaveItem({via: 'esm'});\n")
    (tmp_path / "cjs.cjs").write_text("const { saveItem } = require('./crawlerkeeper-sdk.cjs');\n"
                                      "saveItem({via: 'cjs'});\n")
    items = tmp_path / "items.jsonl"
    env = {**os.environ, "CK_ITEMS_FILE": str(items)}
    for script in ("esm.mjs", "cjs.cjs"):
        done = await trio.run_process([node, script], cwd=tmp_path, env=env, capture_stderr=True, check=False)
        assert done.returncode == 0, done.stderr.decode()
    assert [json.loads(line) for line in items.read_text().splitlines()] == [{"via": "esm"}, {"via": "cjs"}]
    no_agent = await trio.run_process([node, "cjs.cjs"], cwd=tmp_path, capture_stdout=True, check=True,
                                      env={k: v for k, v in os.environ.items() if k != "CK_ITEMS_FILE"})
    assert no_agent.stdout == b'{"via":"cjs"}\n'


async def test_deps_failure_carries_whole_lines(tmp_path: Path, index_url: str) -> None:
    log = bytearray()
    code = _code(tmp_path / "bad", {"requirements.txt": "ckdemo-dep==1.0\nckagent-no-such-package-xyz\n"})
    with trio.fail_after(120), pytest.raises(DepsError) as caught:
        await _deps(tmp_path, index_url).prepare("python", "bad", code, log.extend)
    head, *lines = str(caught.value).splitlines()
    assert head.startswith("uv pip install failed with exit code ") and head.endswith(":")
    output_lines = {line.rstrip() for line in bytes(log).decode().splitlines()}
    assert lines and all(line in output_lines for line in lines), (lines, output_lines)
    assert "ckagent-no-such-package-xyz" in str(caught.value)


def test_result_reports_the_phases_apart() -> None:
    from ckagent.task.admission import RunningTask
    from ckagent.task.outcome import TaskOutcome
    from ckagent.task.outcome import task_result as _result

    rt = RunningTask(task=_task("python"))
    rt.phase_seconds.update(deploy=0.25, install=12.5)
    now = time.time()
    rt.started_at = now - 3.0
    result = _result(rt, TaskOutcome("SUCCESS", exit_code=0), started_wall=now - 16.0)
    assert (result.deploy_ms, result.install_ms) == (250, 12500)
    assert result.run_ms is not None and 3000 <= result.run_ms < 3500
    assert result.duration_ms is not None and 16000 <= result.duration_ms < 16500  # from the claim: all phases
    wire = result.to_json()
    assert wire["installMs"] == 12500 and wire["deployMs"] == 250
    never_ran = _result(RunningTask(task=_task("python")), TaskOutcome("FAILED", "DEPLOY_FAILED", "x"), now)
    assert never_ran.run_ms is None and "runMs" not in never_ran.to_json()


def test_legacy_per_spider_environments_are_removed(tmp_path: Path) -> None:
    from ckagent.code.deps import remove_legacy_environments

    (tmp_path / "venvs" / "spider-1" / "bin").mkdir(parents=True)
    (tmp_path / "node" / "spider-2").mkdir(parents=True)
    (tmp_path / "envs" / "py-abc").mkdir(parents=True)
    assert sorted(p.name for p in remove_legacy_environments(tmp_path)) == ["node", "venvs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["envs"]
