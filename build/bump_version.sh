#!/usr/bin/env bash
# bump_version.sh — change the single version source of the agent (ckagent/__init__.py) or the SDK.
#
#   build/bump_version.sh 0.2.0            set the agent's version
#   build/bump_version.sh patch|minor|major  bump the agent's version (0.1.3 → 0.1.4 | 0.2.0 | 1.0.0)
#   build/bump_version.sh --sdk 0.2.0      the same for sdk/python (crawlerkeeper_sdk/__init__.py)
#   --root DIR                             operate on another checkout (default: this one)
#
# Prints "OLD -> NEW". Refuses a version that is not PEP 440 (N.N.N with optional aN/bN/rcN/.postN/.devN)
# and one that is not greater than the current one (exit 2). Commit the change yourself.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
FILE_REL="ckagent/__init__.py"
while (($#)); do
  case "$1" in
    --sdk) FILE_REL="sdk/python/src/crawlerkeeper_sdk/__init__.py"; shift ;;
    --root) ROOT="$(cd "$2" && pwd -P)"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "bump_version.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
(($# == 1)) || { echo "usage: build/bump_version.sh [--sdk] [--root DIR] VERSION|patch|minor|major" >&2; exit 2; }
exec "${PYTHON:-python3}" - "$ROOT/$FILE_REL" "$1" <<'PY'
import re, sys
path, wanted = sys.argv[1], sys.argv[2]
PEP440 = re.compile(r"(\d+)\.(\d+)\.(\d+)((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?")
text = open(path, encoding="utf-8").read()
line = re.compile(r'^__version__ = "([^"]+)"$', re.M)
match = line.search(text)
if not match:
    sys.exit(f"bump_version.sh: no '__version__ = \"...\"' line in {path}")
old = match.group(1)
parts = PEP440.fullmatch(old)
if wanted in ("patch", "minor", "major"):
    if not parts:
        sys.exit(f"bump_version.sh: current version {old!r} is not N.N.N; give the new version explicitly")
    major, minor, patch = (int(x) for x in parts.group(1, 2, 3))
    release = (major, minor, patch + 1) if wanted == "patch" and not parts.group(4) and not parts.group(7) else \
        (major, minor, patch) if wanted == "patch" else (major, minor + 1, 0) if wanted == "minor" else (major + 1, 0, 0)
    new = "%d.%d.%d" % release
elif PEP440.fullmatch(wanted):
    new = wanted
else:
    print(f"bump_version.sh: {wanted!r} is not a version (N.N.N[aN|bN|rcN][.postN][.devN]) nor patch|minor|major",
          file=sys.stderr)
    sys.exit(2)

def key(v):
    m = PEP440.fullmatch(v)
    pre = m.group(4) or ""
    pre_key = (3, 0) if not pre else ({"a": 0, "b": 1, "rc": 2}[re.match(r"[a-z]+", pre).group()], int(re.sub(r"\D", "", pre)))
    post = int(m.group(6)[5:]) if m.group(6) else -1
    dev = int(m.group(7)[4:]) if m.group(7) else 1 << 30
    if m.group(7) and not pre and not m.group(6):
        pre_key = (-1, 0)
    return (tuple(int(x) for x in m.group(1, 2, 3)), pre_key, post, dev)

if parts and key(new) <= key(old):
    print(f"bump_version.sh: {new} is not greater than the current {old}", file=sys.stderr)
    sys.exit(2)
with open(path, "w", encoding="utf-8") as fh:
    fh.write(line.sub(f'__version__ = "{new}"', text, count=1))
print(f"{old} -> {new}")
PY
