"""An npm registry on 127.0.0.1 serving packages made in a test, for npm in tests that must not reach npmjs.org.

:func:`npm_registry` serves each package's document (``GET /<name>``) and its tarball (``GET
/<name>/-/<name>-<version>.tgz``), as npm asks for them; point npm at it with
``NPM_CONFIG_REGISTRY=<url>``. A package is its files (``package.json`` built from the name, the version
and ``scripts``): its install scripts run wherever npm installs it — a third-party package's own code.
A package may also be a real tarball (``NpmPackage.real``: e.g. one ``npm pack`` fetched, as
tests/harness/nodelocks.py does for yarn and pnpm); scoped names (``@yarnpkg/cli-dist``) are served at
``/@scope%2fname`` as npm asks.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.server
import io
import json
import tarfile
import threading
import urllib.parse
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
    tarball: bytes | None = None

    @classmethod
    def real(cls, tarball: bytes) -> NpmPackage:
        """A package that is ``tarball`` (an npm ``.tgz``), served as it is; its name and version from it."""
        manifest = _packed_manifest(tarball)
        return cls(str(manifest["name"]), str(manifest["version"]), tarball=tarball)

    def manifest(self) -> dict[str, Any]:
        """Its package.json."""
        if self.tarball is not None:
            return _packed_manifest(self.tarball)
        return {"name": self.name, "version": self.version, "main": "index.js", "scripts": self.scripts}


def _packed_manifest(tarball: bytes) -> dict[str, Any]:
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        member = tar.extractfile("package/package.json")
        assert member is not None
        manifest: dict[str, Any] = json.loads(member.read())
    return manifest


def npm_tarball(package: NpmPackage) -> bytes:
    """The package as npm packs it: a gzipped tar of ``package/...`` (the same bytes every time)."""
    if package.tarball is not None:
        return package.tarball
    members = {"package/package.json": json.dumps(package.manifest(), indent=2),
               **{f"package/{rel}": text for rel, text in package.files.items()}}
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for path, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 499162500
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass(frozen=True)
class NpmRegistry:
    """A served registry: its ``url`` (``http://127.0.0.1:PORT/``), how many tarballs it handed out (by
    path) and each package's ``integrity`` (``name@version`` → ``sha512-…``, as a lock file records it)."""

    url: str
    downloads: dict[str, int]
    integrity: dict[str, str] = field(default_factory=dict)

    def tarball_url(self, name: str, version: str) -> str:
        """Where the tarball of ``name@version`` is served."""
        return f"{self.url}{name}/-/{name.rsplit('/', 1)[-1]}-{version}.tgz"


@contextlib.contextmanager
def npm_registry(packages: Sequence[NpmPackage]) -> Iterator[NpmRegistry]:
    """Serve ``packages`` as an npm registry on 127.0.0.1 (a free port) until the block ends."""
    documents: dict[str, bytes] = {}
    tarballs: dict[str, bytes] = {}
    downloads: dict[str, int] = {}
    integrity_of: dict[str, str] = {}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    by_name: dict[str, list[NpmPackage]] = {}
    for package in packages:
        by_name.setdefault(package.name, []).append(package)
    for name, versions in by_name.items():
        doc: dict[str, Any] = {"name": name, "dist-tags": {"latest": versions[-1].version}, "versions": {}}
        for package in versions:
            data = npm_tarball(package)
            path = f"/{name}/-/{name.rsplit('/', 1)[-1]}-{package.version}.tgz"
            tarballs[path] = data
            integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
            integrity_of[f"{name}@{package.version}"] = integrity
            manifest = package.manifest()
            doc["versions"][package.version] = {
                **manifest, "hasInstallScript": any(s in (manifest.get("scripts") or {}) for s in
                                                    ("preinstall", "install", "postinstall")),
                "dist": {"tarball": url.rstrip("/") + path, "shasum": hashlib.sha1(data).hexdigest(),
                         "integrity": integrity}}
        documents[f"/{name}"] = json.dumps(doc).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urllib.parse.unquote(self.path.split("?", 1)[0])
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
        yield NpmRegistry(url, downloads, integrity_of)
    finally:
        server.shutdown()
        server.server_close()
