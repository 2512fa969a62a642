"""Stopping an agent from outside: ``ckagent stop [--migrate]`` as a process, a stand-in for an agent
older than it, and a spider that answers the agent's persist requests (PLAN38's control channel)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import trio


def moved_on(task: dict[str, Any]) -> dict[str, Any]:
    """The first attempt of a task (admin JSON) the master moved on from after a disruption: asserts the
    task is PENDING again as attempt 2 (another node resumes it) and returns attempt 1's record."""
    assert (task["status"], task.get("attempt")) == ("PENDING", 2), task
    first = task["attempts"][0]
    assert (first["causeClass"], first["counted"]) == ("disruption", False), first
    return first


async def ckagent_stop(config: Path, *, migrate: bool = False, extra: tuple[str, ...] = ()) -> tuple[int, str, float]:
    """Run ``python -m ckagent stop [--migrate] -c CONFIG``; returns (exit code, its stderr, seconds it
    took). Bound it with ``trio.fail_after`` at the call site."""
    argv = [sys.executable, "-m", "ckagent", "stop", *(["--migrate"] if migrate else []), "-c", str(config), *extra]
    started = time.monotonic()
    done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False,
                                  stdin=subprocess.DEVNULL)
    return done.returncode, done.stderr.decode(errors="replace"), time.monotonic() - started


OLD_AGENT = textwrap.dedent("""
    # An agent older than `ckagent stop`: it holds the work dir's lock (as ckagent.node.workdir does)
    # and drains on SIGTERM — it knows nothing of the request file.
    import fcntl, os, signal, sys, time
    fd = os.open(os.path.join(sys.argv[1], "agent.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0); os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    print("locked", flush=True)
    time.sleep(600)
""")
"""Run with the work dir as its argument; prints ``locked`` once it holds the lock."""


PERSISTING_SPIDER = textwrap.dedent("""
    # A spider that checkpoints as PLAN38's control channel asks (until the SDK lands): it counts pages
    # in CK_STATE_DIR/state.json, and for every request in CK_CONTROL_FILE copies the state dir to
    # CK_SNAPSHOT_DIR/<id> (via <id>.tmp) and appends its ack to CK_CONTROL_ACK_FILE.
    import json, os, shutil, time
    state_dir = os.environ["CK_STATE_DIR"]
    control, acks = os.environ["CK_CONTROL_FILE"], os.environ["CK_CONTROL_ACK_FILE"]
    snapshots, items = os.environ["CK_SNAPSHOT_DIR"], os.environ["CK_ITEMS_FILE"]
    os.makedirs(snapshots, exist_ok=True)
    path = os.path.join(state_dir, "state.json")
    state = json.load(open(path)) if os.path.exists(path) else {"page": 0}
    print("resumed at", state["page"], flush=True)
    print("started", flush=True)
    seen = 0
    while True:
        state["page"] += 1
        with open(items, "a") as f:
            f.write(json.dumps({"page": state["page"]}) + "\\n")
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)
        lines = open(control).read().splitlines() if os.path.exists(control) else []
        for line in lines[seen:]:
            request = json.loads(line)
            n = str(request["id"])
            started = time.monotonic()
            tmp = os.path.join(snapshots, n + ".tmp")
            shutil.copytree(state_dir, tmp, symlinks=True)
            os.replace(tmp, os.path.join(snapshots, n))
            ack = {"id": request["id"], "itemsOffset": os.path.getsize(items), "snapshot": n,
                   "pauseMs": (time.monotonic() - started) * 1000}
            with open(acks, "a") as f:
                f.write(json.dumps(ack) + "\\n")
            print("persisted", n, request.get("event"), request.get("secondsLeft"), flush=True)
        seen = len(lines)
        time.sleep(0.2)
""")
"""A python spider's main.py: an item a page every 0.2 s, its state in CK_STATE_DIR, acks persist requests."""


SDK_COUNTER = textwrap.dedent("""
    # A spider that persists its state with the Python SDK: a counter, an item per step (under the SDK's
    # state lock, so a snapshot never holds an item without the count that made it, nor the reverse).
    import time
    import crawlerkeeper_sdk as ck
    state = ck.load_state({"n": 0})
    ck.on_persist(lambda: {"n": state["n"]})
    ck.on_migrating(lambda seconds_left: print("migrating:", round(seconds_left, 1), "s left", flush=True))
    print("resumed at", state["n"], flush=True)
    print("started", flush=True)
    while True:
        with ck.state_lock():
            state["n"] += 1
            ck.save_item({"n": state["n"]})
        time.sleep(0.05)
""")
"""A python spider's main.py that checkpoints through crawlerkeeper_sdk (on_persist, load_state)."""
