"""What of a task's ``env`` reaches its installers, and which of it enters the environment's key.

The task's ``env`` (with the node's ``task.extra_env``) reaches uv and npm as it reaches the spider,
but for what the builder must never be given (below): a per-spider index (``UV_INDEX_URL``, ``UV_DEFAULT_INDEX``, ``UV_EXTRA_INDEX_URL``), an npm
registry or token (``NPM_CONFIG_REGISTRY``, ``NPM_TOKEN`` used by an ``.npmrc``), a proxy,
``PUPPETEER_SKIP_DOWNLOAD``. The agent's own secrets never do (installers start from the same
minimal base as spiders). The values of secret-named variables are masked in the install log and
in the DEPS_FAILED message, as everywhere in the task log.

Environments stay shared and content-addressed. The variables that change *what* an install puts
into the environment are part of its key (:func:`install_key_env`), so two spiders with different
values never share one:

- names starting with one of :data:`KEY_PREFIXES` (uv's and pip's settings, npm/yarn/pnpm config,
  the download switches of browser and binary packages), and
- the names in :data:`KEY_NAMES` (``NODE_ENV``: npm leaves dev dependencies out under
  ``production``).

Left out of the key: credentials (names ending in TOKEN, SECRET, PASSWORD, PASSWD, KEY or AUTH —
they decide whether a download is allowed, not what it is, and must not be hashed into a path
name) and proxies (how packages travel, not which). A change of a left-out variable reuses the
environment built before.

**What the installers never get** (:func:`installer_env`). Installers run as the node's builder
(ckagent.code.builder), which must never run a program or load a file a spider chose: a spider can
write its own directories, and anything of its that the builder ran would run with the builder's
rights over the shared caches and the environments being built. So the variables that make a program
load or run something, or that move the builder's own places, reach the spider but not its
installers (:func:`withheld`), and the task log names each one left out:

- the loader, the shells and the interpreters: ``LD_*``, ``DYLD_*``, ``GLIBC_TUNABLES``,
  ``GCONV_PATH``, ``BASH_ENV``, ``ENV``, ``SHELL``, ``NODE_OPTIONS``, ``NODE_PATH``, ``PYTHONPATH``,
  ``PYTHONSTARTUP``, ``PYTHONHOME``, ``PYTHONUSERBASE``, ``PYTHONBREAKPOINT``,
  ``PYTHONPYCACHEPREFIX``, ``PERL5LIB``, ``PERL5OPT``, ``RUBYOPT``, ``OPENSSL_CONF``…;
- the builder's places: ``PATH``, ``HOME``, ``TMPDIR``/``TMP``/``TEMP``, ``XDG_*``, ``VIRTUAL_ENV``;
- compilers and their flags (a flag loads plugins: ``-fplugin``, ``-B``): ``CC``, ``CXX``, ``CFLAGS``,
  ``LDFLAGS``, ``PKG_CONFIG_PATH``…, ``CARGO_*``, ``RUSTFLAGS``, ``CMAKE_*``; git's settings
  (``GIT_*``: ``GIT_SSH_COMMAND``, ``GIT_CONFIG_*``); nvm's (``NVM_*``);
- an install tool's setting that names a file, a directory or a program (a name starting with one
  of :data:`KEY_PREFIXES` and ending in ``_DIR``, ``_PATH``, ``_HOME``, ``_FILE``, ``_CACHE``,
  ``_SHELL``, ``_OPTIONS``, ``_CONFIG``, ``_PREFIX``, ``_GIT``, ``_PYTHON``, ``_FIND_LINKS``…:
  ``UV_CACHE_DIR``, ``UV_CONFIG_FILE``, ``NPM_CONFIG_SCRIPT_SHELL``, ``NPM_CONFIG_USERCONFIG``,
  ``PIP_FIND_LINKS``, ``PUPPETEER_CACHE_DIR``).

An index, a registry, proxies and switches (``PUPPETEER_SKIP_DOWNLOAD``, ``NPM_CONFIG_PRODUCTION``)
still reach them: they choose *what* is installed, not *what runs* it. A secret-named variable reaches
them only when an install tool reads it: a tool's own setting (``UV_INDEX_<NAME>_PASSWORD``,
``NPM_CONFIG__AUTH``), one of :data:`INSTALL_SECRETS` (``NPM_TOKEN``), or one the project's staged
install files name as ``${NAME}`` (an ``.npmrc``'s ``${MY_REGISTRY_TOKEN}``); the others (a
``DB_PASSWORD``) stay the spider's — every install runs as the one builder, and another install
running at the same time could read what a builder process was given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEY_PREFIXES = ("UV_", "PIP_", "SETUPTOOLS_", "NPM_CONFIG_", "YARN_", "PNPM_", "COREPACK_", "PUPPETEER_",
                "PLAYWRIGHT_", "CYPRESS_", "ELECTRON_", "SASS_", "SHARP_", "PRISMA_", "CHROMEDRIVER_")
"""Prefixes (case-insensitive) of variables that change what an install does."""
KEY_NAMES = frozenset({"NODE_ENV"})
"""Single variables that change what an install does (the compilers and their flags would too, but they never
reach the installers: :func:`withheld`)."""
_CREDENTIAL = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|KEY|AUTH)$", re.IGNORECASE)


def changes_install(name: str) -> bool:
    """Whether the variable ``name`` enters the environment's key (see the module docstring)."""
    if _CREDENTIAL.search(name) or "AUTH" in name.upper():
        return False
    upper = name.upper()
    return upper in KEY_NAMES or upper.startswith(KEY_PREFIXES)


