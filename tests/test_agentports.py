"""The host's registry of agents' ports (ckagent.node.agentports): every live agent's ports, whoever
runs it; a file anyone can plant only adds denials and never stops the reader.

Liveness is proved with real processes (:func:`harness.another_agent`); "another user" is ``nobody``
(:func:`harness.run_as`, root only). The registries here live in test directories, never in the
host's /run/ckagent/ports.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    NOBODY,
    RecordingMaster,
    another_agent,
    another_user_cannot,
    no_strays,
    other_user_prelude,
    run_as,
    running_agent,
    settings_for,
    world_directory,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckagent.node.agentports import (
    FORMAT,
    MAX_ENTRY_BYTES,
    MAX_PORTS,
    PortRegistry,
    boot_id,
    parse_entry,
    pid_namespace,
)
from ckagent.node.procid import is_zombie, start_ticks

needs_another_user = pytest.mark.skipif(another_user_cannot() is not None, reason=str(another_user_cannot()))


def _entry(pid: int | None = None, ports: list[int] | None = None, **changes: object) -> dict[str, object]:
    """An entry as an agent writes it (this process's identity unless ``pid``/``changes`` say otherwise)."""
    pid = os.getpid() if pid is None else pid
    entry: dict[str, object] = {"ckagent": FORMAT, "pid": pid, "start": start_ticks(pid) or 0,
                                "boot": boot_id(), "pidns": pid_namespace(),
                                "ports": [7001] if ports is None else ports, "workDir": "/x"}
    entry.update(changes)
    return entry


def _plant(directory: Path, name: str, content: bytes | dict[str, object]) -> Path:
    path = directory / name
    path.write_bytes(json.dumps(content).encode() if isinstance(content, dict) else content)
    return path


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def test_an_agents_entry_is_written_read_by_the_others_and_removed(tmp_path: Path) -> None:
    directory = tmp_path / "ports"
    mine, other = PortRegistry(directory, work_dir=tmp_path), PortRegistry(directory, liveness_interval=0)
    assert other.live_ports() == frozenset() and mine.path is None  # nothing written before register
    mine.register([9000])
    assert mine.path is not None and mine.path.parent == directory
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o1777  # sticky: each entry is its owner's
    assert stat.S_IMODE(os.stat(mine.path).st_mode) == 0o644  # every user's agent reads it
    entry = parse_entry(mine.path.read_bytes())
    assert entry is not None and (entry.pid, entry.ports, entry.work_dir) == (os.getpid(), {9000}, str(tmp_path))
    assert other.live_ports() == {9000}
    mine.register([9001, 9002])
    assert other.live_ports() == {9000, 9001, 9002}
    mine.unregister([9000, 9002, 4444])
    assert other.live_ports() == {9001} and mine.ports == {9001}
    [seen] = other.entries()
    assert seen.path == str(mine.path)
    mine.close()
    assert other.live_ports() == frozenset() and not list(directory.iterdir())
    mine.close()  # idempotent
    with pytest.raises(ValueError, match="not a port"):
        mine.register([0])
    with pytest.raises(ValueError, match="not a port"):
        mine.register([True])  # type: ignore[list-item]


def test_another_process_counts_while_it_lives_and_its_entry_goes_when_it_is_dead(tmp_path: Path) -> None:
    directory = tmp_path / "ports"
    reader = PortRegistry(directory, liveness_interval=0)
    with another_agent(directory, [7100, 7101]) as first, another_agent(directory, [7200]) as second:
        assert reader.live_ports() == {7100, 7101, 7200}
        first.send_signal(signal.SIGKILL)  # a crash: its entry stays behind
        first.wait()
        assert len(list(directory.iterdir())) == 2
        assert reader.live_ports() == {7200}
        assert len(list(directory.iterdir())) == 1  # the dead agent's entry was removed
        second.send_signal(signal.SIGSTOP)  # stopped is alive
        try:
            assert reader.live_ports() == {7200}
        finally:
            second.send_signal(signal.SIGCONT)
    assert reader.live_ports() == frozenset()  # the second removed its own at its stop


def test_a_zombie_is_dead(tmp_path: Path) -> None:
    directory = tmp_path / "ports"
    reader = PortRegistry(directory, liveness_interval=0)
    with another_agent(directory, [7300]) as zombie:
        os.kill(zombie.pid, signal.SIGKILL)
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # (until it is a zombie; not reaped)
        assert start_ticks(zombie.pid) is not None and is_zombie(zombie.pid)
        assert reader.live_ports() == frozenset()
        zombie.wait()


def test_the_cache_sees_every_change(tmp_path: Path) -> None:
    directory = tmp_path / "ports"
    writer = PortRegistry(directory)
    writer.register([7400])
    reader = PortRegistry(directory, liveness_interval=3600)
    assert reader.live_ports() == {7400}
    for port in range(7401, 7441):  # changes faster than the directory's mtime ticks
        writer.register([port])
        assert port in reader.live_ports()
        writer.unregister([port - 1])
        assert port - 1 not in reader.live_ports()


# ------------------------------------------------------------------------------ hostile and unlucky files


def _symlink_to_valid(directory: Path) -> None:
    outside = directory.parent / "outside.json"
    outside.write_text(json.dumps(_entry(ports=[6001])))
    (directory / "link.json").symlink_to(outside)


def _fifo(directory: Path) -> None:
    os.mkfifo(directory / "fifo.json")


def _huge_sparse(directory: Path) -> None:
    with open(directory / "huge.json", "wb") as fh:
        fh.truncate(1 << 40)  # a terabyte, sparse


def _over_the_cap(directory: Path) -> None:
    entry = json.dumps(_entry(ports=[6002])).encode()
    _plant(directory, "big.json", entry + b" " * (MAX_ENTRY_BYTES + 1 - len(entry)))


def _directory(directory: Path) -> None:
    (directory / "dir.json").mkdir()
    _plant(directory / "dir.json", "inner.json", _entry(ports=[6003]))


def _unreadable(directory: Path) -> None:
    path = _plant(directory, "locked.json", b"\x00")
    path.chmod(0)


def _in_progress(directory: Path) -> None:
    _plant(directory, ".tmp.json.1234", _entry(ports=[6004]))


HOSTILE: dict[str, Callable[[Path], object]] = {
    "garbage": lambda d: _plant(d, "garbage.json", b"\xff\xfe\x00not json at all\x80"),
    "empty": lambda d: _plant(d, "empty.json", b""),
    "huge (sparse, 1 TiB)": _huge_sparse,
    "over the size cap": _over_the_cap,
    "a symlink to a valid entry": _symlink_to_valid,
    "a symlink to /dev/zero": lambda d: (d / "zero.json").symlink_to("/dev/zero"),
    "a FIFO": _fifo,
    "a directory": _directory,
    "unreadable": _unreadable,
    "being written (dot file)": _in_progress,
    "deep nesting": lambda d: _plant(d, "deep.json", b"[" * 200000),
    "an over-long integer": lambda d: _plant(d, "long.json", b'{"ckagent": "agent-ports/1", "pid": 1' + b"0" * 5000 + b"}"),
    "NaN and floats": lambda d: _plant(d, "nan.json", json.dumps(_entry(ports=[6005.0, float("nan")])).encode()),
    "booleans as ports": lambda d: _plant(d, "bool.json", _entry(ports=[True, 6006])),
    "ports out of range": lambda d: _plant(d, "range.json", _entry(ports=[0, 6007, 65536])),
    "a port as text": lambda d: _plant(d, "text.json", _entry(ports=["6008"])),
    "too many ports": lambda d: _plant(d, "many.json", _entry(ports=[6009] * (MAX_PORTS + 1))),
    "another format": lambda d: _plant(d, "format.json", _entry(ports=[6010], ckagent="agent-ports/2")),
    "a list": lambda d: _plant(d, "list.json", b"[1, 2, 3]"),
    "a pid out of range": lambda d: _plant(d, "pid.json", _entry(ports=[6011], pid=1 << 23)),
    "a stale pid": lambda d: _plant(d, "stale.json", _entry(ports=[6012], pid=_dead_pid(), start=1)),
    "a reused pid (live, another start time)": lambda d: _plant(
        d, "reused.json", _entry(ports=[6013], start=(start_ticks(os.getpid()) or 0) + 1)),
    "another boot": lambda d: _plant(d, "boot.json", _entry(ports=[6014], boot="0" * 36)),
    "my identity with no ports": lambda d: _plant(d, "copy.json", _entry(ports=[])),
}
"""What a hostile local user (or a crash) leaves in a registry directory: none of it is an entry
that counts, and none stops the reader or hides the real entries."""

REMOVED = {"a stale pid": "stale.json", "a reused pid (live, another start time)": "reused.json",
           "another boot": "boot.json"}
"""The cases that are dead agents' entries: the reader removes their files."""


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_a_hostile_file_never_stops_the_reader_nor_hides_an_entry(tmp_path: Path, case: str) -> None:
    directory = tmp_path / "ports"
    real = PortRegistry(directory)
    real.register([9000])
    HOSTILE[case](directory)
    reader = PortRegistry(directory, liveness_interval=0)
    with trio.fail_after(10):  # (a FIFO opened for reading without O_NONBLOCK would wait forever)
        ports = await trio.to_thread.run_sync(reader.live_ports)
    assert ports == {9000}, case
    if case in REMOVED:
        assert not (directory / REMOVED[case]).exists()
    real.close()
    assert reader.live_ports() == frozenset()


def test_entries_that_cannot_be_judged_or_name_a_live_process_count(tmp_path: Path) -> None:
    """A planted entry can only add denials: one naming a live process (init here) counts, as does
    one from another pid namespace (its pid means nothing here); neither is removed."""
    directory = tmp_path / "ports"
    directory.mkdir()
    _plant(directory, "init.json", _entry(pid=1, ports=[6101]))
    _plant(directory, "elsewhere.json", _entry(pid=_dead_pid(), ports=[6102], pidns="pid:[1]"))
    reader = PortRegistry(directory, liveness_interval=0)
    assert reader.live_ports() == {6101, 6102}
    assert reader.live_ports() == {6101, 6102} and len(list(directory.iterdir())) == 2


def test_a_flood_of_files_hides_nothing_and_is_read_once(tmp_path: Path) -> None:
    directory = tmp_path / "ports"
    real = PortRegistry(directory)
    real.register([9000])
    for i in range(3000):
        _plant(directory, f"flood-{i:05}.json", b"x" * 100)
    reader = PortRegistry(directory, liveness_interval=0)
    assert reader.live_ports() == {9000}
    cached = reader._dirs[directory].files
    assert cached is not None and len(cached) == 3001
    real.register([9001])  # the directory changed: scanned again, unchanged files not read again
    assert reader.live_ports() == {9000, 9001}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_parse_entry_never_raises_on_bytes(data: bytes) -> None:
    entry = parse_entry(data)
    assert entry is None or all(1 <= p <= 65535 for p in entry.ports)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=10)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pid=JSONISH, start=JSONISH, ports=JSONISH, boot=JSONISH, extra=st.dictionaries(st.text(max_size=8), JSONISH))
