"""One row of the settings' table (:data:`ckagent.node.configschema.SETTINGS`): section, key, env var,
type, default, meaning, parser — and how its default reads in the docs. Imports: ckagent.node.configvalues.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckagent.node.configvalues import Dynamic


@dataclass(frozen=True)
class Setting:
    """One row of :data:`SETTINGS`.

    ``type_doc`` and ``doc`` are for humans (docs/README); ``default`` is the value used when neither the
    file nor the environment sets it (None = unset/optional); ``parse`` turns raw text into the value;
    ``mapping`` marks a setting that is a YAML mapping (labels).
    """

    section: str
    key: str
    env: str
    type_doc: str
    default: Any
    doc: str
    parse: Callable[[str], Any]
    secret: bool = False
    mapping: bool = False

    @property
    def dotted(self) -> str:
        """``section.key``."""
        return f"{self.section}.{self.key}"

    @property
    def default_doc(self) -> str:
        """The default as shown in the docs table."""
        d = self.default
        if isinstance(d, Dynamic):
            return d.doc
        if d is None:
            return "—"
        if isinstance(d, Mapping):
            return f"`{dict(d)}`"
        if isinstance(d, Path) and not d.is_absolute():
            return f"`./{d}`"
        if isinstance(d, float):
            return f"`{d:g}`"
        return f"`{d}`"
