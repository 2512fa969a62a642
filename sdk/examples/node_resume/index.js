// A Node spider whose crawl survives its node (CrawlerKeeper SDK, no dependencies; Node 18+ for fetch).
//
// It crawls a site breadth-first from the task parameter start_url (CK_PARAMS; else START_URL; else
// http://127.0.0.1:8080/demo-site/), following every link to a URL that starts with the task parameter scope
// (default: the start URL's origin), and saves one item per page that has an <h1> (the demo shop's listing
// pages have none: they only lead to products): {url, title: the h1, page: how many items before it + 1},
// with price and sku (the first span.price / span.sku) when the page shows them — on the demo shop, its 30
// products. Its frontier and seen set are the task's state: the
// agent asks for them every checkpoint interval (onPersist) and before it moves the crawl to another node
// (onMigrating), and a later attempt, on any node, starts from them (loadState) — so each page's item reaches
// the master once.
//
// Task parameters: start_url; scope; max_pages (default 100000); delay_seconds between two pages (default 0).
// Run: `node index.js` (the agent does; so can you: outside an agent items are printed, nothing is persisted).
"use strict";

const ck = require("./crawlerkeeper-sdk.cjs");

const TRIES = 3;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function parsePage(html) {
  const text = (re) => { const m = re.exec(html); return m ? m[1].trim() : null; };
  const links = [];
  const re = /<a\b[^>]*\bhref\s*=\s*["']([^"']+)["']/gi;
  for (let m = re.exec(html); m !== null; m = re.exec(html)) links.push(m[1]);
  return {
    h1: text(/<h1\b[^>]*>([^<]*)<\/h1>/i),
    price: text(/<span class="price">([^<]*)<\/span>/),
    sku: text(/<span class="sku">([^<]*)<\/span>/),
    links,
  };
}

async function fetchPage(url) {
  for (let attempt = 0; ; attempt += 1) {
    try {
      const response = await fetch(url, { headers: { "User-Agent": "crawlerkeeper-node-resume/1.0" } });
      return { status: response.status, html: response.ok ? await response.text() : "" };
    } catch (err) {
      if (attempt === TRIES - 1) throw err;
      await sleep(1000 * (1 + attempt));
    }
  }
}

async function main() {
  const context = ck.taskContext();
  const params = context.params;
  const startUrl = params.start_url || process.env.START_URL || "http://127.0.0.1:8080/demo-site/";
  const maxPages = Number(params.max_pages || 100000);
  const delayMs = Number(params.delay_seconds || 0) * 1000;
  const scope = params.scope || `${new URL(startUrl).origin}/`;

  // The crawl's state: what is left to fetch, what was ever queued, how many pages are done.
  const saved = ck.loadState({ frontier: [startUrl], seen: [startUrl], pages: 0, items: 0 });
  const crawl = { frontier: saved.frontier, seen: new Set(saved.seen), pages: saved.pages, items: saved.items };
  let leaveAt = null; // Date.now() when the agent stops us (a migration), or null

  // Called by the SDK between two steps of this crawl: the live state, as it is at that instant.
  ck.onPersist(() => ({ frontier: crawl.frontier, seen: [...crawl.seen], pages: crawl.pages, items: crawl.items }));
  ck.onMigrating((secondsLeft) => {
    console.log(`migrating: the agent stops this spider in ${secondsLeft} s; no new pages`);
    leaveAt = Date.now() + (secondsLeft || 0) * 1000;
  });
  console.log(`attempt ${context.attempt}: ${crawl.pages} pages done (${crawl.items} items), ${crawl.frontier.length} to go from ${startUrl}`);

  while (crawl.frontier.length && crawl.pages < maxPages) {
    if (leaveAt !== null) {
      // The snapshot is taken: what we would fetch now is fetched again by the next attempt.
      await sleep(Math.max(0, leaveAt - Date.now()) + 10000);
      leaveAt = null; // still running long after the notice: the agent changed its mind
    }
    const url = crawl.frontier[0]; // left in the frontier until its item is saved
    const { status, html } = await fetchPage(url);
    const page = parsePage(html);
    // From here to the end of the step no await: the item and the state change that accounts for it are
    // one synchronous stretch, so a snapshot never falls between them.
    crawl.frontier.shift();
    crawl.pages += 1;
    if (status !== 200) {
      console.log(`${url}: HTTP ${status}, skipped`);
    } else if (page.h1 !== null) {
      crawl.items += 1;
      const item = { url, title: page.h1, page: crawl.items };
      if (page.price !== null) item.price = page.price;
      if (page.sku !== null) item.sku = page.sku;
      ck.saveItem(item);
    }
    for (const href of page.links) {
      const link = new URL(href, url);
      link.hash = "";
      if (link.href.startsWith(scope) && !crawl.seen.has(link.href)) {
        crawl.seen.add(link.href);
        crawl.frontier.push(link.href);
      }
    }
    ck.reportStats({ requests: crawl.pages, items: crawl.items });
    ck.progress(crawl.pages, null);
    if (delayMs) await sleep(delayMs);
  }
  console.log(`done: ${crawl.items} items from ${crawl.pages} pages`);
  ck.reportStats({ requests: crawl.pages, items: crawl.items, finishReason: "finished" }, { final: true });
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