def test_parse_entry_never_raises_on_entry_shaped_json(pid: object, start: object, ports: object, boot: object,
                                                       extra: dict[str, object]) -> None:
    """Entry-shaped objects with a field of any JSON type (random bytes rarely get that far)."""
    obj = {**extra, "ckagent": FORMAT, "pid": pid, "start": start, "boot": boot, "pidns": "pid:[1]", "ports": ports}
    entry = parse_entry(json.dumps(obj).encode())
    if entry is not None:
        assert type(pid) is int and type(start) is int and isinstance(ports, list)
        assert all(type(p) is int and 1 <= p <= 65535 for p in entry.ports)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=st.dictionaries(st.from_regex(r"[a-z0-9_-]{1,20}\.json", fullmatch=True), st.binary(max_size=2048),
                             max_size=6))
def test_any_bytes_in_the_registry_never_stop_the_reader(files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as base:
        directory = Path(base) / "ports"
        real = PortRegistry(directory)
        real.register([9000])
        for name, data in files.items():
            _plant(directory, name, data)
        assert PortRegistry(directory, liveness_interval=0).live_ports() == {9000}
        real.close()


# ------------------------------------------------------------------------------ where agents write


def test_a_root_agent_makes_the_host_wide_registry_and_refuses_one_it_cannot_trust(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the host-wide registry is made by root")
    (tmp_path / "run").mkdir(mode=0o755)
    host = tmp_path / "run" / "ckagent" / "ports"
    registry = PortRegistry(host_dir=host, fallback_dir=tmp_path / "fallback")
    assert registry.read_dirs == (host, tmp_path / "fallback")
    registry.register([9000])
    assert registry.path is not None and registry.path.parent == host
    assert stat.S_IMODE(os.stat(host).st_mode) == 0o1777 and os.stat(host).st_uid == 0
    assert stat.S_IMODE(os.stat(host.parent).st_mode) == 0o755
    assert PortRegistry(host_dir=host, fallback_dir=tmp_path / "fallback").live_ports() == {9000}
    registry.close()
    # A registry whose directory another user owns (they could remove entries): root writes nothing there.
    os.chown(host, NOBODY, NOBODY)
    untrusted = PortRegistry(host_dir=host, fallback_dir=tmp_path / "fallback")
    untrusted.register([9001])
    assert untrusted.path is None and not list(host.iterdir())


def test_the_configured_directory_is_the_only_one(tmp_path: Path) -> None:
    registry = PortRegistry(tmp_path / "mine", host_dir=tmp_path / "host", fallback_dir=tmp_path / "fallback")
    assert registry.read_dirs == (tmp_path / "mine",)
    registry.register([9000])
    assert registry.path is not None and registry.path.parent == tmp_path / "mine"
    assert not (tmp_path / "host").exists() and not (tmp_path / "fallback").exists()
    registry.close()


def test_a_symlinked_registry_is_neither_written_through_nor_read(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    _plant(target, "planted.json", _entry(ports=[6201]))
    (tmp_path / "ports").symlink_to(target)
    registry = PortRegistry(tmp_path / "ports", liveness_interval=0)
    registry.register([9000])
    assert registry.path is None and [p.name for p in target.iterdir()] == ["planted.json"]
    assert registry.live_ports() == {9000}  # its own, from memory; nothing through the link


NON_ROOT_AGENT = """
import json, sys
from pathlib import Path
from ckagent.node.agentports import PortRegistry
host, fallback, *ports = sys.argv[1:]
registry = PortRegistry(host_dir=Path(host), fallback_dir=Path(fallback), liveness_interval=0)
registry.register([int(p) for p in ports])
print(json.dumps({"path": str(registry.path), "live": sorted(registry.live_ports())}))
"""

OTHER_UID = 4242
"""A second unprivileged uid (needs no account: the kernel only checks numbers)."""


@needs_another_user
def test_root_and_non_root_agents_read_each_others_entries_and_remove_none(tmp_path: Path) -> None:
    with world_directory() as base:
        host, fallback = base / "run-ckagent" / "ports", base / "tmp-ckagent-ports"
        # Before any root agent: a non-root agent writes to the fallback (and makes it, mode 1777).
        early = run_as(NOBODY, NON_ROOT_AGENT, str(host), str(fallback), "7701")
        assert early.returncode == 0, early.stderr
        assert json.loads(early.stdout) == {"path": str(next(fallback.iterdir())), "live": [7701]}
        assert stat.S_IMODE(os.stat(fallback).st_mode) == 0o1777 and os.stat(fallback).st_uid == NOBODY
        # The root agent makes the host-wide one and reads the fallback too (the other agent is gone
        # by now: its entry is judged dead and removed; a live one is held below).
        root = PortRegistry(host_dir=host, fallback_dir=fallback, liveness_interval=0)
        root.register([7000])
        assert root.path is not None and root.path.parent == host
        # A non-root agent now writes to the host-wide one and reads root's entry (mode 0644).
        later = run_as(OTHER_UID, NON_ROOT_AGENT, str(host), str(fallback), "7702")
        assert later.returncode == 0, later.stderr
        seen = json.loads(later.stdout)
        assert seen["live"] == [7000, 7702] and seen["path"].startswith(str(host) + "/"), seen
        # A non-root user cannot remove root's entry (the sticky bit), nor another user's.
        remove = run_as(NOBODY, "import os, sys\ntry:\n os.unlink(sys.argv[1])\nexcept PermissionError:\n "
                        "print('refused')", str(root.path))
        assert remove.stdout.strip() == "refused", (remove.stdout, remove.stderr)
        assert root.path.exists()
        root.close()


HOLDING_AGENT = """
import sys
from pathlib import Path
from ckagent.node.agentports import PortRegistry
registry = PortRegistry(host_dir=Path(sys.argv[1]), fallback_dir=Path(sys.argv[2]))
registry.register([int(sys.argv[3])])
print(registry.path, flush=True)
sys.stdin.read()
"""


@needs_another_user
def test_a_live_non_root_agent_in_the_fallback_is_seen_by_root_and_a_dead_ones_entry_is_removed(
    tmp_path: Path,
) -> None:
    with world_directory() as base:
        host, fallback = base / "run-ckagent" / "ports", base / "tmp-ckagent-ports"
        prelude = other_user_prelude()
        holder = subprocess.Popen(["/usr/bin/python3", "-I", "-S", "-c", prelude + HOLDING_AGENT, str(host),
                                   str(fallback), "7801"], user=NOBODY, group=NOBODY, extra_groups=[],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        try:
            assert holder.stdout is not None
            path = Path(holder.stdout.readline().strip())
            assert path.parent == fallback and os.stat(path).st_uid == NOBODY
            root = PortRegistry(host_dir=host, fallback_dir=fallback, liveness_interval=0)
            assert root.live_ports() == {7801}
            holder.kill()
            holder.wait()
            assert root.live_ports() == frozenset() and not path.exists()  # root may remove a dead one's
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
            for stream in (holder.stdin, holder.stdout):
                if stream is not None:
                    stream.close()


@needs_another_user
def test_a_fallback_planted_by_a_hostile_user_is_not_written_to(tmp_path: Path) -> None:
    """World-writable without the sticky bit: anyone could remove entries there; a symlink: it
    could point anywhere. The agent writes nothing, says so once, and its own tasks still refuse its ports."""
    with world_directory() as base:
        host = base / "no-host-registry"
        for kind in ("open", "symlink"):
            fallback = base / f"fallback-{kind}"
            if kind == "open":
                fallback.mkdir()
                os.chown(fallback, NOBODY, NOBODY)
                fallback.chmod(0o777)
            else:
                (base / "theirs").mkdir(exist_ok=True)
                fallback.symlink_to(base / "theirs")
            done = run_as(OTHER_UID, NON_ROOT_AGENT, str(host), str(fallback), "7901")
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout) == {"path": "None", "live": [7901]}, kind
            assert "cannot record this agent's ports" in done.stderr, done.stderr


@needs_another_user
def test_a_non_root_agent_moves_its_entry_to_the_host_wide_registry_when_it_appears(tmp_path: Path) -> None:
    script = """
import os, sys
from pathlib import Path
from ckagent.node.agentports import PortRegistry
host, fallback = Path(sys.argv[1]), Path(sys.argv[2])
registry = PortRegistry(host_dir=host, fallback_dir=fallback)
registry.register([7601])
print(registry.path.parent == fallback)
input()  # the test makes the host-wide registry
registry.register([7602])
print(registry.path.parent == host, sorted(p.name for p in fallback.iterdir()))
"""
    with world_directory() as base:
        host, fallback = base / "run-ckagent" / "ports", base / "tmp-ckagent-ports"
        prelude = other_user_prelude()
        process = subprocess.Popen(["/usr/bin/python3", "-I", "-S", "-c", prelude + script, str(host), str(fallback)],
                                   user=NOBODY, group=NOBODY, extra_groups=[], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        assert process.stdout is not None and process.stdin is not None
        assert process.stdout.readline().strip() == "True"
        PortRegistry(host_dir=host, fallback_dir=fallback).register([7000])  # a root agent makes it
        out, err = process.communicate("\n", timeout=30)
        assert out.strip() == "True []", (out, err)


# ------------------------------------------------------------------------------ the agent


async def test_the_agent_registers_its_status_port_and_removes_it_at_its_stop(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path,
) -> None:
    settings = settings_for(tmp_path, recording_master, AGENT_TASK_EGRESS="off")
    directory = settings.agent.ports_registry
    assert directory == tmp_path / "agent-ports"
    reader = PortRegistry(directory, liveness_interval=0)
    async with running_agent(nursery, settings) as agent:
        assert reader.live_ports() == {agent.status_port}
        assert agent.egress is not None and agent.egress.agent_ports() == {agent.status_port}
        with another_agent(directory, [7001]):
            assert agent.egress.agent_ports() == {agent.status_port, 7001}
    assert reader.live_ports() == frozenset() and not list(directory.iterdir())
