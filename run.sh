#!/usr/bin/env bash
# run.sh — start, stop and upgrade the CrawlerKeeper node agent (ckagent). Full guide: docs/deploy.md.
#
#   ./run.sh [FLAGS] start [AGENT ARGS...]      (default AGENT ARGS: -c config/config.yaml, else -c config.yaml)
#   ./run.sh [FLAGS] restart [AGENT ARGS...]    (default: the arguments of the last daemon start)
#   ./run.sh stop [--leave-running | --migrate] | status | logs [--follow=off] | help
#   ./run.sh upgrade [VERSION]                  (default: latest.json; an older VERSION needs --downgrade)
#   ./run.sh upgrade --downgrade VERSION        install an older release, verified and health-checked
#   ./run.sh rollback                           back to the previous verified release (ckagent.pyz.prev)
#
# restart and upgrade hand over: the old agent stops (SIGUSR2) and leaves its running tasks running,
# the new one re-adopts them (docs/operations.md, "Tasks outlive the agent"); --drain waits for them
# instead (SIGTERM, as `stop` does). `stop --leave-running` stops the agent and leaves its tasks
# running for the next start. `stop --migrate` hands them over to other nodes: `ckagent stop --migrate`
# checkpoints every running task, stops it and reports it MIGRATED (the master gives it a new attempt
# elsewhere) within task.migrate_timeout (docs/operations.md, "Stopping and migrating"); an agent
# too old for it drains instead, as `stop` does.
#
# FLAGS may stand before or after the command (./run.sh --daemon=on start = ./run.sh start --daemon=on):
#   --daemon=on|off               run in the background (log: logs/agent.log, rotated by the logging
#                                 settings); off (default) = in the foreground, logging to stderr
#                                 (the terminal, or the journal under systemd)
#   --cleanup_temp_files=on|off   before starting, delete temporary files: partial downloads, old pyz
#                                 extractions, half-finished code deployments, and (the agent, at its
#                                 start) the directories of tasks the master has fully acknowledged
#   --spider-user=NAME|off        spiders and installers run as NAME (task.run_as_user), created as a
#                                 system user without login when missing (the agent must run as root);
#                                 remembered in .ckagent/spider_user for later starts; off forgets it
#
# Everything lives next to this script: logs/agent.log, agent.pid, .last_daemon_args, data/ (the
# agent's work_dir when the config says ./data), and .ckagent/ (pyz extraction, downloads, uv, lock).
#
# Modes: a checkout next to run.sh (pyproject.toml + ckagent/) → source mode, runs
# .venv/bin/python -m ckagent (the venv is created when missing). Otherwise install mode: runs
# ckagent.pyz with python3, downloading it from AGENT_RELEASE_URL when absent.
#
# Environment: AGENT_RELEASE_URL (release index base URL: latest.json, <version>.json),
# AGENT_AUTO_INSTALL=off, AGENT_UPGRADE_DRY_RUN=on, AGENT_PYTHON (default python3),
# AGENT_STOP_TIMEOUT (default: drain_timeout + max(kill_grace, max_stop_grace) + flush_timeout + 10 s
# from the config),
# AGENT_START_TIMEOUT (15 s), AGENT_UPGRADE_HEALTH_TIMEOUT (60 s), AGENT_HEALTH_URL (default from
# the config's agent.bind/agent.ip and agent.port), AGENT_DOWNLOAD_TIMEOUT (120 s),
# AGENT_SYSTEMD_UNIT (upgrade restarts through `systemctl restart UNIT` instead of stop/start),
# AGENT_CHECK_TIMEOUT (120 s: the next agent's `config check` before upgrade/rollback/restart stop anything).
# Credentials (AGENT_REGISTRATION_TOKEN, AGENT_API_KEY) given in the environment are moved into a
# memory file before anything else (CKAGENT_SECRETS_FD names it): no process's /proc/<pid>/environ
# shows them, neither run.sh's nor the agent's.
#
# Exit codes (every command: 2 = usage error):
#   start     0 running and /healthz answers 200 (also: already running and healthy); 1 it exited during
#             its start, /healthz did not answer within AGENT_START_TIMEOUT (it is stopped; the end of
#             its log is printed), /readyz named a cause (it keeps running and retrying), or an agent
#             already runs but does not answer /healthz
#   stop      0 stopped (or was not running; --migrate: also when an older agent drained instead, said);
#             1 it survived SIGKILL
#   restart   1 the agent to be started fails its check (nothing stopped); else as stop, then as start,
#             but 3 when no agent runs after it, 4 when it runs but does not answer /healthz
#   status    0 running and /healthz 200; 3 not running; 4 running but /healthz does not answer 200
#             (then the levels in force from its /status: whom spiders run as, containment, egress,
#             and its warnings)
#   logs      0 shown; 1 no log file yet
#   upgrade   0 upgraded and healthy, installed (agent not running), nothing to do, or a version that
#             failed here before is skipped; 1 failed (download, verification, the check before
#             stopping: nothing replaced or stopped; an older VERSION without --downgrade; or a health
#             check: rolled back, healthy again); after a failed upgrade 4 an agent runs but does not
#             answer /healthz, 3 none runs (as status says)
#   rollback  0 back on the previous release (healthy, or installed when not running); 1 no previous
#             release, it fails its check (nothing changed), or it is not healthy (then the current one
#             is restored, healthy); 4 or 3 as for upgrade
#
# Before the running agent stops, upgrade, rollback and restart check what they will start: it runs
# here, and its `config check` accepts this node's config and environment (the spider user can run the
# interpreter) with a registration token reachable; as root the running agent's credentials go on to
# the next one. The last change is kept in .ckagent/last-change.json (docs/deploy.md, "What an
# upgrade, rollback or restart guarantees").
set -euo pipefail

DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
PID_FILE="$DIR/agent.pid"
ARGS_FILE="$DIR/.last_daemon_args"
LOG_DIR="$DIR/logs"
LOG_FILE="$LOG_DIR/agent.log"
STATE_DIR="$DIR/.ckagent"
PYZ="$DIR/ckagent.pyz"
PYZ_PREV="$DIR/ckagent.pyz.prev"
UV_DIR="$STATE_DIR/bin"
UV="$UV_DIR/uv"
PYTHON="${AGENT_PYTHON:-python3}"
DEFAULT_STOP_TIMEOUT=260
SPIDER_USER_FILE="$STATE_DIR/spider_user"
KEEP_UNHEALTHY=0  # 1: start leaves an agent that is not healthy yet running (upgrade/rollback wait longer)

say() { printf 'run.sh: %s\n' "$*"; }
die() { printf 'run.sh: %s\n' "$1" >&2; exit 1; }
usage_error() { printf 'run.sh: %s (./run.sh --help shows the usage)\n' "$1" >&2; exit 2; }
is_on() { case "${1,,}" in on|1|yes|true) return 0 ;; *) return 1 ;; esac; }

