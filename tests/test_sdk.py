"""The spider SDK (sdk/python, `crawlerkeeper_sdk`) and the example spiders (sdk/examples).

Everything runs in real subprocesses with PYTHONPATH=sdk/python/src, the way an agent runs a
spider: the SDK is never imported into the test process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from harness import find_python, missing_python

REPO = Path(__file__).resolve().parents[1]
SDK_DIR = REPO / "sdk" / "python"
SDK_SRC = SDK_DIR / "src"
EXAMPLES = REPO / "sdk" / "examples"
PYTHON38 = find_python("3.8")
# A Python with Scrapy installed, for running the Scrapy example for real (see test below).
SCRAPY_PYTHON_ENV = "CK_TEST_SCRAPY_PYTHON"
SUBPROCESS_TIMEOUT = 60.0  # seconds

CK_VARS = ("CK_ITEMS_FILE", "CK_TASK_ID", "CK_SPIDER_ID", "CK_SPIDER_NAME", "CK_PARAMS", "CK_TASK_DIR")


# --- helpers ---------------------------------------------------------------------------------


def spider_env(**extra: str) -> dict[str, str]:
    """The environment of a spider: this one without CK_* variables, the SDK importable."""
    env = {k: v for k, v in os.environ.items() if k not in CK_VARS and k != "DEMO_SITE_URL"}
    env["PYTHONPATH"] = str(SDK_SRC)
    env.pop("PYTHONHOME", None)
    env.update(extra)
    return env


def run_python(
    code: str,
    *,
    python: str | os.PathLike[str] = sys.executable,
    cwd: Path | None = None,
    args: tuple[str, ...] = (),
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with the SDK importable and ``env`` added."""
    return subprocess.run(
        [os.fspath(python), "-c", textwrap.dedent(code), *args],
        env=spider_env(**env),
        cwd=cwd,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=SUBPROCESS_TIMEOUT,
    )


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def read_items(path: Path) -> list[dict[str, object]]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), "the items file must end with a whole line"
    return [json.loads(line) for line in data.decode("utf-8").split("\n")[:-1]]


# --- the demo site stand-in (same HTML as the dev master's /demo-site/) -----------------------

DEMO_PAGES = 5
DEMO_PER_PAGE = 6


def demo_page_html(n: int) -> str:
    parts = [
        f"<html><head><title>Demo shop – page {n}</title></head><body><ul class=\"products\">",
    ]
    for i in range((n - 1) * DEMO_PER_PAGE + 1, n * DEMO_PER_PAGE + 1):
        parts.append(
            f'<li class="product"><a class="title" href="/demo-site/product/{i}/">Product {i:02d}</a> '
            f'<span class="price">{i * 3 + 0.99:.2f}</span> <span class="sku">SKU-{i:04d}</span></li>'
        )
    parts.append("</ul>")
    if n < DEMO_PAGES:
        parts.append(f'<a class="next" href="/demo-site/page/{n + 1}/">next</a>')
    parts.append("</body></html>")
    return "".join(parts)


def expected_items(base: str) -> list[dict[str, object]]:
    return [
        {
            "title": f"Product {i:02d}",
            "price": round(i * 3 + 0.99, 2),
            "sku": f"SKU-{i:04d}",
            "url": f"{base}/demo-site/product/{i}/",
            "page": (i - 1) // DEMO_PER_PAGE + 1,
        }
        for i in range(1, DEMO_PAGES * DEMO_PER_PAGE + 1)
    ]


