"""Dependencies: real uv and npm runs against a local package index (no internet needed), the hash skip,
timeouts and failures as DEPS_FAILED with useful text, uv missing, node version selection, runtimes.

The local index is a PEP 503 "simple" directory served by http.server on 127.0.0.1 (port 0) holding
one hand-made wheel, ``ckdemo-dep``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import trio
from harness import NpmPackage, marked_pids, npm_registry, package_index

from ckagent.code.deps import (
    NPM_MISSING,
    UV_MISSING,
    Dependencies,
    DepsError,
    IndexChooser,
    spider_base_env,
    wanted_node,
)
from ckagent.code.installenv import changes_install, install_key_env
from ckagent.code.runtimes import detect_runtimes
from ckagent.node.noderange import parse_node_version, satisfies

NPM = shutil.which("npm")
needs_npm = pytest.mark.skipif(NPM is None, reason="npm is not installed (apt-get install nodejs npm)")

# --------------------------------------------------------------------------- a local package index


@pytest.fixture(scope="module")
def local_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a simple index on 127.0.0.1 serving ``ckdemo-dep`` 1.0 (module VALUE = 42) and the sdist
    ``slowpkg`` 1.0, whose build backend takes two minutes (a third-party package's own code)."""
    slow = {"pyproject.toml": SLOW_PYPROJECT, "slow_backend.py": SLOW_BACKEND}
    with package_index(tmp_path_factory.mktemp("index"), [("ckdemo_dep", "1.0", "VALUE = 42\n")],
                       [("slowpkg", "1.0", slow)]) as index:
        yield index.url


def _deps(tmp_path: Path, index: str, **kwargs: object) -> Dependencies:
    options: dict[str, object] = {
        "uv_path": None, "index": IndexChooser(index, index), "uv_cache_dir": tmp_path / "uv-cache",
        "timeout": 60.0, "base_env": spider_base_env(),
    }
    options.update(kwargs)
    return Dependencies(tmp_path / "venvs", **options)  # type: ignore[arg-type]


