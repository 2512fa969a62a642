"""How much of the machine the agent may use, and the health figures it reports.

``max_workers`` follows one rule:

* set (``AGENT_MAX_WORKERS`` / ``agent.max_workers``, an integer >= 1): honoured as it is — also 1, and
  also above 8 (a big node running light spiders may want 64 slots). When it exceeds what the
  node's CPU and memory suggest (:func:`suggested_ceiling`: 4 slots per core, one per 256 MiB), one
  WARNING line says so, and the value is still used;
* unset: the node's cores, from the first that applies — ``CONTAINER_CPU_LIMIT`` /
  ``agent.container_cpu_limit`` ("2000m" = 2, "4" = 4, "1.5" → 2: fractions round up), the cgroup CPU
  quota (v2 ``cpu.max``; v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, rounded up), the CPU
  count — then ``min(cores, 8)`` and at least 2 (as crawlerkeeper-agent does).

psutil does not know about cgroups, hence the explicit reads here.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

MIN_WORKERS = 2
MAX_WORKERS = 8
CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_limit(text: str) -> float:
    """Parse a Kubernetes CPU quantity ("2000m", "4", "1.5") into cores. Raises ValueError."""
    value = text.strip()
    try:
        cores = float(value[:-1]) / 1000 if value.endswith("m") else float(value)
    except ValueError:
        raise ValueError(f"not a CPU quantity: {text!r} (expected e.g. '2000m', '4' or '1.5')") from None
    if not math.isfinite(cores) or cores <= 0:
        raise ValueError(f"CPU quantity must be positive: {text!r}")
    return cores


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """Cores allowed by the cgroup CPU quota, or None when unlimited / not in a cgroup.

    Reads cgroup v2 ``<root>/cpu.max`` ("max 100000" or "200000 100000"), else v1
    ``<root>/cpu/cpu.cfs_quota_us`` (or ``cpu,cpuacct/``) with its period (-1 = unlimited).
    """
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) >= 1 and parts[0] != "max":
            try:
                quota = float(parts[0])
                period = float(parts[1]) if len(parts) > 1 else 100000.0
            except ValueError:
                return None
            return quota / period if quota > 0 and period > 0 else None
        return None
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quota_text = _read(root / sub / "cpu.cfs_quota_us")
        period_text = _read(root / sub / "cpu.cfs_period_us")
        if quota_text is None or period_text is None:
            continue
        try:
            quota, period = float(quota_text), float(period_text)
        except ValueError:
            return None
        return quota / period if quota > 0 and period > 0 else None
    return None


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes allowed by the cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), or None."""
    v2 = _read(root / "memory.max")
    if v2 is not None:
        return None if v2 == "max" else _positive_int(v2)
    v1 = _read(root / "memory" / "memory.limit_in_bytes")
    if v1 is None:
        return None
    limit = _positive_int(v1)
    # v1 reports "unlimited" as a huge page-rounded number near 2**63.
    return None if limit is None or limit >= 1 << 60 else limit


