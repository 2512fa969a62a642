"""The frameworks a task may name: one frozen record each, and the lookups every other module asks.

A task's ``framework`` (a wire value of docs/protocol.md) decides, through its :class:`Framework`
record: the runtime it runs on (:class:`Runtime`: the tool without which the node does not take it,
the installer that builds its environment, the hooks every task of the runtime gets), the packages
installed when the project declares no dependency file, the default command and the files it needs,
the marker files that detect it, the node's browsers it uses, and the hooks that add to a task's
environment at the spawn (Scrapy's items and stats: ckagent.code.scrapyhook). Who asks:

- ckagent.code.deps / pyplan — the runtime's builder, the default packages (:func:`default_packages`);
- ckagent.code.capabilities — the tool each runtime needs (:data:`RUNTIMES`);
- ckagent.task.commands — the default command and what it needs (DEPLOY_FAILED, with the markers
  one folder down: :func:`all_markers`);
- the task runner — :func:`spawn_additions` at the spawn (env, notices for the task log);
- ckagent.cli.localrun — :func:`detect` (``ckagent exec`` without ``--framework``) and the spider
  names a default command needs.

Adding a framework
------------------
1. Add one :class:`Framework` to :data:`REGISTRY` below (its runtime; its packages, command and
   markers; hooks of its own if it needs them — a hook is a blocking function of a
   :class:`SpawnContext` returning :class:`SpawnAdditions`).
2. Add its name to the wire values: ``FRAMEWORKS`` in ckagent.master.protocol and the ``Framework``
   enum of the OpenAPI file (the master validates it; tests/test_framework_registry.py holds the
   three equal and fails naming what is missing).
3. Document it: a row of the "Default commands" table of docs/protocol.md (the same test checks
   it) and the ``--framework`` help of ``ckagent exec``.

A new runtime (a language beyond Python and Node) is a :class:`Runtime` in :data:`RUNTIMES` plus its
environment builder in ckagent.code.deps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.code import eggs
from ckagent.code.deps_node import node_default_command
from ckagent.code.runtimes import BROWSER_VARS
from ckagent.code.scrapyhook import scrapy_hook, scrapy_spider_names

SCRAPY_STOP_GRACE = 180.0
"""Seconds a Scrapy task gets between its stop signal and the kill unless it names its own
``stopGraceSeconds``: Scrapy's graceful close waits for every request already handed to its downloader
— up to ``CONCURRENT_REQUESTS`` (16) queued in a slot behind ``DOWNLOAD_DELAY`` — then runs the
``close_spider`` pipelines and the feed exports. Measured (docs/operations.md, Polite stops): a polite
crawl (``DOWNLOAD_DELAY = 5``, AutoThrottle, Scrapy's other defaults, one loopback site) closed 92.6,
104.1 and 100.0 s after its SIGTERM (finish reason ``shutdown``, ``close_spider`` ran); the delays are
randomized up to 1.5 × (``RANDOMIZE_DOWNLOAD_DELAY``): 16 × 7.5 s = 120 s at worst, plus the exports."""

SPIDER_NAME = "<spiderName>"
"""Placeholder in a default command: the task's ``spiderName`` (its ``spiderId`` when it has none)."""


@dataclass(frozen=True)
class SpawnContext:
    """What a spawn hook sees (blocking hooks: run them through ``trio.to_thread``).

    ``argv`` is the command the task runs; ``env`` the spider's environment as built so far
    (read-only); ``path`` its PATH; ``code_dir`` the working copy; ``env_dir`` the environment the
    agent built for it (None: none, e.g. a Node spider without dependencies); ``items_declared``
    whether the task declares ``outputs.items`` (those files are its items: no feed of the agent's).
    """

    framework: str
    argv: list[str]
    env: Mapping[str, str]
    code_dir: Path
    env_dir: Path | None
    items_declared: bool = False

    @property
    def path(self) -> str | None:
        """The spider's PATH (where ``argv[0]`` is looked up at the spawn)."""
        return self.env.get("PATH")


@dataclass
class SpawnAdditions:
    """What hooks add at the spawn: variables for the spider's env, lines for the task's log."""

    env: dict[str, str] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)

    def add(self, other: SpawnAdditions) -> None:
        """Merge ``other`` in (a later hook's variable wins)."""
        self.env.update(other.env)
        self.notices.extend(other.notices)