def _code(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    code = tmp_path / "code" / name
    for rel, text in files.items():
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        (code / rel).write_text(text)
    return code


# --------------------------------------------------------------------------- python


async def test_python_install_then_cached(tmp_path: Path, local_index: str) -> None:
    deps = _deps(tmp_path, local_index)
    log = bytearray()
    code = _code(tmp_path, "v1", {"requirements.txt": "ckdemo-dep==1.0\n", "main.py": ""})
    with trio.fail_after(120):
        first = await deps.prepare("python", "spider/1", code, log.extend)
        assert not first.cache_hit
        venv_python = Path(first.path_prefix[0]) / "python"
        check = await trio.run_process(
            [str(venv_python), "-c", "import ckdemo_dep, crawlerkeeper_sdk; print(ckdemo_dep.VALUE)"],
            capture_stdout=True, capture_stderr=True, check=False)
        assert check.stdout.strip() == b"42", check.stderr
        assert b"ckdemo-dep==1.0" in bytes(log)  # uv's output went to the task log
        # Same dependency files (even in a new code version): nothing runs.
        code2 = _code(tmp_path, "v2", {"requirements.txt": "ckdemo-dep==1.0\n", "main.py": "print(2)"})
        second = await deps.prepare("python", "spider/1", code2, log.extend)
        assert second.cache_hit and second.path_prefix == first.path_prefix
        # Changed dependency files: installed again.
        code3 = _code(tmp_path, "v3", {"requirements.txt": "ckdemo-dep==1.0\n# changed\n"})
        third = await deps.prepare("python", "spider/1", code3, log.extend)
        assert not third.cache_hit
    # The venv lives outside the code dir, under a safe name.
    assert Path(first.path_prefix[0]).parent.parent == tmp_path / "venvs"


async def test_missing_package_fails_with_uvs_message(tmp_path: Path, local_index: str) -> None:
    deps = _deps(tmp_path, local_index)
    code = _code(tmp_path, "bad", {"requirements.txt": "ckagent-no-such-package-xyz\n"})
    with trio.fail_after(60), pytest.raises(DepsError) as caught:
        await deps.prepare("python", "bad", code, lambda _: None)
    text = str(caught.value)
    assert text.startswith("uv pip install failed with exit code")
    assert "ckagent-no-such-package-xyz" in text and "not found" in text


@pytest.mark.parametrize(("framework", "files", "package"), [
    ("scrapy", {"scrapy.cfg": "[settings]\n"}, "scrapy"),
    ("python", {"scrapy.cfg": "[settings]\n"}, "scrapy"),
    ("selenium", {"main.py": ""}, "selenium"),
    ("playwright", {"main.py": ""}, "playwright"),
])
async def test_framework_default_package_without_dependency_file(tmp_path: Path, local_index: str, framework: str,
                                                                 files: dict[str, str], package: str) -> None:
    # The local index has none of these: the failure shows the default was asked for, offline.
    deps = _deps(tmp_path, local_index)
    log = bytearray()
    with trio.fail_after(60), pytest.raises(DepsError) as caught:
        await deps.prepare(framework, "d", _code(tmp_path, "d", files), log.extend)
    assert f" {package}\n" in bytes(log).decode().split("uv pip install", 1)[1].split("\n", 1)[0] + "\n"
    assert package in str(caught.value) and "not found" in str(caught.value)


async def test_uv_missing_tells_how_to_install(tmp_path: Path, local_index: str) -> None:
    env = spider_base_env()
    env["PATH"] = str(tmp_path / "empty-bin")
    deps = _deps(tmp_path, local_index, base_env=env, agent_bin=None, uv_path=tmp_path / "nope" / "uv")
    code = _code(tmp_path, "x", {"main.py": ""})
    with pytest.raises(DepsError) as caught:
        await deps.prepare("python", "x", code, lambda _: None)
    assert str(caught.value) == UV_MISSING
    assert "pip install uv" in UV_MISSING and "AGENT_UV_PATH" in UV_MISSING


SLOW_BACKEND = """\
import sys, time
print("slow backend: building for a long time", file=sys.stderr, flush=True)
time.sleep(120)
def build_wheel(*args, **kwargs):
    raise RuntimeError("never")
"""
SLOW_PYPROJECT = """\
[build-system]
requires = []
build-backend = "slow_backend"
backend-path = ["."]

[project]
name = "slowpkg"
version = "1.0"
"""


async def test_install_timeout_stops_uv(tmp_path: Path, local_index: str) -> None:
    deps = _deps(tmp_path, local_index, timeout=3.0)
    code = _code(tmp_path, "slow", {"requirements.txt": "slowpkg==1.0\n"})
    task_id = f"slow-test-{uuid.uuid4().hex}"  # this test's processes only: others build slow_backend too
    with trio.fail_after(30), pytest.raises(DepsError) as caught:
        await deps.prepare("python", "slow", code, lambda _: None, marker={"CK_TASK_ID": task_id})
    assert "uv pip install timed out after 3 s and was stopped" in str(caught.value)
    assert "AGENT_UV_SYNC_TIMEOUT" in str(caught.value)
    await trio.sleep(0.5)
    assert marked_pids(task_id) == [], "the build backend outlived the timeout"


async def test_index_chooser_falls_back_when_pypi_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}/simple"
    monkeypatch.setattr("ckagent.code.deps_python.OFFICIAL_INDEX", closed)
    chooser = IndexChooser(None, "https://mirror.example/simple", probe_timeout=1.0)
    with trio.fail_after(10):
        assert await chooser.index_url() == "https://mirror.example/simple"
    assert await IndexChooser("https://mine.example/simple", "x").index_url() == "https://mine.example/simple"


async def _index_answer(stream: trio.SocketStream, slow_first: list[int]) -> None:
    """A package index's answer to the probe's HEAD; the first ``slow_first[0]`` connections wait 2 s."""
    try:
        await stream.receive_some(65536)
        if slow_first[0] > 0:
            slow_first[0] -= 1
            await trio.sleep(2)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # (the probe gave up on this one)


async def test_index_chooser_keeps_pypi_after_one_slow_probe_and_tries_it_again_after_a_fallback(
        monkeypatch: pytest.MonkeyPatch, nursery: trio.Nursery) -> None:
    """One slow answer on a busy node does not send the installs to the mirror (a second, longer probe),
    and a fallback is not for the agent's life: after ``retry_after`` PyPI is probed again."""
    slow_first = [1]
    listeners = await nursery.start(partial(trio.serve_tcp, partial(_index_answer, slow_first=slow_first), 0,
                                            host="127.0.0.1"))
    index = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/simple"
    monkeypatch.setattr("ckagent.code.deps_python.OFFICIAL_INDEX", index)
    with trio.fail_after(20):
        assert await IndexChooser(None, "https://mirror.example/simple", probe_timeout=1.0).index_url() == index
        assert slow_first == [0], "the first probe was not the slow one"
        # PyPI away (a bound port that does not listen yet): the mirror, then PyPI again once it answers
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        away = f"http://127.0.0.1:{sock.getsockname()[1]}/simple"
        monkeypatch.setattr("ckagent.code.deps_python.OFFICIAL_INDEX", away)
        chooser = IndexChooser(None, "https://mirror.example/simple", probe_timeout=0.5, retry_after=0.5)
        assert await chooser.index_url() == "https://mirror.example/simple"
        sock.listen()
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        await nursery.start(trio.serve_listeners, partial(_index_answer, slow_first=[0]), [listener])
        assert await chooser.index_url() == "https://mirror.example/simple"  # (within retry_after: kept)
        await trio.sleep(0.6)
        assert await chooser.index_url() == away