def install_key_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that enters an environment's key: ``{name: value}``, sorted by name (of
    what reaches the installers: :func:`installer_env`)."""
    return {name: env[name] for name in sorted(env) if changes_install(name) and not withheld(name)}


_WITHHELD_NAMES = frozenset({
    # the builder's own places
    "PATH", "HOME", "TMPDIR", "TMP", "TEMP", "VIRTUAL_ENV", "CONDA_PREFIX", "PWD", "OLDPWD", "CDPATH",
    # shells, interpreters and libraries that load or run a file they are given
    "SHELL", "BASH_ENV", "ENV", "IFS", "PS4", "PROMPT_COMMAND", "SHELLOPTS", "BASHOPTS", "GLIBC_TUNABLES",
    "GCONV_PATH", "LOCPATH", "NLSPATH", "HOSTALIASES", "RESOLV_HOST_CONF", "NODE_OPTIONS", "NODE_PATH",
    "NODE_REPL_EXTERNAL_MODULE", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONUSERBASE",
    "PYTHONEXECUTABLE", "PYTHONBREAKPOINT", "PYTHONPYCACHEPREFIX", "PYTHONPLATLIBDIR", "PERL5LIB", "PERLLIB",
    "PERL5OPT", "PERL5DB", "RUBYOPT", "RUBYLIB", "OPENSSL_CONF", "OPENSSL_ENGINES", "OPENSSL_MODULES",
    "WGETRC", "CURL_HOME", "EDITOR", "VISUAL", "PAGER", "BROWSER", "SSH_ASKPASS", "SUDO_ASKPASS",
    # compilers and build tools, and flags that load plugins or pick programs (-fplugin, -B, -specs)
    "CC", "CXX", "CPP", "LD", "AR", "AS", "NM", "RANLIB", "STRIP", "OBJCOPY", "OBJDUMP", "FC", "F77", "F90",
    "NVCC", "CUDAHOSTCXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED", "FFLAGS", "ARCHFLAGS",
    "PKG_CONFIG", "PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR", "PKG_CONFIG_SYSROOT_DIR", "RUSTC", "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER", "RUSTFLAGS", "RUSTDOCFLAGS", "MAKE", "MAKEFLAGS", "MFLAGS", "GNUMAKEFLAGS",
    "SETUPTOOLS_USE_DISTUTILS", "DISTUTILS_DEBUG", "MAX_JOBS",
})
_WITHHELD_PREFIXES = ("LD_", "DYLD_", "GIT_", "XDG_", "CARGO_", "RUSTUP_", "CMAKE_", "NVM_", "PYTHONDEV",
                      "MALLOC_", "UV_PYTHON", "UV_TOOL", "UV_INSTALL", "UV_PROJECT")
_TOOL_PLACES = ("DIR", "DIRS", "PATH", "PATHS", "HOME", "FILE", "FILES", "FILENAME", "FOLDER", "CACHE", "STORE",
                "ROOT", "PREFIX", "SHELL", "COMMAND", "CMD", "EXECUTABLE", "EXEC", "BIN", "BINARY", "OPTIONS",
                "CONFIG", "USERCONFIG", "GLOBALCONFIG", "RC", "SCRIPT", "MODULE", "GIT", "PYTHON", "NODE",
                "GYP", "TMP", "TEMP", "EDITOR", "BROWSER", "VIEWER", "LINKS", "CONSTRAINT", "CONSTRAINTS",
                "OVERRIDE", "OVERRIDES", "LOCATION", "DEST", "TARGET", "SRC", "PLUGINS", "LOG", "LOGS",
                "LOGFILE", "HOOK", "HOOKS", "WRAPPER")
"""Last words of an install tool's setting (a :data:`KEY_PREFIXES` name) that names a file, a directory or
a program (``UV_CACHE_DIR``, ``NPM_CONFIG_SCRIPT_SHELL``, ``PIP_FIND_LINKS``, ``YARN_YARN_PATH``)."""
_WORDS = re.compile(r"[^A-Z0-9]+")
_SWITCHES = frozenset({"NO", "SKIP", "DISABLE", "IGNORE"})
"""First words of a tool setting that turns something off: a switch, whatever its last word."""


def withheld(name: str) -> bool:
    """Whether the task's variable ``name`` is kept from the installers (see the module docstring)."""
    upper = name.upper()
    if upper in _WITHHELD_NAMES or upper.startswith(_WITHHELD_PREFIXES):
        return True
    if not upper.startswith(KEY_PREFIXES) or _CREDENTIAL.search(upper):
        return False
    prefix = next(p for p in KEY_PREFIXES if upper.startswith(p))
    words = [w for w in _WORDS.split(upper[len(prefix):]) if w]
    if words and words[0] in _SWITCHES:  # UV_NO_CACHE, PIP_NO_CACHE_DIR, PUPPETEER_SKIP_DOWNLOAD: on or off
        return False
    return bool(words) and (words[-1] in _TOOL_PLACES or "_".join(words[-2:]) in _TOOL_PLACES)


