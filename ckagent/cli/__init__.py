"""The ``ckagent`` command line (cyclopts). Argument handling only: every command delegates.

Commands::

    ckagent [-c FILE]                 same as `ckagent run -c FILE`
    ckagent run [-c FILE] [--exit-when-idle S] [--max-tasks N]   run the agent until SIGTERM/SIGINT (or idle / N tasks done)
    ckagent stop [--migrate] -c FILE  stop the agent of that config's work dir (drain / migrate), wait (stopagent.py)
    ckagent config check [-c FILE]    validate the configuration, say which containment and egress levels
                                      this node gets and what would raise each, print "config OK: FILE"
    ckagent config show [-c FILE]     print the effective settings as YAML (secrets masked)
    ckagent version                   print the ckagent and Python versions
    ckagent supervise [-c FILE] [-- ARGS]   a pod's PID 1: runs `run` as its child, keeps it up (ckagent.pod)
    ckagent dev-master ...            run the reference master (SQLite)
    ckagent demo [--work-dir DIR] [--keep] [-c FILE]   dev master + agent + example spiders, end to end, checked
    ckagent exec PATH [--spider NAME] [--param K=V ...] [--env K=V ...] [--args "..."] [--items FILE] [--artifacts DIR] ...
                                      run one local spider (folder or zip) exactly as a node would

Exit codes (ckagent.node.errors, translated once in :func:`main`): 0 ok; 2 usage or configuration error
(``ckagent: config error: <msg>`` on stderr); 1 the agent cannot run (``ckagent: cannot run: <msg>``,
unless the agent's log already said it on stderr); 3 (``run``) an ephemeral worker stopped with results
undelivered (ckagent.node.ephemeral).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import platform
import shlex
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from ckagent import __version__
from ckagent.cli.devmastercheck import dev_master_db_problem, listen_problem
from ckagent.node.config import (
    ConfigError,
    Settings,
    load_settings,
    missing_token_message,
    suspicious_env_vars,
)
from ckagent.node.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, StartupError
from ckagent.node.lazycli import defer_httpx_cli

if TYPE_CHECKING:
    from cyclopts import App, Parameter

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "main"]

# Start-up time: `ckagent run -c FILE` (what run.sh and the service units start) is parsed by
# :func:`_plain_run` without importing cyclopts (~40 ms with its dependencies); every other
# command line goes to cyclopts, built on first use by :func:`_app`. The commands below are plain
# functions whose cyclopts annotations are strings (``from __future__ import annotations``):
# cyclopts resolves them from this module's globals when ``_app()`` registers the commands, after
# ``_app()`` has put ``Parameter`` and ``ConfigOption`` there.
if TYPE_CHECKING:
    ConfigOption = Annotated[Path | None, Parameter(name=["--config", "-c"])]


def _config_option() -> object:
    from cyclopts import Parameter

    return Annotated[
        Path | None,
        Parameter(
            name=["--config", "-c"],
            help="YAML config file. Without it: defaults + AGENT_* environment variables only.",
        ),
    ]


@cache
def _app() -> App:
    """The cyclopts application (imports cyclopts; built once)."""
    from cyclopts import App, Parameter

    globals().update(Parameter=Parameter, ConfigOption=_config_option())
    app = App(
        name="ckagent",
        help="CrawlerKeeper node agent: runs spiders and ships their logs, items and results to the master.",
        version=__version__,
        result_action="return_value",
    )
    config_app = App(name="config", help="Validate or show the agent configuration.",
                     result_action="return_value")
    app.command(config_app)
    app.default(_default)
    config_app.default(_config_default)
    app.command(run)
    from ckagent.cli.stopagent import stop_command
    app.command(stop_command, name="stop")
    config_app.command(check)
    config_app.command(show)
    app.command(version_command, name="version")
    app.command(dev_master, name="dev-master")
    app.command(demo_command, name="demo")
    app.command(exec_command, name="exec")
    from ckagent.cli.supervise import supervise_command
    app.command(supervise_command, name="supervise")
    return app


class _UsageError(Exception):
    """A usage problem that cyclopts cannot see (e.g. a required value missing from flag and env)."""


def _load(config: Path | None, *, require_token: bool) -> Settings:
    return load_settings(config, require_token=require_token)


def _default(*, config: ConfigOption = None) -> int:
    """Without a command: `ckagent -c FILE` runs the agent; bare `ckagent` prints this help."""
    if config is None:
        _app().help_print([])
        return EXIT_USAGE
    return run(config=config)


def _config_default() -> int:
    """Without a subcommand: print this help (exit 2)."""
    _app()["config"].help_print([])
    return EXIT_USAGE


def run(*, config: ConfigOption = None, exit_when_idle: str | None = None, max_tasks: str | None = None) -> int:
    """Run the agent: register, heartbeat, poll and run tasks until SIGTERM (drain) or SIGINT (stop).

    Needs a registration token (agent.registration_token or AGENT_REGISTRATION_TOKEN). A token or
    key in the environment is first moved out of it: the process re-executes itself (same pid)
    with the credentials in a memory file (ckagent.node.secretenv), so /proc/<pid>/environ never shows them.

    Parameters
    ----------
    exit_when_idle
        SECONDS (> 0): an ephemeral worker stops (a drain), leaves the master and exits 0 after this long with
        no task claimed, running or undelivered (agent.exit_when_idle).
    max_tasks
        N (>= 1): claim at most N tasks in the agent's life, then stop once they are delivered and exit 0
        (agent.max_tasks).
    """
    from ckagent.cli.runflags import RunFlags
    from ckagent.node.secretenv import reexec_without_secrets

    try:
        flags = RunFlags.parse(exit_when_idle, max_tasks)
    except ValueError as exc:
        raise _UsageError(f"run: {exc}") from None
    reexec_without_secrets()
    settings = flags.apply(_load(config, require_token=True))
    with _httpx_without_its_cli():
        from ckagent.cli.runagent import run_agent

    return run_agent(settings)


@contextlib.contextmanager
def _httpx_without_its_cli() -> Iterator[None]:
    """Within the block, ``import httpx`` skips httpx's command-line client: ~50 ms less start-up.

    ``httpx/__init__.py`` runs ``from ._main import main`` in a ``try``/``except ImportError`` that falls
    back to a stub ``main`` (installs without ``httpx[cli]``). ``httpx._main`` imports click, rich and
    pygments whenever they are installed (rich is: cyclopts needs it), none of which the agent uses. A
    ``None`` entry in ``sys.modules`` makes one import raise ImportError (Python's documented way), so
    httpx takes its fallback; the entry is removed on leaving. The only difference in this process:
    ``httpx.main`` is the stub. Nothing changes when httpx is already imported (tests/test_cli.py)."""
    if "httpx" in sys.modules or "httpx._main" in sys.modules:
        yield
        return
    sys.modules["httpx._main"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "httpx._main" in sys.modules and sys.modules["httpx._main"] is None:
            del sys.modules["httpx._main"]


def check(*, config: ConfigOption = None) -> int:
    """Validate the configuration (file and environment), say which containment, egress and identity
    levels this node gets with it (identity: whom spiders run as), why, and what would raise each; then
    print "config OK: FILE".

    Runs the checks `ckagent run` runs (values, then users, paths and the port on this node, then the
    levels: a named level this node cannot have is an error, as at the start). A missing registration
    token and a port in use now are only warnings here (`ckagent run` refuses both). The levels are
    judged without changing the machine (probes remove what they make), for an agent started as this
    command is (its user and cgroup).
    """
    from ckagent.code.pyplan import bundled_sdk_dir
    from ckagent.containment.levelcheck import check_levels
    from ckagent.node.preflight import preflight

    settings = _load(config, require_token=False)
    if settings.agent.registration_token is None:
        print(f"warning: {missing_token_message()}", file=sys.stderr)
    for line in suspicious_env_vars():
        print(f"warning: {line}", file=sys.stderr)
    problems = preflight(settings)
    for problem in problems:
        print(f"{'error' if problem.error else 'warning'}: {problem.message}", file=sys.stderr)
    levels = check_levels(settings, sdk_dir=bundled_sdk_dir())
    print("\n".join(levels.lines))
    for error in levels.errors:
        print(f"error: {error}", file=sys.stderr)
    errors = len([p for p in problems if p.error]) + len(levels.errors)
    if errors:
        raise ConfigError(f"{errors} setting(s) cannot be used on this node (see above)")
    where = str(settings.config_file) if settings.config_file is not None else "(no file: defaults + environment)"
    print(f"config OK: {where}")
    return EXIT_OK


def show(*, config: ConfigOption = None) -> int:
    """Print the effective settings (defaults < file < environment) as YAML; secrets show as ***."""
    import yaml

    settings = _load(config, require_token=False)
    source = str(settings.config_file) if settings.config_file is not None else "no file"
    print(f"# effective ckagent settings ({source}; environment applied; secrets masked)")
    print(yaml.safe_dump(settings.redacted(), sort_keys=False, allow_unicode=True), end="")
    return EXIT_OK


def version_command() -> int:
    """Print the ckagent version and the Python it runs on."""
    print(f"ckagent {__version__} (Python {platform.python_version()}, {platform.python_implementation()})")
    return EXIT_OK


def dev_master(
    *,
    db: Path = Path("master.sqlite"),
    host: str = "127.0.0.1",
    port: int = 8080,
    registration_token: Annotated[str | None, Parameter(env_var="DEVMASTER_REGISTRATION_TOKEN")] = None,
    admin_token: Annotated[str | None, Parameter(env_var="DEVMASTER_ADMIN_TOKEN")] = None,
    public_url: Annotated[str | None, Parameter(env_var="DEVMASTER_PUBLIC_URL")] = None,
    node_lost_after: float = 600.0,
) -> int:
    """Run the reference master (protocol + admin API over SQLite) until Ctrl-C.

    Parameters
    ----------
    db
        SQLite database file (created if missing).
    host
        Address to listen on.
    port
        TCP port to listen on (0 = any free port).
    registration_token
        Token agents must send to register. Prefer the environment variable: flags show up in `ps`.
    admin_token
        Bearer token for the admin API. Prefer the environment variable.
    public_url
        The URL agents reach this master at (e.g. behind a proxy), used in the code package URLs it
        hands out. Unset (the default): the URLs are relative, resolved by each agent against its
        server.url.
    node_lost_after
        Seconds without a heartbeat after which a node is lost: its running tasks end their attempt
        NODE_LOST and get a new one, from their last checkpoint. Default 600, the protocol's restart grace.
    """
    if not registration_token:
        raise _UsageError("dev-master needs --registration-token or DEVMASTER_REGISTRATION_TOKEN")
    if not admin_token:
        raise _UsageError("dev-master needs --admin-token or DEVMASTER_ADMIN_TOKEN")
    if not 0 <= port <= 65535:
        raise _UsageError(f"--port: expected 0..65535, got {port}")
    if not node_lost_after > 0:
        raise _UsageError(f"--node-lost-after: expected seconds > 0, got {node_lost_after}")
    if (unusable := dev_master_db_problem(db)) is not None:
        raise _UsageError(unusable)
    problem = listen_problem(host, port)
    if problem:
        print(f"ckagent: dev-master cannot listen on {host}:{port}: {problem}; choose another --port "
              "(0 = any free port) or --host", file=sys.stderr)
        return EXIT_FAILURE
    from ckagent.devmaster.server import serve_forever

    serve_forever(
        db_path=db, host=host, port=port, registration_token=registration_token, admin_token=admin_token,
        public_url=public_url, node_lost_after=node_lost_after,
    )
    return EXIT_OK


def demo_command(*, work_dir: Path = Path("demo-data"), keep: bool = False, config: ConfigOption = None) -> int:
    """Run the reference master, an agent and the example spiders end to end, print a table and check
    every spider's items against the demo shop (exit 1 when one differs).

    The agent takes its settings as `ckagent run` does (AGENT_* variables over -c FILE: e.g.
    AGENT_TASK_EGRESS=proxy), except its master, token, name, address, work dir and log, which are
    the demo's.

    Parameters
    ----------
    work_dir
        Directory for the demo's data: master database, agent work dir, agent log (default ./demo-data).
    keep
        Keep the master and the agent running afterwards (Ctrl-C stops them), to look around.
    config
        A config file for the demo's agent (as `ckagent run -c`); AGENT_* variables override it.
    """
    from ckagent.cli.demo import run_demo

    return run_demo(work_dir=work_dir, keep=keep, config=config)


def exec_command(
    path: Path | None = None,
    /,
    *,
    spider: str | None = None,
    framework: str | None = None,
    command: str | None = None,
    param: Annotated[list[str] | None, Parameter(consume_multiple=True)] = None,
    env: Annotated[list[str] | None, Parameter(consume_multiple=True)] = None,
    timeout: float | None = None,
    stall_timeout: float | None = None,
    items: Path = Path("items.jsonl"),
    artifacts: Path = Path("artifacts"),
    args: str | None = None,
    output_items: list[str] | None = None,
    output_artifacts: list[str] | None = None,
    work_dir: Path | None = None,
    config: ConfigOption = None,
) -> int:
    """Run one spider from a local folder or zip exactly as a node runs it, without a master.

    The same package checks, dependency install, environment, containment, capture, items and stats
    as on a node. The log streams to stdout; items go to --items; the end says the outcome, the
    counts and the resource figures. Exit code: 0 success, 1 failed, 3 not started (deploy or
    dependencies), 124 timeout, 130 cancelled (Ctrl-C), 2 usage error.

    Parameters
    ----------
    path
        The spider's folder (zipped like an upload), its .zip package, or a Scrapyd .egg (scrapyd-deploy --build-egg).
    spider
        The spider's name. Scrapy: what `scrapy crawl NAME` runs; default: the project's only spider
        (a project with several needs it). Others: default the folder's name.
    framework
        scrapy, python, node, playwright or selenium (default: scrapy.cfg → scrapy, package.json → node, else python).
    command
        The command to run instead of the framework's default (split like a shell does).
    param
        Task parameters NAME=VALUE (VALUE as JSON when it is valid JSON, else text): --param a=1 b=2, or one --param each.
    env
        Environment variables NAME=VALUE for the spider: --env A=1 B=2, or one --env each.
    timeout
        Run-time limit in seconds (default: the agent's task.execute_timeout; 0 = none).
    stall_timeout
        Stop the spider as STALLED after this many seconds without output, items or stats (default: the
        agent's task.stall_timeout, off; 0 = off).
    items
        JSON lines file the items are written to (default ./items.jsonl); replaced, a non-empty one is said first.
    artifacts
        Folder the task's artifacts (files it created or changed) are written to (default ./artifacts/).
    args
        Arguments appended to the command, like a task's args (split like a shell does); write --args="--max-pages 2" when they start with a dash.
    output_items
        A glob of item files the spider writes (outputs.items, e.g. results.json); repeatable.
    output_artifacts
        A glob of the files that are its artifacts (outputs.artifacts; default: every file it created or changed); repeatable.
    work_dir
        Agent work dir: environments are cached here for the next run (default ~/.cache/ckagent/exec).
    """
    from ckagent.cli.execargs import split_path
    from ckagent.cli.localrun import (
        ExecRequest,
        ExecUsageError,
        default_work_dir,
        exec_main,
        parse_assignments,
    )

    try:
        path, env, param = split_path(path, env or [], param or [])
        params = parse_assignments(param, "--param", json_values=True)
        spider_env = {k: str(v) for k, v in parse_assignments(env, "--env", json_values=False).items()}
    except ExecUsageError as exc:
        raise _UsageError(f"exec: {exc}") from exc
    try:
        task_args = shlex.split(args) if args else []
    except ValueError as exc:
        raise _UsageError(f"exec: --args {args!r}: {exc}") from exc
    outputs = None
    if output_items or output_artifacts:
        from ckagent.master.protocol import ProtocolError, TaskOutputs
        try:
            declared = TaskOutputs.from_json({"items": output_items or [], "artifacts": output_artifacts or []})
        except ProtocolError as exc:
            raise _UsageError(f"exec: --output-items/--output-artifacts: {exc}") from exc
        outputs = None if declared is None else declared.to_json()
    for flag, seconds in (("--timeout", timeout), ("--stall-timeout", stall_timeout)):
        if seconds is not None and not (seconds >= 0 and seconds != float("inf")):
            raise _UsageError(f"exec: {flag} {seconds}: expected seconds >= 0")
    request = ExecRequest(
        source=path, items=items.absolute(), work_dir=(work_dir or default_work_dir()).absolute(),
        framework=framework, command=command, spider=spider, params=params, env=spider_env,
        timeout=timeout, stall_timeout=stall_timeout, config=config,
        artifacts=artifacts.absolute(), args=task_args, outputs=outputs,
    )
    return exec_main(request)


def _unknown_command(tokens: list[str]) -> str | None:
    """A message if the leading words name no command (cyclopts would call them "unused tokens")."""
    group, path = _app(), ""
    for word in tokens:
        if word.startswith("-"):
            return None
        if word not in group:
            commands = [name for name in group if not name.startswith("-")]
            close = difflib.get_close_matches(word, commands, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; commands: {', '.join(commands)}"
            return f"unknown command {path + word!r}{hint}"
        sub = group[word]
        if not any(not name.startswith("-") for name in sub):
            return None  # a leaf command: the rest are its arguments
        group, path = sub, f"{path}{word} "
    return None


def _plain_run(tokens: list[str]) -> tuple[bool, Path | None]:
    """Whether ``tokens`` is a plain ``[run] [-c FILE | --config FILE | --config=FILE]``, and its FILE.

    Plain lines are what run.sh and the service manifests start; for them ``(True, FILE or None)``
    is what cyclopts would pass to :func:`run`. Anything else (help, other commands, repeated or
    unusual options, a value that looks like an option, bare ``ckagent``) is ``(False, None)``:
    cyclopts parses it.
    """
    rest = tokens[1:] if tokens[:1] == ["run"] else tokens
    if rest is tokens and not rest:
        return False, None  # bare `ckagent` prints the help
    if not rest:
        return True, None
    if len(rest) == 2 and rest[0] in ("-c", "--config"):
        value = rest[1]
    elif len(rest) == 1 and rest[0].startswith("--config="):
        value = rest[0].partition("=")[2]
    else:
        return False, None
    if not value or value.startswith("-"):
        return False, None
    return True, Path(value)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: parse ``argv`` (default ``sys.argv[1:]``), run the command, ``sys.exit`` with its code.

    Never returns: exits 0 on success, 2 on usage/config errors, else the command's code (1 = failure).
    """
    defer_httpx_cli()  # (before anything imports httpx: rich, click and pygments stay out of the start)
    tokens = sys.argv[1:] if argv is None else argv
    if tokens[:1] == ["supervise"]:  # (its own parser, ckagent.pod.command; ckagent/__main__.py comes here first)
        from ckagent.cli.supervise import supervise_main
        supervise_main(tokens[1:])
    plain, config = _plain_run(tokens)
    try:
        if plain:  # without cyclopts: see the comment above _app()
            result: object = run(config=config)
        else:
            result = _cyclopts_main(tokens)
        sys.stdout.flush()
    except BrokenPipeError:
        # `ckagent config show | head -1`: the reader left. No traceback; stdout goes to /dev/null so
        # that the interpreter's final flush does not fail again (Python's documented recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_FAILURE)
    except StartupError as exc:  # the one place an error becomes an exit code (ckagent.node.errors)
        if not exc.logged:
            print(f"ckagent: {exc.label}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except _UsageError as exc:
        print(f"ckagent: {exc}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    sys.exit(result if isinstance(result, int) else EXIT_OK)


def _cyclopts_main(tokens: list[str]) -> object:
    """Run ``tokens`` through cyclopts; exits 2 (after printing why) for an unknown command or bad usage."""
    from cyclopts.exceptions import CycloptsError

    unknown = _unknown_command(tokens)
    if unknown:
        print(f"ckagent: {unknown}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    try:
        return _app()(tokens, exit_on_error=False, print_error=True)
    except CycloptsError:
        # cyclopts already printed the problem (to stderr).
        sys.exit(EXIT_USAGE)
