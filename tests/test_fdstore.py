"""The proxy's listeners outlive the agent: the supervisor's descriptor store (ckagent.pod.fdstore) and
the agent's side of it (ckagent.containment.egress.proxy.fdstore).

- ``LISTEN_FDS`` / ``LISTEN_FDNAMES`` / ``LISTEN_PID`` parsing (hypothesis on the variables' text);
- a round trip between real processes: the supervisor's store starts a real child with its listeners
  from fd 3 and its socket pair; the child takes the valid listener, closes everything else it was
  given (a pipe, a UDP socket, a listener on another port, one that does not listen, an AF_UNIX
  socket, a bad name), leaves nothing inheritable, and stores and removes listeners the store keeps;
- hostile messages to the store (garbage, too long, too many descriptors, bad names, a pipe, a socket
  of the wrong family or type, a store full, an agent that is gone): refused, their descriptors closed,
  the store goes on;
- the end to end claim: a task at the ``proxy`` egress level, its spider requesting through its proxy
  all the time (a keep-alive client and a new-connection client), kill -9 of the agent under ``ckagent
  supervise`` (and SIGUSR2 to PID 1, a restart in place): not one connect refused (those made while no agent ran wait in the listener's backlog and
  are served by the next agent), the task completes once with every page, the same proxy port, and the
  spider saw neither the store's socket nor a stored listener.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    PROXY_CLIENTS,
    SupervisedNode,
    eventually,
    no_strays,
    serve_site,
    submit,
    summary_of,
    wait_for_log,
)
from hypothesis import given
from hypothesis import strategies as st

from ckagent.containment.egress.proxy.fdstore import MAX_FDS, FdStore, name_port, parse_listen_fds
from ckagent.pod.fdstore import DescriptorStore, spawn
from ckagent.pod.loop import Loop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCM_RIGHTS and /proc are Linux's")

_numbers = st.one_of(st.integers(-5, MAX_FDS + 5).map(str), st.text(max_size=8),
                     st.sampled_from(["", "1", "01", " 2", "2 ", "+3", "٣", "4096", "4097", "1e3"]))


@given(fds=st.one_of(st.none(), _numbers), names=st.one_of(st.none(), st.text(max_size=40)),
       pid=st.one_of(st.none(), _numbers))
def test_listen_fds_parsing_takes_only_what_sd_listen_fds_would(fds: str | None, names: str | None,
                                                                pid: str | None) -> None:
    env = {k: v for k, v in (("LISTEN_FDS", fds), ("LISTEN_FDNAMES", names), ("LISTEN_PID", pid)) if v is not None}
    got = parse_listen_fds(dict(env), 4242)
    if not got:
        return
    assert fds is not None and fds.isascii() and fds.isdigit() and int(fds) == len(got) <= MAX_FDS
    assert pid is None or pid == "4242"
    assert [fd for fd, _ in got] == list(range(3, 3 + len(got)))
    split = (names or "").split(":")
    assert [name for _, name in got] == (split if len(split) == len(got) else ["unknown"] * len(got))


def test_listen_fds_examples() -> None:
    assert parse_listen_fds({"LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b"}, 7) == [(3, "a"), (4, "b")]
    assert parse_listen_fds({"LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b", "LISTEN_PID": "7"}, 7) == [(3, "a"), (4, "b")]
    assert parse_listen_fds({"LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b", "LISTEN_PID": "8"}, 7) == []
    assert parse_listen_fds({"LISTEN_FDS": "2", "LISTEN_FDNAMES": "a"}, 7) == [(3, "unknown"), (4, "unknown")]
    assert parse_listen_fds({"LISTEN_FDS": "0"}, 7) == parse_listen_fds({"LISTEN_FDS": "-1"}, 7) == []
    assert parse_listen_fds({"LISTEN_FDS": str(MAX_FDS + 1)}, 7) == []
    assert [name_port(n) for n in ("ckproxy-8080", "ckproxy-65535", "ckproxy-65536", "ckproxy-0",
                                   "ckproxy-080", "ckproxy-1\n", "xckproxy-1", "ckproxy-")] == \
        [8080, 65535, None, None, None, None, None, None]


def _listener(port: int = 0, host: str = "127.0.0.1", family: int = socket.AF_INET) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, port))
    sock.listen(8)
    return sock


def _run_loop(loop: Loop) -> None:
    for _ in range(5):
        loop.run_once(0.05)


def _open_fds() -> set[int]:
    """This process's descriptors (not the one listdir used, closed by the time it is checked)."""
    found = set()
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.add(fd)
    return found