SpawnHook = Callable[[SpawnContext], SpawnAdditions]
"""A blocking function of the spawn's context; must not raise for a project it does not understand."""


def _scrapy_items(ctx: SpawnContext) -> SpawnAdditions:
    """Scrapy's items and stats however Scrapy is started (ckagent.code.scrapyhook): only in an
    environment the agent built (its ``.pth`` loads the SDK's hook); only stats when the task
    declares ``outputs.items``."""
    if ctx.env_dir is None:
        return SpawnAdditions()
    env, notice = scrapy_hook(ctx.framework, ctx.argv, ctx.path, ctx.code_dir, ctx.env_dir,
                              items_declared=ctx.items_declared)
    return SpawnAdditions(env, [notice] if notice else [])


@dataclass(frozen=True)
class Runtime:
    """A language a spider runs on.

    ``tool``: without it the node does not take the runtime's tasks (ckagent.code.capabilities);
    ``helpers``: tools it uses when present (without them only some spiders run); ``hooks``: spawn
    hooks every task of the runtime gets (before its framework's own).
    """

    name: str
    tool: str
    helpers: tuple[str, ...] = ()
    hooks: tuple[SpawnHook, ...] = ()


def _scrapyd_egg(ctx: SpawnContext) -> SpawnAdditions:
    """A Scrapyd egg's environment as Scrapyd's runner gives it (ckagent.code.eggs); nothing for other code."""
    env, notice = eggs.spawn_env(ctx.code_dir, ctx.env)
    return SpawnAdditions(env, [notice] if notice else [])


PYTHON = Runtime("python", tool="uv", hooks=(_scrapy_items, _scrapyd_egg))
"""Any Python task may start Scrapy (``scrapy crawl``, a ``CrawlerProcess`` in main.py): Scrapy's
items hook is the runtime's, so a plain python spider's Scrapy crawl delivers its items too; and any
Python task may be a Scrapyd egg (its settings module and place on ``sys.path``: ckagent.code.eggs)."""
NODE = Runtime("node", tool="node", helpers=("npm",))
RUNTIMES: dict[str, Runtime] = {r.name: r for r in (PYTHON, NODE)}


@dataclass(frozen=True)
class Framework:
    """One framework (see the module docstring).

    ``command`` is the default argv (:data:`SPIDER_NAME` stands for the spider's name), run in the
    package root; ``needs`` the files it needs there (a package without them fails DEPLOY_FAILED
    before anything is installed); ``from_project`` refines it from the project's files (blocking:
    ``code_dir → (argv or None, what it followed)``; None argv: nothing to run) and then ``needs``
    is not checked; ``explains`` says in an error what the default runs. ``packages``: installed
    when the project declares no dependency file. ``markers``: files at the project root that show
    a project of this framework (detection; a marker one folder down is named in DEPLOY_FAILED).
    ``browsers``: the node's browsers its spiders use (``CK_CHROMIUM_PATH`` …; a missing one is
    said in the task's log). ``spider_names``: the spiders a project holds (blocking; for a
    default command with :data:`SPIDER_NAME`). ``hooks``: spawn hooks of its own. ``stop_grace``: the
    default stop grace of its tasks (seconds; None: the node's ``task.kill_grace``).
    """

    name: str
    runtime: Runtime
    title: str
    command: tuple[str, ...]
    needs: tuple[str, ...] = ()
    from_project: Callable[[Path], tuple[list[str] | None, str]] | None = None
    explains: str = ""
    packages: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()
    browsers: tuple[str, ...] = ()
    spider_names: Callable[[Path], list[str]] | None = None
    hooks: tuple[SpawnHook, ...] = ()
    stop_grace: float | None = None
    """Seconds from the stop signal to the kill that its spiders get by default (a task's
    ``stopGraceSeconds`` beats it; None: the node's ``task.kill_grace``)."""

    def default_argv(self, spider_name: str) -> list[str]:
        """:attr:`command` with the spider's name put in (no file access)."""
        return [spider_name if part == SPIDER_NAME else part for part in self.command]


