"""The values of the settings: :class:`Secret` and the parsers that turn raw text into a value.

Each parser takes the raw text (an environment variable's value or a YAML scalar's source text) and
returns the value, or raises :class:`Invalid` saying what was expected. The caller
(:mod:`ckagent.node.config`) adds where the value came from and, unless the setting is a secret, what
it was. The table of settings (:mod:`ckagent.node.configschema`) names one parser per setting.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import os
import re
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


class Secret:
    """A string that must not leak: ``repr``/``str``/``format`` all give ``***``.

    Call :meth:`reveal` at the one place that needs the value (an HTTP header). Equality compares the
    values (in constant time); a ``Secret`` never equals a plain ``str``.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """Return the secret value itself."""
        return self._value

    def __repr__(self) -> str:
        return "***"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(("Secret", self._value))





class Invalid(ValueError):
    """A raw value that is not what its setting expects: ``problem`` says what was expected;
    ``show_value`` False keeps the raw text out of the message (secrets, long paths)."""

    def __init__(self, problem: str, *, show_value: bool = True) -> None:
        super().__init__(problem)
        self.problem = problem
        self.show_value = show_value


def seconds(*, minimum: float = 0.0, exclusive: bool = True, maximum: float | None = None) -> Callable[[str], float]:
    """A parser of float seconds >= (> when ``exclusive``) ``minimum``, at most ``maximum``; finite."""
    if maximum is not None:
        expected = f"a number of seconds {minimum:g}..{maximum:g}"
    elif exclusive:
        expected = f"a number of seconds > {minimum:g}"
    else:
        expected = f"a number of seconds >= {minimum:g}"

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise Invalid(f"expected {expected}") from None
        if (
            not math.isfinite(value)
            or value < minimum
            or (exclusive and value == minimum)
            or (maximum is not None and value > maximum)
        ):
            raise Invalid(f"expected {expected}")
        return value

    return parse


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A parser of base-10 integers ``minimum``..``maximum`` (None: no upper bound)."""
    expected = f"an integer {minimum}..{maximum}" if maximum is not None else f"an integer >= {minimum}"

    def parse(raw: str) -> int:
        try:
            value = int(raw, 10)
        except ValueError:
            raise Invalid(f"expected {expected}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise Invalid(f"expected {expected}")
        return value

    return parse


def boolean(raw: str) -> bool:
    """on/off, true/false, yes/no or 1/0 (any case)."""
    value = raw.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise Invalid("expected on/off (or true/false, yes/no, 1/0)")


def globs(raw: str) -> str:
    """Comma-separated glob patterns relative to the task dir (empty entries dropped)."""
    patterns = [p.strip() for p in raw.split(",") if p.strip()]
    for pattern in patterns:
        if pattern.startswith("/") or ".." in pattern.split("/"):
            raise Invalid("expected glob patterns relative to the task dir (no leading '/', no '..')")
    return ",".join(patterns)


def abs_paths(raw: str) -> str:
    """Comma-separated absolute paths (empty entries dropped), normalised."""
    paths = [p.strip() for p in raw.split(",") if p.strip()]
    for entry in paths:
        if not entry.startswith("/"):
            raise Invalid(f"expected absolute paths ({entry!r} is not)")
    return ",".join(os.path.normpath(p) for p in paths)


def text(raw: str) -> str:
    """A non-empty string, stripped."""
    if not raw.strip():
        raise Invalid("expected a non-empty string")
    return raw.strip()


def secret(raw: str) -> Secret:
    """A non-empty :class:`Secret` (its value never appears in the error)."""
    if not raw.strip():
        raise Invalid("expected a non-empty string", show_value=False)
    return Secret(raw.strip())


def http_url(raw: str) -> str:
    """An http:// or https:// URL with a host and no user name or password."""
    value = raw.strip()
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        raise Invalid("expected an http:// or https:// URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Invalid("expected an http:// or https:// URL")
    if parts.username is not None or parts.password is not None:
        # A password in a URL ends up in logs and `config show`; the node authenticates with its tokens.
        raise Invalid("must not contain a user name or password (user:pass@); the agent authenticates "
                       "with agent.registration_token and its API key", show_value=False)
    return value


def path(raw: str) -> Path:
    """A path, ``~`` expanded, made absolute against the current directory."""
    if not raw.strip():
        raise Invalid("expected a path")
    return Path(os.path.abspath(os.path.expanduser(raw.strip())))


def readable_file(raw: str) -> Path:
    """An existing, readable regular file (absolute path)."""
    file = path(raw)
    if not file.exists():
        raise Invalid(f"file not found: {file}", show_value=False)
    if not file.is_file():
        raise Invalid(f"not a regular file: {file}", show_value=False)
    if not os.access(file, os.R_OK):
        raise Invalid(f"file not readable: {file}", show_value=False)
    return file


def egress_deny(raw: str) -> str:
    """Comma-separated deny entries of :mod:`ckagent.node.egress_policy`, normalised."""
    from ckagent.node.egress_policy import PolicyError, parse_deny

    try:
        return ",".join(parse_deny(raw.split(",")).to_json()["deny"])
    except PolicyError as exc:
        raise Invalid(str(exc).removeprefix("deny: ")) from None


def egress_allow(raw: str) -> str:
    """Comma-separated allow entries of :mod:`ckagent.node.egress_policy`, normalised."""
    from ckagent.node.egress_policy import PolicyError, parse_allow

    try:
        return ",".join(parse_allow(raw.split(",")).to_json()["allow"])
    except PolicyError as exc:
        raise Invalid(str(exc).removeprefix("allow: ")) from None


def ip(raw: str) -> str:
    """An IPv4 or IPv6 address, normalised."""
    try:
        return str(ipaddress.ip_address(raw.strip()))
    except ValueError:
        raise Invalid("expected an IPv4 or IPv6 address") from None


def choice(options: tuple[str, ...], *, upper: bool) -> Callable[[str], str]:
    """A parser of one of ``options`` (compared upper- or lower-cased)."""

    def parse(raw: str) -> str:
        value = raw.strip().upper() if upper else raw.strip().lower()
        if value not in options:
            raise Invalid(f"expected one of {', '.join(options)}")
        return value

    return parse


_CPU_QUANTITY = re.compile(r"^(?:(?P<milli>[0-9]+)m|(?P<cores>[0-9]+(?:\.[0-9]+)?))$")


def cpu_quantity_cores(raw: str) -> float:
    """A Kubernetes-style CPU quantity ("2000m", "4", "1.5") in cores (> 0)."""
    match = _CPU_QUANTITY.match(raw.strip())
    if match is None:
        raise Invalid('expected a CPU quantity like "2000m", "4" or "1.5"')
    cores = int(match["milli"]) / 1000 if match["milli"] is not None else float(match["cores"])
    if cores <= 0:
        raise Invalid("expected a CPU quantity > 0")
    return cores


def cpu_quantity(raw: str) -> str:
    """A valid CPU quantity, kept as text (see :func:`cpu_quantity_cores`)."""
    cpu_quantity_cores(raw)
    return raw.strip()


def label_key(key: str) -> str:
    """A label key: non-empty, no '=' or ','."""
    key = key.strip()
    if not key or "=" in key or "," in key:
        raise Invalid("expected label keys to be non-empty and contain no '=' or ','")
    return key


def labels(raw: str) -> Mapping[str, str]:
    """``k=v,k2=v2`` as a read-only mapping (each key once)."""
    found: dict[str, str] = {}
    for entry in raw.split(","):
        if not entry.strip():
            continue
        key, sep, value = entry.partition("=")
        if not sep:
            raise Invalid("expected key=value pairs separated by commas")
        key = label_key(key)
        if key in found:
            raise Invalid(f"label {key!r} given twice")
        found[key] = value.strip()
    return types.MappingProxyType(found)


INVALID_IDS = (65535, 4294967295)
"""Ids no user may have: ``(uid_t) -1`` and its 16-bit form (the kernel's "no change" in chown and setresuid)."""
MAX_ID = 4294967294


@dataclass(frozen=True)
class UidRange:
    """A range of uids (and the gids of the same numbers), both ends included: ``task.spider_uids``.
    ``str()`` is its settings text, ``FIRST-LAST``."""

    first: int
    last: int

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and self.first <= uid <= self.last

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.first, self.last + 1))


