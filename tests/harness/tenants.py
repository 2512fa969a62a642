"""Spiders as tenants of one node (tests/test_tenants.py): a victim that keeps running and writes items
beside an attacker that tries every cross-tenant action and reports each result.

- :data:`VICTIM_PY` — spider B (Python): writes two items through ``CK_ITEMS_FILE``, tells the test where
  it lives (a *beacon* file: its pid, process group, working copy, task, data and home dirs, venv, items
  and stats files — never its environment), waits for ``go`` in its task dir (the test's, root's or the
  agent user's), writes two more items. Its task env carries a secret (``DB_PASSWORD``).
- :data:`VICTIM_NODE` / :func:`victim_node_files` — spider N (Node): the same with a dependency from a
  test npm registry (``ckvictimdep``, :data:`VICTIM_DEP`) in its environment's ``node_modules``.
- A later task of either runs the same code: a ``.pth`` or a module A planted would have run there, and
  would have left a ``POISONED-*`` file in the report dir and a ``POISONED`` line in its log
  (:func:`poisoned`).
- :data:`ATTACKER` — spider A (Python, standard library only): each action of :func:`action_keys` against
  the targets in its ``CK_PARAMS`` (:func:`attack_params`), each result ``{"ok": bool, "error": errno
  name, "got": what it read}`` in a JSON report (:func:`read_report`). ``gentle`` (at levels that cannot
  prevent an action): writes open without writing (or create and unlink), signals are signal 0, a
  ptrace attach is detached at once — the attempt's answer without harm to B.

Everything here is blocking (small files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.npmregistry import NpmPackage

__all__ = ["AGENT_ACTIONS", "ATTACKER", "NODE_ACTIONS", "PY_ACTIONS", "SECRET", "VICTIM_ACTIONS", "VICTIM_DEP",
           "VICTIM_NODE", "VICTIM_PY", "action_keys", "attack_params", "beacon_of", "poisoned", "read_report", "victim_node_files", "victim_py_files"]

SECRET = "hunter2-db-password-of-b"
"""The victim's ``DB_PASSWORD`` (its task env): it must never show in what A saw."""

VICTIM_PY = r'''
import json, os, site, sys, time
P = json.loads(os.environ["CK_PARAMS"])
task = os.environ["CK_TASK_DIR"].rstrip("/").rsplit("/", 1)[-1]
assert os.environ.get("DB_PASSWORD"), "the task env's secret"
items = open(os.environ["CK_ITEMS_FILE"], "a")
open(os.environ["CK_STATS_FILE"], "a").close()  # there for A to try
def item(n):
    items.write(json.dumps({"spider": "B", "task": task, "n": n}) + "\n")
    items.flush()
item(1); item(2)
beacon = {"pid": os.getpid(), "pgid": os.getpgrp(), "uid": os.getuid(), "cwd": os.getcwd(),
          "task_dir": os.environ["CK_TASK_DIR"], "data_dir": os.environ["CK_DATA_DIR"],
          "home": os.environ["HOME"], "venv": sys.prefix, "site": site.getsitepackages(),
          "items_file": os.environ["CK_ITEMS_FILE"], "stats_file": os.environ["CK_STATS_FILE"]}
path = os.path.join(P["report"], "beacon-" + task + ".json")
with open(path + ".part", "w") as fh:
    json.dump(beacon, fh)
os.rename(path + ".part", path)
print("victim ready", flush=True)
for _ in range(2400 if P.get("wait") else 0):  # at most two minutes: the test creates "go" in the task dir
    if os.path.exists(os.path.join(os.environ["CK_TASK_DIR"], "go")):
        break
    time.sleep(0.05)
item(3); item(4)
print("victim done", flush=True)
'''

VICTIM_DEP = NpmPackage("ckvictimdep", files={"index.js": "module.exports = 42;\n"})
"""The Node victim's dependency, served by a test npm registry."""

VICTIM_NODE = r'''
const fs = require('fs'), path = require('path');
const P = JSON.parse(process.env.CK_PARAMS);
const task = path.basename(process.env.CK_TASK_DIR.replace(/\/+$/, ''));
const dep = require('ckvictimdep');
if (dep !== 42) console.log('POISONED: ckvictimdep is ' + JSON.stringify(dep));
const item = (n) => fs.appendFileSync(process.env.CK_ITEMS_FILE,
  JSON.stringify({spider: 'N', task: task, n: n}) + '\n');
item(1); item(2);
fs.closeSync(fs.openSync(process.env.CK_STATS_FILE, 'a'));
const modules = fs.realpathSync('node_modules');
const beacon = {pid: process.pid, uid: process.getuid(), cwd: process.cwd(), task_dir: process.env.CK_TASK_DIR,
  data_dir: process.env.CK_DATA_DIR, home: process.env.HOME, node_modules: modules,
  items_file: process.env.CK_ITEMS_FILE, stats_file: process.env.CK_STATS_FILE};
const file = path.join(P.report, 'beacon-' + task + '.json');
fs.writeFileSync(file + '.part', JSON.stringify(beacon));
fs.renameSync(file + '.part', file);
console.log('victim ready');
let left = P.wait ? 2400 : 0;
const tick = () => {
  if (left-- > 0 && !fs.existsSync(path.join(process.env.CK_TASK_DIR, 'go'))) return setTimeout(tick, 50);
  item(3); item(4);
  console.log('victim done');
};
tick();
'''

