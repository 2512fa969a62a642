"""A Scrapyd egg end to end: built by `setup.py bdist_egg` from a Scrapyd-style project (scrapy.cfg
``[deploy]`` and setup.py's ``[scrapy]`` entry point: sdk/examples/scrapyd_shop), run through a real
agent against the reference master and by ``ckagent exec`` (the README's egg line), crawling the
demo shop: every product delivered, Scrapyd's conventions (params as ``-a``/``-s``, ``_job``, the
runner's variables) in force. Scrapy comes from the suite's PyPI access, as for the other Scrapy
examples. The egg's logic and hostile eggs: tests/test_eggs.py."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import SCRAPYD_SHOP, ExampleRuns, agent_settings, build_egg, recipe_words, running_agent

from ckagent.devmaster.demosite import expected_products

SHOP = sorted(product["sku"] for product in expected_products())
RUN_TIMEOUT = 900.0

pytestmark = pytest.mark.slow


async def _through_the_agent(dev_master: Any, nursery: trio.Nursery, tmp_path: Path, egg: bytes,
                             params: dict[str, Any], args: list[str]) -> tuple[dict[str, Any], list[Any], list[str]]:
    admin = dev_master.admin
    spider_id = await admin.create_spider(name="products", framework="scrapy")
    await admin.upload_package(spider_id, egg)
    work_dir = tmp_path / "agent"
    work_dir.mkdir()
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="600")
    async with running_agent(nursery, settings):
        task_id = await admin.create_task(spider_id, params=params, args=args)
        with trio.fail_after(RUN_TIMEOUT):
            task = await admin.wait_task_final(task_id, RUN_TIMEOUT)
    return task, await admin.get_items(task_id), await admin.get_logs(task_id)


async def test_a_built_egg_runs_through_the_agent_as_on_scrapyd(dev_master: Any, nursery: trio.Nursery,
                                                                 tmp_path: Path, example_runs: ExampleRuns) -> None:
    built = await trio.to_thread.run_sync(build_egg, SCRAPYD_SHOP, tmp_path / "dist")
    assert built.name.startswith("scrapyd_shop-1.0-py3")
    params = {"start_url": f"{dev_master.base_url}/demo-site/", "setting": "SHOP_LABEL=from-setting",
              "jobid": "job-7"}
    task, items, logs = await _through_the_agent(dev_master, nursery, tmp_path, built.read_bytes(), params,
                                                 ["-a", "tag=from-args"])
    text = "\n".join(logs)
    assert task["status"] == "SUCCESS", (task, text[-3000:])
    assert sorted(item["sku"] for item in items) == SHOP
    assert {(item["tag"], item["label"]) for item in items} == {("from-args", "from-setting")}
    assert "job job-7, project scrapyd_shop, settings scrapyd_shop.settings" in text
    assert "a Scrapyd egg (scrapyd-shop 1.0): settings scrapyd_shop.settings" in text
    # `ckagent exec` of the README's egg line (the bundled egg, built from the same folder) gives the same items.
    done = await example_runs.exec(recipe_words("scrapyd_shop"), dev_master.base_url)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.items == [{k: v for k, v in item.items() if k not in ("tag", "label")} for item in items]
    assert "a Scrapyd egg (scrapyd-shop 1.0)" in done.stdout
    assert " requests forwarded" in done.stdout  # at the proxy level, as the README recipe's test wants
    assert "[ckagent exec] outcome: SUCCESS, finish reason finished" in done.stderr


async def test_exec_runs_an_egg_shipped_in_a_zip_beside_its_requirements(dev_master: Any, tmp_path: Path,
                                                                          example_runs: ExampleRuns) -> None:
    """A zip holding the egg and its requirements.txt: the egg unpacked in its place, the requirements
    installed (which ones: tests/test_eggs.py); the task's params as Scrapyd's (-a, jobid) and its args (-s) as written."""
    package = tmp_path / "scrapyd_shop.zip"
    with zipfile.ZipFile(package, "w") as archive:
        archive.write(SCRAPYD_SHOP / "scrapyd_shop.egg", "scrapyd_shop.egg")
        archive.writestr("requirements.txt", "scrapy>=2.11\n")
    words = (str(package), "--spider", "products", "--param", "start_url=$URL", "--param", "jobid=j-1",
             "--param", "tag=from-param", "--args=-s SHOP_LABEL=from-args")
    done = await example_runs.exec(words, dev_master.base_url)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(item["sku"] for item in done.items) == SHOP
    assert {(item["tag"], item["label"]) for item in done.items} == {("from-param", "from-args")}
    assert "job j-1, project scrapyd_shop" in done.stdout
    assert "the package holds the Scrapyd egg scrapyd_shop.egg: unpacked in its place" in done.stdout
