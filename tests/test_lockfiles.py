"""yarn.lock and pnpm-lock.yaml on a node with only node and npm (issue 37, item 6): the tool the lock needs
is fetched from the npm registry the node reaches (here: tests/harness/npmregistry.py on 127.0.0.1,
serving the real yarn and pnpm tarballs), pinned by ``packageManager``, cached per version and sealed;
never corepack; a tool that cannot be fetched is DEPS_FAILED saying what was tried and what to install.

Each project depends on ``ckdep`` ``^1.0.0``; the registry serves 1.0.0 and 1.1.0 and the lock pins
1.0.0, so a run that prints 1.0.0 installed what the lock pins (npm would have taken 1.1.0).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (
    NpmPackage,
    agent_settings,
    berry_lock,
    node_only_bin,
    npm_registry,
    packed_tools,
    pnpm_lock,
    running_agent,
    searchable_directory,
    yarn_v1_lock,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ckagent.code.deps import Dependencies, DepsError, IndexChooser, spider_base_env
from ckagent.code.deps_node import NPM_OPTIONS, npm_install_command
from ckagent.code.nodetools import _CACHE_ENTRY, SEMVER, parse_package_manager, wanted_tool, yarn_release
from ckagent.devmaster.client import zip_directory
from ckagent.node.runas import RunAs

pytestmark = pytest.mark.skipif(shutil.which("npm") is None or shutil.which("node") is None,
                                reason="needs node and npm (apt-get install nodejs npm)")

BUILDER_UID, SPIDER_UID = 3_310_000_201, 3_310_000_202
"""Uids no account has: the builder's and a spider's."""
SPECS = ["yarn@1.22.22", "yarn@1.22.21", "pnpm@9.1.0", "@yarnpkg/cli-dist@4.1.0"]
DEP = [NpmPackage("ckdep", "1.0.0", files={"index.js": "module.exports = '1.0.0';\n"}),
       NpmPackage("ckdep", "1.1.0", files={"index.js": "module.exports = '1.1.0';\n"})]
PINS = {"ckdep": ("^1.0.0", "1.0.0")}
INDEX_JS = "console.log('ckdep ' + require('ckdep'));\n"


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NpmPackage]:
    """The real tools' packages, by spec (fetched once by ``npm pack``; skipped when npm cannot)."""
    packed = packed_tools(tmp_path_factory.mktemp("packed"), SPECS)
    if not packed:
        pytest.skip("npm pack could not fetch yarn and pnpm (no npm registry reachable)")
    return {spec: NpmPackage.real(data) for spec, data in packed.items()}


@pytest.fixture
def node_only(tmp_path: Path) -> Iterator[Dependencies]:
    """Dependencies on a node whose PATH has node, npm and corepack (with its shims) but no yarn or pnpm."""
    env = {**spider_base_env(), "PATH": str(node_only_bin(tmp_path / "bin"))}
    yield Dependencies(tmp_path / "envs", uv_path=None, index=IndexChooser("http://127.0.0.1:9/", None),
                       uv_cache_dir=tmp_path / "uv-cache", timeout=120.0, base_env=env)


def _project(where: Path, files: dict[str, str], manifest: dict[str, object] | None = None) -> Path:
    package = {"name": "lockdemo", "version": "1.0.0", "private": True, "main": "index.js",
               "dependencies": {"ckdep": "^1.0.0"}, **(manifest or {})}
    for rel, text in {"package.json": json.dumps(package), "index.js": INDEX_JS, **files}.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(text)
    return where


def _run(code: Path) -> str:
    done = subprocess.run(["node", "index.js"], cwd=code, capture_output=True, timeout=60, check=True)
    return done.stdout.decode().strip()


def _cached(envs: Path) -> list[str]:
    return sorted(entry.name for entry in (envs / ".tools").iterdir() if not entry.name.startswith("."))