ATTACKER = r'''
import ctypes, errno, json, os, signal, sys
P = json.loads(os.environ["CK_PARAMS"])
gentle = P["gentle"]
report = {}

def attempt(name, fn):
    try:
        got = fn()
        report[name] = {"ok": True, "got": got}
    except OSError as exc:
        report[name] = {"ok": False, "error": errno.errorcode.get(exc.errno, str(exc.errno))}
    except Exception as exc:
        report[name] = {"ok": False, "error": type(exc).__name__ + ": " + str(exc)}

def read(path):
    with open(path, "rb") as fh:
        return fh.read(65536).decode("latin-1")

def create(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if not gentle:
            os.write(fd, text.encode())
    finally:
        os.close(fd)
    if gentle:
        os.unlink(path)
    return path

def append(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        if not gentle:
            os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path

def overwrite(path, text):
    fd = os.open(path, os.O_WRONLY | (0 if gentle else os.O_TRUNC))
    try:
        if not gentle:
            os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path

def opened(path):
    os.close(os.open(path, os.O_RDONLY))
    return "opened"

def fds(pid):
    names = os.listdir("/proc/%d/fd" % pid)
    seen = {}
    for name in names:
        link = "/proc/%d/fd/%s" % (pid, name)
        try:
            seen[name] = os.readlink(link)
            if not gentle:  # (reading another's pipe or eventfd takes what it was owed)
                seen[name] += " => " + read(link)[:2000]
        except OSError as exc:
            seen[name] = seen.get(name, "") + " !" + errno.errorcode.get(exc.errno, "")
    return seen

def kill(pid, group=False):
    sig = 0 if gentle else signal.SIGKILL
    (os.killpg if group else os.kill)(pid, sig)
    return sig

libc = ctypes.CDLL(None, use_errno=True)
def ptrace(pid):
    if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.waitpid(pid, getattr(os, "__WALL", 0x40000000))
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH: B goes on
    return "attached"

poison = ("import os; open(os.path.join(%r, 'POISONED-' + str(os.getpid())), 'w').write('pth'); "
          "print('POISONED by a planted .pth')\n" % P["report"])
node_poison = ("require('fs').writeFileSync(%s + '/POISONED-' + process.pid, 'node'); "
               "console.log('POISONED by a planted module'); module.exports = 'poisoned';\n" % json.dumps(P["report"]))
forged = json.dumps({"spider": "B", "forged": "by A"}) + "\n"
for who, t in sorted(P["victims"].items()):
    attempt(who + ":read working copy", lambda: sorted(os.listdir(t["cwd"])))
    attempt(who + ":read data dir", lambda: sorted(os.listdir(t["data_dir"])))
    attempt(who + ":write working copy", lambda: create(os.path.join(t["cwd"], "planted-by-a.py"), "x"))
    attempt(who + ":write task dir", lambda: create(os.path.join(t["task_dir"], "planted-by-a"), "x"))
    attempt(who + ":write data dir", lambda: create(os.path.join(t["data_dir"], "planted-by-a"), "x"))
    attempt(who + ":write home", lambda: create(os.path.join(t["home"], ".bashrc"), "x"))
    attempt(who + ":append items", lambda: append(t["items_file"], forged))
    attempt(who + ":append stats", lambda: append(t["stats_file"], json.dumps({"forged": 1}) + "\n"))
    attempt(who + ":append output.log", lambda: append(os.path.join(t["task_dir"], "output.log"), "forged\n"))
    attempt(who + ":read items", lambda: read(t["items_file"]))
    attempt(who + ":read environ", lambda: read("/proc/%d/environ" % t["pid"]))
    attempt(who + ":read cmdline", lambda: read("/proc/%d/cmdline" % t["pid"]))
    attempt(who + ":read fd", lambda: fds(t["pid"]))
    attempt(who + ":read mem", lambda: opened("/proc/%d/mem" % t["pid"]))
    attempt(who + ":signal", lambda: kill(t["pid"]))
    attempt(who + ":signal group", lambda: kill(t.get("pgid", t["pid"]), group=True))
    attempt(who + ":ptrace", lambda: ptrace(t["pid"]))
    if "site" in t:
        attempt(who + ":plant .pth", lambda: create(os.path.join(t["site"][0], "zz-planted-by-a.pth"), poison))
        attempt(who + ":plant in venv bin", lambda: create(os.path.join(t["venv"], "bin", "planted"), "x"))
    if "node_modules" in t:
        mods = t["node_modules"]
        attempt(who + ":plant node_modules file",
                lambda: create(os.path.join(mods, "ckvictimdep", "planted.js"), node_poison))
        attempt(who + ":overwrite node_modules module",
                lambda: overwrite(os.path.join(mods, "ckvictimdep", "index.js"), node_poison))
agent, work = P["agent_pid"], P["work_dir"]
attempt("agent:read environ", lambda: read("/proc/%d/environ" % agent))
attempt("agent:read cmdline", lambda: read("/proc/%d/cmdline" % agent))
attempt("agent:read fd", lambda: fds(agent))
attempt("agent:read mem", lambda: opened("/proc/%d/mem" % agent))
attempt("agent:signal", lambda: os.kill(agent, 0))
attempt("agent:ptrace", lambda: ptrace(agent))
attempt("agent:read config", lambda: read(P["config"]))
attempt("agent:read state.db", lambda: read(os.path.join(work, "state.db")))
attempt("agent:read state.db-wal", lambda: read(os.path.join(work, "state.db-wal")))
attempt("agent:read node id", lambda: read(os.path.join(work, "node_uid")))
attempt("agent:read runtimes", lambda: read(os.path.join(work, "runtimes.json")))
attempt("agent:read egress key", lambda: read(os.path.join(work, "egress-proxy.key")))
attempt("agent:list work dir", lambda: sorted(os.listdir(work)))
attempt("agent:list tasks", lambda: sorted(os.listdir(os.path.join(work, "tasks"))))
attempt("agent:write work dir", lambda: create(os.path.join(work, "planted-by-a"), "x"))
attempt("agent:write tasks dir", lambda: create(os.path.join(work, "tasks", "planted-by-a"), "x"))
attempt("agent:write envs", lambda: create(os.path.join(work, "envs", "planted-by-a"), "x"))
out = os.path.join(P["report"], "attack.json")
with open(out + ".part", "w") as fh:
    json.dump({"uid": os.getuid(), "report": report}, fh)
os.rename(out + ".part", out)
print("attacker tried %d actions, %d refused" % (len(report), sum(not r["ok"] for r in report.values())), flush=True)
'''

