"""Scrapy's project data dir (``.scrapy``) kept in the spider's data dir between its tasks, as Scrapyd keeps it.

Scrapy keeps what a project remembers between crawls in its *project data dir*: ``data_path()``
(scrapy/utils/project.py) resolves a relative ``HTTPCACHE_DIR`` (default ``httpcache``) and other
state in ``<dir of the closest scrapy.cfg>/.scrapy`` (unless a ``[datadir]`` section of scrapy.cfg
names another), and in ``./.scrapy`` when Scrapy runs outside a project (a script with a
``CrawlerProcess`` and no scrapy.cfg). A task runs in a fresh working copy (ckagent.code.workcopy),
so that dir would be thrown away after every task; on Scrapyd it stays with the project. Here it
lives in the spider's data dir, ``CK_DATA_DIR/scrapy`` (``work_dir/spider-data/<spider>/scrapy``):

- :func:`attach` (in the prepare hop, before any process of the task runs) makes that dir (given to
  the spider's identity: its own uid at the ``spider-uids`` level), and a symlink ``.scrapy`` → it in
  the working copy's root and beside each ``scrapy.cfg`` up to :data:`CFG_DEPTH` folders down. A
  ``.scrapy`` the package ships, and a scrapy.cfg with a ``[datadir]`` of its own, are the author's:
  left alone, said in the log line. The symlinks are no outputs (the cache rule of
  ckagent.delivery.outputs; a symlink is never collected) and the disk accounting walks no link, so the
  data is counted once, in the data dir (ckagent.delivery.diskwatch: a task's data dir is part of its use).
- A task's ``cleanStart`` empties it first (its size is said).
- Its size is said in the task log (:meth:`ScrapyData.line`), and a spider's dir not used for
  ``task.retention`` seconds is removed by the retention loop (:func:`remove_unused`), as the files
  kept on the node are; a spider with a task here keeps it.

The data dir is the spider's: every look into it goes by descriptors (ckagent.node.beneath), no link
followed; a ``scrapy`` entry that is not a directory (a link the spider planted) is replaced.
Blocking throughout: call from a thread (the prepare hop; the retention loop's ``trio.to_thread``).
"""

from __future__ import annotations

import configparser
import logging
import os
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.code.scrapyhook import SCAN_SKIP
from ckagent.containment import format_bytes
from ckagent.node import beneath
from ckagent.node.runas import RunAs

log = logging.getLogger(__name__)

SCRAPY_DIR = "scrapy"
"""The folder of a spider's data dir holding its Scrapy project data dir."""
LINK = ".scrapy"
"""Scrapy's name of the project data dir (beside scrapy.cfg, or in the working directory)."""
CFG_DEPTH = 2
"""How many folders below the working copy's root a ``scrapy.cfg`` gets its ``.scrapy`` link."""
MAX_ENTRIES = 200_000
"""Entries a size measurement counts at most (an HTTP cache holds several files per page)."""


@dataclass
class ScrapyData:
    """What :func:`attach` did: the dir (``target``), the working copy's folders given a link
    (``linked``: POSIX relative, "" = the root), the ``.scrapy`` entries the package ships
    (``shipped``) and the scrapy.cfg files naming a ``[datadir]`` (``own_datadir``) — left alone —,
    the bytes a clean start removed (None: no clean start), the bytes kept (``size_bytes``), and
    whether a ``scrapy`` entry that was no directory had to be replaced."""

    target: Path
    linked: list[str] = field(default_factory=list)
    shipped: list[str] = field(default_factory=list)
    own_datadir: list[str] = field(default_factory=list)
    cleaned_bytes: int | None = None
    size_bytes: int = 0
    replaced: bool = False

    def line(self) -> str:
        """The task log's line: where ``.scrapy`` lives, its size, a clean start, what was left alone."""
        where = ", ".join(f"{rel}/{LINK}" if rel else LINK for rel in self.linked) or "nowhere"
        if self.cleaned_bytes is not None:
            kept = f"cleanStart: emptied ({format_bytes(self.cleaned_bytes)} removed)"
        elif self.size_bytes:
            kept = f"{format_bytes(self.size_bytes)} kept from this spider's earlier tasks"
        else:
            kept = "empty"
        text = f"Scrapy's data dir ({where} → {self.target}): {kept}; kept between this spider's tasks on this node"
        if self.shipped:
            text += f"; the package's own {', '.join(self.shipped)} left alone (not kept)"
        if self.own_datadir:
            text += f"; {', '.join(self.own_datadir)} names its own [datadir]: left alone"
        if self.replaced:
            text += f"; its {SCRAPY_DIR} entry was not a directory: replaced"
        return text