@pytest.mark.slow
async def test_a_yarn_v1_project_installs_its_lock_with_yarn_fetched_from_the_registry_and_runs(
        tmp_path: Path, node_only: Dependencies, tools: dict[str, NpmPackage]) -> None:
    canary = tmp_path / "injected"
    with npm_registry([*DEP, tools["yarn@1.22.21"], tools["yarn@1.22.22"]]) as registry:
        env = {"NPM_CONFIG_REGISTRY": registry.url}
        code = _project(tmp_path / "p1", {"yarn.lock": yarn_v1_lock(registry, PINS)})
        log = bytearray()
        with trio.fail_after(240):
            first = await node_only.prepare("node", "s1", code, log.extend, task_env=env)
            text = bytes(log).decode()
            assert _run(code) == "ckdep 1.0.0"  # what the lock pins, not package.json's highest
            # A hostile packageManager is not used (no shell, no path): the cached yarn 1 installs it.
            hostile = f"yarn@1.22.22; touch {canary}"
            other = _project(tmp_path / "p2", {"yarn.lock": yarn_v1_lock(registry, PINS), "x.js": ""},
                             {"packageManager": hostile})
            log2 = bytearray()
            await node_only.prepare("node", "s2", other, log2.extend, task_env=env)
    assert not first.cache_hit
    assert f"fetching yarn@1 from {registry.url} as the node's builder (not corepack)" in text
    assert "corepack's shim" in text and "cannot download" not in text
    assert "yarn.js install --frozen-lockfile" in text and "yarn.lock: installing exactly what it pins with yarn 1.22.22" \
        in text
    yarn_path = "/yarn/-/yarn-1.22.22.tgz"
    assert registry.downloads[yarn_path] == 1 and "/yarn/-/yarn-1.22.21.tgz" not in registry.downloads
    assert _run(other) == "ckdep 1.0.0" and not canary.exists()
    text2 = bytes(log2).decode()
    assert "packageManager" in text2 and "not used" in text2 and "fetching" not in text2
    envs = tmp_path / "envs"
    (name,) = _cached(envs)
    assert name.startswith("yarn-1.22.22-")
    top = envs / ".tools" / name
    st_top = os.lstat(top)
    assert stat.S_IMODE(st_top.st_mode) == 0o555 and (os.geteuid() != 0 or st_top.st_uid == 0)
    script = top / "node_modules" / "yarn" / "bin" / "yarn.js"
    assert not os.lstat(script).st_mode & 0o222


@pytest.mark.slow
async def test_through_the_agent_a_yarn_and_a_pnpm_spider_run_on_a_node_without_either(
        dev_master: Any, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        tools: dict[str, NpmPackage]) -> None:
    admin = dev_master.admin
    monkeypatch.setenv("PATH", str(node_only_bin(tmp_path / "bin")))  # the agent's PATH: node, npm, corepack
    with npm_registry([*DEP, tools["yarn@1.22.22"], tools["pnpm@9.1.0"]]) as registry:
        tasks = {}
        for tool, lock in (("yarn", {"yarn.lock": yarn_v1_lock(registry, PINS)}),
                           ("pnpm", {"pnpm-lock.yaml": pnpm_lock(registry, PINS)})):
            code = _project(tmp_path / tool, lock)
            spider = await admin.create_spider(name=f"lock-{tool}", framework="node")
            await admin.upload_package(spider, await trio.to_thread.run_sync(zip_directory, code))
            tasks[tool] = spider
        settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
        async with running_agent(nursery, settings):
            ids = {tool: await admin.create_task(spider, env={"NPM_CONFIG_REGISTRY": registry.url})
                   for tool, spider in tasks.items()}
            with trio.fail_after(240):
                done = {tool: await admin.wait_task_final(task_id, 240) for tool, task_id in ids.items()}
    for tool, task_id in ids.items():
        log = "\n".join(await admin.get_logs(task_id))
        assert done[tool]["status"] == "SUCCESS", (done[tool], log[-3000:])
        assert f"fetching {tool}@" in log and "ckdep 1.0.0" in log, log[-3000:]


@pytest.mark.slow
async def test_a_pnpm_project_pinned_by_package_manager(tmp_path: Path, node_only: Dependencies,
                                                        tools: dict[str, NpmPackage]) -> None:
    with npm_registry([*DEP, tools["pnpm@9.1.0"]]) as registry:
        code = _project(tmp_path / "p", {"pnpm-lock.yaml": pnpm_lock(registry, PINS)},
                        {"packageManager": "pnpm@9.1.0+sha512." + "ab" * 64})
        log = bytearray()
        with trio.fail_after(240):
            await node_only.prepare("node", "s", code, log.extend, task_env={"NPM_CONFIG_REGISTRY": registry.url})
    text = bytes(log).decode()
    assert "fetching pnpm@9.1.0 from" in text and "package.json packageManager pnpm@9.1.0" in text
    assert "pnpm.cjs install --frozen-lockfile --ignore-pnpmfile" in text
    assert _run(code) == "ckdep 1.0.0"
    (name,) = _cached(tmp_path / "envs")
    assert name.startswith("pnpm-9.1.0-")


