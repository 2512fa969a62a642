# ruff: noqa  (sample legacy project for migrate_spiders.py, kept as spider teams wrote it)
"""crawlerkeeper_sdk 0.0.2 (a single-file copy pasted into this script project)."""
import json
import os

__version__ = "0.0.2"


def save_item(item):
    path = os.environ.get("CK_ITEMS_FILE")
    line = json.dumps(dict(item), ensure_ascii=False)
    if not path:
        print(line)
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
