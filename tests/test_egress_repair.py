"""The agent's nftables table deleted by someone else while tasks run (an operator's ``nft flush ruleset``,
``systemctl restart nftables``, a firewall manager's reload): the agent makes it again with every attached
task's rules within about a second (ckagent.containment.egress.repair), and when it cannot, stops its
tasks (EGRESS_LOST) and takes no more (the intake gate's ``egress`` key).

Found by the fleet benchmark: 16 agents whose tables vanished failed every task they claimed ("add chain
inet ckagent_…: No such file or directory") and kept claiming, while their running tasks crawled
without a policy. Each test deletes only its own agent's table (``nft delete table inet <its name>``:
the kernel announces it as it does each table a ``flush ruleset`` deletes) — never the ruleset, never
another table; connections go to 127.0.0.x only.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    LEVEL,
    RecordingMaster,
    connect_from,
    containment_at,
    delete_table,
    egress_kernel_missing,
    eventually,
    loopback_listener,
    no_strays,
    running_agent,
    settings_for,
    submit,
    table_text,
    tables_deleted,
    wait_for_log,
)

from ckagent.containment import ContainmentLevel, Limits, available_levels
from ckagent.containment.egress import EgressError, Refusal, open_egress, parse_text
from ckagent.containment.egress import repair as repair_module
from ckagent.containment.egress.netlink import Netlink
from ckagent.containment.egress.nft import Nft, NftError
from ckagent.containment.egress.owners import table_name
from ckagent.containment.hierarchy import agent_group_name
from ckagent.master.protocol import Task
from ckagent.node.intake import IntakeGate
from ckagent.task.admission import Admission
from ckagent.task.nodelevels import EgressLost
from ckagent.task.stop import StopReason

V2_LEVELS = [lvl.value for lvl in available_levels(Path(tempfile.gettempdir()) / "ckagent-levels-probe")
             if ContainmentLevel(lvl).has_cgroup]
MISSING = egress_kernel_missing() or (None if V2_LEVELS else "no containment level with a v2 cgroup here")

pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"nftables egress cannot be tested here: {MISSING}")

DENY = "metadata,link-local,agent,127.0.0.2"


class Refusing(Nft):
    """An nft backend whose every change is refused as without CAP_NET_ADMIN (the rights gone)."""

    kind = "nft"

    def run(self, commands: str) -> None:
        raise NftError("Error: Could not process rule: Operation not permitted")

    def run_json(self, command: str) -> dict[str, list[object]]:
        raise NftError("Error: Could not process rule: Operation not permitted")


async def test_a_deleted_table_is_made_again_with_the_running_tasks_rules_within_a_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    work_dir = tmp_path / "agent"
    work_dir.mkdir()
    name = table_name(agent_group_name(work_dir))
    caplog.set_level(logging.WARNING, "ckagent.containment.egress.repair")
    with tables_deleted(name), containment_at(V2_LEVELS[0], work_dir) as containment, \
            loopback_listener("127.0.0.2") as port:
        egress = open_egress("nftables", containment, agent_group_name(work_dir), parse_text(DENY, ""),
                             agent_port=9, work_dir=work_dir)
        assert egress.keeper is not None and egress.table is not None
        running, later = containment.jail("running", Limits()), containment.jail("later", Limits())
        try:
            with trio.fail_after(60):
                rules = await trio.to_thread.run_sync(egress.attach, running, "running")
                assert rules is not None
                assert await trio.to_thread.run_sync(connect_from, running, "127.0.0.2", port) == 7
                async with trio.open_nursery() as service:
                    await service.start(egress.serve)
                    assert await trio.to_thread.run_sync(delete_table, name)
                    deleted = time.monotonic()

                    async def repaired() -> bool:
                        return egress.keeper is not None and egress.keeper.repairs == 1

                    await eventually(repaired, 5, "the table made again", interval=0.005)
                    took = time.monotonic() - deleted
                    text = await trio.to_thread.run_sync(table_text, name)
                    assert text is not None and f'"{rules.cgroup}" : jump {rules.chain}' in text, text
                    assert "9" in text.split("agent_ports")[1].split("}")[0]  # the agent ports are back
                    assert await trio.to_thread.run_sync(connect_from, running, "127.0.0.2", port) == 7
                    assert egress.refusals(rules) == [Refusal("127.0.0.2", port, 1)]  # (counted anew)
                    other = await trio.to_thread.run_sync(egress.attach, later, "later")  # a new task attaches
                    assert other is not None
                    assert await trio.to_thread.run_sync(connect_from, later, "127.0.0.2", port) == 7
                    service.cancel_scope.cancel()
                egress.detach(other)
                egress.detach(rules)
        finally:
            running.close()
            later.close()
            egress.close()
    assert took < 1.0, f"repaired {took:.3f} s after the deletion"
    [warning] = [r.getMessage() for r in caplog.records if "deleted by someone else" in r.getMessage()]
    assert f"the table inet {name} was deleted by someone else (nft flush ruleset?); made again with 1 tasks' " \
        "rules" in warning, warning
    assert table_text(name) is None  # the agent's close deleted it, and nothing made it again


async def test_an_attach_racing_a_deletion_repairs_the_table_and_succeeds(tmp_path: Path) -> None:
    """An attach that meets the missing table (no watch yet: it is the first to notice) makes it again
    with every task attached so far and adds its own. Then, with the watch running, attaches in two
    threads while the table is deleted: none fails, every task's element is in the table made again,
    and it was made again once (the watch and an attach that both notice do not both repair)."""
    work_dir = tmp_path / "agent"
    work_dir.mkdir()
    name = table_name(agent_group_name(work_dir))
    with tables_deleted(name), containment_at(V2_LEVELS[0], work_dir) as containment, \
            loopback_listener("127.0.0.2") as port:
        egress = open_egress("nftables", containment, agent_group_name(work_dir), parse_text(DENY, ""),
                             work_dir=work_dir)
        assert egress.keeper is not None
        jails = [containment.jail(f"t{i}", Limits()) for i in range(42)]
        try:
            with trio.fail_after(60):
                first = await trio.to_thread.run_sync(egress.attach, jails[0], "t0")
                assert first is not None and await trio.to_thread.run_sync(delete_table, name)
                second = await trio.to_thread.run_sync(egress.attach, jails[1], "t1")  # repairs, then adds
                assert second is not None and egress.keeper.repairs == 1
                failures: list[Exception] = []
                attached = []
                go = threading.Barrier(3)

                def attach_some(indices: range) -> None:
                    go.wait(10)
                    for i in indices:
                        try:
                            attached.append(egress.attach(jails[i], f"t{i}"))
                        except Exception as exc:
                            failures.append(exc)

                def delete() -> None:
                    go.wait(10)
                    time.sleep(0.002)  # (a few attaches in)
                    with contextlib.closing(Netlink()) as netlink:
                        netlink.delete_table(name)

                async with trio.open_nursery() as service:
                    await service.start(egress.serve)
                    async with trio.open_nursery() as racing:
                        racing.start_soon(trio.to_thread.run_sync, attach_some, range(2, 22))
                        racing.start_soon(trio.to_thread.run_sync, attach_some, range(22, 42))
                        racing.start_soon(trio.to_thread.run_sync, delete)

                    async def repaired() -> bool:
                        return egress.keeper is not None and egress.keeper.repairs >= 2

                    await eventually(repaired, 5, "the table made again", interval=0.005)
                    service.cancel_scope.cancel()
                assert failures == [] and len(attached) == 40
                assert egress.keeper.repairs == 2
                text = await trio.to_thread.run_sync(table_text, name)
                assert text is not None
                for rules in [first, second, *attached]:
                    assert rules is not None and f'"{rules.cgroup}" : jump' in text, (rules.task_id, text)
                assert await trio.to_thread.run_sync(connect_from, jails[0], "127.0.0.2", port) == 7
                assert await trio.to_thread.run_sync(connect_from, jails[41], "127.0.0.2", port) == 7
        finally:
            for jail in jails:
                jail.close()
            egress.close()


async def test_a_table_that_cannot_be_made_again_stops_the_tasks_and_closes_the_intake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rights are gone when the table goes (here: every nft change refused): the running task is
    stopped EGRESS_LOST and the node takes no tasks, rather than crawl unprotected; a new attach fails
    at once; when the table can be made again, the intake opens."""
    monkeypatch.setattr(repair_module, "RETRY_INTERVAL", 0.2)
    work_dir = tmp_path / "agent"
    work_dir.mkdir()
    name = table_name(agent_group_name(work_dir))
    admission, gate = Admission(2), IntakeGate()
    rt = admission.admit(Task.from_json({"id": "running", "spiderId": "s", "framework": "python"}))
    with tables_deleted(name), containment_at(V2_LEVELS[0], work_dir) as containment:
        egress = open_egress("nftables", containment, agent_group_name(work_dir), parse_text(DENY, ""),
                             work_dir=work_dir)
        assert egress.keeper is not None and egress.table is not None
        jail, later = containment.jail("running", Limits()), containment.jail("later", Limits())
        try:
            with trio.fail_after(60):
                rt.egress = await trio.to_thread.run_sync(egress.attach, jail, "running")
                async with trio.open_nursery() as service:
                    await service.start(partial(egress.serve, lost=EgressLost(admission, gate)))
                    working, egress.table.nft = egress.table.nft, Refusing()
                    assert await trio.to_thread.run_sync(delete_table, name)
                    await gate.wait_closed()
                    assert gate.is_closed("egress") and gate.reason is not None
                    assert f"the table inet {name} is gone and cannot be made again" in gate.reason
                    assert "Operation not permitted" in gate.reason
                    assert rt.stop.reason is StopReason.EGRESS_LOST
                    assert "must not run without its network policy" in rt.stop.describe()
                    with pytest.raises(EgressError, match="cannot be made again"):
                        await trio.to_thread.run_sync(egress.attach, later, "later")
                    egress.table.nft = working  # the rights are back: the next try makes it
                    await gate.wait_open()
                    assert egress.keeper.repairs == 1 and egress.keeper.lost is None
                    text = await trio.to_thread.run_sync(table_text, name)
                    assert text is not None and f'"{rt.egress.cgroup}" : jump' in text, text
                    service.cancel_scope.cancel()
        finally:
            jail.close()
            later.close()
            egress.close()



