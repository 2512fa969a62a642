"""Agent configuration: one YAML file plus ``AGENT_*`` environment variables → one frozen :class:`Settings`.

Precedence (lowest to highest): built-in defaults < YAML file < environment. Every setting has exactly
one environment variable; :data:`SETTINGS` is the single table that the loader, ``ckagent config show``,
``docs/configuration.md``, the README table and the sync test all derive from.

Rules shared by both sources:

* YAML ``null`` (or an empty value) and an empty environment variable both mean "not set": the
  next-lower source (finally the default) applies.
* Relative paths are made absolute against the current directory at load time; ``~`` is expanded.
* Secrets (:class:`Secret`) never appear in ``repr``/``str``, :meth:`Settings.redacted` or any error message.

Exception tree::

    Exception
    └── ConfigError      bad file (missing, unreadable, YAML syntax, unknown key, wrong type, out of
                         range) or bad environment variable; the message names ``file:line:column``
                         or the variable, and says what was expected.

Unknown ``AGENT_*`` environment variables are ignored (other tools use that prefix too);
:func:`suspicious_env_vars` lists the ones that look like misspelled settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import hmac
import ipaddress
import math
import os
import re
import socket
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

from ckagent.node.errors import EXIT_USAGE, StartupError
from ckagent.node.secretenv import agent_environ

__all__ = [
    "SETTINGS",
    "AgentSettings",
    "ConfigError",
    "DepsSettings",
    "HeartbeatSettings",
    "LoggingSettings",
    "Secret",
    "ServerSettings",
    "Setting",
    "Settings",
    "TaskSettings",
    "load_settings",
    "replace_marked_block",
    "settings_markdown_table",
    "suspicious_env_vars",
]

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["text", "json"]

TABLE_START_MARKER = "<!-- config-table:start -->"
TABLE_END_MARKER = "<!-- config-table:end -->"


class ConfigError(StartupError):
    """The configuration is unusable. ``str(err)`` is one line naming ``file:line:column`` or the env var.

    The message never contains a secret value. Exit code 2 (ckagent.node.errors).
    """

    exit_code = EXIT_USAGE
    label = "config error"


class Secret:
    """A string that must not leak: ``repr``/``str``/``format`` all give ``***``.

    Call :meth:`reveal` at the one place that needs the value (an HTTP header). Equality compares the
    values (in constant time); a ``Secret`` never equals a plain ``str``.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """Return the secret value itself."""
        return self._value

    def __repr__(self) -> str:
        return "***"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(("Secret", self._value))


# --------------------------------------------------------------------------------------------------
# Settings objects


@dataclass(frozen=True)
class ServerSettings:
    """How to reach the master.

    ``url``: base URL, http(s). ``ca_file``: extra CA bundle (PEM) for TLS, or None for the system store.
    ``request_timeout``: seconds per HTTP request (a long poll adds its wait on top).
    ``refusal_timeout``: seconds a stream or result retries a 404 (a lone element's 413) before giving up.
    ``download_stall_timeout``: seconds a code download may receive nothing before it is retried.
    """

    url: str
    ca_file: Path | None
    request_timeout: float
    refusal_timeout: float = 600.0
    download_stall_timeout: float = 30.0


@dataclass(frozen=True)
class AgentSettings:
    """Who this node is.

    ``port`` is the agent's own status/metrics port (0 = any free port); it listens on ``bind``
    (None = ``ip``). ``labels`` is a read-only mapping str→str.
    ``max_workers`` None = derived from the machine; ``container_cpu_limit`` is a Kubernetes-style CPU
    quantity ("2000m", "4", "1.5") or None (see :attr:`container_cpu_limit_cores`). ``auto_upgrade``:
    follow the master's desired agent version through run.sh (ckagent.master.fleet).
    """

    name: str
    ip: str
    port: int
    bind: str | None
    registration_token: Secret | None
    labels: Mapping[str, str]
    max_workers: int | None
    container_cpu_limit: str | None
    auto_upgrade: bool

    @property
    def container_cpu_limit_cores(self) -> float | None:
        """``container_cpu_limit`` in CPU cores ("2000m" → 2.0), or None when not set."""
        if self.container_cpu_limit is None:
            return None
        return _cpu_quantity_cores(self.container_cpu_limit)


@dataclass(frozen=True)
class HeartbeatSettings:
    """``interval``: seconds between heartbeats."""

    interval: float


