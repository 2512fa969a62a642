"""Wheels and a PEP 503 simple index on 127.0.0.1, for uv in tests that must not reach PyPI."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import tarfile
import threading
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def wheel(name: str, version: str, module_text: str) -> tuple[str, bytes]:
    """A minimal pure-Python wheel of the package ``name`` (its ``__init__.py`` is ``module_text``):
    (file name, bytes). The distribution's name is ``name`` with ``-`` for ``_``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": module_text.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: ckagent-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass(frozen=True)
class PackageIndex:
    """A served simple index: ``url`` (``http://127.0.0.1:PORT/simple``) and, per (package, version),
    the wheel's direct URL with its hash (``…/files/NAME.whl#SHA256``), as a lock file names it."""

    url: str
    wheel_urls: dict[tuple[str, str], str]


def sdist(name: str, version: str, files: dict[str, str]) -> tuple[str, bytes]:
    """A source distribution of ``name`` (its ``pyproject.toml``, build backend and code are ``files``,
    relative to the sdist's top directory; a ``PKG-INFO`` is added): (file name, bytes). Building it
    runs whatever its build backend is — a third-party package's own code, as a package index serves it."""
    top = f"{name}-{version}"
    members = {f"{top}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
               **{f"{top}/{rel}": text for rel, text in files.items()}}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return f"{top}.tar.gz", buf.getvalue()


@contextlib.contextmanager
def package_index(root: Path, packages: Sequence[tuple[str, str, str]],
                  sdists: Sequence[tuple[str, str, dict[str, str]]] = ()) -> Iterator[PackageIndex]:
    """Serve a PEP 503 simple index of ``packages`` ((package, version, module text), each built
    with :func:`wheel`) and of ``sdists`` ((package, version, files): :func:`sdist`) from ``root`` on
    127.0.0.1 (a free port) until the block ends: for uv in tests that must not reach PyPI."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    with served_directory(root) as base:
        yield _write_index(root, base, packages, sdists)


def _write_index(root: Path, base: str, packages: Sequence[tuple[str, str, str]],
                 sdists: Sequence[tuple[str, str, dict[str, str]]] = ()) -> PackageIndex:
    """Write the index of ``packages`` and ``sdists`` into ``root`` (served at ``base``): their files and
    its pages."""
    projects: dict[str, list[str]] = {}
    urls: dict[tuple[str, str], str] = {}
    built = [(name, version, *wheel(name, version, text)) for name, version, text in packages]
    built += [(name, version, *sdist(name, version, files)) for name, version, files in sdists]
    for name, version, wheel_name, data in built:
        (root / "files" / wheel_name).write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        projects.setdefault(name.replace("_", "-"), []).append(
            f'<a href="/files/{wheel_name}#sha256={sha}">{wheel_name}</a>')
        urls[(name, version)] = f"{base}/files/{wheel_name}#{sha}"
    for project, links in projects.items():
        (root / "simple" / project).mkdir(parents=True)
        (root / "simple" / project / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>\n")
    (root / "simple" / "index.html").write_text(
        "<html><body>" + "".join(f'<a href="{p}/">{p}</a>' for p in projects) + "</body></html>\n")
    return PackageIndex(f"{base}/simple", urls)


@contextlib.contextmanager
def served_directory(root: Path) -> Iterator[str]:
    """Serve the files under ``root`` over HTTP on 127.0.0.1 (a free port, no request log) until the
    block ends; yields the base URL (``http://127.0.0.1:PORT``)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