@pytest.mark.slow
async def test_a_yarn_berry_project_with_its_yarnrc_installs_with_yarn_4_from_the_npm_registry(
        tmp_path: Path, node_only: Dependencies, tools: dict[str, NpmPackage]) -> None:
    cli = tools["@yarnpkg/cli-dist@4.1.0"]
    assert cli.tarball is not None
    with npm_registry([*DEP, cli]) as registry:
        yarnrc = f'npmRegistryServer: "{registry.url}"\nunsafeHttpWhitelist:\n  - "127.0.0.1"\n'
        manifest = {"name": "lockdemo", "version": "1.0.0", "private": True, "main": "index.js",
                    "dependencies": {"ckdep": "^1.0.0"}, "packageManager": "yarn@4.1.0"}
        # The author's lock, made while the registry had only ckdep 1.0.0.
        with npm_registry(DEP[:1]) as older:
            older_rc = yarnrc.replace(registry.url, older.url)
            lock = berry_lock(older, cli.tarball, {"package.json": json.dumps(manifest), ".yarnrc.yml": older_rc},
                              tmp_path / "author")
        assert "__metadata:" in lock and "ckdep@npm:1.0.0" in lock
        code = _project(tmp_path / "p", {"yarn.lock": lock, ".yarnrc.yml": yarnrc}, {"packageManager": "yarn@4.1.0"})
        log = bytearray()
        with trio.fail_after(240):
            await node_only.prepare("node", "s", code, log.extend, task_env={"NPM_CONFIG_REGISTRY": registry.url})
    text = bytes(log).decode()
    assert "fetching @yarnpkg/cli-dist@4.1.0 from" in text and "yarn.js install --immutable" in text
    assert _run(code) == "ckdep 1.0.0"
    (name,) = _cached(tmp_path / "envs")
    assert name.startswith("yarn-4.1.0-")


@pytest.mark.slow
async def test_a_package_manager_pin_is_honoured_over_the_newest(tmp_path: Path, node_only: Dependencies,
                                                                 tools: dict[str, NpmPackage]) -> None:
    with npm_registry([*DEP, tools["yarn@1.22.21"], tools["yarn@1.22.22"]]) as registry:
        code = _project(tmp_path / "p", {"yarn.lock": yarn_v1_lock(registry, PINS)}, {"packageManager": "yarn@1.22.21"})
        log = bytearray()
        with trio.fail_after(240):
            await node_only.prepare("node", "s", code, log.extend, task_env={"NPM_CONFIG_REGISTRY": registry.url})
    assert "with yarn 1.22.21" in bytes(log).decode()
    assert registry.downloads == {"/yarn/-/yarn-1.22.21.tgz": 1, "/ckdep/-/ckdep-1.0.0.tgz": 1}
    assert _run(code) == "ckdep 1.0.0"
    assert [n.split("-")[1] for n in _cached(tmp_path / "envs")] == ["1.22.21"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a builder uid of its own needs root")
async def test_the_builder_uid_fetches_the_tool_and_no_spider_can_write_it(tools: dict[str, NpmPackage]) -> None:
    with searchable_directory() as reach:
        work = reach / "work"
        work.mkdir(mode=0o711)
        env = {**spider_base_env(), "PATH": str(node_only_bin(reach / "bin"))}
        deps = Dependencies(work / "envs", uv_path=None, index=IndexChooser("http://127.0.0.1:9/", None),
                            uv_cache_dir=None, timeout=120.0, base_env=env,
                            run_as=RunAs.of_uid(BUILDER_UID, str(work / "builder-home")))
        with npm_registry([*DEP, tools["pnpm@9.1.0"]]) as registry:
            code = _project(reach / "p", {"pnpm-lock.yaml": pnpm_lock(registry, PINS)})
            log = bytearray()
            with trio.fail_after(240):
                await deps.prepare("node", "s", code, log.extend, task_env={"NPM_CONFIG_REGISTRY": registry.url})
        text = bytes(log).decode()
        assert f"as the node's builder, uid {BUILDER_UID}" in text and "fetching pnpm@9 from" in text
        assert _run(code) == "ckdep 1.0.0"
        (name,) = _cached(work / "envs")
        top = work / "envs" / ".tools" / name
        script = top / "node_modules" / "pnpm" / "bin" / "pnpm.cjs"
        for path in (top, script, script.parent):
            assert path.stat().st_uid == 0 and not path.stat().st_mode & 0o222, path
        cache = deps.npm_cache_dir
        assert (cache.stat().st_uid, stat.S_IMODE(cache.stat().st_mode)) == (BUILDER_UID, 0o700)
        for target in (script, top / "evil.js", work / "envs" / ".tools" / "pnpm-9.9.9-000000000000"):
            assert _write_attempt(SPIDER_UID, target) == "EACCES", target


def _write_attempt(uid: int, path: Path) -> str:
    """What happens when ``uid`` creates ``path``: "written" or the errno's name."""
    code = ("import errno, sys\ntry:\n    open(sys.argv[1], 'w').write('x')\n    print('written')\n"
            "except OSError as exc:\n    print(errno.errorcode[exc.errno])\n")
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", code, str(path)], user=uid, group=uid, extra_groups=[],
                          capture_output=True, text=True, timeout=60, check=False, cwd="/")
    return done.stdout.strip()


