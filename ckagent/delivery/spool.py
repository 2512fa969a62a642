"""Limits and file names of a task's spool (shared by every part of delivery)."""

from __future__ import annotations

MAX_LINE_BYTES = 64 * 1024
"""Longest log line (bytes); longer ones are cut into pieces."""
MAX_ITEM_BYTES = 16 * 1024 * 1024
"""Longest items.jsonl line (bytes) read as one item."""
MAX_BATCH_BYTES = 1024 * 1024
"""Most JSON bytes of elements in one batch (one larger element travels alone)."""
MAX_BATCH_COUNT = 5000
"""Most elements in one batch."""
BATCH_AGE = 1.0
"""Seconds a non-full batch may wait for more elements before it is sent."""
TAIL_INTERVAL = 0.25
"""Seconds between looks at a file written by another process (items, spider log files)."""
SCAN_INTERVAL = 1.0
"""Seconds between looks for new or grown spider log files."""
READ_CHUNK = 256 * 1024
"""Bytes read from a spool file at a time."""
SEND_CONCURRENCY = 8
"""Tasks of the outbox that may have a request in flight at the same time."""
BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 30.0
EARLY_RETRY_AFTER = 1.0
"""Seconds in backoff after which a shipper retries at once if the master was seen reachable again."""
MAX_LOG_SOURCES = 64
"""Most spider log files tailed for one task (more are ignored, with a notice in the agent log)."""
CHECKPOINTS_KEPT = 64

OUTPUT_LOG = "output.log"
ITEMS_FILE = "items.jsonl"
JOURNAL_FILE = "output.journal"
AGENT_FILES = frozenset({OUTPUT_LOG, ITEMS_FILE, JOURNAL_FILE})
DEFAULT_LOG_GLOBS: tuple[str, ...] = ("*.log",)


