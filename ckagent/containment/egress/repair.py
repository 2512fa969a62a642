"""The agent's table made again when someone else deletes it, with every attached task's rules.

Others delete it: an operator's ``nft flush ruleset``, ``systemctl restart nftables`` (Debian's
``/etc/nftables.conf`` begins with ``flush ruleset``), a firewall manager's reload. Every running task
would then crawl without its policy (its spider reaches the cloud metadata service), and every task
attached after would fail ("add chain inet ckagent_…: No such file or directory") while the agent
keeps claiming. :class:`TableKeeper` keeps what it needs to write each attached task's rules again and:

- follows nftables' change events (:class:`~.netlink.TableEvents`, the multicast group ``nft monitor``
  reads): a deletion of a table of this name *with this table's handle* (the kernel numbers each
  table it makes; a deletion of an older one, e.g. a copy of ours restored by ``nft -f`` that the
  repair replaces, is not ours) makes it again at once — no poll per task; where the events cannot be
  followed, it looks at the table every :data:`FALLBACK_CHECK_INTERVAL` seconds;
- an attach that fails while the table is gone makes it again and tries once more;
- the repair: :meth:`EgressTable.create <.table.EgressTable.create>` (the set of agent ports, the
  policy chains as tasks need them, the node's pinned one with its first task), then one element per
  attached task (its cgroup's id read again); one WARNING, :attr:`TableKeeper.repairs` counted
  (``ckagent_egress_repairs_total``). What the tasks were refused before is lost with the table.
- when the table cannot be made (the rights are gone), every attached task is stopped and the node
  takes no tasks (:class:`LostRules`, the agent's: EGRESS_LOST, the intake gate's key ``egress``),
  and it tries again every :data:`RETRY_INTERVAL` seconds (the intake opens when it works).

Threads: :meth:`TableKeeper.attach`, :meth:`~TableKeeper.remove`, :meth:`~TableKeeper.check` block
(nft batches, netlink round trips) and are thread-safe (one lock); :class:`LostRules` is told on the
Trio thread, after the lock is released. Exceptions: NftError / EgressError as the docstrings say.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ckagent.containment.egress.errors import EgressError
from ckagent.containment.egress.netlink import Netlink, NetlinkError, TableEvents
from ckagent.containment.egress.nft import NftError
from ckagent.containment.egress.table import NFT_CGROUP_ROOT, EgressTable, TaskRules
from ckagent.node.egress_policy import EgressPolicy

if TYPE_CHECKING:  # (the containment package imports Trio)
    from ckagent.containment import TaskJail

log = logging.getLogger(__name__)

RETRY_INTERVAL = 10.0
"""Seconds between two tries to make the table again while it cannot be made."""
FALLBACK_CHECK_INTERVAL = 5.0
"""Seconds between two looks at the table where nftables' events cannot be followed."""


class LostRules(Protocol):
    """What the node does when tasks' rules cannot be kept (the agent's: ckagent.task.egresslost).
    Called on the Trio thread; must not block."""

    def stop(self, task_ids: list[str], why: str) -> None:
        """Stop these tasks: their rules are gone and cannot be written again (``why``)."""

    def intake(self, why: str | None) -> None:
        """The table cannot be made (``why``): take no tasks; None: it can again."""


@dataclass
class _Attached:
    rules: TaskRules
    agent_port: int | None
    resolvers: tuple[tuple[str, int], ...]
    pin: bool


