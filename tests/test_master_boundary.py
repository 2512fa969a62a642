"""The master boundary's classification, one class at a time (httpx.MockTransport, autojump clock):
every answer becomes one exception of the tree in ckagent/master/client.py, one metric outcome, one log line
per episode, and a cause /readyz can show. Plus the URL rules (relative package URLs, other origins).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from ckagent.master.client import (
    Connectivity,
    MasterClient,
    MasterConflict,
    MasterProtocolError,
    MasterRejected,
    MasterUnavailable,
    RegistrationRefused,
    Trouble,
)
from ckagent.master.endpoints import HEARTBEAT, LOGS, Retry
from ckagent.master.protocol import RegisterRequest, SeqAccepted

TOKEN = "reg-token-SECRET-0123456789"
KEY = "api-key-SECRET-4242"


def register_body() -> RegisterRequest:
    return RegisterRequest(name="n1", ip="127.0.0.1", port=9000, version="0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2)


class Recorder:
    """The observer hook: (endpoint, outcome) per attempt."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, str]] = []

    def __call__(self, endpoint: str, outcome: str, seconds: float) -> None:
        assert seconds >= 0
        self.outcomes.append((endpoint, outcome))


def client(answer: Callable[[httpx.Request], httpx.Response], base: str = "http://master.test",
           recorder: Recorder | None = None) -> MasterClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/api/nodes/register"):
            return httpx.Response(200, json={"nodeId": "n-1", "apiKey": KEY})
        return answer(request)

    return MasterClient(base, TOKEN, register_body, transport=httpx.MockTransport(handler), observer=recorder)


HTML = httpx.Response(200, headers={"content-type": "text/html"}, content=b"<html><body>portal</body></html>")

CLASSES: dict[str, tuple[Callable[[httpx.Request], httpx.Response], type[Exception], str, str]] = {
    # name: (answer, exception, metric outcome, words of the cause)
    "html": (lambda r: HTML, MasterProtocolError, "protocol_error",
             "master answers 200 text/html to heartbeat: not the node protocol (not JSON; "),
    "truncated": (lambda r: httpx.Response(200, headers={"content-type": "application/json"},
                                           content=b'{"cancelTaskIds": ["a'),
                  MasterProtocolError, "protocol_error", "truncated JSON"),
    "wrong_shape": (lambda r: httpx.Response(200, json={"cancelTaskIds": "all"}), MasterProtocolError,
                    "protocol_error", "wrong shape: cancelTaskIds"),
    "empty": (lambda r: httpx.Response(200), MasterProtocolError, "protocol_error", "wrong shape"),
    "not_an_object": (lambda r: httpx.Response(200, json=[1, 2]), MasterProtocolError, "protocol_error",
                      "wrong shape"),
    "redirect": (lambda r: httpx.Response(302, headers={"location": "http://portal.test/"}), MasterProtocolError,
                 "protocol_error", "not a 2xx answer"),
    "404_html": (lambda r: httpx.Response(404, headers={"content-type": "text/html"}, content=b"<h1>404</h1>"),
                 MasterProtocolError, "protocol_error", "master answers 404 text/html to heartbeat"),
    "429": (lambda r: httpx.Response(429, text="slow down"), MasterUnavailable, "429",
            "master unavailable (heartbeat: answered 429 text/plain"),
    "503": (lambda r: httpx.Response(503, text="down"), MasterUnavailable, "503", "answered 503"),
    "transport": (lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused", request=r)), MasterUnavailable,
                  "error", "master unreachable (heartbeat: ConnectError: refused"),
    "timeout": (lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("slow", request=r)), MasterUnavailable,
                "error", "ReadTimeout"),
    "403": (lambda r: httpx.Response(403, json={"error": "forbidden here"}), MasterRejected, "403",
            "master refuses heartbeat with 403 (forbidden here); that request fails"),
    "409": (lambda r: httpx.Response(409, json={"error": "not yours"}), MasterConflict, "409", ""),
    "bad_encoding": (lambda r: httpx.Response(200, headers={"content-encoding": "gzip"}, content=b"not gzip"),
                     MasterProtocolError, "protocol_error", "DecodingError"),
}