@dataclass(frozen=True)
class TaskSettings:
    """Task polling and execution (all durations in seconds).

    ``long_poll_wait`` 0 disables the long poll; ``execute_timeout`` 0 means no limit and applies when a
    task carries no timeout; ``kill_grace`` is SIGTERM → SIGKILL; ``drain_timeout`` bounds DRAINING;
    ``flush_timeout`` bounds the final delivery when stopping. ``work_dir`` is absolute.
    ``run_as_user``: user name (or uid) spiders run as when the agent is root; None = the agent's user.
    Task data: ``max_log_bytes`` caps a task's output.log and ``min_free_disk_bytes`` is the free-space
    floor of the work dir's filesystem (bytes, 0 = none); ``max_artifact_bytes`` the most bytes of a
    task's artifacts shipped to the master (0 = none: all kept on the node); ``log_files`` comma-separated globs of spider
    log files under the task dir; ``retention`` seconds a delivered task dir is kept (0 = forever);
    ``cleanup_temp_files`` deletes every delivered task dir at start. ``stall_timeout``: seconds
    without output, item or stats change before a task is stopped STALLED (0 = off).
    ``containment``: ``auto`` or a level of :data:`ckagent.containment.LEVELS`; node default limits
    of a task that names none: ``memory_limit_bytes`` (bytes), ``pids_limit``, ``cpus_limit``
    (cores); None = no limit. ``egress``: ``auto`` or a level of :data:`ckagent.containment.egress.LEVELS`;
    ``egress_deny`` / ``egress_allow``: comma-separated entries of :mod:`ckagent.node.egress_policy`.
    """

    poll_interval: float
    long_poll_wait: float
    work_dir: Path
    execute_timeout: float
    kill_grace: float
    drain_timeout: float
    flush_timeout: float
    run_as_user: str | None
    max_log_bytes: int
    min_free_disk_bytes: int
    max_artifact_bytes: int
    log_files: str
    retention: float
    cleanup_temp_files: bool
    stall_timeout: float
    containment: str
    memory_limit_bytes: int | None
    pids_limit: int | None
    cpus_limit: float | None
    egress: str
    egress_deny: str
    egress_allow: str


@dataclass(frozen=True)
class LoggingSettings:
    """``level`` (upper case), ``file`` (None = stderr only), ``format`` ("text" or "json").

    ``max_bytes``: the file is rotated when it would grow beyond this size (bytes); ``backup_count``
    rotated files are kept (>= 1).
    """

    level: LogLevel
    file: Path | None
    format: LogFormat
    max_bytes: int
    backup_count: int


@dataclass(frozen=True)
class DepsSettings:
    """Dependency installation with uv. ``uv_sync_timeout`` in seconds; ``uv_path`` used when uv is not on PATH."""

    uv_index_url: str | None
    uv_fallback_index_url: str
    uv_cache_dir: Path | None
    uv_sync_timeout: float
    uv_path: Path | None
    env_budget_bytes: int
    python: Path | None = None