# --------------------------------------------------------------------------- through the agent


@pytest.mark.slow
async def test_agent_cached_run_timeout_and_missing_package(dev_master, nursery: trio.Nursery, tmp_path: Path,
                                                            local_index: str) -> None:
    from harness import agent_settings, running_agent, submit

    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_INDEX_URL=local_index, AGENT_UV_SYNC_TIMEOUT="4",
                              AGENT_UV_CACHE_DIR=str(tmp_path / "uv-cache"), AGENT_MAX_WORKERS="3")
    spider_files = {"requirements.txt": "ckdemo-dep==1.0\n",
                    "main.py": "import ckdemo_dep, crawlerkeeper_sdk as ck\nck.save_item({'v': ckdemo_dep.VALUE})\n"}
    async with running_agent(nursery, settings):
        slow = await submit(dev_master.admin, "slow", {"requirements.txt": "slowpkg==1.0\n", "main.py": ""})
        missing = await submit(dev_master.admin, "missing", {"requirements.txt": "ckagent-no-such-package-xyz\n",
                                                             "main.py": ""})
        first = await submit(dev_master.admin, "cached", spider_files)
        with trio.fail_after(90):
            first_task = await dev_master.admin.wait_task_final(first, 90)
            spider_id = first_task["spiderId"]
            second = await dev_master.admin.create_task(spider_id)
            second_task = await dev_master.admin.wait_task_final(second, 60)
            slow_task = await dev_master.admin.wait_task_final(slow, 60)
            missing_task = await dev_master.admin.wait_task_final(missing, 60)
    assert first_task["status"] == "SUCCESS" and second_task["status"] == "SUCCESS", (first_task, second_task)
    first_log = "\n".join(await dev_master.admin.get_logs(first))
    second_log = "\n".join(await dev_master.admin.get_logs(second))
    assert "dependencies installed" in first_log
    assert "dependencies cached" in second_log and "uv pip install" not in second_log
    assert await dev_master.admin.get_items(second) == [{"v": 42}]
    assert (slow_task["status"], slow_task["errorCode"]) == ("FAILED", "DEPS_FAILED")
    assert "timed out after 4 s" in slow_task["errorMessage"]
    assert (missing_task["status"], missing_task["errorCode"]) == ("FAILED", "DEPS_FAILED")
    assert "ckagent-no-such-package-xyz" in missing_task["errorMessage"]
    assert "not found" in missing_task["errorMessage"]


# --------------------------------------------------------------------------- node


PACKAGE_JSON = {"name": "demo", "version": "1.0.0", "private": True}
LOCK = {"name": "demo", "version": "1.0.0", "lockfileVersion": 3, "requires": True,
        "packages": {"": {"name": "demo", "version": "1.0.0"}}}


@needs_npm
async def test_npm_ci_then_cached_across_versions(tmp_path: Path, local_index: str) -> None:
    deps = _deps(tmp_path, local_index)
    log = bytearray()
    files = {"package.json": json.dumps(PACKAGE_JSON), "package-lock.json": json.dumps(LOCK), "index.js": ""}
    with trio.fail_after(60):
        first = await deps.prepare("node", "n1", _code(tmp_path, "v1", files), log.extend)
        assert not first.cache_hit and b"npm ci" in bytes(log)
        v2 = _code(tmp_path, "v2", {**files, "index.js": "console.log(2)"})
        second = await deps.prepare("node", "n1", v2, log.extend)
    assert second.cache_hit and second.env_dir == first.env_dir
    assert first.env_dir is not None and first.env_dir.parent == tmp_path / "venvs"
    assert (v2 / "node_modules").is_symlink() and (v2 / "node_modules").resolve() == (
        first.env_dir / "node_modules").resolve()
    assert (v2 / "package-lock.json").read_text() == json.dumps(LOCK)  # the code dir is not modified


