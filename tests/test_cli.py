"""The ckagent CLI, run as a real subprocess: exit codes and messages."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ckagent import __version__

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "config.yaml"
TOKEN = "tok-6c1e0d93ab"
API_KEY = "key-0b7f2e11c4"


def ckagent(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ckagent ARGS`` with a clean AGENT_*/DEVMASTER_* environment."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AGENT_", "DEVMASTER_")) and k != "CONTAINER_CPU_LIMIT"
    }
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    base["COLUMNS"] = "200"  # keep cyclopts' error panels on one line
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ckagent", *args],
        cwd=cwd,
        env=base,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_version(tmp_path: Path) -> None:
    result = ckagent("version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ckagent {__version__} ")
    assert f"Python {platform.python_version()}" in result.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--help"], ["run", "config", "version", "dev-master", "demo", "--config"]),
        (["run", "--help"], ["--config", "registration token"]),
        (["config", "--help"], ["check", "show"]),
        (["config", "check", "--help"], ["--config"]),
        (["config", "show", "--help"], ["--config"]),
        (["dev-master", "--help"], ["--db", "--port", "DEVMASTER_REGISTRATION_TOKEN", "DEVMASTER_ADMIN_TOKEN"]),
        (["demo", "--help"], ["--work-dir", "--keep"]),
    ],
)
def test_help(tmp_path: Path, args: list[str], expected: list[str]) -> None:
    result = ckagent(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for word in expected:
        assert word in result.stdout


def test_no_command_prints_help_and_is_a_usage_error(tmp_path: Path) -> None:
    result = ckagent(cwd=tmp_path)
    assert result.returncode == 2
    assert "Usage: ckagent" in result.stdout


def test_config_check_good_file(tmp_path: Path) -> None:
    result = ckagent("config", "check", "-c", str(EXAMPLE), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"config OK: {EXAMPLE}"  # after the levels (test_config_levels.py)
    # the example sets no token: a warning, not an error
    assert result.stderr.startswith("warning: no registration token")


def test_config_check_relative_path_and_token_from_env(tmp_path: Path) -> None:
    write(tmp_path, "agent:\n  port: 9100\n")
    result = ckagent(
        "config", "check", "--config", "config.yaml", cwd=tmp_path, env={"AGENT_REGISTRATION_TOKEN": TOKEN}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"config OK: {tmp_path / 'config.yaml'}"
    assert result.stderr == ""


def test_config_check_warns_about_misspelled_env_var(tmp_path: Path) -> None:
    result = ckagent("config", "check", cwd=tmp_path, env={"AGENT_REGISTRATION_TOKEN": TOKEN, "AGENT_PROT": "1"})
    assert result.returncode == 0, result.stderr
    assert "warning: AGENT_PROT is not a setting (did you mean AGENT_PORT?)" in result.stderr


def test_config_check_bad_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "agent:\n  name: [oops\n")
    result = ckagent("config", "check", "-c", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"ckagent: config error: {path}:3:1: YAML syntax error")
    assert result.stdout == ""


def test_config_check_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, "server:\n  ulr: http://x\n")
    result = ckagent("config", "check", "-c", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"ckagent: config error: {path}:2:3: unknown key 'server.ulr' (did you mean 'url'?)"
    )


def test_config_check_missing_file(tmp_path: Path) -> None:
    result = ckagent("config", "check", "-c", "missing.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "ckagent: config error: missing.yaml: config file not found"  # the path as given


def test_config_check_bad_env_var(tmp_path: Path) -> None:
    result = ckagent("config", "check", cwd=tmp_path, env={"AGENT_PORT": "abc"})
    assert result.returncode == 2
    assert result.stderr.strip() == "ckagent: config error: AGENT_PORT: expected an integer 0..65535, got 'abc'"


def test_config_show_masks_secrets_and_applies_env(tmp_path: Path) -> None:
    path = write(tmp_path, f"agent:\n  registration_token: {API_KEY}\n  port: 9100\n  labels: {{zone: a}}\n")
    result = ckagent(
        "config", "show", "-c", str(path), cwd=tmp_path,
        env={"AGENT_PORT": "9200"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert API_KEY not in result.stdout + result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["agent"]["registration_token"] == "***"
    assert shown["agent"]["port"] == 9200
    assert shown["agent"]["labels"] == {"zone": "a"}
    assert shown["task"]["work_dir"] == str(tmp_path / "data")
    assert list(shown) == ["server", "agent", "heartbeat", "task", "logging", "deps"]


def test_unknown_command(tmp_path: Path) -> None:
    result = ckagent("frobnicate", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown command 'frobnicate'" in result.stderr
    result = ckagent("config", "chek", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown command 'config chek' (did you mean 'check'?)" in result.stderr


def test_unknown_option_and_bad_option_value_are_usage_errors(tmp_path: Path) -> None:
    assert ckagent("config", "check", "--frob", cwd=tmp_path).returncode == 2
    result = ckagent("dev-master", "--port", "abc", "--registration-token", "r", "--admin-token", "a", cwd=tmp_path)
    assert result.returncode == 2
    assert "--port" in result.stderr


def test_run_without_token_is_a_config_error(tmp_path: Path) -> None:
    result = ckagent("run", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("ckagent: config error: no registration token")
    assert "AGENT_REGISTRATION_TOKEN" in result.stderr


@pytest.mark.parametrize("args", [["run", "-c"], ["-c"], ["--config"]])
def test_run_with_bad_file_is_a_config_error(tmp_path: Path, args: list[str]) -> None:
    """`ckagent -c FILE` is `ckagent run -c FILE`: both validate the file before anything else."""
    path = write(tmp_path, "task:\n  poll_interval: fast\n")
    result = ckagent(*args, str(path), cwd=tmp_path, env={"AGENT_REGISTRATION_TOKEN": TOKEN})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"ckagent: config error: {path}:2:18: task.poll_interval: expected a number of seconds >= 0.1, got 'fast'"
    )
    assert TOKEN not in result.stderr


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("task:\n  run_as_user: no-such-user-ck16\n", "task.run_as_user (AGENT_TASK_RUN_AS_USER): no user 'no-such-user-ck16'"),
        ("task:\n  work_dir: {tmp}/afile/data\n", "task.work_dir (AGENT_WORK_DIR) '{tmp}/afile/data' cannot be used: "
                                                    "{tmp}/afile is not a directory"),
        ("logging:\n  file: {tmp}/afile/agent.log\n", "logging.file (AGENT_LOG_FILE) '{tmp}/afile/agent.log' cannot be opened"),
        ("deps:\n  uv_path: {tmp}/afile\n", "deps.uv_path (AGENT_UV_PATH) '{tmp}/afile' is not an executable file"),
    ],
)  # fmt: skip
def test_config_check_refuses_exactly_what_run_refuses(tmp_path: Path, yaml_text: str, message: str) -> None:
    """Users and paths: `config check` fails with the message with which `run` then refuses to start."""
    (tmp_path / "afile").write_text("not a directory\n")
    path = write(tmp_path, "agent:\n  port: 0\n" + yaml_text.format(tmp=tmp_path))
    env = {"AGENT_REGISTRATION_TOKEN": TOKEN, "AGENT_SERVER_URL": "http://127.0.0.1:9"}
    checked = ckagent("config", "check", "-c", str(path), cwd=tmp_path, env=env)
    assert checked.returncode == 2, checked
    assert f"error: {message.format(tmp=tmp_path)}" in checked.stderr
    ran = ckagent("run", "-c", str(path), cwd=tmp_path, env=env)
    assert ran.returncode == 2, ran
    assert ran.stderr.startswith(f"ckagent: config error: {message.format(tmp=tmp_path)}")


def test_config_check_warns_about_a_port_in_use_and_refuses_a_foreign_address(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = ckagent("config", "check", cwd=tmp_path,
                         env={"AGENT_REGISTRATION_TOKEN": TOKEN, "AGENT_BIND": "127.0.0.1", "AGENT_PORT": str(port)})
    assert result.returncode == 0, result.stderr
    assert f"warning: agent.port: cannot listen on 127.0.0.1:{port}" in result.stderr
    result = ckagent("config", "check", cwd=tmp_path,
                     env={"AGENT_REGISTRATION_TOKEN": TOKEN, "AGENT_BIND": "192.0.2.1", "AGENT_PORT": "0"})
    assert result.returncode == 2
    assert "error: agent.port: cannot listen on 192.0.2.1:0" in result.stderr


def test_config_show_into_a_closed_pipe_prints_no_traceback(tmp_path: Path) -> None:
    """`ckagent config show | head -1`: the reader is gone before the output is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    env["PYTHONPATH"] = str(REPO)
    try:
        result = subprocess.run([sys.executable, "-m", "ckagent", "config", "show"], cwd=tmp_path, env=env,
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert result.stderr == ""


def test_dev_master_bad_db_or_busy_port_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    import socket

    tokens = {"DEVMASTER_REGISTRATION_TOKEN": TOKEN, "DEVMASTER_ADMIN_TOKEN": API_KEY}
    for db, expected in ((tmp_path, "is a directory"), (tmp_path / "missing" / "m.sqlite", "does not exist")):
        result = ckagent("dev-master", "--db", str(db), "--port", "0", cwd=tmp_path, env=tokens)
        assert result.returncode == 2
        assert expected in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    (tmp_path / "junk.sqlite").write_bytes(b"this is not a database" * 100)
    result = ckagent("dev-master", "--db", str(tmp_path / "junk.sqlite"), "--port", "0", cwd=tmp_path, env=tokens)
    assert result.returncode == 2 and "cannot be opened as an SQLite database" in result.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = ckagent("dev-master", "--db", str(tmp_path / "m.sqlite"), "--port", str(port), cwd=tmp_path, env=tokens)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"ckagent: dev-master cannot listen on 127.0.0.1:{port}: Address already in use; "
                                     "choose another --port (0 = any free port) or --host")


