"""Environments and caches no spider can write (issue 35, part 2): installers run as the node's builder,
never on the project's own code, and a finished environment is sealed read-only.

The rules first, on data (what of a task's env reaches the installers, what a project requires read
without running it, what of a Node project is staged, the seal's walk); then real builds — uv from a
package index on 127.0.0.1, npm from a registry on 127.0.0.1 — as a builder uid of their own (root
only), where a third-party package's build or install script writes a marker with the uid it ran as
(the builder's) and the project's own setup.py / postinstall would write one too (it never does),
then spiders under other uids try to write what the builder made: the environment (a ``.pth`` the
next spider's interpreter would load: the issue's "POISONED" case), ``node_modules``, the caches.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from harness import (
    NpmPackage,
    npm_registry,
    package_index,
    searchable_directory,
    spider_python,
    world_directory,
)

from ckagent.code.builder import Builder, remove_tree, seal, sealed_by
from ckagent.code.deps import Dependencies, IndexChooser, spider_base_env
from ckagent.code.envstore import collect, read_marker
from ckagent.code.installenv import install_key_env, installer_env, withheld
from ckagent.code.nodestage import node_staged
from ckagent.code.pyreqs import (
    literal_install_requires,
    poetry_constraint,
    project_requirements,
    read_requirements,
)
from ckagent.code.stage import NotStageable, ProjectFiles
from ckagent.node.runas import RunAs

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a builder uid of its own needs root")
NPM = shutil.which("npm")

BUILDER_UID, SPIDER_A, SPIDER_B = 3_310_000_101, 3_310_000_102, 3_310_000_103
"""Uids no account has: the builder's and two spiders' (far above any range a test agent allocates)."""


def _code(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# --------------------------------------------------------------------------- what reaches the installers


def test_the_installers_get_no_program_or_file_a_spider_chose() -> None:
    for name in ("LD_PRELOAD", "NODE_OPTIONS", "PYTHONPATH", "PYTHONSTARTUP", "BASH_ENV", "PATH", "HOME", "TMPDIR",
                 "CC", "CFLAGS", "GIT_SSH_COMMAND", "XDG_CONFIG_HOME", "UV_CACHE_DIR", "UV_CONFIG_FILE",
                 "npm_config_script_shell", "NPM_CONFIG_NODE_OPTIONS", "NPM_CONFIG_USERCONFIG", "NPM_CONFIG_GIT",
                 "PIP_FIND_LINKS", "PUPPETEER_CACHE_DIR", "YARN_YARN_PATH", "NVM_DIR"):
        assert withheld(name), name
    for name in ("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_PRIVATE_PASSWORD", "npm_config_registry",
                 "NPM_TOKEN", "PUPPETEER_SKIP_DOWNLOAD", "HTTPS_PROXY", "NODE_ENV", "START_URL", "CK_TASK_ID"):
        assert not withheld(name), name
    given = installer_env({"NODE_OPTIONS": "--require /x.js", "DB_PASSWORD": "s3cret", "NPM_TOKEN": "t",
                           "MY_REGISTRY_TOKEN": "m", "UV_INDEX_URL": "https://i/simple", "START_URL": "u"},
                          named={"MY_REGISTRY_TOKEN"})
    assert given.env == {"NPM_TOKEN": "t", "MY_REGISTRY_TOKEN": "m", "UV_INDEX_URL": "https://i/simple",
                         "START_URL": "u"}
    assert given.withheld == ("NODE_OPTIONS",) and given.secrets == ("DB_PASSWORD",)
    notice = given.notice()
    assert notice is not None and "NODE_OPTIONS" in notice and "DB_PASSWORD" in notice and "s3cret" not in notice
    assert install_key_env({"CFLAGS": "-O2", "UV_CACHE_DIR": "/x", "UV_RESOLUTION": "lowest"}) == {
        "UV_RESOLUTION": "lowest"}


# --------------------------------------------------------------------------- a project's requirements, unrun


def test_a_requirements_file_installs_no_line_of_the_projects_own_code(tmp_path: Path) -> None:
    code = _code(tmp_path / "p", {
        "requirements.txt": "-r base.txt\n-c pins.txt\n-e .\n./libs/own\n../outside\n/etc\n"
                            "-e git+https://example.org/x.git@v1#egg=xlib\nwheels/own-1.0-py3-none-any.whl\n"
                            "--find-links ./wheels\nrequests>=2  # a comment\n",
        "base.txt": "scrapy==2.11\n", "pins.txt": "twisted<24\n",
        "setup.py": "import os\nos.system('touch /tmp/pwned')\nsetup(install_requires=['itemadapter>=0.8'])\n",
        "libs/own/pyproject.toml": "[project]\nname='own'\nversion='1'\ndependencies=['lxml']\n",
        "libs/own/src/own/__init__.py": "", "wheels/own-1.0-py3-none-any.whl": "not really a wheel"})
    reqs = read_requirements(ProjectFiles(code), "requirements.txt")
    assert reqs.lines == ["scrapy==2.11", "itemadapter>=0.8", "lxml", "xlib @ git+https://example.org/x.git@v1",
                          "./wheels/own-1.0-py3-none-any.whl", "--find-links wheels", "requests>=2"]
    assert reqs.constraints == ["twisted<24"]
    assert reqs.python_path == [".", "libs/own/src"]
    assert reqs.wheels == {"wheels/own-1.0-py3-none-any.whl": "own-1.0-py3-none-any.whl"}
    text = "\n".join(reqs.notes)
    assert "-e . is the project itself: not built or installed" in text and "PYTHONPATH" in text
    assert "../outside names a path outside the project: left out" in text
    assert "/etc names a path outside the project" in text
    assert "installed as xlib @ git+https://example.org/x.git@v1" in text


def test_a_projects_requirements_are_read_from_its_files_never_by_running_it(tmp_path: Path) -> None:
    def reqs(files: dict[str, str]) -> tuple[list[str], list[str]]:
        root = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        got = project_requirements(ProjectFiles(_code(root, files)))
        return got.lines, got.unread

    assert reqs({"pyproject.toml": "[project]\nname='x'\nversion='1'\ndependencies=['a>=1', 'x[extra]']\n"}) == (
        ["a>=1"], [])
    assert reqs({"pyproject.toml": "[project]\nname='x'\nversion='1'\ndynamic=['dependencies']\n"
                                   "[tool.setuptools.dynamic]\ndependencies={file=['reqs.in']}\n",
                 "reqs.in": "b==2\n"}) == (["b==2"], [])
    lines, unread = reqs({"pyproject.toml": "[project]\nname='x'\nversion='1'\ndynamic=['dependencies']\n"})
    assert lines == [] and "dynamic" in unread[0]
    assert reqs({"pyproject.toml": "[tool.poetry.dependencies]\npython='^3.10'\nrequests='^2.28'\n"
                                   "bs4={version='~4.11', extras=['lxml']}\nopt={version='*', optional=true}\n"}) == (
        ["requests>=2.28,<3.0.0", "bs4[lxml]>=4.11,<4.12"], [])
    assert reqs({"setup.cfg": "[options]\ninstall_requires =\n    c>=3\n    d\n"}) == (["c>=3", "d"], [])
    assert reqs({"setup.py": "from setuptools import setup\nDEPS = ['e']\nsetup(name='x', install_requires=DEPS)\n"}) \
        == (["e"], [])
    lines, unread = reqs({"setup.py": "setup(install_requires=open('r.txt').read().split())\n"})
    assert lines == [] and "computes install_requires" in unread[0]
    assert literal_install_requires("setup(name='x')\n") == []
    assert poetry_constraint("^0.2.3") == ">=0.2.3,<0.3.0" and poetry_constraint("1.0 || 2.0") is None


def test_node_staging_drops_the_root_packages_install_scripts_and_program_settings(tmp_path: Path) -> None:
    manifest = {"name": "p", "version": "1.0.0", "scripts": {"preinstall": "x", "postinstall": "y", "prepare": "tsc",
                                                            "start": "node main.js"}, "dependencies": {"a": "1"}}
    code = _code(tmp_path / "p", {
        "package.json": json.dumps(manifest), ".pnpmfile.cjs": "module.exports = {}",
        ".npmrc": "registry=https://r.example/\nscript-shell=/home/x/evil.sh\nnode-options=--require ./e.js\n"
                  "//r.example/:_authToken=${MY_TOKEN}\ngit=/tmp/git\n",
        ".yarnrc.yml": "yarnPath: .yarn/releases/yarn.cjs\nplugins:\n  - path: .yarn/plugins/x.cjs\n"
                       "npmRegistryServer: https://r.example/\n"})
    staged, notes = node_staged(ProjectFiles(code))
    assert json.loads(staged["package.json"])["scripts"] == {"start": "node main.js"}
    assert json.loads(staged["package.json"])["dependencies"] == {"a": "1"}
    assert staged[".npmrc"].decode() == "registry=https://r.example/\n//r.example/:_authToken=${MY_TOKEN}\n"
    assert staged[".yarnrc.yml"].decode() == "npmRegistryServer: https://r.example/\n"
    assert ".pnpmfile.cjs" not in staged
    text = "\n".join(notes)
    assert "preinstall, postinstall, prepare are not run" in text and "script-shell, node-options, git" in text
    assert "yarnPath, plugins" in text and "--ignore-pnpmfile" in text


def test_dependency_files_are_read_without_following_a_link(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the agent's token\n")
    code = _code(tmp_path / "p", {"real/requirements.txt": "x\n"})
    (code / "requirements.txt").symlink_to(secret)
    (code / "linked").symlink_to(code / "real", target_is_directory=True)
    os.mkfifo(code / "fifo.txt")
    files = ProjectFiles(code)
    with pytest.raises(NotStageable, match=r"requirements\.txt: a symlink; not followed"):
        files.read("requirements.txt")
    with pytest.raises(NotStageable, match="a symlink on the way"):
        files.read("linked/requirements.txt")
    with pytest.raises(NotStageable, match=r"not a regular file \(a FIFO\)"):
        files.read("fifo.txt")
    assert files.read("real/requirements.txt") == b"x\n" and files.read("../secret.txt") is None
    assert files.read("absent.txt") is None


# --------------------------------------------------------------------------- the seal


def test_a_sealed_tree_has_no_write_bit_no_set_id_no_shared_inode_and_follows_no_link(tmp_path: Path) -> None:
    env = _code(tmp_path / "env", {"lib/site/mod.py": "x = 1\n", "bin/tool": "#!/bin/sh\n"})
    (env / "bin" / "tool").chmod(0o4775)
    outside = tmp_path / "outside.txt"
    outside.write_text("the cache's copy\n")
    os.link(outside, env / "lib" / "site" / "linked.py")
    (env / "lib" / "site" / "to-outside").symlink_to(outside)
    os.mkfifo(env / "lib" / "fifo")
    owner = (0, 0) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    done = seal(env, owner)
    assert done.copied == 1 and done.dropped >= 1
    for path in (env, env / "lib", env / "lib" / "site", env / "bin"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o555, path
    assert stat.S_IMODE((env / "lib" / "site" / "mod.py").stat().st_mode) == 0o444
    assert stat.S_IMODE((env / "bin" / "tool").stat().st_mode) == 0o555
    assert (env / "lib" / "site" / "linked.py").stat().st_nlink == 1 and outside.stat().st_nlink == 1
    assert stat.S_IMODE(outside.stat().st_mode) & 0o200  # what the link named is untouched
    assert not (env / "lib" / "fifo").exists()
    assert sealed_by(env, owner)
    remove_tree(env)
    assert not env.exists()


def test_environments_of_older_agents_are_collected_whatever_the_budget(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "envs"
    old, in_use, new = root / "py-old", root / "py-inuse", root / "py-new"
    for env, marker in ((old, {"key": "k1"}), (in_use, {"key": "k2"}), (new, {"key": "k3", "sealed": True})):
        env.mkdir(parents=True)
        (env / ".ckagent-env.json").write_text(json.dumps(marker))
    with caplog.at_level("INFO", "ckagent.code.envstore"):
        removed = collect(root, 0, {in_use})
    assert removed == [old] and in_use.exists() and new.exists()
    assert any("1 environment(s) an older agent built" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- real builds as the builder


THIRD_PARTY_BACKEND = """\
import base64, hashlib, io, os, zipfile
MARKER = {marker!r}

