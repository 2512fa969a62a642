// CrawlerKeeper SDK for Node spiders: save scraped items and read the task context.
//
// One file with no dependencies; copy it into your project. It works from CommonJS and from ES
// modules ("type": "module") alike:
//
//   const { saveItem, taskContext } = require("./crawlerkeeper-sdk.cjs");   // CommonJS
//   import { saveItem, taskContext } from "./crawlerkeeper-sdk.cjs";        // ESM
//
// saveItem(obj) appends one JSON line to the task's items file (CK_ITEMS_FILE) with one
// synchronous write, so items are never interleaved or lost when the process is stopped; outside an
// agent (no CK_ITEMS_FILE) it prints the item as a JSON line on stdout instead.
"use strict";

const fs = require("node:fs");

let itemsFd = null;
let itemsPath = null;

function saveItem(item) {
  if (item === null || typeof item !== "object" || Array.isArray(item)) {
    throw new TypeError("saveItem: an item is a plain object");
  }
  const line = JSON.stringify(item) + "\n";
  const path = process.env.CK_ITEMS_FILE;
  if (!path) {
    process.stdout.write(line);
    return;
  }
  if (itemsFd === null || itemsPath !== path) {
    itemsFd = fs.openSync(path, "a");
    itemsPath = path;
  }
  fs.writeSync(itemsFd, line);
}

function saveItems(items) {
  let n = 0;
  for (const item of items) {
    saveItem(item);
    n += 1;
  }
  return n;
}

function taskContext() {
  let params = {};
  try {
    params = JSON.parse(process.env.CK_PARAMS || "{}");
  } catch (err) {
    params = {};
  }
  return {
    taskId: process.env.CK_TASK_ID || null,
    spiderId: process.env.CK_SPIDER_ID || null,
    spiderName: process.env.CK_SPIDER_NAME || null,
    params,
    itemsFile: process.env.CK_ITEMS_FILE || null,
    taskDir: process.env.CK_TASK_DIR || null,
    dataDir: process.env.CK_DATA_DIR || null,
  };
}

module.exports = { saveItem, saveItems, taskContext };
