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
// State that travels with the task (CK_STATE_DIR, restored from the last checkpoint on any node; Apify's
// Actor.on("persistState") / Crawlee's useState are the model):
//
//   const state = loadState({ frontier: [start], seen: [start] });   // the last persisted state, or the default
//   onPersist(() => state);                              // the agent asks (every checkpoint interval, before a
//                                                        // stop meant to be resumed): return the state to save
//   onMigrating((secondsLeft) => { leaving = true; });   // this node is being left in secondsLeft seconds
//   persistState(state);                                 // save it now (atomically, CK_STATE_DIR/state.json)
//   stateDir();                                          // the directory for state files of your own
//
// The first call of any of these starts the watcher: a timer (unref'd: it never keeps the process alive)
// that looks at CK_CONTROL_FILE every 0.2 s and answers each request of the agent: it runs the migrating
// callbacks, then the persist callbacks (a returned value other than undefined/null → persistState(value);
// a returned promise is awaited), then — in one synchronous stretch, so no item is saved meanwhile — takes
// the items offset, copies CK_STATE_DIR to CK_SNAPSHOT_DIR/<id> (links and special files skipped) and
// appends the answer to CK_CONTROL_ACK_FILE ({"id", "itemsOffset", "snapshot", "pauseMs"}, or {"id",
// "error"}); a failure never ends the spider. The items offset is the size of CK_ITEMS_FILE when the state
// was last made current: right after the persist callbacks (when any are registered), else at the last
// persistState() call. So keep a page's saveItem() calls and the state change they go with in one
// synchronous stretch (no await between them), and return your live state object from onPersist: while an
// async callback is awaited your crawl runs on, and what it returns is written only when it resolves.
// Only the main thread answers (worker threads never do); use the state API in one process of a spider.
// Outside an agent (no CK_STATE_DIR): loadState returns the default (or what persistState kept in memory),
// callbacks never run, stateDir() is a temporary directory removed at exit.
//
// Outside an agent (no CK_ITEMS_FILE) items are printed on stdout and stats are ignored. Writes are
// synchronous appends of whole lines (O_APPEND): safe next to other writers of the same file, never
// interleaved or lost when the process is stopped. Stats lines are coalesced: at most one per second;
// a pending one is written by a timer or when the process exits. reportStats(stats, { final: true })
// writes at once.
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");

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
    attempt: Number.isInteger(Number(env.CK_ATTEMPT)) && Number(env.CK_ATTEMPT) >= 1 ? Number(env.CK_ATTEMPT) : 1,
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


// --- State that travels with the task (see the header) -------------------------------------------------

const STATE_FILE = "state.json";
const POLL_MS = 200;
const MAX_LINE_BYTES = 64 * 1024;
const READ_BYTES = 1 << 20;
const MAX_BACKLOG_BYTES = 8 << 20;
const MAX_ACK_READ_BYTES = 16 << 20;
const MAX_DEPTH = 64;
const EVENTS = new Set(["persistState", "migrating"]);
const O_NOFOLLOW = fs.constants.O_NOFOLLOW || 0;
const O_NONBLOCK = fs.constants.O_NONBLOCK || 0;

const persistCallbacks = [];
const migratingCallbacks = [];
let memoryState = null; // persistState() outside an agent: the JSON text
let markedOffset = null; // the items offset at the last persistState()
let watcher = null;
let localDir = null;

let isMainThread = true;
try {
  isMainThread = require("worker_threads").isMainThread;
} catch (err) { /* no worker threads in this Node */ }

function note(message) {
  try { process.stderr.write(`crawlerkeeper-sdk: ${message}\n`); } catch (err) { /* nowhere to say it */ }
}

// The size of the items file cut back to its last whole line (0 if none).
function itemsOffset(itemsPath) {
  if (!itemsPath) return 0;
  let fd;
  try {
    fd = fs.openSync(itemsPath, fs.constants.O_RDONLY | O_NONBLOCK);
  } catch (err) {
    if (err.code === "ENOENT") return 0;
    throw err;
  }
  try {
    let end = fs.fstatSync(fd).size;
    const buf = Buffer.allocUnsafe(65536);
    while (end > 0) {
      const start = Math.max(0, end - buf.length);
      const n = fs.readSync(fd, buf, 0, end - start, start);
      const newline = buf.subarray(0, n).lastIndexOf(10);
      if (newline >= 0) return start + newline + 1;
      end = start;
    }
    return 0;
  } finally {
    fs.closeSync(fd);
  }
}

