"""Package layout that pyproject.toml cannot express: the bundled spider SDK.

The agent makes ``crawlerkeeper_sdk`` importable in spider virtualenvs through a ``.pth`` file that
points at a directory holding only that package (``ckagent/code/deps.py: bundled_sdk_dir``). The wheel
therefore ships ``sdk/python/src/crawlerkeeper_sdk`` as ``ckagent/_sdk/crawlerkeeper_sdk`` — mapped
here with ``package_dir``, so git holds one copy. Everything else is configured in pyproject.toml.
"""

from setuptools import find_packages, setup

SDK_PACKAGE = "ckagent._sdk.crawlerkeeper_sdk"

setup(
    packages=[*find_packages(include=["ckagent", "ckagent.*"]), SDK_PACKAGE],
    package_dir={SDK_PACKAGE: "sdk/python/src/crawlerkeeper_sdk"},
)
