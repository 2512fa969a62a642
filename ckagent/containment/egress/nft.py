"""Talking to nftables: libnftables through ctypes (no process per change), the ``nft`` binary otherwise.

Both take the same text commands (the ``nft -f`` language; several lines are one atomic batch) and
can answer in JSON (``nft -j``). Exceptions::

    Exception
    └── NftError        nftables refused a command (the message carries nft's own error text), or
                        neither libnftables nor the ``nft`` binary can be used here

:func:`open_nft` picks the library when it loads and answers, else the binary, else raises.
"""

from __future__ import annotations

import abc
import ctypes
import ctypes.util
import json
import shlex
import shutil
import subprocess
import threading
from typing import Any

NFT_CTX_OUTPUT_JSON = 1 << 4
LIBRARY_NAMES = ("libnftables.so.1", "libnftables.so")
NFT_TIMEOUT = 10.0
"""Seconds the ``nft`` binary may take for one batch before it counts as failed."""


class NftError(Exception):
    """nftables refused a command, or cannot be used here (see the module docstring)."""


class Nft(abc.ABC):
    """One way to run nft commands. ``kind`` is ``libnftables`` or ``nft``; thread-safe."""

    kind = ""

    @abc.abstractmethod
    def run(self, commands: str) -> None:
        """Run ``commands`` (one atomic batch). Raises NftError with nft's message."""

    @abc.abstractmethod
    def run_json(self, command: str) -> Any:
        """Run one listing command and return its JSON answer (``{"nftables": [...]}``).
        Raises NftError."""


class LibNft(Nft):
    """libnftables through ctypes: ~0.1-0.3 ms a batch instead of a process start (bench/egress.py)."""

    kind = "libnftables"

    def __init__(self, library: str | None = None) -> None:
        names = [library] if library else [*LIBRARY_NAMES, ctypes.util.find_library("nftables")]
        lib = None
        problems = []
        for name in names:
            if not name:
                continue
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as exc:
                problems.append(str(exc))
        if lib is None:
            raise NftError("libnftables cannot be loaded (" + "; ".join(problems or ["not found"]) + ")")
        try:
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            for fn in (lib.nft_ctx_buffer_output, lib.nft_ctx_buffer_error):
                fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
            for fn in (lib.nft_ctx_get_output_buffer, lib.nft_ctx_get_error_buffer):
                fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
            lib.nft_ctx_output_set_flags.restype = None
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_ctx_free.restype, lib.nft_ctx_free.argtypes = None, [ctypes.c_void_p]
        except AttributeError as exc:
            raise NftError(f"libnftables lacks a function this agent needs: {exc}") from exc
        self._lib = lib
        self._lock = threading.Lock()
        self._text = self._context(0)
        self._json = self._context(NFT_CTX_OUTPUT_JSON)

    def _context(self, flags: int) -> int:
        ctx = self._lib.nft_ctx_new(0)
        if not ctx:
            raise NftError("libnftables: nft_ctx_new failed (out of memory?)")
        self._lib.nft_ctx_buffer_output(ctx)
        self._lib.nft_ctx_buffer_error(ctx)
        if flags:
            self._lib.nft_ctx_output_set_flags(ctx, flags)
        return int(ctx)

    def _call(self, ctx: int, commands: str) -> str:
        with self._lock:
            rc = self._lib.nft_run_cmd_from_buffer(ctx, commands.encode())
            out = (self._lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            err = (self._lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
        if rc != 0:
            raise NftError(_first_error(err) or f"nft failed (rc {rc})")
        return out

    def run(self, commands: str) -> None:
        self._call(self._text, commands)

    def run_json(self, command: str) -> Any:
        return _parse_json(self._call(self._json, command))

    def close(self) -> None:
        """Free the contexts (idempotent)."""
        with self._lock:
            for ctx in (self._text, self._json):
                if ctx:
                    self._lib.nft_ctx_free(ctx)
            self._text = self._json = 0


class BinaryNft(Nft):
    """The ``nft`` program, one process per batch (several ms each; the fallback)."""

    kind = "nft"

    def __init__(self, program: str | None = None) -> None:
        found = program or shutil.which("nft") or next(
            (p for p in ("/usr/sbin/nft", "/sbin/nft") if shutil.which(p)), None)
        if found is None:
            raise NftError("the nft program is not installed (Debian/Ubuntu: apt-get install nftables)")
        self.program = found

    def _call(self, args: list[str], commands: str | None) -> str:
        try:
            done = subprocess.run([self.program, *args], input=commands, capture_output=True, text=True,
                                  timeout=NFT_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NftError(f"cannot run {self.program}: {exc}") from exc
        if done.returncode != 0:
            raise NftError(_first_error(done.stderr) or f"nft failed (exit status {done.returncode})")
        return done.stdout

    def run(self, commands: str) -> None:
        self._call(["-f", "-"], commands)

    def run_json(self, command: str) -> Any:
        return _parse_json(self._call(["-j", *shlex.split(command)], None))


def open_nft(prefer: str = "auto") -> Nft:
    """libnftables when it loads (``prefer`` ``auto``/``libnftables``), else the ``nft`` binary
    (``prefer`` ``nft`` forces it). Checks nothing about rights: the caller's first batch does.
    Raises NftError when neither can be used."""
    problems = []
    if prefer in ("auto", "libnftables"):
        try:
            return LibNft()
        except NftError as exc:
            if prefer == "libnftables":
                raise
            problems.append(str(exc))
    try:
        return BinaryNft()
    except NftError as exc:
        problems.append(str(exc))
    raise NftError("; ".join(problems))


def _first_error(stderr: str) -> str:
    """nft's error text, squeezed to one line (it prints the command and a caret line below)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and set(line.strip()) != {"^"}]
    return " | ".join(lines[:2])[:500]


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else {"nftables": []}
    except ValueError as exc:
        raise NftError(f"nft answered something that is not JSON: {text[:200]!r}") from exc
