"""Scrapy items and stats with no change to the project, however Scrapy is started.

Every Python task gets ``CK_SCRAPY_HOOK`` in its environment. The agent-built environment's ``.pth``
file (ckagent.code.deps) then loads ``crawlerkeeper_sdk._scrapy_hook`` in every interpreter of the task,
which adds two extensions to Scrapy's defaults (``EXTENSIONS_BASE``) when Scrapy is imported: one
that writes every scraped item to ``CK_ITEMS_FILE`` and one that reports live stats. The project's
own ``FEEDS`` (a path, S3, FTP) keep exporting as written; the argv does not matter (``scrapy crawl``,
``sh -c 'python setup.py && scrapy crawl x'``, ``python -m scrapy``, a script with ``CrawlerProcess``).

``CK_SCRAPY_HOOK`` is ``items,stats``, or ``stats`` when the project's files mention
``crawlerkeeper_sdk`` (it ships its items through the SDK itself: never an item twice). The SDK's
extension also steps aside when a feed already writes the items file or the SDK pipeline is on.

A Scrapy project (framework ``scrapy`` or a ``scrapy.cfg``) whose command runs an interpreter from
outside the task's environment (a system ``scrapy``, a virtualenv of the author's own) cannot be
attached to: :func:`scrapy_hook` returns a plain notice for the task log saying that items will not
be collected and how to make them be.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckagent.containment.stoptarget import LAUNCHERS
from ckagent.task.commands import runs_in_env, uses_sdk_pipeline

HOOK_VAR = "CK_SCRAPY_HOOK"
"""The variable that switches the SDK's Scrapy hook on (its value: ``items,stats`` or ``stats``)."""
HOW_TO_COLLECT = ('run the environment\'s scrapy or python (first on PATH), declare the item files in the '
                  'spider\'s outputs.items, save items with the SDK (crawlerkeeper_sdk.save_item or its '
                  'pipeline), or add -o "$CK_ITEMS_FILE:jsonlines" to the scrapy command')


def attaches(argv: list[str], path: str | None, env_dir: Path | None) -> bool:
    """Whether the Python that ``argv`` ends up running is the environment's (blocking: a few stats).

    True when ``argv[0]`` lies in ``env_dir`` (see ckagent.task.commands.runs_in_env), or is a launcher
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
                env_dir: Path | None) -> tuple[dict[str, str], str | None]:
    """(variables to add to a Python task's env, a notice for its log or None). Blocking: scans the
    project for ``crawlerkeeper_sdk`` (bounded) and stats a few files. ``path`` is the spider's PATH."""
    mode = "stats" if uses_sdk_pipeline(code_dir) else "items,stats"
    env = {HOOK_VAR: mode}
    is_scrapy = framework == "scrapy" or (code_dir / "scrapy.cfg").is_file()
    if is_scrapy and not attaches(argv, path, env_dir):
        what = "items and live crawl stats" if mode != "stats" else "live crawl stats"
        return env, (f"Scrapy {what} will not be collected: {argv[0]} is not in the task's environment, so the "
                     f"agent's Scrapy hook cannot attach to it; to collect the items, {HOW_TO_COLLECT}")
    return env, None
