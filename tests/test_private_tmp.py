"""A task's own /tmp, /var/tmp, /dev/shm and /proc (ckagent.containment.private), with a real agent and
real spiders at the level this machine gives, and the namespace helper of a non-root agent.

- every task has its own temporary directory ``<task dir>/tmp``, the spider's, mode 0700, gone at the
  task's end; ``TMPDIR`` (= ``TMP`` = ``TEMP``) names it: ``/tmp`` in a namespace, else its own path;
- ``mount-namespace`` (root): /tmp and /var/tmp are that directory, /dev/shm a tmpfs of the task's — what
  one spider leaves there another, running beside it, does not see, and the host's /tmp never gets it;
  the work dir (here under /tmp) is still seen; /proc is mounted ``hidepid=invisible``: a spider that is
  not root sees only its own uid's processes — not the agent, not another uid's, whose cmdline,
  environ and fds it cannot open either;
- ``user-namespace`` (a plain user): the helper maps the user to itself and gives it the same mounts
  (run here as ``nobody``);
- Chromium (Python Playwright) runs as the spider's own uid with the task's own /dev/shm, without
  ``--disable-dev-shm-usage``, and in Chromium's own sandbox where the agent says it works
  (``CK_CHROMIUM_SANDBOX``, ckagent.code.browsers).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    NOBODY,
    OTHER_USER_PYTHON,
    RecordingMaster,
    agent_settings,
    assert_default_identity,
    chromium_sandbox_expected,
    eventually,
    no_strays,
    running_agent,
    spider_python,
    spider_reachable,
    spider_zip,
    submit,
)

from ckagent.code.runtimes import find_chromium
from ckagent.containment import SPIDER_OOM_SCORE_ADJ, ContainmentError
from ckagent.containment.base import libc, make_preexec
from ckagent.containment.private import USERNS_HELPER, Privacy, PrivacyLevel, open_privacy
from ckagent.containment.process import MARKER_VAR, run_supervised
from ckagent.master.ids import task_dir
from ckagent.node.runas import RunAs

ROOT = os.geteuid() == 0

LOOKER = r"""
import json, os, sys, time
params = json.loads(os.environ["CK_PARAMS"])
tmpdir = os.environ.get("TMPDIR", "")
mounts = {}
for line in open("/proc/self/mounts"):
    fields = line.split()
    mounts[fields[1]] = [fields[2], fields[3]]
mark = params.get("mark")
if mark:
    for folder in ("/tmp", "/var/tmp", "/dev/shm", tmpdir):
        with open(os.path.join(folder, mark), "w") as fh:
            fh.write("left by " + mark)
seen = {folder: sorted(os.listdir(folder)) for folder in ("/tmp", "/var/tmp", "/dev/shm")}
st = os.stat(tmpdir)
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
reach = {}
for pid in params.get("pids", []):
    for what in ("cmdline", "environ", "fd"):
        path = f"/proc/{pid}/{what}"
        try:
            os.listdir(path) if what == "fd" else open(path, "rb").read()
            reach[f"{pid}/{what}"] = "read"
        except OSError as exc:
            reach[f"{pid}/{what}"] = exc.strerror
print("LOOK " + json.dumps({
    "uid": os.getuid(), "pid": os.getpid(), "tmpdir": tmpdir, "tmp": os.environ.get("TMP"),
    "temp": os.environ.get("TEMP"), "tmpdir_mode": oct(st.st_mode & 0o7777), "tmpdir_uid": st.st_uid,
    "mounts": {k: mounts.get(k) for k in ("/tmp", "/var/tmp", "/dev/shm", "/proc")},
    "seen": seen, "pids": pids, "reach": reach, "work_seen": os.path.isdir(params.get("work", "/")),
}), flush=True)
go = os.path.join(os.environ["CK_TASK_DIR"], "go")
for _ in range(1200 if params.get("wait") else 0):  # at most a minute: the test creates "go"
    if os.path.exists(go):
        break
    time.sleep(0.05)
