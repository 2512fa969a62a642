"""``ckagent demo`` as a user runs it, plus a many-page Scrapy crawl on the same agent: the main job at
one containment and egress level (tests/test_demo_levels.py).

:func:`demo_with_crawl` starts ``ckagent demo --keep`` as a real process (as root or as another user),
waits for its checks and its ``--keep`` line, then — on the demo's own master and agent, so at the
same levels, with the same Scrapy environment — uploads sdk/examples/scrapy_shop and runs its
``products`` spider: 35 pages (listing and detail pages, 4 requests at a time over kept-alive
connections). Then Ctrl-C (SIGINT), as a user stops a kept demo, and the demo's exit code: 0 only
when its own checks passed (ckagent/cli/demo.py).

:func:`user_checkout` lays out what a user without access to root's checkout needs to run the demo
with the system's python3: the package, the SDK and the examples, readable by all; the dependencies
come from the session's ckagent.pyz, and the copy goes first on ``PYTHONPATH`` (shiv puts the pyz's
site-packages after the ``PYTHONPATH`` entries).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from ckagent.cli.demo import SPIDERS, first_difference
from ckagent.devmaster.client import AdminClient, zip_directory
from ckagent.devmaster.demosite import expected_products
from harness.examples import EXAMPLES, REPO
from harness.users import SystemUser

__all__ = ["CRAWL_EXAMPLE", "DemoRun", "demo_environ", "demo_with_crawl", "user_checkout", "user_demo"]

DEMO_TIMEOUT = 600.0
"""Seconds for one demo with its crawl, cold caches included (Scrapy's ~40 packages from PyPI)."""

CRAWL_EXAMPLE = "scrapy_shop"
"""The many-page Scrapy crawl: every listing page and every product's detail page, 4 at a time."""

_KEEP_LINE = b"\n--keep: master and agent keep running"
_ADMIN = re.compile(r"Bearer (\S+)' (http://127\.0\.0\.1:\d+)/api/nodes")
_LEVELS = re.compile(r"ran at containment (\S+) and egress (\S+) ")


@dataclass
class DemoRun:
    """What one ``ckagent demo --keep`` gave: exit code, stdout and stderr as text, the containment and
    egress levels its summary named, and the crawl's final task and items (None/[] when the demo did
    not get that far)."""

    returncode: int | None
    stdout: str
    stderr: str
    levels: tuple[str, str] | None
    crawl: dict[str, Any] | None = None
    crawl_items: list[dict[str, Any]] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Everything that is not as the demo promises, in words ([] = the main job works here): the
        demo's exit code (its own checks), and the crawl — SUCCESS with every product of the shop
        once (in SKU order: the crawl is concurrent)."""
        out = []
        if self.returncode != 0:
            out.append(f"ckagent demo exited {self.returncode}:\n{self.stdout[-3000:]}\n{self.stderr[-2000:]}")
        if self.crawl is None:
            out.append(f"the {CRAWL_EXAMPLE} crawl did not run")
        else:
            if self.crawl.get("status") != "SUCCESS":
                out.append(f"{CRAWL_EXAMPLE}: {self.crawl.get('status')}/{self.crawl.get('errorCode')}: "
                           f"{self.crawl.get('errorMessage')}")
            expected = expected_products()
            ordered = sorted(self.crawl_items, key=lambda item: str(item.get("sku")))
            difference = first_difference(ordered, expected)
            if difference is not None:
                out.append(f"{CRAWL_EXAMPLE}: {len(self.crawl_items)} items of the shop's {len(expected)} "
                           f"(first difference by SKU: {difference})")
        return out


def user_checkout(dest: Path) -> Path:
    """Copy the package, the SDK and the demo's examples (and :data:`CRAWL_EXAMPLE`) to ``dest``,
    readable by every user; returns ``dest``, for ``PYTHONPATH`` (blocking)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "ckagent", dest / "ckagent", ignore=ignore)
    shutil.copytree(REPO / "sdk" / "python" / "src", dest / "sdk" / "python" / "src", ignore=ignore)
    for example in sorted({spider.directory for spider in SPIDERS} | {CRAWL_EXAMPLE}):
        shutil.copytree(EXAMPLES / example, dest / "sdk" / "examples" / example, ignore=ignore)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def user_demo(user: SystemUser, pyz: Path) -> tuple[list[str], dict[str, str], Path]:
    """The command, environment and directory with which ``user`` runs ``ckagent demo --keep`` as a
    developer without root would: the system's python3 with ``pyz`` (a copy in ``user.reach/bin``, with
    uv beside it on PATH) and :func:`user_checkout`, in a directory of its own; uv's cache is the user's
    (in its home). Skips without /usr/bin/python3 or uv (blocking)."""
    python = Path("/usr/bin/python3")
    if not python.is_file():
        pytest.skip("the user runs the demo with the system's /usr/bin/python3, which this machine lacks")
    beside = Path(sys.executable).parent / "uv"  # the dev venv's; else the one on PATH
    uv = beside if beside.is_file() else Path(shutil.which("uv") or "/nonexistent/uv")
    if not uv.is_file():
        pytest.skip("no uv to give the user")
    source = user_checkout(user.reach / "src")
    tools = user.reach / "bin"
    tools.mkdir(mode=0o755)
    for tool in (pyz, uv):
        shutil.copy(tool, tools / tool.name)
        (tools / tool.name).chmod(0o755)
    run_dir = user.reach / "run"
    run_dir.mkdir()
    os.chown(run_dir, user.uid, user.gid)
    env = user.environ(demo_environ(PATH=f"{tools}:/usr/bin:/bin", PYTHONPATH=str(source)))
    return [str(python), str(tools / pyz.name), "demo", "--keep", "--work-dir", str(run_dir / "demo")], env, run_dir


