"""Scrapy and Scrapyd for the benchmarks: a bench-owned virtualenv, a tiny project, a Scrapyd daemon.

- :func:`ensure_venv` makes ``$XDG_CACHE_HOME/ckagent-bench/scrapy-venv`` (default ``~/.cache``)
  with uv and installs Scrapy, Scrapyd and setuptools from the package index into it, plus a
  ``.pth`` hook that stamps ``time.time()`` at interpreter start (before any spider code) when
  ``BENCH_STAMP_DIR`` and a run key (``CK_TASK_ID``, ``BENCH_ID``, or Scrapyd's ``-a _job=<id>``) are set — the
  same first-line stamp for every launcher.
- :func:`write_project` writes the Scrapy project every side runs: spider ``noop`` starts and closes.
- :func:`build_egg` builds its egg (``python setup.py bdist_egg`` in the bench venv).
- :class:`Scrapyd` writes ``scrapyd.conf`` (127.0.0.1, a free port, ``max_proc``, ``poll_interval``),
  starts the daemon, deploys the egg with ``addversion.json`` and schedules jobs.

Errors: RuntimeError (with the tool's output tail) when an install, build or start fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import trio

from bench._harness import PYTHON, STAMP_DIR_VAR, STAMP_KEY_VARS, free_port

REQUIREMENTS = ("scrapy>=2.11", "scrapyd>=1.5", "setuptools")
PROJECT = "benchproj"
SPIDER = "noop"

_STAMP_MODULE = f'''"""Benchmark hook (from a .pth file): stamp the interpreter's start for the launcher being measured."""
import os as _os
_d = _os.environ.get({STAMP_DIR_VAR!r})
if _d:
    import time as _time
    _t = _time.time()
    _k = next((_os.environ[v] for v in {STAMP_KEY_VARS!r} if _os.environ.get(v)), None)
    if not _k:  # Scrapyd passes the job id as the spider argument "-a _job=<id>"
        import sys as _sys
        _k = next((a[5:] for a in _sys.argv if a.startswith("_job=")), None)
    if _k:
        with open(_os.path.join(_d, _k), "w") as _f:
            _f.write(repr(_t))
