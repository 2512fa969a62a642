"""``python -m ckagent`` and the ``ckagent`` command (its entry point): the CLI.

``supervise`` goes straight to ckagent.pod, without the command line's imports (settings, cyclopts):
it is a pod's PID 1 for the pod's whole life, and holds only what it needs (17 MB resident).
"""

import sys


def main() -> None:
    """Run the command line of ``sys.argv``; never returns (exits with the command's code)."""
    if sys.argv[1:2] == ["supervise"]:
        from ckagent.pod.command import main as supervise

        supervise(sys.argv[2:])
    from ckagent.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
