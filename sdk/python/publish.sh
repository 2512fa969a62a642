#!/usr/bin/env bash
# publish.sh — release the spider SDK (crawlerkeeper-sdk): wheel + sdist to PyPI.
#
#   sdk/python/publish.sh --dry-run    build, check artifacts, brand-word gate; no token needed, upload nothing
#   sdk/python/publish.sh --publish    the same, then upload with uv publish
#
# Options: --repository-url URL (or PYPI_REPOSITORY_URL), --gate-file FILE (or RELEASE_GATE_FILE,
# default build/brand_words.txt). Token: PYPI_TOKEN, else the file PYPI_TOKEN_FILE (default
# ~/.pypi_token); never printed. Version: build/bump_version.sh --sdk VERSION. See docs/deploy.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY="${PYTHON:-python3}"
exec "$PY" "$ROOT/build/release.py" --project sdk "$@"
