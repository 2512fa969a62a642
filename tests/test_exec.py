"""``ckagent exec`` gives what the node gives: each sdk/examples spider run by the real CLI (a
subprocess, no master) and through the reference master with an agent has the same outcome, the
same items and the same log lines (the agent's own timestamped notices and Scrapy's timings aside;
however the stdout and stderr pipes happened to interleave in each run).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import EXAMPLES, ExampleRuns, recipe_words

from ckagent.cli import main
from ckagent.cli.localrun import (
    ExecRequest,
    ExecUsageError,
    _Terminal,
    detect_framework,
    exit_code_of,
    parse_assignments,
    run_exec,
)
from ckagent.code.runtimes import find_chromedriver, find_chromium
from ckagent.devmaster.client import zip_directory

# (example, framework on the master, spider name there, exec's words beyond the README's line, task
#  params beyond start_url, expected exit code of `ckagent exec`, marks). The README's line is the
# exec run (tests/harness/examples.py: the recipe's test reads the same run); the browser examples name
# their framework, as the master's spider does. selenium_demo leaves its browser behind on both paths
# (the agent's run is the one tests/test_frameworks.py checks the sweep with).
CASES = [
    pytest.param("python_demo", "python", None, (), {}, 0, id="python_demo"),
    pytest.param("fail_demo", "python", None, (), {}, 1, id="fail_demo"),
    pytest.param("httpx_demo", "python", None, (), {}, 0, id="httpx_demo", marks=pytest.mark.slow),
    pytest.param("scrapy_demo", "scrapy", "products", (), {}, 0, id="scrapy_demo", marks=pytest.mark.slow),
    pytest.param("node_demo", "node", None, (), {}, 0, id="node_demo", marks=[pytest.mark.slow, pytest.mark.skipif(
        shutil.which("node") is None or shutil.which("npm") is None, reason="node/npm are not installed")]),
    pytest.param("playwright_demo", "playwright", None, ("--framework", "playwright"), {}, 0, id="playwright_demo",
                 marks=[pytest.mark.slow, pytest.mark.skipif(find_chromium() is None, reason="Chromium is not installed")]),
    pytest.param("selenium_demo", "selenium", None, ("--framework", "selenium", "--param", "leave_browser=true"),
                 {"leave_browser": True}, 0, id="selenium_demo", marks=[
        pytest.mark.slow, pytest.mark.skipif(find_chromium() is None or find_chromedriver() is None,
                                             reason="Chromium/chromedriver are not installed")]),
]

_STAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:[+-]\d{4})?")
_SCRAPY_VARIABLE = re.compile(r"(elapsed_time|memusage|_time'|time\b|Crawled \d+ pages|Telnet|Overridden"
                              r"|pid|\bat 0x[0-9a-f]+|Versions:|Enabled|\[scrapy\.(?:utils\.log|addons|"
                              r"middleware|extensions)\]|^\s|^\{|^\})")


def spider_lines(lines: list[str], framework: str) -> list[str]:
    """The spider's own log lines, comparable across runs: from the agent's "running ..." notice on
    (installer output depends on what the cache held), without the agent's notices (timestamps,
    paths) and, for Scrapy, without timestamps and the lines that hold timings."""
    out = []
    starts = [i for i, line in enumerate(lines) if line.startswith("[ckagent ") and "] running " in line]
    for line in lines[starts[0] + 1 if starts else 0:]:
        if line.startswith(("[ckagent", "[ckagent]")) or line.startswith("$ ") or not line.strip():
            continue
        if framework == "scrapy":
            line = _STAMP.sub("<t>", line)
            if _SCRAPY_VARIABLE.search(line):
                continue
        out.append(line)
    return out


def assert_same_lines(exec_lines: list[str], master_lines: list[str]) -> None:
    """The same log lines, however the two pipes interleaved in each run: stdout and stderr are read
    as they come, so a line of one may be followed by the other's before its own line end (Python
    writes print()'s text and its newline in two writes). Each line of one run is in the other's
    text, and both runs wrote the same characters."""
    assert master_lines, "nothing to compare"
    exec_text, master_text = "".join(exec_lines), "".join(master_lines)  # a line may be cut by the other pipe's
    assert [line for line in exec_lines if line not in master_text] == []
    assert [line for line in master_lines if line not in exec_text] == []
    assert sorted(exec_text) == sorted(master_text)


@pytest.mark.parametrize(("example", "framework", "spider", "extra", "params", "exit_code"), CASES)
async def test_exec_gives_what_the_master_path_gives(dev_master: Any, nursery: trio.Nursery, example_runs: ExampleRuns,
                                                      example: str, framework: str, spider: str | None,
                                                      extra: tuple[str, ...], params: dict[str, Any],
                                                      exit_code: int) -> None:
    # Through the reference master, as a node runs it.
    run = await example_runs.agent(dev_master, nursery, example, framework, name=spider, params=params or None)
    task, master_items, master_logs = run.task, run.items, run.logs
    # The same spider with `ckagent exec` (its own private master; the same demo site to crawl).
    done = await example_runs.exec((*recipe_words(example), *extra), dev_master.base_url)
    stdout, stderr = done.stdout, done.stderr
    assert done.returncode == exit_code == exit_code_of(task), (task, stderr[-3000:])
    assert done.items == master_items
    exec_lines, via_master = spider_lines(stdout.splitlines(), framework), spider_lines(master_logs, framework)
    try:
        assert_same_lines(exec_lines, via_master)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nexec stdout:\n{stdout[-3000:]}\nmaster log:\n" + "\n".join(master_logs[-60:])) from exc
    code = task["errorCode"]
    assert f"[ckagent exec] outcome: {task['status']}" + (f" ({code})" if code else "") in stderr
    assert f"[ckagent exec] counts: {len(master_items)} items" in stderr
    assert "[ckagent exec] resources: " in stderr


async def test_exec_refuses_bad_input_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_zip = tmp_path / "spider.txt"
    not_zip.write_text("x")
    scrapy_project = tmp_path / "proj"
    scrapy_project.mkdir()
    (scrapy_project / "scrapy.cfg").write_text("[settings]\ndefault = p.settings\n")
    # What exec refuses before anything starts, each with its message (exec_main turns the refusal
    # into exit 2 and prints the message: the real process at the end shows it).
    cases: list[tuple[Path, dict[str, Any], str]] = [
        (tmp_path / "missing", {}, "no such folder or zip"),
        (not_zip, {}, "expected a spider's folder, a .zip of it or a Scrapyd .egg"),
        (scrapy_project, {}, "needs --spider NAME"),
        (tmp_path, {"framework": "ruby"}, "expected one of scrapy"),
    ]
    for source, options, message in cases:
        request = ExecRequest(source=source, items=tmp_path / "items.jsonl", work_dir=tmp_path / "w", **options)
        with pytest.raises(ExecUsageError, match=re.escape(message)):
            await run_exec(request, io.StringIO(), io.StringIO())
    # What the command line refuses before exec runs: exit 2 and the message, as `ckagent` exits.
    with pytest.raises(SystemExit) as exited:
        main(["exec", str(tmp_path), "--param", "novalue", "--work-dir", str(tmp_path / "w")])
    assert exited.value.code == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err
    # What exec refuses, as a real process shows it: exit 2 and the message (exec_main).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    done = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "ckagent", "exec", str(tmp_path / "missing"), "--work-dir", str(tmp_path / "w")],
        capture_output=True, text=True, timeout=60, check=False, env=env))
    assert done.returncode == 2, done.stderr
    assert "ckagent exec: " in done.stderr and "no such folder or zip" in done.stderr, done.stderr


def test_helpers() -> None:
    assert parse_assignments(["n=3", "s=abc", "l=[1]", "e="], "--param", json_values=True) == {
        "n": 3, "s": "abc", "l": [1], "e": ""}
    assert parse_assignments(["A=1"], "--env", json_values=False) == {"A": "1"}
    assert detect_framework(EXAMPLES / "scrapy_demo") == "scrapy"
    assert detect_framework(EXAMPLES / "node_demo") == "node"
    assert detect_framework(EXAMPLES / "python_demo") == "python"
    assert [exit_code_of({"status": s, "errorCode": c}) for s, c in [
        ("SUCCESS", None), ("SUCCESS", "LOG_BUDGET"), ("FAILED", "EXIT_NONZERO"), ("FAILED", "TIMEOUT"),
        ("FAILED", "DEPS_FAILED"), ("CANCELLED", "CANCELLED"), ("FAILED", "STALLED")]] == [0, 0, 1, 124, 3, 130, 1]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_stays_at_the_bottom_of_a_terminal() -> None:
    out, err = io.StringIO(), _Tty()
    terminal = _Terminal(out, err)
    terminal.progress("[ckagent exec] 3 items, 00:01 elapsed")
    terminal.write_log(b"a line\n")
    terminal.done()
    assert out.getvalue() == "a line\n"
    assert err.getvalue() == ("\r\033[K[ckagent exec] 3 items, 00:01 elapsed"  # drawn
                              "\r\033[K"  # cleared before the log line
                              "[ckagent exec] 3 items, 00:01 elapsed"  # drawn again
                              "\r\033[K")  # cleared at the end
    plain_err = io.StringIO()
    terminal = _Terminal(out, plain_err)
    terminal.progress("nothing on a pipe")
    assert plain_err.getvalue() == ""


def test_exec_ctrl_c_stops_the_spider_gracefully(tmp_path: Path) -> None:
    spider = tmp_path / "sleepy"
    spider.mkdir()
    (spider / "main.py").write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM, closing', flush=True), sys.exit(0)))\n"
        "print('sleeping', flush=True)\n"
        "time.sleep(120)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    proc = subprocess.Popen([sys.executable, "-m", "ckagent", "exec", str(spider), "--work-dir", str(tmp_path / "w"),
                             "--items", str(tmp_path / "items.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:  # the spider runs once its line reached the terminal
            if b"sleeping" in raw:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"got SIGTERM, closing" in out  # stopped the graceful way, not killed
    assert b"[ckagent exec] outcome: CANCELLED (CANCELLED)" in err


async def test_exec_takes_a_zip_and_applies_the_node_package_checks(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from ckagent.devmaster.client import zip_files

    # A zip that runs, through a real process: its exit code and its log on stdout.
    (tmp_path / "fail.zip").write_bytes(zip_directory(EXAMPLES / "fail_demo"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    done = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "ckagent", "exec", str(tmp_path / "fail.zip"), "--work-dir", str(tmp_path / "w"),
         "--items", str(tmp_path / "items.jsonl")],
        capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "[ckagent exec] outcome: FAILED (EXIT_NONZERO)" in done.stderr, done.stderr[-2000:]
    assert "[ckagent exec] attempt 1, cause: spider, retryable\n" in done.stderr  # (issue 38: its cause class)
    assert "something went wrong: demo failure" in done.stdout  # the spider's stderr, in the log
    # Zips the node refuses to deploy: exec's own master and agent, in this process (run_exec's
    # return value is the exit code exec_main exits with).
    for key in [k for k in os.environ if k.startswith(("AGENT_", "CK_"))]:
        monkeypatch.delenv(key)
    packages = {
        "evil.zip": zip_files({"../evil.py": "x", "main.py": "print(1)\n"}),
        "nomain.zip": zip_files({"other.py": "print(1)\n"}),
    }
    for name, data in packages.items():
        (tmp_path / name).write_bytes(data)
        out, err = io.StringIO(), io.StringIO()
        request = ExecRequest(source=tmp_path / name, items=tmp_path / "items.jsonl", work_dir=tmp_path / "w",
                              artifacts=tmp_path / "artifacts")
        assert await run_exec(request, out, err) == 3, (name, err.getvalue()[-2000:])
        assert "[ckagent exec] outcome: FAILED (DEPLOY_FAILED)" in err.getvalue(), (name, err.getvalue()[-2000:])


def test_a_scrapy_project_with_one_spider_needs_no_spider_name() -> None:
    from ckagent.task.commands import scrapy_spider_names

    assert scrapy_spider_names(EXAMPLES / "scrapy_demo") == ["products"]
    assert scrapy_spider_names(EXAMPLES / "scrapy_playwright_shop") == ["rendered"]
    assert scrapy_spider_names(EXAMPLES / "scrapy_shop") == ["listing", "products"]


async def test_a_scrapy_project_with_two_spiders_is_refused_naming_them(tmp_path: Path) -> None:
    # (exit 2 for what run_exec refuses: tests/test_exec.py::test_exec_refuses_bad_input_with_exit_2)
    request = ExecRequest(source=EXAMPLES / "scrapy_shop", items=tmp_path / "items.jsonl", work_dir=tmp_path / "w")
    with pytest.raises(ExecUsageError) as refused:
        await run_exec(request, io.StringIO(), io.StringIO())
    assert "needs --spider NAME" in str(refused.value) and "its spiders are listing, products" in str(refused.value)
