"""The per-task changes of the egress table, straight over nfnetlink: one message and its ack each.

libnftables (and the ``nft`` program) refresh their view of the whole ruleset before every change:
a dump of every table's chains and sets and one request per table for its objects. That costs
~0.35 ms per table on the host (another agent's, firewalld's, a container runtime's, a kube-proxy's
thousands of chains), on every task start and end. The three things a task needs — its element in
the ``tasks`` map, a read of the refused-destination sets, the deletion of its elements — are
set-element messages of the kernel's stable netfilter ABI (``linux/netfilter/nf_tables.h``), so
:class:`SetElements` sends them itself, in a batch, and waits for the kernel's ack. Chains, rules
and sets are still written by nft (:mod:`.table`): rare, and nft's language is the readable record.

Keys are the bytes the kernel stores: a ``cgroupsv2`` key is the cgroup's id (the inode number of
its directory in the v2 tree, host byte order, 8 bytes); a concatenation pads each field to 4 bytes
(``cgroup . ip daddr . th dport`` = 8 + 4 + 2 (+2) bytes). Exceptions::

    OSError
    └── NetlinkError    the kernel refused a message (``errno`` set: ENOENT no such element/set/chain,
                        EPERM no CAP_NET_ADMIN), or answered something this module cannot read

Blocking (a netlink round trip, ~20-60 µs): call from a worker thread; thread-safe (one lock).
"""

from __future__ import annotations

import errno as errno_
import itertools
import os
import socket
import struct
import threading
from collections.abc import Iterator

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END = 16, 17
NFT_MSG_NEWTABLE, NFT_MSG_GETTABLE, NFT_MSG_DELTABLE = 0, 1, 2
NFT_MSG_NEWSETELEM, NFT_MSG_GETSETELEM, NFT_MSG_DELSETELEM = 12, 13, 14
NFT_MSG_DESTROYTABLE = 26
NFNLGRP_NFTABLES = 7
"""The multicast group of nf_tables' change events (what ``nft monitor`` reads)."""
SOL_NETLINK, NETLINK_ADD_MEMBERSHIP = 270, 1
SO_RCVBUFFORCE = 33  # (Linux; not in Python's socket module)
EVENTS_RECEIVE_BYTES = 4 << 20
"""The receive buffer asked for the events socket (a flush of a large ruleset is a burst of events)."""
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK, NLM_F_DUMP, NLM_F_CREATE = 0x1, 0x2, 0x4, 0x300, 0x400
NLA_F_NESTED = 0x8000
NFPROTO_INET = 1
NFTA_TABLE_NAME, NFTA_TABLE_HANDLE, NFTA_TABLE_USERDATA = 1, 4, 6
NFTNL_UDATA_TABLE_COMMENT = 0
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_EXPR, NFTA_SET_ELEM_EXPRESSIONS = 1, 2, 7, 10
NFTA_DATA_VALUE, NFTA_DATA_VERDICT = 1, 2
NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN = 1, 2
NFT_JUMP = -3
NFTA_EXPR_NAME, NFTA_EXPR_DATA = 1, 2
NFTA_COUNTER_PACKETS = 2
RECEIVE_BYTES = 1 << 17
REPLY_TIMEOUT = 5.0
"""Seconds the kernel may take to answer (it answers in microseconds; past this: NetlinkError)."""

_HEADER = struct.Struct("=IHHII")
_ATTR = struct.Struct("=HH")


class NetlinkError(OSError):
    """The kernel refused a set-element message, or its answer could not be read (see the module docstring)."""


def cgroup_key(path: str | os.PathLike[str]) -> bytes:
    """The ``cgroupsv2`` key of the cgroup directory ``path``. Raises OSError when it does not exist."""
    return struct.pack("=Q", os.stat(path).st_ino)


