"""The settings' schema: the frozen section objects, :class:`Settings`, and :data:`SETTINGS`, the one
table (section, key, env var, type, default, meaning, parser) that the loader (:mod:`ckagent.node.config`),
``ckagent config show``, the docs generator (:mod:`ckagent.node.configdocs`) and the sync test derive from.

To add a setting: a field on its section's dataclass and one :class:`Setting` row, in the same order
(checked at import), then regenerate the docs (``python -m ckagent.node.configdocs README.md
docs/configuration.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ckagent.node import configvalues as v
from ckagent.node.configvalues import AUTO_IP, EMPTY_LABELS, HOSTNAME, Secret, UidRange
from ckagent.node.levels import AUTO, ContainmentLevel, EgressLevel
from ckagent.node.settingrow import Setting

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["text", "json"]

PRIVATE_TMP_CHOICES = (AUTO, "mount-namespace", "user-namespace", "tmpdir")
"""``task.private_tmp``: auto, or a level of ckagent.containment.private.PrivacyLevel (strongest first)."""


@dataclass(frozen=True)
class ServerSettings:
    """How to reach the master.

    ``url``: base URL, http(s). ``ca_file``: extra CA bundle (PEM) for TLS, or None for the system store.
    ``request_timeout``: seconds per HTTP request (a long poll adds its wait on top).
    ``refusal_timeout``: seconds a stream retries a 4xx in the protocol's words (not 401/408/409/429), a
    result a 404, a lone element a 413, before giving up (the result says incomplete, with the reason).
    ``download_stall_timeout``: seconds a code download may receive nothing before it is retried.
    ``max_backoff_interval``: seconds, the longest pause between two attempts of a request the master
    did not answer (the exponential backoff grows from 0.5 s to it, with jitter).
    """

    url: str
    ca_file: Path | None
    request_timeout: float
    refusal_timeout: float = 600.0
    download_stall_timeout: float = 30.0
    max_backoff_interval: float = 30.0


@dataclass(frozen=True)
class AgentSettings:
    """Who this node is.

    ``port`` is the agent's own status/metrics port (0 = any free port); it listens on ``bind``
    (None = ``ip``). ``labels`` is a read-only mapping str→str.
    ``max_workers`` None = derived from the machine; ``container_cpu_limit`` is a Kubernetes-style CPU
    quantity ("2000m", "4", "1.5") or None (see :attr:`container_cpu_limit_cores`). ``auto_upgrade``:
    follow the master's desired agent version through run.sh (ckagent.master.fleet). ``ports_registry``:
    the directory of the host's registry of agents' ports (None = the host-wide one,
    :mod:`ckagent.node.agentports`). ``sigterm``: what SIGTERM asks of the agent, ``drain`` or
    ``migrate`` (:class:`ckagent.node.stoprequest.StopMode`). An ephemeral worker
    (:mod:`ckagent.node.ephemeral`): ``exit_when_idle`` seconds idle before it stops (0 = never),
    ``max_tasks`` tasks it claims in its life (0 = no limit). ``name_exclusive``: at most one agent
    runs under ``name`` (the orchestrator's word), so its registration takes the name over (ckagent.master.fleet).
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
    ports_registry: Path | None
    sigterm: str = "drain"
    exit_when_idle: float = 0.0
    max_tasks: int = 0
    name_exclusive: bool = False

    @property
    def container_cpu_limit_cores(self) -> float | None:
        """``container_cpu_limit`` in CPU cores ("2000m" → 2.0), or None when not set."""
        if self.container_cpu_limit is None:
            return None
        return v.cpu_quantity_cores(self.container_cpu_limit)


@dataclass(frozen=True)
class HeartbeatSettings:
    """``interval``: seconds between heartbeats."""

    interval: float


@dataclass(frozen=True)
class TaskSettings:
    """Task polling and execution (all durations in seconds).

    ``long_poll_wait`` 0 disables the long poll; ``execute_timeout`` 0 means no limit and applies when a
    task carries no timeout; ``kill_grace`` is SIGTERM → SIGKILL (a task's own ``stopGraceSeconds`` or its
    framework's default instead, at most ``max_stop_grace``); ``drain_timeout`` bounds DRAINING;
    ``flush_timeout`` bounds the final delivery when stopping. ``work_dir`` is absolute.
    ``run_as_user``: user name (or uid) every spider runs as when the agent is root (``root``: root); None =
    a uid per spider from ``spider_uids`` when the agent is root, else the agent's user
    (:class:`~ckagent.node.levels.IdentityLevel`).
    Task data: ``max_log_bytes`` caps a task's output.log and ``min_free_disk_bytes`` is the free-space
    floor of the work dir's filesystem (bytes, 0 = none); ``max_artifact_bytes`` the most bytes of a
    task's artifacts shipped to the master (0 = none: all kept on the node); ``log_files`` comma-separated globs of spider
    log files under the task dir; ``retention`` seconds a delivered task dir is kept (0 = forever);
    ``cleanup_temp_files`` deletes every delivered task dir at start. ``stall_timeout``: seconds
    without output, item or stats change before a task is stopped STALLED (0 = off).
    ``containment``: ``auto`` or a :class:`~ckagent.node.levels.ContainmentLevel`'s text; node default limits
    of a task that names none: ``memory_limit_bytes`` (bytes), ``pids_limit``, ``cpus_limit``
    (cores), ``disk_limit_bytes`` (bytes of disk a task may hold); None = no limit. ``egress``: ``auto`` or an :class:`~ckagent.node.levels.EgressLevel`'s text;
    ``egress_deny`` / ``egress_allow``: comma-separated entries of :mod:`ckagent.node.egress_policy`.
    ``private_tmp``: ``auto`` or a level of :class:`ckagent.containment.private.PrivacyLevel` (its text);
    ``private_tmp_shared``: absolute paths (comma-separated) tasks still see in their private namespace.
    ``uid_claims``: the host-wide directory of the uids agents handed out (ckagent.node.uidclaims).
    ``migrate_timeout``: seconds a migrate (``ckagent stop --migrate``) may take before the flush;
    ``memory_soft_bytes``: the soft memory ceiling of a task that names none (bytes; None = none).
    ``checkpoint_interval``: seconds between a task's periodic checkpoints when it names none (0 = none).
    """

    poll_interval: float
    long_poll_wait: float
    work_dir: Path
    execute_timeout: float
    kill_grace: float
    max_stop_grace: float
    drain_timeout: float
    flush_timeout: float
    run_as_user: str | None
    spider_uids: UidRange
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
    disk_limit_bytes: int | None
    egress: str
    egress_deny: str
    egress_allow: str
    private_tmp: str = "auto"
    private_tmp_shared: str = ""
    uid_claims: Path = Path("/var/lib/ckagent/uids")
    migrate_timeout: float = 20.0
    memory_soft_bytes: int | None = None
    checkpoint_interval: float = 60.0


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
            for spec in specs_in(section):
                value = getattr(section_obj, spec.key)
                if isinstance(value, Secret):
                    value = "***"
                elif isinstance(value, (Path, UidRange)):
                    value = str(value)
                elif isinstance(value, Mapping):
                    value = dict(value)
                values[spec.key] = value
            out[section] = values
        return out


SETTINGS: tuple[Setting, ...] = (
    Setting("server", "url", "AGENT_SERVER_URL", "http(s) URL", "http://127.0.0.1:8080",
            "Base URL of the master.", v.http_url),
    Setting("server", "ca_file", "AGENT_SERVER_CA_FILE", "path (existing file)", None,
            "Extra CA bundle (PEM) to verify the master's TLS certificate; unset = system trust store.",
            v.readable_file),
    Setting("server", "request_timeout", "AGENT_SERVER_REQUEST_TIMEOUT", "seconds >= 1", 30.0,
            "Timeout of one HTTP request to the master (a long poll adds its wait on top).",
            v.seconds(minimum=1.0, exclusive=False)),
    Setting("server", "refusal_timeout", "AGENT_SERVER_REFUSAL_TIMEOUT", "seconds > 0", 600.0,
            "How long a task's stream keeps retrying a refusal in the protocol's words (a 4xx other than 401, "
            "408, 409, 429: 404 unknown task, 403, 400, ...), its result a 404, and a stream a 413 for a single "
            "element, before giving up on it: the result then says incomplete with the master's reason "
            "(incompleteReason; the spool stays on the node), the element becomes a placeholder.", v.seconds()),
    Setting("server", "download_stall_timeout", "AGENT_SERVER_DOWNLOAD_STALL_TIMEOUT", "seconds >= 1", 30.0,
            "A code download that receives nothing for this long is cut off and retried with backoff.",
            v.seconds(minimum=1.0, exclusive=False)),
    Setting("server", "max_backoff_interval", "AGENT_SERVER_MAX_BACKOFF_INTERVAL", "seconds >= 1", 30.0,
            "Longest pause between two attempts of a request the master did not answer (transport error, "
            "429, 5xx): the backoff grows from 0.5 s to it, with jitter; once another request gets through, "
            "waiting streams retry after 1 s.", v.seconds(minimum=1.0, exclusive=False)),
    Setting("agent", "name", "AGENT_NAME", "string", HOSTNAME,
            "Node name shown in the master.", v.text),
    Setting("agent", "ip", "AGENT_IP", "IP address", AUTO_IP,
            "Address reported to the master; default: the local address used to reach the master "
            "host (no packet is sent), else 127.0.0.1.", v.ip),
    Setting("agent", "port", "AGENT_PORT", "integer 0..65535", 9000,
            "Port of the agent's own HTTP server (/metrics, /healthz, /readyz, /status); 0 = any free "
            "port (the bound one is logged and registered). A busy port stops the agent (exit 1).",
            v.integer(0, 65535)),
    Setting("agent", "bind", "AGENT_BIND", "IP address", None,
            "Address the status/metrics server listens on; unset = agent.ip; 0.0.0.0 or :: = every "
            "interface. It serves no secrets, but shows what runs here: keep it to your monitoring.", v.ip),
    Setting("agent", "registration_token", "AGENT_REGISTRATION_TOKEN", "secret string", None,
            "Token for POST /api/nodes/register. Required by `ckagent run`.", v.secret, secret=True),
    Setting("agent", "labels", "AGENT_LABELS", "mapping str→str (env: `k=v,k2=v2`)", EMPTY_LABELS,
            "Free-form labels sent at registration.", v.labels, mapping=True),
    Setting("agent", "max_workers", "AGENT_MAX_WORKERS", "integer >= 1", None,
            "Maximum concurrent tasks, honoured as set (also 1, also above 8; one warning line when it is more "
            "than 4 per core or one per 256 MiB of memory); unset = min(cores, 8) and at least 2, where cores "
            "come from agent.container_cpu_limit, else the cgroup CPU quota, else the CPU count.",
            v.integer(1)),
    Setting("agent", "container_cpu_limit", "CONTAINER_CPU_LIMIT", 'CPU quantity ("2000m", "4", "1.5")', None,
            "CPU limit of the agent's container when cgroups do not tell; unset = detect.", v.cpu_quantity),
    Setting("agent", "auto_upgrade", "AGENT_AUTO_UPGRADE", "on/off", False,
            "When the master names a desired agent version other than this one, drain and upgrade through "
            "`run.sh upgrade` (verified, rolled back on failure; an older one through `run.sh upgrade "
            "--downgrade`). Needs run.sh (daemon mode).", v.boolean),
    Setting("agent", "ports_registry", "AGENT_PORTS_REGISTRY", "path", None,
            "Directory where every agent on this host records the ports it listens on, so that no agent's "
            "task reaches any agent's port (egress group `agent`); unset = /run/ckagent/ports (made by a root "
            "agent, or by config/ckagent.tmpfiles), else /tmp/ckagent-ports for a non-root agent. Agents "
            "that share a host's network but not its /run (containers) can share one here.", v.path),
    Setting("agent", "sigterm", "AGENT_SIGTERM", "drain, migrate", "drain",
            "What SIGTERM asks: drain (stop claiming, let running tasks finish within task.drain_timeout) or "
            "migrate (checkpoint every running task and hand it to another node within "
            "task.migrate_timeout, as `ckagent stop --migrate` does). Kubernetes: migrate.",
            v.choice(("drain", "migrate"), upper=False)),
    Setting("agent", "exit_when_idle", "AGENT_EXIT_WHEN_IDLE", "seconds >= 0", 0.0,
            "An ephemeral worker (`ckagent run --exit-when-idle`): after this long with no task claimed, running "
            "or with results undelivered, stop as a drain does, leave the master (freeing the name) and exit 0; "
            "0 = never. See docs/operations.md, Ephemeral workers.", v.seconds(exclusive=False)),
    Setting("agent", "max_tasks", "AGENT_MAX_TASKS", "integer >= 0", 0,
            "An ephemeral worker (`ckagent run --max-tasks`): claim at most this many tasks in the agent's life "
            "(a restart after a crash goes on counting: work_dir/max-tasks.json), then stop once they are "
            "delivered, leave and exit 0; 0 = no limit.", v.integer(0)),
    Setting("agent", "name_exclusive", "AGENT_NAME_EXCLUSIVE", "on/off", False,
            "The orchestrator runs at most one agent with this agent.name (a StatefulSet's pod), so a new work "
            "dir (a new nodeUid) takes the name over at once instead of waiting until the master counts the "
            "earlier holder's heartbeats old; its running tasks resume elsewhere. Off: wait.", v.boolean),
    Setting("heartbeat", "interval", "AGENT_HEARTBEAT_INTERVAL", "seconds >= 1", 30.0,
            "Seconds between heartbeats.", v.seconds(minimum=1.0, exclusive=False)),
    Setting("task", "poll_interval", "AGENT_TASK_POLL_INTERVAL", "seconds >= 0.1", 10.0,
            "Pause between task polls when the long poll is off or failed.", v.seconds(minimum=0.1, exclusive=False)),
    Setting("task", "long_poll_wait", "AGENT_TASK_LONG_POLL_WAIT", "seconds 0..60", 20.0,
            "How long the master may hold a task poll open; 0 disables the long poll.",
            v.seconds(minimum=0.0, exclusive=False, maximum=60.0)),
    Setting("task", "work_dir", "AGENT_WORK_DIR", "path", Path("data"),
            "Agent data directory (task spools, workspaces, state.db); relative = to the current directory.",
            v.path),
    Setting("task", "execute_timeout", "AGENT_TASK_EXECUTE_TIMEOUT", "seconds >= 0", 3600.0,
            "Default run-time limit of a task that names none; 0 = no limit.", v.seconds(exclusive=False)),
    Setting("task", "kill_grace", "AGENT_TASK_KILL_GRACE", "seconds >= 0", 10.0,
            "Seconds between SIGTERM and SIGKILL when stopping a task's processes (its spider or installer).",
            v.seconds(exclusive=False)),
    Setting("task", "max_stop_grace", "AGENT_TASK_MAX_STOP_GRACE", "seconds >= 0", 180.0,
            "The longest stop grace of a task's spider: a task's stopGraceSeconds or its framework's default "
            "(scrapy: 180, time for Scrapy's graceful close of a polite crawl) is cut to it; task.kill_grace "
            "stays the default of other frameworks. Kubernetes' terminationGracePeriodSeconds must cover "
            "drain_timeout + max(kill_grace, max_stop_grace) + flush_timeout (docs/operations.md, Polite stops).",
            v.seconds(exclusive=False)),
    Setting("task", "drain_timeout", "AGENT_TASK_DRAIN_TIMEOUT", "seconds >= 0", 60.0,
            "On SIGTERM: how long running tasks may finish before they are terminated.",
            v.seconds(exclusive=False)),
    Setting("task", "flush_timeout", "AGENT_TASK_FLUSH_TIMEOUT", "seconds >= 0", 10.0,
            "When stopping: how long unsent logs, items and results may take to reach the master before "
            "they are left on disk for the next start. The agent exits within drain_timeout + the longest "
            "stop grace of its running tasks (task.kill_grace, or up to task.max_stop_grace) + flush_timeout "
            "(+ a few seconds).", v.seconds(exclusive=False)),
    Setting("task", "run_as_user", "AGENT_TASK_RUN_AS_USER", "user name or uid", None,
            "When the agent runs as root: every spider and installer runs as this user, which owns their "
            "workspace, task directory and venv (`root`: as root, with a warning); unset = each spider a uid "
            "of its own from task.spider_uids when the agent is root, else the agent's own user. See "
            "docs/operations.md, Who a spider runs as.", v.text),
    Setting("task", "spider_uids", "AGENT_TASK_SPIDER_UIDS", "uid range FIRST-LAST", UidRange(61184, 65519),
            "The uids (and gids, the same numbers) the agent gives spiders when it runs as root and "
            "task.run_as_user is unset: each spider one of its own, kept for it in state.db; every id in "
            "/etc/passwd or /etc/group is skipped (checked at start). No passwd entry is made.", v.uid_range),
    Setting("task", "max_log_bytes", "AGENT_TASK_MAX_LOG_BYTES", "integer >= 0 (bytes)", 1024**3,
            "Disk budget of one task's output.log: beyond it the spider's output is drained but dropped, "
            "and one marker line says how many bytes; 0 = no limit.", v.integer(0)),
    Setting("task", "min_free_disk_bytes", "AGENT_TASK_MIN_FREE_DISK_BYTES", "integer >= 0 (bytes)", 512 * 1024**2,
            "Free-space floor of the work dir's filesystem: below it the task over its share of the disk is "
            "stopped (DISK_FULL) and its scratch removed, and new tasks wait until space is back; output is "
            "never dropped for it. 0 = no floor of its own (4 MiB). See docs/operations.md, When the disk fills.",
            v.integer(0)),
    Setting("task", "max_artifact_bytes", "AGENT_TASK_MAX_ARTIFACT_BYTES", "integer >= 0 (bytes)", 100 * 1024**2,
            "Artifact budget of one task: the files it created or changed in its working copy are shipped to "
            "the master up to this many bytes (in path order); the rest stay on the node in "
            "`spider-data/<spider>/outputs/<task>/` for `task.retention`, and the task log says where; "
            "0 = ship none.", v.integer(0)),
    Setting("task", "log_files", "AGENT_TASK_LOG_FILES", "comma-separated globs", "*.log",
            "Spider log files under the task dir (CK_TASK_DIR) that are tailed into the task's log, each "
            "line marked `[<file>] `; a task adds globs with `params.logFiles`.", v.globs),
    Setting("task", "retention", "AGENT_TASK_RETENTION", "seconds >= 0", 7 * 86400.0,
            "How long a finished task's directory is kept after the master acknowledged all of it; "
            "0 = keep forever.", v.seconds(exclusive=False)),
    Setting("task", "cleanup_temp_files", "AGENT_CLEANUP_TEMP_FILES", "on/off", False,
            "At start, delete the directories of every task the master has fully acknowledged "
            "(`run.sh --cleanup_temp_files=on`).", v.boolean),
    Setting("task", "stall_timeout", "AGENT_TASK_STALL_TIMEOUT", "seconds >= 0", 0.0,
            "A task with no new output line, item or stats change for this long is stopped gracefully and "
            "reported FAILED (STALLED); a task's `stallTimeoutSeconds` overrides it; 0 = off (the default: "
            "execute_timeout bounds a hang; 3600 is a good value for long crawls).", v.seconds(exclusive=False)),
    Setting("task", "containment", "AGENT_TASK_CONTAINMENT", ", ".join(ContainmentLevel.choices()), AUTO,
            "How tasks are contained: auto = the strongest level this node allows (logged at start, shown "
            "in /status); a named level fails the start when it is not available. See docs/operations.md.",
            v.choice(ContainmentLevel.choices(), upper=False)),
    Setting("task", "memory_limit_bytes", "AGENT_TASK_MEMORY_LIMIT_BYTES", "integer >= 1 (bytes)", None,
            "Memory limit of a task that names none (`resources.memoryBytes`), its installers included; "
            "past it the kernel kills the task (FAILED/OOM_KILLED). Unset = no limit. Needs a cgroup level.",
            v.integer(1)),
    Setting("task", "pids_limit", "AGENT_TASK_PIDS_LIMIT", "integer >= 1", None,
            "Most processes + threads of a task that names none (`resources.pids`); unset = no limit. "
            "Needs a cgroup level.", v.integer(1)),
    Setting("task", "cpus_limit", "AGENT_TASK_CPUS_LIMIT", 'CPU quantity ("1.5", "500m")', None,
            "CPU cores a task that names none (`resources.cpus`) may use; unset = no limit. Needs a cgroup "
            "level with the cpu controller.", v.cpu_quantity_cores),
    Setting("task", "disk_limit_bytes", "AGENT_TASK_DISK_LIMIT_BYTES", "integer >= 1048576 (bytes)", None,
            "Disk a task that names none (`resources.diskBytes`) may hold: its task dir, working copy and data "
            "dir; past it the task is stopped (FAILED/DISK_FULL) and its scratch removed. Unset = no limit of its "
            "own (a full disk still stops the task over its share). See docs/operations.md, When the disk fills.",
            v.integer(1 << 20)),
    Setting("task", "egress", "AGENT_TASK_EGRESS", ", ".join(EgressLevel.choices()), AUTO,
            "How a task's network policy is enforced: auto = nftables on the task's cgroup when the kernel "
            "and the agent's rights allow it, else the advisory filtering proxy; a named level fails the "
            "start when it is not available. See docs/operations.md, Egress.",
            v.choice(EgressLevel.choices(), upper=False)),
    Setting("task", "egress_deny", "AGENT_TASK_EGRESS_DENY", "comma-separated groups and IP networks",
            "metadata,link-local,agent",
            "Destinations no task may reach: groups metadata (cloud metadata services), link-local, agent "
            "(the agent's own port), private (RFC 1918, CGNAT, ULA), loopback; or networks (192.0.2.0/24). "
            "A task's `egress.deny` adds to it.", v.egress_deny),
    Setting("task", "egress_allow", "AGENT_TASK_EGRESS_ALLOW", "comma-separated IP networks[:port]", "",
            "Exceptions that beat every denial (an internal proxy: 10.0.0.5:3128); a task's `egress.allow` "
            "adds to it.", v.egress_allow),
    Setting("task", "private_tmp", "AGENT_TASK_PRIVATE_TMP", ", ".join(PRIVATE_TMP_CHOICES), AUTO,
            "Each task's own /tmp, /var/tmp and /dev/shm (tmpfs, gone with the task) and, as root, a /proc "
            "showing a spider only its own processes: auto = a mount namespace per task as root, a user "
            "namespace where the agent is not root and may make one, else tmpdir (TMPDIR alone, the host's "
            "/tmp shared); a named level fails the start when it is not available. See docs/operations.md.",
            v.choice(PRIVATE_TMP_CHOICES, upper=False)),
    Setting("task", "private_tmp_shared", "AGENT_TASK_PRIVATE_TMP_SHARED", "comma-separated absolute paths", "",
            "Paths under /tmp, /var/tmp or /dev/shm that tasks still see as the host's in their private "
            "namespace (a local database's socket, /tmp/.X11-unix); the work dir always is.", v.abs_paths),
    Setting("task", "uid_claims", "AGENT_TASK_UID_CLAIMS", "path", Path("/var/lib/ckagent/uids"),
            "Directory (root's, mode 0700) where every agent on this host claims the uids of task.spider_uids "
            "it hands out, one file per uid naming its work dir, so that no two agents give one uid to "
            "their spiders or builders; a claim whose work dir has no state.db any more is taken over. "
            "Agents that share a host's uids but not its /var/lib (containers) can share one here.", v.path),
    Setting("task", "migrate_timeout", "AGENT_TASK_MIGRATE_TIMEOUT", "seconds > 0", 20.0,
            "`ckagent stop --migrate` (or SIGTERM with agent.sigterm=migrate): the seconds every running task "
            "gets to checkpoint, stop and ship its checkpoint before it is reported MIGRATED; the agent exits "
            "within this + flush_timeout (+ a few seconds): 20 + 10 fit Kubernetes' default 30 s grace.",
            v.seconds()),
    Setting("task", "memory_soft_bytes", "AGENT_TASK_MEMORY_SOFT_BYTES", "integer >= 1 (bytes)", None,
            "Soft memory ceiling of a task that names none (`resources.memorySoftBytes`): past it the spider "
            "is asked to checkpoint, then stopped FAILED (MEMORY_LIMIT, retryable), to resume on its next "
            "attempt. Unset = none. Any containment level (the cgroup's figure, else its processes' RSS).",
            v.integer(1)),
    Setting("task", "checkpoint_interval", "AGENT_TASK_CHECKPOINT_INTERVAL", "seconds >= 0", 60.0,
            "Seconds between a running task's periodic checkpoints (its spider asked to persist its state dir, "
            "shipped with its items position) when the task names none (`checkpointIntervalSeconds`); "
            "0 = none (checkpoints before a migrate or the soft memory ceiling are still taken).",
            v.seconds(exclusive=False)),
    Setting("logging", "level", "AGENT_LOG_LEVEL", "DEBUG, INFO, WARNING, ERROR", "INFO",
            "Log level (case-insensitive).", v.choice(("DEBUG", "INFO", "WARNING", "ERROR"), upper=True)),
    Setting("logging", "file", "AGENT_LOG_FILE", "path", None,
            "Write the agent log to this file (rotated); stderr then gets it only when it is a terminal or "
            "the systemd journal. Unset = stderr only (`run.sh --daemon=on`: logs/agent.log).", v.path),
    Setting("logging", "format", "AGENT_LOG_FORMAT", "text, json", "text",
            "Log line format: text, or json (one object per line, for Loki/ELK).",
            v.choice(("text", "json"), upper=False)),
    Setting("logging", "max_bytes", "AGENT_LOG_MAX_BYTES", "integer >= 1024", 10 * 1024 * 1024,
            "Size in bytes at which logging.file is rotated.", v.integer(1024)),
    Setting("logging", "backup_count", "AGENT_LOG_BACKUP_COUNT", "integer >= 1", 5,
            "Rotated log files kept (agent.log.1 … agent.log.N).", v.integer(1)),
    Setting("deps", "uv_index_url", "AGENT_UV_INDEX_URL", "http(s) URL", None,
            "Package index for `uv`; unset = PyPI if it answers a short probe (once per agent run), "
            "else deps.uv_fallback_index_url.", v.http_url),
    Setting("deps", "uv_fallback_index_url", "AGENT_UV_FALLBACK_INDEX_URL", "http(s) URL",
            "https://pypi.tuna.tsinghua.edu.cn/simple",
            "Index used when deps.uv_index_url is unset and PyPI is unreachable (two probes fail; PyPI is probed "
            "again 10 minutes later).", v.http_url),
    Setting("deps", "uv_cache_dir", "AGENT_UV_CACHE_DIR", "path", None,
            "uv's cache; unset = work_dir/envs/.uv-cache. It belongs to the node's builder (mode 0700: spiders "
            "can neither read nor write it); one another identity owned is emptied and given to it at start.",
            v.path),
    Setting("deps", "uv_sync_timeout", "AGENT_UV_SYNC_TIMEOUT", "seconds >= 1", 180.0,
            "Time limit of one dependency installer run (uv, npm, nvm); past it the task fails "
            "DEPS_FAILED.", v.seconds(minimum=1.0, exclusive=False)),
    Setting("deps", "uv_path", "AGENT_UV_PATH", "path", None,
            "The uv executable to use when `uv` is not on PATH (without uv, Python spiders fail "
            "DEPS_FAILED: `pip install uv`).", v.path),
    Setting("deps", "env_budget_bytes", "AGENT_DEPS_ENV_BUDGET_BYTES", "integer >= 0 (bytes)", 10 * 1024**3,
            "Disk budget of the spiders' dependency environments (`work_dir/envs`, shared by projects "
            "with the same dependencies): beyond it the least recently used ones not in use are removed; "
            "0 = no limit.", v.integer(0)),
    Setting("deps", "python", "AGENT_DEPS_PYTHON", "path", None,
            "The interpreter Python spiders' environments are built on; unset = the agent's own. With "
            "task.run_as_user that user must be able to execute it (checked at start).", v.path),
)  # fmt: skip

SECTION_CLASSES: dict[str, type] = {
    "server": ServerSettings,
    "agent": AgentSettings,
    "heartbeat": HeartbeatSettings,
    "task": TaskSettings,
    "logging": LoggingSettings,
    "deps": DepsSettings,
}
SECTIONS: tuple[str, ...] = tuple(SECTION_CLASSES)
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}


def specs_in(section: str) -> Iterator[Setting]:
    """The rows of ``section``, in table order."""
    return (s for s in SETTINGS if s.section == section)


def check_table() -> None:
    """The table and the dataclasses must describe the same fields (checked at import)."""
    for section, cls in SECTION_CLASSES.items():
        fields = [f.name for f in dataclasses.fields(cls)]
        keys = [s.key for s in specs_in(section)]
        if fields != keys:
            raise AssertionError(f"SETTINGS out of sync with {cls.__name__}: {keys} != {fields}")
    if {s.section for s in SETTINGS} != set(SECTIONS) or len(BY_ENV) != len(SETTINGS):
        raise AssertionError("SETTINGS has an unknown section or a duplicate env var")


check_table()


REMOVED_SETTINGS: dict[str, str] = {
    "agent.api_key": "the node's API key is the one the master gives at registration (a key alone, "
                     "without the node id it belongs to, cannot be used); delete the line",
}
"""Settings of earlier versions: a YAML file that still sets one fails with this reason (a null value is
ignored); their environment variables are reported by :func:`suspicious_env_vars`."""
REMOVED_ENV = {"AGENT_API_KEY": "agent.api_key"}