def cgroup_memory_usage(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the cgroup uses now (v2 ``memory.current``, v1 ``memory.usage_in_bytes``), or None."""
    text = _read(root / "memory.current") or _read(root / "memory" / "memory.usage_in_bytes")
    return None if text is None else _positive_int(text)


def _positive_int(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


SLOTS_PER_CORE = 4
"""Slots per core a node can be expected to carry with light (I/O-bound) spiders."""
MEMORY_PER_SLOT_BYTES = 256 * 1024**2
"""Memory one light spider needs at least (bytes)."""


def node_cores(container_cpu_limit: str | None, *, cgroup_root: Path = CGROUP_ROOT,
               cpu_count: int | None = None) -> int:
    """Whole cores this node may use: the container limit, else the cgroup quota, else the CPU count
    (fractions round up; at least 1). Raises ValueError for a bad container CPU limit."""
    if container_cpu_limit:
        return max(1, math.ceil(parse_cpu_limit(container_cpu_limit)))
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        return max(1, math.ceil(quota))
    return max(1, cpu_count if cpu_count is not None else (os.cpu_count() or 1))


def suggested_ceiling(cores: int, memory_bytes: int) -> int:
    """The most slots ``cores`` and ``memory_bytes`` (the cgroup limit, else the RAM) suggest: the
    smaller of SLOTS_PER_CORE per core and one per MEMORY_PER_SLOT_BYTES; at least MIN_WORKERS."""
    return max(MIN_WORKERS, min(cores * SLOTS_PER_CORE, memory_bytes // MEMORY_PER_SLOT_BYTES))


def compute_max_workers(
    configured: int | None,
    container_cpu_limit: str | None,
    *,
    cgroup_root: Path = CGROUP_ROOT,
    cpu_count: int | None = None,
    memory_bytes: int | None = None,
) -> int:
    """Apply the module's rule. ``configured`` is agent.max_workers (None = unset); ``memory_bytes``
    None = the cgroup memory limit, else the RAM. Raises ValueError for a bad CPU limit."""
    cores = node_cores(container_cpu_limit, cgroup_root=cgroup_root, cpu_count=cpu_count)
    if configured is None:
        return max(min(cores, MAX_WORKERS), MIN_WORKERS)
    if memory_bytes is None:
        memory_bytes = cgroup_memory_limit(cgroup_root) or psutil.virtual_memory().total
    ceiling = suggested_ceiling(cores, memory_bytes)
    if configured > ceiling:
        log.warning("agent.max_workers (AGENT_MAX_WORKERS) %d is more than this node's %d core(s) and "
                    "%d MiB suggest (%d); using %d as configured — lower it if tasks starve each other",
                    configured, cores, memory_bytes // 1024**2, ceiling, configured)
    return configured


@dataclass(frozen=True)
class HealthSample:
    """One reading of the node's health. Percentages 0..100, sizes in bytes."""

    cpu_percent: float
    memory_percent: float
    memory_used_bytes: int
    disk_percent: float
    disk_free_bytes: int
    load1: float


class HealthSampler:
    """Reads CPU, memory, disk and load without ever blocking on an interval.

    CPU is primed at construction (``psutil.cpu_percent(None)``) and then read with ``None``: each
    sample is the average since the previous one. Memory is relative to the cgroup limit when there
    is one. ``sample()`` does file I/O: call it through ``trio.to_thread``.
    """

    def __init__(self, disk_path: Path, cgroup_root: Path = CGROUP_ROOT) -> None:
        self._disk_path = disk_path
        self._cgroup_root = cgroup_root
        psutil.cpu_percent(None)
        self.started = time.monotonic()
        self._last = HealthSample(0.0, 0.0, 0, 0.0, 0, 0.0)
        self._warned: set[str] = set()

    def sample(self) -> HealthSample:
        """Take one reading (blocking file reads; no sleeping). Never raises for the node's files: a
        reading that fails (the process out of descriptors, /proc unreadable) gives the last good one
        (zeros before the first), and a warning once per kind of failure."""
        try:
            self._last = self._read()
        except (OSError, psutil.Error) as exc:
            kind = type(exc).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("health sample failed (%s); the heartbeat carries the last good one", exc)
        return self._last

    def _read(self) -> HealthSample:
        cpu = psutil.cpu_percent(None)
        vm = psutil.virtual_memory()
        limit = cgroup_memory_limit(self._cgroup_root)
        usage = cgroup_memory_usage(self._cgroup_root) if limit else None
        if limit and usage is not None:
            used, mem_percent = usage, min(100.0, usage * 100.0 / limit)
        else:
            used, mem_percent = int(vm.total - vm.available), float(vm.percent)
        path = self._disk_path
        while not path.exists() and path != path.parent:
            path = path.parent
        disk = shutil.disk_usage(path)
        load1 = os.getloadavg()[0]
        return HealthSample(
            cpu_percent=round(cpu, 1),
            memory_percent=round(mem_percent, 1),
            memory_used_bytes=used,
            disk_percent=round(disk.used * 100.0 / disk.total, 1) if disk.total else 0.0,
            disk_free_bytes=disk.free,
            load1=round(load1, 2),
        )