class TableKeeper:
    """The agent's table kept in the kernel (see the module docstring). ``ports()``: every agent's port,
    for the ``agent_ports`` set. ``repairs``: how often the table was made again; ``lost``: why it
    cannot be made (None: it is in place)."""

    def __init__(self, table: EgressTable, ports: Callable[[], Collection[int]]) -> None:
        self.table, self._ports = table, ports
        self.repairs = 0
        self.lost: str | None = None
        self._attached: dict[int, _Attached] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._told: list[tuple[str, tuple[Any, ...]]] = []  # (a LostRules method, its arguments)
        self._handlers: LostRules | None = None
        try:
            self._netlink: Netlink | None = Netlink()
        except NetlinkError:
            self._netlink = None
        self.handle = self._current_or_none()

    def attach(self, jail: TaskJail, task_id: str, policy: EgressPolicy, agent_port: int | None,
               resolvers: tuple[tuple[str, int], ...], *, pin: bool) -> TaskRules:
        """Add the task's element (:meth:`EgressTable.add <.table.EgressTable.add>`), the table made
        again first when it is gone. Blocking. Raises EgressError (no v2 cgroup), NftError, ValueError."""
        path = jail.v2_path()
        if path is None:
            raise EgressError(f"egress: the task's jail ({jail.level}) has no cgroup in the v2 tree to filter")
        cgroup = str(path.relative_to(NFT_CGROUP_ROOT))
        try:
            with self._lock:
                if self.lost is not None:
                    self._repair(f"task {task_id} was to be attached")
                try:
                    rules = self.table.add(task_id, cgroup, policy, agent_port, resolvers, pin=pin)
                except NftError:
                    if not self._gone():
                        raise
                    self._repair(f"the rules of task {task_id} could not be added")
                    rules = self.table.add(task_id, cgroup, policy, agent_port, resolvers, pin=pin)
                self._attached[id(rules)] = _Attached(rules, agent_port, resolvers, pin)
                return rules
        finally:
            self._tell()

    def remove(self, rules: TaskRules, refused: list[Any]) -> None:
        """Remove the task's rules (:meth:`EgressTable.remove <.table.EgressTable.remove>`; never raises)."""
        with self._lock:
            self._attached.pop(id(rules), None)
            self.table.remove(rules, refused)

    def check(self, how: str) -> bool:
        """Make the table again when it is gone (or could not be made so far); ``how``: what noticed it,
        for the log. True when it is in place. Blocking; never raises."""
        try:
            with self._lock:
                if self._closed or (self.lost is None and not self._gone()):
                    return True
                with contextlib.suppress(NftError):  # (said, and told)
                    self._repair(how)
                return self.lost is None
        finally:
            self._tell()

    async def watch(self, lost: LostRules | None = None, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Follow nftables' events and make the table again when it is deleted (startable: ``started()``
        once subscribed); ``lost`` is told when it cannot be. Until cancelled."""
        self._handlers = lost
        try:
            try:
                events = TableEvents()
            except NetlinkError as exc:
                log.info("egress: %s; the table inet %s is looked at every %g s", exc, self.table.name,
                         FALLBACK_CHECK_INTERVAL)
                task_status.started()
                while True:
                    await trio.sleep(FALLBACK_CHECK_INTERVAL if self.lost is None else RETRY_INTERVAL)
                    await trio.to_thread.run_sync(self.check, "found gone at a periodic look")
            try:
                task_status.started()
                await trio.to_thread.run_sync(self.check, "found gone at the start of the watch")
                await self._follow(events)
            finally:
                events.close()
        finally:
            self._handlers = None

    async def _follow(self, events: TableEvents) -> None:
        while True:
            with trio.move_on_after(RETRY_INTERVAL if self.lost is not None else float("inf")):
                await trio.lowlevel.wait_readable(events.sock)
            how = "" if self.lost is None else "a new try"
            try:
                if any(h is None or h == self.handle for h in events.deleted(self.table.name)):
                    how = "nftables announced its deletion"
            except NetlinkError as exc:
                how = f"events were lost ({exc})"
            if how:
                await trio.to_thread.run_sync(self.check, how)

    def close(self) -> None:
        """Delete the table (no repair after this) and close the sockets. Raises NftError."""
        with self._lock:
            self._closed = True
            self._attached.clear()
            try:
                self.table.close()
            finally:
                if self._netlink is not None:
                    self._netlink.close()

    def _repair(self, how: str) -> None:
        """Make the table again with every attached task's element (under the lock). Raises NftError
        when the table cannot be made (``lost`` set, the tasks to be stopped and the intake closed)."""
        if self._closed:
            raise NftError(f"the table inet {self.table.name} was closed")
        began = time.monotonic()
        try:
            self.table.create()
            self.handle = self._current()
            self.table.set_agent_ports(self._ports())
        except NftError as exc:
            why = f"the table inet {self.table.name} is gone and cannot be made again ({exc})"
            if self.lost is None:
                log.error("egress: %s (%s): the tasks are stopped and no task is taken until it can",
                          why, how)
                self._told.append(("stop", ([a.rules.task_id for a in self._attached.values()], why)))
                self._told.append(("intake", (why,)))
            self.lost = why
            raise NftError(why) from exc
        failed = []
        for key, entry in list(self._attached.items()):
            rules = entry.rules
            if not (NFT_CGROUP_ROOT / rules.cgroup).is_dir():  # its processes are gone: nothing to filter
                rules.removed = True
                del self._attached[key]
                continue
            try:
                again = self.table.add(rules.task_id, rules.cgroup, rules.policy, entry.agent_port,
                                       entry.resolvers, pin=entry.pin)
            except NftError as exc:
                log.warning("egress: cannot add the rules of task %s again: %s", rules.task_id, exc)
                failed.append(rules.task_id)
                continue
            rules.key, rules.chain, rules.hits = again.key, again.chain, {}
        self.repairs += 1
        log.warning("egress: the table inet %s was deleted by someone else (nft flush ruleset?); made again "
                    "with %d tasks' rules in %.0f ms (%s)", self.table.name, len(self._attached) - len(failed),
                    (time.monotonic() - began) * 1000, how)
        if failed:
            self._told.append(("stop", (failed, "the task's rules could not be written again after its "
                                                f"table inet {self.table.name} was deleted")))
        if self.lost is not None:
            log.info("egress: the table inet %s is in place again: taking tasks", self.table.name)
            self._told.append(("intake", (None,)))
        self.lost = None

    def _tell(self) -> None:
        """Tell the handlers what the last repair found (outside the lock; on the Trio thread)."""
        with self._lock:
            told, self._told = self._told, []
        handlers = self._handlers
        if handlers is None:
            return
        for name, args in told:
            fn = getattr(handlers, name)
            try:
                trio.lowlevel.current_task()
            except RuntimeError:
                with contextlib.suppress(RuntimeError, trio.RunFinishedError):
                    trio.from_thread.run_sync(fn, *args)
            else:
                fn(*args)

    def _gone(self) -> bool:
        """Whether the table of this name is not the one made last (none, or another's). False when it
        cannot be looked at."""
        try:
            return self._current() != self.handle
        except NftError:
            return False

    def _current_or_none(self) -> int | None:
        try:
            return self._current()
        except NftError:
            return None

    def _current(self) -> int | None:
        """The handle of the table of this name now (None: there is none). Raises NftError."""
        if self._netlink is not None:
            try:
                return self._netlink.table_handle(self.table.name)
            except NetlinkError as exc:
                raise NftError(str(exc)) from exc
        try:
            answer = self.table.nft.run_json(f"list table {self.table.ref}")
        except NftError as exc:
            if "No such file" in str(exc):
                return None
            raise
        found = [o["table"] for o in answer.get("nftables", []) if isinstance(o, dict) and "table" in o]
        return int(found[0].get("handle", 0)) if found else 0
