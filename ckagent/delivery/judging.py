"""How the master's error to a batch moves a stream (the stream shipper's answers: ckagent.delivery.shipper).

:class:`AnswerJudge` is the part of :class:`~ckagent.delivery.shipper.StreamShipper` that reads a
:class:`~ckagent.master.client.MasterError`: transport trouble, 429 and 5xx are retried; a 409 with
``expectedSeq`` moves the stream to the master's position; a 409 with ``supersededBy`` (an attempt the
master moved on from: docs/protocol.md, "Attempts") ends it for good, sending nothing more; any other 409
refuses the stream; a 413 shrinks the batches; a 422 naming an element replaces it; other 4xx are retried
until ``refusal_timeout`` says the master means it. Pure logic on the exception and the shipper's state.
"""

from __future__ import annotations

import logging

import trio

from ckagent.delivery.flight import RETRY, Answer, refused_element
from ckagent.master.client import MasterConflict, MasterError, MasterRejected, MasterUnavailable

log = logging.getLogger("ckagent.delivery.shipper")

PASSING_REFUSALS = frozenset({401, 408})
"""4xx answers that never end a stream, however long they last: 401 (the client registers again;
a node-wide matter) and 408 (the request's own time-out)."""


class AnswerJudge:
    """The shipper's reading of the master's errors (see the module docstring); the attributes are the
    shipper's."""

    task_id: str
    stream: str
    refusing_since: float | None
    _key: str
    _refusal_timeout: float
    _lone_too_large: bool
    seq_start: int

    def local(self, seq: int) -> int:
        """The spool's count for the master's ``seq`` (the wire's numbers start at :attr:`seq_start`)."""
        return max(0, seq - self.seq_start)

    def _judge(self, exc: MasterError, seq: int, count: int) -> Answer | None:
        """What the master's ``exc`` to a batch of ``count`` elements from ``seq`` means for the
        stream: an answer that moves it, a retry after a backoff (kind "retry"), or None (not a
        batch's answer: RegistrationRefused)."""
        if isinstance(exc, MasterUnavailable):  # MasterProtocolError too: a 2xx without acceptedSeq is none
            return Answer("retry", retry_after=exc.retry_after)
        if isinstance(exc, MasterConflict):
            body = exc.body if isinstance(exc.body, dict) else {}
            superseded = body.get("supersededBy")
            if isinstance(superseded, int) and not isinstance(superseded, bool):
                log.warning("task %s %s: %s; this attempt's stream ends here", self.task_id, self.stream, exc)
                return Answer("superseded", superseded)
            expected = body.get("expectedSeq")
            if isinstance(expected, int) and expected >= 0:
                expected = self.local(expected)
                log.info("task %s %s: master expects element %d (sent %d)", self.task_id, self.stream,
                         expected, seq)
                return Answer("expected", expected)
            log.error("task %s %s: the master refuses the stream (%s); not sending it any more; the "
                      "result will say incomplete", self.task_id, self.stream, exc)
            return Answer("refused", reason=str(exc))
        if isinstance(exc, MasterRejected):
            return self._refusal(exc, count) or RETRY
        return None

    def _refusal(self, exc: MasterRejected, count: int) -> Answer | None:
        """What a 4xx (not 409) to the batch means: an answer that moves the stream, or None (retry)."""
        now = trio.current_time()
        if self.refusing_since is None:
            self.refusing_since = now
        lasted = now - self.refusing_since
        if exc.status == 413 and count == 1:
            self._lone_too_large = True
        if exc.status == 413 and count > 1:
            log.warning("task %s %s: the master finds a batch of %d elements too large (413); sending it smaller",
                        self.task_id, self.stream, count)
            return Answer("shrink")
        index = refused_element(exc, self._key, count)
        if index is not None:
            return Answer("element", index)
        if lasted >= self._refusal_timeout:
            if exc.status == 413:  # count == 1: this element, not the batch size
                return Answer("shrink")
            if exc.status not in PASSING_REFUSALS:
                log.error("task %s %s: the master has refused the stream for %.0f s (%s; server.refusal_timeout); "
                          "not sending it any more; the result will say incomplete, with that reason; the spool "
                          "stays on the node", self.task_id, self.stream, lasted, exc)
                return Answer("refused", reason=f"{exc} for {lasted:.0f} s")
        # Not (yet) the master's word to drop anything (a 404 of a master restarting, a 403 for a
        # moment, 401 until registered again, 408, a lone 413 for a moment, ...): the batch is retried
        # with backoff; logged once per episode by the client.
        return None