def _record(uid):
    with open(MARKER, "a") as fh:
        fh.write(f"{{uid}}\\n")

def get_requires_for_build_wheel(config_settings=None):
    return []

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _record(os.getuid())  # a third-party package's own build code: it runs as whoever installs
    dist = "ckthird-1.0.dist-info"
    files = {{"ckthird/__init__.py": b"BUILT = True\\n",
             f"{{dist}}/METADATA": b"Metadata-Version: 2.1\\nName: ckthird\\nVersion: 1.0\\n",
             f"{{dist}}/WHEEL": b"Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}}
    record = [f"{{p}},sha256={{base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()}},{{len(d)}}"
              for p, d in files.items()] + [f"{{dist}}/RECORD,,"]
    files[f"{{dist}}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    name = "ckthird-1.0-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        for p, d in files.items():
            zf.writestr(p, d)
    return name
"""
THIRD_PARTY_PYPROJECT = """\
[build-system]
requires = []
build-backend = "backend"
backend-path = ["."]

[project]
name = "ckthird"
version = "1.0"
"""
PROJECT_SETUP_PY = """\
import os
open({marker!r}, "a").write(f"project setup.py ran as {{os.getuid()}}\\n")
from setuptools import setup
setup(name="victim-project", version="1.0", install_requires=["ckdemo-dep==1.0"])
"""


@pytest.fixture
def reach() -> Iterator[Path]:
    """Where a test's builds happen: a directory every uid can enter (pytest's tmp_path is root's alone)."""
    with searchable_directory() as path:
        yield path


@pytest.fixture
def markers() -> Iterator[Path]:
    """A directory every uid can write: where a build script leaves its mark (if it runs at all)."""
    with world_directory() as path:
        yield path


def _builder_deps(tmp_path: Path, index: str, **kwargs: object) -> Dependencies:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    work.chmod(0o711)
    options: dict[str, object] = {"uv_path": None, "index": IndexChooser(index, index), "uv_cache_dir": None,
                                  "timeout": 120.0, "base_env": spider_base_env(), "python": spider_python(),
                                  "run_as": RunAs.of_uid(BUILDER_UID, str(work / "builder-home"))}
    options.update(kwargs)
    return Dependencies(work / "envs", **options)  # type: ignore[arg-type]


def _as(uid: int, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, user=uid, group=uid, extra_groups=[], capture_output=True, text=True, timeout=60,
                          check=False, cwd="/", **kwargs)  # type: ignore[call-overload]


def _write_attempt(uid: int, path: Path) -> str:
    """What happens when ``uid`` creates ``path``: "written" or the errno's name."""
    code = ("import errno, sys\ntry:\n    open(sys.argv[1], 'w').write('import os; print(\"POISONED\")\\n')\n"
            "    print('written')\nexcept OSError as exc:\n    print(errno.errorcode[exc.errno])\n")
    return _as(uid, ["/usr/bin/python3", "-I", "-c", code, str(path)]).stdout.strip()


@needs_root
async def test_a_python_env_is_built_as_the_builder_without_the_projects_code_and_no_spider_can_write_it(
        reach: Path, markers: Path) -> None:
    third = markers / "third-party-build"
    own = markers / "project-code"
    backend = {"pyproject.toml": THIRD_PARTY_PYPROJECT, "backend.py": THIRD_PARTY_BACKEND.format(marker=str(third))}
    with package_index(reach / "index", [("ckdemo_dep", "1.0", "VALUE = 42\n")], [("ckthird", "1.0", backend)]) \
            as index:
        deps = _builder_deps(reach, index.url)
        code = _code(reach / "victim", {"requirements.txt": "-e .\nckthird==1.0\n",
                                           "setup.py": PROJECT_SETUP_PY.format(marker=str(own)),
                                           "victim_project/__init__.py": "NAME = 'victim'\n", "main.py": ""})
        log = bytearray()
        with trio.fail_after(120):
            prepared = await deps.prepare("python", "victim", code, log.extend)
    assert prepared.env_dir is not None
    venv = prepared.env_dir
    text = log.decode()
    assert not own.exists(), own.read_text()  # the project's setup.py never ran
    assert third.read_text().split() == [str(BUILDER_UID)]  # the third-party build ran, as the builder
    assert f"as the node's builder, uid {BUILDER_UID}" in text
    assert "-e . is the project itself: not built or installed" in "\n".join(prepared.notes)
    assert prepared.env["PYTHONPATH"] == str(code)
    # sealed: root's, no write bit; marked ready as built by the builder
    marker = read_marker(venv)
    assert marker is not None and marker["sealed"] is True and f"builder={BUILDER_UID}" in str(marker["builder"])
    st = venv.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o555)
    site = next(venv.glob("lib/python*/site-packages"))
    for path in (site, site / "ckthird" / "__init__.py", venv / "bin", venv / "bin" / "python"):
        mode = path.lstat().st_mode
        assert path.lstat().st_uid == 0 and (stat.S_ISLNK(mode) or not mode & 0o222), path
    cache = deps.uv_cache_dir
    assert (cache.stat().st_uid, stat.S_IMODE(cache.stat().st_mode)) == (BUILDER_UID, 0o700)
    assert any(p.stat().st_uid == BUILDER_UID for p in cache.rglob("*") if not p.is_symlink())
    # spider A tries to poison what spider B's later task loads, and the cache B's next build reads
    assert _write_attempt(SPIDER_A, site / "zz_poison.pth") == "EACCES"
    assert _write_attempt(SPIDER_A, venv / "bin" / "scrapy") == "EACCES"
    assert _write_attempt(SPIDER_A, cache / "poison") == "EACCES"
    assert _as(SPIDER_A, ["ls", str(cache)]).returncode != 0
    assert _write_attempt(SPIDER_A, deps.builder.home / "poison") == "EACCES"
    # B's task runs clean, with the dependencies setup.py declared and the project on its PYTHONPATH
    run = _as(SPIDER_B, [str(venv / "bin" / "python"), "-c",
                         "import ckdemo_dep, ckthird, victim_project; print(ckdemo_dep.VALUE, victim_project.NAME)"],
              env={"PYTHONPATH": prepared.env["PYTHONPATH"], "PATH": "/usr/bin:/bin"})
    assert "POISONED" not in run.stdout + run.stderr
    assert run.stdout.split() == ["42", "victim"], run


@needs_root
@pytest.mark.skipif(NPM is None, reason="npm is not installed")
async def test_a_node_env_runs_its_dependencies_scripts_as_the_builder_never_the_projects(
        reach: Path, markers: Path) -> None:
    dep_marker, own_marker = markers / "dependency-script", markers / "project-script"
    record = "node -e \"require('fs').appendFileSync(process.argv[1], process.getuid() + '\\\\n')\" "
    with npm_registry([NpmPackage("ckdep", scripts={"postinstall": record + str(dep_marker)})]) as registry:
        deps = _builder_deps(reach, "http://127.0.0.1:9/simple")
        manifest = {"name": "victim", "version": "1.0.0", "dependencies": {"ckdep": "1.0.0"},
                    "scripts": {s: record + str(own_marker) for s in ("preinstall", "postinstall", "prepare")}}
        code = _code(reach / "victim", {"package.json": json.dumps(manifest), "index.js": ""})
        log = bytearray()
        with trio.fail_after(120):
            prepared = await deps.prepare("node", "victim", code, log.extend,
                                          task_env={"NPM_CONFIG_REGISTRY": registry.url})
    assert prepared.env_dir is not None
    env = prepared.env_dir
    assert not own_marker.exists(), own_marker.read_text()
    assert dep_marker.read_text().split() == [str(BUILDER_UID)]
    assert "preinstall, postinstall, prepare are not run" in "\n".join(prepared.notes)
    modules = env / "node_modules"
    assert (code / "node_modules").resolve() == modules.resolve()
    for path in (env, modules, modules / "ckdep", modules / "ckdep" / "index.js"):
        assert path.stat().st_uid == 0 and not path.stat().st_mode & 0o222, path
    assert not (env / ".npmrc").exists()
    cache = deps.npm_cache_dir
    assert (cache.stat().st_uid, stat.S_IMODE(cache.stat().st_mode)) == (BUILDER_UID, 0o700)
    # a spider writing node_modules through its working copy's link, or the npm cache
    assert _write_attempt(SPIDER_A, code / "node_modules" / "ckdep" / "index.js") == "EACCES"
    assert _write_attempt(SPIDER_A, code / "node_modules" / "evil.js") == "EACCES"
    assert _write_attempt(SPIDER_A, cache / "poison") == "EACCES"


@needs_root
async def test_an_existing_cache_of_another_identity_is_emptied_and_given_to_the_builder(reach: Path) -> None:
    deps = _builder_deps(reach, "http://127.0.0.1:9/simple")
    poisoned = deps.uv_cache_dir / "archive-v0" / "x" / "requests" / "__init__.py"
    poisoned.parent.mkdir(parents=True)
    poisoned.write_text("print('POISONED')\n")
    os.chown(deps.uv_cache_dir, SPIDER_A, SPIDER_A)  # one-user era: the spiders' uid filled it
    await trio.to_thread.run_sync(deps.setup)
    assert not poisoned.exists() and deps.uv_cache_dir.stat().st_uid == BUILDER_UID
    assert (deps.envs_root.stat().st_uid, stat.S_IMODE(deps.envs_root.stat().st_mode)) == (0, 0o711)


def test_the_builder_of_an_agent_that_is_not_root_is_the_agent(tmp_path: Path) -> None:
    builder = Builder.of(None, tmp_path)
    assert builder.uid == os.geteuid() and builder.home == tmp_path / "builder-home"
    assert builder.env()["HOME"] == str(tmp_path / "builder-home")
    assert builder.env()["TMPDIR"] == str(tmp_path / "builder-home" / "tmp")
    dedicated = Builder.of(RunAs.of_uid(BUILDER_UID, str(tmp_path / "bh")), tmp_path)
    assert dedicated.home == tmp_path / "bh" and dedicated.identity != builder.identity
    assert errno.EACCES  # (the errno the spiders get, named in the docs)


# --------------------------------------------------------------------------- the other identity levels


@needs_root
async def test_at_one_user_the_env_is_roots_but_the_caches_are_the_spiders_user(reach: Path) -> None:
    """``task.run_as_user: NAME``: the builder is that user, so the finished environment is still
    root's and read-only to it — but the caches are its own: what the level cannot keep (the docs)."""
    user = RunAs.lookup("nobody")
    with package_index(reach / "index", [("ckdemo_dep", "1.0", "VALUE = 42\n")]) as index:
        deps = _builder_deps(reach, index.url, run_as=user)
        code = _code(reach / "p", {"requirements.txt": "ckdemo-dep==1.0\n", "main.py": ""})
        with trio.fail_after(120):
            prepared = await deps.prepare("python", "p", code, lambda _: None)
    assert prepared.env_dir is not None
    site = next(prepared.env_dir.glob("lib/python*/site-packages"))
    assert prepared.env_dir.stat().st_uid == 0 and site.stat().st_uid == 0
    assert _write_attempt(user.uid, site / "zz_poison.pth") == "EACCES"
    assert deps.uv_cache_dir.stat().st_uid == user.uid
    assert _write_attempt(user.uid, deps.uv_cache_dir / "planted") == "written"  # the level's limit


ATTACKER = """\
import errno, os, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
try:
    open(os.path.join(site, "zz_poison.pth"), "w").write("import os; print('POISONED by ' + os.environ.get('CK_SPIDER_ID', '?'))\\n")
    print("wrote", site)
except OSError as exc:
    print("refused", errno.errorcode[exc.errno], site)
"""
VICTIM = "print('victim ran clean')\n"


@pytest.mark.slow
def test_at_agent_user_a_spider_writing_its_environment_gets_eacces(pyz: Path) -> None:
    """A non-root agent (``nobody``, with the session's pyz): spiders and builder are its own uid, the
    environment is sealed by mode alone — a write by mistake (``pip install`` at run time) is refused,
    and the next spider's interpreter loads nothing the first one tried to plant."""
    import pwd

    if os.geteuid() != 0:
        pytest.skip("running the agent as another user needs root")
    beside = Path(sys.executable).parent / "uv"  # the dev venv's; else the one on PATH
    uv = beside if beside.is_file() else Path(shutil.which("uv") or "/nonexistent/uv")
    if not uv.is_file():
        pytest.skip("no uv to give the agent's user")
    nobody = pwd.getpwnam("nobody")
    with world_directory() as reach:
        (reach / "bin").mkdir(mode=0o755)
        shutil.copy(pyz, reach / "bin" / "ckagent.pyz")
        shutil.copy(uv, reach / "bin" / "uv")
        home = reach / "home"
        home.mkdir()
        os.chown(home, nobody.pw_uid, nobody.pw_gid)
        for name, text in (("attacker", ATTACKER), ("victim", VICTIM)):
            _code(reach / name, {"main.py": text})
        env = {"HOME": str(home), "USER": "nobody", "SHIV_ROOT": str(home / "shiv"), "PATH": f"{reach}/bin:/usr/bin:/bin",
               "LANG": "C.UTF-8"}

        def run(name: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["/usr/bin/python3", str(reach / "bin" / "ckagent.pyz"), "exec", str(reach / name),
                                   "--framework", "python", "--items", str(home / f"{name}.jsonl"),
                                   "--artifacts", str(home / f"{name}-artifacts")],
                                  cwd=home, env=env, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                                  capture_output=True, text=True, timeout=300, check=False)

        attacker, victim = run("attacker"), run("victim")
    assert attacker.returncode == 0, attacker.stdout + attacker.stderr
    assert "refused EACCES" in attacker.stdout, attacker.stdout
    assert victim.returncode == 0 and "victim ran clean" in victim.stdout, victim.stdout + victim.stderr
    assert "POISONED" not in victim.stdout + victim.stderr


def test_a_refused_write_into_the_environment_gets_a_hint_in_the_task_log() -> None:
    from ckagent.code.builder import read_only_hint

    pip = ("ERROR: Could not install packages due to an OSError: [Errno 13] Permission denied: "
           "'/var/lib/ckagent/envs/py-0123456789abcdef01234567/lib/python3.11/site-packages/requests'")
    npm = "npm error EACCES: permission denied, mkdir '/work/tasks/t/work/node_modules/.cache'"
    assert read_only_hint(pip) is not None and read_only_hint(npm) is not None
    assert read_only_hint("PermissionError: [Errno 13] Permission denied: '/etc/shadow'") is None
    assert read_only_hint("site-packages/x.py: all fine") is None


@needs_root
def test_a_builder_process_still_writing_a_sealed_environment_is_killed_and_the_environment_not_used(
        reach: Path) -> None:
    from ckagent.code.builder import StillWritten, writers
    from ckagent.code.envstore import mark_ready

    env = reach / "py-x"
    env.mkdir()
    (env / "lib").mkdir()
    os.chown(env, BUILDER_UID, BUILDER_UID)
    os.chown(env / "lib", BUILDER_UID, BUILDER_UID)
    holder = subprocess.Popen(["/usr/bin/python3", "-I", "-c", "import sys, time\nf = open(sys.argv[1], 'w')\n"
                               "print('open', flush=True)\ntime.sleep(60)\n", str(env / "lib" / "late.py")],
                              stdout=subprocess.PIPE, text=True, user=BUILDER_UID, group=BUILDER_UID, extra_groups=[])
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        assert [found.pid for found in writers(env, BUILDER_UID)] == [holder.pid]
        with pytest.raises(StillWritten, match=f"process\\(es\\) {holder.pid} of the builder"):
            mark_ready(env, "k", "py", owner=(0, 0), builder="b", builder_uid=BUILDER_UID)
        assert holder.wait(timeout=10) == -9
        assert read_marker(env) is None  # not ready: its next build starts from nothing
    finally:
        holder.kill()
        holder.communicate()


@needs_root
def test_the_start_says_when_the_builder_cannot_run_an_installer(reach: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    hidden = reach / "root-only"
    hidden.mkdir(mode=0o700)
    uv = Path(sys.executable).parent / "uv"
    if not uv.is_file():
        pytest.skip("no uv beside the suite's interpreter")
    shutil.copy(uv, hidden / "uv")
    env = {**spider_base_env(), "PATH": "/usr/bin:/bin"}
    deps = _builder_deps(reach, "http://127.0.0.1:9/simple", uv_path=hidden / "uv", agent_bin=None, base_env=env)
    hidden.chmod(0o700)  # _builder_deps opened the tree for searching: this one stays root's alone
    with caplog.at_level("WARNING", "ckagent.code.deps"):
        deps.setup()
    warned = [r.getMessage() for r in caplog.records if "cannot run uv" in r.getMessage()]
    assert warned and f"uid {BUILDER_UID}" in warned[0] and "deps.uv_path" in warned[0], caplog.text


MEMBER_BACKEND = """\
import os
open({marker!r}, "a").write(f"member backend ran as {{os.getuid()}}\\n")
def get_requires_for_build_wheel(config_settings=None):
    return []
def build_editable(*args, **kwargs):
    raise RuntimeError("never built")
build_wheel = build_editable
"""


@needs_root
async def test_a_uv_workspace_member_is_put_on_pythonpath_never_built(reach: Path, markers: Path) -> None:
    """uv.lock: ``uv export`` names a workspace member as ``-e ./libs/mylib`` — the project's own code.
    It is left out of the install (its locked requirements stay) and goes on the spider's PYTHONPATH."""
    ran = markers / "member-backend"
    member_project = ("[project]\nname = 'mylib'\nversion = '0.1'\ndependencies = ['ckdemo-dep==1.0']\n"
                      "[build-system]\nrequires = []\nbuild-backend = 'backend'\nbackend-path = ['.']\n")
    root_project = ("[project]\nname = 'proj'\nversion = '0.1'\nrequires-python = '>=3.8'\ndependencies = ['mylib']\n"
                    "[tool.uv.sources]\nmylib = { workspace = true }\n[tool.uv.workspace]\nmembers = ['libs/*']\n")
    with package_index(reach / "index", [("ckdemo_dep", "1.0", "VALUE = 42\n")]) as index:
        code = _code(reach / "proj", {"pyproject.toml": root_project, "main.py": "",
                                      "libs/mylib/pyproject.toml": member_project,
                                      "libs/mylib/backend.py": MEMBER_BACKEND.format(marker=str(ran)),
                                      "libs/mylib/src/mylib/__init__.py": "NAME = 'mylib'\n"})
        uv = Path(sys.executable).parent / "uv"
        with trio.fail_after(120):
            locked = await trio.run_process(
                [str(uv), "lock", "--index-url", index.url, "--python", spider_python()], cwd=code, capture_stdout=True,
                capture_stderr=True, check=False,
                env={**spider_base_env(), "UV_NO_CONFIG": "1", "UV_CACHE_DIR": str(reach / "lock-cache")})
        assert locked.returncode == 0, locked.stderr.decode()
        ran.unlink(missing_ok=True)  # the lock may read the member; only what the builder runs counts
        deps = _builder_deps(reach, index.url)
        log = bytearray()
        with trio.fail_after(120):
            prepared = await deps.prepare("python", "proj", code, log.extend)
    assert not ran.exists(), ran.read_text()
    assert prepared.env["PYTHONPATH"] == str(code / "libs" / "mylib" / "src")
    assert "uv.lock: mylib is the project's own libs/mylib: not built or installed" in "\n".join(prepared.notes)
    assert "left out of the export (the project's own code): -e ./libs/mylib" in log.decode()
    assert prepared.env_dir is not None
    site = next(prepared.env_dir.glob("lib/python*/site-packages"))
    assert (site / "ckdemo_dep").is_dir() and not list(site.glob("mylib*"))
