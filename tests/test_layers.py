"""The package structure holds: layers only import downwards, no module circle, small modules, a short top.

The layers, lowest first (each package's docstring says what it owns and may import)::

    node → pod → master → containment → code → delivery → resume → task → port → agent / cli

``ckagent.devmaster`` (the reference master) is beside them: it may import node and master (the wire
protocol) only, and no agent module imports it but the command line. Imports are read from the source
with ``ast`` — function-level and ``TYPE_CHECKING`` imports included, so no circle can hide.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ckagent"

LAYERS = ["node", "pod", "master", "containment", "code", "delivery", "resume", "task", "port", "agent", "cli"]
"""Lowest first; a module may import its own package and any package before it."""

ALLOWED_EXTRA = {
    "devmaster": {"node", "master"},
    "cli": {"devmaster"},
}

MAX_TOP_ENTRIES = 14
"""The wings of design.md's house table, ``__init__``/``__main__`` and ``agent.py`` (issue 38 added ``resume``, issue 39 ``pod``)."""
MAX_LINES = 500

# Modules still over MAX_LINES while issue 26's splits land; each split removes its line. Empty at the end.
OVER_LIMIT: set[str] = set()


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        if "_sdk" in path.parts:
            continue
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """The agent modules ``module`` imports; ``from pkg import submodule`` counts as the submodule."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                names.append(full if full in MODULES else source)
        for name in names:
            if not name.startswith("ckagent"):
                continue
            target = _resolve(name)
            if target and target not in (module, "ckagent"):
                found.add(target)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    """Module → the ckagent modules it imports (every import, also inside functions). Built on first
    use, not at collection: every pytest-xdist worker collects this file, one runs these tests."""
    return {m: _imports(m, p) for m, p in MODULES.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ckagent"


def test_ckagent_top_level_has_at_most_fourteen_entries() -> None:
    entries = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))
    assert len(entries) <= MAX_TOP_ENTRIES, entries


def test_every_package_says_what_it_owns_and_may_import() -> None:
    for package in [*LAYERS, "devmaster"]:
        init = ROOT / package / "__init__.py"
        if package in ("agent",):
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init} has no docstring"
        if package not in ("cli", "devmaster"):
            assert "import" in doc, f"{init}'s docstring does not say what the package may import"


def test_imports_only_go_down_the_layers() -> None:
    upward = []
    for module, targets in graph().items():
        src = _package(module)
        if src == "ckagent" or src not in [*LAYERS, "devmaster"]:
            continue
        for target in targets:
            dst = _package(target)
            if dst == src or dst == "ckagent":
                continue
            if dst in ALLOWED_EXTRA.get(src, set()):
                continue
            if src == "devmaster" or dst == "devmaster" or LAYERS.index(dst) > LAYERS.index(src):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports up a layer:\n" + "\n".join(sorted(upward))


def test_no_module_circle_not_even_behind_a_function_level_import() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph()[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph():
        if v not in index:
            visit(v)
    assert not circles, circles


@pytest.mark.parametrize("path", sorted(MODULES.values()), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_over_five_hundred_lines(path: Path) -> None:
    shown = str(path.relative_to(ROOT.parent))
    lines = len(path.read_text().splitlines())
    if shown in OVER_LIMIT:
        assert lines > MAX_LINES, f"{shown} is {lines} lines now: take it off OVER_LIMIT"
        return
    assert lines <= MAX_LINES, f"{shown} has {lines} lines (at most {MAX_LINES}): it holds two concerns"
