# ruff: noqa  (sample legacy project for migrate_spiders.py, kept as spider teams wrote it)
"""crawlerkeeper_sdk 0.0.3 (copied into this project by hand)."""
import json
import os

__version__ = "0.0.3"


def save_item(item):
    path = os.environ.get("CK_ITEMS_FILE")
    line = json.dumps(dict(item), ensure_ascii=False)
    if not path:
        print(line)
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def get_params():
    """Old API, later replaced by task_context().params."""
    return json.loads(os.environ.get("CK_PARAMS") or "{}")