WAITS_THEN_CONNECTS = """
import os, socket, time
port = int(os.environ["TARGET_PORT"])
go = os.path.join(os.environ["CK_TASK_DIR"], "go")
print("ready", flush=True)
for _ in range(600):  # bounded: at most a minute
    if os.path.exists(go):
        break
    time.sleep(0.1)
try:
    socket.create_connection(("127.0.0.2", port), timeout=5).close()
    print("connected", flush=True)
except ConnectionRefusedError:
    print("refused", flush=True)
"""


async def test_the_agent_makes_its_table_again_and_keeps_taking_tasks(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path,
) -> None:
    """The agent end to end: its table deleted while a task runs, the task's later connection is
    refused all the same, ``ckagent_egress_repairs_total`` says so, and the next task succeeds."""
    LEVEL["current"] = V2_LEVELS[0]
    admin = recording_master.admin
    name = table_name(agent_group_name(tmp_path / "agent"))
    with tables_deleted(name), loopback_listener("127.0.0.2") as port:
        settings = settings_for(tmp_path, recording_master, AGENT_TASK_EGRESS="nftables", AGENT_TASK_EGRESS_DENY=DENY)
        async with running_agent(nursery, settings) as agent:
            running = await submit(admin, "repaired", {"main.py": WAITS_THEN_CONNECTS}, env={"TARGET_PORT": str(port)})
            await wait_for_log(admin, running, "ready", 60)
            assert await trio.to_thread.run_sync(delete_table, name)

            async def repairs() -> str:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}") as client:
                    metrics = (await client.get("/metrics")).text
                return "ckagent_egress_repairs_total 1.0" in metrics and metrics

            await eventually(repairs, 10, "the repair counted", interval=0.05)
            (tmp_path / "agent" / "tasks" / running / "go").write_text("")
            with trio.fail_after(60):
                first = await admin.wait_task_final(running, 60)
            after = await submit(admin, "after", {"main.py": WAITS_THEN_CONNECTS.replace("for _ in range(600)",
                                                                                       "for _ in range(0)")},
                                 env={"TARGET_PORT": str(port)})
            with trio.fail_after(60):
                second = await admin.wait_task_final(after, 60)
        first_lines, second_lines = await admin.get_logs(running), await admin.get_logs(after)
    assert first["status"] == "SUCCESS" and "refused" in first_lines and "connected" not in first_lines, first_lines
    assert first["egressRefused"] == [{"address": "127.0.0.2", "port": port, "count": 1}], first
    assert second["status"] == "SUCCESS" and "refused" in second_lines, (second, second_lines)
