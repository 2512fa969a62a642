"""The dev master's spiders and their code: packages (zips) and the files of each package."""

from __future__ import annotations

import sqlite3
from typing import Any

from ckagent.devmaster.errors import NotFoundError
from ckagent.devmaster.packages import PackageContents
from ckagent.devmaster.store.database import Database, dumps, loads, new_id
from ckagent.master.protocol import utc_now_iso


class SpiderStore(Database):
    """Spiders and packages (part of :class:`ckagent.devmaster.store.Store`)."""

    def create_spider(
        self,
        *,
        name: str,
        framework: str,
        command: list[str] | str | None,
        timeout_seconds: float | None,
        code_mode: str,
        env: dict[str, str],
        resources: dict[str, Any] | None = None,
        stop_signal: str | None = None,
        outputs: dict[str, Any] | None = None,
        egress: dict[str, Any] | None = None,
        stop_grace_seconds: float | None = None,
        retry: dict[str, Any] | None = None,
        resume: str | None = None,
        checkpoint_interval_seconds: float | None = None,
    ) -> str:
        """Create a spider (arguments already validated). Returns its id. ``resources`` (limits of its
        tasks), ``stop_signal`` and ``outputs`` (declared item files and artifacts) and ``egress`` (its network policy, the wire shape)
        and ``stop_grace_seconds`` (seconds from a stop signal to the kill), ``retry`` (the wire's RetryPolicy
        JSON), ``resume`` (restart-replace | restart-keep) and ``checkpoint_interval_seconds`` are the defaults
        of its tasks."""
        spider_id = new_id()
        with self._tx() as db:
            db.execute(
                "INSERT INTO spiders (id, name, framework, command, timeout_seconds, code_mode, env, created_at,"
                " resources, stop_signal, outputs, egress, stop_grace_seconds, retry, resume, checkpoint_interval_seconds)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    spider_id,
                    name,
                    framework,
                    dumps(command),
                    timeout_seconds,
                    code_mode,
                    dumps(env),
                    utc_now_iso(),
                    dumps(resources) if resources else None,
                    stop_signal,
                    dumps(outputs) if outputs is not None else None,
                    dumps(egress) if egress is not None else None,
                    stop_grace_seconds,
                    dumps(retry) if retry is not None else None,
                    resume,
                    checkpoint_interval_seconds,
                ),
            )
        return spider_id

    @staticmethod
    def _spider_json(r: sqlite3.Row) -> dict[str, Any]:
        return {
            "id": r["id"],
            "name": r["name"],
            "framework": r["framework"],
            "command": loads(r["command"]),
            "timeoutSeconds": r["timeout_seconds"],
            "codeMode": r["code_mode"],
            "env": loads(r["env"]),
            "codeVersion": r["code_version"],
            "createdAt": r["created_at"],
            "resources": loads(r["resources"]) if r["resources"] else {},
            "stopSignal": r["stop_signal"],
            "outputs": loads(r["outputs"]),
            "egress": loads(r["egress"]),
            "stopGraceSeconds": r["stop_grace_seconds"],
            "retry": loads(r["retry"]),
            "resume": r["resume"],
            "checkpointIntervalSeconds": r["checkpoint_interval_seconds"],
        }

    def list_spiders(self) -> list[dict[str, Any]]:
        """Every spider as admin JSON, oldest first."""
        rows = self._read(lambda db: db.execute("SELECT * FROM spiders ORDER BY created_at, id").fetchall())
        return [self._spider_json(r) for r in rows]

    def get_spider(self, spider_id: str) -> dict[str, Any]:
        """One spider as admin JSON. Raises NotFoundError."""
        row = self._read(lambda db: db.execute("SELECT * FROM spiders WHERE id = ?", (spider_id,)).fetchone())
        if row is None:
            raise NotFoundError(f"no spider {spider_id!r}")
        return self._spider_json(row)

    def update_spider(self, spider_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Change a spider's ``name``, ``framework``, ``command``, ``timeout_seconds``, ``env``, ``resources``,
        ``stop_signal``, ``outputs``, ``egress``, ``stop_grace_seconds``, ``retry``, ``resume``,
        ``checkpoint_interval_seconds`` (validated values; only the keys given). Returns the spider's admin
        JSON. Raises NotFoundError."""
        as_json = {"command", "env", "resources", "outputs", "egress", "retry"}  # JSON columns; the others: the value
        sets: list[str] = []
        values: list[Any] = []
        for key, value in changes.items():
            if key not in ("name", "framework", "command", "timeout_seconds", "env", "resources", "stop_signal",
                           "outputs", "egress", "stop_grace_seconds", "retry", "resume", "checkpoint_interval_seconds"):
                raise ValueError(f"update_spider: {key!r} is not a changeable column")
            sets.append(f"{key} = ?")
            if key in ("resources", "outputs", "egress", "retry") and not value:
                values.append(None)  # nullable column: none
            else:
                values.append(dumps(value) if key in as_json else value)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM spiders WHERE id = ?", (spider_id,)).fetchone() is None:
                raise NotFoundError(f"no spider {spider_id!r}")
            if sets:
                db.execute(f"UPDATE spiders SET {', '.join(sets)} WHERE id = ?", (*values, spider_id))
        return self.get_spider(spider_id)

    def store_package(self, spider_id: str, package: PackageContents, data: bytes) -> dict[str, Any]:
        """Store a validated package (zip + files) and make it the spider's current code.

        Returns ``{codeVersion, sha256, sizeBytes, fileCount}``. Uploading the same zip again is a no-op
        apart from making it current. Raises NotFoundError for an unknown spider.
        """
        version = package.code_version
        with self._tx() as db:
            if db.execute("SELECT 1 FROM spiders WHERE id = ?", (spider_id,)).fetchone() is None:
                raise NotFoundError(f"no spider {spider_id!r}")
            known = db.execute(
                "SELECT 1 FROM packages WHERE spider_id = ? AND code_version = ?", (spider_id, version)
            ).fetchone()
            if known is None:
                db.execute(
                    "INSERT INTO packages (spider_id, code_version, sha256, size_bytes, data, uploaded_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (spider_id, version, package.sha256, package.size_bytes, data, utc_now_iso()),
                )
                db.executemany(
                    "INSERT INTO spider_files (id, spider_id, code_version, path, size_bytes, sha256, data)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        (new_id(), spider_id, version, f.path, f.size_bytes, f.sha256, f.data)
                        for f in package.files
                    ],
                )
            db.execute("UPDATE spiders SET code_version = ? WHERE id = ?", (version, spider_id))
        return {
            "codeVersion": version,
            "sha256": package.sha256,
            "sizeBytes": package.size_bytes,
            "fileCount": len(package.files),
        }

    def spider_files(self, spider_id: str) -> list[dict[str, Any]]:
        """The files of the spider's current package, by path: ``[{id, path, sizeBytes, sha256}]``.

        An empty list for a spider without a package. Raises NotFoundError for an unknown spider.
        """

        def query(db: sqlite3.Connection) -> list[sqlite3.Row]:
            spider = db.execute("SELECT code_version FROM spiders WHERE id = ?", (spider_id,)).fetchone()
            if spider is None:
                raise NotFoundError(f"no spider {spider_id!r}")
            return db.execute(
                "SELECT id, path, size_bytes, sha256 FROM spider_files WHERE spider_id = ? AND code_version = ?"
                " ORDER BY path",
                (spider_id, spider["code_version"]),
            ).fetchall()

        return [
            {"id": r["id"], "path": r["path"], "sizeBytes": r["size_bytes"], "sha256": r["sha256"]}
            for r in self._read(query)
        ]

    def spider_file(self, file_id: str) -> bytes:
        """The bytes of one spider file. Raises NotFoundError."""
        row = self._read(
            lambda db: db.execute("SELECT data FROM spider_files WHERE id = ?", (file_id,)).fetchone()
        )
        if row is None:
            raise NotFoundError(f"no spider file {file_id!r}")
        return bytes(row["data"])

    def package_zip(self, spider_id: str, code_version: str) -> bytes:
        """The zip bytes of one package version. Raises NotFoundError."""
        row = self._read(
            lambda db: db.execute(
                "SELECT data FROM packages WHERE spider_id = ? AND code_version = ?",
                (spider_id, code_version),
            ).fetchone()
        )
        if row is None:
            raise NotFoundError(f"no package {code_version!r} for spider {spider_id!r}")
        return bytes(row["data"])