INSTALL_SECRETS = frozenset({"NPM_TOKEN", "NODE_AUTH_TOKEN", "NPM_AUTH_TOKEN", "GITHUB_TOKEN", "GH_TOKEN"})
"""Secret-named variables install tools (or the usual ``.npmrc``) read without a tool prefix."""
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-[^}]*)?\}")


def secret(name: str) -> bool:
    """Whether ``name`` is secret-named (…TOKEN, …SECRET, …PASSWORD, …PASSWD, …KEY, or containing AUTH)."""
    return bool(_CREDENTIAL.search(name)) or "AUTH" in name.upper()


def referenced(text: str) -> set[str]:
    """The variables ``text`` (an ``.npmrc``, a requirements file) names as ``${NAME}``: the tool
    reading it expands them, so they reach the installers even when secret."""
    return set(_REFERENCE.findall(text))


@dataclass(frozen=True)
class InstallerEnv:
    """What of a task's env reaches its installers (``env``), and what not: ``withheld`` (names that
    would make the builder run or load something, or move its places: see the module docstring) and
    ``secrets`` (secret-named variables no install tool reads: they stay the spider's, so another
    install running as the builder at the same time never sees them)."""

    env: dict[str, str]
    withheld: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()

    def notice(self) -> str | None:
        """A line for the task log naming what was kept from the installers (None: nothing was)."""
        parts = []
        if self.withheld:
            parts.append(f"{', '.join(self.withheld)} (they would make the builder run or load a file of the "
                         "spider's, or move its own places)")
        if self.secrets:
            parts.append(f"{len(self.secrets)} secret-named variable(s) no install tool reads "
                         f"({', '.join(self.secrets)})")
        if not parts:
            return None
        return ("the task's env reaches the spider whole, but not its installers, which run as the node's "
                "builder: " + "; ".join(parts))


def installer_env(task_env: dict[str, str], named: set[str] | frozenset[str] = frozenset()) -> InstallerEnv:
    """What of the task's ``env`` reaches its installers (see :class:`InstallerEnv` and the module
    docstring). ``named``: variables the staged install files reference (:func:`referenced`): a
    secret among them reaches the installers."""
    env: dict[str, str] = {}
    kept_out: list[str] = []
    secrets: list[str] = []
    for name, value in task_env.items():
        upper = name.upper()
        if withheld(name):
            kept_out.append(name)
        elif secret(name) and not (upper.startswith(KEY_PREFIXES) or upper in INSTALL_SECRETS or name in named):
            secrets.append(name)
        else:
            env[name] = value
    return InstallerEnv(env, tuple(sorted(kept_out)), tuple(sorted(secrets)))
