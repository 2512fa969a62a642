"""An npm registry on 127.0.0.1 serving packages made in a test, for npm in tests that must not reach npmjs.org.

:func:`npm_registry` serves each package's document (``GET /<name>``) and its tarball (``GET
/<name>/-/<name>-<version>.tgz``), as npm asks for them; point npm at it with
``NPM_CONFIG_REGISTRY=<url>``. A package is its files (``package.json`` built from the name, the version
and ``scripts``): its install scripts run wherever npm installs it — a third-party package's own code.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import json
import tarfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NpmPackage", "NpmRegistry", "npm_registry", "npm_tarball"]


@dataclass(frozen=True)
class NpmPackage:
    """A package for :func:`npm_registry`: its ``name``, ``version``, ``scripts`` (lifecycle scripts: they
    run on install) and other ``files`` (path → text; ``index.js`` by default)."""

    name: str
    version: str = "1.0.0"
    scripts: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=lambda: {"index.js": "module.exports = 42;\n"})

    def manifest(self) -> dict[str, Any]:
        """Its package.json."""
        return {"name": self.name, "version": self.version, "main": "index.js", "scripts": self.scripts}


def npm_tarball(package: NpmPackage) -> bytes:
    """The package as npm packs it: a gzipped tar of ``package/...``."""
    members = {"package/package.json": json.dumps(package.manifest(), indent=2),
               **{f"package/{rel}": text for rel, text in package.files.items()}}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 499162500
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass(frozen=True)
class NpmRegistry:
    """A served registry: its ``url`` (``http://127.0.0.1:PORT/``) and how many tarballs it handed out."""

    url: str
    downloads: dict[str, int]


@contextlib.contextmanager
def npm_registry(packages: Sequence[NpmPackage]) -> Iterator[NpmRegistry]:
    """Serve ``packages`` as an npm registry on 127.0.0.1 (a free port) until the block ends."""
    documents: dict[str, bytes] = {}
    tarballs: dict[str, bytes] = {}
    downloads: dict[str, int] = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    by_name: dict[str, list[NpmPackage]] = {}
    for package in packages:
        by_name.setdefault(package.name, []).append(package)
    for name, versions in by_name.items():
        doc: dict[str, Any] = {"name": name, "dist-tags": {"latest": versions[-1].version}, "versions": {}}
        for package in versions:
            data = npm_tarball(package)
            path = f"/{name}/-/{name}-{package.version}.tgz"
            tarballs[path] = data
            integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
            doc["versions"][package.version] = {
                **package.manifest(), "hasInstallScript": any(s in package.scripts for s in
                                                              ("preinstall", "install", "postinstall")),
                "dist": {"tarball": url.rstrip("/") + path, "shasum": hashlib.sha1(data).hexdigest(),
                         "integrity": integrity}}
        documents[f"/{name}"] = json.dumps(doc).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            body = documents.get(path) if "/-/" not in path else tarballs.get(path)
            if body is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if "/-/" in path:
                downloads[path] = downloads.get(path, 0) + 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json" if "/-/" not in path else "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server.RequestHandlerClass = Handler
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield NpmRegistry(url, downloads)
    finally:
        server.shutdown()
        server.server_close()
