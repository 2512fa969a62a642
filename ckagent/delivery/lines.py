"""Lines and elements: secret masking, the byte-exact line splitter, log/item converters.

See the package docstring (ckagent.delivery) for the whole design.
"""

from __future__ import annotations

import json
import json.scanner
import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from operator import add
from typing import Any

from ckagent.delivery.spool import MAX_LINE_BYTES
from ckagent.node.logs import Masker

log = logging.getLogger(__name__)
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|PASS|KEY|AUTH|CREDENTIALS?|COOKIE)$", re.IGNORECASE)
"""A secret's name (an env variable's, a flag's, a ``NAME=`` word's) ends so: ``API_KEY``, ``--db-password``,
Scrapy's ``http_pass`` spider argument, ``--proxy-auth``, ``--cookie``."""

# ---------------------------------------------------------------------------------------------- secrets


def secret_values(env: dict[str, str], extra: Iterable[str] = (), args: Iterable[str] = ()) -> list[str]:
    """Values to mask: env variables with a secret's name (*TOKEN, *SECRET, *PASSWORD, *PASSWD, *PASS,
    *KEY, *AUTH, *CREDENTIAL(S), *COOKIE), the same in ``args``
    (see :func:`secret_args`), plus ``extra``.

    Empty values are left out. Longest first. How each is masked (a short one only where it stands
    alone) is :class:`ckagent.node.logs.Masker`'s rule, the same as in the agent's own log.
    """
    values = [v for k, v in env.items() if _SECRET_NAME.search(k)]
    values.extend(secret_args(args))
    values.extend(extra)
    return sorted({v for v in values if v}, key=len, reverse=True)


def secret_args(args: Iterable[str]) -> list[str]:
    """The values in a command line that the env rule would mask: ``--db-password hunter2``,
    ``--db-password=hunter2``, ``-a api_key=x``, ``TOKEN=x`` and ``--set=API_KEY=x`` give
    ``hunter2``/``x`` (a flag or name with a secret's name, :data:`_SECRET_NAME`, ``-`` read as ``_``; a
    word with several ``=`` is cut after the first name that is secret)."""
    found: list[str] = []
    words = list(args)
    for i, word in enumerate(words):
        cut = _secret_cut(word)
        if cut is not None:
            found.append(word[cut:])
        elif _secret_flag(word) and i + 1 < len(words):
            found.append(words[i + 1])
    return found


def _secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name.lstrip("-").replace("-", "_")))


def _secret_flag(word: str) -> bool:
    """``word`` is a flag whose value (the next word) is secret: ``--token``, ``--db-password``."""
    return word.startswith("-") and "=" not in word and _secret_name(word)


def _secret_cut(word: str) -> int | None:
    """Where the secret value in ``word`` starts: after the first ``=`` whose name (the text since the
    previous ``=``) is secret (``api_key=x`` → 8, ``--set=API_KEY=x`` → 14); None if there is none."""
    start = 0
    while (eq := word.find("=", start)) != -1:
        if _secret_name(word[start:eq]):
            return eq + 1
        start = eq + 1
    return None


_URL_PASSWORD = re.compile(r"(://[^/@:]*:)[^/]*@")
_CREDENTIAL_HEADER = re.compile(r"(?is)((?:proxy-)?authorization|cookie)(\s*:\s*)\S.*")
_AUTH_SCHEME = re.compile(r"(?i)\b(bearer|basic|digest|token)(\s+)[^\s'\"]+")


