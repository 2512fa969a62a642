"""ckagent.pyz (build/build_pyz.py): reproducible, one file for CPython 3.10–3.13, isolated spiders.

The pyz is built once per test session from a frozen copy of the checkout (:func:`session_pyz`,
shared with test_runsh.py); the reproducibility test builds a second time from the same copy.
Interpreters come from pyenv (``/root/.pyenv/versions/3.1x.*``) or ``python3.1x`` on PATH
(:func:`harness.python_or_skip`); a missing or unreachable one is skipped with a message naming it
(shown by ``-ra``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import trio
import yaml
from harness import build_pyz, free_port, python_or_skip, python_versions, pyz_dir, submit

import ckagent

SUPPORTED = ("3.10", "3.11", "3.12", "3.13")


def run_pyz(python: Path | str, pyz: Path, *args: str, shiv_root: Path, timeout: float = 120,
            **env: str) -> subprocess.CompletedProcess[str]:
    """``python pyz args`` with SHIV_ROOT; a clean environment (no PYTHONPATH from the test run)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SHIV_", "AGENT_"))}
    environ.update(SHIV_ROOT=str(shiv_root), **env)
    return subprocess.run([str(python), str(pyz), *args], capture_output=True, text=True, timeout=timeout,
                          env=environ, check=False)


