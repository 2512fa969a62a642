"""PEP 440 versions with the standard library only: parse, compare, refuse anything else.

The agent compares its version with the master's ``minAgentVersion``/``desiredAgentVersion``; run.sh
compares releases before it downloads one (its copy of :func:`version_key` is embedded in run.sh, which
runs before any pyz exists — tests/test_versions.py keeps both equal to ``packaging.version``).
The pattern is PEP 440's own (Appendix B); the ordering is packaging's: epoch, release (trailing
zeros ignored), then dev < a < b < rc < final < post, local versions after their public one.

Exceptions: :class:`InvalidVersion` (a ValueError) for text that is not a PEP 440 version.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["InvalidVersion", "Version", "version_key"]

VERSION_PATTERN = r"""
    v?
    (?:
        (?:(?P<epoch>[0-9]+)!)?
        (?P<release>[0-9]+(?:\.[0-9]+)*)
        (?P<pre>[-_\.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_\.]?(?P<pre_n>[0-9]+)?)?
        (?P<post>(?:-(?P<post_n1>[0-9]+))|(?:[-_\.]?(?P<post_l>post|rev|r)[-_\.]?(?P<post_n2>[0-9]+)?))?
        (?P<dev>[-_\.]?(?P<dev_l>dev)[-_\.]?(?P<dev_n>[0-9]+)?)?
    )
    (?:\+(?P<local>[a-z0-9]+(?:[-_\.][a-z0-9]+)*))?
"""
_REGEX = re.compile(r"^\s*" + VERSION_PATTERN + r"\s*$", re.VERBOSE | re.IGNORECASE)
_PRE = {"alpha": "a", "a": "a", "beta": "b", "b": "b", "c": "rc", "pre": "rc", "preview": "rc", "rc": "rc"}


class InvalidVersion(ValueError):
    """The text is not a PEP 440 version; ``str()`` names it."""


def version_key(text: str) -> tuple[Any, ...]:
    """A sort key ordering versions as PEP 440 does. Raises InvalidVersion."""
    m = _REGEX.match(text)
    if m is None:
        raise InvalidVersion(f"not a PEP 440 version: {text!r} (expected e.g. 1.2.0, 1.3.0rc1, 2.0.post1)")
    release = [int(x) for x in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre = (_PRE[m["pre_l"].lower()], int(m["pre_n"] or 0)) if m["pre_l"] else None
    post = int(m["post_n1"] or m["post_n2"] or 0) if m["post"] else None
    dev = int(m["dev_n"] or 0) if m["dev"] else None
    inf, neg = (1, ""), (-1, "")
    # pre: a dev release of a final sorts before its pre-releases; a final after them
    pre_key: tuple[Any, ...] = (-1, "", 0) if pre is None and post is None and dev is not None else (
        (1, "", 0) if pre is None else (0, pre[0], pre[1]))
    post_key = (-1, 0) if post is None else (0, post)
    dev_key = inf if dev is None else (0, dev)
    local: tuple[Any, ...] = neg if m["local"] is None else tuple(
        (1, int(p), "") if p.isdigit() else (0, 0, p.lower()) for p in re.split(r"[-_.]", m["local"]))
    return (int(m["epoch"] or 0), tuple(release), pre_key, post_key, dev_key, (0,) if m["local"] is None else (1, local))


class Version:
    """A parsed PEP 440 version, ordered as PEP 440 says. Raises InvalidVersion from the constructor."""

    __slots__ = ("_key", "text")

    def __init__(self, text: str) -> None:
        self.text = text.strip()
        self._key = version_key(text)

    def __repr__(self) -> str:
        return f"Version({self.text!r})"

    def __str__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __lt__(self, other: Version) -> bool:
        return self._key < other._key

    def __le__(self, other: Version) -> bool:
        return self._key <= other._key

    def __gt__(self, other: Version) -> bool:
        return self._key > other._key

    def __ge__(self, other: Version) -> bool:
        return self._key >= other._key