@pytest.mark.slow
async def test_a_tool_that_cannot_be_fetched_says_what_was_tried_and_what_to_install(
        tmp_path: Path, node_only: Dependencies) -> None:
    with npm_registry(DEP) as registry:  # no yarn in it
        code = _project(tmp_path / "p", {"yarn.lock": yarn_v1_lock(registry, PINS)}, {"packageManager": "yarn@1.22.22"})
        with trio.fail_after(240), pytest.raises(DepsError) as caught:
            url = registry.url.replace("http://", "http://ck:s3cret@")
            await node_only.prepare("node", "s", code, lambda _: None, task_env={"NPM_CONFIG_REGISTRY": url})
    message = str(caught.value)
    assert "yarn.lock is installed with yarn 1.22.22 (package.json packageManager yarn@1.22.22)" in message
    shown = registry.url.replace("http://", "http://***@")
    assert "corepack's shim" in message and f"`npm install yarn@1.22.22` from {shown}" in message
    assert "404" in message and "s3cret" not in message  # npm's own words, from its last lines
    assert "npm install -g yarn@1.22.22" in message and "NPM_CONFIG_REGISTRY" in message
    assert "cannot download" not in message
    assert not [e for e in (tmp_path / "envs" / ".tools").iterdir()]  # the scratch directory is gone


def _fake_yarn(bin_dir: Path, version: str) -> None:
    """``yarn`` on PATH as an npm package's script (its version in its package.json) that 'installs' by
    writing a ckdep that says it was this yarn."""
    package = bin_dir.parent / "lib" / "yarn"
    (package / "bin").mkdir(parents=True)
    (package / "package.json").write_text(json.dumps({"name": "yarn", "version": version}))
    script = package / "bin" / "yarn.js"
    said = json.dumps(f"module.exports = 'from the node\\'s yarn {version}';")
    script.write_text("#!/usr/bin/env node\nconst fs = require('fs');\nfs.mkdirSync('node_modules/ckdep', "
                      f"{{recursive: true}});\nfs.writeFileSync('node_modules/ckdep/index.js', {said});\n")
    script.chmod(0o755)
    (bin_dir / "yarn").unlink(missing_ok=True)
    (bin_dir / "yarn").symlink_to(script)


@pytest.mark.slow
async def test_the_nodes_own_yarn_is_used_when_its_version_fits_else_the_pin_is_fetched(
        tmp_path: Path, node_only: Dependencies, tools: dict[str, NpmPackage]) -> None:
    _fake_yarn(tmp_path / "bin", "1.22.22")
    with npm_registry([*DEP, tools["yarn@1.22.21"]]) as registry:
        env = {"NPM_CONFIG_REGISTRY": registry.url}
        own = _project(tmp_path / "own", {"yarn.lock": yarn_v1_lock(registry, PINS)})
        pinned = _project(tmp_path / "pinned", {"yarn.lock": yarn_v1_lock(registry, PINS)},
                          {"packageManager": "yarn@1.22.21"})
        log = bytearray()
        with trio.fail_after(240):
            await node_only.prepare("node", "a", own, lambda _: None, task_env=env)
            await node_only.prepare("node", "b", pinned, log.extend, task_env=env)
    assert _run(own) == "ckdep from the node's yarn 1.22.22"
    assert f"{tmp_path / 'bin' / 'yarn'} on PATH is yarn 1.22.22, not yarn 1.22.21: fetching yarn@1.22.21" in \
        bytes(log).decode()
    assert _run(pinned) == "ckdep 1.0.0"


