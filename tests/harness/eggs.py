"""Scrapyd eggs for the tests: built the way ``scrapyd-deploy`` builds them (``setup.py bdist_egg`` of
a Scrapyd-style project: scrapy.cfg ``[deploy]`` and a setup.py whose entry point names the settings),
and made by hand from a dict of entries (hostile eggs)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["SCRAPYD_SHOP", "build_egg", "egg_bytes"]

SCRAPYD_SHOP = Path(__file__).resolve().parents[2] / "sdk" / "examples" / "scrapyd_shop"
"""The bundled Scrapyd-style project (its committed egg: ``scrapyd_shop.egg``)."""


def build_egg(project: Path, dest_dir: Path) -> Path:
    """``python setup.py bdist_egg`` of a copy of ``project`` (the source folder is left as it was) with
    this interpreter's setuptools, no network; returns the egg in ``dest_dir``. Blocking (~0.5 s).
    Raises subprocess.CalledProcessError (its output attached) when setuptools fails."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="egg-build-") as tmp:
        copy = Path(tmp) / project.name
        shutil.copytree(project, copy, ignore=shutil.ignore_patterns("*.egg", "__pycache__", "build", "*.egg-info"))
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        subprocess.run([sys.executable, "setup.py", "-q", "bdist_egg", "--dist-dir", str(dest_dir)], cwd=copy,
                       env=env, check=True, capture_output=True, timeout=120)
    eggs = sorted(dest_dir.glob("*.egg"), key=lambda p: p.stat().st_mtime)
    return eggs[-1]


def egg_bytes(entries: dict[str, bytes | str]) -> bytes:
    """A zip of ``entries`` (path → content), as an egg is one."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buf.getvalue()
