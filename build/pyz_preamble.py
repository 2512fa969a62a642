"""Runs inside ckagent.pyz after shiv has extracted it, before the CLI starts (shiv ``--preamble``).

Keeps the extraction root (``SHIV_ROOT``; run.sh puts it in ``.ckagent/pyz`` next to itself) from
growing with every upgrade: it marks this build's extraction as just used, then removes extractions
of other builds of the same archive name except the most recently used one (kept so that a rollback
starts warm), with their lock files and half-finished ``.tmp`` extractions. A build whose shiv lock
is held (being extracted right now) is left alone.

It also lets this process cache bytecode in the extraction (``sys.dont_write_bytecode = False``), so
only the first start of a build compiles the modules it imports; later (warm) starts load the
``.pyc`` files. Without it a ``PYTHONDONTWRITEBYTECODE=1`` environment (common in containers and
CI) would recompile every module on every start: ~0.4 s of a ~1 s start. The extraction is the
pyz's private cache, so writing there is what that variable exists to avoid in source trees; the
variable itself is left in ``os.environ``, so spiders and other child processes still honour it.

Globals given by shiv: ``site_packages`` (Path of this build's extracted site-packages), ``env``,
``archive``. Never fails the start: OSErrors are ignored (another process may be cleaning too).
"""

import fcntl
import os
import re
import shutil
import sys
from pathlib import Path

KEEP_OTHER_BUILDS = 1
SUPPORTED = ((3, 10), (3, 13))
"""Oldest and newest Python (major, minor) the bundled wheels were built for."""

if not SUPPORTED[0] <= sys.version_info[:2] <= SUPPORTED[1]:
    # Say so plainly instead of an ImportError deep in a dependency (this file must parse on old Pythons).
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    sys.exit(f"ckagent needs Python {lo_major}.{lo_minor} to {hi_major}.{hi_minor}; this is "
             f"{sys.version.split()[0]} ({sys.executable}): run the pyz with another python3 "
             "(run.sh: AGENT_PYTHON=/path/to/python3)")


def _remove_build(root: Path, name: str) -> None:
    lock = root / f".{name}_lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return  # being extracted by another process
    try:
        shutil.rmtree(root / f"{name}.tmp", ignore_errors=True)
        shutil.rmtree(root / name, ignore_errors=True)
        lock.unlink()
    except OSError:
        pass
    finally:
        os.close(fd)


def clean(current: Path) -> None:
    """Remove old extractions beside ``current`` (this build's extraction directory)."""
    root = current.parent
    prefix = current.name.rpartition("_")[0]
    pattern = re.compile(re.escape(prefix) + r"_([0-9a-f]{64})(\.tmp)?")
    try:
        os.utime(current)
        others: dict[str, float] = {}
        for path in root.iterdir():
            match = pattern.fullmatch(path.name)
            if match and path.name != current.name:
                name = path.name.removesuffix(".tmp")
                mtime = path.stat().st_mtime if match.group(2) is None else -1.0
                others[name] = max(others.get(name, -1.0), mtime)
    except OSError:
        return
    newest_first = sorted(others, key=lambda n: others[n], reverse=True)
    keep = [n for n in newest_first if others[n] >= 0][:KEEP_OTHER_BUILDS]
    for name in newest_first:
        if name not in keep:
            _remove_build(root, name)


if __name__ == "__main__":
    sys.dont_write_bytecode = False  # see the module docstring: warm starts load cached bytecode
    clean(Path(site_packages).parent)  # type: ignore[name-defined]  # noqa: F821
