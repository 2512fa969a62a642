"""``ckagent exec``'s several-valued options: ``--env A=1 B=2`` and ``--param n=3 tag=x`` (also one
option per value, and both mixed).

cyclopts gives each of them every word up to the next option (``consume_multiple``), so in
``ckagent exec --env A=1 B=2 ./spider`` it takes the folder for a third variable. Values are
``NAME=VALUE``; a word without ``=`` cannot be one: when the PATH is missing and exactly one list ends
with such a word, that word is the PATH (:func:`split_path`). Pure; no cyclopts import.
"""

from __future__ import annotations

from pathlib import Path

from ckagent.cli.localrun import ExecUsageError


def split_path(path: Path | None, env: list[str], param: list[str]) -> tuple[Path, list[str], list[str]]:
    """``(path, env, param)`` with the PATH taken back from the end of ``--env``/``--param`` values when
    cyclopts gave it to them (see the module docstring).

    Raises ExecUsageError when the PATH is missing (none given, or not one list ending with a word
    without ``=``); a word without ``=`` elsewhere is left for :func:`~ckagent.cli.localrun.parse_assignments`
    to refuse, naming it."""
    if path is not None:
        return path, env, param
    ends = [words for words in (env, param) if words and "=" not in words[-1]]
    if len(ends) != 1:
        raise ExecUsageError("PATH is missing: the spider's folder, .zip or .egg (ckagent exec PATH [options])")
    taken = ends[0][-1]
    return (Path(taken), env[:-1], param) if ends[0] is env else (Path(taken), env, param[:-1])