CHILD = textwrap.dedent("""
    import json, logging, os, socket, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from ckagent.containment.egress.proxy.fdstore import FdStore
    def open_fds():  # (not listdir's own, closed by now)
        found = []
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                os.fstat(fd)
                found.append(fd)
            except OSError:
                pass
        return sorted(found)
    before = open_fds()
    store = FdStore.from_environ()
    after = open_fds()
    taken = sorted(store.listeners)
    def inheritable(fd):
        try:
            return os.get_inheritable(fd)
        except OSError:  # (listdir's own)
            return False
    inheritable = [fd for fd in after if fd > 2 and inheritable(fd)]
    port = int(sys.argv[3])
    sock = store.take(port)
    new = socket.socket(); new.bind(("127.0.0.1", 0)); new.listen(8)
    store.store(port, sock)              # an inherited one stored again (replaces)
    store.store(new.getsockname()[1], new)
    store.remove(int(sys.argv[2]))       # one the store had that no task claims
    with open(sys.argv[1], "w") as out:
        json.dump({"before": before, "after": after, "taken": taken, "inheritable": inheritable,
                   "new": new.getsockname()[1], "active": store.active,
                   "env": sorted(k for k in os.environ if k.startswith("LISTEN_") or "FDSTORE" in k)}, out)
""")


