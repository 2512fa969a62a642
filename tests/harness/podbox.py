"""A pod without a cluster: the agent started the way a Kubernetes pod starts it (config/k8s), in a box of
namespaces on this machine (issue 39).

A :class:`PodBox` is an agent process (:class:`harness.core.AgentProcess`: its config, its log, its
work dir) whose process is ``unshare`` making

- its own **PID namespace**: PID 1 is the image's entrypoint, ``python3 ckagent.pyz supervise -c CONFIG``
  (ckagent/pod/, the supervisor), which starts ``ckagent run -c CONFIG`` as its child and keeps it up;
  the box's ``/proc`` is its own; when PID 1 dies the kernel kills everything in the box;
- its own **mount namespace** (harness/podboxinit.py shapes it): every mount read-only — the root,
  ``/sys`` and the **cgroup** mounts (as a pod's: the agent cannot make a cgroup) — except its volumes,
  writable at the same paths as on the host: the work dir (``data``, an emptyDir), the home
  (``home``: HOME, where the pyz unpacks itself and uv keeps its cache) and ``/tmp`` (``tmp``, bound
  over /tmp); ``/run`` empty and read-only (an image's), ``/dev/shm`` a fresh tmpfs. Its mounts go with
  the namespace: nothing of them is left on the host (:func:`host_mounts` before and after);
- a **non-root uid** with **no capabilities** (``securityContext``: runAsUser 10001, drop ALL,
  allowPrivilegeEscalation false = no_new_privs): as root the box's first process switches to
  :data:`POD_UID` (no passwd entry, as in an image) with ``setpriv``; as a plain user the box is a user
  namespace mapping that user to itself (``--map-current-user --keep-caps``: the capabilities it needs
  for the mounts live only in that namespace) and every capability (bounding and inheritable sets; the
  ambient set follows) is dropped before PID 1 is exec'ed;
- the **host's network namespace** (a pod has its own: here the agent and its tasks reach the reference
  master, the test's sites and PyPI over the host's loopback and network; the ``agent`` egress group's
  registry is the box's own /tmp, as in a pod).

Variants (:data:`VARIANTS`), as the manifests: ``plain`` (config/k8s/base), ``net_admin``
(overlays/net-admin: root in the box with only :data:`NET_ADMIN_CAPS`, the cgroup read-only) and
``privileged`` (overlays/privileged: root with every capability, the cgroup mounts writable). :func:`box_cannot`
says why this machine (or user) cannot make one.

The agent's own files are the host's paths: the test reads the work dir, the log
(``<directory>/agent.log``: PID 1's stdout and stderr) and the master directly. :meth:`PodBox.exec_in` runs a
command inside the box's namespaces as the box's user (``nsenter``: ``kubectl exec``, a preStop
hook); :meth:`PodBox.prestop` is the manifests' ``ckagent stop --migrate -c CONFIG``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
import yaml

from ckagent.containment.egress.netlink import Netlink, NetlinkError
from ckagent.containment.egress.owners import table_owner
from ckagent.containment.hierarchy import agent_group_name, own_dirs
from harness.core import AgentProcess
from harness.demo import demo_environ

__all__ = ["POD_UID", "VARIANTS", "BoxRun", "PodBox", "box_cannot", "box_processes", "host_leftovers", "host_mounts", "run_box"]

VARIANTS = ("plain", "net_admin", "privileged")
POD_UID = 10001
"""The uid (and gid) the plain box's agent runs as when this process is root: config/k8s/base's
``runAsUser``/``runAsGroup`` (no passwd entry, as in the image)."""
NET_ADMIN_CAPS = ("net_admin", "setuid", "setgid", "chown", "fowner", "dac_override", "kill")
"""The capabilities config/k8s/overlays/net-admin adds (to root: Kubernetes sets no ambient capabilities,
so a capability added to a non-root container is of no use to it), every other one dropped."""
SYSTEM_PYTHON = Path("/usr/bin/python3")
"""The image's interpreter (config/Dockerfile: the pyz on the system's Python)."""
INIT = Path(__file__).with_name("podboxinit.py")
EXEC_TIMEOUT = 120.0
"""Seconds :meth:`PodBox.exec_in` lets a command run (then it is killed and the test fails)."""

_TOOLS = ("unshare", "nsenter", "setpriv")


def _tool(name: str) -> str | None:
    return shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")


def box_cannot(variant: str = "plain") -> str | None:
    """Why a box of ``variant`` cannot be made here (None: it can). As root every variant; as a plain user
    ``plain`` only (through a user namespace): ``CAP_NET_ADMIN`` in a user namespace does not reach the
    host's network namespace the box shares, and no user namespace makes a host's cgroup writable."""
    if variant not in VARIANTS:
        raise ValueError(f"no box variant {variant!r}: {VARIANTS}")
    missing = [name for name in _TOOLS if _tool(name) is None]
    if missing:
        return f"a pod box needs util-linux's {', '.join(missing)}"
    if not SYSTEM_PYTHON.is_file():
        return f"the box runs the pyz on {SYSTEM_PYTHON} (as the image does), which is missing"
    if os.geteuid() == 0:
        return None
    if variant != "plain":
        return (f"the {variant} variant needs root (uid {os.geteuid()} here): CAP_NET_ADMIN or root in a user "
                "namespace neither changes the host's network namespace the box shares nor writes its cgroups")
    probe = subprocess.run([_tool("unshare") or "unshare", "--user", "--map-current-user", "--pid", "--fork",
                            "--mount", "--mount-proc", "true"], capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        return f"this user may not make a user namespace: {probe.stderr.strip()[:200]}"
    return None


def host_mounts() -> list[str]:
    """This process's mount table (mount point and source of each, from /proc/self/mountinfo): what a box
    must leave unchanged."""
    with open("/proc/self/mountinfo") as fh:
        return sorted(" ".join(line.split()[3:5]) for line in fh)


def _ns_inode(pid: int) -> int | None:
    """The inode of ``pid``'s PID namespace; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return None
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except (OSError, IndexError):
        return None


