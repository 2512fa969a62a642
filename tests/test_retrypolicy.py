"""The reference master's retry decision (ckagent.devmaster.retrypolicy): a table of cases and properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckagent.devmaster.retrypolicy import MAX_UNCOUNTED_IN_A_ROW, Decision, Ending, Policy, decide
from ckagent.master.protocol import CAUSE_CLASSES, ERROR_CODES, RetryPolicy, cause_of

POLICY = Policy(max_attempts=3, backoff_seconds=10.0, factor=2.0, on=frozenset({"resource"}),
                exit_codes=frozenset({3}))


def failed(code: str, exit_code: int | None = None, **changes: object) -> Ending:
    cause, retryable = cause_of(code)
    fields: dict[str, object] = {"status": "FAILED", "error_code": code, "exit_code": exit_code,
                                 "cause_class": None if cause is None else cause.value, "retryable": retryable}
    fields.update(changes)
    return Ending(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("ending", "counted_before", "expected"), [
    (Ending(status="SUCCESS"), 0, (False, True, 0.0)),
    (Ending(status="CANCELLED", error_code="CANCELLED"), 0, (False, True, 0.0)),
    (failed("TIMEOUT", cancel_requested=True), 0, (False, True, 0.0)),  # a cancel asked: final
    (failed("BAD_TASK"), 0, (False, True, 0.0)),  # never retryable
    (failed("EXIT_NONZERO", 1, retryable=False), 0, (False, True, 0.0)),  # retryable false: never
    (failed("NODE_LOST"), 0, (True, False, 0.0)),  # disruption: at once, not counted
    (failed("MIGRATED"), 2, (True, False, 0.0)),  # ... whatever was counted before
    (failed("AGENT_LOST"), 5, (True, False, 0.0)),
    (failed("MEMORY_LIMIT", checkpointed=True), 2, (True, False, 0.0)),  # resumes: not counted
    (failed("MEMORY_LIMIT"), 0, (True, True, 10.0)),  # no checkpoint of its own: resource, counted
    (failed("OOM_KILLED"), 0, (True, True, 10.0)),  # class in on: backoff × factor^0
    (failed("TIMEOUT"), 1, (True, True, 20.0)),  # the second counted attempt: × factor^1
    (failed("STALLED"), 2, (False, True, 0.0)),  # the third of maxAttempts 3: final
    (failed("EXIT_NONZERO", 3), 0, (True, True, 10.0)),  # an exit code listed
    (failed("EXIT_NONZERO", 4), 0, (False, True, 0.0)),  # not listed, spider not in on
    (failed("SIGNALED", -11), 0, (False, True, 0.0)),
    (failed("DEPS_FAILED"), 0, (False, True, 0.0)),  # setup not in on
])
def test_the_decision_table(ending: Ending, counted_before: int, expected: tuple[bool, bool, float]) -> None:
    decision = decide(POLICY, ending, counted_before=counted_before, uncounted_in_a_row=0)
    assert (decision.again, decision.counted, decision.delay_seconds) == expected, decision.why
    assert decision.why


def test_the_default_policy_retries_disruptions_only() -> None:
    default = Policy.from_stored(None)
    assert default == Policy()
    assert decide(default, failed("NODE_LOST"), counted_before=0, uncounted_in_a_row=0).again
    assert not decide(default, failed("OOM_KILLED"), counted_before=0, uncounted_in_a_row=0).again
    assert not decide(default, failed("EXIT_NONZERO", 1), counted_before=0, uncounted_in_a_row=0).again


def test_at_most_25_uncounted_attempts_in_a_row() -> None:
    assert decide(POLICY, failed("NODE_LOST"), counted_before=0, uncounted_in_a_row=MAX_UNCOUNTED_IN_A_ROW - 2).again
    last = decide(POLICY, failed("NODE_LOST"), counted_before=0, uncounted_in_a_row=MAX_UNCOUNTED_IN_A_ROW - 1)
    assert not last.again and "25" in last.why


def test_the_stored_wire_policy_reads_back() -> None:
    wire = RetryPolicy.from_json({"maxAttempts": 4, "backoffSeconds": 0, "factor": 3, "on": ["spider"],
                                  "exitCodes": [2, 7]})
    assert wire is not None
    assert Policy.from_stored(wire.to_json()) == Policy(max_attempts=4, backoff_seconds=0.0, factor=3.0,
                                                        on=frozenset({"spider"}), exit_codes=frozenset({2, 7}))


policies = st.builds(
    Policy, max_attempts=st.integers(1, 50), backoff_seconds=st.floats(0, 1e6), factor=st.floats(1, 1e3),
    on=st.frozensets(st.sampled_from(CAUSE_CLASSES)), exit_codes=st.frozensets(st.integers(-255, 255)))
endings = st.builds(
    Ending, status=st.sampled_from(["SUCCESS", "FAILED", "CANCELLED"]),
    error_code=st.none() | st.sampled_from(ERROR_CODES), exit_code=st.none() | st.integers(-255, 255),
    cause_class=st.none() | st.sampled_from(CAUSE_CLASSES), retryable=st.booleans(), checkpointed=st.booleans(),
    cancel_requested=st.booleans())


@given(policies, endings, st.integers(0, 100), st.integers(0, 100))
def test_properties_of_every_decision(policy: Policy, ending: Ending, counted_before: int, in_a_row: int) -> None:
    d: Decision = decide(policy, ending, counted_before=counted_before, uncounted_in_a_row=in_a_row)
    if ending.status != "FAILED" or ending.cancel_requested or not ending.retryable:
        assert not d.again  # SUCCESS, CANCELLED, a cancel asked, retryable false: final
    if d.again and d.counted:
        assert counted_before + 1 < policy.max_attempts  # maxAttempts honoured
        assert 0 <= d.delay_seconds <= 7 * 24 * 3600
    if d.again and not d.counted:
        assert d.delay_seconds == 0 and in_a_row + 1 < MAX_UNCOUNTED_IN_A_ROW
    if ending.cause_class == "disruption" and ending.retryable and ending.status == "FAILED" \
            and not ending.cancel_requested:
        assert not d.counted  # disruptions never count
