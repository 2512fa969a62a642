// crawlerkeeper-sdk.cjs — the CrawlerKeeper SDK for Node spiders: items, stats and progress, like the
// Python SDK.
//
// One file with no dependencies (Node 14+); copy it into your project. It works from CommonJS and from
// ES modules ("type": "module") alike:
//
//   import { saveItem, reportStats, progress, taskContext } from "./crawlerkeeper-sdk.cjs";   // ESM
//   const ck = require("./crawlerkeeper-sdk.cjs");                                              // CommonJS
//
//   saveItem({ title: "Product 01", price: 3.99 });      // one JSON line of CK_ITEMS_FILE
//   reportStats({ requests: 14, items: 120 });           // a complete stats snapshot (CK_STATS_FILE)
//   progress(3, 10);                                     // done / total (total may be null)
//   const { params, dataDir } = taskContext();           // CK_PARAMS as an object, CK_DATA_DIR
//   puppeteer.launch({ executablePath: process.env.CK_CHROMIUM_PATH, args: chromiumArgs() });
//   chromium.launch({ executablePath: process.env.CK_CHROMIUM_PATH, chromiumSandbox: chromiumSandbox() });
//                                                        // Chromium's own sandbox where the agent says it
//                                                        // works (CK_CHROMIUM_SANDBOX), else --no-sandbox
//
// Outside an agent (no CK_ITEMS_FILE) items are printed on stdout and stats are ignored. Writes are
// synchronous appends of whole lines (O_APPEND): safe next to other writers of the same file, never
// interleaved or lost when the process is stopped. Stats lines are coalesced: at most one per second;
// a pending one is written by a timer or when the process exits. reportStats(stats, { final: true })
// writes at once.
"use strict";

const fs = require("fs");

const MIN_INTERVAL_MS = 1000;
let current = { stats: {}, progress: null };
let pending = false;
let lastWrite = 0;
let timer = null;

function line(obj) {
  return JSON.stringify(obj).replace(/\u2028/g, "\\u2028").replace(/\u2029/g, "\\u2029") + "\n";
}

function saveItem(item) {
  if (item === null || typeof item !== "object" || Array.isArray(item)) {
    throw new TypeError("saveItem() takes an object (field -> value)");
  }
  const text = line(item);
  if (process.env.CK_ITEMS_FILE) appendWhole(process.env.CK_ITEMS_FILE, text);
  else process.stdout.write(text);
}

// A full disk (ENOSPC, EDQUOT) is waited out, never a lost or torn item: the agent stops the task that
// filled the disk and frees its space; until then this spider blocks here (as the Python SDK does).
const DISK_FULL = new Set(["ENOSPC", "EDQUOT"]);
const FULL_RETRY_MS = [50, 100, 200, 500, 1000];
const nap = new Int32Array(new SharedArrayBuffer(4));

function appendWhole(path, text) {
  const data = Buffer.from(text, "utf8");
  const fd = fs.openSync(path, "a");
  try {
    let done = 0;
    let tries = 0;
    while (done < data.length) {
      try {
        done += fs.writeSync(fd, data, done, data.length - done);
      } catch (err) {
        if (!DISK_FULL.has(err.code)) throw err;
        Atomics.wait(nap, 0, 0, FULL_RETRY_MS[Math.min(tries, FULL_RETRY_MS.length - 1)]);
        tries += 1;
      }
    }
  } finally {
    fs.closeSync(fd);
  }
}

function saveItems(items) {
  let n = 0;
  for (const item of items) {
    saveItem(item);
    n += 1;
  }
  return n;
}

function writeNow() {
  pending = false;
  if (timer) { clearTimeout(timer); timer = null; }
  const path = process.env.CK_STATS_FILE;
  if (!path) return;
  const snapshot = { time: Date.now() / 1000, stats: current.stats };
  if (current.progress) snapshot.progress = current.progress;
  fs.appendFileSync(path, line(snapshot));
  lastWrite = Date.now();
}

function publish(force) {
  if (!process.env.CK_STATS_FILE) return;
  pending = true;
  const wait = MIN_INTERVAL_MS - (Date.now() - lastWrite);
  if (force || wait <= 0) { writeNow(); return; }
  if (!timer) {
    timer = setTimeout(() => { timer = null; if (pending) writeNow(); }, wait);
    timer.unref();
  }
}

function reportStats(stats, options = {}) {
  if (stats === null || typeof stats !== "object" || Array.isArray(stats)) {
    throw new TypeError("reportStats() takes an object of name -> value");
  }
  current.stats = { ...stats };
  publish(Boolean(options.final));
}

function progress(done, total = null) {
  for (const [name, value] of [["done", done], ["total", total]]) {
    if (name === "total" && value === null) continue;
    if (typeof value !== "number" || !Number.isFinite(value)) throw new TypeError(`progress(): ${name} must be a number`);
    if (value < 0) throw new RangeError(`progress(): ${name} must be >= 0`);
  }
  current.progress = { done, total };
  publish(false);
}

function flushStats() {
  if (pending) writeNow();
}

process.on("exit", () => { try { flushStats(); } catch (err) { /* the process is ending */ } });

function parseParams(text) {
  try {
    const params = JSON.parse(text || "{}");
    return params !== null && typeof params === "object" ? params : {};
  } catch (err) {
    return {};
  }
}

function taskContext() {
  const env = process.env;
  return {
    taskId: env.CK_TASK_ID || null,
    spiderId: env.CK_SPIDER_ID || null,
    spiderName: env.CK_SPIDER_NAME || null,
    params: parseParams(env.CK_PARAMS),
    taskDir: env.CK_TASK_DIR || null,
    itemsFile: env.CK_ITEMS_FILE || null,
    statsFile: env.CK_STATS_FILE || null,
    dataDir: env.CK_DATA_DIR || null,
  };
}

// Whether to launch Chromium with its own sandbox: what the agent says (CK_CHROMIUM_SANDBOX "1": the spider
// is not root and may make user namespaces; "0": it needs --no-sandbox); outside an agent, unless root.
function chromiumSandbox() {
  const said = process.env.CK_CHROMIUM_SANDBOX;
  if (said === "1" || said === "0") return said === "1";
  return typeof process.geteuid === "function" && process.geteuid() !== 0;
}

// The switches Chromium needs here to start: ["--no-sandbox"] unless chromiumSandbox(), else none.
function chromiumArgs() {
  return chromiumSandbox() ? [] : ["--no-sandbox"];
}

module.exports = { saveItem, saveItems, reportStats, progress, flushStats, taskContext, chromiumSandbox, chromiumArgs };
