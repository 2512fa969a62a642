"""Lock files other than uv.lock are honoured: the locked version is installed, not the newest one.

A local index on 127.0.0.1 (port 0) serves ``ckdemo-dep`` 1.0 and 2.0; every project allows both
and locks 1.0. Real uv runs. A lock that cannot be honoured fails with a message naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, assert_default_identity, package_index, running_agent

import ckagent
from ckagent.code.deps import Dependencies, DepsError, IndexChooser, spider_base_env
from ckagent.code.pylocks import find_lock
from ckagent.devmaster.client import zip_directory

EXAMPLES = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "examples"


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """(simple index URL, {version: wheel URL#sha256}) serving ckdemo-dep 1.0 and 2.0."""
    packages = [("ckdemo_dep", version, f"VALUE = {version!r}\n") for version in ("1.0", "2.0")]
    with package_index(tmp_path_factory.mktemp("index2"), packages) as index:
        yield index.url, {version: index.wheel_urls[("ckdemo_dep", version)] for version in ("1.0", "2.0")}


POETRY_PYPROJECT = """
[tool.poetry]
name = "shop"
version = "0.1.0"
description = ""
authors = []

[tool.poetry.dependencies]
python = "^3.10"
ckdemo-dep = ">=1.0"

[tool.poetry.group.dev.dependencies]
not-on-the-index = "^9"
"""

POETRY_LOCK = """
[[package]]
name = "ckdemo-dep"
version = "1.0"
description = ""
optional = false
python-versions = "*"
files = []
groups = ["main"]

[[package]]
name = "not-on-the-index"
version = "9.0"
description = "a dev tool: not installed for a spider"
optional = false
python-versions = "*"
files = []
groups = ["dev"]

[metadata]
lock-version = "2.1"
python-versions = "^3.10"
content-hash = "x"
"""

PEP621 = '[project]\nname = "shop"\nversion = "0.1.0"\ndependencies = ["ckdemo-dep>=1.0"]\n'
PDM_LOCK = """
[metadata]
groups = ["default"]
lock_version = "4.5.0"

[[package]]
name = "ckdemo-dep"
version = "1.0"
groups = ["default"]
files = []
"""
PIPFILE_LOCK = json.dumps({"_meta": {"sources": []}, "default": {"ckdemo-dep": {"version": "==1.0"}},
                           "develop": {"not-on-the-index": {"version": "==9.0"}}})


def _pylock(urls: dict[str, str]) -> str:
    url, sha = urls["1.0"].split("#")
    return (f'lock-version = "1.0"\ncreated-by = "tests"\n\n[[packages]]\nname = "ckdemo-dep"\nversion = "1.0"\n'
            f'wheels = [{{ url = "{url}", hashes = {{ sha256 = "{sha}" }} }}]\n')


def _project(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    code = tmp_path / "code" / name
    code.mkdir(parents=True)
    for rel, text in {**files, "main.py": ""}.items():
        (code / rel).write_text(text)
    return code


async def _installed_version(tmp_path: Path, index: str, code: Path) -> tuple[str, str]:
    deps = Dependencies(tmp_path / "envs", uv_path=None, index=IndexChooser(index, index),
                        uv_cache_dir=tmp_path / "uv-cache", timeout=120.0, base_env=spider_base_env())
    log = bytearray()
    with trio.fail_after(180):
        prepared = await deps.prepare("python", "s", code, log.extend)
    assert prepared.env_dir is not None
    [module] = prepared.env_dir.glob("lib/python*/site-packages/ckdemo_dep/__init__.py")
    return module.read_text().split("=")[1].strip().strip("'"), bytes(log).decode(errors="replace")


@pytest.mark.parametrize("kind", ["poetry", "pdm", "pipenv", "pylock"])
async def test_the_locked_version_is_installed(tmp_path: Path, two_versions: tuple[str, dict[str, str]],
                                               kind: str) -> None:
    index, urls = two_versions
    files = {"poetry": {"pyproject.toml": POETRY_PYPROJECT, "poetry.lock": POETRY_LOCK},
             "pdm": {"pyproject.toml": PEP621, "pdm.lock": PDM_LOCK},
             "pipenv": {"Pipfile": "[packages]\nckdemo-dep = '*'\n", "Pipfile.lock": PIPFILE_LOCK},
             "pylock": {"pylock.toml": _pylock(urls), "pyproject.toml": PEP621}}[kind]
    code = _project(tmp_path, kind, files)
    lock = find_lock(code)
    assert lock is not None and lock in files
    version, log = await _installed_version(tmp_path, index, code)
    assert version == "1.0", log  # the newest allowed is 2.0
    assert lock in log


async def test_without_a_lock_the_newest_allowed_version_comes(tmp_path: Path,
                                                              two_versions: tuple[str, dict[str, str]]) -> None:
    """The control: the same pyproject without its lock gets 2.0, so the tests above can fail."""
    version, _ = await _installed_version(tmp_path, two_versions[0], _project(tmp_path, "free", {"pyproject.toml": PEP621}))
    assert version == "2.0"


async def test_a_lock_that_cannot_be_honoured_fails_naming_it(tmp_path: Path,
                                                              two_versions: tuple[str, dict[str, str]]) -> None:
    lock = POETRY_LOCK.replace('groups = ["main"]', 'groups = ["main"]\n\n[package.source]\ntype = "directory"\n'
                               'url = "../libs/ckdemo"', 1)
    code = _project(tmp_path, "dir", {"pyproject.toml": POETRY_PYPROJECT, "poetry.lock": lock})
    with pytest.raises(DepsError) as caught:
        await _installed_version(tmp_path, two_versions[0], code)
    assert "poetry.lock pins ckdemo-dep from a directory source" in str(caught.value)
    broken = _project(tmp_path, "broken", {"pyproject.toml": PEP621, "pdm.lock": "[[package]\n"})
    with pytest.raises(DepsError, match=r"pdm\.lock cannot be read as TOML"):
        await _installed_version(tmp_path, two_versions[0], broken)


@pytest.mark.slow
async def test_the_poetry_example_runs_with_its_locked_versions(dev_master: Any, nursery: trio.Nursery,
                                                               tmp_path: Path) -> None:
    """sdk/examples/poetry_shop through a real agent (packages from PyPI or the mirror)."""
    admin = dev_master.admin
    spider = await admin.create_spider(name="poetry_shop", framework="python",
                                       env={"START_URL": f"{dev_master.base_url}/demo-site/"})
    await admin.upload_package(spider, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "poetry_shop"))
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="600")
    async with running_agent(nursery, settings):
        task_id = await admin.create_task(spider)
        with trio.fail_after(700):
            task = await admin.wait_task_final(task_id, 700)
    log = "\n".join(await admin.get_logs(task_id))
    assert task["status"] == "SUCCESS", (task, log[-3000:])
    assert_default_identity(log)  # as root: under a uid of its own
    assert "at the versions poetry.lock pins" in log
    assert "running with requests 2.31.0, beautifulsoup4 4.12.2" in log, log[-3000:]
    assert "page 5: 30 products" in log