@needs_npm
async def test_npm_install_without_lockfile_and_failure_tail(tmp_path: Path, local_index: str) -> None:
    deps = _deps(tmp_path, local_index)
    log = bytearray()
    with trio.fail_after(60):
        await deps.prepare("node", "n2", _code(tmp_path, "ok", {"package.json": json.dumps(PACKAGE_JSON)}),
                           log.extend)
        assert b"npm install" in bytes(log)
        broken = _code(tmp_path, "broken", {"package.json": "{not json"})
        with pytest.raises(DepsError) as caught:
            await deps.prepare("node", "n3", broken, lambda _: None)
    assert "npm install failed with exit code" in str(caught.value)
    assert "JSON" in str(caught.value) or "json" in str(caught.value)


async def test_npm_missing(tmp_path: Path, local_index: str) -> None:
    env = spider_base_env()
    env["PATH"] = str(tmp_path / "empty-bin")
    deps = _deps(tmp_path, local_index, base_env=env)
    code = _code(tmp_path, "n", {"package.json": json.dumps(PACKAGE_JSON)})
    with pytest.raises(DepsError, match="npm is not installed"):
        await deps.prepare("node", "n", code, lambda _: None)
    assert "apt-get install nodejs npm" in NPM_MISSING


def _fake_nvm(root: Path, versions: list[str]) -> Path:
    """An nvm home: nvm.sh plus versions/node/vX/bin/node scripts that print their version."""
    (root / "versions" / "node").mkdir(parents=True)
    (root / "nvm.sh").write_text("nvm() { return 3; }\n")  # `nvm install` fails: no download here
    for v in versions:
        bin_dir = root / "versions" / "node" / f"v{v}" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "node").write_text(f"#!/bin/sh\necho v{v}\n")
        (bin_dir / "node").chmod(0o755)
    return root


async def test_nvm_selects_an_installed_version(tmp_path: Path, local_index: str) -> None:
    nvm = _fake_nvm(tmp_path / "nvm", ["16.20.2", "18.19.0", "18.20.4", "22.1.0"])
    deps = _deps(tmp_path, local_index, nvm_dir=nvm)
    code = _code(tmp_path, "n", {".nvmrc": "18\n", "index.js": ""})
    prepared = await deps.prepare("node", "n", code, lambda _: None)
    assert prepared.path_prefix == [str(nvm / "versions" / "node" / "v18.20.4" / "bin")]
    assert prepared.notes == ["node 18.20.4 from nvm (.nvmrc wants '18')"]
    runtimes = detect_runtimes(nvm_dir=nvm)
    assert runtimes["node"]["nvm"] == ["16.20.2", "18.19.0", "18.20.4", "22.1.0"]


async def test_no_nvm_and_unsatisfied_engines_warns(tmp_path: Path, local_index: str) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    deps = _deps(tmp_path, local_index, nvm_dir=tmp_path / "no-nvm")
    code = _code(tmp_path, "n", {"package.json": json.dumps({**PACKAGE_JSON, "engines": {"node": ">=99"}})})
    log = bytearray()
    with trio.fail_after(60):
        prepared = await deps.prepare("node", "n", code, log.extend)
    assert len(prepared.notes) == 1
    note = prepared.notes[0]
    assert note.startswith("warning: package.json engines.node wants node '>=99' but the system node is v")
    assert "nvm not found" in note and "running with it anyway" in note
    # A satisfied range gives no warning.
    ok = _code(tmp_path, "ok", {"package.json": json.dumps({**PACKAGE_JSON, "engines": {"node": ">=10"}})})
    assert (await deps.prepare("node", "ok", ok, lambda _: None)).notes == []


@pytest.mark.parametrize(("version", "spec", "expected"), [
    ("20.11.0", ">=18", True), ("20.11.0", "^20.1", True), ("20.11.0", "~20.10", False),
    ("20.11.0", "18.x", False), ("20.11.0", "16 || >=20", True), ("20.11.0", ">=18 <21", True),
    ("20.11.0", "18 - 20", True), ("20.11.0", "v20.11.0", True), ("20.11.0", ">= 21", False),
    ("0.2.5", "^0.2.3", True), ("0.3.0", "^0.2.3", False), ("20.11.0", "lts/*", None),
    ("20.11.0", "banana", None),
])
def test_node_ranges(version: str, spec: str, expected: bool | None) -> None:
    parsed = parse_node_version(version)
    assert parsed is not None
    assert satisfies(parsed, spec) is expected


def test_wanted_node_prefers_nvmrc(tmp_path: Path) -> None:
    code = _code(tmp_path, "n", {".nvmrc": "v20.1.0\n", "package.json": json.dumps({"engines": {"node": ">=18"}})})
    assert wanted_node(code) == ("v20.1.0", ".nvmrc")
    (code / ".nvmrc").unlink()
    assert wanted_node(code) == (">=18", "package.json engines.node")


