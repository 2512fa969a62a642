"""What of a task's ``env`` reaches its installers, and which of it enters the environment's key.

The task's whole ``env`` (with the node's ``task.extra_env``) reaches uv and npm, as it reaches the
spider: a per-spider index (``UV_INDEX_URL``, ``UV_DEFAULT_INDEX``, ``UV_EXTRA_INDEX_URL``), an npm
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
  ``production``; the C compiler and its flags: they change what a source build produces).

Left out of the key: credentials (names ending in TOKEN, SECRET, PASSWORD, PASSWD, KEY or AUTH —
they decide whether a download is allowed, not what it is, and must not be hashed into a path
name) and proxies (how packages travel, not which). A change of a left-out variable reuses the
environment built before.
"""

from __future__ import annotations

import re

KEY_PREFIXES = ("UV_", "PIP_", "SETUPTOOLS_", "NPM_CONFIG_", "YARN_", "PNPM_", "COREPACK_", "PUPPETEER_",
                "PLAYWRIGHT_", "CYPRESS_", "ELECTRON_", "SASS_", "SHARP_", "PRISMA_", "CHROMEDRIVER_")
"""Prefixes (case-insensitive) of variables that change what an install does."""
KEY_NAMES = frozenset({"NODE_ENV", "CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "PKG_CONFIG_PATH"})
"""Single variables that change what an install does."""
_CREDENTIAL = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|KEY|AUTH)$", re.IGNORECASE)


def changes_install(name: str) -> bool:
    """Whether the variable ``name`` enters the environment's key (see the module docstring)."""
    if _CREDENTIAL.search(name) or "AUTH" in name.upper():
        return False
    upper = name.upper()
    return upper in KEY_NAMES or upper.startswith(KEY_PREFIXES)


def install_key_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that enters an environment's key: ``{name: value}``, sorted by name."""
    return {name: env[name] for name in sorted(env) if changes_install(name)}