def mask_argv(argv: Sequence[str], secrets: Iterable[str] = ()) -> list[str]:
    """``argv`` as it may be shown: the value of a secret-looking flag (``--token X``: the next word),
    the value of a secret-looking ``NAME=VALUE`` (:func:`secret_args`), a URL's password
    (``https://user:***@host``), a credential header's value (``Authorization: ***``, ``Cookie: ***``),
    the credentials after ``Bearer``/``Basic``/``Digest``/``Token``, and every occurrence of ``secrets``
    (and of the secret-looking values, wherever else they occur: :class:`Masker`'s rule, a short value
    only where it stands alone) are ``***``; every other word is as it was. Pure; never raises."""
    words = list(argv)
    masker = Masker([*secrets, *secret_args(words)], multiline=True)
    shown: list[str] = []
    hide_next = False
    for word in words:
        if hide_next:
            shown.append("***")
            hide_next = False
            continue
        cut = _secret_cut(word)
        if cut is not None:
            shown.append(masker(word[:cut]) + "***")
            continue
        hide_next = _secret_flag(word)
        word = _URL_PASSWORD.sub(r"\1***@", masker(word))
        shown.append(_AUTH_SCHEME.sub(r"\1\2***", _CREDENTIAL_HEADER.sub(r"\1\2***", word)))
    return shown


# ---------------------------------------------------------------------------------------------- lines

_TERM_CR = re.compile(rb"\r\n|\r|\n")
_TERM_LF = re.compile(rb"\n")


class LineSplitter:
    """Incremental bytes → complete lines with the byte offset where each ends (see module docstring).

    ``feed(data)`` returns ``(lines, ends)`` for the lines completed so far (terminators stripped;
    ``ends[i]`` is the offset just after line i's terminator). ``flush()`` ends the stream: an
    unterminated last line is returned too. ``offset`` is where the unfinished line starts (the
    first byte not yet returned). The result does not depend on how the bytes were chunked, so a
    splitter restarted at any returned end offset continues exactly as the first one did.
    """

    def __init__(self, start_offset: int = 0, max_line_bytes: int = MAX_LINE_BYTES, cr_breaks: bool = True) -> None:
        if max_line_bytes < 4:
            raise ValueError("max_line_bytes must be at least 4")
        self._buf = b""
        self._start = start_offset
        self._max = max_line_bytes
        self._cr = cr_breaks

    @property
    def offset(self) -> int:
        """Offset of the first byte not yet returned as part of a line."""
        return self._start

    @property
    def buffered(self) -> int:
        """Bytes held back (an unfinished line)."""
        return len(self._buf)

    def feed(self, data: bytes) -> tuple[list[bytes], list[int]]:
        """Add bytes; return the lines they completed and their end offsets."""
        buf = self._buf + data if self._buf else bytes(data)
        return self._split(buf, final=False)

    def feed_block(self, data: bytes) -> tuple[bytes, int, int] | None:
        """:meth:`feed` for a flood of ordinary lines, without a bytes object per line.

        Returns ``(block, start, count)``: the ``count`` lines ``data`` completed, joined by ``\\n``
        as they were (no final terminator), the first starting at offset ``start`` (line ``i`` ends
        at ``start`` + the lengths of lines 0..i + i + 1). Returns None, changing nothing, when
        :meth:`feed` must handle ``data``: no line completed, a ``\\r`` where it breaks lines, or a
        line longer than ``max_line_bytes``. Cut with :meth:`split_block` it is what :meth:`feed`
        would have returned.
        """
        buf = self._buf + data if self._buf else bytes(data)
        last = buf.rfind(b"\n")
        if last < 0 or len(buf) - last - 1 > self._max or (self._cr and b"\r" in buf):
            return None
        mx = self._max
        pos = 0
        while last - pos > mx:  # every line fits: find a newline in each max_line_bytes window
            nl = buf.rfind(b"\n", pos, pos + mx + 1)
            if nl < 0:
                return None
            pos = nl + 1
        start = self._start
        block = buf[:last]
        self._buf = buf[last + 1 :]
        self._start = start + last + 1
        return block, start, block.count(b"\n") + 1

    @staticmethod
    def split_block(block: bytes, start: int) -> tuple[list[bytes], list[int]]:
        """A block of :meth:`feed_block` as :meth:`feed` returns lines: ``(lines, ends)``."""
        lines = block.split(b"\n")
        return lines, list(map(add, accumulate(map(len, lines)), range(start + 1, start + 1 + len(lines))))

    def flush(self) -> tuple[list[bytes], list[int]]:
        """End of stream: return what is left (including an unterminated last line)."""
        return self._split(self._buf, final=True)

    def _split(self, buf: bytes, final: bool) -> tuple[list[bytes], list[int]]:
        mx = self._max
        if not (self._cr and b"\r" in buf):
            # Fast path (no \r): C-level split, then check no line is too long.
            parts = buf.split(b"\n")
            rest = parts.pop()
            if len(rest) <= mx and (not parts or max(map(len, parts)) <= mx):
                start = self._start
                # ends[i] = start + the lengths of lines 0..i + their i+1 newlines (C-level iterators)
                ends = list(map(add, accumulate(map(len, parts)), range(start + 1, start + 1 + len(parts))))
                if final and rest:
                    parts.append(rest)
                    ends.append(start + len(buf))
                    rest = b""
                self._buf = rest
                self._start = start + len(buf) - len(rest)
                return parts, ends
        return self._split_slow(buf, final)

    def _split_slow(self, buf: bytes, final: bool) -> tuple[list[bytes], list[int]]:
        mx = self._max
        base = self._start
        n = len(buf)
        lines: list[bytes] = []
        ends: list[int] = []
        pos = 0
        content_end = n  # where the content of the unfinished line ends (before a trailing lone \r)
        for match in (_TERM_CR if self._cr else _TERM_LF).finditer(buf):
            s, e = match.start(), match.end()
            if e == n and not final and buf[s] == 0x0D:
                content_end = s  # "\r" at the end of what we have: could be the start of "\r\n"
                break
            while s - pos > mx:
                cut = _utf8_boundary(buf, pos + mx, pos)
                lines.append(buf[pos:cut])
                ends.append(base + cut)
                pos = cut
            lines.append(buf[pos:s])
            ends.append(base + e)
            pos = e
        while content_end - pos > mx:
            cut = _utf8_boundary(buf, pos + mx, pos)
            lines.append(buf[pos:cut])
            ends.append(base + cut)
            pos = cut
        if final and n > pos:
            lines.append(buf[pos:])
            ends.append(base + n)
            pos = n
        self._buf = buf[pos:]
        self._start = base + pos
        return lines, ends


