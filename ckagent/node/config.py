"""Agent configuration: one YAML file plus ``AGENT_*`` environment variables → one frozen :class:`Settings`.

Precedence (lowest to highest): built-in defaults < YAML file < environment. Every setting has exactly
one environment variable; :data:`SETTINGS` is the single table that the loader, ``ckagent config show``,
``docs/configuration.md``, the README table and the sync test all derive from.

This module loads (YAML with file:line:column errors, the environment, defaults); the schema — the
section objects, :class:`Settings` and the :data:`SETTINGS` table — is :mod:`ckagent.node.configschema`,
the values' parsers and :class:`Secret` are :mod:`ckagent.node.configvalues`, the docs generator is
:mod:`ckagent.node.configdocs`. ``from ckagent.node.config import Settings, load_settings`` is the way in.

Rules shared by both sources:

* YAML ``null`` (or an empty value) and an empty environment variable both mean "not set": the
  next-lower source (finally the default) applies.
* Relative paths are made absolute against the current directory at load time; ``~`` is expanded.
* Secrets (:class:`Secret`) never appear in ``repr``/``str``, :meth:`Settings.redacted` or any error message.

Exception tree::

    Exception
    └── ConfigError      bad file (missing, unreadable, YAML syntax, unknown key, wrong type, out of
                         range) or bad environment variable; the message names ``file:line:column``
                         or the variable, and says what was expected.

Unknown ``AGENT_*`` environment variables are ignored (other tools use that prefix too);
:func:`suspicious_env_vars` lists the ones that look like misspelled settings.
"""

from __future__ import annotations

import difflib
import os
import socket
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from ckagent.node.configschema import (
    BY_ENV,
    REMOVED_ENV,
    REMOVED_SETTINGS,
    SECTION_CLASSES,
    SECTIONS,
    SETTINGS,
    AgentSettings,
    DepsSettings,
    HeartbeatSettings,
    LoggingSettings,
    ServerSettings,
    Setting,
    Settings,
    TaskSettings,
    specs_in,
)
from ckagent.node.configvalues import AUTO_IP, HOSTNAME, Invalid, Secret, label_key
from ckagent.node.errors import EXIT_USAGE, StartupError
from ckagent.node.secretenv import agent_environ

__all__ = [
    "REMOVED_SETTINGS",
    "SETTINGS",
    "AgentSettings",
    "ConfigError",
    "DepsSettings",
    "HeartbeatSettings",
    "LoggingSettings",
    "Secret",
    "ServerSettings",
    "Setting",
    "Settings",
    "TaskSettings",
    "detect_local_ip",
    "load_settings",
    "missing_token_message",
    "suspicious_env_vars",
]


class ConfigError(StartupError):
    """The configuration is unusable. ``str(err)`` is one line naming ``file:line:column`` or the env var.

    The message never contains a secret value. Exit code 2 (ckagent.node.errors).
    """

    exit_code = EXIT_USAGE
    label = "config error"