class _DemoSiteHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        match = re.fullmatch(r"/demo-site/(?:page/(\d+)/)?", self.path)
        page = int(match.group(1) or 1) if match else 0
        if not 1 <= page <= DEMO_PAGES:
            self.send_error(404)
            return
        body = demo_page_html(page).encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def demo_site() -> Iterator[str]:
    """Base URL (no trailing slash) of a stand-in demo site on 127.0.0.1, port chosen by the OS."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DemoSiteHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --- save_item / save_items ------------------------------------------------------------------


def test_save_item_appends_one_json_line_per_item_keeping_non_ascii(tmp_path: Path) -> None:
    items_file = tmp_path / "items.jsonl"
    items_file.write_bytes(b'{"earlier": true}\n')  # append mode: what is there stays
    proc = ok(
        run_python(
            """
            import datetime, decimal
            from crawlerkeeper_sdk import save_item, save_items
            save_item({"title": "Café – 東京", "tags": ["a", "b"]})
            save_item({"when": datetime.date(2026, 11, 29), "price": decimal.Decimal("3.99")})
            print(save_items([{"n": 1}, {"n": 2, "text": "line\\nbreak\\u2028sep"}]))
            print(save_items(iter([])))
            """,
            CK_ITEMS_FILE=str(items_file),
        )
    )
    assert proc.stdout.split() == ["2", "0"], "items must not be printed when CK_ITEMS_FILE is set"
    raw = items_file.read_bytes()
    assert "Café – 東京".encode() in raw, "non-ASCII text must be written as UTF-8, not \\u escapes"
    assert raw.count(b"\n") == 5
    assert read_items(items_file) == [
        {"earlier": True},
        {"title": "Café – 東京", "tags": ["a", "b"]},
        {"when": "2026-11-29", "price": "3.99"},
        {"n": 1},
        {"n": 2, "text": "line\nbreak\u2028sep"},
    ]
    # Line separators inside strings stay escaped, so every line reader sees five lines.
    assert len(raw.decode("utf-8").splitlines()) == 5


def test_save_item_outside_an_agent_prints_json_lines_on_stdout(tmp_path: Path) -> None:
    # PYTHONIOENCODING=ascii: a developer's terminal under LANG=C must not break a spider.
    proc = ok(
        run_python(
            """
            from crawlerkeeper_sdk import save_item, save_items, task_context
            assert not task_context().in_agent
            save_item({"title": "Ünïcode"})
            save_items([{"n": 1}, {"n": 2}])
            """,
            PYTHONIOENCODING="ascii",
            cwd=tmp_path,
        )
    )
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [
        {"title": "Ünïcode"},
        {"n": 1},
        {"n": 2},
    ]
    assert list(tmp_path.iterdir()) == []


def test_non_mapping_items_raise_type_error(tmp_path: Path) -> None:
    items_file = tmp_path / "items.jsonl"
    proc = ok(
        run_python(
            """
            from crawlerkeeper_sdk import save_item, save_items
            for bad in (["title", "x"], "a string", 42, None):
                try:
                    save_item(bad)
                except TypeError as exc:
                    print("TypeError:", exc)
                else:
                    raise SystemExit("no TypeError for %r" % (bad,))
            try:
                save_items([{"n": 1}, {"n": 2}, ("not", "a", "dict"), {"n": 4}])
            except TypeError as exc:
                print("TypeError:", exc)
            else:
                raise SystemExit("no TypeError from save_items")
            """,
            CK_ITEMS_FILE=str(items_file),
        )
    )
    errors = proc.stdout.splitlines()
    assert len(errors) == 5
    assert all("mapping" in line for line in errors), errors
    assert "got list" in errors[0] and "got tuple" in errors[4]
    # save_items saves what came before the bad element, nothing after it.
    assert read_items(items_file) == [{"n": 1}, {"n": 2}]


def test_concurrent_appends_from_processes_and_threads_keep_lines_whole(tmp_path: Path) -> None:
    """4 processes x 2 threads x 250 items, each item ~4 KiB: every one of 2000 lines intact."""
    items_file = tmp_path / "items.jsonl"
    writer = textwrap.dedent(
        """
        import sys, threading
        from crawlerkeeper_sdk import save_item
        proc_no = int(sys.argv[1])
        sys.stdin.readline()  # start together
        def write(thread_no):
            for n in range(250):
                save_item({"proc": proc_no, "thread": thread_no, "n": n, "pad": "é" * 2000})
        threads = [threading.Thread(target=write, args=(t,)) for t in range(2)]
        for t in threads: t.start()
        for t in threads: t.join()
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", writer, str(p)],
            env=spider_env(CK_ITEMS_FILE=str(items_file)),
            stdin=subprocess.PIPE,
            text=True,
        )
        for p in range(4)
    ]
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
    for proc in procs:
        assert proc.wait(timeout=SUBPROCESS_TIMEOUT) == 0

    items = read_items(items_file)  # raises if any line is torn
    assert len(items) == 2000
    assert all(item["pad"] == "é" * 2000 for item in items)
    for p in range(4):
        for t in range(2):
            ns = [item["n"] for item in items if item["proc"] == p and item["thread"] == t]
            assert ns == list(range(250)), f"writer {p}/{t} lost or reordered items"