@dataclass(frozen=True)
class Settings:
    """The whole, validated agent configuration. Immutable; build it with :func:`load_settings`.

    ``config_file`` is the YAML file it was loaded from (absolute), or None.
    """

    server: ServerSettings
    agent: AgentSettings
    heartbeat: HeartbeatSettings
    task: TaskSettings
    logging: LoggingSettings
    deps: DepsSettings
    config_file: Path | None = None

    def redacted(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict ``{section: {key: value}}`` safe to print: secrets "***", paths str, labels dict."""
        out: dict[str, dict[str, Any]] = {}
        for section in SECTIONS:
            values: dict[str, Any] = {}
            section_obj = getattr(self, section)
            for spec in _specs_in(section):
                value = getattr(section_obj, spec.key)
                if isinstance(value, Secret):
                    value = "***"
                elif isinstance(value, Path):
                    value = str(value)
                elif isinstance(value, Mapping):
                    value = dict(value)
                values[spec.key] = value
            out[section] = values
        return out


# --------------------------------------------------------------------------------------------------
# Value parsers. Each takes the raw text (env value or YAML scalar source text) and returns the value,
# or raises _Invalid. The caller adds where the value came from and (unless secret) what it was.


class _Invalid(ValueError):
    def __init__(self, problem: str, *, show_value: bool = True) -> None:
        super().__init__(problem)
        self.problem = problem
        self.show_value = show_value


def _seconds(*, minimum: float = 0.0, exclusive: bool = True, maximum: float | None = None) -> Callable[[str], float]:
    if maximum is not None:
        expected = f"a number of seconds {minimum:g}..{maximum:g}"
    elif exclusive:
        expected = f"a number of seconds > {minimum:g}"
    else:
        expected = f"a number of seconds >= {minimum:g}"

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise _Invalid(f"expected {expected}") from None
        if (
            not math.isfinite(value)
            or value < minimum
            or (exclusive and value == minimum)
            or (maximum is not None and value > maximum)
        ):
            raise _Invalid(f"expected {expected}")
        return value

    return parse


def _integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    expected = f"an integer {minimum}..{maximum}" if maximum is not None else f"an integer >= {minimum}"

    def parse(raw: str) -> int:
        try:
            value = int(raw, 10)
        except ValueError:
            raise _Invalid(f"expected {expected}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise _Invalid(f"expected {expected}")
        return value

    return parse


def _boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise _Invalid("expected on/off (or true/false, yes/no, 1/0)")


def _globs(raw: str) -> str:
    patterns = [p.strip() for p in raw.split(",") if p.strip()]
    for pattern in patterns:
        if pattern.startswith("/") or ".." in pattern.split("/"):
            raise _Invalid("expected glob patterns relative to the task dir (no leading '/', no '..')")
    return ",".join(patterns)


def _text(raw: str) -> str:
    if not raw.strip():
        raise _Invalid("expected a non-empty string")
    return raw.strip()


def _secret(raw: str) -> Secret:
    if not raw.strip():
        raise _Invalid("expected a non-empty string", show_value=False)
    return Secret(raw.strip())


def _http_url(raw: str) -> str:
    value = raw.strip()
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        raise _Invalid("expected an http:// or https:// URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Invalid("expected an http:// or https:// URL")
    if parts.username is not None or parts.password is not None:
        # A password in a URL ends up in logs and `config show`; the node authenticates with its tokens.
        raise _Invalid("must not contain a user name or password (user:pass@); the agent authenticates "
                       "with agent.registration_token and its API key", show_value=False)
    return value


def _path(raw: str) -> Path:
    if not raw.strip():
        raise _Invalid("expected a path")
    return Path(os.path.abspath(os.path.expanduser(raw.strip())))


def _readable_file(raw: str) -> Path:
    path = _path(raw)
    if not path.exists():
        raise _Invalid(f"file not found: {path}", show_value=False)
    if not path.is_file():
        raise _Invalid(f"not a regular file: {path}", show_value=False)
    if not os.access(path, os.R_OK):
        raise _Invalid(f"file not readable: {path}", show_value=False)
    return path


def _egress_deny(raw: str) -> str:
    from ckagent.node.egress_policy import PolicyError, parse_deny

    try:
        return ",".join(parse_deny(raw.split(",")).to_json()["deny"])
    except PolicyError as exc:
        raise _Invalid(str(exc).removeprefix("deny: ")) from None


def _egress_allow(raw: str) -> str:
    from ckagent.node.egress_policy import PolicyError, parse_allow

    try:
        return ",".join(parse_allow(raw.split(",")).to_json()["allow"])
    except PolicyError as exc:
        raise _Invalid(str(exc).removeprefix("allow: ")) from None


def _ip(raw: str) -> str:
    try:
        return str(ipaddress.ip_address(raw.strip()))
    except ValueError:
        raise _Invalid("expected an IPv4 or IPv6 address") from None


def _choice(options: tuple[str, ...], *, upper: bool) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().upper() if upper else raw.strip().lower()
        if value not in options:
            raise _Invalid(f"expected one of {', '.join(options)}")
        return value

    return parse


_CPU_QUANTITY = re.compile(r"^(?:(?P<milli>[0-9]+)m|(?P<cores>[0-9]+(?:\.[0-9]+)?))$")


def _cpu_quantity_cores(raw: str) -> float:
    match = _CPU_QUANTITY.match(raw.strip())
    if match is None:
        raise _Invalid('expected a CPU quantity like "2000m", "4" or "1.5"')
    cores = int(match["milli"]) / 1000 if match["milli"] is not None else float(match["cores"])
    if cores <= 0:
        raise _Invalid("expected a CPU quantity > 0")
    return cores


def _cpu_quantity(raw: str) -> str:
    _cpu_quantity_cores(raw)
    return raw.strip()


def _label_key(key: str) -> str:
    key = key.strip()
    if not key or "=" in key or "," in key:
        raise _Invalid("expected label keys to be non-empty and contain no '=' or ','")
    return key


def _labels(raw: str) -> Mapping[str, str]:
    labels: dict[str, str] = {}
    for entry in raw.split(","):
        if not entry.strip():
            continue
        key, sep, value = entry.partition("=")
        if not sep:
            raise _Invalid("expected key=value pairs separated by commas")
        key = _label_key(key)
        if key in labels:
            raise _Invalid(f"label {key!r} given twice")
        labels[key] = value.strip()
    return types.MappingProxyType(labels)


# --------------------------------------------------------------------------------------------------
# The table


class _Dynamic:
    """Marker for defaults computed at load time."""

    def __init__(self, doc: str) -> None:
        self.doc = doc

    def __repr__(self) -> str:
        return self.doc


_HOSTNAME = _Dynamic("the host name")
_AUTO_IP = _Dynamic("auto-detected")
_EMPTY_LABELS: Mapping[str, str] = types.MappingProxyType({})


@dataclass(frozen=True)
class Setting:
    """One row of :data:`SETTINGS`.

    ``type_doc`` and ``doc`` are for humans (docs/README); ``default`` is the value used when neither the
    file nor the environment sets it (None = unset/optional); ``parse`` turns raw text into the value;
    ``mapping`` marks a setting that is a YAML mapping (labels).
    """

    section: str
    key: str
    env: str
    type_doc: str
    default: Any
    doc: str
    parse: Callable[[str], Any]
    secret: bool = False
    mapping: bool = False

    @property
    def dotted(self) -> str:
        """``section.key``."""
        return f"{self.section}.{self.key}"

    @property
    def default_doc(self) -> str:
        """The default as shown in the docs table."""
        d = self.default
        if isinstance(d, _Dynamic):
            return d.doc
        if d is None:
            return "—"
        if isinstance(d, Mapping):
            return f"`{dict(d)}`"
        if isinstance(d, Path) and not d.is_absolute():
            return f"`./{d}`"
        if isinstance(d, float):
            return f"`{d:g}`"
        return f"`{d}`"


SETTINGS: tuple[Setting, ...] = (
    Setting("server", "url", "AGENT_SERVER_URL", "http(s) URL", "http://127.0.0.1:8080",
            "Base URL of the master.", _http_url),
    Setting("server", "ca_file", "AGENT_SERVER_CA_FILE", "path (existing file)", None,
            "Extra CA bundle (PEM) to verify the master's TLS certificate; unset = system trust store.",
            _readable_file),
    Setting("server", "request_timeout", "AGENT_SERVER_REQUEST_TIMEOUT", "seconds >= 1", 30.0,
            "Timeout of one HTTP request to the master (a long poll adds its wait on top).",
            _seconds(minimum=1.0, exclusive=False)),
    Setting("server", "refusal_timeout", "AGENT_SERVER_REFUSAL_TIMEOUT", "seconds > 0", 600.0,
            "How long a task's stream or result keeps retrying a 404 (unknown task), and a stream a 413 for a "
            "single element, before giving up on it: the result then says incomplete (the spool stays on the "
            "node), the element becomes a placeholder.", _seconds()),
    Setting("server", "download_stall_timeout", "AGENT_SERVER_DOWNLOAD_STALL_TIMEOUT", "seconds >= 1", 30.0,
            "A code download that receives nothing for this long is cut off and retried with backoff.",
            _seconds(minimum=1.0, exclusive=False)),
    Setting("agent", "name", "AGENT_NAME", "string", _HOSTNAME,
            "Node name shown in the master.", _text),
    Setting("agent", "ip", "AGENT_IP", "IP address", _AUTO_IP,
            "Address reported to the master; default: the local address used to reach the master "
            "host (no packet is sent), else 127.0.0.1.", _ip),
    Setting("agent", "port", "AGENT_PORT", "integer 0..65535", 9000,
            "Port of the agent's own HTTP server (/metrics, /healthz, /readyz, /status); 0 = any free "
            "port (the bound one is logged and registered). A busy port stops the agent (exit 1).",
            _integer(0, 65535)),
    Setting("agent", "bind", "AGENT_BIND", "IP address", None,
            "Address the status/metrics server listens on; unset = agent.ip; 0.0.0.0 or :: = every "
            "interface. It serves no secrets, but shows what runs here: keep it to your monitoring.", _ip),
    Setting("agent", "registration_token", "AGENT_REGISTRATION_TOKEN", "secret string", None,
            "Token for POST /api/nodes/register. Required by `ckagent run`.", _secret, secret=True),
    Setting("agent", "labels", "AGENT_LABELS", "mapping str→str (env: `k=v,k2=v2`)", _EMPTY_LABELS,
            "Free-form labels sent at registration.", _labels, mapping=True),
    Setting("agent", "max_workers", "AGENT_MAX_WORKERS", "integer >= 1", None,
            "Maximum concurrent tasks, honoured as set (also 1, also above 8; one warning line when it is more "
            "than 4 per core or one per 256 MiB of memory); unset = min(cores, 8) and at least 2, where cores "
            "come from agent.container_cpu_limit, else the cgroup CPU quota, else the CPU count.",
            _integer(1)),
    Setting("agent", "container_cpu_limit", "CONTAINER_CPU_LIMIT", 'CPU quantity ("2000m", "4", "1.5")', None,
            "CPU limit of the agent's container when cgroups do not tell; unset = detect.", _cpu_quantity),
    Setting("agent", "auto_upgrade", "AGENT_AUTO_UPGRADE", "on/off", False,
            "When the master names a desired agent version other than this one, drain and upgrade through "
            "`run.sh upgrade` (verified, rolled back on failure; an older one through `run.sh upgrade "
            "--downgrade`). Needs run.sh (daemon mode).", _boolean),
    Setting("heartbeat", "interval", "AGENT_HEARTBEAT_INTERVAL", "seconds >= 1", 30.0,
            "Seconds between heartbeats.", _seconds(minimum=1.0, exclusive=False)),
    Setting("task", "poll_interval", "AGENT_TASK_POLL_INTERVAL", "seconds >= 0.1", 10.0,
            "Pause between task polls when the long poll is off or failed.", _seconds(minimum=0.1, exclusive=False)),
    Setting("task", "long_poll_wait", "AGENT_TASK_LONG_POLL_WAIT", "seconds 0..60", 20.0,
            "How long the master may hold a task poll open; 0 disables the long poll.",
            _seconds(minimum=0.0, exclusive=False, maximum=60.0)),
    Setting("task", "work_dir", "AGENT_WORK_DIR", "path", Path("data"),
            "Agent data directory (task spools, workspaces, state.db); relative = to the current directory.",
            _path),
    Setting("task", "execute_timeout", "AGENT_TASK_EXECUTE_TIMEOUT", "seconds >= 0", 3600.0,
            "Default run-time limit of a task that names none; 0 = no limit.", _seconds(exclusive=False)),
    Setting("task", "kill_grace", "AGENT_TASK_KILL_GRACE", "seconds >= 0", 10.0,
            "Seconds between SIGTERM and SIGKILL when stopping a task's process group.",
            _seconds(exclusive=False)),
    Setting("task", "drain_timeout", "AGENT_TASK_DRAIN_TIMEOUT", "seconds >= 0", 60.0,
            "On SIGTERM: how long running tasks may finish before they are terminated.",
            _seconds(exclusive=False)),
    Setting("task", "flush_timeout", "AGENT_TASK_FLUSH_TIMEOUT", "seconds >= 0", 10.0,
            "When stopping: how long unsent logs, items and results may take to reach the master before "
            "they are left on disk for the next start. The agent exits within drain_timeout + kill_grace "
            "+ flush_timeout (+ a few seconds).", _seconds(exclusive=False)),
    Setting("task", "run_as_user", "AGENT_TASK_RUN_AS_USER", "user name or uid", None,
            "When the agent runs as root: spiders and installers run as this user, which owns their "
            "workspace, task directory and venv; unset = the agent's own user.", _text),
    Setting("task", "max_log_bytes", "AGENT_TASK_MAX_LOG_BYTES", "integer >= 0 (bytes)", 1024**3,
            "Disk budget of one task's output.log: beyond it the spider's output is drained but dropped, "
            "and one marker line says how many bytes; 0 = no limit.", _integer(0)),
    Setting("task", "min_free_disk_bytes", "AGENT_TASK_MIN_FREE_DISK_BYTES", "integer >= 0 (bytes)", 512 * 1024**2,
            "Free-space floor of the work dir's filesystem: task output that would go below it is dropped "
            "(with a marker line), a task whose writes take the free space below it is stopped (DISK_FULL) and "
            "new tasks wait until it is back; 0 = no floor.", _integer(0)),
    Setting("task", "max_artifact_bytes", "AGENT_TASK_MAX_ARTIFACT_BYTES", "integer >= 0 (bytes)", 100 * 1024**2,
            "Artifact budget of one task: the files it created or changed in its working copy are shipped to "
            "the master up to this many bytes (in path order); the rest stay on the node in "
            "`spider-data/<spider>/outputs/<task>/` for `task.retention`, and the task log says where; "
            "0 = ship none.", _integer(0)),
    Setting("task", "log_files", "AGENT_TASK_LOG_FILES", "comma-separated globs", "*.log",
            "Spider log files under the task dir (CK_TASK_DIR) that are tailed into the task's log, each "
            "line marked `[<file>] `; a task adds globs with `params.logFiles`.", _globs),
    Setting("task", "retention", "AGENT_TASK_RETENTION", "seconds >= 0", 7 * 86400.0,
            "How long a finished task's directory is kept after the master acknowledged all of it; "
            "0 = keep forever.", _seconds(exclusive=False)),
    Setting("task", "cleanup_temp_files", "AGENT_CLEANUP_TEMP_FILES", "on/off", False,
            "At start, delete the directories of every task the master has fully acknowledged "
            "(`run.sh --cleanup_temp_files=on`).", _boolean),
    Setting("task", "stall_timeout", "AGENT_TASK_STALL_TIMEOUT", "seconds >= 0", 0.0,
            "A task with no new output line, item or stats change for this long is stopped gracefully and "
            "reported FAILED (STALLED); a task's `stallTimeoutSeconds` overrides it; 0 = off (the default: "
            "execute_timeout bounds a hang; 3600 is a good value for long crawls).", _seconds(exclusive=False)),
    Setting("task", "containment", "AGENT_TASK_CONTAINMENT", "auto, cgroup-v2, cgroup-v1, process-group", "auto",
            "How tasks are contained: auto = the strongest level this node allows (logged at start, shown "
            "in /status); a named level fails the start when it is not available. See docs/operations.md.",
            _choice(("auto", "cgroup-v2", "cgroup-v1", "process-group"), upper=False)),
    Setting("task", "memory_limit_bytes", "AGENT_TASK_MEMORY_LIMIT_BYTES", "integer >= 1 (bytes)", None,
            "Memory limit of a task that names none (`resources.memoryBytes`), its installers included; "
            "past it the kernel kills the task (FAILED/OOM_KILLED). Unset = no limit. Needs a cgroup level.",
            _integer(1)),
    Setting("task", "pids_limit", "AGENT_TASK_PIDS_LIMIT", "integer >= 1", None,
            "Most processes + threads of a task that names none (`resources.pids`); unset = no limit. "
            "Needs a cgroup level.", _integer(1)),
    Setting("task", "cpus_limit", "AGENT_TASK_CPUS_LIMIT", 'CPU quantity ("1.5", "500m")', None,
            "CPU cores a task that names none (`resources.cpus`) may use; unset = no limit. Needs a cgroup "
            "level with the cpu controller.", _cpu_quantity_cores),
    Setting("task", "egress", "AGENT_TASK_EGRESS", "auto, nftables, proxy, off", "auto",
            "How a task's network policy is enforced: auto = nftables on the task's cgroup when the kernel "
            "and the agent's rights allow it, else the advisory filtering proxy; a named level fails the "
            "start when it is not available. See docs/operations.md, Egress.",
            _choice(("auto", "nftables", "proxy", "off"), upper=False)),
    Setting("task", "egress_deny", "AGENT_TASK_EGRESS_DENY", "comma-separated groups and IP networks",
            "metadata,link-local,agent",
            "Destinations no task may reach: groups metadata (cloud metadata services), link-local, agent "
            "(the agent's own port), private (RFC 1918, CGNAT, ULA), loopback; or networks (192.0.2.0/24). "
            "A task's `egress.deny` adds to it.", _egress_deny),
    Setting("task", "egress_allow", "AGENT_TASK_EGRESS_ALLOW", "comma-separated IP networks[:port]", "",
            "Exceptions that beat every denial (an internal proxy: 10.0.0.5:3128); a task's `egress.allow` "
            "adds to it.", _egress_allow),
    Setting("logging", "level", "AGENT_LOG_LEVEL", "DEBUG, INFO, WARNING, ERROR", "INFO",
            "Log level (case-insensitive).", _choice(("DEBUG", "INFO", "WARNING", "ERROR"), upper=True)),
    Setting("logging", "file", "AGENT_LOG_FILE", "path", None,
            "Write the agent log to this file (rotated); stderr then gets it only when it is a terminal or "
            "the systemd journal. Unset = stderr only (`run.sh --daemon=on`: logs/agent.log).", _path),
    Setting("logging", "format", "AGENT_LOG_FORMAT", "text, json", "text",
            "Log line format: text, or json (one object per line, for Loki/ELK).",
            _choice(("text", "json"), upper=False)),
    Setting("logging", "max_bytes", "AGENT_LOG_MAX_BYTES", "integer >= 1024", 10 * 1024 * 1024,
            "Size in bytes at which logging.file is rotated.", _integer(1024)),
    Setting("logging", "backup_count", "AGENT_LOG_BACKUP_COUNT", "integer >= 1", 5,
            "Rotated log files kept (agent.log.1 … agent.log.N).", _integer(1)),
    Setting("deps", "uv_index_url", "AGENT_UV_INDEX_URL", "http(s) URL", None,
            "Package index for `uv`; unset = PyPI if it answers a short probe (once per agent run), "
            "else deps.uv_fallback_index_url.", _http_url),
    Setting("deps", "uv_fallback_index_url", "AGENT_UV_FALLBACK_INDEX_URL", "http(s) URL",
            "https://pypi.tuna.tsinghua.edu.cn/simple",
            "Index used when deps.uv_index_url is unset and PyPI is unreachable.", _http_url),
    Setting("deps", "uv_cache_dir", "AGENT_UV_CACHE_DIR", "path", None,
            "uv cache directory; unset = uv's default.", _path),
    Setting("deps", "uv_sync_timeout", "AGENT_UV_SYNC_TIMEOUT", "seconds >= 1", 180.0,
            "Time limit of one dependency installer run (uv, npm, nvm); past it the task fails "
            "DEPS_FAILED.", _seconds(minimum=1.0, exclusive=False)),
    Setting("deps", "uv_path", "AGENT_UV_PATH", "path", None,
            "The uv executable to use when `uv` is not on PATH (without uv, Python spiders fail "
            "DEPS_FAILED: `pip install uv`).", _path),
    Setting("deps", "env_budget_bytes", "AGENT_DEPS_ENV_BUDGET_BYTES", "integer >= 0 (bytes)", 10 * 1024**3,
            "Disk budget of the spiders' dependency environments (`work_dir/envs`, shared by projects "
            "with the same dependencies): beyond it the least recently used ones not in use are removed; "
            "0 = no limit.", _integer(0)),
    Setting("deps", "python", "AGENT_DEPS_PYTHON", "path", None,
            "The interpreter Python spiders' environments are built on; unset = the agent's own. With "
            "task.run_as_user that user must be able to execute it (checked at start).", _path),
)  # fmt: skip

_SECTION_CLASSES: dict[str, type] = {
    "server": ServerSettings,
    "agent": AgentSettings,
    "heartbeat": HeartbeatSettings,
    "task": TaskSettings,
    "logging": LoggingSettings,
    "deps": DepsSettings,
}
SECTIONS: tuple[str, ...] = tuple(_SECTION_CLASSES)
_BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}


def _specs_in(section: str) -> Iterator[Setting]:
    return (s for s in SETTINGS if s.section == section)


def _check_table() -> None:
    """The table and the dataclasses must describe the same fields (checked at import)."""
    for section, cls in _SECTION_CLASSES.items():
        fields = [f.name for f in dataclasses.fields(cls)]
        keys = [s.key for s in _specs_in(section)]
        if fields != keys:
            raise AssertionError(f"SETTINGS out of sync with {cls.__name__}: {keys} != {fields}")
    if {s.section for s in SETTINGS} != set(SECTIONS) or len(_BY_ENV) != len(SETTINGS):
        raise AssertionError("SETTINGS has an unknown section or a duplicate env var")


_check_table()


# --------------------------------------------------------------------------------------------------
# Loading


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe_node(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


class _FileReader:
    """Turns the composed YAML tree into {env var name: value}, raising ConfigError with positions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)

    def where(self, node: yaml.Node) -> str:
        mark = node.start_mark
        return f"{self.name}:{mark.line + 1}:{mark.column + 1}"

    def fail(self, node: yaml.Node, message: str) -> ConfigError:
        return ConfigError(f"{self.where(node)}: {message}")

    def read(self) -> dict[str, Any]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"{self.name}: config file not found") from None
        except IsADirectoryError:
            raise ConfigError(f"{self.name}: config file is a directory") from None
        except OSError as exc:
            raise ConfigError(f"{self.name}: cannot read config file: {exc.strerror or exc}") from None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise ConfigError(f"{self.name}:{line}: config file is not valid UTF-8") from None
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{self.name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else self.name
            problem = exc.problem or exc.context or "invalid YAML"
            raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{self.name}: YAML error: {exc}") from None
        if root is None or _is_null(root):
            return {}
        if not isinstance(root, yaml.MappingNode):
            raise self.fail(
                root, f"the top level must be a mapping of sections ({', '.join(SECTIONS)}), "
                f"got {_describe_node(root)}"
            )
        values: dict[str, Any] = {}
        for section, section_node in self._pairs(root, prefix=""):
            if section not in _SECTION_CLASSES:
                raise self.fail(
                    section_node[0],
                    f"unknown section {section!r}{_did_you_mean(section, list(SECTIONS))}",
                )
            value_node = section_node[1]
            if _is_null(value_node):
                continue
            if not isinstance(value_node, yaml.MappingNode):
                raise self.fail(
                    value_node, f"{section}: expected a mapping of settings, got {_describe_node(value_node)}"
                )
            specs = {s.key: s for s in _specs_in(section)}
            for key, (key_node, node) in self._pairs(value_node, prefix=f"{section}."):
                spec = specs.get(key)
                removed = REMOVED_SETTINGS.get(f"{section}.{key}")
                if spec is None and removed is not None:
                    if _is_null(node):
                        continue  # the line of an older sample config: harmless
                    raise self.fail(key_node, f"'{section}.{key}' is no setting any more: {removed}")
                if spec is None:
                    raise self.fail(
                        key_node, f"unknown key '{section}.{key}'{_did_you_mean(key, list(specs))}"
                    )
                if _is_null(node):
                    continue
                values[spec.env] = self._value(spec, node)
        return values

    def _pairs(self, mapping: yaml.MappingNode, *, prefix: str) -> Iterator[tuple[str, tuple[yaml.Node, yaml.Node]]]:
        seen: set[str] = set()
        for key_node, value_node in mapping.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.fail(key_node, f"expected a name as key, got {_describe_node(key_node)}")
            key = str(key_node.value)
            if key in seen:
                raise self.fail(key_node, f"duplicate key '{prefix}{key}'")
            seen.add(key)
            yield key, (key_node, value_node)

    def _value(self, spec: Setting, node: yaml.Node) -> Any:
        if spec.mapping:
            return self._mapping_value(spec, node)
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, f"{spec.dotted}: expected a single value, got {_describe_node(node)}")
        try:
            return spec.parse(str(node.value))
        except _Invalid as exc:
            raise self.fail(node, f"{spec.dotted}: {_problem(spec, exc, node.value)}") from None

    def _mapping_value(self, spec: Setting, node: yaml.Node) -> Mapping[str, str]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{spec.dotted}: expected a mapping of str to str, got {_describe_node(node)}")
        result: dict[str, str] = {}
        for key, (key_node, value_node) in self._pairs(node, prefix=f"{spec.dotted}."):
            try:
                key = _label_key(key)
            except _Invalid as exc:
                raise self.fail(key_node, f"{spec.dotted}: {exc.problem}, got {key!r}") from None
            if not isinstance(value_node, yaml.ScalarNode) or _is_null(value_node):
                raise self.fail(
                    value_node,
                    f"{spec.dotted}.{key}: expected a string value, got "
                    f"{'null' if _is_null(value_node) else _describe_node(value_node)}",
                )
            result[key] = str(value_node.value)
        return types.MappingProxyType(result)


