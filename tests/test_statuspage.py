"""The agent's status page in a real browser (headless Chromium driven through chromedriver's WebDriver
HTTP API, no Selenium needed): the page loads, lists the running task with its live stats, and the
live tail shows a line the spider printed after the page was loaded. Also without a browser: the
tables are plain HTML, secrets are masked, unknown tasks are 404.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import agent_settings, running_agent, submit

from ckagent.code.runtimes import find_chromedriver, find_chromium

CHROMIUM = find_chromium()
CHROMEDRIVER = find_chromedriver()
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Chromium/chromedriver are not installed (apt-get install chromium chromium-driver)")

SPIDER = r"""
import os, time
from crawlerkeeper_sdk import report_stats, task_context
params = task_context().params
print("spider started; token is " + os.environ["API_TOKEN"], flush=True)
report_stats({"items": 7, "requests": 11, "responsesByStatus": {"200": 10, "404": 1}}, final=True)
while not os.path.exists(params["go"]):
    time.sleep(0.1)
print("printed after the page loaded: " + params["marker"], flush=True)
report_stats({"items": 8, "requests": 12, "responsesByStatus": {"200": 11, "404": 1}}, final=True)
while not os.path.exists(params["stop"]):
    time.sleep(0.1)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def webdriver(profile: Path) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A chromedriver process and one headless Chromium session: yields (client, session URL prefix)."""
    port = free_port()
    assert CHROMEDRIVER is not None and CHROMIUM is not None
    driver = await trio.lowlevel.open_process([str(CHROMEDRIVER), f"--port={port}"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            with trio.fail_after(20):
                while True:
                    try:
                        if (await client.get("/status")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)
            options = {"binary": str(CHROMIUM), "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}"]}
            answer = await client.post("/session", json={"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": options}}})
            assert answer.status_code == 200, answer.text
            session = f"/session/{answer.json()['value']['sessionId']}"
            try:
                yield client, session
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(20):
                    await client.delete(session)
    finally:
        driver.kill()
        with trio.CancelScope(shield=True):
            await driver.wait()


async def script(client: httpx.AsyncClient, session: str, code: str) -> Any:
    answer = await client.post(f"{session}/execute/sync", json={"script": code, "args": []})
    assert answer.status_code == 200, answer.text
    return answer.json()["value"]


@pytest.mark.slow
@needs_browser
async def test_status_page_in_headless_chromium(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    go, stop, marker = tmp_path / "go", tmp_path / "stop", "MARK-4f2a9c"
    with trio.fail_after(120):
        async with running_agent(nursery, settings) as agent:
            task_id = await submit(admin, "page-spider", {"main.py": SPIDER},
                                   params={"go": str(go), "stop": str(stop), "marker": marker},
                                   env={"API_TOKEN": "s3cr3t-value-123"})
            base = f"http://127.0.0.1:{agent.status_port}"
            async with httpx.AsyncClient(base_url=base, timeout=10) as plain:
                while True:  # the spider has printed its first line and reported stats
                    page = (await plain.get("/")).text
                    if "spider started" in page and ">11<" in page:
                        break
                    await trio.sleep(0.1)
                # Without JavaScript: the tables and the last lines are in the HTML; the secret is masked.
                assert task_id in page and "page-spider" in page and "Running tasks (1)" in page
                assert "s3cr3t-value-123" not in page and "token is ***" in page
                assert "200: 10, 404: 1" in page
                log_txt = (await plain.get(f"/tasks/{task_id}/log.txt")).text
                assert "token is ***" in log_txt and "s3cr3t" not in log_txt
                assert (await plain.get("/tasks/no-such-task/tail")).status_code == 404
            async with webdriver(tmp_path / "profile") as (client, session):
                assert (await client.post(f"{session}/url", json={"url": base + "/"})).status_code == 200
                title = await script(client, session, "return document.title")
                assert title.startswith("ckagent")
                rows = await script(client, session, "return [...document.querySelectorAll('td code')]"
                                                     ".map(e => e.textContent)")
                assert task_id in rows
                go.touch()  # now the spider prints a line the page has not seen
                tail = ""
                with trio.fail_after(30):  # noqa: ASYNC912 - the loop's body awaits
                    while marker not in tail:
                        tail = await script(client, session, "return document.querySelector('pre.tail').textContent")
                        await trio.sleep(0.2)
                assert "spider started; token is ***" in tail and "s3cr3t" not in tail
                # The tables are fetched again every few seconds: the newer stats show without a reload.
                requests = ""
                with trio.fail_after(30):  # noqa: ASYNC912 - the loop's body awaits
                    while requests != "12":
                        requests = await script(client, session, "const t = document.querySelector("
                                                "'[data-live=running] table'); const row = t && t.rows[1]; "
                                                "const col = t ? [...t.rows[0].cells].findIndex("
                                                "c => c.textContent === 'requests') : -1; "
                                                "return row && col >= 0 ? row.cells[col].textContent : ''")
                        await trio.sleep(0.3)
                assert marker in await script(client, session, "return document.querySelector('pre.tail').textContent")
            stop.touch()
            task = await admin.wait_task_final(task_id, 30)
            assert task["status"] == "SUCCESS"
            async with httpx.AsyncClient(base_url=base, timeout=10) as plain:
                page = (await plain.get("/")).text
            assert "Recent tasks (1)" in page and "Running tasks (0)" in page and "SUCCESS" in page
