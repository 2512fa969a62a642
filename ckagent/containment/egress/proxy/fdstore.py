"""The proxy's listeners outlive the agent: a file-descriptor store held by the supervisor.

At the ``proxy`` egress level each task's listener lives in the agent. Were it to close with the agent
(a crash, kill -9, the OOM killer), every connect of the spider would be refused until the next agent
listens again. So the agent keeps a duplicate of each listener in a store held by the process that
outlives every agent — ``ckagent supervise`` (ckagent.pod.fdstore), in systemd's file-descriptor-store
model (sd_notify(3) ``FDSTORE=1`` / ``FDNAME=`` / ``FDSTOREREMOVE=1``; sd_listen_fds(3)):

- the supervisor starts each agent with an end of a socket pair (:data:`STORE_FD_ENV`: its number) and
  the listeners stored so far from fd 3 on (``LISTEN_FDS``, ``LISTEN_FDNAMES``; no ``LISTEN_PID``:
  the pid is not known before the exec, so it is accepted absent); without that pair, systemd's
  ``NOTIFY_SOCKET`` is the store (config/ckagent.service: ``NotifyAccess=main``,
  ``FileDescriptorStoreMax=``): systemd keeps the descriptors across a ``Restart=`` after a crash and
  hands them back the same way (with ``LISTEN_PID``);
- :meth:`FdStore.from_environ` takes the inherited listeners named ``ckproxy-<port>`` (each checked: a
  listening TCP socket of AF_INET bound to 127.0.0.1:<port>; anything else is closed and logged), makes
  every one of them and the pair's end non-inheritable, and removes the variables from the environment;
- the proxy (ckagent.containment.egress.proxy.server) opens a task's listener on the inherited socket of
  its port when there is one (a re-adopted task), stores each listener it opens (:meth:`FdStore.store`)
  and removes it when the task's listener closes (:meth:`FdStore.remove`); inherited listeners that no
  adopted task claimed are closed and removed after the adoption (:meth:`FdStore.release_unclaimed`).

While no agent runs, a stored listener stays open in the supervisor: the kernel completes the spider's
connects into its backlog (``listen(128)``) and the next agent accepts them. Connections the dead agent
had accepted are cut (the spider's retry handles those). Without a store (a plain ``ckagent run``, the
daemon of run.sh) :meth:`FdStore.from_environ` returns an inactive store and nothing changes.

Not thread-safe: call it from the Trio thread (the proxy server's). Sending never blocks (a full socket
buffer is logged, the listener then just is not stored).
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import re
import socket
from collections.abc import Iterable, MutableMapping

log = logging.getLogger("ckagent.containment.egress.proxy")

STORE_FD_ENV = "CKAGENT_FDSTORE_FD"
"""The agent's end of the store's socket pair (a ``SOCK_DGRAM`` AF_UNIX socket), given by the supervisor."""
LISTEN_FDS_START = 3
"""SD_LISTEN_FDS_START: the first inherited descriptor."""
MAX_FDS = 4096
"""Most descriptors a store holds (and an agent takes at its start); more are refused."""
PREFIX = "ckproxy-"
NAME = re.compile(r"ckproxy-([1-9][0-9]{0,4})\Z")
"""A stored listener's name: ``ckproxy-<port>`` (port 1..65535, no leading zero)."""
LISTEN_ENV = ("LISTEN_FDS", "LISTEN_FDNAMES", "LISTEN_PID")


def name_port(name: str) -> int | None:
    """The port of a listener's name ``ckproxy-<port>``, or None for any other name."""
    found = NAME.match(name)
    if found is None or int(found.group(1)) > 65535:
        return None
    return int(found.group(1))


def parse_listen_fds(env: MutableMapping[str, str] | dict[str, str], pid: int) -> list[tuple[int, str]]:
    """The inherited descriptors ``[(fd, name)]`` that ``env`` announces (sd_listen_fds_with_names(3)):
    ``LISTEN_FDS`` (1..:data:`MAX_FDS`, decimal) from fd 3 on; ``LISTEN_PID`` absent or ``pid``; names
    from ``LISTEN_FDNAMES`` (colon-separated; a count that differs → every name ``unknown``). [] when
    nothing valid is announced. Never raises; does not touch the descriptors nor ``env``."""
    text = env.get("LISTEN_FDS", "")
    if not (text.isascii() and text.isdigit()) or len(text) > 5:
        return []
    count = int(text)
    if not 0 < count <= MAX_FDS:
        return []
    owner = env.get("LISTEN_PID")
    if owner is not None and owner != str(pid):
        return []
    names = env.get("LISTEN_FDNAMES", "").split(":")
    if len(names) != count:
        names = ["unknown"] * count
    return [(LISTEN_FDS_START + i, name) for i, name in enumerate(names)]


def check_listener(fd: int, port: int) -> socket.socket:
    """``fd`` as a socket object when it is a listening TCP socket of AF_INET bound to 127.0.0.1:``port``
    (non-inheritable from now on). Raises ValueError (saying what it is instead) or OSError; the caller
    closes ``fd`` then."""
    sock = socket.socket(fileno=fd)  # (ENOTSOCK for anything but a socket)
    try:
        if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM:
            raise ValueError(f"a socket of family {sock.family.name}, type {sock.type.name}")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ValueError("a TCP socket that does not listen")
        bound = sock.getsockname()
        if bound != ("127.0.0.1", port):
            raise ValueError(f"a listener on {bound[0]}:{bound[1]}, not 127.0.0.1:{port}")
        sock.set_inheritable(False)
    except BaseException:
        sock.detach()
        raise
    return sock