def test_pyz_is_reproducible_compressed_and_holds_only_what_it_needs(
    pyz: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    again = build_pyz(pyz_dir(tmp_path_factory) / "src", tmp_path_factory.mktemp("again")
                      / "ckagent.pyz")
    assert again.read_bytes() == pyz.read_bytes(), "same input must give the same bytes"
    assert pyz.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    assert os.access(pyz, os.X_OK)
    with zipfile.ZipFile(pyz) as archive:
        infos = archive.infolist()
        names = {info.filename for info in infos}
        environment = json.loads(archive.read("environment.json"))
    assert environment["entry_point"] == "ckagent.__main__:main"  # (supervise is dispatched before ckagent.cli)
    assert all(info.compress_type == zipfile.ZIP_DEFLATED for info in infos)
    assert {info.date_time for info in infos} == {infos[0].date_time}, "one fixed timestamp"
    assert "site-packages/ckagent/_sdk/crawlerkeeper_sdk/__init__.py" in names
    assert {n.split("/")[3] for n in names if n.startswith("site-packages/ckagent/_sdk/")} == {"crawlerkeeper_sdk"}
    assert not [n for n in names if n.endswith(".pyc") or n.startswith(("site-packages/tests/", "site-packages/build/"))]
    # one compiled yaml module per supported Python, psutil's single abi3 module
    for version in SUPPORTED:
        tag = version.replace(".", "")
        assert f"site-packages/yaml/_yaml.cpython-{tag}-x86_64-linux-gnu.so" in names
    assert "site-packages/psutil/_psutil_linux.abi3.so" in names
    # no install record naming the build machine's temp dirs
    assert not [n for n in names if n.endswith("direct_url.json")]


_PROBE = """
import json, sys
import yaml, psutil, trio, httpx, cyclopts, starlette, hypercorn, prometheus_client, stamina
import ckagent
from ckagent.code.deps import bundled_sdk_dir
sdk = bundled_sdk_dir()
print(json.dumps({
    "python": "%d.%d" % sys.version_info[:2],
    "libyaml": yaml.__with_libyaml__,
    "cpus": psutil.cpu_count(),
    "ckagent": ckagent.__file__,
    "sdk_dir": str(sdk),
    "sdk_entries": sorted(p.name for p in sdk.iterdir() if p.name != "__pycache__"),
    "exceptiongroup": sys.version_info >= (3, 11) or bool(__import__("exceptiongroup")),
}))
"""


@pytest.mark.parametrize("version", python_versions(*SUPPORTED))
def test_one_pyz_runs_on_each_supported_python(pyz: Path, version: str, tmp_path: Path) -> None:
    python = python_or_skip(version)
    shiv_root = pyz.parent / "shiv-shared"  # one extraction serves every version (each adds its own .pyc)
    result = run_pyz(python, pyz, "version", shiv_root=shiv_root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ckagent {ckagent.__version__} (Python {version}."), result.stdout
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    result = run_pyz(python, pyz, str(probe), shiv_root=shiv_root, SHIV_INTERPRETER="1")
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["python"] == version
    assert facts["libyaml"] is True, "the compiled yaml module for this Python must load"
    assert facts["cpus"] >= 1
    assert facts["ckagent"].startswith(str(shiv_root)), "runs from the extraction under SHIV_ROOT"
    assert facts["sdk_dir"].startswith(str(shiv_root)) and facts["sdk_entries"] == ["crawlerkeeper_sdk"]
    assert facts["exceptiongroup"]
    config = tmp_path / "agent.yaml"
    config.write_text("agent:\n  registration_token: t\n  port: 9001\n")
    checked = run_pyz(python, pyz, "config", "check", "-c", str(config), shiv_root=shiv_root)
    assert checked.returncode == 0 and "config OK" in checked.stdout, checked.stderr


def test_an_unsupported_python_gets_a_plain_message_not_a_traceback(pyz: Path, tmp_path: Path) -> None:
    python = python_or_skip("3.9")
    result = run_pyz(python, pyz, "version", shiv_root=tmp_path / "shiv")
    assert result.returncode != 0
    assert "ckagent needs Python 3.10 to 3.13; this is 3.9." in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "AGENT_PYTHON" in result.stderr


def test_warm_start_loads_bytecode_cached_by_the_first_even_with_dont_write_bytecode(
    pyz: Path, tmp_path: Path
) -> None:
    shiv_root = tmp_path / "shiv"
    first = run_pyz(sys.executable, pyz, "version", shiv_root=shiv_root, PYTHONDONTWRITEBYTECODE="1")
    assert first.returncode == 0, first.stderr
    site = next(shiv_root.glob("ckagent.pyz_*/site-packages"))
    tag = sys.implementation.cache_tag
    cached = site / "ckagent" / "cli" / "__pycache__" / f"__init__.{tag}.pyc"
    assert cached.is_file(), "the first start caches the bytecode of what it imported"
    assert (site / "cyclopts" / "__pycache__" / f"core.{tag}.pyc").is_file()
    assert not list((site / "ckagent" / "devmaster").rglob("*.pyc")), "only what was imported is compiled"
    # -v names each module's origin: a warm start loads the cached bytecode instead of compiling again.
    warm = run_pyz(sys.executable, pyz, "version", shiv_root=shiv_root, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONVERBOSE="1")
    assert warm.returncode == 0, warm.stderr
    assert f"code object from '{cached}'" in warm.stderr
    assert f"code object from {site / 'ckagent' / 'cli' / '__init__.py'}" not in warm.stderr


def _with_build_id(pyz: Path, dest: Path, build_id: str) -> Path:
    """A copy of ``pyz`` that shiv extracts under another build id (as a different build would)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(pyz) as src, dest.open("wb") as out:
        out.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                data = src.read(info)
                if info.filename == "environment.json":
                    env = json.loads(data)
                    env["build_id"] = build_id
                    data = json.dumps(env).encode()
                dst.writestr(info, data)
    return dest


def test_old_extractions_are_cleaned_keeping_the_last_other_build(pyz: Path, tmp_path: Path) -> None:
    shiv_root = tmp_path / "shiv"
    copies = [_with_build_id(pyz, tmp_path / f"b{i}" / "ckagent.pyz", f"{i:x}" * 64) for i in (1, 2, 3)]
    with zipfile.ZipFile(pyz) as archive:
        real_id = json.loads(archive.read("environment.json"))["build_id"]
    # a half-finished extraction of a fourth build, and an unrelated directory that must survive
    (shiv_root / (f"ckagent.pyz_{'4' * 64}.tmp")).mkdir(parents=True)
    (shiv_root / "something-else").mkdir()
    for copy in [*copies, pyz]:
        copy.chmod(0o755)
        assert run_pyz(sys.executable, copy, "version", shiv_root=shiv_root).returncode == 0
    left = sorted(p.name for p in shiv_root.iterdir() if not p.name.startswith("."))
    assert left == sorted([f"ckagent.pyz_{real_id}", f"ckagent.pyz_{'3' * 64}", "something-else"])
    locks = sorted(p.name for p in shiv_root.iterdir() if p.name.startswith("."))
    assert locks == sorted([f".ckagent.pyz_{real_id}_lock", f".ckagent.pyz_{'3' * 64}_lock"])


_ISOLATION_SPIDER = """
import json, os, sys
info = {"path": sys.path, "env": sorted(os.environ), "executable": sys.executable}
for name in ("trio", "yaml", "httpx", "ckagent", "cyclopts"):
    try:
        __import__(name)
        info[name] = "importable"
    except ImportError:
        info[name] = "missing"
import crawlerkeeper_sdk as ck
info["sdk"] = ck.__file__
print("ISOLATION " + json.dumps(info), flush=True)
ck.save_item({"ok": True})
"""


def agent_config(directory: Path, base_url: str, token: str, port: int) -> Path:
    """A config file for a pyz agent against the dev master (fast heartbeat, short polls)."""
    config = {
        "server": {"url": base_url},
        "agent": {"registration_token": token, "name": "pyz-node", "ip": "127.0.0.1", "port": port,
                  "max_workers": 1},
        "heartbeat": {"interval": 1},
        "task": {"work_dir": str(directory / "data"), "poll_interval": 0.5, "long_poll_wait": 1,
                 "kill_grace": 2, "drain_timeout": 5},
        "deps": {"uv_path": str(Path(sys.executable).parent / "uv")},
    }
    path = directory / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("version", python_versions(SUPPORTED[0], SUPPORTED[-1]))
async def test_pyz_agent_runs_a_spider_that_cannot_see_the_agents_packages(
    pyz: Path, dev_master, tmp_path: Path, version: str
) -> None:
    python = python_or_skip(version)  # (found: the mark skipped it otherwise)
    shiv_root = tmp_path / "shiv"
    config = agent_config(tmp_path, dev_master.base_url, dev_master.registration_token, free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "AGENT_", "SHIV_"))}
    env["SHIV_ROOT"] = str(shiv_root)
    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as log:
        process = await trio.lowlevel.open_process(
            [str(python), str(pyz), "-c", str(config)], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
        )
    try:
        task_id = await submit(dev_master.admin, "isolation", {"main.py": _ISOLATION_SPIDER})
        with trio.fail_after(90):
            task = await dev_master.admin.wait_task_final(task_id, 90)
        logs = await dev_master.admin.get_logs(task_id)
        assert task["status"] == "SUCCESS", (task, logs, log_path.read_text())
        assert await dev_master.admin.get_items(task_id) == [{"ok": True}]
    finally:
        process.terminate()
        with trio.move_on_after(30, shield=True):  # a cancelled test still stops the agent
            await process.wait()
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(10, shield=True):
                await process.wait()
    assert process.returncode == 0, log_path.read_text()
    line = next(line for line in logs if line.startswith("ISOLATION "))
    info = json.loads(line.split(" ", 1)[1])
    extraction = next(shiv_root.glob("ckagent.pyz_*/site-packages"))
    assert info["sdk"] == str(extraction / "ckagent" / "_sdk" / "crawlerkeeper_sdk" / "__init__.py")
    assert {info[name] for name in ("trio", "yaml", "httpx", "ckagent", "cyclopts")} == {"missing"}, info
    assert str(extraction) not in info["path"], "the pyz's site-packages must not be on the spider's path"
    assert not [p for p in info["path"] if p.startswith(str(extraction)) and not p.endswith("/_sdk")]
    assert not [name for name in info["env"] if name.startswith(("SHIV", "PYTHONPATH", "AGENT_"))], info["env"]
    assert info["executable"].startswith(str(tmp_path / "data")), "the spider runs in its own venv"
