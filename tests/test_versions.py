"""PEP 440 without dependencies (ckagent.node.versions and run.sh's embedded copy) agree with packaging."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest

from ckagent.node.versions import InvalidVersion, Version, version_key

packaging_version = pytest.importorskip("packaging.version")

VERSIONS = ["0", "0.0.1", "0.1", "0.1.0", "0.1.0.dev1", "0.1.0a1", "0.1.0a2.dev3", "0.1.0b1", "0.1.0rc1",
            "0.1.0c2", "0.1.0.post1", "0.1.0-1", "0.1.0.post1.dev2", "0.1.0+local.1", "0.1.0+local.a", "0.1.0+2",
            "0.2.0", "1.0", "1.0.0", "1!0.1", "v1.2", "1.10.0", "1.9.9", "99.0.0", "100.0.0", "2.0.0.dev0",
            "2.0.0alpha1", "2.0.0-beta.2", "2.0.0.PRE3", "1.0.post", "1.0rev4"]
INVALID = ["banana", "", "1.0-", "1..0", "latest", "1.0.0.dev1.post2", "v", "1.0+", "0x10"]
REPO = Path(__file__).resolve().parents[1]


def test_order_and_equality_match_packaging() -> None:
    for a, b in itertools.product(VERSIONS, repeat=2):
        pa, pb = packaging_version.Version(a), packaging_version.Version(b)
        va, vb = Version(a), Version(b)
        assert (va < vb, va == vb, va > vb) == (pa < pb, pa == pb, pa > pb), (a, b)


@pytest.mark.parametrize("text", INVALID)
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(packaging_version.InvalidVersion):
        packaging_version.Version(text)
    with pytest.raises(InvalidVersion, match="not a PEP 440 version"):
        version_key(text)


def _run_sh_vercmp(a: str, b: str) -> subprocess.CompletedProcess[str]:
    """run.sh's vercmp, cut out of the script and run alone."""
    script = (REPO / "run.sh").read_text()
    helpers = re.search(r"^py\(\) \{.*?^\}\n", script, re.M | re.S)
    vercmp = re.search(r"^vercmp\(\) \{.*?^\}\n", script, re.M | re.S)
    assert helpers and vercmp
    program = f'PYTHON=python3\n{helpers.group(0)}{vercmp.group(0)}vercmp "$1" "$2"\n'
    return subprocess.run(["bash", "-c", program, "vercmp", a, b], capture_output=True, text=True, timeout=30,
                          check=False)


def test_run_sh_compares_as_pep_440_and_refuses_anything_else() -> None:
    for a, b in [("1.10.0", "1.9.9"), ("0.1.0rc1", "0.1.0"), ("0.1.0", "0.1.0.post1"), ("1.0", "1.0.0"),
                 ("2.0.0.dev0", "2.0.0alpha1"), ("0.1.0+local.1", "0.1.0"), ("1!0.1", "99.0.0")]:
        expected = (Version(a) > Version(b)) - (Version(a) < Version(b))
        result = _run_sh_vercmp(a, b)
        assert result.returncode == 0 and result.stdout.strip() == str(expected), (a, b, result)
    for bad in ("banana", "latest", "1..0"):
        result = _run_sh_vercmp(bad, "0.1.0")
        assert result.returncode != 0 and result.stdout == ""
        assert f"not a PEP 440 version: {bad!r}" in result.stderr
