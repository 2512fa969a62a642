// Node demo spider for CrawlerKeeper: crawls the demo shop with fetch (Node 18+) and writes one JSON
// object per product, one per line, to the file named by CK_ITEMS_FILE (the agent ships each line to
// the master as an item). Outside the agent the items go to stdout instead.
//
// Start URL, first found wins: the task parameter start_url (CK_PARAMS), DEMO_SITE_URL,
// http://127.0.0.1:8080/demo-site/. Run: `node index.js`.
"use strict";

const fs = require("fs");

const MAX_PAGES = 1000;

function saveItem(item) {
  const line = JSON.stringify(item) + "\n";
  if (process.env.CK_ITEMS_FILE) {
    fs.appendFileSync(process.env.CK_ITEMS_FILE, line); // whole lines, O_APPEND: safe next to other writers
  } else {
    process.stdout.write(line);
  }
}

function parsePage(html) {
  const products = [];
  const re = /<li class="product"><a class="title" href="([^"]*)">([^<]*)<\/a>\s*<span class="price">([^<]*)<\/span>\s*<span class="sku">([^<]*)<\/span><\/li>/g;
  let m;
  while ((m = re.exec(html)) !== null) {
    products.push({ href: m[1], title: m[2].trim(), price: m[3].trim(), sku: m[4].trim() });
  }
  const next = /<a class="next" href="([^"]*)">/.exec(html);
  return { products, next: next ? next[1] : null };
}

async function main() {
  const params = JSON.parse(process.env.CK_PARAMS || "{}");
  let url = params.start_url || process.env.DEMO_SITE_URL || "http://127.0.0.1:8080/demo-site/";
  console.log(`crawling ${url} with node ${process.version}`);
  const seen = new Set();
  let page = 0;
  let total = 0;
  while (url && !seen.has(url) && page < MAX_PAGES) {
    seen.add(url);
    page += 1;
    const response = await fetch(url, { headers: { "User-Agent": "crawlerkeeper-node-demo/1.0" } });
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    const { products, next } = parsePage(await response.text());
    for (const p of products) {
      saveItem({ title: p.title, price: Number(p.price), sku: p.sku, url: new URL(p.href, url).href, page });
    }
    total += products.length;
    console.log(`page ${page}: ${products.length} products`);
    url = next ? new URL(next, url).href : null;
  }
  console.log(`done: ${total} items from ${page} pages`);
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
