"""Scrapyd eggs: a project as ``scrapyd-deploy`` builds it, run as Scrapyd runs it.

An egg is a ``bdist_egg`` zip: the project's packages at its top and ``EGG-INFO/`` beside them, whose
``entry_points.txt`` names the settings module (``[scrapy]`` ``settings = bookshop.settings``, from
``setup.py``'s ``entry_points``). It has no ``scrapy.cfg``: Scrapyd's runner puts the egg on
``sys.path`` and sets ``SCRAPY_SETTINGS_MODULE`` from that entry point, then runs ``scrapy crawl``.
The agent unpacks it like any package (ckagent.code.unpack: the same rules; ``EGG-INFO/`` is never
unwrapped as a single top folder) and, for a task without its own ``command``, runs it the same way:

- the command (:func:`crawl_argv`): ``scrapy crawl <spiderName>``, then the task's ``params`` as
  Scrapyd's ``schedule.json`` takes them — each ``NAME: value`` a spider argument ``-a NAME=value``
  (text as it is, anything else as JSON), ``jobid`` the job id, ``setting`` (``"K=V"`` or a list of
  them) and ``settings`` (an object) Scrapy settings ``-s K=V``, ``project``/``spider``/``_version``
  Scrapyd's own and left out — then ``-a _job=<job id>`` (the ``jobid`` param, else the task id),
  then the task's ``args`` (``-a``/``-s`` as written);
- the environment (:func:`spawn_env`, a spawn hook of the Python runtime): ``SCRAPY_SETTINGS_MODULE``
  (unless the task sets it, as Scrapyd's ``setdefault``), ``SCRAPY_PROJECT`` (the settings' top package),
  ``SCRAPYD_SPIDER``, ``SCRAPYD_JOB``, ``SCRAPYD_EGG_VERSION`` (PKG-INFO's) and the working copy first on
  ``PYTHONPATH`` (the egg's place on ``sys.path``);
- its requirements (ckagent.code.pyplan): a ``requirements.txt`` shipped in the egg's top, else
  ``EGG-INFO/requires.txt`` (``install_requires``; Scrapy added when not named, as Scrapyd brings
  its own), else the framework's packages (Scrapy).

A package that is a zip holding one egg and files beside it (its ``requirements.txt``) has the egg
unpacked in its place (:func:`unnest`, one level: an egg inside that egg is a file like any other).

The egg's files are hostile input like any package's: :func:`read_egg` reads ``EGG-INFO`` files by
descriptor (no link followed, at most :data:`MAX_INFO_BYTES`) and checks the settings module's name
and that the egg holds it.

Exceptions::

    DeployError   the egg cannot run as Scrapyd would run it; the message says what is wrong and how
                  to build it right (the task fails DEPLOY_FAILED)
"""

from __future__ import annotations

import configparser
import errno
import json
import keyword
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckagent.code.unpack import EGG_INFO, Limits, extract_zip
from ckagent.node import beneath
from ckagent.node.errors import DeployError

ENTRY_POINTS = f"{EGG_INFO}/entry_points.txt"
REQUIRES = f"{EGG_INFO}/requires.txt"
PKG_INFO = f"{EGG_INFO}/PKG-INFO"
MAX_INFO_BYTES = 64 * 1024
"""Bytes an ``EGG-INFO`` file may hold (an egg's entry points and metadata are a few lines)."""
SCRAPYD_OWN_PARAMS = frozenset({"project", "spider", "_version", "jobid", "setting", "settings"})
"""``schedule.json`` parameters that are not spider arguments."""
BUILD_HINT = ("build it from the project folder with `scrapyd-deploy --build-egg=project.egg` or "
              "`python setup.py bdist_egg`, its setup.py holding entry_points={'scrapy': ['settings = "
              "PROJECT.settings']}")


@dataclass(frozen=True)
class Egg:
    """What an egg says about itself: its settings module (dotted), the project (the settings module's
    top package: what scrapy.cfg's ``[deploy] project`` usually names, an egg not carrying it) and the
    distribution's name and version (``EGG-INFO/PKG-INFO``; None when it says none plainly)."""

    settings_module: str
    project: str
    name: str | None = None
    version: str | None = None


def is_egg(code_dir: Path) -> bool:
    """Whether ``code_dir`` holds an unpacked egg (an ``EGG-INFO`` folder and no ``scrapy.cfg``: a project
    that ships both runs as a Scrapy project). Blocking (two stats); never raises."""
    try:
        return (beneath.stat_entry(code_dir, EGG_INFO).st_mode & 0o170000 == 0o040000
                and not (code_dir / "scrapy.cfg").exists())
    except OSError:
        return False


