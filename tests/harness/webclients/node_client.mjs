// A real Node HTTP client runs a plan of requests on ONE agent/pool through the proxy of its
// environment, as a spider would: `node node_client.mjs <undici|undici-forward|got|axios> PLAN RESULT`.
// PLAN and RESULT as in py_clients.py (a request's "pause": seconds waited before it). Run from the directory the packages were installed in
// (tests/harness/webclients.py copies this file there).
//   undici          fetch with undici's EnvHttpProxyAgent (HTTP_PROXY/HTTPS_PROXY; it tunnels plain
//                   http:// through CONNECT too, its default)
//   undici-forward  the same with proxyTunnel: false (plain http:// sent to the proxy in absolute form)
//   got             got with hpagent's keep-alive proxy agents (both tunnel through CONNECT)
//   axios           axios's own proxy support (HTTP_PROXY) for http://, hpagent's for https:// (axios's own
//                   cannot tunnel; https-proxy-agent 7 checks an IP address's certificate against
//                   "localhost")
import { createHash } from 'node:crypto';
import { readFileSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import { Readable } from 'node:stream';

const TIMEOUT_MS = 30000;
const [lib, planFile, resultFile] = process.argv.slice(2);
const plan = JSON.parse(readFileSync(planFile, 'utf8'));
const ca = readFileSync(plan.ca);
const proxy = process.env.HTTP_PROXY;

function bodyBytes(tag, size) {
  const unit = Buffer.from(tag + '-');
  const out = Buffer.alloc(size);
  for (let i = 0; i < size; i += unit.length) unit.copy(out, i);
  return out;
}

function pieces(data) {
  const third = Math.max(1, Math.floor(data.length / 3));
  return [data.subarray(0, third), data.subarray(third, 2 * third), data.subarray(2 * third)];
}

function record(spec, status, identity, body, type, error = null) {
  let parsed = null;
  if (type && type.includes('json')) {
    try { parsed = JSON.parse(body.toString('utf8')); } catch { parsed = null; }
  }
  return { id: spec.id, status, identity: identity ?? null, length: body.length,
           sha256: createHash('sha256').update(body).digest('hex'), json: parsed, error };
}

function failed(spec, err) {
  const causes = [];
  for (let e = err; e && causes.length < 5; e = e.cause) causes.push(String(e));
  return record(spec, null, null, Buffer.alloc(0), null, causes.join(' <- '));
}

const pause = (spec) => new Promise((resolve) => setTimeout(resolve, (spec.pause || 0) * 1000));

function body(spec, stream) {
  if (!spec.body) return undefined;
  const data = bodyBytes(spec.body.tag, spec.body.size);
  if (!spec.body.chunked) return data;
  return stream(pieces(data));
}

async function runUndici(forward) {
  const { EnvHttpProxyAgent, fetch } = await import('undici');
  const dispatcher = new EnvHttpProxyAgent({ proxyTunnel: !forward, requestTls: { ca } });
  const out = [];
  for (const spec of plan.requests) {
    await pause(spec);
    try {
      const r = await fetch(spec.url, {
        dispatcher, method: spec.method, headers: spec.headers, redirect: 'follow', duplex: 'half',
        body: body(spec, (parts) => Readable.toWeb(Readable.from(parts))),
        signal: AbortSignal.timeout(TIMEOUT_MS),
      });
      const data = Buffer.from(await r.arrayBuffer());
      out.push(record(spec, r.status, r.headers.get('x-identity'), data, r.headers.get('content-type')));
    } catch (err) {
      out.push(failed(spec, err));
    }
  }
  await dispatcher.close();
  return out;
}

async function runGot() {
  const { default: got } = await import('got');
  const { HttpProxyAgent, HttpsProxyAgent } = await import('hpagent');
  const agent = {
    http: new HttpProxyAgent({ proxy, keepAlive: true, maxSockets: 8 }),
    https: new HttpsProxyAgent({ proxy, keepAlive: true, maxSockets: 8, ca }),
  };
  const client = got.extend({ agent, https: { certificateAuthority: ca }, throwHttpErrors: false,
                              retry: { limit: 0 }, followRedirect: true, timeout: { request: TIMEOUT_MS },
                              responseType: 'buffer' });
  const out = [];
  for (const spec of plan.requests) {
    await pause(spec);
    try {
      const r = await client(spec.url, { method: spec.method, headers: spec.headers,
                                         body: body(spec, (parts) => Readable.from(parts)) });
      out.push(record(spec, r.statusCode, r.headers['x-identity'], r.body, r.headers['content-type']));
    } catch (err) {
      out.push(failed(spec, err));
    }
  }
  agent.http.destroy();
  agent.https.destroy();
  return out;
}

async function runAxios() {
  const { default: axios } = await import('axios');
  const { HttpsProxyAgent } = await import('hpagent');
  const httpAgent = new http.Agent({ keepAlive: true });
  const httpsAgent = new HttpsProxyAgent({ proxy: process.env.HTTPS_PROXY, keepAlive: true, ca });
  const client = axios.create({ httpAgent, httpsAgent, validateStatus: () => true, maxRedirects: 5,
                                responseType: 'arraybuffer', timeout: TIMEOUT_MS });
  const out = [];
  for (const spec of plan.requests) {
    await pause(spec);
    const https = spec.url.startsWith('https:');
    try {
      // http://: axios's own proxy (from HTTP_PROXY, credentials from the URL); https://: the agent
      // tunnels (axios's own proxy cannot: it would send the https URL to the proxy in the clear).
      const r = await client.request({ url: spec.url, method: spec.method, headers: spec.headers,
                                       data: body(spec, (parts) => Readable.from(parts)),
                                       ...(https ? { proxy: false } : {}) });
      out.push(record(spec, r.status, r.headers['x-identity'], Buffer.from(r.data), r.headers['content-type']));
    } catch (err) {
      out.push(failed(spec, err));
    }
  }
  httpAgent.destroy();
  httpsAgent.destroy();
  return out;
}

const runners = { undici: () => runUndici(false), 'undici-forward': () => runUndici(true), got: runGot,
                  axios: runAxios };
const results = await runners[lib]();
writeFileSync(resultFile, JSON.stringify(results));
