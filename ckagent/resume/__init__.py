"""Checkpoints on the agent's side (issue 38): a task's state dir travels with the task across attempts.

The spider copies its state dir (``CK_STATE_DIR``) into ``CK_SNAPSHOT_DIR/N`` when asked to persist
(ckagent.task.checkpoints runs that exchange); this package does the rest:

- :mod:`ckagent.resume.snapshot` — **pack**: the snapshot dir (the spider's, hostile) read by
  descriptors, never through a link, bounded, into a manifest (``CheckpointFile`` rows) and chunks
  (1 MiB pieces, sha256 of the raw bytes, gzip level 1), incremental against the chunks the master holds.
- :mod:`ckagent.resume.ship` — **ship**: :class:`~ckagent.resume.ship.CheckpointShipper`, durable across
  an agent restart (``<task_dir>/snapshots/N.json``: :mod:`ckagent.resume.records`), uploads the missing
  chunks then the manifest, with the delivery's backoff; a superseded attempt stops it.
- :mod:`ckagent.resume.restore` — **restore**: a checkpoint from the master into a new attempt's state
  dir, every chunk verified, every size bounded, written beneath the dir as the spider's uid.

The wire (chunk and manifest endpoints, ``CHUNK_BYTES``) is ckagent.master's; docs/protocol.md
"Checkpoints" describes it.

May import: ckagent.node, ckagent.master, ckagent.delivery (the backoff). Imported by ckagent.task (the
runner restores before the spawn and runs a shipper per attempt) and, for its types, ckagent.port.
"""
