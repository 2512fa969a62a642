#!/usr/bin/env bash
# publish.sh — release the agent: wheel + sdist to PyPI, ckagent.pyz + release index for run.sh.
#
#   build/publish.sh --dry-run    build, check artifacts, brand-word gate, write the release index; no token needed
#   build/publish.sh --publish    the same, then upload with uv publish
#
# Options: --repository-url URL (or PYPI_REPOSITORY_URL), --gate-file FILE (or RELEASE_GATE_FILE,
# default build/brand_words.txt), --pyz FILE (use a pyz built before), --uv FILE (the uv the release
# index names; default the dev venv's). Token (--publish only): PYPI_TOKEN, else the file
# PYPI_TOKEN_FILE (default ~/.pypi_token); never printed. Details: build/release.py, docs/deploy.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY="${PYTHON:-python3}"
exec "$PY" "$ROOT/build/release.py" --project agent "$@"