def _problem(spec: Setting, exc: _Invalid, raw: str) -> str:
    if exc.show_value and not spec.secret:
        return f"{exc.problem}, got {raw!r}"
    return exc.problem


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for spec in SETTINGS:
        raw = env.get(spec.env)
        if raw is None or not raw.strip():
            continue
        try:
            values[spec.env] = spec.parse(raw)
        except _Invalid as exc:
            raise ConfigError(f"{spec.env}: {_problem(spec, exc, raw)}") from None
    return values


def detect_local_ip(server_url: str) -> str:
    """The local address this host would use to reach ``server_url``'s host, else "127.0.0.1".

    "Connects" a UDP socket (which sends no packet) and reads its local address. Blocks for name
    resolution of the server host; never raises.
    """
    parts = urlsplit(server_url)
    host = parts.hostname or "127.0.0.1"
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            local = sock.getsockname()[0]
    except (OSError, ValueError, IndexError):
        return "127.0.0.1"
    if not isinstance(local, str) or local in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return local


def load_settings(
    path: Path | None, env: Mapping[str, str] | None = None, *, require_token: bool = True
) -> Settings:
    """Load and validate the configuration.

    ``path``: the YAML file, or None for defaults + environment only. ``env`` defaults to ``os.environ``
    plus the credentials inherited in a memory file (ckagent.node.secretenv.agent_environ).
    ``require_token``: fail when no registration token is set (``ckagent run`` needs one).

    Relative paths resolve against the current directory; ``agent.ip`` may resolve the server host name
    (blocking). Raises :class:`ConfigError` on any problem, with a message naming the file position
    or the environment variable.
    """
    environ: Mapping[str, str] = agent_environ() if env is None else env
    values: dict[str, Any] = {}
    config_file: Path | None = None
    if path is not None:
        config_file = Path(os.path.abspath(path))
        values.update(_FileReader(Path(path)).read())
    values.update(_read_env(environ))

    def get(spec: Setting) -> Any:
        if spec.env in values:
            return values[spec.env]
        default = spec.default
        if default is _HOSTNAME:
            return socket.gethostname() or "localhost"
        if default is _AUTO_IP:
            return detect_local_ip(get(_BY_ENV["AGENT_SERVER_URL"]))
        if isinstance(default, Path):
            return Path(os.path.abspath(default))
        return default

    sections: dict[str, Any] = {}
    for section, cls in _SECTION_CLASSES.items():
        sections[section] = cls(**{spec.key: get(spec) for spec in _specs_in(section)})
    settings = Settings(**sections, config_file=config_file)
    if require_token and settings.agent.registration_token is None:
        raise ConfigError(missing_token_message())
    return settings


