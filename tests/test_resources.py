"""The concurrency rule (max_workers) and the cgroup readers, against fake cgroup trees in tmp_path."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from ckagent.node.config import load_settings
from ckagent.node.resources import (
    HealthSampler,
    cgroup_cpu_quota,
    cgroup_memory_limit,
    cgroup_memory_usage,
    compute_max_workers,
    parse_cpu_limit,
)

GIB = 1024**3
MIB = 1024**2


def tree(root: Path, files: dict[str, str]) -> Path:
    """A fake cgroup mount: ``files`` maps a path under ``root`` to its content."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


@pytest.fixture
def empty_cgroup(tmp_path: Path) -> Path:
    """A cgroup root with nothing in it: no quota, no memory limit (bare metal)."""
    return tree(tmp_path / "nocgroup", {})


# ---------------------------------------------------------------------------- 1. AGENT_MAX_WORKERS


@pytest.mark.parametrize("configured", [1, 2, 5, 8, 9, 24])
def test_configured_max_workers_is_honoured_as_set(configured: int, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # A cgroup quota, a container limit and many CPUs are all there: the configured value still wins,
    # also 1 and also above 8; within 4 per core (6 cores) and one per 256 MiB (8 GiB) no warning.
    root = tree(tmp_path / "cg", {"cpu.max": "300000 100000"})
    with caplog.at_level("WARNING"):
        assert compute_max_workers(configured, "6", cgroup_root=root, cpu_count=32, memory_bytes=8 * GIB) == configured
    assert not caplog.records


@pytest.mark.parametrize(("cores", "memory", "configured"), [("2", 64 * GIB, 9), ("64", 1 * GIB, 5), ("1", 1 * GIB, 64)])
def test_max_workers_above_what_cpu_and_memory_suggest_is_used_with_one_warning(
    cores: str, memory: int, configured: int, empty_cgroup: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        assert compute_max_workers(configured, cores, cgroup_root=empty_cgroup, memory_bytes=memory) == configured
    [record] = caplog.records
    assert f"agent.max_workers (AGENT_MAX_WORKERS) {configured} is more than" in record.getMessage()
    assert f"using {configured} as configured" in record.getMessage()


def test_max_workers_reads_the_cgroup_memory_limit_for_its_warning(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # 16 cores would carry 64 slots, but the cgroup allows 1 GiB: 4 slots.
    root = tree(tmp_path / "cg", {"cpu.max": "1600000 100000", "memory.max": str(GIB)})
    with caplog.at_level("WARNING"):
        assert compute_max_workers(8, None, cgroup_root=root, cpu_count=32) == 8
    assert "1024 MiB suggest (4)" in caplog.text


def test_unset_max_workers_is_min_of_cores_and_8_and_at_least_2(empty_cgroup: Path) -> None:
    assert [compute_max_workers(None, None, cgroup_root=empty_cgroup, cpu_count=n) for n in (1, 2, 5, 8, 64)] == [
        2, 2, 5, 8, 8]


# ---------------------------------------------------------------------------- 2. CONTAINER_CPU_LIMIT


@pytest.mark.parametrize(
    ("limit", "expected"),
    [("2000m", 2), ("4", 4), ("1.5", 2), ("500m", 2), ("16", 8), ("2500m", 3), ("3.01", 4), (" 3 ", 3)],
)
def test_container_cpu_limit(limit: str, expected: int, tmp_path: Path) -> None:
    # The container limit beats the cgroup quota (6 cores here) and the CPU count.
    root = tree(tmp_path / "cg", {"cpu.max": "600000 100000"})
    assert compute_max_workers(None, limit, cgroup_root=root, cpu_count=32) == expected


@pytest.mark.parametrize("limit", ["abc", "0", "-2", "m", "nan", "inf", "0m"])
def test_bad_container_cpu_limit_is_an_error_naming_it(limit: str, empty_cgroup: Path) -> None:
    with pytest.raises(ValueError, match="CPU quantity"):
        compute_max_workers(None, limit, cgroup_root=empty_cgroup, cpu_count=4)


def test_parse_cpu_limit_gives_cores() -> None:
    assert parse_cpu_limit("2000m") == 2.0
    assert parse_cpu_limit("250m") == 0.25
    assert parse_cpu_limit("1.5") == 1.5


# ---------------------------------------------------------------------------- 3. cgroup quota


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 2), ("350000 100000", 4),
     ("1600000 100000", 8), ("400000 200000", 2)],
)
def test_cgroup_v2_quota(cpu_max: str, expected: int, tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"cpu.max": cpu_max})
    assert compute_max_workers(None, None, cgroup_root=root, cpu_count=32) == expected


def test_cgroup_v2_unlimited_falls_through_to_cpu_count(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"cpu.max": "max 100000"})
    assert cgroup_cpu_quota(root) is None
    assert compute_max_workers(None, None, cgroup_root=root, cpu_count=5) == 5
    assert compute_max_workers(None, None, cgroup_root=root, cpu_count=1) == 2