def settings_of(data: bytes) -> str:
    """The settings module ``entry_points.txt`` (its bytes) names in ``[scrapy]``. Raises DeployError
    saying what is wrong: too big, not UTF-8, not an entry-points file, no ``[scrapy] settings``, a
    value that is not a dotted module name."""
    where = f"this package is an egg, but its {ENTRY_POINTS}"
    if len(data) > MAX_INFO_BYTES:
        raise DeployError(f"{where} holds {len(data)} bytes (at most {MAX_INFO_BYTES}): not an egg's entry "
                          f"points; {BUILD_HINT}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DeployError(f"{where} is not UTF-8 text (byte {exc.start}); {BUILD_HINT}") from None
    parser = configparser.ConfigParser(delimiters=("=",), comment_prefixes=("#", ";"), interpolation=None,
                                       strict=True, default_section="\0none")
    try:
        parser.read_string(text, source=ENTRY_POINTS)
    except configparser.Error as exc:
        first = str(exc).splitlines()[0][:200]
        raise DeployError(f"{where} cannot be read as entry points ({first}); {BUILD_HINT}") from None
    if not parser.has_option("scrapy", "settings"):
        sections = ", ".join(f"[{s[:40]}]" for s in parser.sections()[:6]) or "no section"
        raise DeployError(f"this package is an egg that does not name its settings: {ENTRY_POINTS} has "
                          f"{sections} but no [scrapy] settings = PROJECT.settings, so it is not a Scrapy "
                          f"project as scrapyd-deploy builds it; {BUILD_HINT}")
    value = parser.get("scrapy", "settings").strip()
    module = value.split(":", 1)[0].strip()  # an entry point may name an attribute: the module is before ':'
    if not _dotted(module):
        raise DeployError(f"this package is an egg whose {ENTRY_POINTS} names settings = {value[:200]!r}, "
                          f"not a module name (e.g. bookshop.settings); {BUILD_HINT}")
    return module


def _dotted(name: str) -> bool:
    parts = name.split(".")
    return bool(name) and all(p.isidentifier() and p.isascii() and not keyword.iskeyword(p) for p in parts)


def read_egg(code_dir: Path) -> Egg:
    """The egg unpacked in ``code_dir`` (see :func:`is_egg`): its settings module, checked to be in the
    egg (``a/b.py``, ``a/b.pyc`` or ``a/b/__init__.py``), and its name and version. Blocking (small
    reads by descriptor). Raises DeployError (see :func:`settings_of`; a module the egg lacks)."""
    try:
        data = beneath.read_bytes(code_dir, ENTRY_POINTS, MAX_INFO_BYTES)
    except FileNotFoundError:
        raise DeployError(f"this package is an egg ({EGG_INFO}/) without {ENTRY_POINTS}, so it does not name "
                          f"its settings; {BUILD_HINT}") from None
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise DeployError(f"this package is an egg, but its {ENTRY_POINTS} holds more than {MAX_INFO_BYTES} "
                              f"bytes (at most {MAX_INFO_BYTES}): not an egg's entry points; {BUILD_HINT}") from None
        raise DeployError(f"this package is an egg, but its {ENTRY_POINTS} cannot be read ({exc.strerror or exc}); "
                          f"{BUILD_HINT}") from None
    module = settings_of(data)
    rel = module.replace(".", "/")
    candidates = (f"{rel}.py", f"{rel}.pyc", f"{rel}/__init__.py", f"{rel}/__init__.pyc")
    if not any(_is_file(code_dir, c) for c in candidates):
        raise DeployError(f"this package is an egg whose {ENTRY_POINTS} names settings {module}, but the egg "
                          f"does not hold it (looked for {candidates[0]} and {candidates[2]}); list the "
                          f"project's packages in setup.py (packages=find_packages()) and {BUILD_HINT}")
    name, version = _pkg_info(code_dir)
    return Egg(module, module.split(".")[0], name, version)


def _is_file(code_dir: Path, rel: str) -> bool:
    try:
        os.close(beneath.open_file(code_dir, rel))
    except OSError:
        return False
    return True


_HEADER = re.compile(r"^(Name|Version):[ \t]*([A-Za-z0-9][A-Za-z0-9._+!-]{0,100})[ \t]*$", re.M)


def _pkg_info(code_dir: Path) -> tuple[str | None, str | None]:
    """(Name, Version) of ``EGG-INFO/PKG-INFO``; None for what it lacks or cannot say plainly."""
    try:
        text = beneath.read_bytes(code_dir, PKG_INFO, MAX_INFO_BYTES).decode("utf-8", "replace")
    except OSError:
        return None, None
    found: dict[str, str] = {}
    for m in _HEADER.finditer(text):
        found.setdefault(m.group(1), m.group(2))
    return found.get("Name"), found.get("Version")


def requires_lines(text: str) -> list[str]:
    """The unconditional requirements of ``EGG-INFO/requires.txt`` (``install_requires``): the lines
    before its first ``[extra]`` / ``[:marker]`` section, comments and blanks left out."""
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("["):
            break
        if line:
            out.append(line)
    return out


def job_id(task_id: str, params: Mapping[str, Any]) -> str:
    """Scrapyd's job id of a task: its ``jobid`` param (text), else the task id."""
    given = params.get("jobid")
    return given if isinstance(given, str) and given else task_id


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def crawl_argv(spider: str, task_id: str, params: Mapping[str, Any]) -> list[str]:
    """``scrapy crawl`` as Scrapyd starts it for ``spider`` with ``params`` (see the module docstring)."""
    argv = ["scrapy", "crawl", spider]
    for name, value in params.items():
        if name not in SCRAPYD_OWN_PARAMS and not name.startswith("_"):
            argv += ["-a", f"{name}={_text(value)}"]
    argv += ["-a", f"_job={job_id(task_id, params)}"]
    setting = params.get("setting")
    for pair in [setting] if isinstance(setting, str) else setting if isinstance(setting, list) else []:
        if isinstance(pair, str) and "=" in pair:
            argv += ["-s", pair]
    settings = params.get("settings")
    if isinstance(settings, dict):
        for key, value in settings.items():
            argv += ["-s", f"{key}={_text(value)}"]
    return argv


def spawn_env(code_dir: Path, env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """The variables Scrapyd's runner gives an egg's crawl (see the module docstring), for the task
    whose environment so far is ``env`` (``CK_TASK_ID``, ``CK_SPIDER_NAME``, ``CK_PARAMS``), and a
    line for its log; ``({}, None)`` when ``code_dir`` holds no egg or one :func:`read_egg` refuses
    (the deploy said so already). Blocking (small reads); never raises."""
    if not is_egg(code_dir):
        return {}, None
    try:
        egg = read_egg(code_dir)
    except DeployError:
        return {}, None
    try:
        params = json.loads(env.get("CK_PARAMS") or "{}")
    except ValueError:
        params = {}
    job = job_id(env.get("CK_TASK_ID", ""), params if isinstance(params, dict) else {})
    python_path = os.pathsep.join(p for p in (str(code_dir), env.get("PYTHONPATH", "")) if p)
    out = {"PYTHONPATH": python_path, "SCRAPY_PROJECT": env.get("SCRAPY_PROJECT") or egg.project,
           "SCRAPY_SETTINGS_MODULE": env.get("SCRAPY_SETTINGS_MODULE") or egg.settings_module,
           "SCRAPYD_SPIDER": env.get("CK_SPIDER_NAME", ""), "SCRAPYD_JOB": job}
    if egg.version:
        out["SCRAPYD_EGG_VERSION"] = egg.version
    shown = " ".join(part for part in (egg.name or egg.project, egg.version) if part)
    return out, (f"a Scrapyd egg ({shown}): settings {out['SCRAPY_SETTINGS_MODULE']} ({ENTRY_POINTS}), "
                 f"job {job}, the egg first on PYTHONPATH — as Scrapyd runs it")


def unnest(code_dir: Path, limits: Limits) -> str | None:
    """When the unpacked package ``code_dir`` is a zip holding one ``*.egg`` at its top (and no egg or
    Scrapy project of its own), unpack that egg into ``code_dir`` in its place, beside the zip's other
    files (its ``requirements.txt``): the egg's name, else None. Beside a project's own code (a
    ``.py`` file or a folder at the top) only a Scrapyd egg (:func:`settings_of` names its settings) is
    unpacked: another egg there is the project's file (a vendored library). The egg passes the rules of
    ckagent.code.unpack within what is left of ``limits`` after the zip's own files. Blocking.
    Raises DeployError naming the egg (a broken rule; a file both the zip and the egg hold)."""
    try:
        entries = list(code_dir.iterdir())
    except OSError:
        return None
    inner = [e for e in entries if e.name.endswith(".egg") and e.is_file() and not e.is_symlink()]
    if len(inner) != 1 or any(e.name in (EGG_INFO, "scrapy.cfg") for e in entries):
        return None
    egg = inner[0]
    alone = all(e == egg or (e.is_file() and not e.is_symlink() and e.suffix != ".py") for e in entries)
    used = sum(p.stat().st_size for p in code_dir.rglob("*") if p.is_file() and not p.is_symlink())
    left = Limits(limits.max_package_bytes, max(limits.max_total_bytes - used, 0), limits.max_entries, limits.max_ratio)
    staging = Path(tempfile.mkdtemp(prefix="egg-", dir=code_dir.parent))
    try:
        try:
            extract_zip(egg, staging, left)
        except DeployError as exc:
            if not alone:
                return None
            raise DeployError(f"{egg.name} (the egg in the package): {exc}") from None
        if not (staging / EGG_INFO).is_dir() or not (alone or _names_settings(staging)):
            return None
        for entry in sorted(staging.iterdir()):
            if (code_dir / entry.name).exists() and entry.name != egg.name:
                raise DeployError(f"both the package and the egg in it ({egg.name}) hold {entry.name}: keep one "
                                  "(a requirements.txt goes beside the egg, the project's code inside it)")
        egg.unlink()
        for entry in sorted(staging.iterdir()):
            os.rename(entry, code_dir / entry.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return egg.name


def _names_settings(unpacked: Path) -> bool:
    """Whether the egg unpacked in ``unpacked`` names its ``[scrapy] settings`` (a Scrapyd egg)."""
    try:
        settings_of(beneath.read_bytes(unpacked, ENTRY_POINTS, MAX_INFO_BYTES))
    except (OSError, DeployError):
        return False
    return True
