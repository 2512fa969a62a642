"""What the master answered to a registration, classified (the registration half of
:class:`ckagent.master.client.MasterClient`, which sends it and retries).

- 2xx in the protocol's words → :class:`~ckagent.master.protocol.RegisterResponse`;
- 401 → MasterUnavailable, retried: the registration token is not accepted (yet); /readyz says so;
- 409 → :class:`~ckagent.master.errors.NameHeld` (a MasterUnavailable), retried with backoff of at most
  REGISTER_WAIT_MAX seconds: another live agent (another ``nodeUid``) holds the node's name. One WARNING
  line with the master's reason when the wait starts, one INFO line when it ends; meanwhile /readyz and
  /status say ``waiting for the name NAME: another agent holds it (…)``. A pod rescheduled with a fresh
  work dir waits here until the earlier pod's heartbeats are old (the reference master: 90 s) — or not at
  all with ``agent.name_exclusive`` (``nameExclusive``: the master hands the name over at once);
- another 4xx in the protocol's words → RegistrationRefused (the agent exits 1: its configuration is
  wrong); one that is not (a proxy's page) → MasterProtocolError, retried;
- 429, 5xx and transport errors never reach here (the sender raised MasterUnavailable).
"""

from __future__ import annotations

import httpx

from ckagent.master.answers import Answers, sent_at
from ckagent.master.errors import (
    MasterUnavailable,
    NameHeld,
    RegistrationRefused,
    error_text,
    in_protocol_words,
    json_or_none,
    redact,
)
from ckagent.master.protocol import RegisterResponse

REGISTER_WAIT_MAX = 30.0
"""Seconds, the longest pause between two registration attempts (server.max_backoff_interval, if lower)."""


def registration_answer(answers: Answers, response: httpx.Response, name: str, exclusive: bool = False) -> RegisterResponse:
    """Classify the master's ``response`` to the registration of the node ``name`` (``exclusive``: it said
    ``nameExclusive``) (module docstring):
    returns the answer, or raises MasterUnavailable/NameHeld (retry), MasterProtocolError (retry) or
    RegistrationRefused (final). Every failure is recorded in the answers' connectivity (one log line
    per episode); no message quotes the token or a key."""
    status = response.status_code
    if status == 401:
        answers.observe("register", "401", response)
        answers.trouble("unauthorized", "register", ("unauthorized",), sent_at(response),
                        "registration refused: 401, check AGENT_REGISTRATION_TOKEN (the master does not "
                        "accept this node's registration token)")
        raise MasterUnavailable("register: registration token not accepted (401)")
    if 400 <= status < 500 and status != 429:
        if not in_protocol_words(json_or_none(response)):
            answers.not_protocol("register", response, 'an error without the protocol\'s {"error": …} body')
        answers.observe("register", str(status), response)
        reason = redact(error_text(response), answers.secrets())
        if status == 409:
            text = f"waiting for the name {name}: another agent holds it (the master: {reason})"
            if exclusive:
                text += ("; agent.name_exclusive is on, yet the master did not hand the name over: a master that"
                         " ignores nameExclusive, or one that took the name from this agent for another")
            answers.trouble("name", "register", ("name", name), sent_at(response), text)
            raise NameHeld(text, name)
        answers.connectivity.succeeded("register", sent_at(response))
        raise RegistrationRefused(
            f"the master refused registration with {status}: {reason}; "
            "check server.url and the agent section of the config"
        )
    return answers.answer("register", response, RegisterResponse.from_json)