// stateDir(): the directory of the state that travels with the task (CK_STATE_DIR); outside an agent a
// temporary directory removed at exit. Write your files there from an onPersist callback. Starts the watcher.
function stateDir() {
  ensureWatcher();
  const dir = process.env.CK_STATE_DIR;
  if (dir) {
    fs.mkdirSync(dir, { recursive: true });
    return dir;
  }
  if (localDir === null) {
    localDir = fs.mkdtempSync(path.join(os.tmpdir(), "ck-state-"));
    const made = localDir;
    process.on("exit", () => { try { fs.rmSync(made, { recursive: true, force: true }); } catch (err) { /* ending */ } });
  }
  return localDir;
}

// loadState(defaultValue = null): the state saved by the last persistState() (of this attempt, or of the
// checkpoint this attempt resumes from), parsed afresh; defaultValue when none was saved. Throws SyntaxError
// if the state file is not JSON, an fs error if it cannot be read. Starts the watcher.
function loadState(defaultValue = null) {
  ensureWatcher();
  const dir = process.env.CK_STATE_DIR;
  if (!dir) return memoryState === null ? defaultValue : JSON.parse(memoryState);
  const file = path.join(dir, STATE_FILE);
  let text;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (err) {
    if (err.code === "ENOENT") return defaultValue;
    throw err;
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new SyntaxError(`the saved state ${file} is not JSON (${err.message}); remove it to start afresh`);
  }
}

// persistState(state): save a JSON value as the task's state, now and atomically (state.json replaced through
// a rename). Call it where the state and the items you saved agree: the next snapshot pairs it with the items
// saved up to this call, unless a persist callback makes the state current later. Throws TypeError for a value
// JSON.stringify cannot write (undefined, a function, a BigInt, a circular object; NaN becomes null), an fs
// error if the file cannot be written. Outside an agent the state is kept in memory. Starts the watcher.
function persistState(state) {
  ensureWatcher();
  const text = JSON.stringify(state);
  if (text === undefined) throw new TypeError("persistState() takes a JSON value (not undefined or a function)");
  const dir = process.env.CK_STATE_DIR;
  if (!dir) {
    memoryState = text;
    return;
  }
  const offset = itemsOffset(process.env.CK_ITEMS_FILE);
  fs.mkdirSync(dir, { recursive: true });
  const temporary = path.join(dir, `.${STATE_FILE}.tmp`);
  fs.writeFileSync(temporary, text);
  fs.renameSync(temporary, path.join(dir, STATE_FILE));
  markedOffset = offset;
}

// onPersist(callback): callback() on every persist request of the agent; it returns the state to save (or a
// promise of it), or undefined/null having written its files in stateDir() itself. A throw fails that
// checkpoint (the agent keeps the previous one). Returns callback. Starts the watcher.
function onPersist(callback) {
  if (typeof callback !== "function") throw new TypeError("onPersist() takes a function");
  ensureWatcher();
  persistCallbacks.push(callback);
  return callback;
}

// onMigrating(callback): callback(secondsLeft) when the agent is about to stop this spider to resume it
// elsewhere; secondsLeft is a number of seconds, or null if the agent did not say. Stop starting new work
// there. A returned promise is awaited before the persist callbacks run; a throw is printed, the persist goes
// on. Returns callback. Starts the watcher.
function onMigrating(callback) {
  if (typeof callback !== "function") throw new TypeError("onMigrating() takes a function");
  ensureWatcher();
  migratingCallbacks.push(callback);
  return callback;
}

function ensureWatcher() {
  if (watcher !== null || !isMainThread) return;
  const env = process.env;
  if (!env.CK_STATE_DIR || !env.CK_CONTROL_FILE || !env.CK_CONTROL_ACK_FILE || !env.CK_SNAPSHOT_DIR) return;
  watcher = new StateWatcher(env.CK_STATE_DIR, env.CK_CONTROL_FILE, env.CK_CONTROL_ACK_FILE, env.CK_SNAPSHOT_DIR);
  watcher.start();
}

