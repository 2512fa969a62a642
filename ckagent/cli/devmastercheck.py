"""What ``ckagent dev-master`` checks before it starts: the database file and the address."""

from __future__ import annotations

from pathlib import Path


def dev_master_db_problem(db: Path) -> str | None:
    """Why ``db`` cannot be opened (or created) as an SQLite database, or None."""
    import sqlite3

    if db.is_dir():
        return f"--db {str(db)!r} is a directory; name a database file in it (e.g. {db / 'master.sqlite'})"
    if not db.parent.is_dir():
        return f"--db {str(db)!r}: the directory {str(db.parent)!r} does not exist; create it first"
    try:
        conn = sqlite3.connect(str(db))
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"--db {str(db)!r} cannot be opened as an SQLite database: {exc}"
    return None


def listen_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (the OS's words), or None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
