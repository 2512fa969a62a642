"""Packages and releases: the wheel (pip install . / -e .), publish.sh (credentials, artifact checks,
brand-word gate, upload to a local index), bump_version.sh and migrate_spiders.py on sample projects.

Uploads go to a small HTTP server on 127.0.0.1 that accepts what ``uv publish`` sends, like an index.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import REPO, frozen_source, session_pyz

import ckagent

PUBLISH = REPO / "build" / "publish.sh"
SDK_PUBLISH = REPO / "sdk" / "python" / "publish.sh"
BUMP = REPO / "build" / "bump_version.sh"
MIGRATE = REPO / "sdk" / "python" / "migrate_spiders.py"
SAMPLES = REPO / "sdk" / "python" / "tests_data"
UV = str(Path(sys.executable).parent / "uv")
TOKEN = "pypi-AgENdGVzdC5weXBpLm9yZwIkZmFrZS10b2tlbi1mb3ItdGVzdHM"


def run(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a command (never raising on its exit code)."""
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False)


@pytest.fixture
def release_env(tmp_path: Path) -> dict[str, str]:
    """An environment with no PyPI credentials: HOME is empty, no PYPI_* variables."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYPI_", "RELEASE_", "UV_PUBLISH"))}
    env["HOME"] = str(home)
    return env


class Index:
    """Requests received by the fake upload endpoint: (path, Authorization header, body bytes)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.uploads: list[tuple[str, str, bytes]] = []


