// A cheerio crawler: the listing pages of a shop, following "next" links.
// START_URL (environment), else the task parameter start_url (CK_PARAMS), points it at the target;
// items go through the SDK's helper.
import * as cheerio from "cheerio";
import { saveItem } from "./crawlerkeeper-sdk.cjs";

function paramStartUrl() {
  try {
    return JSON.parse(process.env.CK_PARAMS || "{}").start_url;
  } catch {
    return undefined;
  }
}

const startUrls = [process.env.START_URL ?? paramStartUrl() ?? "http://127.0.0.1:8080/demo-site/"];
const maxPages = Number(process.env.MAX_PAGES ?? 50);

async function crawl(url) {
  let pages = 0;
  let items = 0;
  while (url && pages < maxPages) {
    const response = await fetch(url, { headers: { "user-agent": "shop-crawler/0.0.1" } });
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    const $ = cheerio.load(await response.text());
    pages += 1;
    $("ul.products li.product").each((_, el) => {
      const link = $(el).find("a.title");
      saveItem({
        title: link.text().trim(),
        price: Number($(el).find("span.price").text()),
        sku: $(el).find("span.sku").text().trim(),
        url: new URL(link.attr("href"), url).href,
      });
      items += 1;
    });
    const next = $("a.next").attr("href");
    url = next ? new URL(next, url).href : null;
  }
  console.log(`crawled ${items} items from ${pages} pages with node ${process.version} (ESM)`);
}

for (const url of startUrls) {
  await crawl(url);
}