function parseJson(buf) {
  try {
    return JSON.parse(buf.toString("utf8"));
  } catch (err) {
    return undefined;
  }
}

function isObject(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

// One request line → {id, event, reason, secondsLeft}, or null. A line torn at its start (a writer that died
// mid-line, then a whole line after it) is read from its last "{": requests are flat objects.
function parseRequest(line) {
  let obj = parseJson(line);
  if (!isObject(obj)) {
    const start = line.lastIndexOf(123); // "{"
    obj = start > 0 ? parseJson(line.subarray(start)) : undefined;
    if (!isObject(obj)) return null;
  }
  const id = obj.id;
  if (!Number.isSafeInteger(id) || id < 0) return null;
  const left = obj.secondsLeft;
  return {
    id,
    event: typeof obj.event === "string" ? obj.event.slice(0, 100) : "",
    reason: typeof obj.reason === "string" ? obj.reason.slice(0, 100) : null,
    secondsLeft: typeof left === "number" && Number.isFinite(left) && left >= 0 ? left : null,
  };
}

function answeredIds(ackPath) {
  const ids = new Set();
  let fd;
  try {
    fd = fs.openSync(ackPath, fs.constants.O_RDONLY | O_NONBLOCK);
  } catch (err) {
    return ids;
  }
  try {
    const size = fs.fstatSync(fd).size;
    const start = Math.max(0, size - MAX_ACK_READ_BYTES);
    const buf = Buffer.allocUnsafe(size - start);
    const n = fs.readSync(fd, buf, 0, buf.length, start);
    for (const line of buf.subarray(0, n).toString("utf8").split("\n")) {
      if (line.length > MAX_LINE_BYTES) continue;
      const obj = parseJson(Buffer.from(line));
      if (isObject(obj) && Number.isSafeInteger(obj.id)) ids.add(obj.id);
    }
  } catch (err) {
    /* unreadable: nothing answered that we know of */
  } finally {
    fs.closeSync(fd);
  }
  return ids;
}

function removePath(p) {
  let st;
  try {
    st = fs.lstatSync(p);
  } catch (err) {
    if (err.code === "ENOENT") return;
    throw err;
  }
  if (st.isDirectory()) fs.rmSync(p, { recursive: true, force: true });
  else fs.unlinkSync(p);
}

// Copy one regular file without following a link; false if src is not one (any more).
function copyFile(src, dst) {
  let fdIn;
  try {
    fdIn = fs.openSync(src, fs.constants.O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
  } catch (err) {
    if (err.code === "ELOOP" || err.code === "ENOENT" || err.code === "ENXIO") return false;
    throw err;
  }
  try {
    const st = fs.fstatSync(fdIn);
    if (!st.isFile()) return false;
    const mode = (st.mode & 0o777) | 0o600;
    const flags = fs.constants.O_WRONLY | fs.constants.O_CREAT | fs.constants.O_EXCL | O_NOFOLLOW;
    const fdOut = fs.openSync(dst, flags, mode);
    try {
      const buf = Buffer.allocUnsafe(Math.max(1, Math.min(st.size, 1 << 20)));
      let done = 0;
      while (done < st.size) { // at most the size seen at open: a file that grows meanwhile ends there
        const n = fs.readSync(fdIn, buf, 0, Math.min(buf.length, st.size - done), done);
        if (n === 0) break;
        let written = 0;
        while (written < n) written += fs.writeSync(fdOut, buf, written, n - written);
        done += n;
      }
      fs.fchmodSync(fdOut, mode);
    } finally {
      fs.closeSync(fdOut);
    }
  } finally {
    fs.closeSync(fdIn);
  }
  return true;
}

// Copy the regular files and directories beneath src into the new dst, never following a link; returns how
// many entries were skipped (links, sockets, FIFOs, devices, directories nested deeper than MAX_DEPTH).
function copyTree(src, dst) {
  fs.mkdirSync(dst, { mode: 0o700 });
  let skipped = 0;
  const stack = [[src, dst, 0]];
  while (stack.length) {
    const [from, to, depth] = stack.pop();
    let entries;
    try {
      entries = fs.readdirSync(from, { withFileTypes: true });
    } catch (err) {
      if (err.code !== "ENOENT" || depth === 0) throw err;
      skipped += 1; // removed while being copied
      continue;
    }
    for (const entry of entries) {
      const source = path.join(from, entry.name);
      const target = path.join(to, entry.name);
      if (entry.isDirectory()) {
        if (depth >= MAX_DEPTH) { skipped += 1; continue; }
        fs.mkdirSync(target, { mode: 0o700 });
        try { fs.chmodSync(target, (fs.lstatSync(source).mode & 0o7777) | 0o700); } catch (err) { /* keep 0700 */ }
        stack.push([source, target, depth + 1]);
      } else if (!(entry.isFile() && copyFile(source, target))) {
        skipped += 1;
      }
    }
  }
  return skipped;
}

function takeSnapshot(stateDirPath, snapshotDir, name) {
  fs.mkdirSync(snapshotDir, { recursive: true });
  const final = path.join(snapshotDir, name);
  const temporary = `${final}.tmp`;
  removePath(temporary);
  removePath(final);
  let skipped = 0;
  let isDir = false;
  try { isDir = fs.statSync(stateDirPath).isDirectory(); } catch (err) { /* missing: an empty snapshot */ }
  try {
    if (isDir) skipped = copyTree(stateDirPath, temporary);
    else fs.mkdirSync(temporary, { mode: 0o700 });
    fs.renameSync(temporary, final);
  } catch (err) {
    try { removePath(temporary); } catch (ignored) { /* the error that matters is err */ }
    throw err; // a failed snapshot leaves nothing behind
  }
  return skipped;
}

function isThenable(value) {
  return value !== null && (typeof value === "object" || typeof value === "function") && typeof value.then === "function";
}

// Call every callback at once (synchronously); await only when one returned a promise.
async function callAll(callbacks, args, onError) {
  const results = [];
  for (const callback of callbacks) {
    try {
      results.push(callback(...args));
    } catch (err) {
      onError(err);
      results.push(undefined);
    }
  }
  if (results.some(isThenable)) {
    for (let i = 0; i < results.length; i += 1) {
      try {
        results[i] = await results[i];
      } catch (err) {
        onError(err);
        results[i] = undefined;
      }
    }
  }
  return results;
}

class StateWatcher {
  constructor(stateDirPath, control, ack, snapshots) {
    Object.assign(this, { stateDirPath, control, ack, snapshots });
    this.ackFd = null;
    this.answered = new Set();
    this.position = 0;
    this.identity = null;
    this.partial = Buffer.alloc(0);
    this.discarding = false; // inside a line that was too long: drop up to its newline
    this.busy = false;
    this.lastError = "";
  }

  start() {
    const timer = setInterval(() => { this.tick(); }, POLL_MS);
    if (typeof timer.unref === "function") timer.unref(); // never keeps the process alive
  }

  async tick() {
    if (this.busy) return;
    this.busy = true;
    try {
      if (this.ackFd === null) {
        this.ackFd = fs.openSync(this.ack, fs.constants.O_WRONLY | fs.constants.O_APPEND | fs.constants.O_CREAT | O_NOFOLLOW, 0o644);
        this.answered = answeredIds(this.ack);
      }
      const pending = [];
      for (const request of this.poll()) {
        if (!this.answered.has(request.id) && !pending.some((p) => p.id === request.id)) pending.push(request);
      }
      if (pending.length) await this.answer(pending);
    } catch (err) {
      const text = String(err && err.stack ? err.message : err);
      if (text !== this.lastError) note(`state watcher: ${text}`);
      this.lastError = text;
    } finally {
      this.busy = false;
    }
  }

  // The whole request lines appended since the last poll; never throws for the file's sake.
  poll() {
    let st;
    try {
      st = fs.statSync(this.control);
    } catch (err) {
      return [];
    }
    if (!st.isFile()) return [];
    const identity = `${st.dev}:${st.ino}`;
    if (identity !== this.identity || st.size < this.position) {
      this.identity = identity; // a new file, or one truncated: read it from its start
      this.position = 0;
      this.partial = Buffer.alloc(0);
      this.discarding = false;
    }
    if (st.size === this.position) return [];
    if (st.size - this.position > MAX_BACKLOG_BYTES) {
      note(`${this.control}: skipped ${st.size - READ_BYTES - this.position} bytes of backlog`);
      this.position = st.size - READ_BYTES;
      this.partial = Buffer.alloc(0);
      this.discarding = true; // the line cut there is not a request
    }
    let chunk;
    try {
      const fd = fs.openSync(this.control, fs.constants.O_RDONLY | O_NONBLOCK);
      try {
        if (!fs.fstatSync(fd).isFile()) return [];
        const buf = Buffer.allocUnsafe(Math.min(st.size - this.position, READ_BYTES));
        chunk = buf.subarray(0, fs.readSync(fd, buf, 0, buf.length, this.position));
      } finally {
        fs.closeSync(fd);
      }
    } catch (err) {
      return [];
    }
    this.position += chunk.length;
    const data = Buffer.concat([this.partial, chunk]);
    const requests = [];
    let start = 0;
    for (let newline = data.indexOf(10); newline >= 0; newline = data.indexOf(10, start)) {
      const line = data.subarray(start, newline);
      start = newline + 1;
      if (this.discarding) { this.discarding = false; continue; }
      if (line.length > MAX_LINE_BYTES) continue;
      const request = parseRequest(line);
      if (request !== null) requests.push(request);
    }
    this.partial = Buffer.from(data.subarray(start));
    if (this.partial.length > MAX_LINE_BYTES) {
      this.partial = Buffer.alloc(0);
      this.discarding = true;
    }
    return requests;
  }

  ackLine(answer) {
    fs.writeSync(this.ackFd, line(answer));
    this.answered.add(answer.id);
  }

  // Answer requests seen together: one snapshot for the newest, the older ones superseded.
  async answer(pending) {
    for (const request of pending) {
      if (!EVENTS.has(request.event)) this.ackLine({ id: request.id, error: `unknown event ${JSON.stringify(request.event)}` });
    }
    const known = pending.filter((r) => EVENTS.has(r.event));
    if (!known.length) return;
    const newest = known[known.length - 1];
    for (const request of known.slice(0, -1)) this.ackLine({ id: request.id, error: `superseded by request ${newest.id}` });
    const migrating = known.filter((r) => r.event === "migrating");
    const started = process.hrtime();
    let answer;
    try {
      if (migrating.length) {
        await callAll(migratingCallbacks.slice(), [migrating[migrating.length - 1].secondsLeft],
          (err) => note(`a migrating callback failed: ${err && err.stack ? err.stack : err}`));
      }
      let failed = null;
      const callbacks = persistCallbacks.slice();
      const values = await callAll(callbacks, [], (err) => {
        note(`a persist callback failed: ${err && err.stack ? err.stack : err}`);
        if (failed === null) failed = err;
      });
      if (failed !== null) throw failed;
      // From here one synchronous stretch: the state written, the items offset and the copy agree.
      for (const value of values) if (value !== undefined && value !== null) persistState(value);
      let offset = itemsOffset(process.env.CK_ITEMS_FILE);
      if (!callbacks.length && markedOffset !== null) offset = Math.min(offset, markedOffset);
      const name = String(newest.id);
      const skipped = takeSnapshot(this.stateDirPath, this.snapshots, name);
      const [seconds, nanos] = process.hrtime(started);
      answer = { id: newest.id, itemsOffset: offset, snapshot: name, pauseMs: Math.round((seconds * 1e3 + nanos / 1e6) * 10) / 10 };
      if (skipped) answer.skipped = skipped;
    } catch (err) {
      const name = err && err.name ? err.name : "Error";
      answer = { id: newest.id, error: `${name}: ${err && err.message ? err.message : err}`.slice(0, 1000) };
    }
    this.ackLine(answer);
  }
}

module.exports = {
  saveItem, saveItems, reportStats, progress, flushStats, taskContext, chromiumSandbox, chromiumArgs,
  loadState, persistState, onPersist, onMigrating, stateDir,
};