@pytest.mark.parametrize("subdir", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota_and_period(subdir: str, tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {f"{subdir}/cpu.cfs_quota_us": "300000", f"{subdir}/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(root) == 3.0
    assert compute_max_workers(None, None, cgroup_root=root, cpu_count=32) == 3


def test_cgroup_v1_fractional_quota_rounds_up(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"cpu/cpu.cfs_quota_us": "250000", "cpu/cpu.cfs_period_us": "100000"})
    assert compute_max_workers(None, None, cgroup_root=root, cpu_count=32) == 3


def test_cgroup_v1_unlimited_falls_through_to_cpu_count(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(root) is None
    assert compute_max_workers(None, None, cgroup_root=root, cpu_count=6) == 6


def test_unreadable_quota_falls_through(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"cpu.max": "garbage here"})
    assert cgroup_cpu_quota(root) is None
    assert compute_max_workers(None, None, cgroup_root=root, cpu_count=3) == 3


# ---------------------------------------------------------------------------- 4. cpu_count


@pytest.mark.parametrize(("count", "expected"), [(1, 2), (2, 2), (3, 3), (8, 8), (64, 8)])
def test_cpu_count_fallback_is_min_n_8_never_below_2(count: int, expected: int, empty_cgroup: Path) -> None:
    assert compute_max_workers(None, None, cgroup_root=empty_cgroup, cpu_count=count) == expected


def test_machine_cpu_count_is_used_when_not_given(empty_cgroup: Path) -> None:
    import os

    expected = max(min(os.cpu_count() or 1, 8), 2)
    assert compute_max_workers(None, None, cgroup_root=empty_cgroup) == expected


# ---------------------------------------------------------------------------- from the environment


def _settings(tmp_path: Path, **env: str):  # type: ignore[no-untyped-def]
    values = {"AGENT_SERVER_URL": "http://127.0.0.1:1", "AGENT_REGISTRATION_TOKEN": "t" * 16,
              "AGENT_WORK_DIR": str(tmp_path / "work"), **env}
    return load_settings(None, env=values, require_token=True)


def test_environment_variables_feed_the_rule(tmp_path: Path, empty_cgroup: Path) -> None:
    both = _settings(tmp_path, AGENT_MAX_WORKERS="20", CONTAINER_CPU_LIMIT="3")
    assert compute_max_workers(both.agent.max_workers, both.agent.container_cpu_limit,
                               cgroup_root=empty_cgroup, cpu_count=1) == 20
    limit_only = _settings(tmp_path, CONTAINER_CPU_LIMIT="2500m")
    assert compute_max_workers(limit_only.agent.max_workers, limit_only.agent.container_cpu_limit,
                               cgroup_root=empty_cgroup, cpu_count=1) == 3
    one = _settings(tmp_path, AGENT_MAX_WORKERS="1")
    assert compute_max_workers(one.agent.max_workers, one.agent.container_cpu_limit,
                               cgroup_root=empty_cgroup, cpu_count=1) == 1


# ---------------------------------------------------------------------------- memory


def test_memory_limit_v2(tmp_path: Path) -> None:
    assert cgroup_memory_limit(tree(tmp_path / "a", {"memory.max": str(GIB)})) == GIB
    assert cgroup_memory_limit(tree(tmp_path / "b", {"memory.max": "max"})) is None


def test_memory_limit_v1(tmp_path: Path) -> None:
    limited = tree(tmp_path / "a", {"memory/memory.limit_in_bytes": str(512 * MIB)})
    assert cgroup_memory_limit(limited) == 512 * MIB
    # v1 says "unlimited" with a huge page-rounded number.
    unlimited = tree(tmp_path / "b", {"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_memory_limit(unlimited) is None


def test_memory_readers_outside_a_cgroup(empty_cgroup: Path) -> None:
    assert cgroup_memory_limit(empty_cgroup) is None
    assert cgroup_memory_usage(empty_cgroup) is None


def test_memory_usage_v2_and_v1(tmp_path: Path) -> None:
    assert cgroup_memory_usage(tree(tmp_path / "a", {"memory.current": str(300 * MIB)})) == 300 * MIB
    v1 = tree(tmp_path / "b", {"memory/memory.usage_in_bytes": str(200 * MIB)})
    assert cgroup_memory_usage(v1) == 200 * MIB


def test_health_sampler_memory_is_relative_to_the_cgroup_limit(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"memory.max": str(GIB), "memory.current": str(256 * MIB)})
    sample = HealthSampler(tmp_path / "does" / "not" / "exist", cgroup_root=root).sample()
    assert sample.memory_percent == 25.0
    assert sample.memory_used_bytes == 256 * MIB
    assert 0.0 <= sample.cpu_percent <= 100.0 * (psutil.cpu_count() or 1)
    assert 0.0 < sample.disk_percent <= 100.0 and sample.disk_free_bytes > 0


def test_health_sampler_v1_limit(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {"memory/memory.limit_in_bytes": str(400 * MIB),
                                  "memory/memory.usage_in_bytes": str(100 * MIB)})
    sample = HealthSampler(tmp_path, cgroup_root=root).sample()
    assert sample.memory_percent == 25.0
    assert sample.memory_used_bytes == 100 * MIB


def test_health_sampler_without_limit_uses_the_machine(tmp_path: Path) -> None:
    # "max" = no limit: the figure is the machine's, not usage / some bogus limit.
    root = tree(tmp_path / "cg", {"memory.max": "max", "memory.current": str(10 * MIB)})
    sample = HealthSampler(tmp_path, cgroup_root=root).sample()
    vm = psutil.virtual_memory()
    assert sample.memory_used_bytes != 10 * MIB
    assert abs(sample.memory_used_bytes - (vm.total - vm.available)) < vm.total * 0.2
    assert abs(sample.memory_percent - vm.percent) < 20.0
