"""``ckagent supervise [-c CONFIG] [--live-port PORT] [--start-timeout S] [-- AGENT_ARGS...]``.

Started as PID 1 of a container (it works as any pid, too: then it is the child subreaper of what
it starts), in this order:

1. the credentials in its environment (``AGENT_REGISTRATION_TOKEN``, ``AGENT_API_KEY``) are moved into
   a memory file and the process re-executes itself without them (ckagent.node.secretenv, as ``ckagent
   run`` does), so no ``/proc/<pid>/environ`` of the pod shows them; it is made non-dumpable;
2. the settings it needs (``agent.port``, ``agent.bind``, ``logging.*``) are read in a forked child,
   so the supervisor never imports the settings' modules (YAML, the schema: ~6 MB it would hold for
   the pod's life); a configuration error exits 2 here, before anything starts;
3. the /livez listener binds (``--live-port``, else ``AGENT_LIVE_PORT``, else ``agent.port + 1``; on
   ``agent.bind``); with ``agent.port`` 0 the supervisor picks a free port once and gives it to every
   agent it starts (``AGENT_PORT``), so the probe knows where to ask and a restart keeps the port;
4. ``<this interpreter and this program> run [-c CONFIG] [AGENT_ARGS...]`` starts with the same
   environment and the memory file (ckagent.pod.supervisor has the rules from there on).

Exit codes: the supervisor's rules (ckagent.pod.supervisor); 2 for a usage or configuration error;
1 when the /livez port cannot be bound or the agent cannot be started at all.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ckagent.node.hardening import protect_agent_memory
from ckagent.node.secretenv import FD_ENV, reexec_without_secrets, secrets_fd
from ckagent.pod.fdstore import DescriptorStore
from ckagent.pod.livez import Health, LiveServer, Probe
from ckagent.pod.loop import Loop
from ckagent.pod.supervisor import AgentCommand, Supervisor, set_child_subreaper

log = logging.getLogger("ckagent.pod")

START_TIMEOUT = 120.0
"""Default ``--start-timeout`` (seconds)."""
LIVE_PORT_ENV = "AGENT_LIVE_PORT"
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
"""The agent's text lines (ckagent.node.logs.TEXT_FORMAT)."""


class UsageError(Exception):
    """A bad argument or configuration: the message says which; exit 2."""


@dataclass(frozen=True)
class Options:
    """The command line, parsed."""

    config: str | None
    live_port: int | None
    start_timeout: float
    agent_args: list[str]


@dataclass(frozen=True)
class NodeFacts:
    """What the supervisor needs of the agent's settings."""

    port: int
    bind: str
    log_level: str
    log_format: str


def parse(argv: Sequence[str]) -> Options:
    """Parse ``supervise``'s arguments (everything after ``--`` goes to ``ckagent run``). Raises UsageError;
    ``--help`` prints the usage and exits 0."""
    argv = list(argv)
    agent_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, agent_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(
        prog="ckagent supervise", description=(
            "Run the agent (`ckagent run`) as a child and keep it up: the container's PID 1. Restarts an "
            "agent that died unasked (it re-adopts the running crawls), forwards stop signals, reaps "
            "orphans, serves GET /livez. Arguments after -- go to `ckagent run`."),
        exit_on_error=False)
    parser.add_argument("-c", "--config", help="the agent's YAML config file (given to `ckagent run -c`)")
    parser.add_argument("--live-port", type=int, default=None,
                        help=f"port of GET /livez (default: {LIVE_PORT_ENV}, else agent.port + 1; 0 = any free port)")
    parser.add_argument("--start-timeout", type=float, default=START_TIMEOUT,
                        help="seconds a (re)starting agent may take to answer /healthz before /livez "
                             f"says 503 (default {START_TIMEOUT:g})")
    try:
        ns, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise UsageError(f"supervise: {exc}") from exc
    if unknown:
        raise UsageError(f"supervise: unknown arguments {' '.join(unknown)} (the agent's go after --)")
    if ns.live_port is not None and not 0 <= ns.live_port <= 65535:
        raise UsageError(f"supervise: --live-port {ns.live_port}: expected 0..65535")
    if not ns.start_timeout > 0 or ns.start_timeout == float("inf"):
        raise UsageError(f"supervise: --start-timeout {ns.start_timeout}: expected seconds > 0")
    return Options(ns.config, ns.live_port, ns.start_timeout, agent_args)


