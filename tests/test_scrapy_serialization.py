"""Scrapy items reach the master byte for byte as the project's own ``scrapy crawl -o items.jsonl`` writes them.

A small real Scrapy project, built here (Scrapy itself installed by the agent from the index, as for
every Scrapy spider), yields a corpus of field types ScrapyJSONEncoder has rules for: datetimes
(naive, with microseconds, aware), dates, times, Decimals (small, huge, exponent), sets, tuples,
nested ``scrapy.Item`` and dataclass items, a field with its own ``serializer``, a Request, big
integers, floats, non-ASCII and U+2028 text. Each crawl runs under a real agent against the reference
master with the project's own feed beside the agent's (``-o own.jsonl``); the agent's items (its
spool, what it sends) equal the project's feed line for line, byte for byte, and the master's
items equal them as JSON. The project's own JSON array feed declared in ``outputs.items`` gives the same bytes (taken as
written, not re-typed). Two spiders: one with ``FEED_EXPORT_ENCODING = "utf-8"`` (what
``scrapy startproject`` writes), one without (Scrapy then escapes non-ASCII as ``\\u``), one started
by ``scrapy crawl``, one by a script building a ``CrawlerProcess``; and the SDK's pipeline, enabled
by the command line, encodes as the agent's feed does.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, assert_default_identity, running_agent

from ckagent.devmaster.client import zip_files
from ckagent.master.ids import task_dir

pytestmark = pytest.mark.slow
TIMEOUT = 600.0

ITEMS = textwrap.dedent('''
    import dataclasses
    from decimal import Decimal

    import scrapy


    class Product(scrapy.Item):
        name = scrapy.Field()
        price = scrapy.Field()
        label = scrapy.Field(serializer=lambda value: f"<{value}>")


    @dataclasses.dataclass
    class Offer:
        seller: str
        amount: Decimal
''')

SPIDER = textwrap.dedent('''
    import datetime as dt
    from decimal import Decimal

    import scrapy

    from corpus.items import Offer, Product


    def corpus(response):
        when = dt.datetime(1907, 2, 1)
        yield {"when": when, "day": dt.date(1907, 2, 1), "at": dt.time(12, 30, 1)}
        yield {"micro": dt.datetime(2020, 1, 1, 12, 0, 0, 123456),
               "aware": dt.datetime(2020, 5, 17, 10, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))}
        yield {"price": Decimal("19.90"), "huge": Decimal("1E+30"), "tiny": Decimal("0.000001"),
               "float": 0.1 + 0.2, "int": 2 ** 70, "none": None, "yes": True}
        yield {"tags": {"only"}, "list": [when, {"k": Decimal("2")}], "tuple": (1, dt.date(2000, 1, 2))}
        yield {"nested": Product(name="inner", price=Decimal("1.50"), label="x"),
               "offer": Offer(seller="s\u00e9ller", amount=Decimal("3.0"))}
        yield Product(name="caf\u00e9 \u2013 \u6771\u4eac \u2028 line", price=Decimal("9.99"), label="shown")
        yield Offer(seller="plain", amount=Decimal("-0.5"))
        yield {"request": response.request, "text": "quote \\" backslash \\\\ tab \\t"}


    class CorpusSpider(scrapy.Spider):
        name = "corpus"
        custom_settings = {"FEED_EXPORT_ENCODING": "utf-8"}

        async def start(self):  # Scrapy >= 2.13
            yield scrapy.Request("data:,corpus", callback=self.parse)

        def start_requests(self):  # older Scrapy
            yield scrapy.Request("data:,corpus", callback=self.parse)

        def parse(self, response):
            yield from corpus(response)


    class AsciiSpider(CorpusSpider):
        name = "ascii"
        custom_settings = {}
''')

RUN = textwrap.dedent('''
    from scrapy.crawler import CrawlerProcess
    from scrapy.utils.project import get_project_settings

    settings = get_project_settings()
    settings.set("FEEDS", {"own.jsonl": {"format": "jsonlines"}})
    process = CrawlerProcess(settings)
    process.crawl("ascii")
    process.start()
''')

PROJECT = {
    "scrapy.cfg": "[settings]\ndefault = corpus.settings\n",
    "requirements.txt": "scrapy>=2.11\n",
    "corpus/__init__.py": "",
    "corpus/items.py": ITEMS,
    "corpus/settings.py": 'BOT_NAME = "corpus"\nSPIDER_MODULES = ["corpus.spiders"]\nROBOTSTXT_OBEY = False\n'
                          'LOG_LEVEL = "INFO"\n',
    "corpus/spiders/__init__.py": "",
    "corpus/spiders/corpus.py": SPIDER,
    "run.py": RUN,
}
COMMANDS = {
    "utf-8": ["scrapy", "crawl", "corpus", "-o", "own.jsonl"],
    "ascii-script": ["python", "run.py"],
    # The project's own JSON array feed declared as the task's items (the agent adds no feed of its
    # own): its objects are taken as written, so they equal the JSON Lines feed of the same crawl.
    "declared-json": ["scrapy", "crawl", "corpus", "-o", "own.json", "-o", "own.jsonl"],
    # The SDK's pipeline enabled instead (the agent's feed then steps aside): the same encoding.
    "pipeline": ["scrapy", "crawl", "corpus", "-o", "own.jsonl", "-s",
                 'ITEM_PIPELINES={"crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300}'],
}
OUTPUTS = {"declared-json": {"items": ["own.json"]}}


async def test_scrapy_items_are_the_projects_own_feed_byte_for_byte(
        dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="600", AGENT_MAX_WORKERS="1")
    package = zip_files(PROJECT)
    tasks: dict[str, str] = {}
    async with running_agent(nursery, settings):
        for name, command in COMMANDS.items():
            spider = await admin.create_spider(name=f"corpus-{name}", framework="scrapy", command=command,
                                               outputs=OUTPUTS.get(name))
            await admin.upload_package(spider, package)
            tasks[name] = await admin.create_task(spider)
        with trio.fail_after(TIMEOUT):
            results = {name: await admin.wait_task_final(t, TIMEOUT) for name, t in tasks.items()}
    for name, task_id in tasks.items():
        log = "\n".join(await admin.get_logs(task_id))
        assert results[name]["status"] == "SUCCESS", (name, results[name], log[-4000:])
        assert_default_identity(log)
        # The agent's feed, unless the project's own feed file is declared as the items.
        assert ("scraped items also go to the task's items file" in log) == (name not in (*OUTPUTS, "pipeline")), \
            log[-3000:]
        own = await admin.get_artifact(task_id, "own.jsonl")  # the project's own JSON Lines feed
        own_lines = own.splitlines(keepends=True)
        assert len(own_lines) == 8, (own, log[-6000:])
        spool = (task_dir(work_dir, task_id) / "items.jsonl").read_bytes()
        assert spool.splitlines(keepends=True) == own_lines, (name, spool, own)  # byte for byte, in order
        stored = await admin.get_items(task_id)
        assert stored == [json.loads(line) for line in own_lines]
        # What the encoder's rules give (Scrapy's: isoformat since 2.13, "%Y-%m-%d %H:%M:%S" before; never
        # the SDK's str() of a datetime with microseconds or a zone):
        when = stored[0]["when"]
        assert when in ("1907-02-01T00:00:00", "1907-02-01 00:00:00"), when
        iso = "T" in when
        assert stored[0] == {"when": when, "day": "1907-02-01", "at": "12:30:01"}
        assert stored[1] == ({"micro": "2020-01-01T12:00:00.123456", "aware": "2020-05-17T10:00:00+02:00"} if iso
                             else {"micro": "2020-01-01 12:00:00", "aware": "2020-05-17 10:00:00"})
        assert stored[2]["price"] == "19.90" and stored[2]["huge"] == "1E+30" and stored[2]["int"] == 2 ** 70
        assert stored[3] == {"tags": ["only"], "list": [when, {"k": "2"}], "tuple": [1, "2000-01-02"]}
        assert stored[4] == {"nested": {"name": "inner", "price": "1.50", "label": "x"},
                             "offer": {"seller": "s\u00e9ller", "amount": "3.0"}}
        assert stored[5]["label"] == "<shown>"  # the field's own serializer, as the feed applies it
        assert stored[7]["request"] == "<Request GET data:,corpus>"
        if name == "ascii-script":
            assert b"caf\\u00e9" in own_lines[5]
        else:
            assert "caf\u00e9".encode() in own_lines[5] and b"\\u2028" not in own_lines[5]