def _utf8_boundary(buf: bytes, cut: int, lo: int) -> int:
    """Move ``cut`` back (at most 3 bytes, never to ``lo``) so it does not split a UTF-8 character."""
    for back in range(4):
        i = cut - back
        if i <= lo:
            break
        if (buf[i] & 0xC0) != 0x80:  # not a continuation byte: a character starts here
            return i
    return cut


# ---------------------------------------------------------------------------------------------- converters


def decode_lines(lines: Sequence[bytes], masker: Masker | None = None, prefix: str = "") -> list[str]:
    """Log lines as shipped: UTF-8 with replacement, secrets masked, ``prefix`` (the source mark) added.

    The lines hold no ``\\n``, so they are decoded (and searched for secrets) in one piece: a newline
    ends any invalid UTF-8 sequence, which makes this the same as decoding line by line.
    """
    if not lines:
        return []
    text = b"\n".join(lines).decode("utf-8", "replace")
    if masker:
        text = masker(text)
    texts = text.split("\n")
    if prefix:
        texts = [prefix + t for t in texts]
    return texts


_PLAIN_LF = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\') + b"\n"
"""Bytes JSON carries as they are (printable ASCII but ``"`` and ``\\``), and the line separator."""


def encode_lines(lines: Sequence[bytes], masker: Masker | None = None, prefix: str = "") -> list[bytes]:
    """The JSON strings (UTF-8 bytes, quotes included) of ``decode_lines(lines, masker, prefix)``.

    Exactly ``json.dumps(text, ensure_ascii=False).encode()`` for each shipped text, so a batch body
    is the elements joined with ``,`` and the size of each element is known exactly. Lines of
    printable ASCII (the common case) are never decoded: they are their own JSON text.
    """
    if not lines:
        return []
    joined = b"\n".join(lines)
    if joined.translate(None, _PLAIN_LF):  # something needs escaping or decoding: the general path
        texts = decode_lines(lines, masker, prefix)
        # A JSON string never holds a raw newline (it is escaped), so "\n" separates the elements.
        encoded = json.dumps(texts, ensure_ascii=False, separators=("\n", ":")).encode()
        return encoded[1:-1].split(b"\n")
    if masker:
        joined = masker.mask_bytes(joined)
    head = b'"' + _json_prefix(prefix)
    return (head + joined.replace(b"\n", b'"\n' + head) + b'"').split(b"\n")