@pytest.fixture
def index() -> Iterator[Index]:
    """An upload endpoint on 127.0.0.1 that answers 200 to every POST (like PyPI's legacy upload API)."""
    received: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            received.append((self.path, self.headers.get("Authorization", ""), body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handle = Index(f"http://127.0.0.1:{server.server_address[1]}/legacy/")
    handle.uploads = received
    try:
        yield handle
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------ wheel and installs


def test_wheel_holds_only_ckagent_with_the_bundled_sdk_and_installs_both_ways(tmp_path: Path) -> None:
    source = frozen_source(tmp_path / "src")
    built = run([UV, "build", "--wheel", "--quiet", "-o", str(tmp_path / "wheel"), str(source)])
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("ckagent-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {n.split("/")[0] for n in names} == {"ckagent", f"ckagent-{ckagent.__version__}.dist-info"}
    sdk_files = sorted(n for n in names if n.startswith("ckagent/_sdk/"))
    expected = sorted(f"ckagent/_sdk/crawlerkeeper_sdk/{p.name}"
                      for p in (REPO / "sdk/python/src/crawlerkeeper_sdk").iterdir() if p.is_file())
    assert sdk_files == expected, "the SDK ships as ckagent/_sdk/crawlerkeeper_sdk, nothing else in _sdk"
    assert "ckagent/master/protocol/openapi.yaml" in names

    probe = "from ckagent.code.deps import bundled_sdk_dir; print(bundled_sdk_dir())"
    for editable in (False, True):
        venv = tmp_path / ("venv-e" if editable else "venv")
        assert run([UV, "venv", "--quiet", "--python", sys.executable, str(venv)]).returncode == 0
        target = ["-e", str(source)] if editable else [str(source)]
        installed = run([UV, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), *target])
        assert installed.returncode == 0, installed.stderr
        where = run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path)
        assert where.returncode == 0, where.stderr
        sdk_dir = Path(where.stdout.strip())
        if editable:
            assert sdk_dir == source / "sdk" / "python" / "src"
        else:
            assert sdk_dir.parent.name == "ckagent" and "site-packages" in sdk_dir.parts
            assert sorted(p.name for p in sdk_dir.iterdir()) == ["crawlerkeeper_sdk"]
            assert not list(sdk_dir.parent.parent.glob("crawlerkeeper_sdk")), "no top-level SDK from the agent"
        version = run([str(venv / "bin" / "ckagent"), "version"])
        assert version.returncode == 0 and version.stdout.startswith(f"ckagent {ckagent.__version__}")


# ------------------------------------------------------------------------------ publish.sh


def test_dry_run_needs_no_token_and_publish_needs_a_valid_one_never_printed(
    release_env: dict[str, str], tmp_path: Path
) -> None:
    dist = ["--dist", str(tmp_path / "dist")]
    ok = run(["bash", str(SDK_PUBLISH), "--dry-run", *dist], env=release_env)  # no token anywhere
    assert ok.returncode == 0, ok.stderr
    assert "dry run passed" in ok.stdout and "not needed for a dry run" in ok.stdout
    assert sorted(p.name for p in (tmp_path / "dist").iterdir() if p.name != ".gitignore") == [
        f"crawlerkeeper_sdk-{_sdk_version()}-py3-none-any.whl", f"crawlerkeeper_sdk-{_sdk_version()}.tar.gz"]

    missing = run(["bash", str(SDK_PUBLISH), "--publish", *dist], env=release_env)
    assert missing.returncode == 1
    assert "no PyPI token" in missing.stderr and ".pypi_token" in missing.stderr and "PYPI_TOKEN" in missing.stderr

    bad = tmp_path / "bad_token"
    bad.write_text("hunter2-not-a-token\n")
    wrong = run(["bash", str(SDK_PUBLISH), "--publish", *dist], env={**release_env, "PYPI_TOKEN_FILE": str(bad)})
    assert wrong.returncode == 1 and "does not look like a PyPI API token" in wrong.stderr
    assert "hunter2" not in wrong.stdout + wrong.stderr


def _sdk_version() -> str:
    text = (REPO / "sdk/python/src/crawlerkeeper_sdk/__init__.py").read_text()
    return text.split('__version__ = "', 1)[1].split('"', 1)[0]


def test_publish_uploads_with_the_token_and_the_gate_stops_a_release(
    release_env: dict[str, str], index: Index, tmp_path: Path
) -> None:
    env = {**release_env, "PYPI_TOKEN": TOKEN}
    gate = tmp_path / "gate.txt"
    gate.write_text("# words that must not ship\n\nTaskContext\n")
    stopped = run(["bash", str(SDK_PUBLISH), "--publish", "--repository-url", index.url,
                   "--gate-file", str(gate), "--dist", str(tmp_path / "d1")], env=env)
    assert stopped.returncode == 1 and "brand-word gate" in stopped.stderr, stopped.stderr
    assert "crawlerkeeper_sdk/__init__.py: 'TaskContext'" in stopped.stderr
    assert index.uploads == [], "nothing is uploaded when the gate stops the release"

    published = run(["bash", str(SDK_PUBLISH), "--publish", "--repository-url", index.url,
                     "--dist", str(tmp_path / "d2")], env=env)
    assert published.returncode == 0, published.stderr
    assert TOKEN not in published.stdout + published.stderr
    assert len(index.uploads) == 2
    expected_auth = "Basic " + base64.b64encode(f"__token__:{TOKEN}".encode()).decode()
    assert {auth for _, auth, _ in index.uploads} == {expected_auth}
    bodies = b"".join(body for _, _, body in index.uploads)
    assert b"crawlerkeeper_sdk-" in bodies and b".whl" in bodies and b".tar.gz" in bodies


def test_agent_dry_run_checks_the_artifacts_and_writes_the_release_index(
    release_env: dict[str, str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pyz = session_pyz(tmp_path_factory)
    dist = tmp_path / "dist"
    result = run(["bash", str(PUBLISH), "--dry-run", "--pyz", str(pyz), "--dist", str(dist)], env=release_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "brand-word gate passed" in result.stdout
    latest = json.loads((dist / "release" / "latest.json").read_text())
    assert latest["version"] == ckagent.__version__
    assert latest["sha256"] == hashlib.sha256(pyz.read_bytes()).hexdigest()
    assert (dist / "release" / latest["url"]).read_bytes() == pyz.read_bytes()
    # uv travels with the agent: the index names the uv it ships (version, file, sha256)
    uv_entry = latest["uv"]
    uv_file = dist / "release" / uv_entry["url"]
    assert uv_entry["url"] == f"uv-{uv_entry['version']}-linux-x86_64"
    assert uv_entry["sha256"] == hashlib.sha256(uv_file.read_bytes()).hexdigest()
    assert uv_file.read_bytes() == Path(UV).read_bytes()
    version = run([str(uv_file), "--version"])
    assert version.returncode == 0 and version.stdout.startswith(f"uv {uv_entry['version']}")
    assert json.loads((dist / "release" / f"{ckagent.__version__}.json").read_text()) == latest

    # a gate word inside the pyz (a dependency's file) stops the agent's release too
    gate = tmp_path / "gate.txt"
    gate.write_text("sortedcontainers\n")
    gated = run(["bash", str(PUBLISH), "--dry-run", "--pyz", str(pyz), "--dist", str(dist), "--gate-file",
                 str(gate)], env=release_env)
    assert gated.returncode == 1 and "ckagent.pyz: site-packages/sortedcontainers" in gated.stderr


# ------------------------------------------------------------------------------ bump_version.sh


def test_bump_version_edits_the_single_version_source(tmp_path: Path) -> None:
    (tmp_path / "ckagent").mkdir()
    init = tmp_path / "ckagent" / "__init__.py"
    init.write_text('"""doc"""\n\n__version__ = "1.4.2"\n')
    steps = [("patch", "1.4.2 -> 1.4.3"), ("minor", "1.4.3 -> 1.5.0"), ("2.0.0rc1", "1.5.0 -> 2.0.0rc1"),
             ("patch", "2.0.0rc1 -> 2.0.0"), ("major", "2.0.0 -> 3.0.0")]
    for arg, said in steps:
        result = run(["bash", str(BUMP), "--root", str(tmp_path), arg])
        assert result.returncode == 0 and result.stdout.strip() == said, result
    assert init.read_text() == '"""doc"""\n\n__version__ = "3.0.0"\n'
    for refused in ("2.9.9", "3.0.0", "not-a-version"):
        result = run(["bash", str(BUMP), "--root", str(tmp_path), refused])
        assert result.returncode == 2, refused
    assert '"3.0.0"' in init.read_text()


# ------------------------------------------------------------------------------ migrate_spiders.py


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_migrate_spiders_replaces_the_vendored_sdk_by_the_package(tmp_path: Path) -> None:
    projects = tmp_path / "projects"
    shutil.copytree(SAMPLES, projects)
    scrapy_project, script_project = projects / "vendored_scrapy", projects / "vendored_script"
    before = _tree(projects)

    dry = run([sys.executable, str(MIGRATE), "--dry-run", str(scrapy_project), str(script_project)])
    assert dry.returncode == 0, dry.stderr
    assert _tree(projects) == before, "--dry-run changes nothing"
    assert "would remove shop/vendor/crawlerkeeper_sdk/" in dry.stdout and "would remove crawlerkeeper_sdk.py" in dry.stdout
    assert "+crawlerkeeper-sdk>=0.1,<1" in dry.stdout and "defines get_params" in dry.stdout

    done = run([sys.executable, str(MIGRATE), str(scrapy_project), str(script_project)])
    assert done.returncode == 0, done.stderr
    assert not (scrapy_project / "shop" / "vendor" / "crawlerkeeper_sdk").exists()
    assert not (script_project / "crawlerkeeper_sdk.py").exists()
    assert (scrapy_project / "requirements.txt").read_text() == "scrapy>=2.11\ncrawlerkeeper-sdk>=0.1,<1\n"
    assert '"crawlerkeeper-sdk>=0.1,<1",' in (script_project / "pyproject.toml").read_text()
    settings = (scrapy_project / "shop" / "settings.py").read_text()
    assert '"crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300' in settings
    spider = (scrapy_project / "shop" / "spiders" / "products.py").read_text()
    assert "from crawlerkeeper_sdk import save_item\nimport crawlerkeeper_sdk as ck\n" in spider
    leftovers = [p for p in projects.rglob("*.py") if "vendor.crawlerkeeper_sdk" in p.read_text()
                 or "from .vendor" in p.read_text()]
    assert leftovers == []
    for path in projects.rglob("*.py"):
        compile(path.read_text(), str(path), "exec")

    # the migrated code runs against the real package
    items = tmp_path / "items.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'sdk/python/src'}:{scrapy_project}", "CK_ITEMS_FILE": str(items)}
    ran = run([sys.executable, "-m", "shop.export"], env=env, cwd=scrapy_project)
    assert ran.returncode == 0, ran.stderr
    assert [json.loads(line) for line in items.read_text().splitlines()] == [{"n": 1}, {"n": 2}]
    env["PYTHONPATH"] = str(REPO / "sdk/python/src")
    ran = run([sys.executable, "main.py"], env=env, cwd=script_project)
    assert ran.returncode == 0 and json.loads(items.read_text().splitlines()[-1]) == {"price": 10}

    again = run([sys.executable, str(MIGRATE), str(scrapy_project), str(script_project)])
    assert again.returncode == 0 and again.stdout.count("nothing to do") == 2
