"""The settings table in the docs: ``python -m ckagent.node.configdocs README.md docs/configuration.md``.

Without arguments it prints the Markdown table of :data:`ckagent.node.configschema.SETTINGS`; with
files it rewrites the block between :data:`TABLE_START_MARKER` and :data:`TABLE_END_MARKER` in each
(tests/test_config.py fails when a file's block is out of date).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ckagent.node.configschema import SETTINGS

__all__ = ["TABLE_END_MARKER", "TABLE_START_MARKER", "main", "replace_marked_block", "settings_markdown_table"]

TABLE_START_MARKER = "<!-- config-table:start -->"
TABLE_END_MARKER = "<!-- config-table:end -->"


def settings_markdown_table() -> str:
    """The settings table in Markdown (key | env var | type | default | meaning), ending with a newline."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| key | env var | type | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        lines.append(
            f"| `{s.dotted}` | `{s.env}` | {cell(s.type_doc)} | {cell(s.default_doc)} | {cell(s.doc)} |"
        )
    return "\n".join(lines) + "\n"


def replace_marked_block(text: str, block: str) -> str:
    """Return ``text`` with the part between the config-table markers replaced by ``block``.

    Raises ValueError when the markers are missing or out of order.
    """
    start = text.find(TABLE_START_MARKER)
    end = text.find(TABLE_END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"markers {TABLE_START_MARKER} ... {TABLE_END_MARKER} not found")
    head = text[: start + len(TABLE_START_MARKER)]
    return f"{head}\n{block}{text[end:]}"


def main(argv: list[str]) -> int:
    """``python -m ckagent.node.configdocs [FILE...]``: print the table, or rewrite the marked block in FILEs."""
    table = settings_markdown_table()
    if not argv:
        sys.stdout.write(table)
        return 0
    for name in argv:
        file = Path(name)
        file.write_text(replace_marked_block(file.read_text(encoding="utf-8"), table), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