@pytest.mark.slow
async def test_a_fetched_package_that_is_not_the_tool_is_refused_and_not_kept(
        tmp_path: Path, node_only: Dependencies) -> None:
    with npm_registry([*DEP, NpmPackage("yarn", "1.22.22")]) as registry:  # a "yarn" without a yarn command
        code = _project(tmp_path / "p", {"yarn.lock": yarn_v1_lock(registry, PINS)})
        with trio.fail_after(240), pytest.raises(DepsError) as caught:
            await node_only.prepare("node", "s", code, lambda _: None, task_env={"NPM_CONFIG_REGISTRY": registry.url})
    assert "npm installed no yarn of yarn 1.x with a `yarn` command inside it" in str(caught.value)
    assert "npm install -g yarn@1" in str(caught.value)
    assert not list((tmp_path / "envs" / ".tools").iterdir())


def test_a_fetch_takes_only_the_registry_of_the_tasks_env(tmp_path: Path) -> None:
    deps = Dependencies(tmp_path / "envs", uv_path=None, index=IndexChooser("http://127.0.0.1:9/", None),
                        uv_cache_dir=None, timeout=60.0, base_env={"PATH": "/usr/bin", "HTTPS_PROXY": "http://node:3128"})
    given = {"npm_config_registry": "http://127.0.0.1:1/", "NPM_CONFIG_REGISTRY": "http://127.0.0.1:2/",
             "NPM_CONFIG_STRICT_SSL": "false", "npm_config_@yarnpkg:registry": "http://127.0.0.1:3/",
             "HTTPS_PROXY": "http://spider:8080", "NODE_TLS_REJECT_UNAUTHORIZED": "0", "CK_TASK_ID": "t1"}
    env = deps.node.tools.fetch_env(given, "/bin")
    npm = {name: value for name, value in env.items() if name.lower().startswith("npm_config_")}
    assert npm == {"npm_config_registry": "http://127.0.0.1:2/", "npm_config_cache": str(deps.npm_cache_dir),
                   "npm_config_update_notifier": "false"}
    assert env["HTTPS_PROXY"] == "http://node:3128" and "NODE_TLS_REJECT_UNAUTHORIZED" not in env
    assert env["CK_TASK_ID"] == "t1" and env["PATH"] == "/bin"


