"""What a task runs: its command (or its framework's default), the check that the package can run
it, and the checks ckagent.task.scrapyhook makes before it attaches to a Scrapy crawl.

Default commands (docs/protocol.md "Running a task")::

    scrapy      scrapy crawl <spiderName>          (needs scrapy.cfg at the project root)
    python, playwright, selenium
                python main.py                     (needs main.py)
    node        npm start        if package.json has scripts.start (task args after "--")
                node <main>      else if package.json has main
                node index.js    else (needs one of the three)

:func:`check_package` raises DeployError naming what is missing and where it looked, so a package
that cannot run fails DEPLOY_FAILED before anything is installed. A task with its own ``command``
is not checked: its author knows what it runs.

Scrapy items with no code change come from ckagent.task.scrapyhook (an environment-driven hook, beside
the project's own ``FEEDS``); :func:`uses_sdk_pipeline` tells it whether the project already ships
its items through the SDK.

The blocking functions read a few small files: call them through ``trio.to_thread``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

from ckagent.code.deps_node import node_default_command
from ckagent.code.workspace import DeployError
from ckagent.master.protocol import Task

DEFAULT_COMMANDS: dict[str, list[str]] = {
    "python": ["python", "main.py"],
    "playwright": ["python", "main.py"],
    "selenium": ["python", "main.py"],
    "node": ["node", "index.js"],
}
"""Fixed defaults by framework (node's is refined by package.json: :func:`resolve_command`)."""
SDK_PIPELINE_MARK = "crawlerkeeper_sdk"
"""Text that shows a Scrapy project already ships its items through the SDK (its pipeline or save_item)."""
_SCAN_SKIP = {".git", ".venv", "venv", "node_modules", "__pycache__", ".scrapy", "build", "dist"}
_SCAN_MAX_FILES = 2000


def default_command(task: Task) -> list[str]:
    """The command a task runs: its own, or its framework's fixed default, plus its args (no file access)."""
    if task.command:
        base = list(task.command)
    elif task.framework == "scrapy":
        base = ["scrapy", "crawl", task.spider_name or task.spider_id]
    else:
        base = list(DEFAULT_COMMANDS[task.framework])
    return base + list(task.args)


def resolve_command(task: Task, code_dir: Path) -> tuple[list[str], str | None]:
    """The command the task runs in ``code_dir`` and a note on how a default was chosen (blocking).

    Raises DeployError when the framework's default needs a file the package lacks (see the module
    docstring); a task with its own ``command`` is taken as it is.
    """
    if task.command:
        return default_command(task), None
    where = f"the package root ({_listing(code_dir)})"
    if task.framework == "scrapy":
        if not (code_dir / "scrapy.cfg").is_file():
            raise DeployError(
                f"scrapy.cfg is missing: a Scrapy task runs `scrapy crawl` in the project root, which must "
                f"hold scrapy.cfg; looked in {where}.{_one_down(code_dir, ('scrapy.cfg',))} Zip the project "
                "folder's contents (or the folder itself), or give the spider a command"
            )
        return default_command(task), None
    if task.framework == "node":
        argv, followed = node_default_command(code_dir)
        if argv is None:
            raise DeployError(
                f"nothing to run: a Node task runs package.json's scripts.start, else its main, else index.js; "
                f"looked for {followed} in {where}.{_one_down(code_dir, ('package.json',))} Add one, or give "
                "the spider a command"
            )
        # npm passes arguments to the script only after "--" (before it they are npm's own options).
        extra = (["--", *task.args] if argv[0] == "npm" else list(task.args)) if task.args else []
        return argv + extra, f"default command from {followed}: {' '.join(argv)}"
    if task.framework in DEFAULT_COMMANDS:
        argv = default_command(task)
        script = argv[1]
        if not (code_dir / script).is_file():
            raise DeployError(
                f"{script} is missing: a {task.framework} task runs `python {script}` in the package root; "
                f"looked in {where}.{_one_down(code_dir, (script, 'scrapy.cfg', 'package.json'))} Add it, or "
                "give the spider a command"
            )
        return argv, None
    return default_command(task), None


def _one_down(code_dir: Path, markers: tuple[str, ...], limit: int = 200) -> str:
    """`` Found bookscraper/scrapy.cfg one folder down: ...`` when a framework marker lies in a
    sub-folder of ``code_dir`` (a zip of the repository root, not the project); else ``""``."""
    found: list[str] = []
    try:
        folders = sorted(e for e in code_dir.iterdir() if e.is_dir() and not e.is_symlink()
                         and e.name not in _SCAN_SKIP)[:limit]
    except OSError:
        return ""
    for folder in folders:
        found.extend(f"{folder.name}/{m}" for m in markers if (folder / m).is_file())
    if not found:
        return ""
    first = found[0].split("/")[0]
    return (f" Found {', '.join(found[:4])} one folder down: the project is in {first}/ — zip that folder's "
            f"contents, or give the spider a command that starts there (e.g. `sh -c 'cd {first} && ...'`).")


def _listing(code_dir: Path, limit: int = 12) -> str:
    """A short listing of the top of ``code_dir`` for error messages: ``"a.py, pkg/, ..."``."""
    try:
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in code_dir.iterdir() if e.name != "node_modules")
    except OSError:
        return "unreadable"
    if not names:
        return "empty"
    shown = ", ".join(names[:limit])
    return shown + (f", … {len(names) - limit} more" if len(names) > limit else "")


