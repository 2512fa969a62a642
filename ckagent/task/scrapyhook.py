"""Moved to ckagent.code.scrapyhook (Scrapy's hooks are its framework record's: ckagent.code.frameworks)."""

from ckagent.code.scrapyhook import HOOK_VAR, HOW_TO_COLLECT, attaches, scrapy_hook

__all__ = ["HOOK_VAR", "HOW_TO_COLLECT", "attaches", "scrapy_hook"]
