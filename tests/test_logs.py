"""The agent's own log: JSON lines, rotation, redaction, where it goes, and the canonical task line —
the last checked on a real agent process running real tasks against the dev master."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from harness import AgentProcess, submit

from ckagent.node.logs import JsonFormatter, Masker, RedactingFormatter, log_task_finished, setup_logging

REPO = Path(__file__).resolve().parents[1]
CANONICAL_KEYS = ["task_id", "spider", "status", "error_code", "exit_code", "duration_seconds", "items",
                  "log_lines", "install_seconds", "cache_hit"]




def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("ckagent.test", logging.WARNING, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_json_lines_carry_fields_as_keys_and_stay_one_line() -> None:
    fmt = JsonFormatter()
    line = fmt.format(record("two\nlines: %s", "ünïcode", fields={"task_id": "t1", "items": 3, "level": "x"}))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "two\nlines: ünïcode" and entry["logger"] == "ckagent.test"
    assert entry["level"] == "WARNING"  # a field never overrides the record's own keys
    assert entry["task_id"] == "t1" and entry["items"] == 3
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", entry["time"])
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record("failed")
        rec.exc_info = sys.exc_info()
    entry = json.loads(fmt.format(rec))
    assert "ValueError: boom" in entry["exception"]


def test_secrets_are_masked_in_every_format() -> None:
    for inner in (JsonFormatter(), logging.Formatter("%(message)s")):
        fmt = RedactingFormatter(inner, ["reg-token-123", "", "api-key-456"])
        text = fmt.format(record("sent %s and %s", "reg-token-123", "Bearer api-key-456", fields={"k": "api-key-456"}))
        assert "reg-token-123" not in text and "api-key-456" not in text and text.count("***") >= 2


def test_short_secrets_are_masked_only_where_they_stand_alone() -> None:
    """A short token must neither corrupt words, timestamps or JSON keys nor spell itself out in stars."""
    line = '2026-11-29 19:02:59,120 INFO ckagent.agent: token=agent sent; {"time": 0} abcdef'
    for secret, expected in (
        ("agent", '2026-11-29 19:02:59,120 INFO ckagent.***: token=*** sent; {"time": 0} abcdef'),
        ("0", '2026-11-29 19:02:59,120 INFO ckagent.agent: token=agent sent; {"time": ***} abcdef'),
        ("e", line),
        ("abc", line),
        ("_", line),
        ("abcdefgh"[:7], line),  # 7 characters: still short
    ):
        for inner in (JsonFormatter(), logging.Formatter("%(message)s")):
            text = RedactingFormatter(inner, [secret]).format(record("%s", line))
            if isinstance(inner, JsonFormatter):
                entry = json.loads(text)  # the JSON keys are intact
                assert set(entry) == {"time", "level", "logger", "message"}
                text = entry["message"]
            assert text == expected, secret
    # A secret of 8 characters or more is masked wherever it occurs, inside words too.
    assert Masker(["s3cr3t-8"])("xs3cr3t-8y and s3cr3t-8") == "x***y and ***"
    both = Masker(["tok", "s3cr3t-8"])
    assert both("tok=s3cr3t-8 tokx") == "***=*** tokx" == both.mask_bytes(b"tok=s3cr3t-8 tokx").decode()
    # Standing alone: next to punctuation, quotes, spaces, line ends — not next to letters (any
    # script), digits or underscores.
    mask = Masker(["tok", ""])
    assert mask("tok 'tok' tok=tok,tok.tok\ntok") == "*** '***' ***=***,***.***\n***"
    assert mask("toks stok tok1 1tok _tok tok_ étok toké") == "toks stok tok1 1tok _tok tok_ étok toké"
    for text in ("tok étok toké tok", "tok \xff tok1 tok", "token=tok; ключ=tok"):
        data = text.encode("utf-8", "surrogateescape")
        assert mask.mask_bytes(data) == mask(data.decode("utf-8", "surrogateescape")).encode(
            "utf-8", "surrogateescape")
    assert mask.mask_bytes("tok étok".encode()) == "*** étok".encode()
    assert not Masker(["", ""]) and mask


def test_short_registration_token_warns_once_without_showing_it(
        tmp_path: Path, root_logger: logging.Logger) -> None:
    path = tmp_path / "agent.log"
    setup_logging("INFO", path, secrets=["sh0rt-t0ken", "a" * 43])
    setup_logging("INFO", path, secrets=["long-random-token-" + "x" * 20, "", "a" * 43])
    for handler in root_logger.handlers:
        handler.flush()
    warnings = [line for line in path.read_text().splitlines() if "WARNING" in line]
    assert len(warnings) == 1, warnings
    assert "short" in warnings[0] and "long random" in warnings[0] and "sh0rt-t0ken" not in warnings[0]


def test_stamina_retries_stay_out_of_the_agent_log(tmp_path: Path, root_logger: logging.Logger) -> None:
    """stamina's per-retry WARNING has no reason nor wait; master.Connectivity logs the changes instead."""
    path = tmp_path / "agent.log"
    setup_logging("DEBUG", path)
    logging.getLogger("stamina").warning("stamina.retry_scheduled")
    logging.getLogger("stamina").error("a real stamina error")
    for handler in root_logger.handlers:
        handler.flush()
    text = path.read_text()
    assert "retry_scheduled" not in text and "a real stamina error" in text


