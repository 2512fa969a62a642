"""Scrapy's project data dir in the spider's data dir (ckagent.code.scrapydata) and the stop grace a task
gets (ckagent.task.stop.stop_grace): real files, links and uids; the e2e runs are tests/test_scrapy_data_e2e.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckagent.code.frameworks import SCRAPY_STOP_GRACE
from ckagent.code.scrapydata import LINK, SCRAPY_DIR, attach, remove_unused, size_of
from ckagent.delivery.diskwatch import Accounted, accounted_bytes
from ckagent.node.runas import RunAs
from ckagent.task.stop import stop_grace

SPIDER_UID = 61999


def _project(work: Path) -> None:
    (work / "scrapy.cfg").write_text("[settings]\ndefault = p.settings\n")
    (work / "sub" / "inner").mkdir(parents=True)
    (work / "sub" / "inner" / "scrapy.cfg").write_text("[settings]\ndefault = q.settings\n")
    (work / "own").mkdir()
    (work / "own" / "scrapy.cfg").write_text("[settings]\ndefault = r.settings\n[datadir]\ndefault = /srv/x\n")
    (work / "node_modules" / "x").mkdir(parents=True)
    (work / "node_modules" / "x" / "scrapy.cfg").write_text("")


def test_links_beside_each_scrapy_cfg_lead_to_the_data_dir_and_the_authors_choices_stay(tmp_path: Path) -> None:
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    data.mkdir()
    _project(work)
    found = attach(work, data, None)
    assert found.linked == ["", "sub/inner"]
    assert found.own_datadir == ["own/scrapy.cfg"]
    for rel in found.linked:
        link = work / rel / LINK
        assert link.is_symlink() and Path(os.readlink(link)) == data / SCRAPY_DIR
    assert not (work / "node_modules" / "x" / LINK).exists()
    # what Scrapy writes through the link lands in the data dir, once in the task's disk use
    (work / LINK / "httpcache").mkdir()
    (work / LINK / "httpcache" / "page").write_bytes(b"x" * 100_000)
    assert size_of(data, SCRAPY_DIR) >= 100_000
    used = accounted_bytes(Accounted((tmp_path / "none", work, data), None))
    assert 100_000 <= used < 2 * 100_000
    (tmp_path / "work2").mkdir()  # the spider's next task: a new working copy, the same data
    again = attach(tmp_path / "work2", data, None)
    assert again.size_bytes >= 100_000 and "kept from this spider's earlier tasks" in again.line()


def test_a_shipped_scrapy_dir_is_left_alone_and_clean_start_empties_the_data(tmp_path: Path) -> None:
    work, data = tmp_path / "work", tmp_path / "data"
    (work / LINK).mkdir(parents=True)
    data.mkdir()
    (work / "scrapy.cfg").write_text("")
    (data / SCRAPY_DIR / "httpcache").mkdir(parents=True)
    (data / SCRAPY_DIR / "httpcache" / "page").write_bytes(b"y" * 50_000)
    found = attach(work, data, None, clean=True)
    assert found.shipped == [LINK] and found.linked == []
    assert found.cleaned_bytes is not None and found.cleaned_bytes >= 50_000
    assert list((data / SCRAPY_DIR).iterdir()) == []
    assert "cleanStart: emptied" in found.line() and "the package's own .scrapy left alone" in found.line()


def test_a_link_the_spider_planted_in_its_data_dir_is_replaced_not_followed(tmp_path: Path) -> None:
    work, data, elsewhere = tmp_path / "work", tmp_path / "data", tmp_path / "elsewhere"
    for d in (work, data, elsewhere):
        d.mkdir()
    (elsewhere / "precious").write_text("keep")
    (data / SCRAPY_DIR).symlink_to(elsewhere)
    found = attach(work, data, None)
    assert found.replaced and found.size_bytes == 0 and "was not a directory: replaced" in found.line()
    assert (elsewhere / "precious").read_text() == "keep"
    assert (data / SCRAPY_DIR).is_dir() and not (data / SCRAPY_DIR).is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
def test_the_data_and_the_links_are_the_spiders_own(tmp_path: Path) -> None:
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    data.mkdir()
    run_as = RunAs.of_uid(SPIDER_UID, str(tmp_path))
    attach(work, data, run_as)
    st = os.stat(data / SCRAPY_DIR)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (SPIDER_UID, SPIDER_UID, 0o700)
    assert os.lstat(work / LINK).st_uid == SPIDER_UID


def test_retention_removes_the_data_of_spiders_idle_for_it_but_not_of_busy_ones(tmp_path: Path) -> None:
    for name in ("idle", "busy", "recent"):
        (tmp_path / "spider-data" / name / SCRAPY_DIR).mkdir(parents=True)
        (tmp_path / "spider-data" / name / SCRAPY_DIR / "f").write_text("x")
    old = time.time() - 10_000
    for name in ("idle", "busy"):
        os.utime(tmp_path / "spider-data" / name / SCRAPY_DIR, (old, old))
    assert remove_unused(tmp_path, 0, ()) == []  # retention 0: forever
    assert remove_unused(tmp_path, 3600, {"busy"}) == ["idle"]
    assert not (tmp_path / "spider-data" / "idle" / SCRAPY_DIR).exists()
    assert (tmp_path / "spider-data" / "busy" / SCRAPY_DIR / "f").exists()
    assert (tmp_path / "spider-data" / "recent" / SCRAPY_DIR / "f").exists()


@pytest.mark.parametrize(("framework", "asked", "kill_grace", "cap", "expected"), [
    ("scrapy", None, 10.0, float("inf"), SCRAPY_STOP_GRACE),  # Scrapy's graceful close of a polite crawl
    ("scrapy", None, 500.0, float("inf"), 500.0),  # a node that gives more keeps it
    ("python", None, 10.0, float("inf"), 10.0),  # the node's kill_grace for the others
    ("node", 30.0, 10.0, float("inf"), 30.0),  # the task's own
    ("scrapy", 0.0, 10.0, float("inf"), 0.0),
    ("scrapy", None, 10.0, 60.0, 60.0),  # cut to task.max_stop_grace
    ("python", 1e6, 10.0, 180.0, 180.0),
])
def test_stop_grace(framework: str, asked: float | None, kill_grace: float, cap: float, expected: float) -> None:
    grace, source = stop_grace(framework, asked, kill_grace, cap)
    assert grace == expected
    assert ("cut to task.max_stop_grace" in source) == (grace == cap)
