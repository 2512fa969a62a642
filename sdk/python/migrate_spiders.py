#!/usr/bin/env python3
"""Move spider projects from a vendored copy of the SDK to the ``crawlerkeeper-sdk`` package.

Older spider projects carried a copy of ``crawlerkeeper_sdk`` in their own tree (for example
``myproject/vendor/crawlerkeeper_sdk/`` or a single ``crawlerkeeper_sdk.py``). This script, for each
project directory given:

1. finds the vendored copies (a ``crawlerkeeper_sdk`` package or module that looks like the SDK;
   virtualenvs, ``node_modules``, ``.git``, build output are skipped);
2. rewrites the project's Python files to import the package instead: dotted paths such as
   ``myproject.vendor.crawlerkeeper_sdk`` (imports, attribute use, and strings like Scrapy's
   ``ITEM_PIPELINES`` keys) and relative imports such as ``from ..vendor.crawlerkeeper_sdk import x``
   become ``crawlerkeeper_sdk``;
3. adds the dependency where the agent installs from: ``[project] dependencies`` of pyproject.toml
   when it has that table, ``[tool.poetry.dependencies]`` for Poetry, else requirements.txt (created
   if missing) — unless the project already depends on crawlerkeeper-sdk;
4. removes the vendored copies.

``--dry-run`` prints the same plan (with diffs) and changes nothing. Running it again on a migrated
project finds nothing to do. Warnings (printed, exit code unchanged): a vendored copy that defines
names the package does not have (a local fork: check them), a ``uv.lock`` that needs ``uv lock``.

Usage::

    python migrate_spiders.py [--dry-run] [--requirement SPEC] PROJECT_DIR [PROJECT_DIR ...]

Exit codes: 0 done (or nothing to do), 1 a project could not be migrated (others still are), 2 usage.
Needs only the standard library (Python 3.8+).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

PACKAGE = "crawlerkeeper_sdk"
DISTRIBUTION = "crawlerkeeper-sdk"
SKIP_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "env", ".env", "node_modules", "__pycache__", "site-packages",
             "build", "dist", ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
_SDK_MARKERS = ("CK_ITEMS_FILE", "save_item")
_HERE = Path(__file__).resolve().parent
_INSTALLED_SDK = _HERE / "src" / PACKAGE / "__init__.py"


class MigrationError(Exception):
    """A project cannot be migrated; the message says why."""


def default_requirement() -> str:
    """``crawlerkeeper-sdk>=X.Y,<NEXT`` from the SDK next to this script, else ``>=0.1,<1``."""
    version = "0.1.0"
    if _INSTALLED_SDK.is_file():
        match = re.search(r'^__version__ = "(\d+)\.(\d+)', _INSTALLED_SDK.read_text(encoding="utf-8"), re.M)
        if match:
            version = f"{match.group(1)}.{match.group(2)}"
    major, minor = (int(x) for x in version.split(".")[:2])
    return f"{DISTRIBUTION}>={major}.{minor},<{major + 1}"


def _walk(root: Path) -> List[Path]:
    """Files and dirs under ``root`` (sorted), not descending into SKIP_DIRS or egg-info dirs."""
    found: List[Path] = []
    stack = [root]
    while stack:
        current = stack.pop()
        for entry in sorted(current.iterdir(), reverse=True):
            if entry.is_dir() and not entry.is_symlink():
                if entry.name in SKIP_DIRS or entry.name.endswith(".egg-info"):
                    continue
                stack.append(entry)
            found.append(entry)
    return sorted(found)


def find_vendored(root: Path) -> List[Path]:
    """Vendored SDK copies under ``root``: ``crawlerkeeper_sdk/`` packages and ``crawlerkeeper_sdk.py`` modules."""
    copies = []
    for path in _walk(root):
        if path.is_dir() and path.name == PACKAGE and (path / "__init__.py").is_file():
            text = (path / "__init__.py").read_text(encoding="utf-8", errors="replace")
        elif path.is_file() and path.name == f"{PACKAGE}.py":
            text = path.read_text(encoding="utf-8", errors="replace")
        else:
            continue
        if any(marker in text for marker in _SDK_MARKERS) and not any(c in path.parents for c in copies):
            copies.append(path)
    return copies


def dotted_name(root: Path, copy: Path) -> str:
    """The import path of a vendored copy relative to the project root (``a.b.crawlerkeeper_sdk``)."""
    parts = list(copy.relative_to(root).parts)
    parts[-1] = PACKAGE
    return ".".join(parts)


def extra_names(copy: Path) -> List[str]:
    """Public top-level names the vendored copy defines that the packaged SDK does not."""
    init = copy / "__init__.py" if copy.is_dir() else copy
    if not _INSTALLED_SDK.is_file():
        return []

    def names(path: Path) -> Set[str]:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        result: Set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                result.add(node.name)
            elif isinstance(node, ast.Assign):
                result.update(t.id for t in node.targets if isinstance(t, ast.Name))
        return {n for n in result if not n.startswith("_")}

    try:
        return sorted(names(init) - names(_INSTALLED_SDK))
    except SyntaxError:
        return []


def _module_of(root: Path, path: Path) -> List[str]:
    """The package parts a file belongs to (its directory, relative to the project root)."""
    return list(path.parent.relative_to(root).parts)


def rewrite_source(text: str, package: List[str], vendored: List[str]) -> str:
    """``text`` with imports/uses of the vendored copies (dotted names in ``vendored``) pointed at the package.

    ``package`` is the file's package path (for relative imports). Raises SyntaxError if the file does
    not parse.
    """
    prefixes = [v for v in vendored if v != PACKAGE]
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if node.level - 1 > len(package):
                continue
            base = package[: len(package) - (node.level - 1)]
            full = ".".join(base + ([node.module] if node.module else []))
        else:
            full = node.module or ""
        line = lines[node.lineno - 1]
        for prefix in vendored:
            if node.level and (full == prefix or full.startswith(prefix + ".")):
                # from ..vendor.crawlerkeeper_sdk[.scrapy] import x  →  from crawlerkeeper_sdk[.scrapy] import x
                rest = full[len(prefix):]
                lines[node.lineno - 1] = re.sub(r"from\s+\.+[\w.]*", f"from {PACKAGE}{rest}", line, count=1)
                break
            if len(node.names) == 1 and f"{full}.{node.names[0].name}" == prefix and node.end_lineno == node.lineno:
                # from .vendor import crawlerkeeper_sdk [as ck]  →  import crawlerkeeper_sdk [as ck]
                alias = node.names[0].asname
                indent = line[: len(line) - len(line.lstrip())]
                lines[node.lineno - 1] = f"{indent}import {PACKAGE}{f' as {alias}' if alias else ''}\n"
                break
    text = "".join(lines)
    for prefix in sorted(prefixes, key=len, reverse=True):
        text = re.sub(r"(?<![\w.])" + re.escape(prefix) + r"(?![\w])", PACKAGE, text)
    return text


def _already_depends(text: str) -> bool:
    return re.search(r"(?i)(^|[\"'\s])crawlerkeeper[-_]sdk\b", text, re.M) is not None


def add_dependency(root: Path, requirement: str) -> Tuple[Optional[Path], Optional[str], Optional[str]]:
    """(file, old text or None when created, new text) for adding ``requirement``; (None, None, None) if present."""
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        text = pyproject.read_text(encoding="utf-8")
        if _already_depends(text):
            return None, None, None
        project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        if project:
            section = project.group(1)
            deps = re.search(r"^dependencies\s*=\s*\[", section, re.M)
            start = project.start(1)
            if deps:
                at = start + deps.end()
                closing = text.index("]", at)
                inner = text[at:closing]
                if inner.strip():
                    indent = re.search(r"\n([ \t]+)\S", inner)
                    pad = indent.group(1) if indent else "    "
                    item = f'\n{pad}"{requirement}",' if "\n" in inner else f'"{requirement}", '
                    new = text[:at] + item + text[at:]
                else:
                    new = text[:at] + f'"{requirement}"' + text[closing:]
            else:
                new = text[:start] + f'\ndependencies = ["{requirement}"]' + text[start:]
            return pyproject, text, new
        poetry = re.search(r"^\[tool\.poetry\.dependencies\]\s*$", text, re.M)
        if poetry:
            spec = requirement[len(DISTRIBUTION):]
            new = text[: poetry.end()] + f'\n{DISTRIBUTION} = "{spec}"' + text[poetry.end():]
            return pyproject, text, new
    requirements = root / "requirements.txt"
    if requirements.is_file():
        text = requirements.read_text(encoding="utf-8")
        if _already_depends(text):
            return None, None, None
        return requirements, text, text + ("" if text.endswith("\n") or not text else "\n") + requirement + "\n"
    return requirements, None, requirement + "\n"


def _diff(path: Path, old: Optional[str], new: str, root: Path) -> str:
    name = str(path.relative_to(root))
    return "".join(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                        f"a/{name}" if old is not None else "/dev/null", f"b/{name}"))


def migrate(root: Path, requirement: str, dry_run: bool) -> List[str]:
    """Migrate one project; returns the lines of its report. Raises MigrationError (nothing changed then)."""
    if not root.is_dir():
        raise MigrationError(f"{root}: not a directory")
    copies = find_vendored(root)
    verb = "would " if dry_run else ""
    if not copies:
        return [f"{root}: no vendored {PACKAGE} found; nothing to do"]
    report = [f"{root}: vendored copies: {', '.join(str(c.relative_to(root)) for c in copies)}"]
    for copy in copies:
        extra = extra_names(copy)
        if extra:
            report.append(f"  warning: {copy.relative_to(root)} defines {', '.join(extra)}, which {DISTRIBUTION} "
                          "does not: the copy was modified or is older; check the code that uses them")
    vendored = [dotted_name(root, c) for c in copies]
    edits: Dict[Path, Tuple[Optional[str], str]] = {}
    for path in _walk(root):
        if path.suffix != ".py" or not path.is_file() or any(path == c or c in path.parents for c in copies):
            continue
        old = path.read_text(encoding="utf-8")
        try:
            new = rewrite_source(old, _module_of(root, path), vendored)
        except SyntaxError as exc:
            raise MigrationError(f"{path}: cannot parse ({exc.msg}, line {exc.lineno}); fix it and run again") from exc
        if new != old:
            edits[path] = (old, new)
    dep_file, dep_old, dep_new = add_dependency(root, requirement)
    if dep_file is not None and dep_new is not None:
        edits[dep_file] = (dep_old, dep_new)
    else:
        report.append(f"  {DISTRIBUTION} is already a dependency")
    if (root / "uv.lock").is_file():
        report.append("  warning: uv.lock is now out of date: run `uv lock` in the project")
    for path, (old, new) in sorted(edits.items()):
        report.append(f"  {verb}{'edit' if old is not None else 'create'} {path.relative_to(root)}")
        if dry_run:
            report.append(_diff(path, old, new, root).rstrip("\n"))
    for copy in copies:
        report.append(f"  {verb}remove {copy.relative_to(root)}{'/' if copy.is_dir() else ''}")
    if not dry_run:
        for path, (_, new) in edits.items():
            path.write_text(new, encoding="utf-8")
        for copy in copies:
            if copy.is_dir():
                shutil.rmtree(copy)
            else:
                copy.unlink()
                cached = copy.parent / "__pycache__"
                for pyc in cached.glob(f"{PACKAGE}.*.pyc") if cached.is_dir() else []:
                    pyc.unlink()
    return report


def main(argv: Optional[List[str]] = None) -> int:
    """Command line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description="Replace a vendored crawlerkeeper_sdk by the crawlerkeeper-sdk "
                                                 "package in spider projects.")
    parser.add_argument("projects", nargs="+", type=Path, metavar="PROJECT_DIR")
    parser.add_argument("--dry-run", action="store_true", help="print what would change; change nothing")
    parser.add_argument("--requirement", default=default_requirement(),
                        help="the requirement to add (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.requirement.lower().replace("_", "-").startswith(DISTRIBUTION):
        parser.error(f"--requirement must name {DISTRIBUTION}")
    status = 0
    for project in args.projects:
        try:
            print("\n".join(migrate(project.resolve(), args.requirement, args.dry_run)))
        except MigrationError as exc:
            print(f"migrate_spiders: {exc}", file=sys.stderr)
            status = 1
    if args.dry_run:
        print("dry run: nothing was changed")
    return status


if __name__ == "__main__":
    sys.exit(main())
