"""Field readers shared by the protocol types: each returns a typed value or raises ProtocolError.

``path`` is the JSON path of the enclosing object ("" for the top level); errors name
``path.key`` so a reader can find the field at once. Values are never echoed for fields marked
secret.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ckagent.master.ids import IdError, check_id

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

AGENT_SET_ENV = ("HOME", "PATH")
"""Variables the agent sets for every spider; a task's ``env`` naming one (or any ``CK_*``) is BAD_TASK."""


def agent_set_env(name: str) -> bool:
    """True for a variable the agent sets itself (``HOME``, ``PATH``, ``CK_*``), which a task may not override."""
    return name in AGENT_SET_ENV or name.startswith("CK_")


class ProtocolError(ValueError):
    """A payload breaks the protocol schema. ``field`` is the JSON path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field or '<body>'}: {message}")


def _name(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def req_object(obj: Any, path: str) -> dict[str, Any]:
    """``obj`` itself must be a JSON object."""
    if not isinstance(obj, dict):
        raise ProtocolError(path, f"expected an object, got {type(obj).__name__}")
    return obj


def req_id(o: dict[str, Any], key: str, *, path: str = "", secret: bool = False) -> str:
    """A required non-empty string; integers are accepted and turned into strings (ids of older backends)."""
    value = o.get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        if value is None or value == "":
            shown = "a missing or empty value"
        else:  # a secret's value is never shown, only its type
            shown = type(value).__name__ if secret else _describe(value)
        raise ProtocolError(_name(path, key), f"expected a non-empty string, got {shown}")
    return value


def master_id(o: dict[str, Any], key: str, *, path: str = "", required: bool = True) -> str | None:
    """An id chosen by the master (task, spider, node, code version, spider name), then
    :func:`ckagent.master.ids.check_id` — NUL, too long or not Unicode raises ProtocolError naming the field
    (the value is described, never echoed whole). ``required``: :func:`req_id` (integers become
    strings); otherwise a string, and absent, null or empty → None."""
    if not required:
        value = opt_str(o, key, path=path)
        if not value:
            return None
    else:
        value = req_id(o, key, path=path)
    try:
        return check_id(value)
    except IdError as exc:
        raise ProtocolError(_name(path, key), f"{exc} ({_describe(value)})") from None


def opt_str(o: dict[str, Any], key: str, *, path: str = "") -> str | None:
    """An optional string (absent or null → None)."""
    value = o.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError(_name(path, key), f"expected a string, got {_describe(value)}")
    return value


def opt_bool(o: dict[str, Any], key: str, *, path: str = "") -> bool | None:
    """An optional boolean (absent or null → None)."""
    value = o.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ProtocolError(_name(path, key), f"expected true or false, got {_describe(value)}")
    return value


def req_choice(o: dict[str, Any], key: str, choices: tuple[str, ...], *, path: str = "") -> str:
    """A required string out of ``choices``."""
    value = o.get(key)
    if value not in choices:
        raise ProtocolError(_name(path, key), f"expected one of {', '.join(choices)}, got {_describe(value)}")
    return str(value)


def _number(value: Any, name: str, lo: float | None, integer: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        raise ProtocolError(name, f"expected {kind}, got {_describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(name, "expected a finite number")
    if integer and isinstance(value, float):
        if not value.is_integer():
            raise ProtocolError(name, f"expected an integer, got {value!r}")
        value = int(value)
    if lo is not None and value < lo:
        raise ProtocolError(name, f"must be >= {lo}, got {value!r}")
    return value


def req_int(o: dict[str, Any], key: str, *, lo: int | None = None, hi: int | None = None, path: str = "") -> int:
    """A required integer in [lo, hi]."""
    name = _name(path, key)
    if key not in o:
        raise ProtocolError(name, "required")
    value = int(_number(o[key], name, lo, integer=True))
    if hi is not None and value > hi:
        raise ProtocolError(name, f"must be <= {hi}, got {value}")
    return value


def opt_int(o: dict[str, Any], key: str, *, lo: int | None = None, path: str = "") -> int | None:
    """An optional integer (absent or null → None)."""
    if o.get(key) is None:
        return None
    return int(_number(o[key], _name(path, key), lo, integer=True))


def req_number(o: dict[str, Any], key: str, *, lo: float | None = None, path: str = "") -> float:
    """A required finite number."""
    name = _name(path, key)
    if key not in o:
        raise ProtocolError(name, "required")
    return float(_number(o[key], name, lo, integer=False))


def opt_number(o: dict[str, Any], key: str, *, lo: float | None = None, path: str = "") -> float | None:
    """An optional finite number (absent or null → None)."""
    if o.get(key) is None:
        return None
    return float(_number(o[key], _name(path, key), lo, integer=False))


def opt_object(o: dict[str, Any], key: str, *, path: str = "") -> dict[str, Any] | None:
    """An optional JSON object (absent or null → None)."""
    value = o.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(_name(path, key), f"expected an object, got {_describe(value)}")
    return value


def str_list(
    o: dict[str, Any], key: str, *, path: str = "", ids: bool = False, required: bool = False
) -> list[str]:
    """An array of strings (absent or null → [] unless required). With ``ids``, integers become strings."""
    name = _name(path, key)
    value = o.get(key)
    if value is None:
        if required:
            raise ProtocolError(name, "required")
        return []
    if not isinstance(value, list):
        raise ProtocolError(name, f"expected an array of strings, got {_describe(value)}")
    out: list[str] = []
    for i, element in enumerate(value):
        if ids and isinstance(element, int) and not isinstance(element, bool):
            element = str(element)
        if not isinstance(element, str):
            raise ProtocolError(f"{name}[{i}]", f"expected a string, got {_describe(element)}")
        out.append(element)
    return out


def str_map(o: dict[str, Any], key: str, *, path: str = "", env_names: bool = False) -> dict[str, str]:
    """An object of string values (absent or null → {}). With ``env_names``, keys must be valid variable names."""
    name = _name(path, key)
    value = o.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        # a malformed env ("TOKEN=..." as a string) may still hold secrets: name the type only
        shown = type(value).__name__ if env_names else _describe(value)
        raise ProtocolError(name, f"expected an object of strings, got {shown}")
    for k, v in value.items():
        if env_names and not _ENV_NAME.match(k):
            raise ProtocolError(f"{name}.{k}", "not a valid environment variable name")
        if env_names and agent_set_env(k):
            raise ProtocolError(
                f"{name}.{k}",
                f"{k} is set by the agent for every spider (HOME: the spider's own home, PATH: its prepared "
                "environment first, CK_*: the task's files and ids) and a task may not override it; "
                "leave it out of env (pass your own setting under another name, or in params)")
        if not isinstance(v, str):
            # env values may be secrets: name the type, never the value
            shown = type(v).__name__ if env_names else _describe(v)
            raise ProtocolError(f"{name}.{k}", f"expected a string, got {shown}")
    return dict(value)


def req_master_id(o: dict[str, Any], key: str, path: str) -> str:
    """A required id chosen by the master (:func:`master_id` with ``required``). Raises ProtocolError."""
    value = master_id(o, key, path=path)
    assert value is not None
    return value


def drop_none(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without its ``None`` values (the protocol leaves unset fields out)."""
    return {k: v for k, v in obj.items() if v is not None}
