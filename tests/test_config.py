"""ckagent.node.config: loading, validation, error messages, secrets, and the docs/example sync."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from pathlib import Path

import pytest
import yaml

from ckagent.node.config import (
    SETTINGS,
    ConfigError,
    Secret,
    Settings,
    detect_local_ip,
    load_settings,
    suspicious_env_vars,
)
from ckagent.node.configdocs import (
    TABLE_END_MARKER,
    TABLE_START_MARKER,
    replace_marked_block,
    settings_markdown_table,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "config.yaml"
TOKEN = "tok-9f3b1c77e2"  # a distinctive value to search for in outputs
API_KEY = "key-51d0aa8e4c"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load(path: Path | None = None, env: dict[str, str] | None = None, **kw: bool) -> Settings:
    return load_settings(path, env or {}, require_token=kw.get("require_token", False))


def error_of(path: Path | None = None, env: dict[str, str] | None = None, **kw: bool) -> str:
    with pytest.raises(ConfigError) as info:
        load(path, env, **kw)
    return str(info.value)


# --------------------------------------------------------------------------------------------------
# defaults and precedence


def test_defaults(tmp_path: Path) -> None:
    s = load()
    assert s.server.url == "http://127.0.0.1:8080"
    assert s.server.ca_file is None
    assert s.server.request_timeout == 30.0
    assert s.agent.name == socket.gethostname()
    ipaddress.ip_address(s.agent.ip)
    assert s.agent.port == 9000
    assert s.agent.registration_token is None
    assert dict(s.agent.labels) == {}
    assert s.agent.max_workers is None and s.agent.container_cpu_limit is None
    assert s.heartbeat.interval == 30.0
    assert (s.task.poll_interval, s.task.long_poll_wait) == (10.0, 20.0)
    assert s.task.work_dir == tmp_path / "data"
    assert (s.task.execute_timeout, s.task.kill_grace, s.task.drain_timeout) == (3600.0, 10.0, 60.0)
    assert (s.logging.level, s.logging.file, s.logging.format) == ("INFO", None, "text")
    assert s.deps.uv_index_url is None
    assert s.deps.uv_fallback_index_url == "https://pypi.tuna.tsinghua.edu.cn/simple"
    assert (s.deps.uv_cache_dir, s.deps.uv_sync_timeout, s.deps.uv_path) == (None, 180.0, None)
    assert s.config_file is None


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n", "null\n"])
def test_empty_file_means_defaults(tmp_path: Path, text: str) -> None:
    s = load(write(tmp_path, text))
    assert s.config_file == tmp_path / "config.yaml"
    assert dataclasses.replace(s, config_file=None) == load()


def test_file_values_and_env_beats_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "server:\n  url: https://master.example:8443/\n"
        "agent:\n  name: node-a\n  port: 9100\n  labels: {region: eu, tier: 1, gpu: false}\n"
        "task:\n  poll_interval: 2.5\n  work_dir: spool\n"
        "logging:\n  level: debug\n",
    )
    s = load(path)
    assert s.server.url == "https://master.example:8443/"
    assert (s.agent.name, s.agent.port) == ("node-a", 9100)
    assert dict(s.agent.labels) == {"region": "eu", "tier": "1", "gpu": "false"}
    assert s.task.poll_interval == 2.5
    assert s.task.work_dir == tmp_path / "spool"
    assert s.logging.level == "DEBUG"

    s = load(path, {"AGENT_PORT": "9200", "AGENT_NAME": "node-b", "AGENT_LABELS": "x=1, y = 2,",
                    "AGENT_TASK_POLL_INTERVAL": "0.5", "AGENT_LOG_LEVEL": "warning"})  # fmt: skip
    assert (s.agent.name, s.agent.port) == ("node-b", 9200)
    assert dict(s.agent.labels) == {"x": "1", "y": "2"}
    assert s.task.poll_interval == 0.5
    assert s.logging.level == "WARNING"
    assert s.server.url == "https://master.example:8443/"  # not overridden: file value stays


def test_empty_env_var_and_yaml_null_mean_not_set(tmp_path: Path) -> None:
    path = write(tmp_path, "agent:\n  port: 9100\n  name:\nlogging:\n  file: agent.log\n")
    s = load(path, {"AGENT_PORT": "", "AGENT_LOG_FILE": "  "})
    assert s.agent.port == 9100
    assert s.agent.name == socket.gethostname()
    assert s.logging.file == tmp_path / "agent.log"


def test_every_setting_has_a_working_env_var(tmp_path: Path) -> None:
    ca = write(tmp_path, "pem", "ca.pem")
    values = {
        "AGENT_SERVER_URL": "http://10.1.2.3:81", "AGENT_SERVER_CA_FILE": str(ca),
        "AGENT_SERVER_REQUEST_TIMEOUT": "5", "AGENT_SERVER_REFUSAL_TIMEOUT": "6",
        "AGENT_SERVER_DOWNLOAD_STALL_TIMEOUT": "7", "AGENT_SERVER_MAX_BACKOFF_INTERVAL": "8", "AGENT_NAME": "n1", "AGENT_IP": "10.9.8.7", "AGENT_PORT": "1",
        "AGENT_BIND": "0.0.0.0", "AGENT_LOG_MAX_BYTES": "2048", "AGENT_LOG_BACKUP_COUNT": "1",
        "AGENT_REGISTRATION_TOKEN": TOKEN, "AGENT_LABELS": "a=b",
        "AGENT_MAX_WORKERS": "3", "CONTAINER_CPU_LIMIT": "1500m", "AGENT_HEARTBEAT_INTERVAL": "7",
        "AGENT_TASK_POLL_INTERVAL": "4", "AGENT_TASK_LONG_POLL_WAIT": "0", "AGENT_WORK_DIR": "/srv/ck",
        "AGENT_TASK_EXECUTE_TIMEOUT": "0", "AGENT_TASK_KILL_GRACE": "1", "AGENT_TASK_DRAIN_TIMEOUT": "2",
        "AGENT_TASK_MAX_STOP_GRACE": "240",
        "AGENT_TASK_FLUSH_TIMEOUT": "3", "AGENT_TASK_RUN_AS_USER": "crawler", "AGENT_TASK_SPIDER_UIDS": " 70000 - 70999",
        "AGENT_TASK_MAX_LOG_BYTES": "1000", "AGENT_TASK_MIN_FREE_DISK_BYTES": "0",
        "AGENT_TASK_MAX_ARTIFACT_BYTES": "5000",
        "AGENT_TASK_LOG_FILES": "*.log, logs/*.txt", "AGENT_TASK_RETENTION": "0", "AGENT_CLEANUP_TEMP_FILES": "on",
        "AGENT_TASK_STALL_TIMEOUT": "600",
        "AGENT_TASK_CONTAINMENT": "Process-Group", "AGENT_TASK_MEMORY_LIMIT_BYTES": "209715200",
        "AGENT_TASK_PIDS_LIMIT": "64", "AGENT_TASK_CPUS_LIMIT": "500m",
        "AGENT_TASK_DISK_LIMIT_BYTES": "67108864",
        "AGENT_TASK_EGRESS": "Proxy", "AGENT_TASK_EGRESS_DENY": "Metadata, private,192.0.2.7",
        "AGENT_TASK_EGRESS_ALLOW": "10.0.0.5:3128,[fd12::1]:8080",
        "AGENT_TASK_PRIVATE_TMP": "TmpDir", "AGENT_TASK_PRIVATE_TMP_SHARED": " /tmp/.X11-unix, /tmp//mysql.sock,",
        "AGENT_LOG_LEVEL": "error", "AGENT_LOG_FILE": "x.log", "AGENT_LOG_FORMAT": "JSON",
        "AGENT_UV_INDEX_URL": "https://pypi.org/simple", "AGENT_UV_FALLBACK_INDEX_URL": "http://idx/simple",
        "AGENT_UV_CACHE_DIR": "cache", "AGENT_UV_SYNC_TIMEOUT": "9", "AGENT_UV_PATH": "/opt/uv",
        "AGENT_DEPS_ENV_BUDGET_BYTES": "0", "AGENT_DEPS_PYTHON": "/usr/bin/python3",
        "AGENT_AUTO_UPGRADE": "on", "AGENT_PORTS_REGISTRY": "ports", "AGENT_NAME_EXCLUSIVE": "on",
        "AGENT_TASK_UID_CLAIMS": "claims", "AGENT_SIGTERM": "Migrate", "AGENT_TASK_MIGRATE_TIMEOUT": "15",
        "AGENT_TASK_MEMORY_SOFT_BYTES": "104857600", "AGENT_TASK_CHECKPOINT_INTERVAL": "30",
        "AGENT_EXIT_WHEN_IDLE": "60", "AGENT_MAX_TASKS": "1",
    }  # fmt: skip
    assert set(values) == {s.env for s in SETTINGS}
    s = load(None, values)
    assert s.redacted() == {
        "server": {"url": "http://10.1.2.3:81", "ca_file": str(ca), "request_timeout": 5.0, "refusal_timeout": 6.0,
                   "download_stall_timeout": 7.0, "max_backoff_interval": 8.0},
        "agent": {"name": "n1", "ip": "10.9.8.7", "port": 1, "bind": "0.0.0.0", "registration_token": "***",
                  "labels": {"a": "b"}, "max_workers": 3, "container_cpu_limit": "1500m", "auto_upgrade": True,
                  "ports_registry": str(tmp_path / "ports"), "sigterm": "migrate",
                  "exit_when_idle": 60.0, "max_tasks": 1, "name_exclusive": True},
        "heartbeat": {"interval": 7.0},
        "task": {"poll_interval": 4.0, "long_poll_wait": 0.0, "work_dir": "/srv/ck", "execute_timeout": 0.0,
                 "kill_grace": 1.0, "max_stop_grace": 240.0, "drain_timeout": 2.0, "flush_timeout": 3.0, "run_as_user": "crawler",
                 "spider_uids": "70000-70999", "max_log_bytes": 1000, "min_free_disk_bytes": 0, "max_artifact_bytes": 5000,
                 "log_files": "*.log,logs/*.txt",
                 "retention": 0.0, "cleanup_temp_files": True, "stall_timeout": 600.0, "containment": "process-group",
                 "memory_limit_bytes": 209715200, "pids_limit": 64, "cpus_limit": 0.5, "disk_limit_bytes": 67108864,
                 "egress": "proxy",
                 "egress_deny": "metadata,private,192.0.2.7/32", "egress_allow": "10.0.0.5:3128,[fd12::1]:8080",
                 "private_tmp": "tmpdir", "private_tmp_shared": "/tmp/.X11-unix,/tmp/mysql.sock",
                 "uid_claims": str(tmp_path / "claims"), "migrate_timeout": 15.0, "memory_soft_bytes": 104857600,
                 "checkpoint_interval": 30.0},
        "logging": {"level": "ERROR", "file": str(tmp_path / "x.log"), "format": "json", "max_bytes": 2048,
                    "backup_count": 1},
        "deps": {"uv_index_url": "https://pypi.org/simple", "uv_fallback_index_url": "http://idx/simple",
                 "uv_cache_dir": str(tmp_path / "cache"), "uv_sync_timeout": 9.0, "uv_path": "/opt/uv",
                 "env_budget_bytes": 0, "python": "/usr/bin/python3"},
    }  # fmt: skip
    assert s.agent.registration_token == Secret(TOKEN)
    assert s.agent.container_cpu_limit_cores == 1.5


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load(None, {"AGENT_WORK_DIR": "~/ck"}).task.work_dir == tmp_path / "home" / "ck"


def test_unknown_agent_env_vars_are_ignored_but_typos_are_flagged() -> None:
    env = {"AGENT_SERVR_URL": "x", "AGENT_FOO": "bar", "AGENT_PORT": "9001", "HOME": "/"}
    assert load(None, env).agent.port == 9001
    assert suspicious_env_vars(env) == ["AGENT_SERVR_URL is not a setting (did you mean AGENT_SERVER_URL?)"]


# --------------------------------------------------------------------------------------------------
# bad input: one message naming file:line:column or the env var


def test_unknown_section_did_you_mean(tmp_path: Path) -> None:
    path = write(tmp_path, "server:\n  url: http://a\nagnet:\n  name: x\n")
    assert error_of(path) == f"{path}:3:1: unknown section 'agnet' (did you mean 'agent'?)"


def test_unknown_key_did_you_mean(tmp_path: Path) -> None:
    path = write(tmp_path, "task:\n  poll_interval: 1\n  work_dri: /x\n")
    assert error_of(path) == f"{path}:3:3: unknown key 'task.work_dri' (did you mean 'work_dir'?)"


def test_unknown_key_without_close_match(tmp_path: Path) -> None:
    path = write(tmp_path, "heartbeat:\n  zzz: 1\n")
    assert error_of(path) == f"{path}:2:3: unknown key 'heartbeat.zzz'"


def test_wrong_type_names_position_key_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, "# comment\n\ntask:\n  work_dir: d\n  poll_interval: fast\n")
    assert error_of(path) == f"{path}:5:18: task.poll_interval: expected a number of seconds >= 0.1, got 'fast'"


@pytest.mark.parametrize(
    ("yaml_text", "where", "message"),
    [
        ("agent:\n  port: [1, 2]\n", "2:9", "agent.port: expected a single value, got a list"),
        ("agent:\n  port: 9000.5\n", "2:9", "agent.port: expected an integer 0..65535, got '9000.5'"),
        ("agent:\n  labels: [a]\n", "2:11", "agent.labels: expected a mapping of str to str, got a list"),
        ("agent:\n  labels:\n    a:\n", "3:7", "agent.labels.a: expected a string value, got null"),
        ("agent:\n  labels:\n    a: {b: c}\n", "3:8", "agent.labels.a: expected a string value, got a mapping"),
        ("agent:\n  ip: my-host\n", "2:7", "agent.ip: expected an IPv4 or IPv6 address, got 'my-host'"),
        ("server:\n  url: ftp://x\n", "2:8", "server.url: expected an http:// or https:// URL, got 'ftp://x'"),
        ("server:\n  url: localhost:8080\n", "2:8",
         "server.url: expected an http:// or https:// URL, got 'localhost:8080'"),
        ("server:\n  url: http://h:99999\n", "2:8",
         "server.url: expected an http:// or https:// URL, got 'http://h:99999'"),
        ("logging:\n  level: verbose\n", "2:10",
         "logging.level: expected one of DEBUG, INFO, WARNING, ERROR, got 'verbose'"),
        ("logging:\n  format: xml\n", "2:11", "logging.format: expected one of text, json, got 'xml'"),
        ("task: 5\n", "1:7", "task: expected a mapping of settings, got '5'"),
        ("task:\n  - poll_interval\n", "2:3", "task: expected a mapping of settings, got a list"),
        ("task:\n  kill_grace: 1\n  kill_grace: 2\n", "3:3", "duplicate key 'task.kill_grace'"),
        ("task:\n  ? [a]\n  : 1\n", "2:5", "expected a name as key, got a list"),
    ],
)  # fmt: skip
def test_bad_values_in_file(tmp_path: Path, yaml_text: str, where: str, message: str) -> None:
    path = write(tmp_path, yaml_text)
    assert error_of(path) == f"{path}:{where}: {message}"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("server.request_timeout", "0", "a number of seconds >= 1"),
        ("server.request_timeout", "-1", "a number of seconds >= 1"),
        ("server.request_timeout", ".nan", "a number of seconds >= 1"),
        ("server.request_timeout", ".inf", "a number of seconds >= 1"),
        ("agent.port", "-1", "an integer 0..65535"),
        ("agent.port", "65536", "an integer 0..65535"),
        ("logging.max_bytes", "1023", "an integer >= 1024"),
        ("logging.backup_count", "0", "an integer >= 1"),
        ("agent.max_workers", "0", "an integer >= 1"),
        ("heartbeat.interval", "0", "a number of seconds >= 1"),
        ("heartbeat.interval", "1e-9", "a number of seconds >= 1"),
        ("heartbeat.interval", "0.5", "a number of seconds >= 1"),
        ("task.poll_interval", "0", "a number of seconds >= 0.1"),
        ("task.poll_interval", "0.01", "a number of seconds >= 0.1"),
        ("server.request_timeout", "0.2", "a number of seconds >= 1"),
        ("task.long_poll_wait", "60.5", "a number of seconds 0..60"),
        ("task.long_poll_wait", "-1", "a number of seconds 0..60"),
        ("task.execute_timeout", "-0.1", "a number of seconds >= 0"),
        ("task.kill_grace", "-1", "a number of seconds >= 0"),
        ("task.drain_timeout", "-1", "a number of seconds >= 0"),
        ("deps.uv_sync_timeout", "0", "a number of seconds >= 1"),
        ("task.spider_uids", "61184", "a range of uids FIRST-LAST, e.g. 61184-65519"),
        ("task.spider_uids", "x-y", "a range of uids FIRST-LAST, e.g. 61184-65519"),
        ("task.spider_uids", "0-100", "a range of uids FIRST-LAST with 1 <= FIRST < LAST <= 4294967294, e.g. 61184-65519"),
        ("task.spider_uids", "5000-5000", "a range of uids FIRST-LAST with 1 <= FIRST < LAST <= 4294967294, e.g. 61184-65519"),
        ("task.spider_uids", "60000-70000",
         "a range of uids without 65535 (no user may have it: it means -1 to the kernel), e.g. 61184-65519"),
    ],
)
def test_out_of_range(tmp_path: Path, key: str, value: str, expected: str) -> None:
    section, name = key.split(".")
    path = write(tmp_path, f"{section}:\n  {name}: {value}\n")
    column = len(f"  {name}: ") + 1
    assert error_of(path) == f"{path}:2:{column}: {key}: expected {expected}, got {value!r}"


def test_range_edges_are_accepted(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "agent:\n  port: 65535\n  max_workers: 1\n"
        "task:\n  long_poll_wait: 60\n  execute_timeout: 0\n  kill_grace: 0\n  drain_timeout: 0\n",
    )
    s = load(path)
    assert (s.agent.port, s.agent.max_workers) == (65535, 1)
    assert str(load(write(tmp_path, "task:\n  spider_uids: 1-2\n")).task.spider_uids) == "1-2"
    assert len(load(None).task.spider_uids) == 65519 - 61184 + 1
    assert (s.task.long_poll_wait, s.task.execute_timeout, s.task.kill_grace) == (60.0, 0.0, 0.0)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert error_of(path) == f"{path}: config file not found"


def test_directory_instead_of_file(tmp_path: Path) -> None:
    assert error_of(tmp_path) == f"{tmp_path}: config file is a directory"


def test_path_through_a_file_is_unreadable(tmp_path: Path) -> None:
    path = write(tmp_path, "x", "plain.txt") / "config.yaml"
    assert error_of(path) == f"{path}: cannot read config file: Not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path: Path) -> None:
    path = write(tmp_path, "agent:\n  port: 1\n")
    path.chmod(0)
    try:
        assert error_of(path) == f"{path}: cannot read config file: Permission denied"
    finally:
        path.chmod(0o600)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"agent:\n  name: caf\xe9\n")
    assert error_of(path) == f"{path}:2: config file is not valid UTF-8"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("agent:\n  name: [unclosed\nserver: {}\n", "3:7"),
        ("agent:\n  name: x\n bad-indent: 1\n", "3:2"),
        ("agent:\n\tname: x\n", "2:1"),
        ("a: 1\n---\nb: 2\n", "2:1"),
    ],
)
def test_yaml_syntax_error_has_position(tmp_path: Path, text: str, where: str) -> None:
    path = write(tmp_path, text)
    message = error_of(path)
    assert message.startswith(f"{path}:{where}: YAML syntax error: "), message


@pytest.mark.parametrize(
    ("text", "got"),
    [("- server\n- agent\n", "a list"), ("just a string\n", "'just a string'"), ("42\n", "'42'")],
)
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, got: str) -> None:
    path = write(tmp_path, text)
    assert error_of(path) == (
        f"{path}:1:1: the top level must be a mapping of sections "
        f"(server, agent, heartbeat, task, logging, deps), got {got}"
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AGENT_PORT": "abc"}, "AGENT_PORT: expected an integer 0..65535, got 'abc'"),
        ({"AGENT_PORT": "80000"}, "AGENT_PORT: expected an integer 0..65535, got '80000'"),
        ({"AGENT_TASK_POLL_INTERVAL": "fast"}, "AGENT_TASK_POLL_INTERVAL: expected a number of seconds >= 0.1, got 'fast'"),
        ({"AGENT_LABELS": "a=1,oops"}, "AGENT_LABELS: expected key=value pairs separated by commas, got 'a=1,oops'"),
        ({"AGENT_LABELS": "a=1,a=2"}, "AGENT_LABELS: label 'a' given twice, got 'a=1,a=2'"),
        ({"AGENT_LABELS": "=1"}, "AGENT_LABELS: expected label keys to be non-empty and contain no '=' or ',', got '=1'"),
        ({"AGENT_MAX_WORKERS": "0"}, "AGENT_MAX_WORKERS: expected an integer >= 1, got '0'"),
        ({"AGENT_LOG_FORMAT": "yaml"}, "AGENT_LOG_FORMAT: expected one of text, json, got 'yaml'"),
        ({"AGENT_SERVER_URL": "127.0.0.1"}, "AGENT_SERVER_URL: expected an http:// or https:// URL, got '127.0.0.1'"),
        ({"AGENT_UV_INDEX_URL": "pypi"}, "AGENT_UV_INDEX_URL: expected an http:// or https:// URL, got 'pypi'"),
    ],
)  # fmt: skip
def test_bad_env_var_is_named(env: dict[str, str], message: str) -> None:
    assert error_of(None, env) == message


def test_bad_file_value_is_reported_even_if_env_overrides_it(tmp_path: Path) -> None:
    path = write(tmp_path, "agent:\n  port: abc\n")
    assert error_of(path, {"AGENT_PORT": "9000"}).startswith(f"{path}:2:9: agent.port:")


# --------------------------------------------------------------------------------------------------
# max_workers, cpu limit, ca_file


@pytest.mark.parametrize(("raw", "value"), [("1", 1), ("16", 16), (" 8 ", 8)])
def test_max_workers_ok(raw: str, value: int) -> None:
    assert load(None, {"AGENT_MAX_WORKERS": raw}).agent.max_workers == value


@pytest.mark.parametrize("raw", ["0", "-1", "1.5", "two", "0x10"])
def test_max_workers_bad(raw: str) -> None:
    assert error_of(None, {"AGENT_MAX_WORKERS": raw}).startswith("AGENT_MAX_WORKERS: expected an integer >= 1")


@pytest.mark.parametrize(
    ("raw", "cores"), [("2000m", 2.0), ("500m", 0.5), ("4", 4.0), ("1.5", 1.5), ("0.25", 0.25)]
)
def test_cpu_limit_ok(raw: str, cores: float) -> None:
    agent = load(None, {"CONTAINER_CPU_LIMIT": raw}).agent
    assert agent.container_cpu_limit == raw
    assert agent.container_cpu_limit_cores == cores


@pytest.mark.parametrize("raw", ["2 cores", "1.", ".5", "m", "-1", "2000M", "1.5m", "abc"])
def test_cpu_limit_bad_format(raw: str) -> None:
    assert error_of(None, {"CONTAINER_CPU_LIMIT": raw}) == (
        f'CONTAINER_CPU_LIMIT: expected a CPU quantity like "2000m", "4" or "1.5", got {raw!r}'
    )


@pytest.mark.parametrize("raw", ["0", "0m", "0.0"])
def test_cpu_limit_zero(raw: str) -> None:
    assert error_of(None, {"CONTAINER_CPU_LIMIT": raw}) == f"CONTAINER_CPU_LIMIT: expected a CPU quantity > 0, got {raw!r}"


def test_cpu_limit_in_yaml_keeps_text(tmp_path: Path) -> None:
    assert load(write(tmp_path, "agent:\n  container_cpu_limit: 2\n")).agent.container_cpu_limit == "2"


def test_ca_file(tmp_path: Path) -> None:
    (tmp_path / "certs").mkdir()
    write(tmp_path, "-----BEGIN CERTIFICATE-----\n", "certs/ca.pem")
    path = write(tmp_path, "server:\n  ca_file: certs/ca.pem\n")
    assert load(path).server.ca_file == tmp_path / "certs" / "ca.pem"
    missing = write(tmp_path, "server:\n  ca_file: certs/missing.pem\n")
    assert error_of(missing) == f"{missing}:2:12: server.ca_file: file not found: {tmp_path}/certs/missing.pem"
    assert error_of(None, {"AGENT_SERVER_CA_FILE": str(tmp_path / "certs")}) == (
        f"AGENT_SERVER_CA_FILE: not a regular file: {tmp_path}/certs"
    )


# --------------------------------------------------------------------------------------------------
# registration token and secrets


def test_missing_token_is_an_error_only_when_required(tmp_path: Path) -> None:
    message = error_of(None, {}, require_token=True)
    assert "agent.registration_token" in message and "AGENT_REGISTRATION_TOKEN" in message
    assert load(None, {}).agent.registration_token is None
    from_env = load(None, {"AGENT_REGISTRATION_TOKEN": TOKEN}, require_token=True)
    assert from_env.agent.registration_token is not None
    assert from_env.agent.registration_token.reveal() == TOKEN
    path = write(tmp_path, f"agent:\n  registration_token: {TOKEN}\n")
    from_file = load(path, require_token=True)
    assert from_file.agent.registration_token == Secret(TOKEN)
    # a blank token counts as missing
    assert "AGENT_REGISTRATION_TOKEN" in error_of(None, {"AGENT_REGISTRATION_TOKEN": "  "}, require_token=True)


def test_secret_type() -> None:
    secret = Secret(TOKEN)
    assert repr(secret) == str(secret) == f"{secret}" == "***"
    assert secret.reveal() == TOKEN
    assert secret == Secret(TOKEN) and hash(secret) == hash(Secret(TOKEN))
    assert secret != Secret(TOKEN + "x")
    assert secret != TOKEN


def test_secrets_never_leak_from_settings(tmp_path: Path) -> None:
    path = write(tmp_path, f"agent:\n  registration_token: {API_KEY}\n")
    s = load(path, {}, require_token=True)
    for text in (repr(s), str(s), repr(s.agent), str(s.redacted()), yaml.safe_dump(s.redacted())):
        assert API_KEY not in text
    assert s.redacted()["agent"]["registration_token"] == "***"
    assert s.agent.registration_token is not None and s.agent.registration_token.reveal() == API_KEY


def test_the_removed_api_key_setting_says_why(tmp_path: Path) -> None:
    """agent.api_key was never used: null (an older sample config) is ignored, a value fails saying so."""
    assert load(write(tmp_path, "agent:\n  api_key: null\n"), {}).agent.name
    message = error_of(write(tmp_path, f"agent:\n  api_key: {API_KEY}\n"))
    assert "agent.api_key' is no setting any more" in message and "registration" in message
    assert API_KEY not in message
    [warning] = suspicious_env_vars({"AGENT_API_KEY": API_KEY})
    assert warning.startswith("AGENT_API_KEY is ignored") and API_KEY not in warning


@pytest.mark.parametrize(
    "yaml_text",
    [
        f"agent:\n  registration_token: [{TOKEN}]\n",
        f"agent:\n  registration_token: {{k: {TOKEN}}}\n",
        'agent:\n  registration_token: "   "\n',
    ],
)
def test_secret_values_never_in_error_messages(tmp_path: Path, yaml_text: str) -> None:
    message = error_of(write(tmp_path, yaml_text))
    assert TOKEN not in message
    assert re.search(r"config\.yaml:2:\d+: agent\.registration_token: expected", message)


# --------------------------------------------------------------------------------------------------
# immutability and shape


def test_settings_are_frozen() -> None:
    s = load(None, {"AGENT_LABELS": "a=b"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.agent.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.task = s.task  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.agent.labels["a"] = "c"  # type: ignore[index]


def test_redacted_is_plain_and_yaml_dumpable(tmp_path: Path) -> None:
    s = load(None, {"AGENT_LABELS": "a=b", "AGENT_LOG_FILE": "log.txt"})
    red = s.redacted()
    assert list(red) == ["server", "agent", "heartbeat", "task", "logging", "deps"]
    assert red["task"]["work_dir"] == str(tmp_path / "data")
    assert red["logging"]["file"] == str(tmp_path / "log.txt")
    assert type(red["agent"]["labels"]) is dict
    assert yaml.safe_load(yaml.safe_dump(red)) == red


def test_detect_local_ip_loopback_and_fallback() -> None:
    assert detect_local_ip("http://127.0.0.1:8080") == "127.0.0.1"
    assert detect_local_ip("not a url") == "127.0.0.1"
    assert load(None, {"AGENT_SERVER_URL": "http://127.0.0.1:1"}).agent.ip == "127.0.0.1"
    assert load(None, {"AGENT_IP": "::1"}).agent.ip == "::1"


# --------------------------------------------------------------------------------------------------
# one source of truth: table ↔ dataclasses ↔ example config ↔ README ↔ docs


def test_table_matches_dataclasses() -> None:
    s = load()
    from_table = [(spec.section, spec.key) for spec in SETTINGS]
    from_classes = [
        (f.name, sub.name)
        for f in dataclasses.fields(Settings)
        if f.name != "config_file"
        for sub in dataclasses.fields(getattr(s, f.name))
    ]
    assert from_table == from_classes
    envs = [spec.env for spec in SETTINGS]
    assert len(set(envs)) == len(envs)
    assert all(e.startswith("AGENT_") or e == "CONTAINER_CPU_LIMIT" for e in envs)


def _example_keys() -> dict[str, int]:
    """{section.key: 0-based line} of the keys in config/config.yaml."""
    root = yaml.compose(EXAMPLE.read_text(encoding="utf-8"))
    assert isinstance(root, yaml.MappingNode)
    keys: dict[str, int] = {}
    for section_key, section in root.value:
        assert isinstance(section, yaml.MappingNode), section_key.value
        for key, _ in section.value:
            keys[f"{section_key.value}.{key.value}"] = key.start_mark.line
    return keys


def test_example_config_has_every_key_and_no_other() -> None:
    assert sorted(_example_keys()) == sorted(spec.dotted for spec in SETTINGS)


def test_example_config_names_the_env_var_of_every_key() -> None:
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for spec in SETTINGS:
        line = _example_keys()[spec.dotted]
        comment = [lines[line]]
        i = line - 1
        while i >= 0 and lines[i].strip().startswith("#"):
            comment.append(lines[i])
            i -= 1
        assert spec.env in "\n".join(comment), f"{spec.dotted}: comment above it should name {spec.env}"


def test_example_config_loads_and_shows_the_defaults() -> None:
    example = load(EXAMPLE)
    assert dataclasses.replace(example, config_file=None) == load()


def _marked_block(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    start, end = text.index(TABLE_START_MARKER), text.index(TABLE_END_MARKER)
    return text[start + len(TABLE_START_MARKER) : end].strip("\n") + "\n"


@pytest.mark.parametrize("doc", ["README.md", "docs/configuration.md"])
def test_docs_table_is_up_to_date(doc: str) -> None:
    block = _marked_block(REPO / doc)
    assert block == settings_markdown_table(), (
        f"{doc} is out of date: run `python -m ckagent.node.configdocs README.md docs/configuration.md`"
    )
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    assert [re.findall(r"`([^`]+)`", row)[:2] for row in rows] == [[s.dotted, s.env] for s in SETTINGS]


def test_replace_marked_block() -> None:
    text = f"intro\n{TABLE_START_MARKER}\nold\n{TABLE_END_MARKER}\nrest\n"
    assert replace_marked_block(text, "new\n") == f"intro\n{TABLE_START_MARKER}\nnew\n{TABLE_END_MARKER}\nrest\n"
    with pytest.raises(ValueError):
        replace_marked_block("no markers", "x")


def test_server_url_with_credentials_is_refused_without_echoing_them(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("server:\n  url: http://ops:hunter2@master.example:8080\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={}, require_token=False)
    assert "hunter2" not in str(info.value) and "ops" not in str(info.value)
    assert "agent.yaml:2:" in str(info.value) and "user name or password" in str(info.value)


@pytest.mark.parametrize("module", ["ckagent.node.configdocs", "ckagent.node.config"])
def test_the_docs_generator_rewrites_the_marked_block(module: str, tmp_path: Path) -> None:
    """``python -m ckagent.node.configdocs FILE`` (and its former name, ckagent.node.config) rewrites the
    block between the markers and leaves the rest of the file as it was."""
    import subprocess
    import sys

    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{TABLE_START_MARKER}\nstale\n{TABLE_END_MARKER}\nrest\n", encoding="utf-8")
    subprocess.run([sys.executable, "-m", module, str(doc)], check=True, timeout=60, cwd=REPO)
    assert doc.read_text(encoding="utf-8") == (
        f"intro\n{TABLE_START_MARKER}\n{settings_markdown_table()}{TABLE_END_MARKER}\nrest\n")