def test_rotation_by_size_and_count(tmp_path: Path, root_logger: logging.Logger) -> None:
    path = tmp_path / "logs" / "agent.log"
    setup_logging("INFO", path, "json", max_bytes=2048, backup_count=2)
    log = logging.getLogger("ckagent.rotation")
    for i in range(200):
        log.info("line %d %s", i, "x" * 40)
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["agent.log", "agent.log.1", "agent.log.2"]
    for p in path.parent.iterdir():
        assert p.stat().st_size <= 2048
        for line in p.read_text().splitlines():
            json.loads(line)
    assert "line 199" in path.read_text()


def test_stderr_only_in_the_foreground(tmp_path: Path, root_logger: logging.Logger,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def kinds() -> list[str]:
        return sorted(type(h).__name__ for h in root_logger.handlers)

    setup_logging("INFO", None)
    assert kinds() == ["StreamHandler"]  # no file: stderr, always
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    setup_logging("INFO", tmp_path / "a.log")  # pytest's stderr is not a terminal: the file only
    assert kinds() == ["FollowingRotatingFileHandler"]
    st = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    setup_logging("INFO", tmp_path / "a.log")  # under systemd, stderr is the journal: both
    assert kinds() == ["FollowingRotatingFileHandler", "StreamHandler"]
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")  # a journal, but not our stderr
    setup_logging("INFO", tmp_path / "a.log")
    assert kinds() == ["FollowingRotatingFileHandler"]
    monkeypatch.delenv("JOURNAL_STREAM")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    setup_logging("INFO", tmp_path / "a.log")  # running in a terminal: both
    assert kinds() == ["FollowingRotatingFileHandler", "StreamHandler"]
    setup_logging("DEBUG", tmp_path / "a.log", stderr=False)
    assert kinds() == ["FollowingRotatingFileHandler"] and root_logger.level == logging.DEBUG


_DAEMON = """
import logging, sys
from pathlib import Path
from ckagent.node.logs import setup_logging
setup_logging("INFO", Path(sys.argv[1]), max_bytes=1024, backup_count=2)
print("before rotation", file=sys.stderr, flush=True)
for i in range(100):
    logging.getLogger("ckagent.daemon").info("line %d %s", i, "x" * 40)
print("STDERR AFTER ROTATION", file=sys.stderr, flush=True)
print("STDOUT AFTER ROTATION", flush=True)
"""


def test_a_daemons_stdout_and_stderr_follow_the_rotated_log_file(tmp_path: Path) -> None:
    """run.sh's daemon mode: `agent >>logs/agent.log 2>&1` with logging.file = logs/agent.log."""
    log = tmp_path / "agent.log"
    with log.open("ab") as out:
        done = subprocess.run([sys.executable, "-c", _DAEMON, str(log)], stdout=out, stderr=out,
                              stdin=subprocess.DEVNULL, timeout=60, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.log", "agent.log.1", "agent.log.2"]
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 1024 + 100, p  # rotated by max_bytes (the stderr lines come on top)
    current = log.read_text()
    assert "STDERR AFTER ROTATION" in current and "STDOUT AFTER ROTATION" in current
    assert "line 99" in current
    assert current.count("line 99 ") == 1  # stderr is the file: each line once


def test_canonical_line_text_format(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    log_task_finished(logging.getLogger("ckagent.agent"), {
        "task_id": "t1", "spider": "my shop", "status": "FAILED", "error_code": "EXIT_NONZERO", "exit_code": 3,
        "duration_seconds": 1.5, "items": 0, "log_lines": 12, "install_seconds": None, "cache_hit": True,
    })
    (rec,) = caplog.records
    assert rec.getMessage() == (
        'task finished task_id=t1 spider="my shop" status=FAILED error_code=EXIT_NONZERO exit_code=3 '
        "duration_seconds=1.500 items=0 log_lines=12 install_seconds=- cache_hit=true"
    )
    assert rec.fields["event"] == "task_finished" and rec.fields["exit_code"] == 3  # type: ignore[attr-defined]


def _strings_hashing_to(text: str, sha256_hex: set[str], length: int) -> list[str]:
    """Every ``length``-character window of URL-safe runs in ``text`` whose SHA-256 is in ``sha256_hex``."""
    found = []
    for run in re.findall(rf"[A-Za-z0-9_\-]{{{length},}}", text):
        for i in range(len(run) - length + 1):
            window = run[i : i + length]
            if hashlib.sha256(window.encode()).hexdigest() in sha256_hex:
                found.append(window)
    return found


async def test_real_agent_json_log_canonical_lines_and_no_secrets(dev_master, tmp_path: Path) -> None:
    log_file = tmp_path / "agent-own.log"
    agent = AgentProcess(tmp_path, dev_master.base_url, dev_master.registration_token,
                         logging__format="json", logging__level="DEBUG", logging__file=str(log_file))
    task_secret = "sekret-in-task-env-0042"
    try:
        with trio.fail_after(90):
            await agent.start()
            ok = await submit(dev_master.admin, "good spider", {
                "main.py": "import crawlerkeeper_sdk as ck\nprint('hi')\nck.save_item({'a': 1})\nck.save_item({'a': 2})\n",
            }, )
            bad = await submit(dev_master.admin, "bad", {"main.py": "import sys\nsys.exit(4)\n"})
            ok_task = await dev_master.admin.wait_task_final(ok, 60)
            bad_task = await dev_master.admin.wait_task_final(bad, 60)
            third = await submit(dev_master.admin, "envy", {"main.py": "import os\nprint(len(os.environ.get('API_TOKEN', '')))\n"})
            spider_id = (await dev_master.admin.get_task(third))["spiderId"]
            with_env = await dev_master.admin.create_task(spider_id, env={"API_TOKEN": task_secret})
            await dev_master.admin.wait_task_final(third, 60)
            await dev_master.admin.wait_task_final(with_env, 60)

            def canonical() -> list[dict[str, object]]:
                if not log_file.exists():
                    return []
                return [e for e in map(json.loads, log_file.read_text().splitlines())
                        if e.get("event") == "task_finished"]

            while True:  # each line is logged once the master has acknowledged the result
                if len(canonical()) >= 4:
                    break
                await trio.sleep(0.05)
            agent.signal(signal.SIGTERM)
            assert await agent.wait() == 0
    finally:
        with trio.move_on_after(10, shield=True):  # a cancelled test still reaps its agents
            await agent.kill()

    text = log_file.read_text()
    entries = [json.loads(line) for line in text.splitlines()]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    assert any("status server on" in e["message"] for e in entries)
    lines = [e for e in entries if e.get("event") == "task_finished"]
    assert sorted(e["task_id"] for e in lines) == sorted([ok, bad, third, with_env])  # once per task
    by_id = {e["task_id"]: e for e in lines}
    good = by_id[ok]
    assert [k for k in good if k in CANONICAL_KEYS] == CANONICAL_KEYS
    assert (good["spider"], good["status"], good["error_code"], good["exit_code"]) == ("good spider", "SUCCESS",
                                                                                        None, 0)
    assert good["items"] == 2 == ok_task["itemCount"] and good["log_lines"] == ok_task["logLines"]
    assert isinstance(good["duration_seconds"], float) and isinstance(good["install_seconds"], float)
    assert isinstance(good["cache_hit"], bool)
    assert good["message"].startswith(f"task finished task_id={ok} spider=\"good spider\" status=SUCCESS")
    failed = by_id[bad]
    assert (failed["status"], failed["error_code"], failed["exit_code"]) == ("FAILED", "EXIT_NONZERO", 4)
    assert failed["log_lines"] == bad_task["logLines"]
    assert by_id[with_env]["cache_hit"] is True  # the same spider's second run reuses its venv

    # No secret in the agent's own log nor in what it wrote to stderr.
    everything = text + agent.log_text()
    assert dev_master.registration_token not in everything
    assert task_secret not in everything
    db = sqlite3.connect(f"file:{dev_master.db_path}?mode=ro", uri=True)
    try:
        key_hashes = {row[0] for row in db.execute("SELECT api_key_sha256 FROM nodes")}
    finally:
        db.close()
    assert key_hashes
    assert _strings_hashing_to(everything, key_hashes, 43) == []
    # The scan does find a key when one is there.
    probe = "Z" * 43
    probe_hash = {hashlib.sha256(probe.encode()).hexdigest()}
    assert _strings_hashing_to(f'{{"h": "Bearer {probe}"}}', probe_hash, 43) == [probe]