"""


def _looked(lines: list[str]) -> dict[str, Any]:
    found = [json.loads(line.split("LOOK ", 1)[1]) for line in lines if "LOOK " in line]
    assert found, lines[-20:]
    return found[0]  # type: ignore[no-any-return]


async def _look(work: Path, task_id: str) -> dict[str, Any]:
    """What the spider said (its LOOK line in output.log), once it said it."""
    out = task_dir(work, task_id) / "output.log"

    async def said() -> dict[str, Any] | None:
        text = await trio.to_thread.run_sync(lambda: out.read_text(errors="replace") if out.exists() else "")
        return _looked(text.splitlines()) if "LOOK " in text else None

    found: dict[str, Any] = await eventually(said, 120, f"task {task_id} looked")
    return found


def _mounts() -> list[str]:
    with open("/proc/self/mounts") as fh:
        return fh.read().splitlines()


def _settings(tmp_path: Path, master: RecordingMaster, **env: str) -> Any:
    """A test agent whose spiders run as ``nobody`` where the test is root (not root: hidepid hides from
    them; one uid, so each spider's view is the namespace's, not its uid's), else as the test's user."""
    work = spider_reachable(tmp_path / "node")
    extra = {"AGENT_TASK_RUN_AS_USER": "nobody", "AGENT_DEPS_PYTHON": spider_python()} if ROOT else {}
    return agent_settings(work, master.base_url, master.registration_token, **{**extra, **env})


async def test_each_task_has_its_own_tmp_dev_shm_and_proc_and_its_tmpdir_goes_at_its_end(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    admin = recording_master.admin
    settings = _settings(tmp_path, recording_master)
    work = settings.task.work_dir
    own_uid = NOBODY if ROOT else os.geteuid()
    other = await trio.lowlevel.open_process(["sleep", "60"], **(
        {"user": 12345, "group": 12345, "extra_groups": []} if ROOT else {}))
    try:
        async with running_agent(nursery, settings) as agent:
            assert agent.containment is not None and agent.containment.privacy is not None
            privacy = agent.containment.privacy
            if privacy.level is PrivacyLevel.TMPDIR:
                pytest.skip(f"no private namespace here: {privacy.passed_over}")
            assert privacy.level is (PrivacyLevel.MOUNT_NAMESPACE if ROOT else PrivacyLevel.USER_NAMESPACE), privacy
            spider_a = await admin.create_spider(name="tmp-a", framework="python")
            spider_b = await admin.create_spider(name="tmp-b", framework="python")
            for spider in (spider_a, spider_b):
                await admin.upload_package(spider, spider_zip({"main.py": LOOKER}))
            pids = [os.getpid(), other.pid]
            first = str(await admin.create_task(spider_a, params={
                "mark": "mark-of-a", "wait": True, "pids": pids, "work": str(work)}))
            a = await _look(work, first)
            second = str(await admin.create_task(spider_b, params={"pids": pids, "work": str(work)}))
            with trio.fail_after(120):
                b_task = await admin.wait_task_final(second, 120)
            assert b_task["status"] == "SUCCESS", (b_task, await admin.get_logs(second))
            b = _looked(await admin.get_logs(second))
            (task_dir(work, first) / "go").touch()
            with trio.fail_after(120):
                a_task = await admin.wait_task_final(first, 120)
            assert a_task["status"] == "SUCCESS", (a_task, await admin.get_logs(first))
    finally:
        other.kill()
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 10):
            await other.wait()
    for look, task_id in ((a, first), (b, second)):
        assert look["tmpdir"] == look["tmp"] == look["temp"] == "/tmp"
        assert (look["tmpdir_mode"], look["tmpdir_uid"]) == ("0o700", own_uid)  # <task dir>/tmp itself
        assert look["mounts"]["/dev/shm"][0] == "tmpfs" and look["mounts"]["/tmp"][0] != "tmpfs", look["mounts"]
        assert look["work_seen"], "the work dir (under /tmp here) is still seen in the namespace"
        assert not (task_dir(work, task_id) / "tmp").exists(), "its TMPDIR goes with the task"
        if privacy.hidepid:
            assert "hidepid=invisible" in look["mounts"]["/proc"][1] or "hidepid=2" in look["mounts"]["/proc"][1]
            assert os.getpid() not in look["pids"] and other.pid not in look["pids"] and look["pid"] in look["pids"]
            assert all(look["reach"][f"{pid}/{what}"] != "read" for pid in pids for what in ("cmdline", "environ",
                                                                                               "fd")), look["reach"]
    assert all("mark-of-a" in a["seen"][folder] for folder in ("/tmp", "/var/tmp", "/dev/shm")), a["seen"]
    assert all("mark-of-a" not in names for names in b["seen"].values()), b["seen"]  # b ran beside a
    host = await trio.to_thread.run_sync(lambda: {f: sorted(os.listdir(f)) for f in ("/tmp", "/var/tmp", "/dev/shm")})
    assert all("mark-of-a" not in names for names in host.values())  # the host's never got it


async def test_tmpdir_alone_when_the_node_says_so(recording_master: RecordingMaster, nursery: trio.Nursery,
                                                  tmp_path: Path) -> None:
    admin = recording_master.admin
    settings = _settings(tmp_path, recording_master, AGENT_TASK_PRIVATE_TMP="tmpdir") if ROOT else agent_settings(
        tmp_path / "node", recording_master.base_url, recording_master.registration_token,
        AGENT_TASK_PRIVATE_TMP="tmpdir")
    work = settings.task.work_dir
    async with running_agent(nursery, settings) as agent:
        assert agent.containment is not None and agent.containment.privacy is not None
        assert agent.containment.privacy.level is PrivacyLevel.TMPDIR
        task_id = await submit(admin, "tmpdir-only", {"main.py": LOOKER}, params={"work": str(work)})
        with trio.fail_after(120):
            task = await admin.wait_task_final(task_id, 120)
    assert task["status"] == "SUCCESS", (task, await admin.get_logs(task_id))
    look = _looked(await admin.get_logs(task_id))
    assert look["tmpdir"] == str(task_dir(work, task_id) / "tmp") and look["tmpdir_mode"] == "0o700"
    host = {line.split()[1]: line.split()[2:4] for line in await trio.to_thread.run_sync(_mounts)}
    assert look["mounts"]["/tmp"] == host.get("/tmp") and look["mounts"]["/dev/shm"] == host.get("/dev/shm")
    assert not (task_dir(work, task_id) / "tmp").exists()


@pytest.mark.skipif(not ROOT, reason="a root agent cannot be had here")
def test_a_named_level_the_node_cannot_give_fails_the_start(tmp_path: Path) -> None:
    with pytest.raises(ContainmentError, match=r"task\.private_tmp is user-namespace"):
        open_privacy(tmp_path, (tmp_path,), "user-namespace")
    assert open_privacy(tmp_path, (tmp_path,), "tmpdir").level is PrivacyLevel.TMPDIR


@pytest.mark.skipif(not ROOT, reason="runs the helper as nobody: needs root to switch users")
@pytest.mark.skipif(not os.access(OTHER_USER_PYTHON, os.X_OK), reason=f"{OTHER_USER_PYTHON} is missing")
def test_the_user_namespace_helper_gives_a_plain_user_its_own_tmp(tmp_path: Path) -> None:
    keep = spider_reachable(tmp_path / "work")
    keep.mkdir()
    (keep / "seen").write_text("the work dir\n")
    keep.chmod(0o755)
    own = keep / "task-tmp"
    own.mkdir(mode=0o700)
    os.chown(own, NOBODY, NOBODY)
    privacy = Privacy(PrivacyLevel.USER_NAMESPACE, keep=(str(keep),))
    script = ('cat /proc/self/mounts; id -u; touch /tmp/mine /dev/shm/mine; ls /tmp; cat "$0"/seen; '
              'echo TMPDIR=$TMPDIR')
    argv = privacy.wrap(["/bin/sh", "-c", script, str(keep)], [], own)
    argv[0] = OTHER_USER_PYTHON  # (the suite's interpreter may be one nobody cannot run)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, user=NOBODY, group=NOBODY,
                          extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin", "TMPDIR": "/x"})
    assert done.returncode == 0, done.stderr
    mounts = {line.split()[1]: line.split()[2] for line in done.stdout.splitlines() if len(line.split()) > 3}
    assert mounts.get("/dev/shm") == "tmpfs" and mounts.get("/tmp") != "tmpfs", done.stdout
    lines = done.stdout.splitlines()
    assert str(NOBODY) in lines, done.stdout
    assert "the work dir" in lines and "TMPDIR=/x" in lines, done.stdout  # the work dir seen, its env through
    assert not Path("/tmp/mine").exists() and not Path("/dev/shm/mine").exists() and (own / "mine").exists()
    assert USERNS_HELPER in argv


@pytest.mark.skipif(ROOT, reason="the user-namespace level is a plain user's (root gets mount-namespace)")
def test_a_plain_users_node_gets_the_user_namespace_level_where_it_may(tmp_path: Path) -> None:
    privacy = open_privacy(tmp_path, (tmp_path,))
    if Path("/proc/sys/user/max_user_namespaces").read_text().strip() == "0":
        assert privacy.level is PrivacyLevel.TMPDIR and "max_user_namespaces" in privacy.passed_over
    else:
        assert privacy.level is PrivacyLevel.USER_NAMESPACE, privacy


CHROMIUM_SPIDER = r"""
import json, os
from crawlerkeeper_sdk import chromium_sandbox, save_item
from playwright.sync_api import sync_playwright


def browsers():
    # Chromium's processes as the spider sees them: a renderer in the sandbox is in a pid namespace
    # below the spider's (NSpid: one pid more) under seccomp-bpf (Seccomp: 2).
    seen = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            # (a zygote's children set their title: one string, arguments joined by spaces)
            argv = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").split()
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
        except OSError:
            continue
        if argv and "chrom" in os.path.basename(argv[0]):
            seen.append({"type": next((a.split("=", 1)[1] for a in argv if a.startswith("--type=")), "browser"),
                         "no_sandbox": "--no-sandbox" in argv, "nspids": len(status["NSpid"].split()),
                         "seccomp": status["Seccomp"].strip(), "uid": int(status["Uid"].split()[0])})
    return seen


mounts = {line.split()[1]: line.split()[2] for line in open("/proc/self/mounts")}
with sync_playwright() as p:
    # No --no-sandbox, no --disable-dev-shm-usage: the sandbox as the agent says (CK_CHROMIUM_SANDBOX),
    # shared memory in the task's own /dev/shm.
    browser = p.chromium.launch(executable_path=os.environ["CK_CHROMIUM_PATH"], headless=True,
                                chromium_sandbox=chromium_sandbox(), args=["--disable-gpu", "--no-first-run"])
    page = browser.new_page()
    page.goto(json.loads(os.environ["CK_PARAMS"])["url"])
    save_item({"title": page.title(), "shm": mounts.get("/dev/shm"), "tmpdir": os.environ["TMPDIR"],
               "uid": os.getuid(), "sandbox_env": os.environ.get("CK_CHROMIUM_SANDBOX"),
               "nspids": len(open("/proc/self/status").read().split("NSpid:")[1].splitlines()[0].split()),
               "sandbox": chromium_sandbox(), "processes": browsers()})
    browser.close()
"""


@pytest.mark.slow
@pytest.mark.skipif(find_chromium() is None, reason="Chromium is not installed (apt-get install chromium)")
async def test_chromium_runs_sandboxed_with_the_tasks_own_dev_shm(recording_master: RecordingMaster,
                                                                  nursery: trio.Nursery, tmp_path: Path) -> None:
    """Python Playwright's Chromium, at the node's default identity level (as root: a uid of the spider's
    own), with Chromium's own sandbox where the agent says it works (the spider is not root and may make
    user namespaces: Debian's Chromium has no setuid sandbox) and shared memory in the task's /dev/shm."""
    admin = recording_master.admin
    settings = agent_settings(tmp_path / "node", recording_master.base_url, recording_master.registration_token)
    async with running_agent(nursery, settings) as agent:
        assert agent.containment is not None and agent.containment.privacy is not None
        level = agent.containment.privacy.level
        task_id = await submit(admin, "chromium-shm", {"main.py": CHROMIUM_SPIDER, "requirements.txt": "playwright>=1.40,<2\n"},
                               params={"url": recording_master.base_url + "/demo-site/"})
        with trio.fail_after(600):
            task = await admin.wait_task_final(task_id, 600)
    log = "\n".join(await admin.get_logs(task_id))
    assert task["status"] == "SUCCESS", log[-6000:]
    uid = assert_default_identity(log)
    [item] = await admin.get_items(task_id)
    assert item["title"] and item["uid"] == uid
    if level is not PrivacyLevel.TMPDIR:
        assert item["shm"] == "tmpfs" and item["tmpdir"] == "/tmp"
    renderers = [p for p in item["processes"] if p["type"] == "renderer"]
    assert renderers and all(p["uid"] == uid for p in item["processes"]), json.dumps(item["processes"], indent=1)
    expected = chromium_sandbox_expected()
    assert (item["sandbox_env"], item["sandbox"]) == ("1" if expected else "0", expected), item
    if expected:  # the renderers in a pid namespace of their own, under seccomp-bpf; no --no-sandbox anywhere
        assert all(p["nspids"] > item["nspids"] and p["seccomp"] == "2" for p in renderers), \
            json.dumps(item["processes"], indent=1)
        assert not any(p["no_sandbox"] for p in item["processes"]), item["processes"]
    else:
        assert all(p["no_sandbox"] for p in item["processes"] if p["type"] == "browser"), item["processes"]


@pytest.mark.skipif(not ROOT, reason="starting a process as another uid needs root")
async def test_a_process_started_as_another_uid_gets_its_oom_score_adj_from_the_agent(tmp_path: Path) -> None:
    """After its setuid the child cannot raise its own oom_score_adj (its /proc files are root's: a
    credential change leaves it non-dumpable) and is never made dumpable to do it — it holds a copy
    of the agent's memory until its exec; the agent sets it once the process runs."""
    task_id = uuid.uuid4().hex
    seen: list[str] = []
    stop = trio.Event()

    async def started(pid: int) -> None:
        seen.append(await trio.to_thread.run_sync(lambda: Path(f"/proc/{pid}/oom_score_adj").read_text().strip()))
        stop.set()

    with trio.fail_after(30):
        await run_supervised(["/bin/sleep", "30"], cwd=Path("/"), env={"PATH": "/usr/bin:/bin", MARKER_VAR: task_id},
                             task_id=task_id, output=lambda data: None, deadline_seconds=20, grace=1.0, stop=stop,
                             notice=lambda text: None, on_started=started, run_as=RunAs.lookup("nobody"))
    assert seen == [str(SPIDER_OOM_SCORE_ADJ)]


@pytest.mark.skipif(not ROOT, reason="starting a process as another uid needs root")
def test_the_forked_child_of_another_uid_is_never_made_dumpable() -> None:
    """What the preexec leaves (PR_GET_DUMPABLE, read in the child just before its exec): 0."""
    read, write = os.pipe()
    preexec = make_preexec([])

    def then_report() -> None:
        preexec()
        os.write(write, str(libc().prctl(3, 0, 0, 0, 0)).encode())  # PR_GET_DUMPABLE

    try:
        subprocess.run(["/bin/true"], user=NOBODY, group=NOBODY, extra_groups=[], preexec_fn=then_report,
                       pass_fds=(write,), timeout=30, check=True)
        os.close(write)
        write = -1
        assert os.read(read, 16) == b"0"
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