class FdStore:
    """The agent's side of the store (module docstring): ``channel`` the pair's end (None: no store),
    ``listeners`` the inherited listeners not taken yet, by port."""

    def __init__(self, channel: socket.socket | None = None, listeners: dict[int, socket.socket] | None = None) -> None:
        self.channel = channel
        self.listeners = listeners or {}
        self.stored: set[int] = set()
        """Ports whose listener this agent stored (or inherited) and has not removed."""

    @property
    def active(self) -> bool:
        """True when the agent runs under a store."""
        return self.channel is not None

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> FdStore:
        """The store this agent was started with (module docstring), taking ``environ``'s (default
        ``os.environ``) :data:`STORE_FD_ENV` and ``LISTEN_*`` out of it. Inherited descriptors that
        are not a valid ``ckproxy-<port>`` listener are closed and logged. Never raises."""
        env = os.environ if environ is None else environ
        channel = _channel(env.pop(STORE_FD_ENV, "")) or _notify_channel(env.get("NOTIFY_SOCKET", ""))
        if channel is None:  # (not under a store: whatever else was inherited is not ours to judge)
            return cls()
        announced = parse_listen_fds(env, os.getpid())
        for key in LISTEN_ENV:
            env.pop(key, None)
        listeners: dict[int, socket.socket] = {}
        for fd, name in announced:
            port = name_port(name)
            try:
                if port is None:
                    raise ValueError(f"an unknown name {name[:64]!r}")
                if port in listeners:
                    raise ValueError(f"a second listener for port {port}")
                listeners[port] = check_listener(fd, port)
            except (OSError, ValueError) as exc:
                log.warning("egress proxy: inherited fd %d (%r) closed: %s", fd, name[:64], exc)
                with contextlib.suppress(OSError):
                    os.close(fd)
        store = cls(channel, listeners)
        store.stored.update(listeners)
        if listeners:
            log.info("egress proxy: %d listener(s) inherited from the store (ports %s)", len(listeners),
                     ", ".join(map(str, sorted(listeners))))
        return store

    def take(self, port: int) -> socket.socket | None:
        """The inherited listener of ``port`` (now the caller's), or None."""
        return self.listeners.pop(port, None) if port else None

    def store(self, port: int, sock: socket.socket) -> None:
        """Keep (a duplicate of) ``sock``, the listener of ``port``, in the store (``FDSTORE=1``).
        A no-op without a store. Never raises (a failure is logged)."""
        if self._send(f"FDSTORE=1\nFDNAME={PREFIX}{port}\n", sock.fileno()):
            self.stored.add(port)

    def remove(self, port: int) -> None:
        """Drop the listener of ``port`` from the store (``FDSTOREREMOVE=1``). Never raises."""
        if port in self.stored and self._send(f"FDSTOREREMOVE=1\nFDNAME={PREFIX}{port}\n", None):
            self.stored.discard(port)

    def release_unclaimed(self, keep: Iterable[int] = ()) -> list[int]:
        """Close and remove the inherited listeners not taken, but those of ``keep`` (ports adopted tasks
        will open again); returns the ports released. Never raises."""
        kept = set(keep)
        released = self.release([port for port in self.listeners if port not in kept])
        if released:
            log.info("egress proxy: inherited listener(s) of no running task closed (ports %s)",
                     ", ".join(map(str, released)))
        return released

    def release(self, ports: Iterable[int]) -> list[int]:
        """Close the inherited listeners of ``ports`` not taken (they stop listening in every copy: no
        connect waits on them) and remove them from the store; returns the ports closed. Never raises."""
        released = sorted(port for port in set(ports) if port in self.listeners)
        for port in released:
            sock = self.listeners.pop(port)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            self.remove(port)
        return released

    def close(self) -> None:
        """Close the inherited listeners not taken (they stay in the store) and the channel."""
        for sock in self.listeners.values():
            sock.close()
        self.listeners.clear()
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _send(self, text: str, fd: int | None) -> bool:
        if self.channel is None:
            return False
        rights = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        try:
            self.channel.sendmsg([text.encode()], rights, socket.MSG_DONTWAIT)
        except OSError as exc:
            log.warning("egress proxy: the descriptor store did not take %r: %s", text.replace("\n", " ").strip(), exc)
            return False
        return True


def _notify_channel(address: str) -> socket.socket | None:
    """systemd's notification socket (``NOTIFY_SOCKET``: a path, or ``@name`` in the abstract namespace)
    as a connected datagram socket (non-inheritable), or None: not set, another kind of address, or it
    cannot be reached (logged). The unit must say ``NotifyAccess=main`` and ``FileDescriptorStoreMax=``
    (config/ckagent.service), else systemd ignores the messages and nothing is kept."""
    if not address.startswith(("/", "@")) or len(address) > 107:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.connect("\0" + address[1:] if address.startswith("@") else address)
    except OSError as exc:
        sock.close()
        log.warning("egress proxy: NOTIFY_SOCKET %r cannot be reached (%s): no descriptor store", address, exc)
        return None
    return sock


def _channel(text: str) -> socket.socket | None:
    """The store's socket of the descriptor number ``text`` (non-inheritable), or None (logged when set
    but not an AF_UNIX datagram socket)."""
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 7:
        log.warning("egress proxy: %s=%r is no descriptor: no store", STORE_FD_ENV, text[:32])
        return None
    fd = int(text)
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        log.warning("egress proxy: %s=%d: %s: no store", STORE_FD_ENV, fd, exc)
        return None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_DGRAM:
        sock.detach()
        log.warning("egress proxy: %s=%d is not the store's socket: no store", STORE_FD_ENV, fd)
        return None
    sock.set_inheritable(False)
    return sock