'''

_FILES = {
    "scrapy.cfg": f"[settings]\ndefault = {PROJECT}.settings\n\n[deploy]\nproject = {PROJECT}\n",
    f"{PROJECT}/__init__.py": "",
    f"{PROJECT}/settings.py": (
        f'BOT_NAME = "{PROJECT}"\nSPIDER_MODULES = ["{PROJECT}.spiders"]\nNEWSPIDER_MODULE = "{PROJECT}.spiders"\n'
        'ROBOTSTXT_OBEY = False\nTELNETCONSOLE_ENABLED = False\nLOG_LEVEL = "INFO"\n'
    ),
    f"{PROJECT}/spiders/__init__.py": "",
    f"{PROJECT}/spiders/noop.py": (
        "import scrapy\n\n\nclass NoopSpider(scrapy.Spider):\n"
        '    """Starts and closes: no requests."""\n\n'
        f'    name = "{SPIDER}"\n    start_urls: list[str] = []\n'
    ),
    "setup.py": (
        "from setuptools import find_packages, setup\n\n"
        f'setup(name="{PROJECT}", version="1.0", packages=find_packages(),\n'
        f'      entry_points={{"scrapy": ["settings = {PROJECT}.settings"]}})\n'
    ),
    # ckagent installs a spider's requirements; the spider runs the bench venv's interpreter instead.
    "requirements.txt": "# dependencies come from the benchmark's own virtualenv\n",
}


def cache_dir() -> Path:
    """Where the bench venv lives (outside the repository)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ckagent-bench"


def venv_python() -> Path:
    """The bench venv's interpreter (exists after :func:`ensure_venv`)."""
    return cache_dir() / "scrapy-venv" / "bin" / "python"


def _uv() -> str:
    found = shutil.which("uv") or str(Path(PYTHON).parent / "uv")
    if not Path(found).exists():
        raise RuntimeError("uv is needed to build the benchmark's Scrapy venv (pip install uv)")
    return found


def _check(argv: list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} … failed ({done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
    return done.stdout


def ensure_venv() -> Path:
    """Create/refresh the bench venv (blocking, seconds with a warm uv cache). Returns its python."""
    venv = cache_dir() / "scrapy-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        _check([_uv(), "venv", "--quiet", "--python", PYTHON, str(venv)])
    _check([_uv(), "pip", "install", "--quiet", "--python", str(python), *REQUIREMENTS])
    site = Path(_check([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (site / "_bench_stamp.py").write_text(_STAMP_MODULE)
    (site / "bench_stamp.pth").write_text("import _bench_stamp\n")
    return python


def versions(python: Path) -> dict[str, str]:
    """Installed versions of Scrapy and Scrapyd in the bench venv."""
    out = _check([str(python), "-c", "import scrapy, scrapyd; print(scrapy.__version__, scrapyd.__version__)"])
    scrapy_v, scrapyd_v = out.split()
    return {"scrapy": scrapy_v, "scrapyd": scrapyd_v}


def write_project(directory: Path) -> Path:
    """Write the benchmark's Scrapy project into ``directory``; returns it."""
    for rel, text in _FILES.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return directory


def build_egg(project_dir: Path, python: Path) -> bytes:
    """Build the project's egg with the bench venv's setuptools; returns its bytes (blocking)."""
    out = project_dir / "dist-egg"
    shutil.rmtree(out, ignore_errors=True)
    _check([str(python), "setup.py", "-q", "bdist_egg", "-d", str(out)], cwd=project_dir)
    eggs = list(out.glob("*.egg"))
    if len(eggs) != 1:
        raise RuntimeError(f"bdist_egg made {len(eggs)} eggs in {out}")
    data = eggs[0].read_bytes()
    for leftover in ("build", f"{PROJECT}.egg-info", "dist-egg"):
        shutil.rmtree(project_dir / leftover, ignore_errors=True)
    return data


def scrapy_command(python: Path) -> list[str]:
    """The command line of the ``noop`` spider, run from the project directory."""
    return [str(python), "-m", "scrapy", "crawl", SPIDER]


class Scrapyd:
    """One Scrapyd daemon in ``directory`` (config, eggs, logs, dbs) on 127.0.0.1 and a free port.

    ``poll_interval`` None keeps Scrapyd's default (5 s). Use ``await start()`` / ``await stop()``.
    """

    def __init__(self, directory: Path, python: Path, *, max_proc: int, poll_interval: float | None = None,
                 stamp_dir: Path | None = None) -> None:
        self.directory = directory
        self.python = python
        self.max_proc = max_proc
        self.poll_interval = poll_interval
        self.stamp_dir = stamp_dir
        self.port = 0
        self.url = ""
        self.process: trio.Process | None = None
        self.http = httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(keepalive_expiry=1.0))

    def _write_config(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        lines = [
            "[scrapyd]",
            "bind_address = 127.0.0.1",
            f"http_port = {self.port}",
            f"max_proc = {self.max_proc}",
            f"eggs_dir = {self.directory / 'eggs'}",
            f"logs_dir = {self.directory / 'logs'}",
            f"dbs_dir = {self.directory / 'dbs'}",
            "items_dir =",
            "jobs_to_keep = 1000",
            "finished_to_keep = 1000",
        ]
        if self.poll_interval is not None:
            lines.append(f"poll_interval = {self.poll_interval}")
        (self.directory / "scrapyd.conf").write_text("\n".join(lines) + "\n")

    async def start(self, timeout: float = 60.0) -> None:  # noqa: ASYNC109 - bounds a startup wait
        """Write the config, start the daemon and wait until daemonstatus.json answers."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write_config()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SCRAPY", "AGENT_"))}
        env.pop("PYTHONPATH", None)
        if self.stamp_dir is not None:
            env[STAMP_DIR_VAR] = str(self.stamp_dir)
        with (self.directory / "scrapyd.out").open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [str(self.python), "-m", "scrapyd"], cwd=str(self.directory), env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )
        with trio.fail_after(timeout):
            while True:
                if self.process.returncode is not None:
                    raise RuntimeError(f"scrapyd exited with {self.process.returncode}; see {self.directory}")
                try:
                    if (await self.http.get(self.url + "/daemonstatus.json")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)

    async def _json(self, method: str, endpoint: str, **kwargs: Any) -> dict[str, Any]:
        response = await self.http.request(method, f"{self.url}/{endpoint}", **kwargs)
        data: dict[str, Any] = response.json()
        if response.status_code != 200 or data.get("status") != "ok":
            raise RuntimeError(f"scrapyd {endpoint}: {response.status_code} {data}")
        return data

    async def deploy(self, egg: bytes, version: str = "1") -> None:
        """Upload the project's egg (addversion.json)."""
        await self._json("POST", "addversion.json", data={"project": PROJECT, "version": version},
                         files={"egg": (f"{PROJECT}.egg", egg)})

    async def schedule(self, spider: str = SPIDER) -> str:
        """Queue one job (schedule.json); returns the job id."""
        return str((await self._json("POST", "schedule.json", data={"project": PROJECT, "spider": spider}))["jobid"])

    async def finished_jobs(self) -> dict[str, dict[str, Any]]:
        """Finished jobs by id (listjobs.json), with ``start``/``end`` as epoch seconds."""
        data = await self._json("GET", "listjobs.json", params={"project": PROJECT})
        jobs: dict[str, dict[str, Any]] = {}
        for job in data.get("finished", []):
            job = dict(job)
            job["start"] = datetime.fromisoformat(job["start_time"]).timestamp()
            job["end"] = datetime.fromisoformat(job["end_time"]).timestamp()
            jobs[job["id"]] = job
        return jobs

    async def wait_finished(self, job_ids: list[str], timeout: float,  # noqa: ASYNC109 - bounds a wait
                            interval: float = 0.25) -> list[dict[str, Any]]:
        """Wait until every job in ``job_ids`` has finished; returns them in order. Raises TimeoutError."""
        with trio.move_on_after(timeout):
            while True:
                jobs = await self.finished_jobs()
                if all(j in jobs for j in job_ids):
                    return [jobs[j] for j in job_ids]
                await trio.sleep(interval)
        raise TimeoutError(f"scrapyd jobs not finished after {timeout:g} s")

    async def stop(self) -> None:
        """Stop the daemon (SIGTERM, SIGKILL after 10 s) and close the HTTP client (idempotent)."""
        await self.http.aclose()
        process = self.process
        if process is None:
            return
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(10):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
            await process.wait()


def minimal_env() -> dict[str, str]:
    """The environment a bare spawner gives its processes (like an agent's spider: PATH, HOME, LANG)."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TZ", "TMPDIR") if k in os.environ}
    env.setdefault("LANG", "C.UTF-8")
    env["PYTHONUNBUFFERED"] = "1"
    return env


if __name__ == "__main__":  # pragma: no cover - manual setup: python -m bench._scrapyd
    print(ensure_venv(), versions(venv_python()), file=sys.stderr)
