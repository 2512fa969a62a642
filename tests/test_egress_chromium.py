"""Chromium at the proxy egress level: it never proxies loopback unless told to, so the agent's
``NO_PROXY`` carries Chromium's ``<-loopback>`` rule — a page's request to 127.0.0.x goes through the
task's proxy and its policy like any other (a crawled page could otherwise reach the agent's port).
Chromium runs as a spider does: as root, under a uid that is not root (``nobody``), in its own sandbox
where the agent would say it works (``CK_CHROMIUM_SANDBOX``: harness.chromium_sandbox_expected).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from harness import NOBODY_UID, IdentityOrigin, chromium_sandbox_expected, spider_writable

from ckagent.code.runtimes import find_chromium
from ckagent.containment.egress import open_egress, parse_text

CHROMIUM = find_chromium()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (Debian: apt-get install chromium)")
@pytest.mark.parametrize("deny", ["", "127.0.0.2"])
async def test_chromium_sends_loopback_through_the_proxy(nursery: trio.Nursery, tmp_path: Path, deny: str) -> None:
    origin = IdentityOrigin("127.0.0.2")
    await nursery.start(origin.serve)
    egress = open_egress("proxy", None, "ckagent_chromium_test", parse_text(f"metadata,link-local,agent,{deny}", ""))
    await nursery.start(egress.serve)
    rules = await trio.to_thread.run_sync(egress.attach, None, "browser")
    home = spider_writable(tmp_path / "home")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), **egress.task_env(rules, {})}
    assert CHROMIUM is not None
    sandbox = [] if chromium_sandbox_expected() else ["--no-sandbox"]
    argv = [CHROMIUM, "--headless", *sandbox, "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", f"--user-data-dir={home / 'profile'}",
            "--dump-dom", f"http://127.0.0.2:{origin.port}/page"]
    spider = {"user": NOBODY_UID, "group": NOBODY_UID, "extra_groups": []} if os.geteuid() == 0 else {}
    with trio.fail_after(60):
        done = await trio.run_process(argv, env=env, capture_stdout=True, capture_stderr=True, check=False, cwd=home,
                                      **spider)
    page = done.stdout.decode(errors="replace")
    if deny:
        assert not origin.seen and "egress policy" in page, page
        assert egress.refusals(rules)[0].address == "127.0.0.2"
    else:
        assert "/page" in [s.target for s in origin.seen] and '"host": "127.0.0.2"' in page, page
        assert egress.proxy_outcomes(rules).get("forwarded", 0) >= 1  # (and a /favicon.ico, at times)