def demo_environ(**extra: str) -> dict[str, str]:
    """This process's environment without the agent's, the suite's and the interpreter's settings (the
    machine's own stay: CA bundles, proxies, locale), plus ``extra``."""
    dropped = ("AGENT_", "CK_", "PYTHON", "UV_", "VIRTUAL_ENV", "PYTEST", "SHIV_")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(dropped)}, **extra}


async def _crawl(base_url: str, admin_token: str, run: DemoRun) -> None:
    async with AdminClient(base_url, admin_token) as admin:
        spider_id = await admin.create_spider(name="shop_products", framework="scrapy",
                                              command=["scrapy", "crawl", "products"])
        await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / CRAWL_EXAMPLE))
        task_id = await admin.create_task(spider_id, args=["-a", f"start_url={base_url}/demo-site/"])
        run.crawl = await admin.wait_task_final(task_id, DEMO_TIMEOUT)
        run.crawl_items = await admin.get_items(task_id)


async def demo_with_crawl(argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, stderr_path: Path,
                          **popen: Any) -> DemoRun:
    """Run ``argv`` (a ``ckagent demo --keep`` command) in ``cwd`` with exactly ``env`` (``popen``: e.g.
    :meth:`harness.users.SystemUser.popen_options`), its stderr to ``stderr_path``; once it prints its
    ``--keep`` line, run the :data:`CRAWL_EXAMPLE` crawl on its master and agent, then SIGINT it and
    wait for its exit. Bounded by :data:`DEMO_TIMEOUT` (then killed; ``returncode`` None)."""
    out = bytearray()
    run = DemoRun(None, "", "", None)
    with await trio.to_thread.run_sync(stderr_path.open, "wb") as stderr:
        process = await trio.lowlevel.open_process(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                   stderr=stderr, env=dict(env), cwd=str(cwd), **popen)
    assert process.stdout is not None
    try:
        with trio.move_on_after(DEMO_TIMEOUT):
            interrupted = False
            while chunk := await process.stdout.receive_some(65536):
                out += chunk
                if not interrupted and _KEEP_LINE in out:
                    found = _ADMIN.search(out.decode(errors="replace"))
                    if found is not None:
                        await _crawl(found.group(2), found.group(1), run)
                    process.send_signal(signal.SIGINT)  # Ctrl-C: the demo's agent terminates, the demo ends
                    interrupted = True
            await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
                run.returncode = None
            else:
                run.returncode = process.returncode
            await process.stdout.aclose()
    run.stdout = out.decode(errors="replace")
    run.stderr = await trio.Path(stderr_path).read_text(errors="replace")
    levels = _LEVELS.search(run.stdout)
    run.levels = (levels.group(1), levels.group(2)) if levels is not None else None
    return run
