"""Durable delivery: a task's files are the spool; the outbox ships them to the master exactly once.

Files of a task (``work_dir/tasks/<task-id>/``)::

    output.log       stdout + stderr bytes as received (LogSink), plus the agent's notices
    items.jsonl      one JSON object per line, written by the spider (the SDK)
    *.log ...        the spider's own log files (globs: ``task.log_files`` + the task's ``params.logFiles``)
    output.journal   the order in which the log sources' bytes enter the task's ONE log stream
    items.journal    with declared item files only: the same for the items stream (items.jsonl and
    item-files/*     the hard links of the declared JSON Lines files; :mod:`.outputs.live`)

**One log stream, several sources.** The master numbers a task's log lines with one ``seq`` space,
so lines of the spider's log files must be merged with stdout/stderr in an order that is the same
every time it is computed — after a crash too — or a resend could drop or repeat lines. The agent
therefore writes that order down: the *journal* is an append-only text file of small records::

    S <idx> <path>    source <idx> is the file <path> (relative to the task dir; 0 = output.log)
    D <idx> <size>    the stream continues with source <idx>'s bytes up to offset <size>
    F <idx>           source <idx> is complete: its unterminated last line becomes a line
    E                 the stream is complete

Every source is cut into lines by its own :class:`LineSplitter`; the log stream is the lines in the
order the journal feeds the bytes. Lines of a spider log file are marked with their source:
``[scrapy.log] <line>``; stdout/stderr lines are not marked. The journal is the only writer's
decision; readers replay it, so the stream is a pure function of the files. Positions stored in the
state store are ``{"j": <journal offset of the record being replayed>, "p": {<idx>: <end offset of
the source's last acknowledged line>}}``; the items stream is one file (``{"offset": n}``), or,
for a task that declares item files, ``items.journal``'s replay (positions as the log's).

**Lines.** Splitting works on bytes, so offsets stay exact: a line ends at ``\\n``, ``\\r\\n`` or a
lone ``\\r`` (progress bars become lines instead of one endless line); a line longer than
``max_line_bytes`` (64 KiB) is cut into pieces at a UTF-8 character boundary. Bytes are decoded only
once a line is complete (a character split across reads stays whole), as UTF-8 with replacement
(invalid bytes become U+FFFD, never an exception). Values of secrets are masked (``***``) per line
or piece (a secret cut by a 64 KiB piece boundary is not recognised); one shorter than 8 characters
only where it stands alone (:class:`ckagent.node.logs.Masker`, the agent log's rule too).

**Shipping** (:class:`StreamShipper`): read from the acknowledged position, cut batches (≤ 5000
elements, ≤ 1 MiB of JSON, or 0.7 s old for lines, 1 s for items), POST ``{seq, lines|items}``, store the new position only
after an acknowledgement in the protocol's own words — a 200 whose body is ``{"acceptedSeq": n}``
(saved while the next batch is on its way; a 2xx without it is a protocol error, retried) — one
request at a time per stream. Each
element is encoded to JSON once, when it is read (:func:`encode_lines`; printable-ASCII lines are
never decoded): a batch body is the elements joined, and its size is exact. The master answers with the count it holds; a 409
``{expectedSeq}`` rewinds (to an in-memory checkpoint, or the start) or skips what it already has.
A 413 halves the batch (it grows back after a run of acknowledgements); only a 422 whose
``field`` names an element (``items[i]``/``lines[i]``) replaces that element by a short placeholder
(a gap would block the stream forever). A 409 without ``expectedSeq`` ends the stream; another 4xx in
the protocol's words (a 404 "unknown task", 403, 400, …; not 401, 408) or a lone element's 413 that
lasts longer than ``server.refusal_timeout`` ends the stream, or replaces the element, and the final
result says ``incomplete: true`` with the master's reason (``incompleteReason``). Every other answer
(transport errors, 429/5xx — after their ``Retry-After`` —, a 2xx that is not the protocol's, a 4xx
for a shorter while) is retried with backoff: a refusal never drops what the spider produced.

**The outbox** (:class:`Outbox`, one per agent, in the agent's root nursery) owns every task's
delivery (:class:`TaskDelivery`, :mod:`ckagent.delivery.taskdelivery`): the journal writer (:mod:`ckagent.delivery.journal`), the two shippers, live stats and, once both streams are complete, the final result
(stored first, sent last, retried with exponential backoff and jitter until acknowledged). A task's
delivery is **one Trio task**: one loop steps its journal, both shippers and live stats, and sleeps
on one waker (:class:`ckagent.delivery.waiting.Waker`) that every notification sets; a batch in a
node batch has no task of its own, a per-task post or a retry after a backoff runs in that loop's
nursery while it lasts. Its thread hops: one to open it (the task's record, journals, output.log),
one at the process's end (the runner's result stored, the end's reads), one to store the result as
sent (with the streams' last positions) before sending it; its acknowledgement is marked in the
outbox's next once-a-second round (a crash before that only makes the next start send it again). A task's
worker slot is free as soon as its process has ended; delivery goes on without it. On start the
agent hands unfinished deliveries from the state store to the outbox (:meth:`Outbox.resume`).
Requests are sent by at most ``SEND_CONCURRENCY`` tasks at a time; a shipper waiting in backoff
retries early (after ≥ 1 s) when another request has found the master reachable again.

**Node batches** (:mod:`ckagent.delivery.nodebatch`): when the master's registration answer offers
``node-batches``, the shippers hand their batches to the outbox's :class:`NodeBatcher`, which sends
whatever is queued — many tasks' log and item batches — in one ``POST /api/nodes/{id}/batches``
(two sender loops of the node: at most two at a time; a lone batch goes at once). Each batch gets its own answer, handled exactly
as above; a log batch then waits only 0.3 s for more lines (the request is shared). A batch's age is
its oldest pending element's.

**Wake-ups of a running task**: output.log's growth wakes the delivery's loop to journal it (the
sink's callback); the outbox's once-a-second round (only while a delivery is open: one thread hop
for every task) stats the spider log files, items.jsonl and the stats file and wakes a task's loop
only when one of them changed. A task that writes nothing does not wake its loop (the shippers'
NOTIFY_FALLBACK safety net aside).

**Log budget** (:class:`LogSink`): output.log stops growing at ``task.max_log_bytes``; the pipes
are still drained (the spider never blocks) and one marker line at the end says how many bytes were
dropped. The spider's own files (items, log files) are not the agent's to cut, and nothing is cut
for a low or full disk.

**A full disk** (:mod:`ckagent.delivery.diskwatch`, :mod:`ckagent.node.diskfull`): each running task's
disk use (task dir, working copy, data dir) is measured at every look of the disk loop; below the
floor the task over its share is stopped (FAILED DISK_FULL), also at its end when it was too fast
for the looks, and its scratch removed once its result is recorded (ckagent.task.diskshare). The
agent's writes that must go on — the state store, the journals, a neighbour's appended spool files
— use space they own beforehand (free pages, blocks held beyond a file's end), which no spider can
take; what still cannot be written waits in memory for room.

**Retention** (:mod:`ckagent.delivery.retention`): a task's directory is deleted only after its result was
acknowledged (which happens only after both streams were), and ``task.retention`` seconds later.

Errors: shipping never raises for master trouble (MasterUnavailable is retried until cancelled;
the stored position lets the next start resume). Nothing here raises into the agent for a
task's data: an unexpected bug in one task's delivery is logged and that task is left in the
state store for the next start. ``OSError`` writing output.log truncates it (marker) instead of
failing the task.

The package also holds what feeds the streams: :mod:`.outputs` (the files a task wrote: items,
artifacts, kept), :mod:`.crawlstats` (the crawl's stats file), :mod:`.activity` (a task's signs of
life, recorded for the runner's stall watchdog). May import :mod:`ckagent.node`, :mod:`ckagent.master`, :mod:`ckagent.containment`.
"""

