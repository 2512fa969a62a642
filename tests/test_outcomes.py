"""The outcome table of docs/protocol.md is the one the code uses (ERROR_CODES, OUTCOME_STATUS)."""

from __future__ import annotations

import re
from pathlib import Path

from ckagent.master.protocol import ERROR_CODES, FINAL_STATUSES, OUTCOME_STATUS

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def doc_outcomes() -> dict[str, str]:
    """{code: status} from the rows between the outcomes markers of docs/protocol.md."""
    text = DOC.read_text(encoding="utf-8")
    block = text[text.index("<!-- outcomes:start -->"):text.index("<!-- outcomes:end -->")]
    rows: dict[str, str] = {}
    for line in block.splitlines():
        match = re.match(r"^\| `([A-Z_]+)` \| ([A-Z]+) \|", line)
        if match:
            assert match[1] not in rows, f"{match[1]} twice in the outcome table"
            rows[match[1]] = match[2]
    return rows


def test_docs_outcome_table_equals_the_code() -> None:
    assert doc_outcomes() == OUTCOME_STATUS
    assert list(OUTCOME_STATUS) == ["SUCCESS", *[c for c in OUTCOME_STATUS if c != "SUCCESS"]]
    assert set(OUTCOME_STATUS) == {"SUCCESS", *ERROR_CODES}
    assert set(OUTCOME_STATUS.values()) <= set(FINAL_STATUSES)


def test_issue_codes_are_all_there() -> None:
    for code in ("SUCCESS", "EXIT_NONZERO", "SIGNALED", "TIMEOUT", "CANCELLED", "STALLED", "OOM_KILLED",
                 "LOG_BUDGET", "DEPLOY_FAILED", "DEPS_FAILED", "AGENT_LOST"):
        assert code in OUTCOME_STATUS
