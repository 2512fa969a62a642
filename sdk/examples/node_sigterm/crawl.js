// Walks the demo site's listing slowly, keeping items in memory and writing them in batches — and,
// like many crawlers that hold a browser or a buffer, flushing and closing on SIGTERM. Started by
// `npm start`: npm runs this through `sh -c`, which passes no signal on; the agent signals this
// process itself. Items go to CK_ITEMS_FILE as JSON lines (stdout outside an agent).
const fs = require('fs');

const PARAMS = JSON.parse(process.env.CK_PARAMS || '{}');  // the task's params: start_url first
const START_URL = PARAMS.start_url || process.env.START_URL || 'http://127.0.0.1:8080/demo-site/';
const PAGE_DELAY_MS = Number(process.env.PAGE_DELAY_MS || 1000);
const BATCH = 100;
let buffer = [];
let stopping = false;

function flush() {
  if (buffer.length === 0) return;
  const lines = buffer.map((item) => JSON.stringify(item) + '\n').join('');
  if (process.env.CK_ITEMS_FILE) fs.appendFileSync(process.env.CK_ITEMS_FILE, lines);
  else process.stdout.write(lines);
  buffer = [];
}

process.on('SIGTERM', () => {
  stopping = true;
  const count = buffer.length;
  flush();
  console.log(`SIGTERM: flushed ${count} buffered items, closing`);
  process.exit(0);
});

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function crawl(url) {
  let page = 1;
  while (url && !stopping) {
    const html = await (await fetch(url)).text();
    for (const m of html.matchAll(/<li class="product">[\s\S]*?class="title"[^>]*>([^<]+)<[\s\S]*?class="sku">([^<]+)</g)) {
      buffer.push({ title: m[1].trim(), sku: m[2].trim(), page });
    }
    console.log(`page ${page}: ${buffer.length} items buffered`);
    if (buffer.length >= BATCH) flush();
    const next = html.match(/<a class="next" href="([^"]+)"/);
    url = next ? new URL(next[1], url).href : null;
    page += 1;
    await sleep(PAGE_DELAY_MS);
  }
  flush();
  console.log('done');
}

crawl(START_URL).catch((err) => { console.error(err); process.exit(1); });