# --------------------------------------------------------------------------- runtimes


def test_detect_runtimes_reports_what_is_installed() -> None:
    found = detect_runtimes()
    assert found["python"]["version"] and found["python"]["versions"]
    assert "uv" in found  # the dev install puts uv next to the interpreter
    node = shutil.which("node")
    if node is not None:
        real = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
        assert found["node"]["version"] == real.lstrip("v")
        assert found["node"]["version"] in found["node"]["versions"]
    if shutil.which("chromium") or shutil.which("google-chrome"):
        assert found["chromium"]["version"].count(".") >= 2
    if shutil.which("chromedriver"):
        assert found["chromedriver"]["version"]


# --------------------------------------------------------------------------- the task's env reaches installers

CLOSED_INDEX = "http://127.0.0.1:9/simple"
"""Nothing listens on loopback port 9 (discard): the node's index is unusable."""


def test_install_key_takes_what_changes_an_install_and_leaves_out_credentials() -> None:
    env = {"UV_INDEX_URL": "https://x/simple", "npm_config_registry": "https://r/", "NODE_ENV": "production",
           "PUPPETEER_SKIP_DOWNLOAD": "true", "NPM_TOKEN": "t", "UV_INDEX_PRIVATE_PASSWORD": "p",
           "NPM_CONFIG__AUTH": "a", "HTTPS_PROXY": "http://proxy:3128", "START_URL": "http://site/",
           "CFLAGS": "-O2"}
    # CFLAGS never reaches the installers (a flag can load a plugin: ckagent.code.installenv.withheld)
    assert install_key_env(env) == {"NODE_ENV": "production", "PUPPETEER_SKIP_DOWNLOAD": "true",
                                    "UV_INDEX_URL": "https://x/simple", "npm_config_registry": "https://r/"}
    assert not changes_install("NPM_CONFIG_//registry.npmjs.org/:_authToken")


@pytest.mark.slow
async def test_the_spiders_own_index_reaches_uv_and_keys_the_environment(tmp_path: Path, local_index: str) -> None:
    deps = _deps(tmp_path, CLOSED_INDEX)
    code = _code(tmp_path, "p", {"requirements.txt": "ckdemo-dep==1.0\n", "main.py": ""})
    log = bytearray()
    with trio.fail_after(120):
        with pytest.raises(DepsError):  # the node's index is closed
            await deps.prepare("python", "s", code, lambda _: None)
        own = await deps.prepare("python", "s", code, log.extend, task_env={"UV_DEFAULT_INDEX": local_index})
        assert not own.cache_hit
        token = await deps.prepare("python", "s", code, log.extend,
                                   task_env={"UV_DEFAULT_INDEX": local_index, "UV_INDEX_X_PASSWORD": "other"})
        assert token.cache_hit and token.env_dir == own.env_dir  # a credential is not part of the key
        other = await deps.prepare("python", "s", code, log.extend,
                                   task_env={"UV_DEFAULT_INDEX": local_index, "UV_RESOLUTION": "lowest-direct"})
    assert not other.cache_hit and other.env_dir != own.env_dir
    assert own.env_dir is not None and list(own.env_dir.glob("lib/python*/site-packages/ckdemo_dep"))


@pytest.mark.skipif(shutil.which("npm") is None, reason="needs npm")
async def test_npm_install_scripts_see_the_tasks_env(tmp_path: Path, local_index: str) -> None:
    """PUPPETEER_SKIP_DOWNLOAD-style switches: a dependency's install script reads the task's env."""
    check = ("node -e \"if (process.env.PUPPETEER_SKIP_DOWNLOAD !== 'true') { console.error('would download "
             "a browser'); process.exit(1) } console.log('download skipped')\"")
    with npm_registry([NpmPackage("ckbrowser", scripts={"install": check})]) as registry:
        manifest = {"name": "p", "version": "1.0.0", "dependencies": {"ckbrowser": "1.0.0"}}
        code = _code(tmp_path, "n", {"package.json": json.dumps(manifest), "index.js": ""})
        deps = _deps(tmp_path, local_index)
        log = bytearray()
        with trio.fail_after(120):
            with pytest.raises(DepsError) as caught:
                await deps.prepare("node", "n", code, lambda _: None, task_env={"NPM_CONFIG_REGISTRY": registry.url})
            assert "would download a browser" in str(caught.value)
            await deps.prepare("node", "n", code, log.extend,
                               task_env={"NPM_CONFIG_REGISTRY": registry.url, "PUPPETEER_SKIP_DOWNLOAD": "true"})
    assert b"download skipped" in bytes(log)
