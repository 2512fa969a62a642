"""``python -m ckagent.devmaster --db F --port P --registration-token T --admin-token A``: run the dev master."""

from __future__ import annotations

import sys

from ckagent.devmaster.server import main

if __name__ == "__main__":
    sys.exit(main())