def test_dev_master_node_lost_after_is_documented_and_checked(tmp_path: Path) -> None:
    tokens = {"DEVMASTER_REGISTRATION_TOKEN": TOKEN, "DEVMASTER_ADMIN_TOKEN": API_KEY}
    helped = ckagent("dev-master", "--help", cwd=tmp_path)
    assert "--node-lost-after" in helped.stdout and "600" in helped.stdout
    for value in ("0", "-5"):
        result = ckagent("dev-master", "--node-lost-after", value, "--port", "0", cwd=tmp_path, env=tokens)
        assert result.returncode == 2 and "--node-lost-after" in result.stderr, result.stderr


def test_dev_master_needs_both_tokens(tmp_path: Path) -> None:
    result = ckagent("dev-master", cwd=tmp_path)
    assert result.returncode == 2
    assert "DEVMASTER_REGISTRATION_TOKEN" in result.stderr
    result = ckagent("dev-master", cwd=tmp_path, env={"DEVMASTER_REGISTRATION_TOKEN": TOKEN})
    assert result.returncode == 2
    assert "DEVMASTER_ADMIN_TOKEN" in result.stderr
    assert TOKEN not in result.stderr


def test_main_in_process_exits_with_code(capsys: pytest.CaptureFixture[str]) -> None:
    from ckagent.cli import main

    with pytest.raises(SystemExit) as info:
        main(["version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"ckagent {__version__}")
    with pytest.raises(SystemExit) as info:
        main(["nope"])
    assert info.value.code == 2


def test_main_in_process_works_after_the_demo_module_was_imported(capsys: pytest.CaptureFixture[str]) -> None:
    """Importing ckagent.cli.demo (what `ckagent demo` does when it runs) binds the submodule as the
    package's ``demo`` attribute: the command's function must not be named so (it was, and every
    later main() in the process failed with AttributeError while it built its commands)."""
    import ckagent.cli.demo  # noqa: F401
    from ckagent.cli import main

    with pytest.raises(SystemExit) as info:
        main(["version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"ckagent {__version__}")


def _python(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60, check=False)


_MODULES_AFTER_MAIN = """
import json, sys
from ckagent.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "cyclopts": "cyclopts" in sys.modules}))
"""


@pytest.mark.parametrize(
    ("args", "cyclopts"),
    [
        (["run", "-c", "FILE"], False),
        (["run", "--config", "FILE"], False),
        (["run", "--config=FILE"], False),
        (["-c", "FILE"], False),
        (["--config", "FILE"], False),
        (["run", "-cFILE"], True),  # unusual spellings still work, through cyclopts
        (["-c=FILE"], True),
    ],
)
def test_plain_run_lines_are_parsed_without_cyclopts(tmp_path: Path, args: list[str], cyclopts: bool) -> None:
    """`ckagent run -c FILE` (what run.sh starts) skips importing cyclopts: a faster start, same result."""
    path = write(tmp_path, "task:\n  poll_interval: fast\n")
    result = _python(_MODULES_AFTER_MAIN, *[a.replace("FILE", str(path)) for a in args], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"ckagent: config error: {path}:2:18: task.poll_interval"), result.stderr
    assert json.loads(result.stdout) == {"code": 2, "cyclopts": cyclopts}


_HTTPX_PROBE = """
import http.server, json, sys, threading
from ckagent.cli import _httpx_without_its_cli

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
with _httpx_without_its_cli():
    import httpx
facts = {"main_loaded": "httpx._main" in sys.modules, "rich": "rich" in sys.modules}  # nor its None entry
facts["get"] = httpx.get(f"http://127.0.0.1:{server.server_address[1]}/").text
import httpx._main  # an explicit import still works afterwards
facts["main_later"] = callable(httpx._main.main)
print(json.dumps(facts))
"""


def test_httpx_imported_without_its_cli_still_works(tmp_path: Path) -> None:
    """The agent imports httpx without its CLI (click, rich, pygments); httpx itself is unaffected."""
    result = _python(_HTTPX_PROBE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"main_loaded": False, "rich": False, "get": "ok", "main_later": True}


def test_demo_prints_curl_commands_only_when_the_master_keeps_running(tmp_path: Path) -> None:
    """Without --keep the master stops with the demo: curl commands against it would fail."""
    from ckagent.cli.demo import explore_lines

    args = ("http://127.0.0.1:8123", "adm-tok", "products", "t-1", tmp_path / "tasks" / "t-1")
    stopped = "\n".join(explore_lines(False, *args))
    assert "curl -H" not in stopped and "8123" not in stopped and "adm-tok" not in stopped
    (hint,) = [line for line in stopped.splitlines() if "--keep" in line]
    assert "re-run" in hint
    assert "--keep" in ckagent("demo", "--help", cwd=tmp_path).stdout  # the option the hint names exists
    kept = explore_lines(True, *args)
    curls = [line for line in kept if "curl -H" in line]
    assert len(curls) == 4 and all("Bearer adm-tok' http://127.0.0.1:8123/api/" in c for c in curls)
    assert any("/api/tasks/t-1/logs" in c for c in curls) and any("/api/tasks/t-1/stats" in c for c in curls)
    assert any(str(tmp_path / "tasks" / "t-1") in line for line in (*kept, *stopped.splitlines()))