def _attr(kind: int, payload: bytes) -> bytes:
    data = _ATTR.pack(_ATTR.size + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _nest(kind: int, *parts: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(parts))


def _name(text: str) -> bytes:
    return text.encode() + b"\0"


def _attrs(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type without flags, payload) of each attribute in ``data``."""
    offset = 0
    while offset + _ATTR.size <= len(data):
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size:
            raise NetlinkError(errno_.EPROTO, "netlink: an attribute of impossible length")
        yield kind & 0x3FFF, data[offset + _ATTR.size:offset + length]
        offset += (length + 3) & ~3


class Netlink:
    """Set elements of one ``inet`` table, and the host's ``inet`` tables (see the module
    docstring). Raises NetlinkError (an OSError) when the socket cannot be opened."""

    def __init__(self, table: str = "") -> None:
        self.table = table
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
            self._sock.bind((0, 0))
            self._sock.settimeout(REPLY_TIMEOUT)
        except OSError as exc:
            raise NetlinkError(exc.errno or errno_.EPROTO, f"netlink: cannot open a netfilter socket: {exc}") from exc
        self._seq = itertools.count(int.from_bytes(os.urandom(2), "big") << 8)
        self._lock = threading.Lock()

    def _message(self, kind: int, flags: int, payload: bytes, family: int = NFPROTO_INET,
                 res_id: int = 0) -> tuple[int, bytes]:
        seq = next(self._seq) & 0xFFFFFFFF
        body = struct.pack("=BB", family, 0) + struct.pack(">H", res_id) + payload
        return seq, _HEADER.pack(_HEADER.size + len(body), kind, flags, seq, 0) + body

    def _elements(self, set_name: str, elements: list[bytes]) -> bytes:
        return (_attr(NFTA_SET_ELEM_LIST_TABLE, _name(self.table)) + _attr(NFTA_SET_ELEM_LIST_SET, _name(set_name))
                + _nest(NFTA_SET_ELEM_LIST_ELEMENTS, *(_nest(NFTA_LIST_ELEM, e) for e in elements)))

    def add_jump(self, set_name: str, key: bytes, chain: str) -> None:
        """Add ``key : jump chain`` to the verdict map ``set_name`` (an existing element is kept)."""
        verdict = _nest(NFTA_DATA_VERDICT, _attr(NFTA_VERDICT_CODE, struct.pack(">i", NFT_JUMP)),
                        _attr(NFTA_VERDICT_CHAIN, _name(chain)))
        element = _nest(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, key)) + _nest(NFTA_SET_ELEM_DATA, verdict)
        self._batch([(NFT_MSG_NEWSETELEM, NLM_F_CREATE, self._elements(set_name, [element]))])

    def update(self, set_name: str, add: list[bytes], delete: list[bytes]) -> None:
        """Add the keys ``add`` to the plain set ``set_name`` and delete ``delete`` from it, in one
        atomic batch. Raises NetlinkError (errno ENOENT when a key to delete is not there: then
        nothing changed)."""
        messages = []
        if delete:
            messages.append((NFT_MSG_DELSETELEM, 0, self._elements(
                set_name, [_nest(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, k)) for k in delete])))
        if add:
            messages.append((NFT_MSG_NEWSETELEM, NLM_F_CREATE, self._elements(
                set_name, [_nest(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, k)) for k in add])))
        if messages:
            self._batch(messages)

    def delete(self, keys: dict[str, list[bytes]]) -> None:
        """Delete ``{set name: [key, ...]}`` in one atomic batch. Raises NetlinkError (errno ENOENT
        when one of them is not there: then nothing was deleted)."""
        messages = [(NFT_MSG_DELSETELEM, 0, self._elements(name, [_nest(NFTA_SET_ELEM_KEY, _attr(NFTA_DATA_VALUE, k))
                                                                   for k in found]))
                    for name, found in keys.items() if found]
        if messages:
            self._batch(messages)

    def dump(self, set_name: str) -> list[tuple[bytes, int]]:
        """Every element of ``set_name``: (key bytes, packets of its counter; 0 without one)."""
        payload = _attr(NFTA_SET_ELEM_LIST_TABLE, _name(self.table)) + _attr(NFTA_SET_ELEM_LIST_SET, _name(set_name))
        found: list[tuple[bytes, int]] = []
        for body in self._dump(NFT_MSG_GETSETELEM, NFT_MSG_NEWSETELEM, payload):
            found.extend(_parse_elements(body))
        return found

    def tables(self) -> list[tuple[str, str]]:
        """The host's ``inet`` tables: (name, comment; '' without one)."""
        found = []
        for body in self._dump(NFT_MSG_GETTABLE, NFT_MSG_NEWTABLE, b""):
            parts = dict(_attrs(body))
            found.append((parts.get(NFTA_TABLE_NAME, b"").rstrip(b"\0").decode(errors="replace"),
                          _comment(parts.get(NFTA_TABLE_USERDATA, b""))))
        return found

    def table_handle(self, name: str) -> int | None:
        """The handle of the ``inet`` table ``name`` (the kernel numbers each table it makes: one made
        again has another), None when there is no such table. Raises NetlinkError."""
        with self._lock:
            seq, message = self._message((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE, NLM_F_REQUEST,
                                         _attr(NFTA_TABLE_NAME, _name(name)))
            self._send(message)
            try:
                for kind, body in self._replies(seq, until_done=False):
                    if kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE:
                        return _handle(body[4:])
            except NetlinkError as exc:
                if exc.errno == errno_.ENOENT:
                    return None
                raise
        raise NetlinkError(errno_.EPROTO, "netlink: no answer for the table")  # pragma: no cover

    def delete_table(self, name: str) -> None:
        """Delete the ``inet`` table ``name`` with everything in it. Raises NetlinkError (ENOENT: none)."""
        self._batch([(NFT_MSG_DELTABLE, 0, _attr(NFTA_TABLE_NAME, _name(name)))])

    def _dump(self, request: int, answer: int, payload: bytes) -> list[bytes]:
        """The bodies (after the nfgenmsg) of a dump's ``answer`` messages."""
        bodies = []
        with self._lock:
            seq, message = self._message((NFNL_SUBSYS_NFTABLES << 8) | request, NLM_F_REQUEST | NLM_F_DUMP, payload)
            self._send(message)
            for kind, body in self._replies(seq, until_done=True):
                if kind == (NFNL_SUBSYS_NFTABLES << 8) | answer:
                    bodies.append(body[4:])
        return bodies

    def _send(self, data: bytes) -> None:
        try:
            self._sock.send(data)
        except OSError as exc:
            raise NetlinkError(exc.errno or errno_.EPROTO, f"netlink: cannot send: {exc}") from exc

    def _batch(self, messages: list[tuple[int, int, bytes]]) -> None:
        with self._lock:
            _, begin = self._message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, b"", socket.AF_UNSPEC, NFNL_SUBSYS_NFTABLES)
            sent = [self._message((NFNL_SUBSYS_NFTABLES << 8) | kind, NLM_F_REQUEST | NLM_F_ACK | flags, payload)
                    for kind, flags, payload in messages]
            _, end = self._message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, b"", socket.AF_UNSPEC, NFNL_SUBSYS_NFTABLES)
            self._send(begin + b"".join(m for _, m in sent) + end)
            waiting = {seq for seq, _ in sent}
            for _ in self._replies(None, until_done=False, acks=waiting):
                pass

    def _replies(self, seq: int | None, *, until_done: bool,
                 acks: set[int] | None = None) -> Iterator[tuple[int, bytes]]:
        """Messages answering ``seq`` (a dump, to NLMSG_DONE) or the acks of ``acks``; raises
        NetlinkError for an error answer."""
        failure: NetlinkError | None = None
        while True:
            try:
                data = self._sock.recv(RECEIVE_BYTES)
            except OSError as exc:  # (a timeout included)
                raise NetlinkError(exc.errno or errno_.ETIMEDOUT, f"netlink: no answer from the kernel: {exc}") from exc
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _flags, got, _pid = _HEADER.unpack_from(data, offset)
                if length < _HEADER.size:
                    raise NetlinkError(errno_.EPROTO, "netlink: a message of impossible length")
                body = data[offset + _HEADER.size:offset + length]
                offset += (length + 3) & ~3
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", body)[0]
                    if acks is not None:
                        acks.discard(got)
                    if code and failure is None:
                        failure = NetlinkError(code, f"netlink: the kernel refused the change of table {self.table}: "
                                                     f"{os.strerror(code)}")
                    if seq is not None and got == seq:
                        raise failure or NetlinkError(errno_.EPROTO, "netlink: an ack ended a dump")
                elif kind == NLMSG_DONE and until_done and got == seq:
                    return
                elif seq is not None and got == seq:
                    yield kind, body
            if acks is not None and not acks:
                if failure is not None:
                    raise failure
                return

    def close(self) -> None:
        """Close the socket (idempotent)."""
        self._sock.close()


