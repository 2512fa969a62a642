"""A node talking raw HTTP to the dev master, and nodes, spiders and tasks made straight in its store."""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from typing import Any

import httpx
import yaml

from ckagent.devmaster.client import AdminClient, zip_files
from ckagent.devmaster.packages import read_package
from ckagent.devmaster.store import Store
from ckagent.master.protocol import Heartbeat, PendingTasks, RegisterRequest


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def register_body(name: str) -> dict[str, Any]:
    """A node's registration body (JSON), as an agent named ``name`` sends it."""
    return {
        "name": name,
        "ip": "127.0.0.1",
        "port": 9000,
        "version": "0.1.0",
        "os": "linux",
        "arch": "x86_64",
        "python": "3.11.9",
        "cpuCount": 2,
        "memoryTotalBytes": 8 * 1024**3,
        "maxWorkers": 2,
        "runtimes": {"python": "3.11.9", "node": None},
        "labels": {"zone": "test"},
    }


HEARTBEAT = {
    "status": "RUNNING",
    "cpuPercent": 12.5,
    "memoryPercent": 40.0,
    "diskPercent": 50.0,
    "memoryUsedBytes": 1024,
    "diskFreeBytes": 4096,
    "load1": 0.5,
    "runningTaskIds": [],
    "runningSpiderIds": [],
    "maxWorkers": 2,
    "freeSlots": 2,
    "version": "0.1.0",
    "uptimeSeconds": 3.0,
}


@dataclass
class Node:
    """A registered node talking raw HTTP, as an agent would."""

    http: httpx.AsyncClient
    node_id: str
    api_key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def heartbeat(self, **changes: Any) -> httpx.Response:
        return await self.http.post(
            f"/api/nodes/{self.node_id}/heartbeat", json={**HEARTBEAT, **changes}, headers=self.auth
        )

    async def poll(
        self, *, limit: int = 10, wait: float = 0, exclude: list[str] | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit, "waitSeconds": wait}
        if exclude:
            params["excludeSpiderIds"] = ",".join(exclude)
        r = await self.http.get(f"/api/nodes/{self.node_id}/tasks/pending", params=params, headers=self.auth)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        parsed = PendingTasks.from_json(body)  # every task the master hands out must satisfy the protocol
        assert parsed.bad_tasks == []
        return body

    async def result(self, task_id: str, status: str, **fields: Any) -> httpx.Response:
        return await self.http.post(
            f"/api/tasks/{task_id}/result", json={"status": status, **fields}, headers=self.auth
        )

    async def claim(self, task_id: str) -> httpx.Response:
        return await self.result(task_id, "RUNNING", startedAt="2026-11-29T16:03:50.123Z")

    async def logs(self, task_id: str, seq: int, lines: list[str]) -> httpx.Response:
        return await self.http.post(
            f"/api/tasks/{task_id}/logs", json={"seq": seq, "lines": lines}, headers=self.auth
        )

    async def items(self, task_id: str, seq: int, items: list[dict[str, Any]]) -> httpx.Response:
        return await self.http.post(
            f"/api/tasks/{task_id}/items", json={"seq": seq, "items": items}, headers=self.auth
        )


async def register(http: httpx.AsyncClient, token: str, name: str = "node-a") -> Node:
    """Register a :class:`Node` named ``name`` with the master ``http`` talks to."""
    r = await http.post(
        "/api/nodes/register", json=register_body(name), headers={"X-Registration-Token": token}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return Node(http=http, node_id=body["nodeId"], api_key=body["apiKey"])


def make_zip(files: dict[str, bytes]) -> bytes:
    """A zip of ``files`` (path → bytes), in the order given."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return buffer.getvalue()


SPIDER_FILES = {"main.py": b"print('hello')\n", "pkg/util.py": b"X = 1\n", "requirements.txt": b""}


async def make_spider(admin: AdminClient, name: str = "demo", *, code_mode: str = "package") -> str:
    """A python spider with :data:`SPIDER_FILES` as its package; its id."""
    spider_id = await admin.create_spider(name, "python", command=["python", "main.py"], code_mode=code_mode)
    await admin.upload_package(spider_id, make_zip(SPIDER_FILES))
    return spider_id


def store_node(store: Store, name: str = "n1") -> str:
    """Register a node named ``name`` straight in the dev master's store; its id."""
    req = RegisterRequest(name=name, ip="127.0.0.1", port=9000, version="0", os="linux", arch="x86_64",
                          python="3.11", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2)
    return store.register_node(req)[0]


def heartbeat_of(running: list[str] | None = None, claiming: list[str] | None = None,
          reporting: list[str] | None = None) -> Heartbeat:
    """A RUNNING heartbeat (the wire type) reporting these running, claiming and reporting task ids."""
    return Heartbeat(status="RUNNING", cpu_percent=0, memory_percent=0, disk_percent=0, memory_used_bytes=0,
                     disk_free_bytes=0, load1=0, running_task_ids=running or [], running_spider_ids=[],
                     max_workers=2, free_slots=2, version="0", uptime_seconds=1,
                     claiming_task_ids=claiming, reporting_task_ids=reporting)


def store_spider(store: Store, name: str) -> str:
    """A python spider named ``name`` (its package: a main.py printing hi) straight in the dev master's
    store; its id."""
    spider_id = store.create_spider(name=name, framework="python", command=None, timeout_seconds=None,
                                    code_mode="package", env={})
    zipped = zip_files({"main.py": "print('hi')\n"})
    store.store_package(spider_id, read_package(zipped), zipped)
    return spider_id


def store_task(store: Store, spider_id: str) -> str:
    """A PENDING task of ``spider_id`` straight in the dev master's store; its id."""
    return store.create_task(spider_id, args=[], env={}, params={}, timeout_seconds=None)
