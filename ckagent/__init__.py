"""ckagent — the CrawlerKeeper node agent.

The version below is the single source of truth: pyproject.toml, the CLI, registration and the
build scripts all read it from here.
"""

__version__ = "0.1.0"
