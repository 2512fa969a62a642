"""ckagent.master.ids: which ids are accepted, and the one way each becomes a file name, a cgroup name or a URL."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import httpx
import pytest

from ckagent.containment.hierarchy import task_cgroup_name
from ckagent.master.ids import (
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    IdError,
    api_path,
    check_id,
    safe_name,
    shown_id,
    url_segment,
)
from ckagent.master.protocol import PendingTasks, ProtocolError

HOSTILE = ["../x", "../../../../etc/passwd", "/abs/dir/x", "%2e%2e%2fx", ".", "..", "...", ".hidden", "a\nb",
           "a/b", "a\\b", "q?x#y", "~", " ", "_x-0123456789", "_x-012345678", "爬虫", "\u1234", "\x1234",
           "x" * MAX_ID_CHARS, "x" * (MAX_ID_CHARS - 1) + "y", "ordinary-id_1.0", "%41", "A"]


@pytest.mark.parametrize("value", HOSTILE)
def test_safe_name_is_one_bounded_plain_component(value: str) -> None:
    name = safe_name(value)
    assert 0 < len(name) <= MAX_NAME_CHARS and name not in (".", "..") and not name.startswith(".")
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in name), name
    assert Path(name).name == name


def test_safe_name_keeps_ordinary_ids_and_never_collides() -> None:
    assert safe_name("1041") == "1041" and safe_name("spider-7.v2") == "spider-7.v2"
    names = {value: safe_name(value) for value in HOSTILE}
    assert len(set(names.values())) == len(HOSTILE)
    # An id that looks like another's hashed name is hashed itself.
    hashed = safe_name("a/b")
    assert hashed.startswith("_") and safe_name(hashed) != hashed


def test_cgroup_names_are_bounded_collision_free_and_unchanged_for_plain_ids() -> None:
    assert task_cgroup_name("abc-1.2") == "task-abc-1.2"
    assert task_cgroup_name("a/b") == "task-a%2fb"  # the escape of earlier versions
    names = [task_cgroup_name(v) for v in HOSTILE]
    assert all(len(n) <= 120 and "/" not in n and n not in (".", "..") for n in names)
    assert len(set(names)) == len(HOSTILE)
    assert task_cgroup_name("\u1234") != task_cgroup_name("\x1234")


@pytest.mark.parametrize("value", HOSTILE)
def test_url_segment_is_exactly_one_segment(value: str) -> None:
    url = httpx.URL("http://127.0.0.1/" + api_path("/api/tasks/{task}/result", task=value).lstrip("/"))
    parts = url.raw_path.decode().split("/")
    assert parts[:3] == ["", "api", "tasks"] and parts[-1] == "result" and len(parts) == 5, url.raw_path
    assert httpx.URL("http://h/").copy_with(raw_path=url.raw_path).raw_path == url.raw_path


def test_api_path_and_url_segment() -> None:
    assert url_segment("..") == "%2E%2E" and url_segment(".") == "%2E" and url_segment("a.b") == "a.b"
    assert api_path("/api/nodes/{node}/x/{task}", task="a/b") == "/api/nodes/{node}/x/a%2Fb"
    with pytest.raises(KeyError):
        api_path("/api/tasks", task="x")


@pytest.mark.parametrize(("value", "why"), [("", "empty"), ("a\x00b", "NUL"), ("x" * (MAX_ID_CHARS + 1), "513"),
                                            ("\ud800", "Unicode")])
def test_check_id_refuses_what_the_agent_cannot_carry(value: str, why: str) -> None:
    with pytest.raises(IdError, match=why):
        check_id(value)


def test_shown_id_never_makes_a_line_of_its_own() -> None:
    assert shown_id("abc") == "abc"
    assert "\n" not in shown_id("a\nb") and len(shown_id("x" * 5000)) <= 80


def _task(**fields: Any) -> dict[str, Any]:
    return {"id": "t1", "spiderId": "s1", "framework": "python", **fields}


@pytest.mark.parametrize(("field", "value"), list(itertools.product(
    ["id", "spiderId", "spiderName", "codeVersion"], ["a\x00b", "x" * 5000, "\ud800"])))
def test_a_refused_id_fails_its_task_alone(field: str, value: str) -> None:
    answer = PendingTasks.from_json({"tasks": [_task(**{"id": "bad", field: value}), _task(id="good")]})
    assert [t.id for t in answer.tasks] == ["good"]
    [bad] = answer.bad_tasks
    assert bad.error.field == f"tasks[0].{field}"
    assert bad.task_id == ("bad" if field != "id" else (None if value == "\ud800" else value))
    assert len(str(bad.error)) < 300  # the value is described, never echoed whole


def test_ids_with_path_syntax_are_accepted_as_data() -> None:
    answer = PendingTasks.from_json({"tasks": [_task(id="../x", spiderId="/abs", spiderName="a\nb", codeVersion="..")]})
    [task] = answer.tasks
    assert (task.id, task.spider_id, task.spider_name, task.code_version) == ("../x", "/abs", "a\nb", "..")
    empty = PendingTasks.from_json({"tasks": [_task(spiderName="", codeVersion="")]})
    assert (empty.tasks[0].spider_name, empty.tasks[0].code_version) == ("", None)
    with pytest.raises(ProtocolError):
        PendingTasks.from_json({"tasks": [_task(codeVersion=7)], "cancelTaskIds": 3})