@pytest.mark.parametrize("name", list(CLASSES))
async def test_every_answer_is_classified_once(name: str, autojump_clock: Any,
                                               caplog: pytest.LogCaptureFixture) -> None:
    answer, exception, outcome, cause = CLASSES[name]
    recorder = Recorder()
    master = client(answer, recorder=recorder)
    caplog.set_level(logging.DEBUG, logger="ckagent.master.client")
    for _ in range(3):
        with pytest.raises(exception) as info:
            await master.call(HEARTBEAT, json={})
        assert type(info.value) is exception
    await master.aclose()
    assert recorder.outcomes[-3:] == [("heartbeat", outcome)] * 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "ckagent.master.client"]
    if name == "409":  # a conflict is the protocol's own answer: the caller's business, no trouble
        assert warnings == [] and master.connectivity.problem is None and master.connectivity.up
        return
    assert len(warnings) == 1 and cause in warnings[0], warnings  # one episode, not one line per attempt
    assert master.connectivity.problem is not None and cause in master.connectivity.problem
    assert TOKEN not in warnings[0] and KEY not in warnings[0]
    assert master.connectivity.up is (exception is MasterRejected)


async def test_an_episode_ends_once_with_the_first_success(autojump_clock: Any,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    answers = [HTML] * 4 + [httpx.Response(200, json={"acceptedSeq": 3})]
    master = client(lambda r: answers.pop(0))
    caplog.set_level(logging.INFO, logger="ckagent.master.client")
    accepted = await master.call(LOGS, {"task": "t"}, content=b"{}", retry=Retry())
    await master.aclose()
    assert accepted == SeqAccepted(3)
    messages = [r.getMessage() for r in caplog.records if "logs" in r.getMessage()]
    assert len(messages) == 2, messages
    assert messages[0].startswith("master answers 200 text/html to logs: not the node protocol")
    assert messages[1].startswith("master answers logs in the node protocol again after 4 failed attempts")
    assert master.connectivity.problem is None and master.connectivity.up


async def test_a_missing_accepted_seq_is_no_acknowledgement(autojump_clock: Any) -> None:
    master = client(lambda r: httpx.Response(200, json={"ok": True}))
    with pytest.raises(MasterProtocolError, match="acceptedSeq"):
        await master.post_stream("items", "t", b"{}")
    await master.aclose()


async def test_registration_401_names_the_token_setting_and_html_is_retried(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    answers = [httpx.Response(401, json={"error": "wrong token"})] * 3 + [HTML] * 2 + [
        httpx.Response(404, text="<h1>nginx</h1>", headers={"content-type": "text/html"}),
        httpx.Response(200, json={"nodeId": "n-9", "apiKey": KEY})]

    def handler(request: httpx.Request) -> httpx.Response:
        return answers.pop(0)

    master = MasterClient("http://master.test", TOKEN, register_body, transport=httpx.MockTransport(handler))
    caplog.set_level(logging.INFO, logger="ckagent.master.client")
    problems: list[str | None] = []

    async def watch() -> None:
        while True:
            problems.append(master.connectivity.problem)
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        answer = await master.register()
        nursery.cancel_scope.cancel()
    await master.aclose()
    assert answer.node_id == "n-9" and not answers
    assert any(p and p.startswith("registration refused: 401, check AGENT_REGISTRATION_TOKEN") for p in problems)
    assert any(p and p.startswith("master answers 200 text/html to register") for p in problems)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "ckagent.master.client"]
    assert len(warnings) == 3, warnings  # 401, then the portal page, then the ingress's 404: three episodes
    assert all(KEY not in m and TOKEN not in m for m in warnings)


async def test_a_registration_answer_is_never_quoted(autojump_clock: Any) -> None:
    answers = [httpx.Response(200, content=b'{"nodeId": "n", "apiKey": "fresh-key-0123456789"')]
    answers.append(httpx.Response(200, json={"nodeId": "n", "apiKey": KEY}))
    master = MasterClient("http://master.test", TOKEN, register_body,
                          transport=httpx.MockTransport(lambda r: answers.pop(0)))
    seen: list[str | None] = []
    master.connectivity.on_change = lambda up: seen.append(master.connectivity.problem)
    await master.register()
    await master.aclose()
    assert seen and seen[0] is not None and "truncated JSON" in seen[0] and "fresh-key" not in seen[0]


async def test_a_refusal_in_the_protocols_words_refuses_registration(autojump_clock: Any) -> None:
    master = MasterClient("http://master.test", TOKEN, register_body,
                          transport=httpx.MockTransport(lambda r: httpx.Response(403, json={"error": "banned"})))
    with pytest.raises(RegistrationRefused, match="banned"):
        await master.register()
    await master.aclose()


async def test_a_long_poll_sent_before_the_trouble_does_not_end_it(autojump_clock: Any) -> None:
    connectivity = Connectivity()
    sent = trio.current_time()
    await trio.sleep(1)
    connectivity.failed(Trouble("unavailable", "logs", "master unavailable (logs: 503)", ("down",)))
    connectivity.succeeded("poll", sent)  # held by the master since before the failure
    assert not connectivity.up and connectivity.problem == "master unavailable (logs: 503)"
    connectivity.succeeded("heartbeat", trio.current_time())
    assert connectivity.up and connectivity.problem is None


async def test_a_refusal_of_one_task_call_is_not_the_nodes_problem(autojump_clock: Any) -> None:
    connectivity = Connectivity()
    connectivity.failed(Trouble("rejected", "claim", "master refuses claim with 403", ("rejected", 403)))
    connectivity.failed(Trouble("rejected", "download", "master refuses download with 404", ("rejected", 404)))
    assert connectivity.problem is None and connectivity.up
    connectivity.failed(Trouble("rejected", "heartbeat", "master refuses heartbeat with 403", ("rejected", 403)))
    assert connectivity.problem == "master refuses heartbeat with 403"
    assert connectivity.problem_age() == 0


async def test_a_refusal_of_the_task_streams_is_named_the_data_waits_on_the_node(autojump_clock: Any) -> None:
    connectivity = Connectivity()
    connectivity.failed(Trouble("rejected", "logs", "master refuses logs with 404", ("rejected", 404)))
    assert connectivity.problem == "master refuses logs with 404" and connectivity.up  # reachable, refusing
    connectivity.succeeded("logs")
    assert connectivity.problem is None


async def test_one_endpoint_failing_while_others_answer_is_a_partial_outage(autojump_clock: Any) -> None:
    connectivity = Connectivity()
    trouble = Trouble("unreachable", "batches", "master unreachable (batches: ReadTimeout)", ("down",))
    sent = trio.current_time()
    await trio.sleep(1)
    connectivity.succeeded("heartbeat")  # sent after the batch: the master answers others
    await trio.sleep(1)
    connectivity.failed(trouble, sent)
    assert connectivity.problem is None  # once: a request that outlived an outage, old news
    sent = trio.current_time()
    await trio.sleep(1)
    connectivity.succeeded("heartbeat")
    connectivity.failed(trouble, sent)  # twice in a row: the task streams are out
    problem = connectivity.problem
    assert problem is not None and "a partial outage: task streams" in problem and connectivity.up
    connectivity.succeeded("items")  # the same class answers again
    assert connectivity.problem is None


# ---------------------------------------------------------------------------- URLs


async def test_relative_urls_resolve_against_server_url_with_its_prefix_and_carry_the_key(
    autojump_clock: Any
) -> None:
    seen: list[tuple[str, str | None]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get("authorization")))
        return httpx.Response(200, content=b"zip bytes")

    master = client(answer, base="https://gateway.test/crawler")
    chunks: list[bytes] = []

    async def sink(chunk: bytes) -> None:
        chunks.append(chunk)

    assert await master.download_package("/api/packages/s1/v1.zip", sink) == 9
    await master.aclose()
    assert seen == [("https://gateway.test/crawler/api/packages/s1/v1.zip", f"Bearer {KEY}")]


@pytest.mark.parametrize("status", [401, 403])
async def test_another_origins_refusal_is_reported_as_what_it_is(status: int, autojump_clock: Any) -> None:
    registrations = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal registrations
        if request.url.path.endswith("/register"):
            registrations += 1
            return httpx.Response(200, json={"nodeId": "n-1", "apiKey": KEY})
        assert "authorization" not in request.headers  # no key for another origin
        return httpx.Response(status, content=b"<Error><Code>AccessDenied</Code></Error>",
                              headers={"content-type": "application/xml"})

    master = MasterClient("http://master.test", TOKEN, register_body, transport=httpx.MockTransport(handler))

    async def sink(chunk: bytes) -> None:
        raise AssertionError("no body expected")

    with pytest.raises(MasterRejected) as info:
        await master.download_package("https://bucket.storage.test/pkg.zip", sink)
    await master.aclose()
    message = str(info.value)
    assert f"https://bucket.storage.test answered {status}" in message
    assert "not the master's origin (http://master.test), so no API key was sent" in message
    assert "revoked" not in message and "register" not in message
    assert registrations == 1  # no re-registration for someone else's 401
