"""The first process of a pod box (harness.podbox), run by ``unshare`` as root of the box's new mount and PID
namespaces: it shapes the box's file system as a pod's, then execs the pod's PID 1.

Run as ``python -I -S podboxinit.py SPEC_JSON`` (the standard library only: it runs before anything is
importable for the box's user). ``SPEC_JSON`` holds ``volumes`` (absolute host paths that stay
writable, at the same paths inside), ``read_only`` (host paths seen read-only at the same paths: the
image's files and the ConfigMap, which would otherwise be hidden when they lie below ``/tmp``), ``tmp`` (the directory that becomes the box's ``/tmp``),
``writable_cgroup`` (the privileged variant: ``/sys/fs/cgroup`` stays writable) and ``argv`` (what
is exec'ed at the end, usually ``setpriv … -- python ckagent.pyz supervise …``).

In order, all in the box's own mount namespace (its mounts die with it; nothing of the host changes):

1. a descriptor of each volume, each read-only path and ``tmp`` is opened (their host paths are about to be covered);
2. every mount becomes read-only (a bind remount keeping the flags a user namespace locks: nosuid,
   nodev, noexec, the atime ones), except ``/proc`` (the box's own, mounted by ``unshare --mount-proc``),
   ``/dev`` and what lies below it, and with ``writable_cgroup`` the cgroup mounts;
3. ``tmp`` is bound over ``/tmp``, ``/dev/shm`` and ``/run`` get fresh tmpfs (``/run`` empty and
   read-only, as an image's; ``/dev/shm`` writable, as a pod's), and each read-only path and volume is
   bound from its descriptor onto its own path (a path below ``/tmp`` made inside the new ``/tmp``
   first), parents first: the volumes writable, the others read-only;
4. ``argv`` is exec'ed: it becomes PID 1 of the box.

Exit code 70 with a line on stderr when a step fails (the box never starts half-made).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_RELATIME = 0x200000
MS_STRICTATIME = 0x1000000
_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
          "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


def _enc(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = _enc
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target} ({fstype}, {flags:#x}): {os.strerror(errno)}")


def _unescape(path: str) -> str:
    """A mountinfo path (octal escapes for space, tab, newline, backslash) as text."""
    return path.encode().decode("unicode_escape") if "\\" in path else path


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of this namespace, parents before children."""
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            found.append((_unescape(fields[4]), set(fields[5].split(","))))
    return sorted(found, key=lambda m: m[0].count("/") if m[0] != "/" else 0)


def _below(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _locked(options: set[str]) -> int:
    return sum(flag for name, flag in _FLAGS.items() if name in options)


def _read_only_everything(writable_cgroup: bool) -> None:
    for target, options in _mounts():
        if "ro" in options or _below(target, "/proc") or _below(target, "/dev"):
            continue
        if writable_cgroup and _below(target, "/sys/fs/cgroup"):
            continue
        try:
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked(options))
        except OSError as exc:
            if exc.errno not in (2, 20, 13):  # (covered or gone: ENOENT, ENOTDIR; EACCES: a path not ours to reach)
                raise


def _bind(fd: int, target: str, writable: bool) -> None:
    """Bind the directory open as ``fd`` onto ``target``, that mount writable or read-only."""
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    options = set()
    for point, opts in _mounts():
        if point == target:
            options = opts  # (the last one listed: the mount just made)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | _locked(options - {"ro"}) | (0 if writable else MS_RDONLY))


def main(spec: dict) -> None:  # type: ignore[type-arg]
    binds = sorted([(os.path.abspath(v), True) for v in spec["volumes"]] +
                   [(os.path.abspath(v), False) for v in spec.get("read_only", [])], key=lambda b: b[0].count("/"))
    fds = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path, _ in binds}
    tmp_fd = os.open(spec["tmp"], os.O_PATH | os.O_DIRECTORY)
    _read_only_everything(bool(spec.get("writable_cgroup")))
    _bind(tmp_fd, "/tmp", writable=True)
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")
    _mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=755,size=1m")
    for path, writable in binds:  # (parents first: a volume inside a read-only directory is bound over it)
        if _below(path, "/tmp") and not os.path.isdir(path):
            os.makedirs(path, mode=0o755, exist_ok=True)
        _bind(fds[path], path, writable)
    for fd in (*fds.values(), tmp_fd):
        os.close(fd)
    argv = spec["argv"]
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except (OSError, KeyError, ValueError) as exc:
        print(f"podbox init: {exc}", file=sys.stderr, flush=True)
        sys.exit(70)
