"""Scrapyd eggs (ckagent.code.eggs): recognised by their ``[scrapy] settings`` entry point, run as
Scrapyd runs them (``scrapy crawl`` with the task's params as ``-a``/``-s``, ``-a _job=``, the runner's
variables), their requirements installed; hostile eggs refused with a message that says what is
wrong and how to build the egg right. The runs end to end: tests/test_eggs_e2e.py."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
from harness import SCRAPYD_SHOP, build_egg, egg_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckagent.cli.localrun import detect_framework
from ckagent.code import eggs
from ckagent.code.eggs import unnest
from ckagent.code.frameworks import SpawnContext, spawn_additions
from ckagent.code.pyplan import python_plan
from ckagent.code.scrapyhook import scrapy_spider_names
from ckagent.code.unpack import Limits, extract_zip
from ckagent.master.protocol import Task
from ckagent.node.errors import DeployError
from ckagent.task.commands import resolve_command

SETTINGS = "shop/settings.py"
GOOD = {
    "EGG-INFO/entry_points.txt": "[scrapy]\nsettings = shop.settings\n",
    "EGG-INFO/PKG-INFO": "Metadata-Version: 2.1\nName: shop\nVersion: 1.2\n",
    "shop/__init__.py": "",
    SETTINGS: "BOT_NAME = 'shop'\n",
    "shop/spiders/__init__.py": "",
    "shop/spiders/a.py": "import scrapy\nclass A(scrapy.Spider):\n    name = 'alpha'\n",
}


def _task(framework: str = "scrapy", **fields: Any) -> Task:
    return Task(id="task-1", spider_id="sp-1", spider_name="alpha", framework=framework, **fields)


def _unpacked(tmp_path: Path, entries: dict[str, bytes | str], name: str = "code") -> Path:
    egg = tmp_path / f"{name}.egg"
    egg.write_bytes(egg_bytes(entries))
    code = tmp_path / name
    code.mkdir()
    extract_zip(egg, code, Limits())
    return code


def test_an_egg_runs_scrapy_crawl_with_the_params_as_scrapyd_passes_them(tmp_path: Path) -> None:
    code = _unpacked(tmp_path, GOOD)
    params = {"start_url": "http://127.0.0.1:1/", "pages": 3, "jobid": "job-7", "_version": "r1",
              "project": "shop", "setting": ["LOG_LEVEL=DEBUG", "not-a-pair"], "settings": {"DOWNLOAD_DELAY": 0.5}}
    argv, how = resolve_command(_task(params=params, args=["-s", "CLOSESPIDER_ITEMCOUNT=5"]), code)
    assert argv == ["scrapy", "crawl", "alpha", "-a", "start_url=http://127.0.0.1:1/", "-a", "pages=3",
                    "-a", "_job=job-7", "-s", "LOG_LEVEL=DEBUG", "-s", "DOWNLOAD_DELAY=0.5",
                    "-s", "CLOSESPIDER_ITEMCOUNT=5"]
    assert how is not None and "Scrapyd egg (settings shop.settings)" in how
    # Without a jobid the task is the job; a python task's egg (no main.py) runs the same way.
    assert resolve_command(_task("python"), code)[0] == ["scrapy", "crawl", "alpha", "-a", "_job=task-1"]
    # A task's own command is its author's: taken as it is.
    assert resolve_command(_task(command=["python", "-m", "x"]), code)[0] == ["python", "-m", "x"]


def test_an_egg_gets_scrapyds_runner_variables_at_the_spawn(tmp_path: Path) -> None:
    code = _unpacked(tmp_path, GOOD)
    env = {"CK_TASK_ID": "task-1", "CK_SPIDER_NAME": "alpha", "CK_PARAMS": '{"jobid": "job-7"}', "PYTHONPATH": "/x"}
    added = spawn_additions(SpawnContext("scrapy", ["scrapy", "crawl", "alpha"], env, code, None))
    assert {k: v for k, v in added.env.items() if k != "CK_SCRAPY_HOOK"} == {
        "SCRAPY_SETTINGS_MODULE": "shop.settings", "SCRAPY_PROJECT": "shop", "PYTHONPATH": f"{code}:/x",
        "SCRAPYD_SPIDER": "alpha", "SCRAPYD_JOB": "job-7", "SCRAPYD_EGG_VERSION": "1.2"}
    assert any("a Scrapyd egg (shop 1.2): settings shop.settings" in line for line in added.notices)
    # The task's own settings module wins (Scrapyd's runner only sets a default).
    own = spawn_additions(SpawnContext("python", ["x"], {**env, "SCRAPY_SETTINGS_MODULE": "other.s"}, code, None))
    assert own.env["SCRAPY_SETTINGS_MODULE"] == "other.s"
    # Other code gets nothing of it.
    plain = tmp_path / "plain"
    plain.mkdir()
    assert "SCRAPY_SETTINGS_MODULE" not in spawn_additions(SpawnContext("python", ["x"], env, plain, None)).env


def test_a_project_with_scrapy_cfg_and_egg_info_stays_a_scrapy_project(tmp_path: Path) -> None:
    code = _unpacked(tmp_path, {**GOOD, "scrapy.cfg": "[settings]\ndefault = shop.settings\n"})
    assert resolve_command(_task(), code) == (["scrapy", "crawl", "alpha"], None)


def _plan(code: Path) -> Any:
    return python_plan(code, "scrapy", {"python": "x"}, "builder", "sdk")


def test_an_eggs_requirements(tmp_path: Path) -> None:
    # install_requires (EGG-INFO/requires.txt, extras left out); Scrapy added as Scrapyd brings its own.
    plan = _plan(_unpacked(tmp_path, {**GOOD, "EGG-INFO/requires.txt": "itemadapter>=0.8\n\n[extra]\nboto3\n"}, "a"))
    assert (plan.mode, plan.requirements) == ("requirements", ("itemadapter>=0.8", "scrapy"))
    named = _plan(_unpacked(tmp_path, {**GOOD, "EGG-INFO/requires.txt": "Scrapy==2.11.2\n"}, "b"))
    assert named.requirements == ("Scrapy==2.11.2",)
    # A requirements.txt shipped in the egg's top is the project's own list.
    shipped = _plan(_unpacked(tmp_path, {**GOOD, "requirements.txt": "scrapy>=2.11\nparsel\n",
                                         "EGG-INFO/requires.txt": "boto3\n"}, "c"))
    assert (shipped.mode, shipped.requirements) == ("requirements", ("scrapy>=2.11", "parsel"))
    # Nothing declared: Scrapy, the framework's package, even for a python task.
    bare = python_plan(_unpacked(tmp_path, GOOD, "d"), "python", {"python": "x"}, "builder", "sdk")
    assert (bare.mode, bare.packages) == ("packages", ("scrapy",))


def test_exec_detects_an_egg_and_its_spiders(tmp_path: Path) -> None:
    egg = tmp_path / "shop.egg"
    egg.write_bytes(egg_bytes(GOOD))
    assert detect_framework(egg) == "scrapy"
    assert scrapy_spider_names(egg) == ["alpha"]


def test_the_bundled_egg_is_built_from_the_bundled_project(tmp_path: Path) -> None:
    """sdk/examples/scrapyd_shop/scrapyd_shop.egg is what `setup.py bdist_egg` makes of the folder."""
    built = build_egg(SCRAPYD_SHOP, tmp_path / "dist")
    with zipfile.ZipFile(built) as fresh, zipfile.ZipFile(SCRAPYD_SHOP / "scrapyd_shop.egg") as committed:
        assert {i.filename: fresh.read(i) for i in fresh.infolist()} == {
            i.filename: committed.read(i) for i in committed.infolist()}
        assert fresh.read("EGG-INFO/entry_points.txt").decode().split() == ["[scrapy]", "settings", "=",
                                                                             "scrapyd_shop.settings"]


# --- hostile eggs: a clear DeployError saying what is wrong and how to fix it ---------------------

BAD_ENTRY_POINTS = [
    pytest.param(b"[console_scripts]\nshop = shop:main\n", "an egg that does not name its settings", id="no-scrapy"),
    pytest.param(b"[scrapy]\nother = shop.settings\n", "an egg that does not name its settings", id="no-settings-key"),
    pytest.param(b"", "an egg that does not name its settings", id="empty"),
    pytest.param(b"settings = shop.settings\n", "cannot be read as entry points", id="no-section"),
    pytest.param(b"[scrapy]\nsettings = a\nsettings = b\n", "cannot be read as entry points", id="twice"),
    pytest.param(b"[scrapy]\nsettings = ../../etc/passwd\n", "not a module name", id="path"),
    pytest.param(b"[scrapy]\nsettings = shop.class\n", "not a module name", id="keyword"),
    pytest.param(b"[scrapy]\nsettings =\n", "not a module name", id="blank"),
    pytest.param(b"[scrapy]\nsettings = shop.settings\xff\n", "not UTF-8", id="not-utf8"),
    pytest.param(b"[scrapy]\nsettings = shop.settings\n#" + b"x" * 70000, "at most 65536", id="huge"),
    pytest.param(b"[scrapy]\nsettings = shop.nothere\n", "does not hold it", id="module-missing"),
]


@pytest.mark.parametrize(("data", "says"), BAD_ENTRY_POINTS)
def test_bad_entry_points_are_refused_saying_what_and_how(tmp_path: Path, data: bytes, says: str) -> None:
    code = _unpacked(tmp_path, {**GOOD, "EGG-INFO/entry_points.txt": data})
    with pytest.raises(DeployError) as caught:
        resolve_command(_task(), code)
    assert says in str(caught.value) and "bdist_egg" in str(caught.value), str(caught.value)


HOSTILE_EGGS = [
    pytest.param({**GOOD, "../evil.py": "x"}, "'..' path components", id="zip-slip"),
    pytest.param({**GOOD, "/etc/cron.d/x": "x"}, "absolute paths", id="absolute"),
    pytest.param({"EGG-INFO/entry_points.txt": GOOD["EGG-INFO/entry_points.txt"]}, "does not hold it",
                 id="only-egg-info-not-unwrapped"),
    pytest.param({k: v for k, v in GOOD.items() if k != "EGG-INFO/entry_points.txt"},
                 "without EGG-INFO/entry_points.txt, so it does not name its settings", id="no-entry-points"),
    pytest.param({**{k: v for k, v in GOOD.items() if k != "EGG-INFO/entry_points.txt"},
                  "EGG-INFO/entry_points.txt/x": "x"}, "cannot be read", id="entry-points-a-directory"),
    pytest.param({**GOOD, "EGG-INFO/entry_points.txt": b"[scrapy]\nsettings = s\n" + b"\n" * (2 << 20)},
                 "compression ratio", id="bomb"),
]


@pytest.mark.parametrize(("entries", "says"), HOSTILE_EGGS)
def test_hostile_eggs_are_refused_saying_what(tmp_path: Path, entries: dict[str, Any], says: str) -> None:
    egg = tmp_path / "x.egg"
    egg.write_bytes(egg_bytes(entries))
    code = tmp_path / "code"
    code.mkdir()
    with pytest.raises(DeployError) as caught:
        extract_zip(egg, code, Limits())
        resolve_command(_task(), code)
    assert says in str(caught.value), str(caught.value)
    assert not (tmp_path / "evil.py").exists()


def _zip_of(tmp_path: Path, entries: dict[str, bytes | str], name: str) -> Path:
    code = _unpacked(tmp_path, entries, name)
    unnest(code, Limits())
    return code


def test_an_egg_shipped_in_a_zip_beside_its_requirements(tmp_path: Path) -> None:
    """A zip holding the egg and its requirements.txt (nested one level): the egg unpacked in its place."""
    code = _unpacked(tmp_path, {"dist/shop-1.0-py3.11.egg": egg_bytes(GOOD), "dist/requirements.txt": "scrapy\nparsel\n"})
    assert unnest(code, Limits()) == "shop-1.0-py3.11.egg"
    assert sorted(p.name for p in code.iterdir()) == ["EGG-INFO", "requirements.txt", "shop"]
    assert resolve_command(_task(), code)[0] == ["scrapy", "crawl", "alpha", "-a", "_job=task-1"]
    assert _plan(code).requirements == ("scrapy", "parsel")
    # One level only: an egg inside that egg is a file of the project.
    deeper = _zip_of(tmp_path, {"outer.egg": egg_bytes({**GOOD, "inner.egg": egg_bytes(GOOD)})}, "deeper")
    assert (deeper / "inner.egg").is_file() and (deeper / "EGG-INFO").is_dir()
    # Not an egg (no EGG-INFO/): left as it is.
    other = _zip_of(tmp_path, {"x.egg": egg_bytes({"a.py": ""}), "main.py": ""}, "other")
    assert sorted(p.name for p in other.iterdir()) == ["main.py", "x.egg"]
    # Beside a project's own code, a library's egg (no [scrapy] settings), even a broken one, is its file.
    library = {"EGG-INFO/PKG-INFO": "Name: lib\n", "lib/__init__.py": ""}
    vendored = _zip_of(tmp_path, {"lib.egg": egg_bytes(library), "main.py": "", "broken.txt": ""}, "vendored")
    assert sorted(p.name for p in vendored.iterdir()) == ["broken.txt", "lib.egg", "main.py"]
    broken = _zip_of(tmp_path, {"lib.egg": b"PK\x03\x04 cut", "main.py": ""}, "broken")
    assert sorted(p.name for p in broken.iterdir()) == ["lib.egg", "main.py"]
    # A Scrapyd egg beside code is unpacked all the same.
    beside = _zip_of(tmp_path, {"shop.egg": egg_bytes(GOOD), "tools/run.py": ""}, "beside")
    assert (beside / "EGG-INFO").is_dir() and (beside / "tools" / "run.py").is_file()


@pytest.mark.parametrize(("entries", "says"), [
    pytest.param({"x.egg": egg_bytes({**GOOD, "../evil.py": "x"})}, "x.egg (the egg in the package): entry '../evil.py'",
                 id="zip-slip-inside"),
    pytest.param({"x.egg": egg_bytes({**GOOD, "requirements.txt": "a"}), "requirements.txt": "b"},
                 "both the package and the egg in it (x.egg) hold requirements.txt", id="clash"),
    pytest.param({"x.egg": b"PK\x03\x04 not a zip"}, "x.egg (the egg in the package): package: not a readable zip",
                 id="truncated"),
])
def test_a_hostile_egg_in_a_zip_is_refused_naming_it(tmp_path: Path, entries: dict[str, Any], says: str) -> None:
    code = _unpacked(tmp_path, entries)
    with pytest.raises(DeployError) as caught:
        unnest(code, Limits())
    assert says in str(caught.value), str(caught.value)
    assert not (tmp_path / "evil.py").exists()


def test_an_egg_in_a_zip_counts_against_the_packages_total(tmp_path: Path) -> None:
    code = _unpacked(tmp_path, {"x.egg": egg_bytes({**GOOD, "big.bin": b"\0" * 5000}), "pad.bin": b"\1" * 5000})
    with pytest.raises(DeployError, match=r"x\.egg .*more than"):
        unnest(code, Limits(max_total_bytes=8000))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(
    st.binary(max_size=400),
    st.lists(st.sampled_from([b"[scrapy]", b"[", b"]", b"settings", b" = ", b"=", b":", b".", b"shop", b"\n",
                              b"\r", b"#", b";", b"\t", b" ", b"\x00", b"\xff", b"[console_scripts]", b"%(x)s",
                              b"settings=shop.settings", b"\\"]), max_size=40).map(b"".join)))
def test_entry_points_bytes_give_a_module_or_a_deploy_error(data: bytes) -> None:
    try:
        module = eggs.settings_of(data)
    except DeployError as exc:
        assert "egg" in str(exc) and "bdist_egg" in str(exc)
        return
    assert all(part.isidentifier() for part in module.split("."))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_hostile_entry_points_through_the_deploy(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    """Unpacked and resolved as a task's package: a command or a DeployError, nothing else."""
    tmp = tmp_path_factory.mktemp("egg")
    code = _unpacked(tmp, {**GOOD, "EGG-INFO/entry_points.txt": b"[scrapy]\nsettings = " + data})
    try:
        argv, _ = resolve_command(_task(), code)
    except DeployError as exc:
        assert "egg" in str(exc)
        return
    assert argv[:3] == ["scrapy", "crawl", "alpha"]