def uid_range(raw: str) -> UidRange:
    """``FIRST-LAST``: at least two ids (a builder and a spider), none of them root's 0 or an id no user
    may have (65535, 4294967295)."""
    first_text, sep, last_text = raw.strip().partition("-")
    try:
        first, last = int(first_text.strip(), 10), int(last_text.strip(), 10)
    except ValueError:
        raise Invalid("expected a range of uids FIRST-LAST, e.g. 61184-65519") from None
    if not sep or not 1 <= first < last <= MAX_ID:
        raise Invalid(f"expected a range of uids FIRST-LAST with 1 <= FIRST < LAST <= {MAX_ID}, e.g. 61184-65519")
    bad = [uid for uid in INVALID_IDS if first <= uid <= last]
    if bad:
        raise Invalid(f"expected a range of uids without {bad[0]} (no user may have it: it means -1 to the "
                      "kernel), e.g. 61184-65519")
    return UidRange(first, last)


class Dynamic:
    """Marker for defaults computed at load time (``doc`` is what the docs table shows)."""

    def __init__(self, doc: str) -> None:
        self.doc = doc

    def __repr__(self) -> str:
        return self.doc


HOSTNAME = Dynamic("the host name")
AUTO_IP = Dynamic("auto-detected")
EMPTY_LABELS: Mapping[str, str] = types.MappingProxyType({})
