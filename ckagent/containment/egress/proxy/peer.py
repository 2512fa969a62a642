"""Who is on the other end of a loopback connection: the Unix user that owns the client's socket.

A task's proxy port says which task a connection speaks for, but any local process can connect to
it (the port is in ``/proc/net/tcp``). Where each spider runs under a uid of its own, the kernel knows
the client socket's owner: the proxy serves a connection only when that owner is the task's uid.

:func:`peer_uid` asks the kernel for one socket by its exact addresses (``NETLINK_SOCK_DIAG``, an
``inet_diag`` lookup: no privilege needed, one round trip of ~20 µs), and falls back to reading
``/proc/net/tcp`` (``tcp6``) when netlink is refused (some sandboxes). Returns None when neither can
tell (the connection already closed, an unusual sandbox). Never raises.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
ALL_STATES = 0xFFFFFFFF

_HEADER = struct.Struct("=IHHII")          # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBxI")         # inet_diag_req_v2 without its socket id
_SOCKID = struct.Struct(">HH16s16s")      # sport, dport, src, dst (network order)
_TAIL = struct.Struct("=III")              # if, cookie[2]
_UID_AT = _HEADER.size + 4 + 48 + 12       # inet_diag_msg: 4 bytes, the id (48), expires/rqueue/wqueue


def peer_uid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid owning the client socket of the TCP connection ``client`` → ``server`` (each an
    ``(address, port)`` as ``getpeername``/``getsockname`` give them on the server's side), or None."""
    try:
        found = _by_netlink(client, server)
    except OSError:
        found = None
    if found is not None:
        return found
    return _by_proc(client, server)


def _packed(address: str) -> tuple[int, bytes]:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return (socket.AF_INET, ip.packed + bytes(12)) if ip.version == 4 else (socket.AF_INET6, ip.packed)


def _by_netlink(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    family, src = _packed(client[0])
    _, dst = _packed(server[0])
    body = (_REQUEST.pack(family, socket.IPPROTO_TCP, 0, ALL_STATES) + _SOCKID.pack(client[1], server[1], src, dst)
            + _TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    message = _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)
        sock.sendto(message, (0, 0))
        answer = sock.recv(8192)
    if len(answer) < _HEADER.size:
        return None
    _, kind, _, _, _ = _HEADER.unpack_from(answer)
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", answer, _HEADER.size)[0] if len(answer) >= _HEADER.size + 4 else 0
        if code in (errno.ENOENT, 0):
            return None
        raise OSError(code, os.strerror(code))
    if kind != SOCK_DIAG_BY_FAMILY or len(answer) < _UID_AT + 4:
        return None
    return int(struct.unpack_from("=I", answer, _UID_AT)[0])


def _by_proc(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The same from ``/proc/net/tcp`` (or ``tcp6``): the line whose local address is the client's
    and remote the server's; its ``uid`` column."""
    try:
        family, _ = _packed(client[0])
    except ValueError:
        return None
    want_local, want_remote = _proc_address(client), _proc_address(server)
    name = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    with contextlib.suppress(OSError, ValueError, IndexError), open(name, encoding="ascii", errors="replace") as fh:
        next(fh)
        for line in fh:
            fields = line.split()
            if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote:
                return int(fields[7])
    return None


def _proc_address(address: tuple[str, int]) -> str:
    """An address as /proc/net/tcp writes it: the 32-bit words of the address in host order, in hex."""
    packed = ipaddress.ip_address(address[0].split("%", 1)[0]).packed
    words = "".join(f"{int.from_bytes(packed[i:i + 4], 'little'):08X}" for i in range(0, len(packed), 4))
    return f"{words}:{address[1]:04X}"
