"""The framework registry (ckagent.code.frameworks) is what every place asks, and a record is all a new
framework needs in the agent: the wire values, the OpenAPI enum and the docs' table agree with it;
detection, default packages, default commands, capabilities and the spawn hooks read it."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from harness import load_yaml

import ckagent
from ckagent.cli.localrun import detect_framework
from ckagent.code import frameworks
from ckagent.code.capabilities import Capabilities
from ckagent.code.frameworks import PYTHON, REGISTRY, Framework, SpawnContext, spawn_additions
from ckagent.code.workspace import DeployError
from ckagent.master.protocol import FRAMEWORKS, Task
from ckagent.task.commands import default_command, resolve_command

ROOT = Path(ckagent.__file__).resolve().parent.parent
SPEC = load_yaml((ROOT / "ckagent" / "master" / "protocol" / "openapi.yaml").read_text(encoding="utf-8"))


def _task(framework: str, **extra: object) -> Task:
    task = Task.from_json({"id": "t1", "spiderId": "s1", "spiderName": "products", "framework": "python"})
    return dataclasses.replace(task, framework=framework, **extra)  # type: ignore[arg-type]


def _code(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(parents=True, exist_ok=True)
    return root


def test_the_registry_the_wire_values_and_the_openapi_enum_agree() -> None:
    assert tuple(REGISTRY) == FRAMEWORKS, "add the framework to ckagent.master.protocol.FRAMEWORKS (same order)"
    assert tuple(SPEC["components"]["schemas"]["Framework"]["enum"]) == FRAMEWORKS, "and to openapi.yaml's enum"
    for name, record in REGISTRY.items():
        assert record.name == name and record.runtime in frameworks.RUNTIMES.values()
        assert record.command, name


def test_the_docs_default_commands_table_has_a_row_per_framework() -> None:
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    table = text[text.index("**Default commands**"):]
    rows = dict(re.findall(r"^\| `([a-z0-9_-]+)` \| (.+) \|$", table[:table.index("\n\n", table.index("| ---"))], re.M))
    assert set(rows) == set(REGISTRY), "docs/protocol.md 'Default commands' needs a row per framework"
    for name, record in REGISTRY.items():
        shown = " ".join(record.command)
        assert f"`{shown}`" in rows[name], (name, rows[name], shown)


def test_exec_help_names_every_framework() -> None:
    out = subprocess.run([sys.executable, "-m", "ckagent", "exec", "--help"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    for name in REGISTRY:
        assert re.search(rf"\b{name}\b", out), name


def test_detection_reads_the_markers(tmp_path: Path) -> None:
    assert detect_framework(_code(tmp_path / "s", {"scrapy.cfg": "", "package.json": "{}"})) == "scrapy"
    assert detect_framework(_code(tmp_path / "n", {"package.json": "{}"})) == "node"
    assert detect_framework(_code(tmp_path / "p", {"main.py": ""})) == "python"
    with zipfile.ZipFile(tmp_path / "wrapped.zip", "w") as archive:  # a single top folder is unwrapped
        archive.writestr("shop/scrapy.cfg", "")
    assert detect_framework(tmp_path / "wrapped.zip") == "scrapy"
    assert frameworks.all_markers() == ("scrapy.cfg", "EGG-INFO/entry_points.txt", "package.json")


def test_default_packages_follow_the_marker_within_the_runtime(tmp_path: Path) -> None:
    plain = _code(tmp_path / "plain", {"main.py": ""})
    scrapy_project = _code(tmp_path / "scrapy", {"scrapy.cfg": ""})
    assert frameworks.default_packages("python", plain) == ()
    assert frameworks.default_packages("playwright", plain) == ("playwright",)
    assert frameworks.default_packages("selenium", plain) == ("selenium",)
    # Any Python code with a scrapy.cfg is a Scrapy project; a Node spider never gets Python packages.
    assert frameworks.default_packages("python", scrapy_project) == ("scrapy",)
    assert frameworks.default_packages("node", scrapy_project) == ()


def test_unknown_framework_is_a_clear_error() -> None:
    with pytest.raises(frameworks.UnknownFramework, match=r"unknown framework 'ruby': expected one of scrapy, python"):
        frameworks.framework("ruby")


def test_the_python_runtime_hooks_scrapy_and_browser_frameworks_say_a_missing_browser(tmp_path: Path) -> None:
    env_dir = tmp_path / "envs" / "py-abc"
    (env_dir / "bin").mkdir(parents=True)
    code = _code(tmp_path / "code", {"main.py": ""})
    path = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin"}

    def ctx(framework: str, env: dict[str, str], built: Path | None = env_dir) -> SpawnContext:
        return SpawnContext(framework, ["python", "main.py"], env, code, built)

    # Every Python task may start Scrapy: its items hook is there, unless the agent built no environment.
    assert spawn_additions(ctx("python", path)).env == {"CK_SCRAPY_HOOK": "items,stats,state"}
    # A task declaring outputs.items: those files are its items; no feed of the agent's beside them.
    declared = SpawnContext("scrapy", ["scrapy", "crawl", "x"], path, code, env_dir, items_declared=True)
    assert spawn_additions(declared).env == {"CK_SCRAPY_HOOK": "stats,state"}
    assert spawn_additions(ctx("python", path, built=None)).env == {}
    assert spawn_additions(ctx("node", path, built=None)).env == {}
    assert spawn_additions(ctx("python", path)).notices == []
    assert frameworks.has_spawn_hooks("python") and not frameworks.has_spawn_hooks("node")
    missing = spawn_additions(ctx("selenium", path)).notices
    assert len(missing) == 1 and "chromium and chromedriver" in missing[0] and "CK_CHROMIUM_PATH" in missing[0]
    found = {**path, "CK_CHROMIUM_PATH": "/usr/bin/chromium"}
    assert spawn_additions(ctx("playwright", found)).notices == []


def test_one_record_is_all_a_new_framework_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A made-up Python framework, added as one record only: detected by its marker, its packages and
    command used, its needed file checked, its runtime's tool required, its own hook run."""
    said: list[SpawnContext] = []

    def hook(ctx: SpawnContext) -> frameworks.SpawnAdditions:
        said.append(ctx)
        return frameworks.SpawnAdditions({"CRAWLKIT_MODE": "agent"}, ["crawlkit hook ran"])

    record = Framework("crawlkit", PYTHON, "Crawlkit", ("python", "-m", "crawlkit", frameworks.SPIDER_NAME),
                       needs=("crawlkit.toml",), packages=("crawlkit",), markers=("crawlkit.toml",), hooks=(hook,))
    monkeypatch.setitem(REGISTRY, "crawlkit", record)
    project = _code(tmp_path / "kit", {"crawlkit.toml": ""})
    assert detect_framework(project) == "crawlkit"
    assert frameworks.default_packages("python", project) == ("crawlkit",)
    assert default_command(_task("crawlkit", args=["-v"])) == ["python", "-m", "crawlkit", "products", "-v"]
    assert resolve_command(_task("crawlkit"), project) == (["python", "-m", "crawlkit", "products"], None)
    with pytest.raises(DeployError, match=r"crawlkit\.toml is missing.*Found sub/crawlkit\.toml one folder down"):
        resolve_command(_task("crawlkit"), _code(tmp_path / "repo", {"sub/crawlkit.toml": ""}))
    caps = Capabilities(None)
    caps.missing = {"uv": "no uv"}
    assert (caps.cannot_run(_task("crawlkit")) or "").startswith("uv is missing")
    added = spawn_additions(SpawnContext("crawlkit", ["python"], {"PATH": "/usr/bin"}, project, None))
    assert added.env == {"CRAWLKIT_MODE": "agent"} and added.notices == ["crawlkit hook ran"] and len(said) == 1
