"""The levels are types (ckagent.node.levels): what each says of itself, the text it keeps at every edge
(settings, wire, state store, metric labels, log lines), and why a level was passed over."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from ckagent.containment import ContainmentError, ContainmentLevel, available_levels, open_containment
from ckagent.containment.monitor import Handle
from ckagent.node.configschema import SETTINGS
from ckagent.node.levels import AUTO, Blocker, EgressLevel, Unavailable
from ckagent.port.metrics import AgentMetrics

HERE = available_levels(Path(tempfile.gettempdir()) / "ckagent-levels-probe")


def test_a_level_is_its_text_at_every_edge() -> None:
    assert [level.value for level in ContainmentLevel] == ["cgroup-v2", "cgroup-v1", "process-group"]
    assert [level.value for level in EgressLevel] == ["nftables", "proxy", "off"]
    for level in [*ContainmentLevel, *EgressLevel]:
        assert str(level) == f"{level}" == f"{level:s}" == level.value
        assert type(level).parse(level.value) is level
        assert json.dumps({"level": level.value}) == f'{{"level": "{level}"}}'
    assert f"[{EgressLevel.PROXY:>8}]" == "[   proxy]"
    with pytest.raises(ValueError, match="expected one of cgroup-v2, cgroup-v1, process-group"):
        ContainmentLevel.parse("cgroup-v3")
    assert EgressLevel("proxy") is EgressLevel.PROXY
    assert EgressLevel.PROXY != "proxy"  # a type, not a string: comparisons go through the type


def test_the_settings_choices_are_the_levels_text() -> None:
    rows = {row.key: row for row in SETTINGS if row.section == "task"}
    assert rows["containment"].type_doc == "auto, cgroup-v2, cgroup-v1, process-group"
    assert rows["egress"].type_doc == "auto, nftables, proxy, off"
    assert rows["containment"].default == rows["egress"].default == AUTO


def test_each_level_says_what_it_guarantees_and_needs() -> None:
    assert [level.has_cgroup for level in ContainmentLevel] == [True, True, False]
    assert [level.kernel_enforced for level in EgressLevel] == [True, False, False]
    assert [level.uses_proxy for level in EgressLevel] == [False, True, False]
    assert [level.has_policy for level in EgressLevel] == [True, True, False]
    for level in [*ContainmentLevel, *EgressLevel]:
        assert level.guarantees and level.needs
    assert "advisory" in EgressLevel.PROXY.guarantees
    assert "CAP_NET_ADMIN" in EgressLevel.NFTABLES.needs
    for blocker in Blocker:
        assert blocker.summary and blocker.remedy
    assert "Delegate=yes" in Blocker.CGROUP_NOT_WRITABLE.remedy
    assert "apt-get install nftables" in Blocker.NO_NFTABLES.remedy
    assert "NET_ADMIN" in Blocker.NO_NET_ADMIN.remedy
    line = Unavailable(EgressLevel.NFTABLES, Blocker.NO_NFTABLES, "libnftables cannot be loaded").describe()
    assert line.startswith("nftables: libnftables cannot be loaded; to get it: install the nftables package")


def test_the_stronger_levels_a_node_does_not_get_carry_why(tmp_path: Path) -> None:
    containment = open_containment("auto", tmp_path)
    try:
        stronger = list(ContainmentLevel)[:list(ContainmentLevel).index(containment.level)]
        assert {u.level for u in containment.passed_over} <= set(stronger)
        for unavailable in containment.passed_over:
            assert unavailable.blocker is not Blocker.SETTING and unavailable.message
    finally:
        containment.close()
    groups = open_containment(ContainmentLevel.PROCESS_GROUP, tmp_path)
    try:
        assert groups.level is ContainmentLevel.PROCESS_GROUP
        assert {(u.level, u.blocker) for u in groups.passed_over} == {
            (ContainmentLevel.CGROUP_V2, Blocker.SETTING), (ContainmentLevel.CGROUP_V1, Blocker.SETTING)}
        assert groups.to_json()["level"] == "process-group"
    finally:
        groups.close()


def test_an_unknown_or_missing_forced_level_fails_with_its_blocker(tmp_path: Path) -> None:
    with pytest.raises(ContainmentError, match=r"unknown level 'cgroup-v3'; expected auto or one of cgroup-v2, "):
        open_containment("cgroup-v3", tmp_path)
    missing = [level for level in ContainmentLevel if level not in HERE]
    for level in missing:
        with pytest.raises(ContainmentError, match=rf"task\.containment={level} is not available here") as raised:
            open_containment(level.value, tmp_path)
        assert raised.value.blocker is not Blocker.FAILED


def test_a_stored_handle_keeps_the_level_as_its_text() -> None:
    handle = Handle(1, 2, "boot", 3.0, "/s", None, "/w", 0.0, ContainmentLevel.CGROUP_V1, "")
    stored = json.loads(json.dumps(handle.to_json()))
    assert stored["level"] == "cgroup-v1"
    assert Handle.from_json(stored) == handle
    older = {**stored, "level": ""}
    assert Handle.from_json(older).level is None and Handle.from_json(older).to_json()["level"] == ""
    with pytest.raises(ValueError, match="wrong shape"):
        Handle.from_json({**stored, "level": "cgroup-v9"})


def test_the_metric_labels_are_the_levels_text(caplog: pytest.LogCaptureFixture) -> None:
    metrics = AgentMetrics("0", "node")
    metrics.containment_level(ContainmentLevel.CGROUP_V1)
    metrics.egress_level(EgressLevel.PROXY)
    text = generate_latest(metrics.registry).decode()
    assert 'ckagent_containment_level{level="cgroup-v1"} 1.0' in text
    assert 'ckagent_containment_level{level="process-group"} 0.0' in text
    assert 'ckagent_egress_level{level="proxy"} 1.0' in text
    assert 'ckagent_egress_level{level="nftables"} 0.0' in text
    with caplog.at_level(logging.INFO, logger="ckagent.containment"):
        open_containment("process-group", Path(tempfile.gettempdir())).close()
    assert "containment: process-group — process groups" in caplog.text


def test_the_operations_guide_has_a_row_for_each_level() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    egress = text[text.index("## Egress"):]
    for level in EgressLevel:
        assert f"\n| `{level}` | " in egress, level
    for level in ContainmentLevel:
        assert f"\n| `{level}` | " in text[text.index("## Containment"):text.index("## Egress")], level
    assert "### Which levels a node gets: `ckagent config check`" in egress