def attach(work: Path, data_dir: Path, run_as: RunAs | None, *, clean: bool = False) -> ScrapyData:
    """Make ``data_dir/scrapy`` (emptied first when ``clean``; given to ``run_as`` when set, else the
    agent's) and link ``.scrapy`` to it in the working copy ``work`` (module docstring). ``work`` is
    fresh (no process of the task ran in it yet); ``data_dir`` exists (ckagent.code.workcopy.spider_dirs).
    Blocking. Raises OSError (a full disk, a data dir that cannot be opened)."""
    target = data_dir / SCRAPY_DIR
    found = ScrapyData(target)
    if clean:
        found.cleaned_bytes = size_of(data_dir, SCRAPY_DIR)
        beneath.remove(data_dir, SCRAPY_DIR)
    found.replaced = _make_dir(data_dir, run_as)
    found.size_bytes = 0 if clean else size_of(data_dir, SCRAPY_DIR)
    for rel in _project_dirs(work):
        place = work / rel / LINK if rel else work / LINK
        if os.path.lexists(place):
            found.shipped.append(f"{rel}/{LINK}" if rel else LINK)
            continue
        cfg = work / rel / "scrapy.cfg" if rel else work / "scrapy.cfg"
        if _names_datadir(cfg):
            found.own_datadir.append(f"{rel}/scrapy.cfg" if rel else "scrapy.cfg")
            continue
        os.symlink(target, place)
        if run_as is not None:
            os.lchown(place, run_as.uid, run_as.gid)
        found.linked.append(rel)
    return found


def _make_dir(data_dir: Path, run_as: RunAs | None) -> bool:
    """``data_dir/scrapy`` as a directory of the spider's (0700), its mtime now (its last use, for
    :func:`remove_unused`). True when an entry of that name that was no directory was removed first."""
    replaced = False
    try:
        st: os.stat_result | None = beneath.stat_entry(data_dir, SCRAPY_DIR)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        beneath.remove(data_dir, SCRAPY_DIR)
        replaced = True
    fd = beneath.open_dir(data_dir, SCRAPY_DIR, create=True)
    try:
        if run_as is not None and (os.fstat(fd).st_uid, os.fstat(fd).st_gid) != (run_as.uid, run_as.gid):
            os.fchown(fd, run_as.uid, run_as.gid)
        os.fchmod(fd, 0o700)
        os.utime(fd)
    finally:
        os.close(fd)
    return replaced


def _project_dirs(work: Path) -> list[str]:
    """The working copy's root ("") and each folder up to :data:`CFG_DEPTH` down holding a scrapy.cfg
    (regular file), in walk order; folders Scrapy projects never hold code in are not entered."""
    dirs = [""]
    for rel_dir, _dirs, entries in beneath.walk(work, skip_dir=lambda rel: rel.count("/") >= CFG_DEPTH
                                                or rel.rsplit("/", 1)[-1] in SCAN_SKIP):
        if rel_dir and any(name == "scrapy.cfg" and stat.S_ISREG(st.st_mode) for name, st in entries):
            dirs.append(rel_dir.rstrip("/"))
    return dirs


def _names_datadir(cfg: Path) -> bool:
    """Whether the scrapy.cfg ``cfg`` (a regular file of the fresh working copy, if any) has a
    ``[datadir]`` section with a value (Scrapy's ``project_data_dir`` then uses it, not ``.scrapy``)."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(beneath.read_bytes(cfg.parent, cfg.name, 1 << 20).decode("utf-8", "replace"))
    except (OSError, configparser.Error):
        return False
    return parser.has_section("datadir") and any(parser.items("datadir"))


def size_of(top: Path, rel: str) -> int:
    """Bytes allocated to the files below ``top/rel`` (st_blocks; hard links once; at most
    :data:`MAX_ENTRIES` entries), walked by descriptors, no link followed; 0 when missing."""
    total = count = 0
    seen: set[tuple[int, int]] = set()
    try:
        fd = beneath.open_dir(top, rel)
    except OSError:
        return 0
    try:
        for _rel, dirs, entries in beneath.walk(fd):
            for _name, st in (*dirs, *entries):
                count += 1
                if count > MAX_ENTRIES:
                    return total
                if stat.S_ISDIR(st.st_mode) or (st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen):
                    continue
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    except OSError:
        pass
    finally:
        os.close(fd)
    return total


def remove_unused(work_dir: Path, older_than: float, busy: Collection[str] = ()) -> list[str]:
    """Remove the Scrapy data dir (``spider-data/<spider>/scrapy``) of each spider whose last task here
    began more than ``older_than`` seconds ago (the dir's mtime, set by :func:`attach`) and that has
    no task here now (``busy``: the safe names of spiders with a task on this node). ``older_than``
    ≤ 0: keep forever. Returns the spiders' dir names whose data went; never raises. Blocking."""
    if older_than <= 0:
        return []
    cutoff = time.time() - older_than
    removed: list[str] = []
    top = work_dir / "spider-data"
    try:
        with os.scandir(top) as spiders:
            names = [entry.name for entry in spiders if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    for name in names:
        if name in busy:
            continue
        try:
            st = beneath.stat_entry(top / name, SCRAPY_DIR)
            if st.st_mtime >= cutoff:
                continue
            beneath.remove(top / name, SCRAPY_DIR)
        except OSError:
            continue
        removed.append(name)
    if removed:
        log.info("removed the Scrapy data of %d spider(s) with no task for task.retention (%g s): %s",
                 len(removed), older_than, ", ".join(removed))
    return removed


__all__ = ["LINK", "SCRAPY_DIR", "ScrapyData", "attach", "remove_unused", "size_of"]