def encode_block(block: bytes, masker: Masker | None = None, prefix: str = "") -> tuple[bytes, int] | None:
    """Lines joined by ``\\n`` (a block of :meth:`LineSplitter.feed_block`) → ``(elements, prefix_bytes)``:
    ``b",".join(encode_lines(block.split(b"\\n"), masker, prefix))`` made in one piece, and the length of
    the prefix inside each JSON string. None when the lines need :func:`encode_lines` one by one: a
    byte that is not printable ASCII, a secret to mask, a prefix holding a quote.
    """
    if block.translate(None, _PLAIN_LF) or (masker and masker.mask_bytes(block) is not block):
        return None
    head = _json_prefix(prefix)
    if b'"' in head:
        return None
    return b'"%s%s"' % (head, block.replace(b"\n", b'","' + head)), len(head)


def _json_prefix(prefix: str) -> bytes:
    """``prefix`` as it is inside a JSON string (UTF-8 bytes, no quotes)."""
    return json.dumps(prefix, ensure_ascii=False).encode()[1:-1] if prefix else b""


def encode_json(value: Any) -> bytes:
    """One element as JSON (UTF-8 bytes), encoded like the HTTP client would: compact, no NaN."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _finite_float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else text  # 1e999 would be Infinity: JSON cannot carry it


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def item_object(raw: bytes) -> Any:
    """One items.jsonl line → the item; a blank line → None (skipped); anything else is wrapped, not lost."""
    text = raw.decode("utf-8", "replace")
    if not text.strip():
        return None
    try:
        value = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except ValueError as exc:
        return {"_invalidItem": text[:10000], "_error": f"not JSON: {exc}"}
    return value if isinstance(value, dict) else {"_invalidItem": text[:10000], "_error": "not a JSON object"}


class _NotPlain(ValueError):
    """An item line that is JSON but needs :func:`item_object`'s care (an infinite float)."""


def _finite_or_raise(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotPlain(text)
    return value


_ITEM_DECODER = json.JSONDecoder(parse_float=_finite_or_raise, parse_constant=_no_constant)
"""Made once: ``json.loads`` with hooks builds a new decoder on every call."""
_ITEM_SCAN: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(_ITEM_DECODER)  # type: ignore[arg-type]
_JSON_SPACE = " \t\n\r"
"""``(value, end) = scan(text, index)``; StopIteration when no value starts at ``index``."""


def encode_item(raw: bytes) -> bytes | None:
    """One items.jsonl line → its element in a batch body (UTF-8 JSON bytes); None for a blank line.

    ``encode_json(item_object(raw))`` in meaning, faster: a line that is valid UTF-8 holding one
    JSON object with finite numbers only (what the SDK writes) is sent as it was written — parsed to
    check it, not encoded again. Anything else goes through :func:`item_object` (wrapped, not lost).
    """
    try:
        text = raw.decode("utf-8")
        # The C scanner itself (JSONDecoder.decode adds two regex matches and a Python frame per
        # line: a third of the agent's CPU per item in bench/items.py): one value from the first
        # to the last but JSON whitespace around it.
        start = len(text) - len(text.lstrip(_JSON_SPACE)) if text[:1] in _JSON_SPACE else 0
        value, end = _ITEM_SCAN(text, start)
        if type(value) is dict and (end == len(text) or not text[end:].strip(_JSON_SPACE)):
            return raw
    except (ValueError, StopIteration):  # not UTF-8, not JSON, NaN, an infinite float: the careful path
        pass
    value = item_object(raw)
    return None if value is None else encode_json(value)
