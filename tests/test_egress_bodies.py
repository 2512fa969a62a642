"""Large bodies through the egress proxy: an answer of known length of 1 MiB or more passes from
socket to socket (splice), a tunnel moves to splice after its first MiB — every byte arrives, in
order, from the host asked, and the connections go on being kept alive after (issue 34, items 1 and 7).
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
from harness import WebHosts, page_bytes, web_hosts

from ckagent.containment.egress import open_egress, parse_text

SIZES = (1048576, 3 * 1048576 + 12345)
"""At the pass-by threshold, and past it with a tail that is no multiple of any buffer."""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebHosts]:
    with web_hosts(tmp_path_factory.mktemp("bodies")) as running:
        yield running


async def _task_url(nursery: trio.Nursery) -> str:
    egress = open_egress("proxy", None, "ckagent_bodies_test", parse_text("metadata,link-local", ""))
    await nursery.start(egress.serve)
    rules = await trio.to_thread.run_sync(egress.attach, None, "bodies")
    return egress.task_env(rules)["HTTP_PROXY"]


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_large_bodies_arrive_whole_and_the_connection_goes_on(
    nursery: trio.Nursery, hosts: WebHosts, scheme: str, tmp_path: Path
) -> None:
    url = await _task_url(nursery)
    context = ssl.create_default_context(cafile=str(hosts.ca_file))
    with trio.fail_after(60):
        async with httpx.AsyncClient(proxy=url, verify=context) as client:
            seen = []
            for size in SIZES:
                for name in ("a", "b"):
                    host = hosts[name]
                    answer = await client.get(host.url(scheme, f"/bytes/{size}"))
                    assert answer.status_code == 200
                    expected = page_bytes(host.origin(scheme), size)
                    assert len(answer.content) == size
                    assert hashlib.sha256(answer.content).digest() == hashlib.sha256(expected).digest()
                    echo = (await client.get(host.url(scheme, "/echo/after"))).json()  # the same connection, kept
                    assert echo["identity"]["origin"] == host.origin(scheme)
                    seen.append((name, echo["connection"]["serial"]))
            head = await client.head(hosts["a"].url(scheme, f"/bytes/{SIZES[1]}"))
    assert head.status_code == 200 and head.headers["content-length"] == str(SIZES[1]) and not head.content
    # Each host served every request on one connection: the passed bodies left the pooled ones usable.
    assert len({serial for name, serial in seen if name == "a"}) == 1
    assert len({serial for name, serial in seen if name == "b"}) == 1
