"""The dev master's --discard-logs: log batches are acknowledged by the seq rules, counted and hashed,
not stored (a master that keeps up, for bench.flood); the digest of a storing master hashes its lines."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

import httpx
import trio
from harness import make_spider, register

from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.server import DevMasterConfig, serve


def sha(lines: list[str]) -> str:
    return hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()


async def test_discarded_logs_keep_the_seq_rules_count_and_hash(nursery: trio.Nursery, tmp_path: Path) -> None:
    for discard in (True, False):
        config = DevMasterConfig(db_path=tmp_path / f"m-{discard}.sqlite", registration_token=secrets.token_urlsafe(16),
                                 admin_token=secrets.token_urlsafe(16), port=0, discard_logs=discard)
        with trio.fail_after(20):
            base_url = await nursery.start(serve, config)
            async with AdminClient(base_url, config.admin_token) as admin, \
                    httpx.AsyncClient(base_url=base_url, timeout=10) as http:
                spider = await make_spider(admin, "flood")
                task_id = await admin.create_task(spider)
                node = await register(http, config.registration_token)
                assert (await node.claim(task_id)).status_code == 200
                assert (await node.logs(task_id, 0, ["a", "b", "c"])).json() == {"acceptedSeq": 3}
                assert (await node.logs(task_id, 1, ["b?", "c?", "d"])).json() == {"acceptedSeq": 4}  # d is new
                gap = await node.logs(task_id, 9, ["x"])
                assert gap.status_code == 409 and gap.json()["expectedSeq"] == 4
                assert (await node.logs(task_id, 4, ["✓ ünïcode"])).json() == {"acceptedSeq": 5}
                digest = await admin.get_log_digest(task_id)
                assert digest == {"count": 5, "sha256": sha(["a", "b", "c", "d", "✓ ünïcode"]), "discarded": discard}
                assert (await admin.get_task(task_id))["storedLogLines"] == 5
                assert await admin.get_logs(task_id) == ([] if discard else ["a", "b", "c", "d", "✓ ünïcode"])