# --- task_context ------------------------------------------------------------------------------

TASK_CONTEXT_DUMP = """
    import dataclasses, json
    from crawlerkeeper_sdk import task_context
    ctx = task_context()
    try:
        ctx.task_id = "changed"
    except dataclasses.FrozenInstanceError:
        frozen = True
    else:
        frozen = False
    print(json.dumps(dict(dataclasses.asdict(ctx), in_agent=ctx.in_agent, frozen=frozen)))
"""


def test_task_context_reads_the_agent_environment(tmp_path: Path) -> None:
    proc = ok(
        run_python(
            TASK_CONTEXT_DUMP,
            CK_TASK_ID="t-42",
            CK_SPIDER_ID="s-7",
            CK_SPIDER_NAME="demo shop",
            CK_PARAMS='{"start_url": "http://127.0.0.1:1/demo-site/", "pages": [1, 2], "ü": null}',
            CK_TASK_DIR=str(tmp_path),
            CK_ITEMS_FILE=str(tmp_path / "items.jsonl"),
        )
    )
    assert json.loads(proc.stdout) == {
        "task_id": "t-42",
        "spider_id": "s-7",
        "spider_name": "demo shop",
        "params": {"start_url": "http://127.0.0.1:1/demo-site/", "pages": [1, 2], "ü": None},
        "task_dir": str(tmp_path),
        "items_file": str(tmp_path / "items.jsonl"),
        "attempt": 1,
        "in_agent": True,
        "frozen": True,
    }


@pytest.mark.parametrize("params_env", [{}, {"CK_PARAMS": ""}, {"CK_PARAMS": "null"}])
def test_task_context_outside_an_agent(params_env: dict[str, str]) -> None:
    proc = ok(run_python(TASK_CONTEXT_DUMP, **params_env))
    assert json.loads(proc.stdout) == {
        "task_id": None,
        "spider_id": None,
        "spider_name": None,
        "params": {},
        "task_dir": None,
        "items_file": None,
        "attempt": 1,
        "in_agent": False,
        "frozen": True,
    }


@pytest.mark.parametrize("bad_params", ["{not json", "[1, 2]", '"a string"', "42"])
def test_malformed_params_raise_value_error_naming_the_variable(bad_params: str) -> None:
    proc = run_python(
        """
        from crawlerkeeper_sdk import task_context
        task_context()
        """,
        CK_PARAMS=bad_params,
    )
    assert proc.returncode == 1
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ValueError: CK_PARAMS "), proc.stderr


# --- Scrapy pipeline ---------------------------------------------------------------------------


def test_scrapy_pipeline_saves_dicts_and_dataclasses_and_returns_them(tmp_path: Path) -> None:
    items_file = tmp_path / "items.jsonl"
    proc = ok(
        run_python(
            """
            import dataclasses, sys
            import crawlerkeeper_sdk
            from crawlerkeeper_sdk.scrapy import CrawlerKeeperPipeline
            assert "scrapy" not in sys.modules, "importing the SDK must not import Scrapy"

            @dataclasses.dataclass
            class Product:
                title: str
                price: float
                tags: list

            pipeline = CrawlerKeeperPipeline()
            plain = {"title": "Product 01", "price": 3.99}
            product = Product("Product 02", 6.99, ["x"])
            assert pipeline.process_item(plain, object()) is plain
            assert pipeline.process_item(product, object()) is product
            assert pipeline.process_item({"no": "spider argument"}) is not None  # Scrapy 2.14+
            try:
                pipeline.process_item(42, None)
            except TypeError as exc:
                print("TypeError:", exc)
            print("itemadapter" in sys.modules)
            """,
            CK_ITEMS_FILE=str(items_file),
        )
    )
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("TypeError: CrawlerKeeperPipeline cannot save a int")
    has_itemadapter = importlib.util.find_spec("itemadapter") is not None
    assert lines[1] == str(has_itemadapter)
    assert read_items(items_file) == [
        {"title": "Product 01", "price": 3.99},
        {"title": "Product 02", "price": 6.99, "tags": ["x"]},
        {"no": "spider argument"},
    ]