def _browsers(ctx: SpawnContext) -> SpawnAdditions:
    """A line for the task's log when the node lacks a browser the framework's spiders use."""
    missing = [name for name in REGISTRY[ctx.framework].browsers if not ctx.env.get(BROWSER_VARS[name])]
    if not missing:
        return SpawnAdditions()
    names = " and ".join(missing)
    return SpawnAdditions(notices=[
        f"this node has no {names} ({', '.join(BROWSER_VARS[m] for m in missing)} unset): a {ctx.framework} spider "
        f"that drives the node's browser cannot start it; install it on the node (e.g. apt-get install chromium "
        "chromium-driver), or let the spider bring its own"])


REGISTRY: dict[str, Framework] = {f.name: f for f in (
    Framework("scrapy", PYTHON, "Scrapy", ("scrapy", "crawl", SPIDER_NAME), needs=("scrapy.cfg",),
              explains="a Scrapy task runs `scrapy crawl` in the project root, which must hold scrapy.cfg",
              packages=("scrapy",), markers=("scrapy.cfg", eggs.ENTRY_POINTS), spider_names=scrapy_spider_names,
              stop_grace=SCRAPY_STOP_GRACE),
    Framework("python", PYTHON, "Python", ("python", "main.py"), needs=("main.py",)),
    Framework("node", NODE, "Node", ("node", "index.js"), from_project=node_default_command,
              explains="a Node task runs package.json's scripts.start, else its main, else index.js",
              markers=("package.json",)),
    Framework("playwright", PYTHON, "Playwright", ("python", "main.py"), needs=("main.py",),
              packages=("playwright",), browsers=("chromium",), hooks=(_browsers,)),
    Framework("selenium", PYTHON, "Selenium", ("python", "main.py"), needs=("main.py",),
              packages=("selenium",), browsers=("chromium", "chromedriver"), hooks=(_browsers,)),
)}
"""Every framework by its wire value, in the protocol's order."""
DEFAULT = REGISTRY["python"]
"""What a project with no framework's marker is (``ckagent exec`` without ``--framework``)."""


class UnknownFramework(ValueError):
    """A framework name no record has (the message lists the known ones)."""


def framework(name: str) -> Framework:
    """The record of ``name``; raises UnknownFramework naming the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownFramework(f"unknown framework {name!r}: expected one of {', '.join(REGISTRY)}") from None


def names(runtime: Runtime | None = None) -> tuple[str, ...]:
    """The frameworks' names (of one runtime when given), in the registry's order."""
    return tuple(name for name, f in REGISTRY.items() if runtime is None or f.runtime is runtime)


def all_markers() -> tuple[str, ...]:
    """Every framework's marker files, once each, in the registry's order."""
    return tuple(dict.fromkeys(m for f in REGISTRY.values() for m in f.markers))


def detect(present: Callable[[str], bool], among: tuple[Framework, ...] | None = None) -> Framework | None:
    """The first framework (of ``among``, default all) with a marker for which ``present(name)``
    is true, or None."""
    for candidate in among if among is not None else tuple(REGISTRY.values()):
        if any(present(marker) for marker in candidate.markers):
            return candidate
    return None


def default_packages(name: str, code_dir: Path) -> tuple[str, ...]:
    """The packages a project without a dependency file gets (blocking: a few stats): those of the
    framework of the same runtime whose marker the project has (any Python code with a
    ``scrapy.cfg`` gets Scrapy), else those of ``name``."""
    own = framework(name)
    same_runtime = tuple(f for f in REGISTRY.values() if f.runtime is own.runtime)
    found = detect(lambda marker: (code_dir / marker).is_file(), same_runtime)
    return (found or own).packages


def has_spawn_hooks(name: str) -> bool:
    """Whether a task of framework ``name`` has spawn hooks at all (no thread hop for one that has none)."""
    record = framework(name)
    return bool(record.runtime.hooks or record.hooks)


def spawn_additions(ctx: SpawnContext) -> SpawnAdditions:
    """What the runtime's hooks, then the framework's, add at the spawn (blocking: hooks read files)."""
    record = framework(ctx.framework)
    out = SpawnAdditions()
    for hook in (*record.runtime.hooks, *record.hooks):
        out.add(hook(ctx))
    return out
