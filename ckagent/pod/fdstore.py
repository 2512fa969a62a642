"""The supervisor's file-descriptor store: the agent's proxy listeners outlive the agent.

systemd's model (sd_notify(3) ``FDSTORE=1`` / ``FDNAME=`` / ``FDSTOREREMOVE=1``, sd_listen_fds(3)), with
the supervisor as the service manager: each agent it starts gets the end of a fresh ``SOCK_DGRAM``
socket pair (env ``CKAGENT_FDSTORE_FD``) and the listeners stored so far from fd 3 on (``LISTEN_FDS``,
``LISTEN_FDNAMES``; no ``LISTEN_PID``: the pid is not known before the exec). The agent stores each
task's proxy listener (ckagent.containment.egress.proxy.fdstore) and removes it when the task's
listener closes. While no agent runs a stored listener stays open here: the kernel completes the
spider's connects into its backlog, and the next agent accepts them instead of the spider being refused.

What is accepted, and nothing else (every refusal closes the descriptors that came with it, is counted
in :attr:`DescriptorStore.refused` and logged — the first :data:`LOGGED` per agent, then a count):

- a datagram of at most :data:`MAX_MESSAGE` bytes from the current agent's pair (only the agent holds
  the other end: a socket pair has no address a spider could reach);
- ``FDSTORE=1`` + ``FDNAME=ckproxy-<port>`` with exactly one descriptor, a listening TCP socket of AF_INET
  bound to 127.0.0.1:<port>; a name already stored is replaced (the old descriptor closed); at most
  :data:`MAX_FDS` names;
- ``FDSTOREREMOVE=1`` + ``FDNAME=ckproxy-<port>`` with no descriptor: closed and forgotten.

Every descriptor held is close-on-exec (received with ``MSG_CMSG_CLOEXEC``): only :func:`spawn` hands
them on, to the agent alone. The store closes them when the supervisor ends (:meth:`close`).
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import re
import selectors
import signal
import socket
from collections.abc import Mapping, Sequence

from ckagent.pod.loop import Loop

log = logging.getLogger("ckagent.pod")

STORE_FD_ENV = "CKAGENT_FDSTORE_FD"
"""The agent's end of the pair (ckagent.containment.egress.proxy.fdstore.STORE_FD_ENV)."""
STORE_ENV = (STORE_FD_ENV, "LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID")
"""Variables only the store sets for the agent (any the supervisor inherited are not passed on)."""
MAX_FDS = 4096
"""Most names the store holds."""
MAX_MESSAGE = 256
"""Bytes of one message (``FDSTORE=1\\nFDNAME=ckproxy-65535\\n`` is 33)."""
MAX_FDS_PER_MESSAGE = 16
"""Descriptors one message may carry before the kernel truncates it (more: refused, all closed)."""
LOGGED = 10
"""Refusals logged one by one per agent; the rest are counted."""
_NAME = re.compile(r"ckproxy-([1-9][0-9]{0,4})\Z")
_MESSAGE = re.compile(r"(FDSTORE|FDSTOREREMOVE)=1\nFDNAME=([^\n]*)\n?\Z")


class DescriptorStore:
    """The store (module docstring), on the supervisor's :class:`Loop`."""

    def __init__(self, loop: Loop, *, max_fds: int = MAX_FDS) -> None:
        self.loop = loop
        self.max_fds = max_fds
        self.fds: dict[str, int] = {}
        """Name → descriptor, in the order stored."""
        self.refused = 0
        """Messages refused since the start."""
        self._ours: socket.socket | None = None
        self._theirs: socket.socket | None = None
        self._logged = 0

    def for_agent(self) -> tuple[dict[str, str], list[int]]:
        """Before an agent's start: a fresh pair; returns the agent's environment additions and the
        descriptors it gets in order from fd 3 (the stored listeners, then the pair's end: its number
        in the variables is ``3 + len(stored)``)."""
        self.agent_ended()
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._ours.setblocking(False)
        self.loop.add(self._ours, selectors.EVENT_READ, self._readable)
        self._logged = 0
        names, fds = list(self.fds), list(self.fds.values())
        env = {STORE_FD_ENV: str(3 + len(fds))}
        if fds:
            env.update(LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=":".join(names))
        return env, [*fds, self._theirs.fileno()]

    def spawned(self) -> None:
        """After the agent's start (or a failed one): the pair's other end is the agent's alone."""
        if self._theirs is not None:
            self._theirs.close()
            self._theirs = None

    def agent_ended(self) -> None:
        """The agent is gone: take what it sent before its end, then close its pair."""
        self.spawned()
        if self._ours is not None:
            self._readable(selectors.EVENT_READ)
            self.loop.remove(self._ours)
            self._ours.close()
            self._ours = None

    def close(self) -> None:
        """Close every descriptor held (the supervisor's end)."""
        self.agent_ended()
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()

    def _readable(self, _mask: int) -> None:
        sock = self._ours
        if sock is None:
            return
        for _ in range(4 * MAX_FDS):  # (bounded: a flood waits for the next turn of the loop)
            try:
                data, ancillary, flags, _addr = sock.recvmsg(
                    MAX_MESSAGE + 1, socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * 4), socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("fd store: cannot read the agent's messages: %s", exc)
                return
            fds = _descriptors(ancillary)
            try:
                why = self._take(data, fds, flags)
            except Exception as exc:  # (a bug here must not end PID 1: the message is refused)
                why = f"{type(exc).__name__}: {exc}"
            if why:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                self._refuse(why)

    def _take(self, data: bytes, fds: list[int], flags: int) -> str:
        """Apply one message; '' when done (its descriptor kept), else why it is refused."""
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE:
            return "a message too long or with too many descriptors"
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            return "a message that is not ASCII text"
        found = _MESSAGE.match(text)
        if found is None:
            return f"an unknown message {text[:64]!r}"
        action, name = found.groups()
        port_text = _NAME.match(name)
        port = int(port_text.group(1)) if port_text else 0
        if not 0 < port <= 65535:
            return f"a bad name {name[:64]!r}"
        if action == "FDSTOREREMOVE":
            if fds:
                return "a removal carrying descriptors"
            old = self.fds.pop(name, None)
            if old is not None:
                os.close(old)
            return ""
        if len(fds) != 1:
            return f"{name}: {len(fds)} descriptors, not one"
        if name not in self.fds and len(self.fds) >= self.max_fds:
            return f"{name}: the store is full ({self.max_fds} descriptors)"
        why = _not_a_listener(fds[0], port)
        if why:
            return f"{name}: {why}"
        old = self.fds.pop(name, None)
        self.fds[name] = fds[0]
        if old is not None and old != fds[0]:
            os.close(old)
        return ""

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self._logged += 1
        if self._logged <= LOGGED:
            log.warning("fd store: refused %s (the descriptors that came with it are closed)", why)
        elif self._logged == LOGGED + 1:
            log.warning("fd store: more messages refused; not logged one by one any more")


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += array.array("i", data[:usable]).tolist()
    return fds


