"""Node version numbers and npm-style version ranges: pure functions, no I/O.

``parse_node_version("v20.1.0")`` → ``(20, 1, 0)``; ``satisfies((20, 11, 0), "^20.1")`` → True. Used to
pick a node for a spider's ``.nvmrc`` / ``engines.node`` (ckagent.code.deps) and to list nvm's versions
(ckagent.code.runtimes).
"""

from __future__ import annotations

import re

NodeVersion = tuple[int, int, int]
"""(major, minor, patch)."""


def parse_node_version(text: str) -> NodeVersion | None:
    """``"v20.1.0"``/``"20.1.0"`` → (20, 1, 0); missing parts are 0; None when it is not a version."""
    text = text.strip().lstrip("vV=")
    parts = text.split("-", 1)[0].split("+", 1)[0].split(".")
    if not parts or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    return (numbers[0], numbers[1], numbers[2])


_COMPARATOR = re.compile(r"^(>=|<=|>|<|=|\^|~>?|)\s*v?([0-9xX*]+(?:\.[0-9xX*]+){0,2})?(?:[-+][0-9A-Za-z.-]+)?$")


def _partial(text: str | None) -> list[int]:
    """The given numeric parts of a partial version (``"1.x"`` → [1]; ``"*"``/None → [])."""
    out: list[int] = []
    for part in (text or "").split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return out


def _bump(parts: list[int]) -> NodeVersion:
    """The first version above every version matching the partial ``parts`` (``[1, 2]`` → 1.3.0)."""
    p = parts[:]
    p[-1] += 1
    p += [0] * (3 - len(p))
    return (p[0], p[1], p[2])


def _full(parts: list[int]) -> NodeVersion:
    p = parts + [0] * (3 - len(parts))
    return (p[0], p[1], p[2])


Bound = tuple[NodeVersion | None, NodeVersion | None]  # [low, high): None = unbounded


def _comparator_bounds(op: str, parts: list[int]) -> Bound | None:
    if not parts:
        return (None, None) if op in ("", "=", ">=", "<=", "^", "~", "~>") else ((0, 0, 0), (0, 0, 0))
    if op in ("", "="):
        return (_full(parts), _bump(parts))
    if op == ">=":
        return (_full(parts), None)
    if op == ">":
        return (_bump(parts), None)
    if op == "<":
        return (None, _full(parts))
    if op == "<=":
        return (None, _bump(parts))
    if op in ("~", "~>"):
        return (_full(parts), _bump(parts[:2]) if len(parts) >= 2 else _bump(parts[:1]))
    if op == "^":
        full = _full(parts)
        if full[0] > 0 or len(parts) == 1:
            return (full, (full[0] + 1, 0, 0))
        if full[1] > 0 or len(parts) == 2:
            return (full, (0, full[1] + 1, 0))
        return (full, (0, 0, full[2] + 1))
    return None


def satisfies(version: NodeVersion, spec: str) -> bool | None:
    """Whether ``version`` matches an npm-style range (``>=18``, ``^20.1``, ``~18.2.0``, ``18.x``,
    ``16 || >=20``, ``>=18 <21``, ``18 - 20``) or an .nvmrc version (``20``, ``v20.1.0``).

    None when the spec cannot be interpreted (``lts/*``, ``node``, aliases): the caller must not warn.
    """
    spec = spec.strip()
    if spec.lower() in ("node", "latest", "stable", "current", "*", "x", ""):
        return True
    if spec.lower().startswith(("lts", "iojs")):
        return None
    for alternative in spec.split("||"):
        alternative = alternative.strip()
        hyphen = re.match(r"^(\S+)\s+-\s+(\S+)$", alternative)
        tokens = ([f">={hyphen.group(1)}", f"<={hyphen.group(2)}"] if hyphen
                  else re.sub(r"(>=|<=|>|<|=|\^|~>?)\s+", r"\1", alternative).split())
        ok = True
        for token in tokens or ["*"]:
            match = _COMPARATOR.match(token)
            if match is None:
                return None
            bounds = _comparator_bounds(match.group(1), _partial(match.group(2)))
            if bounds is None:
                return None
            low, high = bounds
            if (low is not None and version < low) or (high is not None and version >= high):
                ok = False
        if ok:
            return True
    return False
