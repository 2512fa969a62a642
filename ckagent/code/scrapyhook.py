"""Scrapy's hooks: its items and stats with no change to the project, however Scrapy is started,
and the spiders a project holds (ckagent.code.frameworks attaches them to the Python runtime and to
Scrapy's record).

Every Python task gets ``CK_SCRAPY_HOOK`` in its environment. The agent-built environment's ``.pth``
file (ckagent.code.deps_python) then loads ``crawlerkeeper_sdk._scrapy_hook`` in every interpreter of the task,
which adds two extensions to Scrapy's defaults (``EXTENSIONS_BASE``) when Scrapy is imported: one
that writes every scraped item to ``CK_ITEMS_FILE`` and one that reports live stats. The project's
own ``FEEDS`` (a path, S3, FTP) keep exporting as written; the argv does not matter (``scrapy crawl``,
``sh -c 'python setup.py && scrapy crawl x'``, ``python -m scrapy``, a script with ``CrawlerProcess``).

``CK_SCRAPY_HOOK`` is ``items,stats,state``, or ``stats,state`` when the project's files mention
``crawlerkeeper_sdk`` (it ships its items through the SDK itself: never an item twice) or when the
task declares ``outputs.items`` (those files are its items, e.g. the project's own feed file: the
agent adds no feed of its own beside them, so no item comes twice; the project's FEEDS are kept). The SDK's
extension also steps aside when a feed already writes the items file or the SDK pipeline is on.
``state`` (every task) makes the crawl checkpoint and resume (``crawlerkeeper_sdk._scrapy_state``):
``JOBDIR`` is ``$CK_STATE_DIR/jobdir`` unless the project sets its own, and at each of the agent's
persist requests the hook saves the crawl's state at one reactor step (issue 38).

A Scrapy project (framework ``scrapy`` or a ``scrapy.cfg``) whose command runs an interpreter from
outside the task's environment (a system ``scrapy``, a virtualenv of the author's own) cannot be
attached to: :func:`scrapy_hook` returns a plain notice for the task log saying that items will not
be collected and how to make them be.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import zipfile
from pathlib import Path

from ckagent.containment.stoptarget import LAUNCHERS
from ckagent.node import beneath

SDK_PIPELINE_MARK = "crawlerkeeper_sdk"
"""Text that shows a Scrapy project already ships its items through the SDK (its pipeline or save_item)."""
SCAN_SKIP = {".git", ".venv", "venv", "node_modules", "__pycache__", ".scrapy", "build", "dist"}
"""Folders a scan of the project never enters."""
_SCAN_MAX_FILES = 2000
HOOK_VAR = "CK_SCRAPY_HOOK"
"""The variable that switches the SDK's Scrapy hook on (its value: ``items,stats,state`` or ``stats,state``)."""
HOW_TO_COLLECT = ('run the environment\'s scrapy or python (first on PATH), declare the item files in the '
                  'spider\'s outputs.items, save items with the SDK (crawlerkeeper_sdk.save_item or its '
                  'pipeline), or add -o "$CK_ITEMS_FILE:jsonlines" to the scrapy command')


def attaches(argv: list[str], path: str | None, env_dir: Path | None) -> bool:
    """Whether the Python that ``argv`` ends up running is the environment's (blocking: a few stats).

    True when ``argv[0]`` lies in ``env_dir`` (see :func:`runs_in_env`), or is a launcher
    (a shell, npm, env ...) and ``scrapy`` or ``python`` on the spider's ``path`` lies there.
    """
    if runs_in_env(argv, path, env_dir):
        return True
    if env_dir is None or not argv or os.path.basename(argv[0]) not in LAUNCHERS:
        return False
    for name in ("scrapy", "python", "python3"):
        found = shutil.which(name, path=path)
        if found is not None and Path(os.path.abspath(found)).is_relative_to(env_dir):
            return True
    return False


def scrapy_hook(framework: str, argv: list[str], path: str | None, code_dir: Path,
                env_dir: Path | None, *, items_declared: bool = False) -> tuple[dict[str, str], str | None]:
    """(variables to add to a Python task's env, a notice for its log or None). Blocking: scans the
    project for ``crawlerkeeper_sdk`` (bounded) and stats a few files. ``path`` is the spider's PATH;
    ``items_declared``: the task declares ``outputs.items`` (then only stats, never the agent's feed)."""
    mode = "stats,state" if items_declared or uses_sdk_pipeline(code_dir) else "items,stats,state"
    env = {HOOK_VAR: mode}
    is_scrapy = framework == "scrapy" or (code_dir / "scrapy.cfg").is_file()
    if is_scrapy and not attaches(argv, path, env_dir):
        what = "items and live crawl stats" if mode.startswith("items") else "live crawl stats"
        return env, (f"Scrapy {what} will not be collected: {argv[0]} is not in the task's environment, so the "
                     f"agent's Scrapy hook cannot attach to it; to collect the items, {HOW_TO_COLLECT}")
    return env, None


def uses_sdk_pipeline(code_dir: Path) -> bool:
    """Whether the project's Python files mention ``crawlerkeeper_sdk`` (its pipeline or save_item)
    (blocking). The working copy is the spider's: walked and read by descriptors, regular files only
    (ckagent.node.beneath: no link followed, no FIFO waited on)."""
    seen = 0

    def skipped(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return name in SCAN_SKIP or name.endswith(".egg-info")

    try:
        for rel_dir, _dirs, entries in beneath.walk(code_dir, skip_dir=skipped):
            for name, st in entries:
                if not stat.S_ISREG(st.st_mode) or not name.endswith(
                        (".py", ".cfg", ".toml", ".ini", ".json", ".yaml", ".yml")):
                    continue
                seen += 1
                if seen > _SCAN_MAX_FILES:
                    return False
                try:
                    fd = beneath.open_file(code_dir, rel_dir + name)
                except OSError:
                    continue
                try:
                    if SDK_PIPELINE_MARK.encode() in os.read(fd, 1 << 20):
                        return True
                except OSError:
                    continue
                finally:
                    os.close(fd)
    except OSError:
        return False
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