class TableEvents:
    """The deletions of ``inet`` tables on this host as the kernel announces them (the nf_tables
    multicast group, as ``nft monitor`` reads it). Non-blocking: wait until :attr:`sock` is readable,
    then :meth:`deleted`. Raises NetlinkError when the socket cannot be opened or subscribed."""

    def __init__(self) -> None:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK,
                             NETLINK_NETFILTER)
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, EVENTS_RECEIVE_BYTES)
            except OSError:  # (no CAP_NET_ADMIN for a forced size: the system's default)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, EVENTS_RECEIVE_BYTES)
            sock.bind((0, 0))
            sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
        except OSError as exc:
            sock.close()
            raise NetlinkError(exc.errno or errno_.EPROTO, f"netlink: cannot follow nftables' events: {exc}") from exc
        self.sock = sock

    def deleted(self, name: str) -> list[int | None]:
        """The handles of the ``inet`` tables ``name`` deleted since the last call (None: a deletion that
        did not say its handle); [] when nothing arrived. Never blocks. Raises NetlinkError (ENOBUFS: the
        kernel dropped events, the buffer was full: what was missed is unknown)."""
        found: list[int | None] = []
        wanted = (NFT_MSG_DELTABLE, NFT_MSG_DESTROYTABLE)
        while True:
            try:
                data = self.sock.recv(RECEIVE_BYTES)
            except BlockingIOError:
                return found
            except OSError as exc:
                raise NetlinkError(exc.errno or errno_.EPROTO, f"netlink: nftables' events were lost: {exc}") from exc
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data, offset)
                if length < _HEADER.size:
                    break
                body = data[offset + _HEADER.size:offset + length]
                offset += (length + 3) & ~3
                if kind >> 8 == NFNL_SUBSYS_NFTABLES and kind & 0xFF in wanted and body[:1] == bytes([NFPROTO_INET]):
                    parts = dict(_attrs(body[4:]))
                    if parts.get(NFTA_TABLE_NAME, b"").rstrip(b"\0") == name.encode():
                        found.append(_handle(body[4:]))

    def close(self) -> None:
        """Close the socket (idempotent)."""
        self.sock.close()