usage() {  # the whole header comment (up to `set -euo pipefail`), without the comment marks
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

# ---------------------------------------------------------------- helpers in Python (stdlib only)

# py CODE ARGS...: run CODE with the interpreter PYTHON names, as resolved once by resolve_python.
py() { "${PY_EXE:-$PYTHON}" -c "$1" "${@:2}"; }

# resolve_python: PY_EXE = the executable $PYTHON runs (its sys.executable), asked once per run.sh
# call. A version manager's shim (pyenv's python3 is a bash script running `pyenv exec`) costs
# ~0.1 s of CPU and a handful of processes per call, and an upgrade makes dozens of helper calls
# (the health checks poll every 0.3 s). Without an answer the helpers run $PYTHON itself.
PY_EXE=""
resolve_python() {
  local exe
  exe="$("$PYTHON" -c 'import sys; print(sys.executable)' 2>/dev/null)" || return 0
  [[ -n "$exe" && -x "$exe" ]] && PY_EXE="$exe"
  return 0
}

# release_info INDEX_URL → "version url sha256" (url resolved against the index URL)
release_info() {
  py '
import json, sys, urllib.parse, urllib.request
index = sys.argv[1]
try:
    with urllib.request.urlopen(index, timeout=30) as r:
        data = json.load(r)
    version, url, sha = str(data["version"]), str(data["url"]), str(data["sha256"]).lower()
except Exception as exc:
    sys.exit(f"run.sh: cannot read the release index {index}: {exc}")
if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
    sys.exit(f"{index}: sha256 is not 64 hex digits")
print(version, urllib.parse.urljoin(index, url), sha)
' "$1"
}

# uv_info INDEX_URL → "version url sha256" of the uv build the release index names (url resolved
# against the index URL), or nothing when it names none
uv_info() {
  py '
import json, sys, urllib.parse, urllib.request
index = sys.argv[1]
try:
    with urllib.request.urlopen(index, timeout=30) as r:
        uv = json.load(r).get("uv")
    if uv is None:
        sys.exit(0)
    version, url, sha = str(uv["version"]), str(uv["url"]), str(uv["sha256"]).lower()
except Exception as exc:
    sys.exit(f"run.sh: cannot read the uv entry of the release index {index}: {exc}")
if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
    sys.exit(f"{index}: uv.sha256 is not 64 hex digits")
print(version, urllib.parse.urljoin(index, url), sha)
' "$1"
}

# download URL DEST SHA256 — to DEST.part, verified, then renamed; nothing is left behind on failure
download() {
  py '
import hashlib, os, sys, urllib.request
url, dest, want = sys.argv[1], sys.argv[2], sys.argv[3]
part = dest + ".part"
digest = hashlib.sha256()
try:
    with urllib.request.urlopen(url, timeout=float(sys.argv[4])) as r, open(part, "wb") as out:
        while chunk := r.read(1 << 16):
            digest.update(chunk)
            out.write(chunk)
except Exception as exc:
    if os.path.exists(part):
        os.unlink(part)
    sys.exit(f"run.sh: download of {url} failed: {exc}")
if digest.hexdigest() != want:
    os.unlink(part)
    sys.exit(f"run.sh: sha256 mismatch for {url}: expected {want}, got {digest.hexdigest()}; nothing was replaced")
os.chmod(part, 0o755)
os.replace(part, dest)
' "$1" "$2" "$3" "${AGENT_DOWNLOAD_TIMEOUT:-120}"
}

# pyz_version FILE → the __version__ inside a ckagent.pyz (read from the zip, nothing extracted)
pyz_version() {
  py '
import re, sys, zipfile
try:
    with zipfile.ZipFile(sys.argv[1]) as z:
        text = z.read("site-packages/ckagent/__init__.py").decode()
    print(re.search(r"^__version__ = [\"\x27]([^\"\x27]+)", text, re.M).group(1))
except Exception as exc:
    sys.exit(f"{sys.argv[1]}: not a ckagent.pyz ({exc})")
' "$1"
}

# pyz_build_id FILE → shiv build id (names its extraction directory)
pyz_build_id() {
  py 'import json, sys, zipfile; print(json.loads(zipfile.ZipFile(sys.argv[1]).read("environment.json"))["build_id"])' "$1"
}

# vercmp A B → prints -1, 0 or 1 (PEP 440: the pattern of its Appendix B, packaging's order); a text that
# is not a PEP 440 version fails with a message (ckagent/node/versions.py is the same code; tests keep them equal)
vercmp() {
  py '
import re, sys
PATTERN = re.compile(r"""^\s*v?(?:(?:(?P<epoch>[0-9]+)!)?(?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_\.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_\.]?(?P<pre_n>[0-9]+)?)?
    (?P<post>(?:-(?P<post_n1>[0-9]+))|(?:[-_\.]?(?P<post_l>post|rev|r)[-_\.]?(?P<post_n2>[0-9]+)?))?
    (?P<dev>[-_\.]?(?P<dev_l>dev)[-_\.]?(?P<dev_n>[0-9]+)?)?)(?:\+(?P<local>[a-z0-9]+(?:[-_\.][a-z0-9]+)*))?\s*$""",
    re.VERBOSE | re.IGNORECASE)
PRE = {"alpha": "a", "a": "a", "beta": "b", "b": "b", "c": "rc", "pre": "rc", "preview": "rc", "rc": "rc"}
def key(text):
    m = PATTERN.match(text)
    if m is None:
        sys.exit(f"run.sh: not a PEP 440 version: {text!r} (expected e.g. 1.2.0, 1.3.0rc1, 2.0.post1)")
    release = [int(x) for x in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre = (PRE[m["pre_l"].lower()], int(m["pre_n"] or 0)) if m["pre_l"] else None
    post = int(m["post_n1"] or m["post_n2"] or 0) if m["post"] else None
    dev = int(m["dev_n"] or 0) if m["dev"] else None
    pre_key = (-1, "", 0) if pre is None and post is None and dev is not None else (
        (1, "", 0) if pre is None else (0, pre[0], pre[1]))
    local = (0,) if m["local"] is None else (1, tuple(
        (1, int(p), "") if p.isdigit() else (0, 0, p.lower()) for p in re.split(r"[-_.]", m["local"])))
    return (int(m["epoch"] or 0), tuple(release), pre_key, (-1, 0) if post is None else (0, post),
            (1, "") if dev is None else (0, dev), local)
a, b = key(sys.argv[1]), key(sys.argv[2])
print((a > b) - (a < b))
' "$1" "$2"
}

# http_status URL → the HTTP status code, or 000 when nothing answers
http_status() {
  py '
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        print(r.status)
except urllib.error.HTTPError as exc:
    print(exc.code)
except Exception:
    print("000")
' "$1"
}

# ---------------------------------------------------------------- mode, agent command, arguments

source_mode() { [[ -f "$DIR/pyproject.toml" && -f "$DIR/ckagent/__init__.py" ]]; }

release_url() {
  [[ -n "${AGENT_RELEASE_URL:-}" ]] || die "AGENT_RELEASE_URL is not set: point it at the release index (the directory holding latest.json)"
  printf '%s/%s' "${AGENT_RELEASE_URL%/}" "$1"
}

ensure_venv() {
  [[ -x "$DIR/.venv/bin/python" ]] && return 0
  say "source mode: creating $DIR/.venv"
  local uv
  uv="$(command -v uv || true)"
  if [[ -n "$uv" ]]; then
    "$uv" venv --quiet --python "$PYTHON" "$DIR/.venv"
    "$uv" pip install --quiet --python "$DIR/.venv/bin/python" -e "$DIR"
  else
    "$PYTHON" -m venv "$DIR/.venv"
    "$DIR/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$DIR"
  fi
}

ensure_pyz() {
  [[ -f "$PYZ" ]] && return 0
  if ! is_on "${AGENT_AUTO_INSTALL:-on}"; then
    local where="\$AGENT_RELEASE_URL/latest.json"
    [[ -n "${AGENT_RELEASE_URL:-}" ]] && where="$(release_url latest.json)"
    die "$PYZ is missing and AGENT_AUTO_INSTALL=off. Install it by hand:
  1. read url and sha256 from $where
  2. curl -fLo '$PYZ' <url> && echo '<sha256>  $PYZ' | sha256sum -c - && chmod +x '$PYZ'
or run again with AGENT_AUTO_INSTALL=on."
  fi
  local info version url sha
  [[ -n "${AGENT_RELEASE_URL:-}" ]] || die "$PYZ is missing: set AGENT_RELEASE_URL (the release index base URL) to download it, or copy it there"
  info="$(release_info "$(release_url latest.json)")" || exit 1
  read -r version url sha <<<"$info"
  say "installing ckagent $version from $url"
  mkdir -p "$STATE_DIR"
  download "$url" "$PYZ" "$sha" || exit 1
}

# ensure_uv INDEX_URL: install mode — the uv build the release index names, verified, in .ckagent/bin/uv
# (once; `upgrade` replaces it when a release names another version). Never fails the start: without
# uv the agent says so and takes no Python spiders.
ensure_uv() {
  [[ -x "$UV" ]] && return 0
  [[ -n "${AGENT_RELEASE_URL:-}" ]] && is_on "${AGENT_AUTO_INSTALL:-on}" || return 0
  local info version url sha
  if ! info="$(uv_info "$1")"; then
    say "warning: no uv installed (see above); the agent takes no Python spiders without it"
    return 0
  fi
  [[ -n "$info" ]] || return 0
  read -r version url sha <<<"$info"
  say "installing uv $version from $url"
  mkdir -p "$UV_DIR"
  if download "$url" "$UV" "$sha"; then
    printf '%s\n' "$version" >"$UV_DIR/uv.version"
  else
    say "warning: uv $version was not installed (see above); the agent takes no Python spiders without it"
  fi
}

# use_bundled_uv: the agent uses .ckagent/bin/uv unless AGENT_UV_PATH or deps.uv_path names another
use_bundled_uv() {
  [[ -x "$UV" && -z "${AGENT_UV_PATH:-}" ]] || return 0
  load_settings
  local configured
  configured="$(settings_value deps uv_path)"
  [[ -z "$configured" || "$configured" == null ]] && export AGENT_UV_PATH="$UV"
  return 0
}

# AGENT array: the command that runs ckagent (without its arguments). The agent learns where this
# run.sh is (CKAGENT_RUN_SH): with agent.auto_upgrade on it upgrades itself through `run.sh upgrade`;
# and where run.sh keeps its state (CK_RUNSH_STATE_DIR): its status page shows the last upgrade,
# rollback or restart (last-change.json) and the failed versions (failed_versions) from there.
agent_command() {
  CKAGENT_RUN_SH="$DIR/${BASH_SOURCE[0]##*/}"
  CK_RUNSH_STATE_DIR="$STATE_DIR"  # the status page reads last-change.json and failed_versions there
  export CKAGENT_RUN_SH CK_RUNSH_STATE_DIR
  if source_mode; then
    ensure_venv
    AGENT=("$DIR/.venv/bin/python" -m ckagent)
  else
    ensure_pyz
    [[ -n "${AGENT_RELEASE_URL:-}" ]] && ensure_uv "$(release_url latest.json)"
    mkdir -p "$STATE_DIR/pyz"
    AGENT=(env "SHIV_ROOT=$STATE_DIR/pyz" "${PY_EXE:-$PYTHON}" "$PYZ")
  fi
}

# like agent_command, but never installs anything (stop/status): AGENT=(false) when there is nothing to run
agent_command_if_installed() {
  if source_mode || [[ -f "$PYZ" ]]; then agent_command; else AGENT=(false); fi
}

# ARGS array: agent arguments with -c/--config made absolute; the default config when none is given
normalise_args() {
  ARGS=()
  local have_config=0 a
  while (($#)); do
    a="$1"; shift
    case "$a" in
      -c|--config)
        (($#)) || usage_error "$a needs a file"
        ARGS+=("$a" "$(abspath "$1")"); shift; have_config=1 ;;
      --config=*) ARGS+=("--config=$(abspath "${a#--config=}")"); have_config=1 ;;
      *) ARGS+=("$a") ;;
    esac
  done
  if ((have_config == 0)); then
    if [[ -f "$DIR/config/config.yaml" ]]; then ARGS+=(-c "$DIR/config/config.yaml")
    elif [[ -f "$DIR/config.yaml" ]]; then ARGS+=(-c "$DIR/config.yaml")
    fi
  fi
}

abspath() { [[ "$1" == /* ]] && printf '%s' "$1" || printf '%s/%s' "$CALLER_DIR" "$1"; }

config_args() {  # only the -c/--config part of ARGS (for `config show`)
  CONFIG_ARGS=()
  local i
  for ((i = 0; i < ${#ARGS[@]}; i++)); do
    case "${ARGS[$i]}" in
      -c|--config) CONFIG_ARGS+=("${ARGS[$i]}" "${ARGS[$((i + 1))]}") ;;
      --config=*) CONFIG_ARGS+=("${ARGS[$i]}") ;;
    esac
  done
}

# load_settings: the effective settings (`ckagent config show` with ARGS' config and this environment)
# into SETTINGS_YAML, once. Call it directly (not inside $(...)) after agent_command.
SETTINGS_YAML=""
load_settings() {
  [[ -n "$SETTINGS_YAML" ]] && return 0
  config_args
  SETTINGS_YAML="$(cd "$DIR" && "${AGENT[@]}" config show "${CONFIG_ARGS[@]+"${CONFIG_ARGS[@]}"}" 2>/dev/null)" \
    || SETTINGS_YAML="# unknown"
}

# settings_value SECTION KEY → a value from SETTINGS_YAML, empty if unknown
settings_value() {
  awk -v section="$1:" -v key="$2:" '
    /^[^ #]/ { in_section = ($1 == section) }
    in_section && $1 == key { print $2; exit }' <<<"$SETTINGS_YAML"
}

stop_timeout() {
  if [[ -n "${AGENT_STOP_TIMEOUT:-}" ]]; then printf '%s' "$AGENT_STOP_TIMEOUT"; return; fi
  local drain grace longest flush
  drain="$(settings_value task drain_timeout)"; grace="$(settings_value task kill_grace)"
  longest="$(settings_value task max_stop_grace)"; flush="$(settings_value task flush_timeout)"
  if [[ -z "$drain" || -z "$grace" ]]; then printf '%s' "$DEFAULT_STOP_TIMEOUT"; return; fi
  # drain + the longest stop grace a task may get (kill_grace, or up to max_stop_grace) + flush + 10
  py 'import math, sys; d, g, m, f = map(float, sys.argv[1:]); print(math.ceil(d + max(g, m) + f + 10))' \
    "$drain" "$grace" "${longest:-0}" "${flush:-10}"
}

health_url() {
  if [[ -n "${AGENT_HEALTH_URL:-}" ]]; then printf '%s' "$AGENT_HEALTH_URL"; return; fi
  local host port
  host="$(settings_value agent bind)"
  [[ -z "$host" || "$host" == null || "$host" == 0.0.0.0 || "$host" == "::" ]] && host="$(settings_value agent ip)"
  [[ -z "$host" || "$host" == null || "$host" == 0.0.0.0 || "$host" == "::" ]] && host=127.0.0.1
  [[ "$host" == *:* ]] && host="[$host]"
  port="$(settings_value agent port)"
  printf 'http://%s:%s/healthz' "$host" "${port:-9000}"
}

# ---------------------------------------------------------------- process state

agent_pid() {  # prints the pid and succeeds when the agent of agent.pid runs
  [[ -f "$PID_FILE" ]] || return 1
  local pid
  pid="$(tr -dc '0-9' <"$PID_FILE")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
  # guard against a recycled pid: the process must be a ckagent, and this node's — start runs it in
  # $DIR (where its working directory can be read: not a non-dumpable agent's, without root)
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q ckagent || return 1
  local cwd
  cwd="$(readlink "/proc/$pid/cwd" 2>/dev/null)" || cwd=""
  [[ -z "$cwd" || "$cwd" == "$DIR" ]] || return 1
  printf '%s' "$pid"
}

wait_gone() {  # wait_gone PID SECONDS → success when the process has exited in time
  local pid="$1" deadline=$((SECONDS + $2))
  while kill -0 "$pid" 2>/dev/null; do
    ((SECONDS >= deadline)) && return 1
    sleep 0.2
  done
}

wait_healthy() {  # wait_healthy PID SECONDS → success on /healthz 200; failure if it exits or stays unhealthy
  local pid="$1" deadline=$((SECONDS + $2)) url
  url="$(health_url)"
  while ((SECONDS < deadline)); do
    kill -0 "$pid" 2>/dev/null || return 1
    [[ "$(http_status "$url")" == 200 ]] && return 0
    sleep 0.3
  done
  return 1
}

# wait_ready PID SECONDS → success once /readyz answers 200; failure, with the reason on stdout, as soon as
# /readyz names a cause (a wrong token, a master that answers HTML, ...), or on time out (reason "").
wait_ready() {
  local pid="$1" deadline=$((SECONDS + $2)) url answer
  url="$(health_url)"
  url="${url%/healthz}/readyz"
  while ((SECONDS < deadline)); do
    kill -0 "$pid" 2>/dev/null || return 1
    answer="$(py '
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
        print("ready")
except urllib.error.HTTPError as exc:
    print(exc.read(500).decode("utf-8", "replace").strip())
except Exception:
    pass
' "$url")"
    case "$answer" in
      ready) return 0 ;;
      ""|"not ready: the agent is STARTING"|"not ready: not registered with the master yet"|"not ready: no heartbeat acknowledged by the master yet") ;;
      *) printf '%s' "${answer#not ready: }"; return 1 ;;
    esac
    sleep 0.3
  done
  return 1
}

# Hand-over: SIGUSR2 stops the agent and leaves its running tasks running for the next agent, which
# re-adopts them. DRAIN=1 (--drain) makes restart and upgrade drain instead; LEAVE_RUNNING=1
# (stop --leave-running) makes stop hand over.
DRAIN=0
LEAVE_RUNNING=0
MIGRATE=0
handover_timeout() {  # flush_timeout + 15 s: the agent only writes its positions and says goodbye
  local flush
  flush="$(settings_value task flush_timeout)"
  py 'import math, sys; print(math.ceil(float(sys.argv[1]) + 15))' "${flush:-10}"
}

# handover_stop: stop the agent of agent.pid with SIGUSR2 (its running tasks keep running), SIGKILL
# after handover_timeout (the tasks survive that too).
handover_stop() {
  local pid timeout
  if ! pid="$(agent_pid)"; then
    rm -f "$PID_FILE"
    say "ckagent is not running"
    return 0
  fi
  load_last_args
  agent_command_if_installed
  load_settings
  timeout="$(handover_timeout)"
  say "stopping ckagent (pid $pid): SIGUSR2, its running tasks keep running for the next agent (up to ${timeout}s)"
  kill -USR2 "$pid" 2>/dev/null || true
  if ! wait_gone "$pid" "$timeout"; then
    say "ckagent did not exit within ${timeout}s: SIGKILL (its tasks keep running)"
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || die "pid $pid survived SIGKILL"
  fi
  rm -f "$PID_FILE"
  say "ckagent stopped; its running tasks are left to the next start"
}

# migrate_stop: `ckagent stop --migrate` on the agent of agent.pid (its config), bounded by
# migrate_timeout + flush_timeout + 10 s; SIGKILL after that. An agent without the command (an older
# pyz: usage error) is drained instead, as cmd_stop does.
migrate_stop() {
  local pid timeout migrate flush rc=0
  if ! pid="$(agent_pid)"; then
    rm -f "$PID_FILE"
    say "ckagent is not running"
    return 0
  fi
  load_last_args
  agent_command_if_installed
  load_settings
  migrate="$(settings_value task migrate_timeout)"; flush="$(settings_value task flush_timeout)"
  if [[ -z "$migrate" ]]; then
    say "this agent has no migrate (task.migrate_timeout unknown): draining instead"
    cmd_stop
    return
  fi
  timeout="$(py 'import math, sys; print(math.ceil(float(sys.argv[1]) + float(sys.argv[2]) + 10))' "$migrate" "${flush:-10}")"
  config_args
  say "stopping ckagent (pid $pid): migrating its running tasks to other nodes (up to ${timeout}s)"
  (cd "$DIR" && "${AGENT[@]}" stop --migrate --timeout "$timeout" "${CONFIG_ARGS[@]+"${CONFIG_ARGS[@]}"}") || rc=$?
  case "$rc" in
    0|4) ;;
    2) say "this agent has no \`stop --migrate\`: draining instead"; cmd_stop; return ;;
    *) say "ckagent stop --migrate ended with $rc" ;;
  esac
  if ! wait_gone "$pid" 5; then
    say "ckagent did not exit within ${timeout}s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || die "pid $pid survived SIGKILL"
  fi
  rm -f "$PID_FILE"
  say "ckagent stopped; its running tasks were handed over to other nodes (MIGRATED)"
}

# stop_for_restart: hand over (default) or drain (--drain) before a restart or an upgrade.
stop_for_restart() {
  if ((DRAIN)); then cmd_stop; else handover_stop; fi
}

# restart_agent ARGS...: stop (hand over, or drain with --drain) and start again — through systemd when AGENT_SYSTEMD_UNIT names
# the unit that runs this agent (run.sh start in the foreground), else as a daemon with ARGS.
restart_agent() {
  if [[ -n "${AGENT_SYSTEMD_UNIT:-}" ]] && ((DRAIN)); then
    systemctl restart "$AGENT_SYSTEMD_UNIT" || say "systemctl restart $AGENT_SYSTEMD_UNIT failed"
  elif [[ -n "${AGENT_SYSTEMD_UNIT:-}" ]]; then  # KillMode=process: the unit's stop leaves the tasks be
    systemctl kill --kill-whom=main --signal=SIGUSR2 "$AGENT_SYSTEMD_UNIT" || say "systemctl kill $AGENT_SYSTEMD_UNIT failed"
    local pid
    if pid="$(agent_pid)"; then wait_gone "$pid" "$(handover_timeout)" || true; fi
    systemctl restart "$AGENT_SYSTEMD_UNIT" || say "systemctl restart $AGENT_SYSTEMD_UNIT failed"
  else
    stop_for_restart || true
    cmd_start --daemon=on "$@" >/dev/null || true
  fi
}

# wait_new_agent_healthy OLD_PID SECONDS: an agent other than OLD_PID runs and answers /healthz 200.
# Fails at once when no new agent runs (it exited during its start; under systemd: none for 5 s), else
# after SECONDS; WAIT_FAILURE then says which.
WAIT_FAILURE=""
wait_new_agent_healthy() {
  local old="$1" deadline=$((SECONDS + $2)) url pid absent_since=$SECONDS grace=0
  [[ -n "${AGENT_SYSTEMD_UNIT:-}" ]] && grace=5
  url="$(health_url)"
  while ((SECONDS < deadline)); do
    if pid="$(agent_pid)" && [[ "$pid" != "$old" ]]; then
      [[ "$(http_status "$url")" == 200 ]] && return 0
      absent_since=$SECONDS
    elif ((SECONDS - absent_since >= grace)); then
      WAIT_FAILURE="exited during its start (see $LOG_FILE)"
      return 1
    fi
    sleep 0.3
  done
  WAIT_FAILURE="is not healthy ($url) within ${2}s"
  return 1
}

lock_state() {  # one run.sh operation at a time; lock_state SECONDS waits that long for the lock
  mkdir -p "$STATE_DIR"
  exec 9>"$STATE_DIR/run.lock"
  if command -v flock >/dev/null 2>&1; then
    flock -w "${1:-0}" 9 || die "another run.sh operation is in progress (lock: $STATE_DIR/run.lock)"
  fi
}

# ---------------------------------------------------------------- commands

cleanup_temp_files() {
  say "cleaning temporary files"
  rm -f "$DIR"/ckagent.pyz.part "$STATE_DIR"/*.part "$UV_DIR"/*.part "$UV_DIR"/*.new
  rm -rf "$STATE_DIR/check"
  if [[ -d "$STATE_DIR/pyz" ]]; then
    local keep=""
    [[ -f "$PYZ" ]] && ! source_mode && keep="ckagent.pyz_$(pyz_build_id "$PYZ")"
    local entry name
    for entry in "$STATE_DIR/pyz"/* "$STATE_DIR/pyz"/.*_lock; do
      [[ -e "$entry" ]] || continue
      name="$(basename "$entry")"
      [[ -n "$keep" && ( "$name" == "$keep" || "$name" == ".${keep}_lock" ) ]] && continue
      rm -rf "$entry"
    done
  fi
  # half-finished code deployments of a crashed agent (workspace temp dirs)
  find "$DIR/data/spiders" -mindepth 2 -maxdepth 2 -name '.deploy-*' -exec rm -rf {} + 2>/dev/null || true
}

cmd_start() {
  local daemon=0 cleanup=0 rest=()
  while (($#)); do
    case "$1" in
      --daemon=*) is_on "${1#--daemon=}" && daemon=1 || daemon=0 ;;
      --daemon) daemon=1 ;;
      --cleanup_temp_files=*|--cleanup-temp-files=*) is_on "${1#*=}" && cleanup=1 || cleanup=0 ;;
      *) rest+=("$1") ;;
    esac
    shift
  done
  local pid
  if pid="$(agent_pid)"; then
    already_running "$pid"
    return
  fi
  normalise_args "${rest[@]+"${rest[@]}"}"
  if ((cleanup)); then
    cleanup_temp_files
    export AGENT_CLEANUP_TEMP_FILES=on  # the agent deletes the acknowledged task directories at its start
  fi
  agent_command
  use_bundled_uv
  mkdir -p "$LOG_DIR"
  chmod go-rwx "$LOG_DIR" 2>/dev/null || true  # the agent's log names every task: no spider reads it
  cd "$DIR"
  if ((daemon == 0)); then
    # stderr: the terminal, or the journal under systemd (logging.file, if set, gets it too)
    say "starting ckagent in the foreground (log on stderr)"
    rm -f "$ARGS_FILE"
    echo $$ >"$PID_FILE"
    exec 9>&-
    exec "${AGENT[@]}" run "${ARGS[@]+"${ARGS[@]}"}"
  fi
  printf '%s\0' "${ARGS[@]+"${ARGS[@]}"}" >"$ARGS_FILE"
  load_settings
  # The agent writes logs/agent.log itself, rotating it by logging.max_bytes/backup_count; its
  # stdout/stderr (a crash before logging starts) go to the same file, and follow it when it rotates.
  local configured_log
  configured_log="$(settings_value logging file)"
  if [[ -z "${AGENT_LOG_FILE:-}" && ( -z "$configured_log" || "$configured_log" == null ) ]]; then
    export AGENT_LOG_FILE="$LOG_FILE"
  fi
  if command -v setsid >/dev/null 2>&1; then
    nohup setsid "${AGENT[@]}" run "${ARGS[@]+"${ARGS[@]}"}" >>"$LOG_FILE" 2>&1 </dev/null 9>&- &
  else
    nohup "${AGENT[@]}" run "${ARGS[@]+"${ARGS[@]}"}" >>"$LOG_FILE" 2>&1 </dev/null 9>&- &
  fi
  pid=$!
  echo "$pid" >"$PID_FILE"
  if wait_healthy "$pid" "${AGENT_START_TIMEOUT:-15}"; then
    local cause
    if cause="$(wait_ready "$pid" "${AGENT_START_TIMEOUT:-15}")"; then
      say "ckagent started and ready (pid $pid); log: $LOG_FILE"
      return 0
    elif [[ -n "$cause" ]]; then
      printf 'run.sh: ckagent runs (pid %s) but is not ready: %s\nrun.sh: it keeps retrying; fix the cause, or stop it with ./run.sh stop (log: %s)\n' \
        "$pid" "$cause" "$LOG_FILE" >&2
      return 1
    fi
    say "ckagent started (pid $pid), not ready yet; log: $LOG_FILE"
    return 0
  fi
  if kill -0 "$pid" 2>/dev/null; then
    if ((KEEP_UNHEALTHY)); then
      say "ckagent started (pid $pid) but $(health_url) does not answer 200 yet; see $LOG_FILE"
      return 0
    fi
    start_timed_out "$pid"
    return 1
  fi
  rm -f "$PID_FILE"
  printf 'run.sh: ckagent exited during start; the end of %s:\n' "$LOG_FILE" >&2
  tail -n 20 "$LOG_FILE" >&2 || true
  return 1
}

cmd_stop() {
  local pid timeout
  if ! pid="$(agent_pid)"; then
    rm -f "$PID_FILE"
    say "ckagent is not running"
    return 0
  fi
  load_last_args
  agent_command_if_installed
  load_settings
  timeout="$(stop_timeout)"
  say "stopping ckagent (pid $pid): SIGTERM, draining up to ${timeout}s"
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_gone "$pid" "$timeout"; then
    say "ckagent did not exit within ${timeout}s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || die "pid $pid survived SIGKILL"
  fi
  rm -f "$PID_FILE"
  say "ckagent stopped"
}

load_last_args() {  # ARGS from .last_daemon_args (or the defaults)
  local saved=()
  if [[ -f "$ARGS_FILE" ]]; then
    while IFS= read -r -d '' a; do saved+=("$a"); done <"$ARGS_FILE"
  fi
  normalise_args "${saved[@]+"${saved[@]}"}"
}

cmd_restart() {
  local rest=() flags=() a
  for a in "$@"; do
    case "$a" in
      --daemon*|--cleanup*) flags+=("$a") ;;
      *) rest+=("$a") ;;
    esac
  done
  if ((${#rest[@]} == 0)); then
    load_last_args
    rest=("${ARGS[@]+"${ARGS[@]}"}")
  fi
  local pid="" running=0 version rc=0
  version="$(installed_version)"
  if pid="$(agent_pid)"; then
    running=1
    # The agent to be started (these arguments, this environment, the spider user asked for) must
    # start here before the running one stops.
    normalise_args "${rest[@]+"${rest[@]}"}"
    agent_command
    hand_on_secrets "$pid"
    [[ -n "$SECRETS_HANDED_ON" ]] && say "this shell gives no credentials: the ones the running agent (pid $pid) was started with go on to the new one"
    if ! check_next installed ""; then
      record_change restart "$version" "$version" refused "the agent to be started $CHECK_FAILURE"
      die "not restarting: the agent to be started $CHECK_FAILURE
run.sh: nothing was stopped: ckagent (pid $pid) keeps running${SPIDER_USER_DEFERRED:+; the spider user is left as it was}"
    fi
  fi
  commit_spider_user
  stop_for_restart
  SETTINGS_YAML=""
  cmd_start --daemon=on "${flags[@]+"${flags[@]}"}" "${rest[@]+"${rest[@]}"}" || rc=$?
  node_state
  if ((running)); then
    if [[ "$NODE_STATE" == healthy ]]; then record_change restart "$version" "$version" healthy ""
    else record_change restart "$version" "$version" "$NODE_STATE" "the new agent did not become healthy (see $LOG_FILE)"; fi
  fi
  if [[ "$NODE_STATE" != healthy ]] && ((rc != 0 || running)); then
    printf 'run.sh: after the restart: %s\n' "$(state_words)" >&2
    exit_for_state
  fi
  return "$rc"
}

# status_levels URL: the levels in force as the agent's /status says them (whom spiders run as, its
# containment and egress) and its notices, indented under the status line; nothing when it cannot say.
status_levels() {
  py '
import json, sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as answer:
        status = json.load(answer)
except Exception:
    sys.exit(0)
def part(key):
    found = status.get(key)
    return found if isinstance(found, dict) else {}
identity = part("identity")
if identity:
    print("  identity: %s (whom spiders run as): %s" % (identity.get("level"), identity.get("details")))
    for passed in identity.get("passedOver") or ():
        if passed.get("blocker") != "run-as-user":
            print("    not %s: %s; to get it: %s" % (passed.get("level"), passed.get("message"), passed.get("remedy")))
print("  containment: %s; egress: %s" % (part("containment").get("level"), part("egress").get("level")))
for text in status.get("warnings") or ():
    print("  warning: %s" % text)
' "$1" || true
}

cmd_status() {
  local pid mode version=""
  source_mode && mode=source || mode=install
  if source_mode; then
    version=" $(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$DIR/ckagent/__init__.py")"
  elif [[ -f "$PYZ" ]]; then
    version=" $(pyz_version "$PYZ" 2>/dev/null || true)"
  fi
  if pid="$(agent_pid)"; then
    load_last_args
    agent_command_if_installed
    load_settings
    local url code
    url="$(health_url)"
    code="$(http_status "$url")"
    if [[ "$code" != 200 ]]; then
      printf 'run.sh: ckagent%s runs (pid %s, %s mode) but does not answer: %s → %s (see %s)\n' \
        "$version" "$pid" "$mode" "$url" "$code" "$LOG_FILE" >&2
      return 4
    fi
    say "ckagent${version} is running (pid $pid, $mode mode); $url → $code"
    status_levels "${url%/healthz}/status"
    return 0
  fi
  say "ckagent${version} is not running ($mode mode)"
  return 3
}

cmd_logs() {
  local follow=1
  for a in "$@"; do
    case "$a" in
      --follow=*) is_on "${a#--follow=}" || follow=0 ;;
      *) usage_error "logs: unknown option $a" ;;
    esac
  done
  [[ -f "$LOG_FILE" ]] || die "no log yet: $LOG_FILE (a daemon writes it; in the foreground the log goes to stderr, under systemd to the journal: journalctl -u ckagent)"
  if ((follow)); then exec tail -n "${AGENT_LOG_LINES:-100}" -F "$LOG_FILE"; fi
  tail -n "${AGENT_LOG_LINES:-100}" "$LOG_FILE"
}

cmd_upgrade() {
  local downgrade=0 positional=()
  while (($#)); do
    case "$1" in
      --downgrade|--allow-downgrade) downgrade=1 ;;
      -*) usage_error "upgrade: unknown option $1 (./run.sh upgrade [--downgrade] [VERSION])" ;;
      *) positional+=("$1") ;;
    esac
    shift
  done
  set -- "${positional[@]+"${positional[@]}"}"
  (($# <= 1)) || usage_error "upgrade takes at most one argument, a VERSION: ./run.sh upgrade [--downgrade] [VERSION]"
  ((downgrade == 0 || $# == 1)) || usage_error "upgrade --downgrade needs the VERSION to go back to: ./run.sh upgrade --downgrade VERSION"
  source_mode && die "source mode ($DIR is a checkout): update it with git and run ./run.sh restart"
  local wanted="${1:-}" index info version url sha current="" dry=0 auto=0 order
  is_on "${AGENT_UPGRADE_DRY_RUN:-off}" && dry=1
  # AGENT_UPGRADE_AUTO=on: the agent asks (agent.auto_upgrade); its VERSION is not the operator's choice
  is_on "${AGENT_UPGRADE_AUTO:-off}" && auto=1
  unset AGENT_UPGRADE_AUTO  # not for the agent this upgrade starts
  if [[ -n "$wanted" ]]; then
    vercmp "$wanted" "$wanted" >/dev/null || exit 2
    index="$(release_url "$wanted.json")"
  else
    index="$(release_url latest.json)"
  fi
  info="$(release_info "$index")" || exit 1
  read -r version url sha <<<"$info"
  # Refused before anything is downloaded: a version that is not PEP 440 cannot be ordered.
  vercmp "$version" "$version" >/dev/null || die "$index names version '$version', which is not a PEP 440 version; nothing was downloaded"
  [[ -z "$wanted" || "$(vercmp "$version" "$wanted")" == 0 ]] || die "$index names version $version, not $wanted"
  if [[ -f "$PYZ" ]]; then
    current="$(pyz_version "$PYZ")" || exit 1
    order="$(vercmp "$version" "$current")" || exit 1
    case "$order" in
      0) say "ckagent $current is installed and is the release offered ($index): nothing to do"; return 0 ;;
      -1)
        if [[ -z "$wanted" ]]; then
          say "installed $current is newer than the latest release $version ($index): nothing to do"; return 0
        elif ((downgrade == 0)); then
          die "not downgrading: installed $current is newer than $version; nothing changed. To go back to it, say so: ./run.sh upgrade --downgrade $version (or ./run.sh rollback for the previous release)"
        fi
        say "downgrading from $current to $version, as asked (--downgrade)" ;;
    esac
  fi
  if failed_before "$version" && { [[ -z "$wanted" ]] || ((auto)); }; then
    say "not retrying ckagent $version: it failed its health check here before ($FAILED_FILE); it is tried again"
    say "  when a newer release is published, or when you name it: ./run.sh upgrade $version"
    return 0
  fi
  local pid="" running=0 health
  pid="$(agent_pid)" && running=1
  # Read the settings with the installed (known good) agent, before anything is replaced.
  load_last_args
  local saved=("${ARGS[@]+"${ARGS[@]}"}")
  agent_command_if_installed
  load_settings
  health="$(health_url)"
  if ((dry)); then
    say "dry run (AGENT_UPGRADE_DRY_RUN=on): would download $url (sha256 $sha) and the uv the release names,"
    say "  replace ckagent ${current:-(none)} by $version, keeping the old one as $(basename "$PYZ_PREV"),"
    if ((running)); then say "  and restart the running agent (pid $pid), rolling back if $health fails"
    else say "  and not start it (the agent is not running)"; fi
    return 0
  fi
  mkdir -p "$STATE_DIR"
  local new="$STATE_DIR/ckagent-$version.pyz"
  say "downloading ckagent $version from $url"
  download "$url" "$new" "$sha" || exit 1
  # The new file must run here, and accept this node's settings and environment, before it replaces
  # anything (extracted into a throwaway root); a running agent is stopped only after that.
  ((running)) && hand_on_secrets "$pid"
  [[ -n "$SECRETS_HANDED_ON" ]] && say "this shell gives no credentials: the ones the running agent (pid $pid) was started with go on to the new one"
  if ! check_next "$new" "$version"; then
    if [[ "$CHECK_KIND" == release ]]; then
      rm -f "$new"
      record_change upgrade "$current" "$version" refused "ckagent $version $CHECK_FAILURE"
      die "the downloaded ckagent $version $CHECK_FAILURE; nothing was replaced${pid:+, the running agent (pid $pid) was not touched}"
    elif ((running)); then
      rm -f "$new"
      record_change upgrade "$current" "$version" refused "ckagent $version $CHECK_FAILURE"
      die "not upgrading: ckagent $version $CHECK_FAILURE
run.sh: nothing was replaced or stopped: ckagent ${current:-(installed)} keeps running (pid $pid); $version is not marked failed (fix the settings or the environment and run the upgrade again)"
    fi
    say "warning: ckagent $version $CHECK_FAILURE"
    say "  (installed all the same: the agent is not running; fix this before ./run.sh start)"
  fi
  # uv travels with the agent: the release's uv build, when it names another one than installed
  local uv_line uv_version="" uv_url uv_sha uv_new=""
  uv_line="$(uv_info "$index")" || { rm -f "$new"; die "nothing was replaced"; }
  if [[ -n "$uv_line" ]]; then
    read -r uv_version uv_url uv_sha <<<"$uv_line"
    if [[ "$(cat "$UV_DIR/uv.version" 2>/dev/null || true)" != "$uv_version" || ! -x "$UV" ]]; then
      uv_new="$UV_DIR/uv-$uv_version.new"
      mkdir -p "$UV_DIR"
      say "downloading uv $uv_version from $uv_url"
      download "$uv_url" "$uv_new" "$uv_sha" || { rm -f "$new"; die "uv $uv_version could not be installed; nothing was replaced"; }
    fi
  fi
  if [[ -f "$PYZ" ]]; then
    ln -f "$PYZ" "$PYZ_PREV" 2>/dev/null || cp -p "$PYZ" "$PYZ_PREV"
  fi
  mv -f "$new" "$PYZ"   # atomic: same directory tree, rename(2)
  rm -f "$UV.prev" "$UV_DIR/uv.version.prev"  # the previous pyz goes with the uv in place, unless replaced now
  if [[ -n "$uv_new" ]]; then
    if [[ -x "$UV" ]]; then
      cp -p "$UV" "$UV.prev"
      cp -p "$UV_DIR/uv.version" "$UV_DIR/uv.version.prev" 2>/dev/null || true
    fi
    mv -f "$uv_new" "$UV"
    printf '%s\n' "$uv_version" >"$UV_DIR/uv.version"
    say "installed uv $uv_version"
  fi
  say "installed ckagent $version (previous: ${current:-none}, kept as $PYZ_PREV)"
  if ((running == 0)); then
    record_change upgrade "$current" "$version" installed "the agent was not running: not started"
    say "the agent is not running: not starting it"
    return 0
  fi
  KEEP_UNHEALTHY=1
  restart_agent "${saved[@]+"${saved[@]}"}"
  local timeout="${AGENT_UPGRADE_HEALTH_TIMEOUT:-60}" why failed_pid
  if wait_new_agent_healthy "$pid" "$timeout"; then
    forget_failed "$version"
    record_change upgrade "$current" "$version" healthy ""
    say "upgraded to $version: healthy (pid $(agent_pid))"
    return 0
  fi
  why="$WAIT_FAILURE"
  if [[ ! -f "$PYZ_PREV" ]]; then
    node_state
    record_change upgrade "$current" "$version" "$NODE_STATE" "ckagent $version $why; no previous release to roll back to"
    say "ckagent $version $why; no previous pyz to roll back to: it stays installed"
    say "now: $(state_words)"
    exit_for_state
  fi
  say "ckagent $version $why: rolling back to ${current:-the previous version}"
  failed_pid="$(agent_pid || true)"
  mv -f "$PYZ" "$STATE_DIR/ckagent-$version.failed.pyz"
  mv -f "$PYZ_PREV" "$PYZ"
  if [[ -n "$uv_new" && -x "$UV.prev" ]]; then  # the uv that went with the previous pyz
    mv -f "$UV.prev" "$UV"
    mv -f "$UV_DIR/uv.version.prev" "$UV_DIR/uv.version" 2>/dev/null || true
  fi
  restart_agent "${saved[@]+"${saved[@]}"}"
  wait_new_agent_healthy "${failed_pid:-$pid}" "$timeout" || true
  node_state
  if [[ "$NODE_STATE" == healthy ]]; then
    # the release before it runs here again: it was the new release that failed
    remember_failed "$version"
    record_change upgrade "$current" "$version" rolled-back "ckagent $version $why"
    die "upgrade to $version failed ($why) and was rolled back: $(state_words); the failed file is $STATE_DIR/ckagent-$version.failed.pyz; $version is not tried again until you name it (./run.sh upgrade $version) or a newer one is published"
  fi
  # the previous release does not come back either: the cause may be this node, not the release
  record_change upgrade "$current" "$version" "$NODE_STATE" "ckagent $version $why; rolled back to ${current:-the previous pyz}, which did not come back either"
  printf 'run.sh: upgrade to %s failed (%s) and was rolled back to %s, which did not come back either: %s\n' \
    "$version" "$why" "${current:-the previous pyz}" "$(state_words)" >&2
  printf 'run.sh: %s is not marked failed (the cause may be this node rather than the release); the file is %s\n' \
    "$version" "$STATE_DIR/ckagent-$version.failed.pyz" >&2
  exit_for_state
}

# ---------------------------------------------------------------- start's verdicts, verification, rollback

# already_running PID: `start` when an agent runs: 0 when it answers /healthz, else 1 with the end of its log
already_running() {
  local pid="$1" url code
  load_last_args
  agent_command_if_installed
  load_settings
  url="$(health_url)"
  code="$(http_status "$url")"
  if [[ "$code" == 200 ]]; then
    say "ckagent is already running (pid $pid)"
    return 0
  fi
  printf 'run.sh: ckagent is already running (pid %s) but %s → %s; the end of %s:\n' "$pid" "$url" "$code" "$LOG_FILE" >&2
  tail -n 20 "$LOG_FILE" >&2 2>/dev/null || true
  printf 'run.sh: ./run.sh restart starts it again\n' >&2
  return 1
}

# start_timed_out PID: the agent runs but /healthz did not answer in time: print the end of its log, stop it
start_timed_out() {
  local pid="$1"
  printf 'run.sh: ckagent (pid %s) did not answer %s within %ss; stopping it. The end of %s:\n' \
    "$pid" "$(health_url)" "${AGENT_START_TIMEOUT:-15}" "$LOG_FILE" >&2
  tail -n 20 "$LOG_FILE" >&2 || true
  kill -TERM "$pid" 2>/dev/null || true
  if ! wait_gone "$pid" 10; then
    kill -KILL "$pid" 2>/dev/null || true
    wait_gone "$pid" 10 || true
  fi
  rm -f "$PID_FILE"
  printf 'run.sh: raise AGENT_START_TIMEOUT if this agent needs longer to start\n' >&2
}

# ---------------------------------------------------------------- checks before anything stops, and the record

# hand_on_secrets PID: when this shell gives the agent no credentials (no CKAGENT_SECRETS_FD: neither
# AGENT_REGISTRATION_TOKEN nor AGENT_API_KEY in its environment), the ones the running agent PID was
# started with are handed on to the agent started next: its memory file (the fd its environ names,
# /proc/PID/fd/N) is opened again and passed as CKAGENT_SECRETS_FD. So `run.sh upgrade` or `restart` from
# a shell without the token keeps the node's token — unless the config names one now (then that one
# is the node's: nothing is handed on). Reading another process's /proc files needs root
# (the agent is non-dumpable); without that nothing is handed on, and check_next refuses when no token
# is reachable. Only from an agent whose working directory is this run.sh's (start runs it there): a
# recycled pid in agent.pid that names another node's agent gives nothing. SECRETS_HANDED_ON names the
# pid they came from.
SECRETS_HANDED_ON=""
hand_on_secrets() {
  [[ -z "${CKAGENT_SECRETS_FD:-}" ]] || return 0
  local pid="$1" n="" fd configured
  # a token in the config (as this shell's settings show it) is the operator's choice: it is kept
  load_settings
  configured="$(settings_value agent registration_token)"
  [[ -z "$configured" || "$configured" == null ]] || return 0
  # this node's agent only (started in $DIR by this run.sh), not another agent a recycled pid names
  [[ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" == "$DIR" ]] || return 0
  n="$( (tr '\0' '\n' <"/proc/$pid/environ") 2>/dev/null | sed -n 's/^CKAGENT_SECRETS_FD=\([0-9][0-9]*\)$/\1/p' | head -n 1)" || true
  [[ -n "$n" && -r "/proc/$pid/fd/$n" ]] || return 0
  { exec {fd}<"/proc/$pid/fd/$n"; } 2>/dev/null || return 0
  export CKAGENT_SECRETS_FD="$fd"
  SECRETS_HANDED_ON="$pid"
}

# check_next RELEASE VERSION: what is started next must start here, checked before anything stops.
# RELEASE is a pyz file (run from a throwaway extraction) or `installed` (the AGENT command); with a
# VERSION, it must run on this Python and report that version (`version`); then its `config check`,
# run as the agent will be (this node's config: ARGS; this environment: the spider user, uv, the
# credentials), must accept the settings (paths, ports, levels, and that the spider user can execute
# the spiders' interpreter), and a registration token must reach it. On failure CHECK_FAILURE says why
# and CHECK_KIND says whose fault it is: `release` (the file does not run or is another version) or
# `settings` (this node's config or environment as the release judges them).
CHECK_FAILURE=""
CHECK_KIND=""
check_next() {
  local file="$1" version="$2" check="$STATE_DIR/check" out rc=0 cmd
  use_bundled_uv
  config_args
  if [[ "$file" == installed ]]; then cmd=("${AGENT[@]}")
  else cmd=(env "SHIV_ROOT=$check" "${PY_EXE:-$PYTHON}" "$file"); fi
  rm -rf "$check"
  CHECK_KIND=release
  if [[ -n "$version" ]]; then
    if ! out="$("${cmd[@]}" version 2>&1)"; then
      rm -rf "$check"
      CHECK_FAILURE="does not run with $PYTHON: $out"
      return 1
    fi
    if [[ "$out" != "ckagent $version "* ]]; then
      rm -rf "$check"
      CHECK_FAILURE="reports '$out', not ckagent $version"
      return 1
    fi
  fi
  local limit=()  # a check that hangs (a level probe) holds the lock, never the node: bounded all the same
  command -v timeout >/dev/null 2>&1 && limit=(timeout -k 5 "${AGENT_CHECK_TIMEOUT:-120}")
  out="$(cd "$DIR" && "${limit[@]+"${limit[@]}"}" "${cmd[@]}" config check "${CONFIG_ARGS[@]+"${CONFIG_ARGS[@]}"}" 2>&1 </dev/null)" || rc=$?
  rm -rf "$check"
  if ((rc == 124)) && ((${#limit[@]})); then
    CHECK_FAILURE="did not finish its \`config check\` within ${AGENT_CHECK_TIMEOUT:-120}s (AGENT_CHECK_TIMEOUT)"
    return 1
  fi
  if ((rc == 0)) && grep -q 'config OK' <<<"$out" && ! grep -q '^warning: no registration token' <<<"$out"; then
    return 0
  fi
  if ((rc == 0 || rc == 2)); then CHECK_KIND=settings; fi  # 2: ckagent's config error; else it broke
  if ((rc == 0)); then
    CHECK_FAILURE="would have no registration token: neither the config nor this shell's environment has one"
    [[ -n "$SECRETS_HANDED_ON" ]] && CHECK_FAILURE+=", nor the credentials the running agent was started with"
    [[ -z "$SECRETS_HANDED_ON" ]] && agent_pid >/dev/null && CHECK_FAILURE+=", and the running agent's (given in the environment it was started with) cannot be read here (only root can read a running agent's credentials)"
    CHECK_FAILURE+=". Run again with the token in the environment (AGENT_REGISTRATION_TOKEN=... ./run.sh ...), or set agent.registration_token in the config"
    return 1
  fi
  local said
  said="$(grep -E '^(error|ckagent|Traceback|[A-Za-z]+Error)' <<<"$out" | tail -n 12)"
  [[ -n "$said" ]] || said="$(tail -n 12 <<<"$out")"
  CHECK_FAILURE="fails its \`config check\` with this node's settings and environment (exit $rc):
$said"
  return 1
}

# node_state: what `status` would say now: NODE_STATE healthy (0), unhealthy (4: runs, /healthz not 200)
# or down (3: no agent runs); NODE_PID the agent's pid (empty when down). Needs the settings (health_url).
NODE_STATE=""
NODE_PID=""
node_state() {
  if NODE_PID="$(agent_pid)"; then
    if [[ "$(http_status "$(health_url)")" == 200 ]]; then NODE_STATE=healthy; else NODE_STATE=unhealthy; fi
  else
    NODE_PID=""
    NODE_STATE=down
  fi
}

# state_words: the node's state as a sentence for the operator (after node_state)
state_words() {
  case "$NODE_STATE" in
    healthy) printf 'ckagent %s is running (pid %s) and healthy' "$(installed_version)" "$NODE_PID" ;;
    unhealthy) printf 'ckagent %s is running (pid %s) but %s does not answer 200 (./run.sh status: 4)' \
                 "$(installed_version)" "$NODE_PID" "$(health_url)" ;;
    *) printf 'no agent is running: the node is down (./run.sh status: 3); see %s' "$LOG_FILE" ;;
  esac
}

# exit_for_state: exit as an upgrade, rollback or restart that went wrong, agreeing with `status` (after
# node_state): 1 when the node is back and healthy, 4 when an agent runs but does not answer, 3 when none runs.
exit_for_state() {
  case "$NODE_STATE" in healthy) exit 1 ;; unhealthy) exit 4 ;; *) exit 3 ;; esac
}

installed_version() {  # the installed release's version (source mode: the checkout's), or nothing
  if source_mode; then sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$DIR/ckagent/__init__.py"
  elif [[ -f "$PYZ" ]]; then pyz_version "$PYZ" 2>/dev/null || true
  fi
}

# record_change ACTION FROM TO OUTCOME REASON: the last upgrade, rollback or restart, as one JSON object
# in $STATE_DIR/last-change.json (replaced atomically) for the agent's status page (CK_RUNSH_STATE_DIR):
# {"action": "upgrade"|"rollback"|"restart", "from": version, "to": version, "outcome": "healthy"|
# "installed"|"refused"|"rolled-back"|"undone"|"unhealthy"|"down", "at": epoch seconds, "reason": text}
# (docs/deploy.md, "What an upgrade guarantees"). Never fails the command.
LAST_CHANGE_FILE="$STATE_DIR/last-change.json"
record_change() {
  mkdir -p "$STATE_DIR"
  py '
import json, os, sys, time
path, action, old, new, outcome, reason = sys.argv[1:7]
record = {"action": action, "from": old or None, "to": new or None, "outcome": outcome,
          "at": int(time.time()), "reason": reason}
part = "%s.%d.part" % (path, os.getpid())
with open(part, "w", encoding="utf-8") as out:
    json.dump(record, out)
    out.write("\n")
os.chmod(part, 0o644)
os.replace(part, path)
' "$LAST_CHANGE_FILE" "$@" 2>/dev/null || say "warning: could not write $LAST_CHANGE_FILE"
}

# swap_releases: ckagent.pyz <-> ckagent.pyz.prev, and the uv that went with each (uv.prev, when kept)
swap_releases() {
  mv -f "$PYZ" "$PYZ.swap"
  mv -f "$PYZ_PREV" "$PYZ"
  mv -f "$PYZ.swap" "$PYZ_PREV"
  if [[ -x "$UV.prev" ]]; then
    mv -f "$UV" "$UV.swap" 2>/dev/null || true
    mv -f "$UV.prev" "$UV"
    [[ -e "$UV.swap" ]] && mv -f "$UV.swap" "$UV.prev"
    if [[ -f "$UV_DIR/uv.version.prev" ]]; then
      mv -f "$UV_DIR/uv.version" "$UV_DIR/uv.version.swap" 2>/dev/null || true
      mv -f "$UV_DIR/uv.version.prev" "$UV_DIR/uv.version"
      [[ -e "$UV_DIR/uv.version.swap" ]] && mv -f "$UV_DIR/uv.version.swap" "$UV_DIR/uv.version.prev"
    fi
  fi
  return 0
}

# rollback: back to the release before the last upgrade (kept as ckagent.pyz.prev, with its uv), verified
# and health-checked like an upgrade; the release left is remembered as failed (not upgraded to again
# from latest.json or by the agent, until named). Running it twice goes forward again.
cmd_rollback() {
  (($# == 0)) || usage_error "rollback takes no arguments (it goes back to $(basename "$PYZ_PREV"))"
  source_mode && die "source mode ($DIR is a checkout): check out the previous revision with git and run ./run.sh restart"
  [[ -f "$PYZ" ]] || die "no ckagent.pyz installed: nothing to roll back"
  [[ -f "$PYZ_PREV" ]] || die "no previous release to roll back to: $PYZ_PREV is kept by ./run.sh upgrade (none ran here)"
  local current previous
  current="$(pyz_version "$PYZ")" || exit 1
  previous="$(pyz_version "$PYZ_PREV")" || die "$PYZ_PREV is not a ckagent.pyz; nothing changed"
  local pid="" running=0
  pid="$(agent_pid)" && running=1
  load_last_args
  local saved=("${ARGS[@]+"${ARGS[@]}"}")
  agent_command_if_installed
  load_settings
  # The previous release must run here and accept this node's settings before anything stops.
  ((running)) && hand_on_secrets "$pid"
  if ! check_next "$PYZ_PREV" "$previous"; then
    if [[ "$CHECK_KIND" == release || "$running" == 1 ]]; then
      record_change rollback "$current" "$previous" refused "ckagent $previous $CHECK_FAILURE"
      die "not rolling back: the previous release $previous $CHECK_FAILURE
run.sh: nothing changed${pid:+: ckagent $current keeps running (pid $pid)}"
    fi
    say "warning: the previous release $previous $CHECK_FAILURE (the agent is not running: rolled back all the same)"
  fi
  swap_releases
  remember_failed "$current"
  say "rolled back: ckagent $previous is installed ($current is kept as $PYZ_PREV and not upgraded to again until named)"
  if ((running == 0)); then
    record_change rollback "$current" "$previous" installed "the agent was not running: not started"
    say "the agent is not running: not starting it"
    return 0
  fi
  KEEP_UNHEALTHY=1
  restart_agent "${saved[@]+"${saved[@]}"}"
  local timeout="${AGENT_UPGRADE_HEALTH_TIMEOUT:-60}" failed_pid
  if wait_new_agent_healthy "$pid" "$timeout"; then
    record_change rollback "$current" "$previous" healthy ""
    say "rolled back to $previous: healthy (pid $(agent_pid))"
    return 0
  fi
  local why="$WAIT_FAILURE"
  say "ckagent $previous $why: undoing the rollback, back to $current"
  failed_pid="$(agent_pid || true)"
  swap_releases
  forget_failed "$current"
  restart_agent "${saved[@]+"${saved[@]}"}"
  wait_new_agent_healthy "${failed_pid:-$pid}" "$timeout" || true
  node_state
  if [[ "$NODE_STATE" == healthy ]]; then
    record_change rollback "$current" "$previous" undone "ckagent $previous $why; back on $current"
  else
    record_change rollback "$current" "$previous" "$NODE_STATE" "ckagent $previous $why; $current did not come back either"
  fi
  printf 'run.sh: ckagent %s %s: rollback undone, back on %s: %s\n' "$previous" "$why" "$current" "$(state_words)" >&2
  exit_for_state
}

# --spider-user=NAME: spiders run as NAME (AGENT_TASK_RUN_AS_USER), a system user created when missing;
# remembered in .ckagent/spider_user; `off` forgets it. Applied by start (also in the foreground).
# With `defer` (restart) the choice is used for the check and the start but kept in spider_user only
# once the check passed (commit_spider_user): a refused restart leaves it as it was.
SPIDER_USER_DEFERRED=""
SPIDER_USER_CHOSEN=""
set_spider_user() {
  local name="$1" defer="${2:-}"
  mkdir -p "$STATE_DIR"
  if [[ -z "$name" || "${name,,}" == off ]]; then
    if [[ -n "$defer" ]]; then SPIDER_USER_DEFERRED=1; SPIDER_USER_CHOSEN=""; return 0; fi
    rm -f "$SPIDER_USER_FILE"
    return 0
  fi
  [[ "$name" =~ ^[a-z_][a-z0-9_-]{0,30}$ ]] || usage_error "--spider-user=$name: not a user name (lower-case letters, digits, _ and -)"
  if ! id -u "$name" >/dev/null 2>&1; then
    ((EUID == 0)) || die "--spider-user=$name: no such user, and only root can create it (and only an agent running as root can run spiders as another user)"
    command -v useradd >/dev/null 2>&1 || die "--spider-user=$name: no such user and no useradd to create it; create it yourself"
    useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "$name" \
      || die "--spider-user=$name: useradd failed"
    say "created the system user $name (no login, no home) for spiders"
  fi
  if [[ -n "$defer" ]]; then
    SPIDER_USER_DEFERRED=1
    SPIDER_USER_CHOSEN="$name"
    [[ -n "${AGENT_TASK_RUN_AS_USER:-}" ]] || export AGENT_TASK_RUN_AS_USER="$name"
    return 0
  fi
  printf '%s\n' "$name" >"$SPIDER_USER_FILE"
}

commit_spider_user() {  # a deferred --spider-user choice, kept in spider_user (off: forgotten)
  [[ -n "$SPIDER_USER_DEFERRED" ]] || return 0
  if [[ -n "$SPIDER_USER_CHOSEN" ]]; then printf '%s\n' "$SPIDER_USER_CHOSEN" >"$SPIDER_USER_FILE"
  else rm -f "$SPIDER_USER_FILE"; fi
}

apply_spider_user() {  # the remembered spider user, unless AGENT_TASK_RUN_AS_USER is set (or --spider-user chose)
  [[ -z "$SPIDER_USER_DEFERRED" && -z "${AGENT_TASK_RUN_AS_USER:-}" && -f "$SPIDER_USER_FILE" ]] || return 0
  AGENT_TASK_RUN_AS_USER="$(tr -d '[:space:]' <"$SPIDER_USER_FILE")"
  export AGENT_TASK_RUN_AS_USER
}

# ---------------------------------------------------------------- credentials out of the environment

# hide_secrets ARGS...: re-execute run.sh with the credentials moved from the environment into a memory
# file (CKAGENT_SECRETS_FD; ckagent/node/secretenv.py is the agent's side). Once: CKAGENT_SECRETS_REEXEC marks it.
hide_secrets() {
  [[ -n "${AGENT_REGISTRATION_TOKEN:-}${AGENT_API_KEY:-}" && -z "${CKAGENT_SECRETS_REEXEC:-}" ]] || return 0
  command -v "$PYTHON" >/dev/null 2>&1 || return 0
  exec "$PYTHON" -c '
import json, os, sys
names = ("AGENT_REGISTRATION_TOKEN", "AGENT_API_KEY")
env = {k: v for k, v in os.environ.items() if k not in names}
env["CKAGENT_SECRETS_REEXEC"] = "1"
if hasattr(os, "memfd_create"):
    merged = {}
    if os.environ.get("CKAGENT_SECRETS_FD", "").isdigit():
        try:
            merged.update(json.loads(os.pread(int(os.environ["CKAGENT_SECRETS_FD"]), 1 << 20, 0)))
        except (OSError, ValueError):
            pass
    merged.update({n: os.environ[n] for n in names if os.environ.get(n)})
    fd = os.memfd_create("ckagent-secrets", 0)
    os.write(fd, json.dumps(merged).encode())
    env["CKAGENT_SECRETS_FD"] = str(fd)
else:  # no memory files here: the variables stay where they are
    env = {**os.environ, "CKAGENT_SECRETS_REEXEC": "1"}
os.execve(sys.argv[1], sys.argv[1:], env)
' "$BASH" "${BASH_SOURCE[0]}" "$@"
}

# Versions whose upgrade failed here, one per line: `upgrade` (latest, or asked by the agent) skips them.
FAILED_FILE="$STATE_DIR/failed_versions"
failed_before() { [[ -f "$FAILED_FILE" ]] && grep -qxF -- "$1" "$FAILED_FILE"; }
remember_failed() { failed_before "$1" || printf '%s\n' "$1" >>"$FAILED_FILE"; }
forget_failed() {
  [[ -f "$FAILED_FILE" ]] || return 0
  grep -vxF -- "$1" "$FAILED_FILE" >"$FAILED_FILE.tmp" || true
  mv -f "$FAILED_FILE.tmp" "$FAILED_FILE"
}

# ---------------------------------------------------------------- main

hide_secrets "$@"
CALLER_DIR="$(pwd -P)"
COMMANDS="start|stop|restart|status|logs|upgrade|rollback|help"
# The command is the first word that names one; FLAGS (--daemon, --cleanup_temp_files) may stand
# anywhere; everything else is the command's (the agent's -c FILE may also come first).
command="" FLAGS=() REST=() SPIDER_USER_FLAG="" HAVE_SPIDER_USER=0
while (($#)); do
  case "$1" in
    -h|--help) usage 0 ;;
    --drain) DRAIN=1 ;;
    --leave-running) LEAVE_RUNNING=1 ;;
    --migrate) MIGRATE=1 ;;
    --daemon|--daemon=*|--cleanup_temp_files|--cleanup_temp_files=*|--cleanup-temp-files|--cleanup-temp-files=*)
      FLAGS+=("$1") ;;
    --spider-user=*|--spider_user=*) SPIDER_USER_FLAG="${1#*=}"; HAVE_SPIDER_USER=1 ;;
    -c|--config)
      (($# >= 2)) || usage_error "$1 needs a file"
      REST+=("$1" "$2"); shift ;;
    -*) REST+=("$1") ;;
    *)
      if [[ -n "$command" ]]; then REST+=("$1")
      elif [[ "|$COMMANDS|" == *"|$1|"* ]]; then command="$1"
      else usage_error "unknown command '$1' (commands: ${COMMANDS//|/, })"
      fi ;;
  esac
  shift
done
for flag in "${FLAGS[@]+"${FLAGS[@]}"}"; do
  if [[ "$flag" == *=* ]]; then
    value="${flag#*=}"
    case "${value,,}" in on|off|1|0|yes|no|true|false) ;; *) usage_error "$flag: expected on or off" ;; esac
  fi
done
[[ -n "$command" ]] || usage_error "no command given (commands: ${COMMANDS//|/, })"
((MIGRATE)) && [[ "$command" != stop ]] && usage_error "--migrate goes with stop"
if ((HAVE_SPIDER_USER)); then
  [[ "$command" == start || "$command" == restart ]] || usage_error "--spider-user goes with start or restart"
  if [[ "$command" == restart ]]; then set_spider_user "$SPIDER_USER_FLAG" defer; else set_spider_user "$SPIDER_USER_FLAG"; fi
fi
[[ "$command" == start || "$command" == restart || "$command" == upgrade || "$command" == rollback ]] && apply_spider_user
[[ "$command" == logs || "$command" == help ]] || resolve_python
case "$command" in
  start) lock_state; cmd_start "${FLAGS[@]+"${FLAGS[@]}"}" "${REST[@]+"${REST[@]}"}" ;;
  restart) lock_state; cmd_restart "${FLAGS[@]+"${FLAGS[@]}"}" "${REST[@]+"${REST[@]}"}" ;;
  stop) ((${#REST[@]} == 0)) || usage_error "stop takes no arguments (it stops the agent of agent.pid)"
    ((LEAVE_RUNNING && MIGRATE)) && usage_error "stop takes --leave-running or --migrate, not both"
    lock_state
    if ((LEAVE_RUNNING)); then handover_stop; elif ((MIGRATE)); then migrate_stop; else cmd_stop; fi ;;
  status) ((${#REST[@]} == 0)) || usage_error "status takes no arguments"; cmd_status ;;
  logs) cmd_logs "${REST[@]+"${REST[@]}"}" ;;
  upgrade)  # asked by the agent (AGENT_UPGRADE_AUTO): wait for an upgrade still restarting it
    if is_on "${AGENT_UPGRADE_AUTO:-off}"; then lock_state 300; else lock_state; fi
    cmd_upgrade "${REST[@]+"${REST[@]}"}" ;;
  rollback) lock_state; cmd_rollback "${REST[@]+"${REST[@]}"}" ;;
  help) usage 0 ;;
esac
