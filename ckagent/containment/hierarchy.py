"""Where this process sits in each cgroup hierarchy: from /proc/self/mountinfo and /proc/self/cgroup.

``own_dirs()`` maps ``"unified"`` (the cgroup v2 tree) and each mounted v1 controller name
(``memory``, ``pids``, ``cpu``, ``cpuacct``, ``freezer``, ``blkio``) to the directory of the
agent's own cgroup in that hierarchy (mount point + the agent's path below the mount's root).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ckagent.master.ids import MAX_NAME_CHARS, safe_name

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer", "blkio")

AGENT_LEAF = "ckagent-agent"
"""Name of the leaf cgroup a pure-v2 agent moves itself into (the no-internal-process rule)."""


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts(mountinfo: str) -> dict[str, tuple[Path, str]]:
    """{"unified" | controller: (mount point, mount root)} from /proc/self/mountinfo text."""
    found: dict[str, tuple[Path, str]] = {}
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point = _unescape(fields[3]), Path(_unescape(fields[4]))
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            found.setdefault("unified", (point, root))
        elif fstype == "cgroup":
            for name in V1_CONTROLLERS:
                if name in options:
                    found.setdefault(name, (point, root))
    return found


def memberships(proc_cgroup: str) -> dict[str, str]:
    """{"unified" | controller: path} from /proc/self/cgroup text."""
    found: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            found["unified"] = path
        else:
            for name in controllers.split(","):
                if name in V1_CONTROLLERS:
                    found[name] = path
    return found


def own_dirs(pid: str = "self") -> dict[str, Path]:
    """The directory of this process's cgroup in every mounted hierarchy (see module docstring)."""
    try:
        info = Path(f"/proc/{pid}/mountinfo").read_text()
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return {}
    where = mounts(info)
    dirs: dict[str, Path] = {}
    for name, path in memberships(cgroup).items():
        if name not in where:
            continue
        point, root = where[name]
        if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
            path = path[len(root):]
        elif root != "/":
            continue  # our cgroup is outside what is mounted here
        dirs[name] = point / path.lstrip("/")
    return dirs


def agent_group_name(work_dir: Path) -> str:
    """``ckagent-<10 hex>``: the directory holding one agent's task cgroups, named after its work dir
    (one agent per work dir; agents sharing a parent cgroup do not meet)."""
    return "ckagent-" + hashlib.sha256(str(work_dir).encode()).hexdigest()[:10]


def task_cgroup_name(task_id: str) -> str:
    """A cgroup directory name for a task id, bounded and collision-free: ``task-<id>`` with anything
    but letters, digits and ``._-`` escaped as ``%xx`` (as before, so a restarted agent finds its
    tasks' cgroups); an id that needs a wider escape or whose name would be longer than 100
    characters gets ``task-%-`` + :func:`ckagent.master.ids.safe_name` (``%-`` never occurs in an escape)."""
    if all(c.isalnum() or c in "._-" or ord(c) < 256 for c in task_id):
        safe = "".join(c if c.isalnum() or c in "._-" else f"%{ord(c):02x}" for c in task_id)
        if len(safe) <= MAX_NAME_CHARS:
            return "task-" + safe
    return "task-%-" + safe_name(task_id)