def box_processes(pid1: int) -> list[int]:
    """The host pids of the live processes in the PID namespace whose PID 1 has host pid ``pid1`` ([]
    once it is gone). Blocking (reads /proc)."""
    inode = _ns_inode(pid1)
    if inode is None:
        return []
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and _ns_inode(int(p)) == inode)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [os.fsdecode(a) for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def ns_pid(pid: int) -> int | None:
    """The pid of host process ``pid`` inside its own (the box's) PID namespace, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except OSError:
        pass
    return None


def host_leftovers(work_dir: Path) -> list[str]:
    """What an agent with ``work_dir`` holds on the host outside a box's namespaces: its cgroup group
    (``ckagent-<hash>``) in each hierarchy of this process's cgroups (a box's are the same: the cgroup mounts
    are the host's) and its nftables table (``inet ckagent_<hash>``, in the host's network namespace the
    box shares). [] = nothing. Blocking."""
    group = agent_group_name(work_dir)
    found = [str(d / group) for d in own_dirs().values() if (d / group).is_dir()]
    try:
        netlink = Netlink()
    except NetlinkError:
        return found  # (no rights to nftables: there is none of ours either)
    try:
        tables = netlink.tables()
    except NetlinkError:
        return found  # (a plain user may not even list them: no agent of its made one)
    finally:
        netlink.close()
    # the box's agent names its table after its own mount namespace: found by the work dir its comment names
    found += [f"nft table inet {name}" for name, comment in tables
              if (owner := table_owner(comment)) is not None and owner[1] == str(work_dir)]
    return found


@dataclass
class BoxRun:
    """A command run to its end in a box or in a box's namespaces: exit code, stdout, stderr."""

    returncode: int
    stdout: str
    stderr: str