VICTIM_ACTIONS = ("read working copy", "read data dir", "write working copy", "write task dir", "write data dir", "write home", "append items",
                  "append stats", "append output.log", "read items", "read environ", "read cmdline", "read fd",
                  "read mem", "signal", "signal group", "ptrace")
"""What A tries on every victim (``<victim>:<action>`` in the report)."""
PY_ACTIONS = ("plant .pth", "plant in venv bin")
NODE_ACTIONS = ("plant node_modules file", "overwrite node_modules module")
AGENT_ACTIONS = ("read environ", "read cmdline", "read fd", "read mem", "signal", "ptrace", "read config",
                 "read state.db", "read node id", "read runtimes", "read state.db-wal", "read egress key", "list work dir", "list tasks",
                 "write work dir", "write tasks dir", "write envs")
"""What A tries on the agent (``agent:<action>``)."""


def action_keys(victims: dict[str, dict[str, Any]]) -> list[str]:
    """Every key A's report holds for ``victims`` (name → beacon)."""
    keys = []
    for who, beacon in sorted(victims.items()):
        keys += [f"{who}:{a}" for a in VICTIM_ACTIONS]
        keys += [f"{who}:{a}" for a in PY_ACTIONS] if "site" in beacon else []
        keys += [f"{who}:{a}" for a in NODE_ACTIONS] if "node_modules" in beacon else []
    return keys + [f"agent:{a}" for a in AGENT_ACTIONS]


def victim_py_files() -> dict[str, str]:
    """Spider B's package (a ``main.py``)."""
    return {"main.py": VICTIM_PY}


def victim_node_files() -> dict[str, str]:
    """Spider N's package: ``package.json`` naming :data:`VICTIM_DEP`, and ``index.js``."""
    manifest = {"name": "victim-node", "version": "1.0.0", "private": True, "main": "index.js",
                "dependencies": {VICTIM_DEP.name: VICTIM_DEP.version}}
    return {"package.json": json.dumps(manifest), "index.js": VICTIM_NODE}


def beacon_of(report_dir: Path, task_id: str) -> dict[str, Any] | None:
    """What the victim's task ``task_id`` said of itself, once it did (None before)."""
    path = report_dir / f"beacon-{task_id}.json"
    return json.loads(path.read_text()) if path.exists() else None


def attack_params(report_dir: Path, victims: dict[str, dict[str, Any]], *, agent_pid: int, work_dir: Path,
                  config: Path, gentle: bool) -> dict[str, Any]:
    """The attacker's ``params``: its targets (victim name → beacon), the agent, where to report."""
    return {"report": str(report_dir), "victims": victims, "agent_pid": agent_pid, "work_dir": str(work_dir),
            "config": str(config), "gentle": gentle}


def read_report(report_dir: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """``(A's uid, action → result)`` from A's report. Raises OSError when A wrote none."""
    data = json.loads((report_dir / "attack.json").read_text())
    return int(data["uid"]), data["report"]


def poisoned(report_dir: Path) -> list[str]:
    """The ``POISONED-*`` files a planted file left (each names the pid that ran it): [] when none ran."""
    return sorted(p.name for p in report_dir.glob("POISONED-*"))
