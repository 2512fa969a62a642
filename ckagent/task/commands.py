"""What a task runs: its command (or its framework's default), and the check that the package can run it.

The defaults come from the framework's record (ckagent.code.frameworks; docs/protocol.md "Running a
task" lists them): a fixed argv (Scrapy's ``scrapy crawl <spiderName>``, ``python main.py``) and
the files it needs, or one refined from the project's files (Node: package.json's
``scripts.start``, else its ``main``, else ``index.js``). ``npm`` takes the task's args only after
``--`` (before it they are npm's own options). A Scrapyd egg (ckagent.code.eggs: ``EGG-INFO/``, no
``scrapy.cfg``) of a Scrapy task, or of a Python one whose default file it lacks, runs
``scrapy crawl`` as Scrapyd starts it (the task's params as ``-a``/``-s``, ``-a _job=``).

:func:`resolve_command` raises DeployError naming what is missing and where it looked (and a
framework's marker found one folder down: a zip of the repository root, not the project), so a
package that cannot run fails DEPLOY_FAILED before anything is installed. A task with its own
``command`` is not checked: its author knows what it runs.

The blocking functions read a few small files: call them through ``trio.to_thread``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ckagent.code import eggs
from ckagent.code.frameworks import PYTHON, all_markers, framework
from ckagent.code.scrapyhook import SCAN_SKIP, runs_in_env, scrapy_spider_names, uses_sdk_pipeline
from ckagent.code.workspace import DeployError
from ckagent.master.protocol import Task

__all__ = ["default_command", "resolve_command", "runs_in_env", "scrapy_spider_names", "uses_sdk_pipeline"]


def default_command(task: Task) -> list[str]:
    """The command a task runs: its own, or its framework's fixed default, plus its args (no file access)."""
    if task.command:
        base = list(task.command)
    else:
        base = framework(task.framework).default_argv(task.spider_name or task.spider_id)
    return base + list(task.args)


def resolve_command(task: Task, code_dir: Path) -> tuple[list[str], str | None]:
    """The command the task runs in ``code_dir`` and a note on how a default was chosen (blocking).

    Raises DeployError when the framework's default needs a file the package lacks (see the module
    docstring); a task with its own ``command`` is taken as it is.
    """
    if task.command:
        return default_command(task), None
    record = framework(task.framework)
    if record.runtime is PYTHON and eggs.is_egg(code_dir) and (
            task.framework == "scrapy" or not all((code_dir / needed).is_file() for needed in record.needs)):
        egg = eggs.read_egg(code_dir)
        crawl = eggs.crawl_argv(task.spider_name or task.spider_id, task.id, task.params) + list(task.args)
        return crawl, f"a Scrapyd egg (settings {egg.settings_module}): `scrapy crawl` as Scrapyd starts it"
    where = f"the package root ({_listing(code_dir)})"
    if record.from_project is not None:
        argv, followed = record.from_project(code_dir)
        if argv is None:
            raise DeployError(
                f"nothing to run: {record.explains}; looked for {followed} in {where}."
                f"{_one_down(code_dir, record.markers or all_markers())} Add one, or give the spider a command"
            )
        # npm passes arguments to the script only after "--" (before it they are npm's own options).
        extra = (["--", *task.args] if argv[0] == "npm" else list(task.args)) if task.args else []
        return argv + extra, f"default command from {followed}: {' '.join(argv)}"
    argv = default_command(task)
    for needed in record.needs:
        if not (code_dir / needed).is_file():
            explains = record.explains or f"a {task.framework} task runs `{' '.join(record.command)}` in the package root"
            fix = ("Zip the project folder's contents (or the folder itself), or give the spider a command"
                   if needed in record.markers else "Add it, or give the spider a command")
            markers = record.markers or (*record.needs, *all_markers())
            raise DeployError(f"{needed} is missing: {explains}; looked in {where}.{_one_down(code_dir, markers)} {fix}")
    return argv, None


def _one_down(code_dir: Path, markers: tuple[str, ...], limit: int = 200) -> str:
    """`` Found bookscraper/scrapy.cfg one folder down: ...`` when a framework marker lies in a
    sub-folder of ``code_dir`` (a zip of the repository root, not the project); else ``""``."""
    found: list[str] = []
    try:
        folders = sorted(e for e in code_dir.iterdir() if e.is_dir() and not e.is_symlink()
                         and e.name not in SCAN_SKIP)[:limit]
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


def resolve_on_path(argv: list[str], env: dict[str, str]) -> list[str]:
    """Resolve argv[0] on the spider's PATH (not the agent's), so the venv's python/scrapy win. Blocking
    (a few stats)."""
    if "/" in argv[0]:
        return argv
    found = shutil.which(argv[0], path=env.get("PATH"))
    return [found, *argv[1:]] if found else argv