def test_the_lock_decides_the_tool_and_its_major() -> None:
    yarn1 = {"package.json": b"{}", "yarn.lock": b"# yarn lockfile v1\n"}
    want = wanted_tool(yarn1)
    assert want is not None and (want.tool, want.major, want.version, want.package) == ("yarn", 1, None, "yarn")
    assert want.install_argv(["y"]) == ["y", "install", "--frozen-lockfile"]
    berry = {"package.json": b"{}", "yarn.lock": b'__metadata:\n  version: 8\n  cacheKey: 10c0\n'}
    want = wanted_tool(berry)
    assert want is not None and (want.major, want.package) == (4, "@yarnpkg/cli-dist")
    assert want.install_argv(["y"]) == ["y", "install", "--immutable"]
    assert want.env({}, Path("/h"))["YARN_NODE_LINKER"] == "node-modules" and "YARN_NODE_LINKER" not in want.env(
        {"YARN_NODE_LINKER": "pnp"}, Path("/h"))
    three = wanted_tool({"yarn.lock": b'__metadata:\n  version: 6\n'})
    assert three is not None and three.major == 3
    pinned = wanted_tool({"package.json": b'{"packageManager": "yarn@4.1.0"}', "yarn.lock": berry["yarn.lock"]})
    assert pinned is not None and (pinned.version, pinned.spec, pinned.package) == ("4.1.0", "4.1.0", "@yarnpkg/cli-dist")
    for lock, major in ((b"lockfileVersion: '9.0'\n", 9), (b"lockfileVersion: '6.0'\n", 8), (b"lockfileVersion: 5.4\n", 7),
                        (b"lockfileVersion: 5.3\n", 6)):
        want = wanted_tool({"pnpm-lock.yaml": lock})
        assert want is not None and (want.tool, want.major) == ("pnpm", major)
    both = {"pnpm-lock.yaml": b"lockfileVersion: '9.0'\n", "yarn.lock": b"# yarn lockfile v1\n"}
    assert wanted_tool(both).tool == "pnpm"  # type: ignore[union-attr]
    assert wanted_tool({**both, "package.json": b'{"packageManager": "yarn@1.22.22"}'}).tool == "yarn"  # type: ignore[union-attr]
    assert wanted_tool({**both, "package-lock.json": b"{}"}) is None
    assert npm_install_command({"package-lock.json": b""}, "npm") == ["npm", "ci", *NPM_OPTIONS]
    assert npm_install_command({}, "npm") == ["npm", "install", *NPM_OPTIONS]
    rc = b'nodeLinker: node-modules\nyarnPath: .yarn/releases/yarn-3.6.4.cjs\n'
    assert yarn_release(rc) == "3.6.4" and yarn_release(b"yarnPath: ./yarn-../../x.cjs\n") is None
    released = wanted_tool(berry, yarn_release(rc))
    assert released is not None and (released.version, released.package) == ("3.6.4", "@yarnpkg/cli-dist")
    assert "yarnPath names yarn-3.6.4" in released.why
    over = wanted_tool({**berry, "package.json": b'{"packageManager": "yarn@4.1.0"}'}, "3.6.4")
    assert over is not None and over.version == "4.1.0"  # packageManager first
    other = wanted_tool({"package.json": b'{"packageManager": "pnpm@9.1.0"}', "yarn.lock": b"# yarn lockfile v1\n"})
    assert other is not None and other.version is None and "names pnpm but the lock is yarn.lock" in other.notes[0]


HOSTILE = st.one_of(
    st.text(max_size=80),
    st.builds(lambda tool, rest: f"{tool}@{rest}", st.sampled_from(["yarn", "pnpm", "npm", "bun", "../yarn"]),
              st.text(alphabet=st.characters(codec="utf-8"), max_size=60)),
    st.builds(lambda v, tail: f"yarn@{v}{tail}", st.from_regex(SEMVER, fullmatch=True),
              st.sampled_from(["", ";id", "/../../x", "\n", " && id", "$(id)", "`id`", "+sha512.zz", "+sha1." + "a" * 40])),
)


@settings(max_examples=400, deadline=None)
@given(HOSTILE, HOSTILE)
def test_a_hostile_package_manager_never_reaches_a_path_or_a_shell(value: str, yarn_path: str) -> None:
    pin = parse_package_manager(value)
    release = yarn_release(f"yarnPath: .yarn/releases/{yarn_path}\n".encode(errors="surrogateescape"))
    assert release is None or SEMVER.fullmatch(release)
    want = wanted_tool({"package.json": json.dumps({"packageManager": value}).encode(), "yarn.lock": b"# yarn lockfile v1\n"},
                       release)
    assert want is not None and want.tool == "yarn"
    if pin is not None:
        assert pin[0] in ("yarn", "pnpm", "npm", "bun") and SEMVER.fullmatch(pin[1])
        assert value.startswith(f"{pin[0]}@{pin[1]}") and value[len(pin[0]) + 1 + len(pin[1]):][:1] in ("", "+")
    if want.version is not None:
        assert SEMVER.fullmatch(want.version) and want.version in ((pin or ("", ""))[1], release)
    # What reaches npm's argv and the cache's entry name is made of checked parts only.
    spec = f"{want.package}@{want.spec}"
    assert spec in ("yarn@1", "@yarnpkg/cli-dist@" + want.spec) or (want.version and spec == f"yarn@{want.version}")
    entry = f"{want.tool}-{want.version or '1.22.22'}-{'0' * 12}"
    assert _CACHE_ENTRY.fullmatch(entry) and "/" not in entry and ".." not in entry.split("-")
    argv = want.install_argv(["node", "/tools/yarn.js"])
    assert argv[:3] == ["node", "/tools/yarn.js", "install"] and argv[3] in ("--frozen-lockfile", "--immutable")
    assert len(argv) == 4