def uses_sdk_pipeline(code_dir: Path) -> bool:
    """Whether the project's Python files mention ``crawlerkeeper_sdk`` (its pipeline or save_item) (blocking)."""
    seen = 0
    for dirpath, dirnames, filenames in os.walk(code_dir):
        dirnames[:] = [d for d in dirnames if d not in _SCAN_SKIP and not d.endswith(".egg-info")]
        for name in filenames:
            if not name.endswith((".py", ".cfg", ".toml", ".ini", ".json", ".yaml", ".yml")):
                continue
            seen += 1
            if seen > _SCAN_MAX_FILES:
                return False
            try:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    if SDK_PIPELINE_MARK.encode() in fh.read(1 << 20):
                        return True
            except OSError:
                continue
    return False


def runs_in_env(argv: list[str], path: str | None, env_dir: Path | None) -> bool:
    """Whether ``argv``'s executable, looked up on ``path`` (the spider's ``PATH``) as it will be at
    the spawn, lies inside ``env_dir``: the environment the agent built, where the bundled SDK is
    importable (blocking: a few ``stat`` calls). True when there is no such environment to compare
    with (``env_dir`` None: nothing known to be missing). A command naming another interpreter (a
    system ``scrapy``, a virtualenv of the author's own) is False: the SDK may be absent there, so
    nothing that imports it is added to the spider's settings. Symlinks are not followed (a
    virtualenv's ``bin/python`` points outside it)."""
    if env_dir is None or not argv:
        return True
    found = shutil.which(argv[0], path=path)
    if found is None:
        return False
    return Path(os.path.abspath(found)).is_relative_to(env_dir)


_SPIDER_NAME = re.compile(r"""^[ \t]+name[ \t]*(?::[^=\n]*)?=[ \t]*["']([^"'\n]+)["']""", re.M)


def scrapy_spider_names(source: Path) -> list[str]:
    """The spider names (``name = "..."`` in a class body) of the Python files under a ``spiders``
    directory of a Scrapy project folder or zip, sorted; blocking. What ``scrapy list`` would say for
    an ordinary project, without installing Scrapy; unreadable files are skipped."""
    import zipfile

    texts: list[str] = []
    if source.is_dir():
        for path in source.rglob("*.py"):
            if "spiders" in path.relative_to(source).parts[:-1]:
                with contextlib.suppress(OSError):
                    texts.append(path.read_text(encoding="utf-8", errors="replace"))
    else:
        with contextlib.suppress(OSError, zipfile.BadZipFile), zipfile.ZipFile(source) as archive:
            for info in archive.infolist():
                parts = info.filename.split("/")
                if info.filename.endswith(".py") and "spiders" in parts[:-1] and info.file_size < 1 << 20:
                    texts.append(archive.read(info).decode("utf-8", "replace"))
    return sorted({m.group(1) for text in texts for m in _SPIDER_NAME.finditer(text)})