# --- Python 3.8 --------------------------------------------------------------------------------


@pytest.mark.skipif(PYTHON38 is None, reason=missing_python("3.8"))
def test_sdk_works_on_python_38(tmp_path: Path) -> None:
    assert PYTHON38 is not None
    items_file = tmp_path / "items.jsonl"
    proc = ok(
        run_python(
            """
            import dataclasses, sys, typing
            assert sys.version_info[:2] == (3, 8), sys.version
            import crawlerkeeper_sdk
            from crawlerkeeper_sdk import TaskContext, save_item, save_items, task_context
            from crawlerkeeper_sdk.scrapy import CrawlerKeeperPipeline
            typing.get_type_hints(TaskContext)  # annotations must evaluate on 3.8
            typing.get_type_hints(save_item)
            ctx = task_context()
            assert ctx.in_agent and ctx.params == {"start_url": "x"}, ctx
            save_item({"title": "Café"})
            assert save_items([{"n": 1}, {"n": 2}]) == 2

            @dataclasses.dataclass
            class Product:
                title: str
            CrawlerKeeperPipeline().process_item(Product("P"), None)
            print(crawlerkeeper_sdk.__version__)
            """,
            python=PYTHON38,
            CK_ITEMS_FILE=str(items_file),
            CK_PARAMS='{"start_url": "x"}',
        )
    )
    assert proc.stdout.strip() == "0.1.0"
    assert read_items(items_file) == [{"title": "Café"}, {"n": 1}, {"n": 2}, {"title": "P"}]
    # Every SDK and example source compiles under 3.8 (no 3.9+ syntax anywhere).
    sources = sorted(SDK_SRC.rglob("*.py")) + sorted(EXAMPLES.rglob("*.py"))
    compile_check = ok(
        run_python(
            """
            import sys
            for path in sys.argv[1:]:
                compile(open(path, encoding="utf-8").read(), path, "exec")
            """,
            python=PYTHON38,
            args=tuple(str(p) for p in sources),
        )
    )
    assert compile_check.stderr == ""


# --- the examples ------------------------------------------------------------------------------


def python_candidates() -> list[object]:
    python38 = pytest.mark.skipif(PYTHON38 is None, reason=missing_python("3.8"))
    return [
        pytest.param(sys.executable, id="current-python"),
        pytest.param(str(PYTHON38), id="python3.8", marks=python38),
    ]


@pytest.mark.parametrize("python", python_candidates())
def test_python_demo_crawls_all_pages_in_order(tmp_path: Path, demo_site: str, python: str) -> None:
    items_file = tmp_path / "items.jsonl"
    proc = ok(
        subprocess.run(
            [python, "main.py"],
            cwd=EXAMPLES / "python_demo",
            env=spider_env(
                CK_ITEMS_FILE=str(items_file),
                CK_PARAMS=json.dumps({"start_url": f"{demo_site}/demo-site/"}),
                DEMO_SITE_URL="http://127.0.0.1:9/unused/",  # the task parameter wins
            ),
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT,
        )
    )
    assert read_items(items_file) == expected_items(demo_site)
    progress = [line for line in proc.stdout.splitlines() if line.startswith("page ")]
    assert progress == [f"page {n}: 6 products" for n in range(1, 6)]


