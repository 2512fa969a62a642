"""A task's final result to the master: sent until acknowledged, then marked so in the state store.

See the package docstring (ckagent.delivery) for the whole design.
"""

from __future__ import annotations

import contextlib
import logging

import trio

from ckagent.delivery.spool import DEFAULT_REFUSAL_TIMEOUT
from ckagent.delivery.waiting import Backoff
from ckagent.master.client import MasterClient, MasterConflict, MasterRejected, MasterUnavailable
from ckagent.master.protocol import TaskResult
from ckagent.node.state import AsyncStateStore, StateStoreError

log = logging.getLogger(__name__)


async def send_result(
    master: MasterClient, store: AsyncStateStore, task_id: str, result: TaskResult,
    limiter: trio.CapacityLimiter | None = None, refusal_timeout: float = DEFAULT_REFUSAL_TIMEOUT,
    *, mark: bool = True,
) -> None:
    """Send a final result until the master acknowledges it (forever, with backoff), then mark it acked
    (without ``mark``: the caller does, e.g. with others in one write; a StateStoreError of the mark is logged).

    A 409 or 422 (in the protocol's words) means the master will never take it (cancelled there,
    claimed by another node, invalid): logged, and marked done so it is not retried across restarts;
    so is a 404 ("unknown task") that lasts longer than ``refusal_timeout`` seconds (a master
    restarting behind a proxy answers 404 for a moment). Any other answer — an answer that is not
    the protocol's (MasterProtocolError), another 4xx — is not an acknowledgement: retried with
    the master client's backoff (:class:`ckagent.delivery.waiting.Backoff`: stamina's; a 429/503's
    ``Retry-After`` when it says one). Cancellation stops the retries; the result
    stays in the state store for the next start.
    """
    backoff = Backoff(master)
    refused_since: float | None = None
    again = backoff.wait

    while True:
        try:
            async with limiter if limiter is not None else contextlib.nullcontext():
                await master.report_result(task_id, result)
            break
        except MasterUnavailable as exc:  # MasterProtocolError too: an HTML page is not an acknowledgement
            await again(exc.retry_after)
        except MasterConflict as exc:
            superseded = getattr(exc, "superseded_by", None)  # (wire's MasterConflict.superseded_by)
            if superseded is not None:  # (a cancel of a node the master declared lost: it has moved on)
                log.info("task %s: the master moved this task on to attempt %d: this attempt's result %s is "
                         "not the task's and is dropped", task_id, superseded, result.status)
            else:
                log.warning("task %s: master refused the final result %s (%s)", task_id, result.status, exc)
            break
        except MasterRejected as exc:
            now = trio.current_time()
            refused_since = now if refused_since is None else refused_since
            if exc.status == 422 or (exc.status == 404 and now - refused_since >= refusal_timeout):
                log.error("task %s: master rejected the final result (%s)", task_id, exc)
                break
            await again()  # 404 for a moment, 401 after re-registering, 403, 408, ...: retried
    if not mark:
        return
    try:
        await store.mark_result_acked(task_id)
    except StateStoreError as exc:  # the next start sends it again; the master answers a repeat as such
        log.error("task %s: the master has its result, but %s", task_id, exc)