from ckagent.delivery.capture import DiskGuard, LogSink
from ckagent.delivery.journal import LogJournal, parse_journal, scan_log_files, task_log_globs
from ckagent.delivery.lines import (
    LineSplitter,
    Masker,
    decode_lines,
    encode_json,
    encode_lines,
    item_object,
    secret_values,
)
from ckagent.delivery.outbox import Outbox
from ckagent.delivery.result import send_result
from ckagent.delivery.retention import cleanup_task_dirs
from ckagent.delivery.shipper import StreamShipper
from ckagent.delivery.spool import (
    AGENT_FILES,
    DEFAULT_LOG_GLOBS,
    ITEMS_FILE,
    JOURNAL_FILE,
    MAX_BATCH_BYTES,
    MAX_BATCH_COUNT,
    MAX_ITEM_BYTES,
    MAX_LINE_BYTES,
    OUTPUT_LOG,
)
from ckagent.delivery.statistics import OutboxStatistics, SpoolCounter
from ckagent.delivery.taskdelivery import OutboxConfig, TaskDelivery

__all__ = [
    "AGENT_FILES",
    "DEFAULT_LOG_GLOBS",
    "ITEMS_FILE",
    "JOURNAL_FILE",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_COUNT",
    "MAX_ITEM_BYTES",
    "MAX_LINE_BYTES",
    "OUTPUT_LOG",
    "DiskGuard",
    "LineSplitter",
    "LogJournal",
    "LogSink",
    "Masker",
    "Outbox",
    "OutboxConfig",
    "OutboxStatistics",
    "SpoolCounter",
    "StreamShipper",
    "TaskDelivery",
    "cleanup_task_dirs",
    "decode_lines",
    "encode_json",
    "encode_lines",
    "item_object",
    "parse_journal",
    "scan_log_files",
    "secret_values",
    "send_result",
    "task_log_globs",
]
