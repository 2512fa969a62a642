"""The package's modules import each other without circles (a module graph read with ``ast``).

Every ``import``/``from … import`` of a ``ckagent`` module counts, at module level and inside
functions alike (a function-level import is still a dependency; hiding a circle in a function only
delays it), except those under ``if TYPE_CHECKING:`` (annotations only, never run). A package
counts as its ``__init__``; ``from ckagent.pkg import name`` depends on ``ckagent.pkg.name`` when that
is a module, else on ``ckagent.pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckagent

ROOT = Path(ckagent.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, package: str, modules: set[str]) -> set[str]:
    """Names of modules imported by ``tree`` (a module whose package is ``package``); ``modules``: the
    package's module names (to tell ``from pkg import submodule`` from ``from pkg import name``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                # A parent package is always imported first; that is not a dependency of the module.
                found.add(sub if sub in modules else module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """ckagent module → the ckagent modules it imports."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        wanted = _imports(ast.parse(path.read_text(encoding="utf-8")), package, set(paths))
        graph[name] = {m for m in wanted if m in paths and m != name and m != "ckagent"}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


def test_the_graph_sees_imports() -> None:
    graph = import_graph()
    assert "ckagent.task.supervisor" in graph["ckagent.agent"]
    assert "ckagent.delivery" in graph["ckagent.task.supervisor"]
    assert "ckagent.cli.runagent" in graph["ckagent.cli"]  # a function-level import counts
    assert "ckagent.agent" not in graph["ckagent.port.status"]  # so does nothing under TYPE_CHECKING


def test_the_cycle_finder_finds_a_circle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_inside_ckagent() -> None:
    assert find_cycles(import_graph()) == []


def test_the_agents_start_leaves_httpxs_command_line_client_out() -> None:
    """rich, click and pygments (httpx's own CLI, ~a fifth of the start-up imports) are not imported
    on the agent's path; ``httpx.main`` still imports and runs the real client when called."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ckagent.node.lazycli import defer_httpx_cli\n"
        "assert defer_httpx_cli()\n"
        "import ckagent.agent, httpx\n"
        "heavy = [m for m in ('rich', 'click', 'pygments') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "httpx.main(['--help'], standalone_mode=False)\n"
        "assert 'click' in sys.modules  # the real client ran\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "Usage" in done.stdout or "usage" in done.stdout.lower(), done.stdout
