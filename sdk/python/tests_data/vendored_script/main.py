# ruff: noqa  (sample legacy project for migrate_spiders.py, kept as spider teams wrote it)
import crawlerkeeper_sdk as ck

if __name__ == "__main__":
    ck.save_item({"price": 10})