def test_a_round_trip_between_the_store_and_a_real_agent_process(tmp_path: Path) -> None:
    """The store hands its listeners from fd 3 to a real child (ckagent.pod.fdstore.spawn); the child
    keeps only the valid one, closes the rest (a listener on another port, one bound but not listening,
    a UDP socket, an AF_INET6 listener, an AF_UNIX socket, a pipe, a bad name), leaves nothing
    inheritable nor any store variable, and its FDSTORE / FDSTOREREMOVE messages reach the store."""
    loop = Loop()
    store = DescriptorStore(loop)
    good, wrong_port, gone = _listener(), _listener(), _listener()
    idle = socket.socket()
    idle.bind(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    six = _listener(0, "::1", socket.AF_INET6)
    unix_a, unix_b = socket.socketpair()
    read_end, write_end = os.pipe()
    port, gone_port = good.getsockname()[1], gone.getsockname()[1]
    given = {f"ckproxy-{port}": good.fileno(), f"ckproxy-{gone_port}": gone.fileno(),
             f"ckproxy-{wrong_port.getsockname()[1] + 1}": wrong_port.fileno(),
             f"ckproxy-{idle.getsockname()[1]}": idle.fileno(), f"ckproxy-{udp.getsockname()[1]}": udp.fileno(),
             f"ckproxy-{six.getsockname()[1]}": six.fileno(), "ckproxy-1": unix_a.fileno(),
             "ckproxy-2": read_end, "nonsense": good.fileno()}
    store.fds = {name: os.dup(fd) for name, fd in given.items()}  # (as if stored by an earlier agent)
    env, fds = store.for_agent()
    assert env["CKAGENT_FDSTORE_FD"] == str(3 + len(given)) and env["LISTEN_FDS"] == str(len(given))
    child_env = {**os.environ, **env, "PYTHONPATH": str(Path(__file__).parents[1])}
    out = tmp_path / "seen.json"
    try:
        child = spawn([sys.executable, "-c", CHILD, str(out), str(gone_port), str(port)], child_env, fds)
    finally:
        store.spawned()
    _, status = os.waitpid(child.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    seen = json.loads(out.read_text())
    channel = 3 + len(given)
    assert seen["before"][:3] == [0, 1, 2] and set(range(3, channel + 1)) <= set(seen["before"]), seen
    assert seen["taken"] == sorted([port, gone_port]) and seen["active"], seen
    assert set(seen["after"]) & set(range(3, channel)) == {3, 4}, seen  # only the valid listeners (fds 3, 4)
    assert channel in seen["after"] and seen["inheritable"] == [] and seen["env"] == [], seen
    _run_loop(loop)
    store.agent_ended()
    assert f"ckproxy-{port}" in store.fds and f"ckproxy-{seen['new']}" in store.fds
    assert f"ckproxy-{gone_port}" not in store.fds  # FDSTOREREMOVE
    for name, fd in store.fds.items():
        if name in (f"ckproxy-{port}", f"ckproxy-{seen['new']}"):
            probe = socket.socket(fileno=os.dup(fd))
            assert probe.getsockname()[1] == name_port(name)
            assert probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            probe.close()
    store.close()
    assert store.fds == {}
    for sock in (good, wrong_port, gone, idle, udp, six, unix_a, unix_b):
        sock.close()
    os.close(read_end)
    os.close(write_end)


def _send(sock: socket.socket, text: bytes, fds: list[int] = ()) -> None:  # type: ignore[assignment]
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([text], rights)


def test_hostile_messages_are_refused_and_the_store_goes_on() -> None:
    """Garbage, a message too long, too many descriptors, bad names, a pipe, sockets of the wrong family
    or type or port, a listener that does not listen, a full store, an agent that is gone: each refused,
    the descriptors that came with it closed; the valid messages between them still taken."""
    loop = Loop()
    store = DescriptorStore(loop, max_fds=3)
    _env, fds = store.for_agent()
    agent = socket.socket(fileno=os.dup(fds[-1]))
    store.spawned()
    baseline = _open_fds()
    good = [_listener() for _ in range(4)]
    ports = [sock.getsockname()[1] for sock in good]
    read_end, write_end = os.pipe()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    six = _listener(0, "::1", socket.AF_INET6)
    unix_a, unix_b = socket.socketpair()
    idle = socket.socket()
    idle.bind(("127.0.0.1", 0))
    pipes = [os.pipe() for _ in range(17)]
    mine = _open_fds()
    hostile: list[tuple[bytes, list[int]]] = [
        (b"\xff\x00garbage", [good[0].fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[0] + b"x" * 4000, [good[0].fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[0], [r for r, _ in pipes]),  # 17 descriptors
        (b"FDSTORE=1\nFDNAME=ckproxy-0\n", [good[0].fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-65536\n", [good[0].fileno()]),
        (b"FDSTORE=1\nFDNAME=../../etc\n", [good[0].fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\nFDSTORE=1\n" % ports[0], [good[0].fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[0], []),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[0], [good[0].fileno(), good[1].fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[1], [good[0].fileno()]),  # a listener of another port
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[0], [read_end]),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % udp.getsockname()[1], [udp.fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % six.getsockname()[1], [six.fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % idle.getsockname()[1], [idle.fileno()]),
        (b"FDSTORE=1\nFDNAME=ckproxy-9\n", [unix_a.fileno()]),
        (b"FDSTOREREMOVE=1\nFDNAME=ckproxy-%d\n" % ports[0], [good[0].fileno()]),
    ]
    for text, carried in hostile[:8]:
        _send(agent, text, carried)
    for i in range(3):  # valid ones between the hostile: the store takes them
        _send(agent, b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[i], [good[i].fileno()])
    for text, carried in hostile[8:]:
        _send(agent, text, carried)
    _send(agent, b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[3], [good[3].fileno()])  # the store is full (3)
    _send(agent, b"FDSTORE=1\nFDNAME=ckproxy-%d" % ports[2], [good[2].fileno()])  # a replacement: taken
    _run_loop(loop)
    assert sorted(store.fds) == sorted(f"ckproxy-{p}" for p in ports[:3]), store.fds
    assert store.refused == len(hostile) + 1, store.refused
    # every descriptor that came with a refused message was closed: only the 3 kept are new here
    assert _open_fds() - mine == set(store.fds.values())
    _send(agent, b"FDSTOREREMOVE=1\nFDNAME=ckproxy-%d\n" % ports[0])
    _run_loop(loop)
    assert f"ckproxy-{ports[0]}" not in store.fds
    # a new agent: the old one's end reaches nothing any more
    store.for_agent()
    store.spawned()
    with pytest.raises(OSError):
        _send(agent, b"FDSTORE=1\nFDNAME=ckproxy-%d\n" % ports[3], [good[3].fileno()])
    _run_loop(loop)
    assert f"ckproxy-{ports[3]}" not in store.fds
    store.close()
    agent.close()
    for sock in (*good, udp, six, unix_a, unix_b, idle):
        sock.close()
    for r, w in [*pipes, (read_end, write_end)]:
        os.close(r)
        os.close(w)
    assert _open_fds() <= baseline | {fds[-1]}, _open_fds() - baseline


def test_without_a_store_the_agent_changes_nothing() -> None:
    env = {"LISTEN_FDS": "1", "LISTEN_FDNAMES": "ckproxy-1"}
    store = FdStore.from_environ(env)
    assert not store.active and store.listeners == {} and env == {"LISTEN_FDS": "1", "LISTEN_FDNAMES": "ckproxy-1"}
    with socket.socket() as sock:
        store.store(1, sock)  # no-ops
    store.remove(1)
    assert store.release_unclaimed() == [] and not store.stored


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill -9", "hand-over"])
async def test_kill_9_of_the_agent_refuses_no_connect_of_a_proxied_spider(dev_master, tmp_path: Path, how: str) -> None:
    """At the proxy level under ``ckagent supervise``: kill -9 of the agent (or SIGUSR2 to PID 1: a restart
    in place) while the spider requests all the time through its proxy; no connect refused, every page
    fetched, the task done once, the same port."""
    admin = dev_master.admin
    node = SupervisedNode(tmp_path / "node", dev_master.base_url, dev_master.registration_token,
                          task__egress="proxy")
    with serve_site(100_000) as site:
        await node.start()
        async with node:
            first = await node.new_agent()
            task_id = await submit(admin, "proxied", {"main.py": PROXY_CLIENTS}, params={"site": site.base})
            await wait_for_log(admin, task_id, "ready", 90)
            before = sum(site.page_fetches().values())
            await eventually(lambda: _more(site, before + 20), 30, "requests through the proxy")
            pid1 = await node.pid1()
            stored = await trio.to_thread.run_sync(_socket_inodes, pid1) if os.geteuid() == 0 else set()
            killed_at = time.monotonic()
            if how == "kill -9":
                os.kill(first, signal.SIGKILL)
            else:
                await node.signal(signal.SIGUSR2)
            second = await node.new_agent(other_than=first)
            await wait_for_log(admin, task_id, "re-adopted after an agent restart", 60)
            back_after = time.monotonic() - killed_at
            after = sum(site.page_fetches().values())
            await eventually(lambda: _more(site, after + 40), 30, "requests after the restart")
            (node.work_dir / "tasks" / task_id / "go").touch()
            final = await admin.wait_task_final(task_id, 60)
            assert final["status"] == "SUCCESS", final
            items = await admin.get_items(task_id)
            log_text = node.log_text()
            assert second != first
    summary, pages = summary_of(items)
    print(f"figures [{how}]: re-adopted {back_after:.1f} s after the kill or signal; longest request {summary['longest']:.2f} s; "
          f"pages keep-alive {len(pages.get('keep', []))}, new-connection {len(pages.get('new', []))}; "
          f"errors {summary['errors']}; refused {summary['refused']}")
    assert summary["refused"] == 0, (summary, log_text[-3000:])
    assert summary["longest"] >= (0.5 if how == "kill -9" else 0.0), summary  # (connects made while no agent ran waited)
    for name, start in (("keep", 1), ("new", 2)):  # every page in order, once each
        assert pages[name] == list(range(start, start + 2 * len(pages[name]), 2)), pages[name][:20]
        assert len(pages[name]) > 10
    fetched = site.page_fetches()
    assert all(fetched.get(page) for got in pages.values() for page in got)
    assert len(final.get("attempts") or []) == 1, final
    assert "listener(s) inherited from the store" in log_text, log_text[-3000:]
    # the spider saw neither the store's socket nor a stored listener (nor their variables)
    assert summary["env"] == [], summary
    assert not [link for link in summary["fds"].values() if link.startswith("socket:")], summary["fds"]
    if stored:
        assert not stored & set(summary["fds"].values())


async def _more(site: object, count: int) -> bool:
    return sum(site.page_fetches().values()) >= count  # type: ignore[attr-defined]


NOTIFYING_CHILD = textwrap.dedent("""
    import os, socket, sys
    from ckagent.containment.egress.proxy.fdstore import FdStore
    store = FdStore.from_environ()
    assert store.active and sorted(store.listeners) == [int(sys.argv[1])], store.listeners
    assert "NOTIFY_SOCKET" in os.environ and "LISTEN_FDS" not in os.environ
    sock = store.take(int(sys.argv[1]))
    store.store(int(sys.argv[1]), sock)
    store.remove(int(sys.argv[1]))
""")


@pytest.mark.parametrize("abstract", [False, True])
def test_under_systemd_the_notify_socket_is_the_store(tmp_path: Path, abstract: bool) -> None:
    """Without the supervisor's pair, ``NOTIFY_SOCKET`` (a path, or ``@name``) gets sd_notify's messages:
    the listener inherited from fd 3 (no ``LISTEN_PID`` here: accepted absent; systemd's, the agent's pid,
    is accepted too: the parsing tests) is taken,
    stored again with ``FDSTORE=1`` + ``FDNAME=ckproxy-<port>`` and one descriptor, then removed."""
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"@ckagent-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else str(tmp_path / "notify")
    manager.bind("\0" + name[1:] if abstract else name)
    manager.settimeout(20)
    good = _listener()
    port = good.getsockname()[1]
    env = {**os.environ, "NOTIFY_SOCKET": name, "LISTEN_FDS": "1", "LISTEN_FDNAMES": f"ckproxy-{port}",
           "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("CKAGENT_FDSTORE_FD", None)
    child = spawn([sys.executable, "-c", NOTIFYING_CHILD, str(port)], env, [good.fileno()])
    _, status = os.waitpid(child.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    data, ancillary, _flags, _addr = manager.recvmsg(256, socket.CMSG_SPACE(4 * 4))
    assert data == f"FDSTORE=1\nFDNAME=ckproxy-{port}\n".encode()
    fds = [fd for level, kind, raw in ancillary if kind == socket.SCM_RIGHTS
           for fd in array.array("i", raw[:len(raw) - len(raw) % 4])]
    assert len(fds) == 1
    with socket.socket(fileno=fds[0]) as stored:
        assert stored.getsockname() == ("127.0.0.1", port)
    data, ancillary, _flags, _addr = manager.recvmsg(256, socket.CMSG_SPACE(4 * 4))
    assert data == f"FDSTOREREMOVE=1\nFDNAME=ckproxy-{port}\n".encode() and not ancillary
    good.close()
    manager.close()