def test_python_demo_falls_back_to_demo_site_url(tmp_path: Path, demo_site: str) -> None:
    items_file = tmp_path / "items.jsonl"
    ok(
        subprocess.run(
            [sys.executable, str(EXAMPLES / "python_demo" / "main.py")],
            env=spider_env(CK_ITEMS_FILE=str(items_file), DEMO_SITE_URL=f"{demo_site}/demo-site/page/4/"),
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT,
        )
    )
    # Started on page 4, it numbers pages from where it started.
    got = read_items(items_file)
    assert [item["sku"] for item in got] == [f"SKU-{i:04d}" for i in range(19, 31)]
    assert [item["page"] for item in got] == [1] * 6 + [2] * 6


def test_fail_demo_fails_with_exit_code_3() -> None:
    proc = subprocess.run(
        [sys.executable, "main.py"],
        cwd=EXAMPLES / "fail_demo",
        env=spider_env(),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
    )
    assert proc.returncode == 3
    assert proc.stdout.strip() != ""
    assert "something went wrong: demo failure" in proc.stderr


def test_scrapy_demo_is_a_complete_scrapy_project() -> None:
    project = EXAMPLES / "scrapy_demo"
    assert "default = demo_shop.settings" in (project / "scrapy.cfg").read_text()
    assert (project / "requirements.txt").read_text().split() == ["scrapy>=2.11"]
    settings = (project / "demo_shop" / "settings.py").read_text()
    assert '"crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300' in settings
    assert "TELNETCONSOLE_ENABLED = False" in settings
    assert "REMOTE_CONTROL_ENABLED = False" in settings
    assert "ROBOTSTXT_OBEY = False" in settings
    assert 'name = "products"' in (project / "demo_shop" / "spiders" / "products.py").read_text()


@pytest.mark.slow
def test_scrapy_demo_crawls_all_pages_in_order(tmp_path: Path, demo_site: str) -> None:
    """Runs `scrapy crawl products` for real, with the Python named by CK_TEST_SCRAPY_PYTHON."""
    scrapy_python = os.environ.get(SCRAPY_PYTHON_ENV)
    if not scrapy_python:
        pytest.skip(
            f"set {SCRAPY_PYTHON_ENV} to a Python with Scrapy installed to run the Scrapy example "
            "(e.g. uv venv /tmp/scrapyvenv && uv pip install --python /tmp/scrapyvenv/bin/python scrapy)"
        )
    items_file = tmp_path / "items.jsonl"
    proc = ok(
        subprocess.run(
            [scrapy_python, "-m", "scrapy", "crawl", "products"],
            cwd=EXAMPLES / "scrapy_demo",
            env=spider_env(
                CK_ITEMS_FILE=str(items_file),
                CK_PARAMS=json.dumps({"start_url": f"{demo_site}/demo-site/"}),
            ),
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT,
        )
    )
    assert read_items(items_file) == expected_items(demo_site)
    assert "summary: 30 items from 5 pages (finished: finished)" in proc.stderr
    assert "Traceback" not in proc.stderr
    # No warnings about the project or its settings (e.g. the fingerprinter choice on Scrapy 2.11);
    # cryptography's notice that the interpreter (3.8) is old is not ours to fix.
    warnings = [
        line
        for line in proc.stderr.splitlines()
        if ("Warning" in line or "WARNING" in line) and "CryptographyDeprecationWarning" not in line
    ]
    assert warnings == [], warnings


# --- packaging ---------------------------------------------------------------------------------