class PodBox(AgentProcess):
    """An agent in a pod box (module docstring) of ``variant``, laid out in ``directory``: ``agent.yaml``
    (read-only in the box, as a ConfigMap), ``agent.log``, ``bin/`` (the pyz and uv, read-only: the image),
    and the volumes ``data`` (task.work_dir), ``home`` and ``tmp``. ``settings`` as AgentProcess takes
    them. Blocking constructor (copies the pyz and uv)."""

    def __init__(self, directory: Path, base_url: str, registration_token: str, *, pyz: Path,
                 variant: str = "plain", live_port: int | None = None, **settings: Any) -> None:
        reason = box_cannot(variant)
        if reason is not None:
            raise RuntimeError(reason)
        directory.mkdir(parents=True, exist_ok=True)
        super().__init__(directory, base_url, registration_token,
                         **{"agent__ports_registry": None, "task__private_tmp_shared": "", **settings})
        config = yaml.safe_load(self.config_path.read_text())
        self.registration_token = config["agent"].pop("registration_token")
        self.config_path.write_text(yaml.safe_dump(config))  # (the token comes from a Secret: the environment)
        self.variant = variant
        self.live_port = live_port
        self.root_host = os.geteuid() == 0
        self.uid = (POD_UID if variant == "plain" else 0) if self.root_host else os.geteuid()
        self.gid = (POD_UID if variant == "plain" else 0) if self.root_host else os.getegid()
        self.bin = directory / "bin"
        self.home = directory / "home"
        self.tmp = directory / "tmp"
        self.pyz = self.bin / "ckagent.pyz"
        self._lay_out(pyz)

    def _lay_out(self, pyz: Path) -> None:
        self.bin.mkdir(exist_ok=True)
        shutil.copy(pyz, self.pyz)
        uv = Path(sys.executable).parent / "uv"
        uv = uv if uv.is_file() else Path(shutil.which("uv") or "/nonexistent/uv")
        if uv.is_file():
            shutil.copy(uv, self.bin / "uv")
        for volume in (self.work_dir, self.home, self.tmp):
            volume.mkdir(exist_ok=True)
            if self.root_host:
                os.chown(volume, self.uid, self.gid)
        self.tmp.chmod(0o1777)
        self.home.chmod(0o755)  # (the privileged box's spiders, other uids, read the SDK the pyz unpacks here)
        for path in (self.directory, self.bin, *self.bin.iterdir()):
            path.chmod(0o755)
        self.config_path.chmod(0o644)

    @property
    def work_dir(self) -> Path:
        """The agent's ``task.work_dir``: the box's ``data`` volume."""
        return self.directory / "data"

    # ------------------------------------------------------------------------------------ the commands

    def _drop(self) -> list[str]:
        """The ``setpriv`` prefix that makes a command the box's user with the variant's capabilities: none
        (plain: uid :data:`POD_UID` as root makes the box), :data:`NET_ADMIN_CAPS` for root (net_admin), all
        (privileged: nothing to drop). No privilege escalation (no_new_privs) but for privileged."""
        if self.variant == "privileged":
            return []
        caps = "-all" + "".join(f",+{cap}" for cap in NET_ADMIN_CAPS) if self.variant == "net_admin" else "-all"
        ids = [f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"] if self.root_host else []
        return [_tool("setpriv") or "setpriv", *ids, f"--inh-caps={caps}", f"--bounding-set={caps}",
                "--no-new-privs", "--"]

    def pid1_argv(self) -> list[str]:
        """The image's entrypoint: ``python3 ckagent.pyz supervise -c CONFIG [--live-port N]``."""
        live = ["--live-port", str(self.live_port)] if self.live_port is not None else []
        return [str(SYSTEM_PYTHON), str(self.pyz), "supervise", "-c", str(self.config_path), *live]

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of the box's processes: the machine's own (CA bundles, proxies, locale: as an image
        would set them) without the suite's, HOME the home volume, PATH the image's tools first."""
        return demo_environ(HOME=str(self.home), PATH=f"{self.bin}:/usr/bin:/bin", **(extra or {}))

    def unshare_argv(self, argv: Sequence[str]) -> list[str]:
        """``unshare`` making a box whose PID 1 execs ``argv`` (as the box's user)."""
        spec = {"volumes": [str(self.work_dir), str(self.home)], "read_only": [str(self.directory)], "tmp": str(self.tmp),
                "writable_cgroup": self.variant == "privileged", "argv": [*self._drop(), *argv]}
        user = [] if self.root_host else ["--user", "--map-current-user", "--keep-caps"]
        return [_tool("unshare") or "unshare", *user, "--pid", "--fork", "--mount", "--mount-proc",
                "--propagation", "private", "--kill-child", sys.executable, "-I", "-S", str(INIT), json.dumps(spec)]

    async def start(self, extra_env: dict[str, str] | None = None) -> None:
        """Make the box and its PID 1 (:meth:`pid1_argv`), the registration token in its environment (as the
        manifests give it from a Secret); returns at once (wait with ``wait_registered``)."""
        await self.start_argv(self.pid1_argv(), {"AGENT_REGISTRATION_TOKEN": self.registration_token, **(extra_env or {})})

    async def start_argv(self, argv: Sequence[str], extra_env: dict[str, str] | None = None) -> None:
        """Make the box with ``argv`` as its PID 1; its output to the log."""
        with self.log_path.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                self.unshare_argv(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env=self.environ(extra_env), cwd="/")

    # ----------------------------------------------------------------------------- the box's processes

    def pid1(self) -> int | None:
        """The host pid of the box's PID 1 (``unshare``'s child), None when there is none."""
        if self.process is None or self.process.returncode is not None:
            return None
        children = _children(self.process.pid)
        return children[0] if children else None

    def processes(self) -> list[int]:
        """Host pids of every live process in the box (blocking)."""
        pid1 = self.pid1()
        return box_processes(pid1) if pid1 is not None else []

    def agent_pid(self) -> int | None:
        """The host pid of the agent: PID 1's child running ``ckagent.pyz run`` (None while there is none)."""
        pid1 = self.pid1()
        for child in _children(pid1) if pid1 is not None else []:
            argv = _cmdline(child)
            if len(argv) > 2 and argv[1] == str(self.pyz) and argv[2] == "run":
                return child
        return None

    def terminate(self) -> None:
        """SIGTERM to PID 1, as the kubelet stops a container (after its preStop hook)."""
        pid1 = self.pid1()
        if pid1 is not None:
            os.kill(pid1, signal.SIGTERM)

    async def kill(self) -> None:
        """SIGKILL PID 1 (the kernel then kills everything in the box), let ``unshare`` reap it and exit (≤ 5
        s, else it is killed too) and reap ``unshare`` (idempotent)."""
        pid1 = self.pid1()
        if pid1 is not None and self.process is not None:
            os.kill(pid1, signal.SIGKILL)
            with trio.move_on_after(5):
                await self.process.wait()
        await super().kill()

    async def exec_in(self, argv: Sequence[str], timeout: float = EXEC_TIMEOUT) -> BoxRun:  # noqa: ASYNC109
        """Run ``argv`` in the box's PID and mount namespaces (and user namespace) as the box's user with its
        capabilities, as ``kubectl exec`` or a preStop hook does; returns its exit code and output.
        Raises AssertionError when the box has no PID 1, trio.TooSlowError after ``timeout`` seconds."""
        pid1 = self.pid1()
        assert pid1 is not None, "the box is not running"
        user = [] if self.root_host else ["--user", "--preserve-credentials"]
        command = [_tool("nsenter") or "nsenter", "-t", str(pid1), *user, "--pid", "--mount", "--",
                   *self._drop(), *argv]
        with trio.fail_after(timeout):
            done = await trio.run_process(command, stdin=subprocess.DEVNULL, capture_stdout=True,
                                          capture_stderr=True, check=False, env=self.environ(), cwd="/")
        return BoxRun(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))

    def ckagent(self, *args: str) -> list[str]:
        """``python3 ckagent.pyz ARGS...`` as the image runs it."""
        return [str(SYSTEM_PYTHON), str(self.pyz), *args]

    async def prestop(self, timeout: float = EXEC_TIMEOUT) -> BoxRun:  # noqa: ASYNC109
        """The manifests' preStop hook: ``ckagent stop --migrate -c CONFIG`` inside the box."""
        return await self.exec_in(self.ckagent("stop", "--migrate", "-c", str(self.config_path)), timeout)


async def run_box(box: PodBox, argv: Sequence[str], timeout: float = EXEC_TIMEOUT) -> BoxRun:  # noqa: ASYNC109
    """Make ``box`` with ``argv`` as its PID 1 and wait for its end (``timeout`` seconds, then
    trio.TooSlowError); returns its exit code and output (stdout and stderr both: the box's log)."""
    before = box.log_text()
    await box.start_argv(argv)
    async with box:
        with trio.fail_after(timeout):
            code = await box.wait()
    out = box.log_text()[len(before):]
    return BoxRun(code, out, "")