def _not_a_listener(fd: int, port: int) -> str:
    """'' when ``fd`` is a listening TCP socket of AF_INET bound to 127.0.0.1:``port``, else what it is."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        return f"not a socket ({exc.strerror or exc})"
    try:
        if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM:
            return f"a socket of family {sock.family.name}, type {sock.type.name}"
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return "a TCP socket that does not listen"
        bound = sock.getsockname()
        if bound != ("127.0.0.1", port):
            return f"a listener on {bound[0]}:{bound[1]}"
        return ""
    except OSError as exc:
        return f"an unusable socket ({exc.strerror or exc})"
    finally:
        sock.detach()


class Spawned:
    """A started process: ``pid``; ``returncode`` set by whoever reaps it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


def spawn(argv: Sequence[str], env: Mapping[str, str], fds: Sequence[int] = (), pass_fds: Sequence[int] = (),
          fd_vars: Mapping[str, int] | None = None) -> Spawned:
    """Start ``argv`` (``PATH`` searched) in a session of its own with ``env``, SIGPIPE and SIGXFSZ at
    their defaults, and no descriptor but 0–2 and: ``fds`` at 3, 4, … in order; then each of
    ``fd_vars`` (variable → descriptor) at the next free number, the variable set to it; ``pass_fds`` at
    their own numbers (not in the range of the others). Raises OSError (the exec failed) or ValueError."""
    fd_vars = dict(fd_vars or {})
    env = dict(env)
    plan = [(fd, 3 + i) for i, fd in enumerate(fds)]
    taken = {dst for _src, dst in plan} | set(pass_fds)
    if set(pass_fds) & set(range(3, 3 + len(fds))):
        raise ValueError("spawn: a descriptor to pass at its number is in the range of those from fd 3")
    at = 3 + len(fds)
    for name, fd in fd_vars.items():
        while at in taken:
            at += 1
        plan.append((fd, at))
        taken.add(at)
        env[name] = str(at)
    plan += [(fd, fd) for fd in pass_fds]
    # dup2 only, through temporary numbers above every one involved (a target may be another's source);
    # dup2 onto a different number also clears close-on-exec, so the targets reach the program.
    base = max([2, *(src for src, _ in plan), *(dst for _, dst in plan)]) + 1
    actions: list[tuple[int, ...]] = [(os.POSIX_SPAWN_DUP2, src, base + i) for i, (src, _dst) in enumerate(plan)]
    actions += [(os.POSIX_SPAWN_DUP2, base + i, dst) for i, (_src, dst) in enumerate(plan)]
    actions += [(os.POSIX_SPAWN_CLOSE, base + i) for i in range(len(plan))]
    actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable() if fd not in taken]  # (as close_fds)
    pid = os.posix_spawnp(argv[0], list(argv), env, file_actions=actions, setsid=True,
                          setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    return Spawned(pid)


def _inheritable() -> list[int]:
    """This process's descriptors above 2 that an exec would hand on (none, usually: Python's are
    close-on-exec)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc/self/fd"):
            fd = int(entry)
            if fd > 2:
                with contextlib.suppress(OSError):
                    if os.get_inheritable(fd):
                        found.append(fd)
    return found
