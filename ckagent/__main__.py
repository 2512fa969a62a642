"""``python -m ckagent`` runs the CLI."""

from ckagent.cli import main

if __name__ == "__main__":
    main()
