"""The pod is a node (issue 39): the agent started the way a Kubernetes pod starts it — a box of namespaces
on this machine (tests/harness/podbox.py: its own PID and mount namespaces, a non-root uid without
capabilities, a read-only root but for its volumes, a read-only cgroup, PID 1 the image's
``ckagent supervise``) — against the real reference master on 127.0.0.1 outside the box.

- ``ckagent config check`` in each variant the manifests describe (base, net-admin, privileged) says
  the levels docs/deploy.md "What a pod gets" documents; a box leaves nothing on the host (its mounts
  die with its namespace);
- the demo's job and a many-page Scrapy crawl deliver every item in the base pod (the proxy egress
  level, kept-alive connections), PID 1 answers the liveness probe;
- ``kill -9`` of the agent (not PID 1): the supervisor starts another, which re-adopts the crawl (the
  same attempt, every item once, every page at both levels: at the proxy level PID 1 holds the task's
  listener while no agent runs, so the spider's connects wait instead of being refused);
- the preStop ``ckagent stop --migrate`` run in the pod's namespaces hands its running crawls (plain
  Python, and Scrapy) to an agent outside within 30 s, each completing exactly once.

Figures: the file takes about 2.5 min on 2 workers as root (9 tests; the Scrapy ones install Scrapy from
PyPI into the pod's home: no cache is shared with the host).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import trio
from harness import AgentProcess, CrawlSite, eventually, wait_exit, wait_registered
from harness.checkpointnode import LostGraceMaster, short_grace_master
from harness.handover import epoch_of, page_counts
from harness.levelcheck import CheckRun
from harness.podbox import (
    POD_UID,
    VARIANTS,
    PodBox,
    box_cannot,
    box_processes,
    host_leftovers,
    host_mounts,
    run_box,
)
from harness.podcrawls import crawl_problems, demo_problems, demo_tasks, resumable_spider
from harness.pyz import free_port
from harness.scrapyprojects import write_site_project
from harness.twonodes import CrawlNode

from ckagent.containment.egress.nft import NftError, open_nft
from ckagent.devmaster.client import zip_directory


def _nftables_here() -> bool:
    """Whether root may drive nftables here: the nft program or libnftables (the agent uses either; a suite
    run with the program hidden still has the library)."""
    if os.geteuid() != 0:
        return False
    try:
        open_nft()
    except NftError:
        return False
    return True


NFT = _nftables_here()


def _variant(name: str) -> pytest.ParameterSet:
    reason = box_cannot(name)
    return pytest.param(name, id=name, marks=[pytest.mark.skipif(reason is not None, reason=reason or "")])


BOXES = [_variant(name) for name in VARIANTS]


def expected_levels(variant: str) -> tuple[str, str, str]:
    """(containment, egress, identity) a variant's agent gets on this machine (docs/deploy.md, "What a pod
    gets"): a plain or net_admin pod cannot write its cgroup, so no task cgroup and no kernel egress
    (CAP_NET_ADMIN or not: nftables matches a task by its cgroup); net_admin's root (with SETUID, SETGID)
    gives each spider a uid of its own; a privileged pod is root with a writable cgroup: what root gets
    on a host."""
    if variant == "privileged":
        return ("cgroup-v1" if Path("/sys/fs/cgroup/memory").is_dir() else "cgroup-v2",
                "nftables" if NFT else "proxy", "spider-uids")
    return "process-group", "proxy", "spider-uids" if variant == "net_admin" else "agent-user"


def _box(tmp_path: Path, pyz: Path, variant: str, **settings: object) -> PodBox:
    return PodBox(tmp_path / f"box-{variant}", "http://127.0.0.1:9", "no-token-here-0123456789", pyz=pyz,
                  variant=variant, **settings)


@pytest.mark.parametrize("variant", BOXES)
async def test_config_check_in_a_pod_says_its_levels(tmp_path: Path, pyz: Path, variant: str) -> None:
    box = await trio.to_thread.run_sync(lambda: _box(tmp_path, pyz, variant))
    before = await trio.to_thread.run_sync(host_mounts)
    run = await run_box(box, box.ckagent("config", "check", "-c", str(box.config_path)))
    check = CheckRun(run.returncode, run.stdout, "")
    assert run.returncode == 0, run.stdout
    got = tuple(check.section(concern)[0].split()[1] for concern in ("containment", "egress", "identity"))
    print(f"figures [{variant}] levels {got}\n" + run.stdout)
    assert got == expected_levels(variant), run.stdout
    uid = (POD_UID if variant == "plain" else 0) if os.geteuid() == 0 else os.geteuid()
    assert f"uid {uid}" in run.stdout, run.stdout
    if variant != "privileged":
        assert "Read-only file system" in check.text("containment"), run.stdout
    assert await trio.to_thread.run_sync(host_mounts) == before


@pytest.mark.skipif(box_cannot() is not None, reason=box_cannot() or "")
async def test_a_box_is_a_pod_and_leaves_nothing_on_the_host(tmp_path: Path, pyz: Path) -> None:
    box = await trio.to_thread.run_sync(lambda: _box(tmp_path, pyz, "plain"))
    before = await trio.to_thread.run_sync(host_mounts)
    probe = ("import os, sys\n"
             "def w(p):\n"
             "    try:\n"
             "        open(p, 'w').close(); return 'rw'\n"
             "    except OSError as e:\n"
             "        return e.strerror\n"
             "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapBnd', 'CapAmb'))]\n"
             f"print('pid', os.getpid(), 'uid', os.getuid(), 'caps', *caps)\n"
             f"print('root', w('/etc/ckbox-probe'), 'cgroup', w('/sys/fs/cgroup/unified/ckbox-probe'))\n"
             f"print('data', w({str(box.work_dir / 'p')!r}), 'home', w({str(box.home / 'p')!r}), 'tmp', w('/tmp/p'))\n"
             "print('procs', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n")
    await box.start_argv([str(Path("/usr/bin/python3")), "-u", "-c", probe + "import time; time.sleep(60)"])
    async with box:
        with trio.fail_after(30):
            await eventually(lambda: trio.to_thread.run_sync(lambda: "procs" in box.log_text()), 30, "the probe's lines")
            pid1 = box.pid1()
            assert pid1 is not None
            assert await trio.to_thread.run_sync(box_processes, pid1) == [pid1]
        await box.kill()
    out = box.log_text()
    uid = POD_UID if os.geteuid() == 0 else os.geteuid()
    assert f"pid 1 uid {uid} caps 0000000000000000 0000000000000000 0000000000000000" in out, out
    assert "root Read-only file system cgroup Read-only file system" in out, out
    assert "data rw home rw tmp rw" in out, out
    assert "procs [1]" in out, out
    assert await trio.to_thread.run_sync(lambda: (box.tmp / "p").exists() and not Path("/tmp/p").exists())  # (its volume)
    assert await trio.to_thread.run_sync(host_mounts) == before
    assert await trio.to_thread.run_sync(box_processes, pid1) == []


PLAIN = pytest.mark.skipif(box_cannot() is not None, reason=box_cannot() or "")
AGENT_TIMEOUT = 600.0
"""Seconds a crawl in a box may take in all (a cold uv cache installs Scrapy from PyPI into the box's home)."""


async def _started_box(nursery: trio.Nursery, tmp_path: Path, pyz: Path, *, name: str = "pod-0",
                       variant: str = "plain", master: LostGraceMaster | None = None,
                       **settings: object) -> tuple[LostGraceMaster, PodBox]:
    """A reference master outside (127.0.0.1; ``master`` or a new one) and a box of ``variant`` started
    against it, as the manifests configure the agent (``agent.sigterm: migrate``) (not yet in an ``async
    with``: the caller owns it)."""
    master = master or await short_grace_master(nursery, tmp_path, 60.0)
    box = await trio.to_thread.run_sync(lambda: PodBox(
        tmp_path / name, master.base_url, master.registration_token, pyz=pyz, live_port=free_port(), variant=variant,
        agent__name=name, agent__sigterm="migrate", deps__uv_sync_timeout=AGENT_TIMEOUT, **settings))
    await box.start()
    return master, box


@PLAIN
@pytest.mark.slow
async def test_the_demo_and_a_scrapy_crawl_deliver_every_item_in_a_pod(nursery: trio.Nursery, tmp_path: Path,
                                                                       pyz: Path) -> None:
    master, box = await _started_box(nursery, tmp_path, pyz)
    async with box:
        await wait_registered(master.admin, box, "pod-0")
        [node] = [n for n in await master.admin.list_nodes() if n["name"] == "pod-0"]
        assert (node["containment"]["level"], node["egress"]["level"]) == ("process-group", "proxy"), node
        pid1 = box.pid1()
        assert pid1 is not None and box.pid1_argv()[1:3] == [str(box.pyz), "supervise"]
        async with httpx.AsyncClient() as client:  # the kubelet's liveness probe, answered by PID 1
            live = await client.get(f"http://127.0.0.1:{box.live_port}/livez", timeout=10)
        assert live.status_code == 200, live.text
        tasks = await demo_tasks(master.admin, master.base_url)
        problems = await demo_problems(master.admin, tasks, AGENT_TIMEOUT)
        assert not problems, "\n\n".join(problems) + "\n" + box.log_text()[-3000:]
        box.terminate()  # the kubelet's SIGTERM to PID 1: the agent migrates (nothing runs) and the pod ends
        assert await wait_exit(box, 60) == 0, box.log_text()[-3000:]
    assert pid1 is not None and await trio.to_thread.run_sync(box_processes, pid1) == []


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in BOXES if v.values[0] != "net_admin"])
async def test_kill_9_of_the_agent_in_a_pod_loses_no_crawl(nursery: trio.Nursery, tmp_path: Path, pyz: Path,
                                                          variant: str) -> None:
    site = CrawlSite(listings=10, per_listing=20, rate=25.0)
    await nursery.start(site.serve)
    master, box = await _started_box(nursery, tmp_path, pyz, variant=variant)
    async with box:
        await wait_registered(master.admin, box, "pod-0")
        spider = await resumable_spider(master.admin)
        task_id = await master.admin.create_task(spider, params={"start_url": site.start_url})
        with trio.fail_after(120):
            await site.reached(site.pages // 3)
        pid1, agent = box.pid1(), box.agent_pid()
        assert pid1 is not None and agent is not None, box.log_text()[-3000:]
        killed_at = time.monotonic()
        os.kill(agent, signal.SIGKILL)  # the agent alone (an OOM kill of it, a crash): not PID 1

        async def new_agent() -> int | None:
            now = await trio.to_thread.run_sync(box.agent_pid)
            return now if now not in (None, agent) else None

        restarted = await eventually(new_agent, 60, "a new agent under PID 1")
        await eventually(lambda: trio.to_thread.run_sync(lambda: "re-adopted" in box.log_text()), 60, "re-adoption")
        back_after = time.monotonic() - killed_at
        final = await master.admin.wait_task_final(task_id, AGENT_TIMEOUT)
        items = await master.admin.get_items(task_id)
        assert box.pid1() == pid1, "PID 1 is not the one that was"
        held = await trio.to_thread.run_sync(host_leftovers, box.work_dir)
        assert bool(held) == (variant == "privileged"), held  # (the check below sees them: the table at least)
        box.terminate()  # the pod ends as the kubelet ends it: its agent stops, and so does PID 1
        assert await wait_exit(box, 60) == 0, box.log_text()[-3000:]
    # nothing of the pod's agent is left on the host (a privileged one made cgroups and an nftables table there)
    assert await trio.to_thread.run_sync(host_leftovers, box.work_dir) == []
    log = "\n".join(await master.admin.get_logs(task_id))
    print(f"figures kill -9 [{variant}]: agent {agent} → {restarted}, re-adopted after {back_after:.1f} s; {len(items)} items "
          f"of {site.pages}; pages fetched {site.fetched()}, twice {site.fetched_twice()}")
    # What holds: the same attempt went on under the new agent (re-adopted, not run again), nothing twice.
    assert "re-adopted" in log, log[-3000:]
    assert len(final.get("attempts") or []) == 1, final
    assert all(n == 1 for n in page_counts(items).values()), page_counts(items).most_common(3)
    problems = crawl_problems(final, items, site, attempts=1)
    # every page, at both levels: at `proxy` (the plain pod's) the task's listener is held by PID 1's
    # descriptor store while no agent runs (connects wait in its backlog); at nftables the kernel filters
    assert not problems, "\n".join(problems) + "\n" + log[-3000:]


@PLAIN
@pytest.mark.slow
async def test_sigterm_with_migrate_hands_every_crawl_over_within_30_s(nursery: trio.Nursery, tmp_path: Path,
                                                                        pyz: Path) -> None:
    sites = [CrawlSite(listings=10, per_listing=20, rate=20.0) for _ in range(2)]
    for site in sites:
        await nursery.start(site.serve)
    master, box = await _started_box(nursery, tmp_path, pyz)
    admin = master.admin
    (tmp_path / "outside").mkdir()
    outside = AgentProcess(tmp_path / "outside", master.base_url, master.registration_token, agent__name="outside")
    async with box, outside:
        await wait_registered(admin, box, "pod-0")
        tasks = [await admin.create_task(await resumable_spider(admin, f"crawl-{n}"), params={"start_url": site.start_url},
                                         checkpoint_interval_seconds=2)
                 for n, site in enumerate(sites)]  # (two spiders: one spider's tasks run one at a time)
        [pod] = [n["id"] for n in await admin.list_nodes() if n["name"] == "pod-0"]

        async def both_running_in_the_pod() -> bool:
            views = [await admin.get_task(t) for t in tasks]
            return all(v.get("status") == "RUNNING" and v.get("nodeId") == pod for v in views)

        await eventually(both_running_in_the_pod, 120, "both crawls running in the pod")
        await outside.start()
        await wait_registered(admin, outside, "outside")
        with trio.fail_after(120):
            for site in sites:
                await site.reached(site.pages // 4)
            await trio.lowlevel.checkpoint()
        left_at = time.time()
        prestop = await box.prestop()  # the preStop hook, inside the pod's namespaces
        # Its exit code is 0, or SIGKILL when it had said "exited" but not yet exited itself as the agent's exit 0
        # ended PID 1 and so the box (as a container's end kills its preStop exec): what it said counts.
        said = prestop.stdout + prestop.stderr
        assert prestop.returncode in (0, -signal.SIGKILL) and "exited after" in said, said + box.log_text()[-3000:]
        box.terminate()  # then the kubelet's SIGTERM to PID 1 (the agent is gone already: nothing to do)
        assert await wait_exit(box, 30) == 0, box.log_text()[-3000:]
        finals = [await admin.wait_task_final(t, AGENT_TIMEOUT) for t in tasks]
        problems = []
        resumed = []
        for task_id, site, final in zip(tasks, sites, finals, strict=True):
            items = await admin.get_items(task_id)
            problems += crawl_problems(final, items, site, attempts=2)
            attempts = final.get("attempts") or [{}, {}]
            if attempts[0].get("errorCode") != "MIGRATED" or attempts[-1].get("nodeId") == pod:
                problems.append(f"{task_id}: attempts {attempts}")
            started = epoch_of(attempts[-1].get("startedAt"))
            resumed.append(None if started is None else started - left_at)
        print(f"figures migrate: prestop {prestop.stderr.strip().splitlines()[-1:]}, resumed outside after {resumed} s")
        assert not problems, "\n".join(problems)
        assert all(r is not None and r < 30 for r in resumed), resumed


@PLAIN
@pytest.mark.slow
async def test_sigterm_with_migrate_hands_a_scrapy_crawl_over_within_30_s(nursery: trio.Nursery, tmp_path: Path,
                                                                         pyz: Path) -> None:
    """The same with a Scrapy crawl (harness.scrapyprojects ``site``: 8 requests in flight over kept-alive
    connections through the pod's egress proxy; its JOBDIR checkpointed by the agent's Scrapy hook). The
    agent outside is made ready first (its Scrapy environment built by a task that holds it), as the
    other pods of a Deployment are."""
    site = CrawlSite(listings=30, per_listing=20, rate=50.0)
    await nursery.start(site.serve)
    master = await short_grace_master(nursery, tmp_path, 60.0)
    admin = master.admin
    project = await trio.to_thread.run_sync(write_site_project, tmp_path / "project")
    spider = str(await admin.create_spider(name="site", framework="scrapy", command=["scrapy", "crawl", "site"],
                                           env={"START_URL": site.start_url}))
    await admin.upload_package(spider, await trio.to_thread.run_sync(zip_directory, project))
    (tmp_path / "outside").mkdir()
    outside = AgentProcess(tmp_path / "outside", master.base_url, master.registration_token, agent__name="outside",
                           agent__max_workers=1, deps__uv_sync_timeout=AGENT_TIMEOUT)
    async with outside:
        await outside.start()
        await wait_registered(admin, outside, "outside")
        await CrawlNode("outside", outside, admin).occupy(spider, args=["-a", "hold=1"])
        _, box = await _started_box(nursery, tmp_path, pyz, master=master)
        async with box:
            await wait_registered(admin, box, "pod-0")
            task_id = str(await admin.create_task(spider, checkpoint_interval_seconds=2))
            with trio.fail_after(AGENT_TIMEOUT):  # (the pod builds its Scrapy environment first)
                await site.reached(site.pages // 3)
            [pod] = [n["id"] for n in await admin.list_nodes() if n["name"] == "pod-0"]
            assert (await admin.get_task(task_id)).get("nodeId") == pod
            site.release()  # the outside agent's holding task ends: it has a slot again
            left_at = time.time()
            prestop = await box.prestop()
            said = prestop.stdout + prestop.stderr
            assert prestop.returncode in (0, -signal.SIGKILL) and "exited after" in said, said + box.log_text()[-3000:]
            assert await wait_exit(box, 30) == 0, box.log_text()[-3000:]
        final = await admin.wait_task_final(task_id, AGENT_TIMEOUT)
        items = await admin.get_items(task_id)
    attempts = final.get("attempts") or [{}]
    started = epoch_of(attempts[-1].get("startedAt"))
    resumed = None if started is None else started - left_at
    log = "\n".join(await admin.get_logs(task_id))
    print(f"figures migrate scrapy: {said.strip().splitlines()[-1:]}, resumed outside after {resumed} s; "
          f"pages fetched {site.fetched()}, twice {site.fetched_twice()}")
    problems = crawl_problems(final, items, site, attempts=2)
    if attempts[0].get("errorCode") != "MIGRATED" or attempts[-1].get("nodeId") == pod:
        problems.append(f"attempts {attempts}")
    assert not problems, "\n".join(problems) + "\n" + log[-3000:]
    assert "resuming from checkpoint" in log, log[-3000:]
    assert resumed is not None and resumed < 30, resumed