def missing_token_message() -> str:
    """The one-line explanation used when no registration token is configured."""
    return (
        "no registration token: set agent.registration_token in the config file "
        "or the AGENT_REGISTRATION_TOKEN environment variable"
    )


REMOVED_SETTINGS: dict[str, str] = {
    "agent.api_key": "the node's API key is the one the master gives at registration (a key alone, "
                     "without the node id it belongs to, cannot be used); delete the line",
}
"""Settings of earlier versions: a YAML file that still sets one fails with this reason (a null value is
ignored); their environment variables are reported by :func:`suspicious_env_vars`."""
_REMOVED_ENV = {"AGENT_API_KEY": "agent.api_key"}


def suspicious_env_vars(env: Mapping[str, str] | None = None) -> list[str]:
    """Warnings for ``AGENT_*`` variables that are no setting but look like one (likely typos).

    Returns one line per variable, e.g. "AGENT_SERVR_URL is not a setting (did you mean AGENT_SERVER_URL?)".
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    known = list(_BY_ENV)
    out: list[str] = []
    for name in sorted(environ):
        if not name.startswith("AGENT_") or name in _BY_ENV:
            continue
        if name in _REMOVED_ENV:
            out.append(f"{name} is ignored: {REMOVED_SETTINGS[_REMOVED_ENV[name]]}")
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            out.append(f"{name} is not a setting (did you mean {close[0]}?)")
    return out


# --------------------------------------------------------------------------------------------------
# Docs


def settings_markdown_table() -> str:
    """The settings table in Markdown (key | env var | type | default | meaning), ending with a newline."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| key | env var | type | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        lines.append(
            f"| `{s.dotted}` | `{s.env}` | {cell(s.type_doc)} | {cell(s.default_doc)} | {cell(s.doc)} |"
        )
    return "\n".join(lines) + "\n"


def replace_marked_block(text: str, block: str) -> str:
    """Return ``text`` with the part between the config-table markers replaced by ``block``.

    Raises ValueError when the markers are missing or out of order.
    """
    start = text.find(TABLE_START_MARKER)
    end = text.find(TABLE_END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"markers {TABLE_START_MARKER} ... {TABLE_END_MARKER} not found")
    head = text[: start + len(TABLE_START_MARKER)]
    return f"{head}\n{block}{text[end:]}"


def _main(argv: list[str]) -> int:
    """``python -m ckagent.node.config [FILE...]``: print the table, or rewrite the marked block in FILEs."""
    table = settings_markdown_table()
    if not argv:
        sys.stdout.write(table)
        return 0
    for name in argv:
        file = Path(name)
        file.write_text(replace_marked_block(file.read_text(encoding="utf-8"), table), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