def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe_node(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


class _FileReader:
    """Turns the composed YAML tree into {env var name: value}, raising ConfigError with positions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)

    def where(self, node: yaml.Node) -> str:
        mark = node.start_mark
        return f"{self.name}:{mark.line + 1}:{mark.column + 1}"

    def fail(self, node: yaml.Node, message: str) -> ConfigError:
        return ConfigError(f"{self.where(node)}: {message}")

    def read(self) -> dict[str, Any]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"{self.name}: config file not found") from None
        except IsADirectoryError:
            raise ConfigError(f"{self.name}: config file is a directory") from None
        except OSError as exc:
            raise ConfigError(f"{self.name}: cannot read config file: {exc.strerror or exc}") from None
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise ConfigError(f"{self.name}:{line}: config file is not valid UTF-8") from None
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{self.name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else self.name
            problem = exc.problem or exc.context or "invalid YAML"
            raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{self.name}: YAML error: {exc}") from None
        if root is None or _is_null(root):
            return {}
        if not isinstance(root, yaml.MappingNode):
            raise self.fail(
                root, f"the top level must be a mapping of sections ({', '.join(SECTIONS)}), "
                f"got {_describe_node(root)}"
            )
        values: dict[str, Any] = {}
        for section, section_node in self._pairs(root, prefix=""):
            if section not in SECTION_CLASSES:
                raise self.fail(
                    section_node[0],
                    f"unknown section {section!r}{_did_you_mean(section, list(SECTIONS))}",
                )
            value_node = section_node[1]
            if _is_null(value_node):
                continue
            if not isinstance(value_node, yaml.MappingNode):
                raise self.fail(
                    value_node, f"{section}: expected a mapping of settings, got {_describe_node(value_node)}"
                )
            specs = {s.key: s for s in specs_in(section)}
            for key, (key_node, node) in self._pairs(value_node, prefix=f"{section}."):
                spec = specs.get(key)
                removed = REMOVED_SETTINGS.get(f"{section}.{key}")
                if spec is None and removed is not None:
                    if _is_null(node):
                        continue  # the line of an older sample config: harmless
                    raise self.fail(key_node, f"'{section}.{key}' is no setting any more: {removed}")
                if spec is None:
                    raise self.fail(
                        key_node, f"unknown key '{section}.{key}'{_did_you_mean(key, list(specs))}"
                    )
                if _is_null(node):
                    continue
                values[spec.env] = self._value(spec, node)
        return values

    def _pairs(self, mapping: yaml.MappingNode, *, prefix: str) -> Iterator[tuple[str, tuple[yaml.Node, yaml.Node]]]:
        seen: set[str] = set()
        for key_node, value_node in mapping.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.fail(key_node, f"expected a name as key, got {_describe_node(key_node)}")
            key = str(key_node.value)
            if key in seen:
                raise self.fail(key_node, f"duplicate key '{prefix}{key}'")
            seen.add(key)
            yield key, (key_node, value_node)

    def _value(self, spec: Setting, node: yaml.Node) -> Any:
        if spec.mapping:
            return self._mapping_value(spec, node)
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, f"{spec.dotted}: expected a single value, got {_describe_node(node)}")
        try:
            return spec.parse(str(node.value))
        except Invalid as exc:
            raise self.fail(node, f"{spec.dotted}: {_problem(spec, exc, node.value)}") from None

    def _mapping_value(self, spec: Setting, node: yaml.Node) -> Mapping[str, str]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{spec.dotted}: expected a mapping of str to str, got {_describe_node(node)}")
        result: dict[str, str] = {}
        for key, (key_node, value_node) in self._pairs(node, prefix=f"{spec.dotted}."):
            try:
                key = label_key(key)
            except Invalid as exc:
                raise self.fail(key_node, f"{spec.dotted}: {exc.problem}, got {key!r}") from None
            if not isinstance(value_node, yaml.ScalarNode) or _is_null(value_node):
                raise self.fail(
                    value_node,
                    f"{spec.dotted}.{key}: expected a string value, got "
                    f"{'null' if _is_null(value_node) else _describe_node(value_node)}",
                )
            result[key] = str(value_node.value)
        return types.MappingProxyType(result)


def _problem(spec: Setting, exc: Invalid, raw: str) -> str:
    if exc.show_value and not spec.secret:
        return f"{exc.problem}, got {raw!r}"
    return exc.problem


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for spec in SETTINGS:
        raw = env.get(spec.env)
        if raw is None or not raw.strip():
            continue
        try:
            values[spec.env] = spec.parse(raw)
        except Invalid as exc:
            raise ConfigError(f"{spec.env}: {_problem(spec, exc, raw)}") from None
    return values


def detect_local_ip(server_url: str) -> str:
    """The local address this host would use to reach ``server_url``'s host, else "127.0.0.1".

    "Connects" a UDP socket (which sends no packet) and reads its local address. Blocks for name
    resolution of the server host; never raises.
    """
    parts = urlsplit(server_url)
    host = parts.hostname or "127.0.0.1"
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            local = sock.getsockname()[0]
    except (OSError, ValueError, IndexError):
        return "127.0.0.1"
    if not isinstance(local, str) or local in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return local


def load_settings(
    path: Path | None, env: Mapping[str, str] | None = None, *, require_token: bool = True
) -> Settings:
    """Load and validate the configuration.

    ``path``: the YAML file, or None for defaults + environment only. ``env`` defaults to ``os.environ``
    plus the credentials inherited in a memory file (ckagent.node.secretenv.agent_environ).
    ``require_token``: fail when no registration token is set (``ckagent run`` needs one).

    Relative paths resolve against the current directory; ``agent.ip`` may resolve the server host name
    (blocking). Raises :class:`ConfigError` on any problem, with a message naming the file position
    or the environment variable.
    """
    environ: Mapping[str, str] = agent_environ() if env is None else env
    values: dict[str, Any] = {}
    config_file: Path | None = None
    if path is not None:
        config_file = Path(os.path.abspath(path))
        values.update(_FileReader(Path(path)).read())
    values.update(_read_env(environ))

    def get(spec: Setting) -> Any:
        if spec.env in values:
            return values[spec.env]
        default = spec.default
        if default is HOSTNAME:
            return socket.gethostname() or "localhost"
        if default is AUTO_IP:
            return detect_local_ip(get(BY_ENV["AGENT_SERVER_URL"]))
        if isinstance(default, Path):
            return Path(os.path.abspath(default))
        return default

    sections: dict[str, Any] = {}
    for section, cls in SECTION_CLASSES.items():
        sections[section] = cls(**{spec.key: get(spec) for spec in specs_in(section)})
    settings = Settings(**sections, config_file=config_file)
    if require_token and settings.agent.registration_token is None:
        raise ConfigError(missing_token_message())
    return settings



def missing_token_message() -> str:
    """The one-line explanation used when no registration token is configured."""
    return (
        "no registration token: set agent.registration_token in the config file "
        "or the AGENT_REGISTRATION_TOKEN environment variable"
    )


def suspicious_env_vars(env: Mapping[str, str] | None = None) -> list[str]:
    """Warnings for ``AGENT_*`` variables that are no setting but look like one (likely typos).

    Returns one line per variable, e.g. "AGENT_SERVR_URL is not a setting (did you mean AGENT_SERVER_URL?)".
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    known = list(BY_ENV)
    out: list[str] = []
    for name in sorted(environ):
        if not name.startswith("AGENT_") or name in BY_ENV:
            continue
        if name in REMOVED_ENV:
            out.append(f"{name} is ignored: {REMOVED_SETTINGS[REMOVED_ENV[name]]}")
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            out.append(f"{name} is not a setting (did you mean {close[0]}?)")
    return out


if __name__ == "__main__":  # the docs generator's former command, kept working
    from ckagent.node.configdocs import main

    raise SystemExit(main(sys.argv[1:]))