def _handle(body: bytes) -> int | None:
    """The NFTA_TABLE_HANDLE of a table message's attributes (None without one)."""
    value = dict(_attrs(body)).get(NFTA_TABLE_HANDLE, b"")
    return int(struct.unpack(">Q", value)[0]) if len(value) == 8 else None


def _comment(udata: bytes) -> str:
    """The comment in a table's user data (libnftnl's TLVs: type byte, length byte, value)."""
    offset = 0
    while offset + 2 <= len(udata):
        kind, length = udata[offset], udata[offset + 1]
        if kind == NFTNL_UDATA_TABLE_COMMENT:
            return udata[offset + 2:offset + 2 + length].rstrip(b"\0").decode(errors="replace")
        offset += 2 + length
    return ""


def _parse_elements(data: bytes) -> Iterator[tuple[bytes, int]]:
    for kind, payload in _attrs(data):
        if kind != NFTA_SET_ELEM_LIST_ELEMENTS:
            continue
        for elem_kind, elem in _attrs(payload):
            if elem_kind != NFTA_LIST_ELEM:
                continue
            key, packets = b"", 0
            for field, value in _attrs(elem):
                if field == NFTA_SET_ELEM_KEY:
                    key = next((v for k, v in _attrs(value) if k == NFTA_DATA_VALUE), b"")
                elif field == NFTA_SET_ELEM_EXPR:
                    packets += _counter_packets(value)
                elif field == NFTA_SET_ELEM_EXPRESSIONS:
                    packets += sum(_counter_packets(v) for k, v in _attrs(value) if k == NFTA_LIST_ELEM)
            yield key, packets


def _counter_packets(expr: bytes) -> int:
    parts = dict(_attrs(expr))
    if parts.get(NFTA_EXPR_NAME, b"").rstrip(b"\0") != b"counter":
        return 0
    for kind, value in _attrs(parts.get(NFTA_EXPR_DATA, b"")):
        if kind == NFTA_COUNTER_PACKETS and len(value) == 8:
            return int(struct.unpack(">Q", value)[0])
    return 0