def _build_wheel(source: Path, out_dir: Path) -> None:
    """Build ``source`` into ``out_dir``: offline with pip when this Python can, else with uv."""
    setuptools_spec = importlib.util.find_spec("setuptools")  # finds, does not import
    # setuptools 70.1+ builds wheels itself; older ones need the `wheel` package.
    can_bdist_wheel = setuptools_spec is not None and (
        (Path(setuptools_spec.origin or "").parent / "command" / "bdist_wheel.py").exists()
        or importlib.util.find_spec("wheel") is not None
    )
    uv = shutil.which("uv") or shutil.which("uv", path=str(Path(sys.executable).parent))
    if importlib.util.find_spec("pip") is not None and can_bdist_wheel:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        cmd += ["--no-index", "-q", str(source), "-w", str(out_dir)]
    elif uv:
        # Isolated build: setuptools comes from the package index (or uv's cache).
        cmd = [uv, "build", "--wheel", str(source), "-o", str(out_dir)]
    else:
        pytest.skip("no way to build a wheel here: need pip with setuptools>=70.1 (or wheel), or uv")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_sdk_builds_a_pure_python_wheel_with_only_the_sdk(tmp_path: Path) -> None:
    source = tmp_path / "src-copy"  # build a copy: no build/ or egg-info litter in the checkout
    shutil.copytree(SDK_DIR, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out_dir = tmp_path / "dist"
    _build_wheel(source, out_dir)

    wheels = sorted(p.name for p in out_dir.glob("*.whl"))
    assert wheels == ["crawlerkeeper_sdk-0.1.0-py3-none-any.whl"]
    with zipfile.ZipFile(out_dir / wheels[0]) as wheel:
        names = wheel.namelist()
        metadata = wheel.read("crawlerkeeper_sdk-0.1.0.dist-info/METADATA").decode()
    assert all(name.startswith(("crawlerkeeper_sdk/", "crawlerkeeper_sdk-0.1.0.dist-info/")) for name in names), names
    package_files = sorted(n for n in names if n.startswith("crawlerkeeper_sdk/"))
    assert package_files == [
        "crawlerkeeper_sdk/__init__.py",
        "crawlerkeeper_sdk/_control.py",
        "crawlerkeeper_sdk/_scrapy_hook.py",
        "crawlerkeeper_sdk/_scrapy_jobdir.py",
        "crawlerkeeper_sdk/_scrapy_proxy.py",
        "crawlerkeeper_sdk/_scrapy_state.py",
        "crawlerkeeper_sdk/_state.py",
        "crawlerkeeper_sdk/_stats.py",
        "crawlerkeeper_sdk/py.typed",
        "crawlerkeeper_sdk/scrapy.py",
        "crawlerkeeper_sdk/scrapy_settings.py",
    ]
    assert "Name: crawlerkeeper-sdk" in metadata
    assert "Version: 0.1.0" in metadata
    assert "Requires-Python: >=3.8" in metadata
    assert "Requires-Dist" not in metadata, "the SDK must have no dependencies"


def test_scrapy_pipeline_steps_aside_when_a_feed_writes_the_items_file(tmp_path: Path) -> None:
    items_file = tmp_path / "items.jsonl"
    proc = ok(
        run_python(
            """
            import json, os, sys, types
            from crawlerkeeper_sdk.scrapy import CrawlerKeeperPipeline, _feeds_items_file

            class Settings:
                def __init__(self, feeds):
                    self.feeds = feeds
                def getdict(self, name):
                    return json.loads(self.feeds) if isinstance(self.feeds, str) else self.feeds

            # Scrapy is not installed here: a stand-in for scrapy.exceptions.NotConfigured.
            exceptions = types.ModuleType("scrapy.exceptions")
            class NotConfigured(Exception):
                pass
            exceptions.NotConfigured = NotConfigured
            sys.modules["scrapy"] = types.ModuleType("scrapy")
            sys.modules["scrapy.exceptions"] = exceptions
            uri = "file://" + os.environ["CK_ITEMS_FILE"]
            agent_feed = Settings(json.dumps({uri: {"format": "jsonlines"}}))  # as `-s FEEDS=...` gives it
            try:
                CrawlerKeeperPipeline.from_crawler(types.SimpleNamespace(settings=agent_feed))
                print("kept")
            except NotConfigured:
                print("stepped aside")
            other = types.SimpleNamespace(settings=Settings({"exports/%(name)s.csv": {"format": "csv"}}))
            print(type(CrawlerKeeperPipeline.from_crawler(other)).__name__)
            print(_feeds_items_file(Settings({os.environ["CK_ITEMS_FILE"]: {}})))
            """,
            CK_ITEMS_FILE=str(items_file),
        )
    )
    assert proc.stdout.splitlines() == ["stepped aside", "CrawlerKeeperPipeline", "True"]