def read_node_facts(config: str | None) -> NodeFacts:
    """The settings the supervisor needs, read as ``ckagent run`` reads them (file + environment), in a
    forked child (module docstring). Raises UsageError for a configuration error. Blocking."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: load, answer, leave (os._exit: nothing of the parent's runs here)
        code = 1
        try:
            os.close(read_fd)
            try:
                from pathlib import Path

                from ckagent.node.config import ConfigError, load_settings

                settings = load_settings(None if config is None else Path(config), require_token=False)
                answer: dict[str, object] = {
                    "port": settings.agent.port, "bind": settings.agent.bind or settings.agent.ip,
                    "log_level": settings.logging.level, "log_format": settings.logging.format}
            except ConfigError as exc:
                answer = {"error": str(exc)}
            except Exception as exc:  # anything else: said, not raised in a forked copy of PID 1
                answer = {"error": f"the settings cannot be read: {type(exc).__name__}: {exc}"}
            os.write(write_fd, json.dumps(answer, default=str).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    os.waitpid(pid, 0)
    try:
        facts: dict[str, Any] = json.loads(b"".join(chunks))
    except ValueError:
        raise UsageError("the settings reader ended without an answer") from None
    if "error" in facts:
        raise UsageError(f"config error: {facts['error']}")
    return NodeFacts(int(facts["port"]), str(facts["bind"]), str(facts["log_level"]), str(facts["log_format"]))


def agent_prefix() -> list[str]:
    """The command that started this process up to its arguments (``python /opt/ckagent/ckagent.pyz``,
    ``python -m ckagent``, ``python .venv/bin/ckagent``), with this interpreter: the agent's starts the same.
    Anything else (``python -c``, an embedding program): ``python -m ckagent``."""
    orig = list(getattr(sys, "orig_argv", None) or [])
    tail = len(sys.argv) - 1
    if orig and sys.argv[0] != "-c" and 0 <= tail < len(orig) and orig[len(orig) - tail:] == sys.argv[1:]:
        prefix = orig[:len(orig) - tail]
    else:
        prefix = [sys.executable, "-m", "ckagent"]
    prefix[0] = sys.executable
    return prefix


def probe_host(bind: str) -> str:
    """Where the probe reaches an agent listening on ``bind`` (a wildcard: its loopback)."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(bind, bind)


def listen(bind: str, port: int) -> socket.socket:
    """A listening TCP socket on ``bind:port`` (0 = any free port). Raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


class _JsonFormatter(logging.Formatter):
    """The agent's JSON lines (ckagent.node.logs.JsonFormatter: time, level, logger, message), without
    that module's imports."""

    def format(self, record: logging.LogRecord) -> str:
        """One JSON object, one line."""
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry = {"time": f"{when}.{int(record.msecs):03d}+00:00", "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(facts: NodeFacts) -> None:
    """The supervisor's lines on stderr, in the agent's ``logging.format`` and ``logging.level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if facts.log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(getattr(logging, facts.log_level.upper(), logging.INFO))


def supervise(options: Options) -> int:
    """Steps 2–4 of the module docstring, then the supervisor's loop; returns the exit code.
    Raises UsageError (exit 2)."""
    facts = read_node_facts(options.config)
    _setup_logging(facts)
    if os.getpid() != 1:
        set_child_subreaper()
    env = dict(os.environ)
    agent_port = facts.port
    if agent_port == 0:
        with listen(facts.bind, 0) as sock:
            agent_port = int(sock.getsockname()[1])
        env["AGENT_PORT"] = str(agent_port)
    live_port = options.live_port
    if live_port is None:
        text = os.environ.get(LIVE_PORT_ENV, "").strip()
        if text:
            if not text.isdigit() or int(text) > 65535:
                raise UsageError(f"{LIVE_PORT_ENV}={text!r}: expected a port 0..65535")
            live_port = int(text)
        else:
            live_port = facts.port + 1 if facts.port else 0
    try:
        sock = listen(facts.bind, live_port)
    except OSError as exc:
        log.error("cannot listen on %s:%d for /livez: %s; set --live-port or %s",
                  facts.bind, live_port, exc.strerror or exc, LIVE_PORT_ENV)
        return 1
    loop = Loop()
    health = Health(loop, Probe(loop, (probe_host(facts.bind), agent_port)), options.start_timeout)
    LiveServer(loop, sock, health)
    shown = f"[{facts.bind}]" if ":" in facts.bind else facts.bind
    log.info("supervise: pid %d; /livez on http://%s:%d/livez; the agent's /healthz on port %d",
             os.getpid(), shown, int(sock.getsockname()[1]), agent_port)
    argv = [*agent_prefix(), "run", *(["-c", options.config] if options.config else []), *options.agent_args]
    fd = secrets_fd()
    command = AgentCommand(argv, env, fd_vars=() if fd is None else ((FD_ENV, fd),))
    return Supervisor(loop, command, health, fdstore=DescriptorStore(loop)).run()


def main(argv: Sequence[str]) -> NoReturn:
    """Entry point of ``ckagent supervise`` (``argv``: its arguments); exits with the supervisor's code."""
    reexec_without_secrets()  # first: nothing may start with the token in its environment
    protect_agent_memory()
    try:
        code = supervise(parse(argv))
    except UsageError as exc:
        print(f"ckagent: {exc}", file=sys.stderr)
        code = 2
    logging.shutdown()
    sys.exit(code)
