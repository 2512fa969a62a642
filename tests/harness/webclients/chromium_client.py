"""Chromium (Debian's, driven by Playwright) runs a plan of requests through the proxy of its
environment: ``python chromium_client.py PLAN RESULT``. PLAN and RESULT as in py_clients.py, plus
``"page"`` (the URL of the page the requests are made from: a page of the first host) and
``"spki"`` (the base64 sha256 of each test certificate's public key: Chromium has no CA file option).

Chromium takes the proxy's address from HTTP_PROXY without the credentials (it ignores credentials in
a proxy URL: the proxy's per-task port says which task asks), and sends loopback destinations through
it only with ``--proxy-bypass-list=<-loopback>``. Each request is a ``fetch`` in the page (one
browser: its own connection pools), one after the other; a body is a Uint8Array (Content-Length:
Chromium streams request bodies over HTTP/2 only). CHROMIUM names the executable (/usr/bin/chromium).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any
from urllib.parse import urlsplit

from playwright.sync_api import sync_playwright

FETCH = """
async (spec) => {
  const hex = (buffer) => Array.from(new Uint8Array(buffer)).map((b) => b.toString(16).padStart(2, '0')).join('');
  let body;
  if (spec.body) {
    const unit = new TextEncoder().encode(spec.body.tag + '-');
    body = new Uint8Array(spec.body.size);
    for (let i = 0; i < spec.body.size; i++) body[i] = unit[i % unit.length];
  }
  try {
    const r = await fetch(spec.url, {method: spec.method, headers: spec.headers, body, cache: 'no-store',
                                     credentials: 'omit', redirect: 'follow'});
    const data = await r.arrayBuffer();
    const type = r.headers.get('content-type') || '';
    let parsed = null;
    if (type.includes('json')) { try { parsed = JSON.parse(new TextDecoder().decode(data)); } catch (e) {} }
    return {id: spec.id, status: r.status, identity: r.headers.get('x-identity'), length: data.byteLength,
            sha256: hex(await crypto.subtle.digest('SHA-256', data)), json: parsed, error: null};
  } catch (e) {
    return {id: spec.id, status: null, identity: null, length: 0, sha256: null, json: null, error: String(e)};
  }
}
"""


def main() -> None:
    plan_file, result_file = sys.argv[1:3]
    with open(plan_file) as fh:
        plan = json.load(fh)
    args = ["--ignore-certificate-errors-spki-list=" + ",".join(plan["spki"])]
    if os.environ.get("HTTP_PROXY"):  # (without: straight to the hosts, a baseline)
        proxy = urlsplit(os.environ["HTTP_PROXY"])
        server = f"{proxy.scheme}://{proxy.hostname}:{proxy.port}"  # no credentials: Chromium ignores them
        args += [f"--proxy-server={server}", "--proxy-bypass-list=<-loopback>"]
    out: list[dict[str, Any]] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
                                             args=args)
        try:
            page = browser.new_page()
            response = page.goto(plan["page"])
            if response is None or response.status != 200:
                raise SystemExit(f"the first page {plan['page']} did not load: "
                                 f"{None if response is None else response.status}")
            for spec in plan["requests"]:
                out.append(page.evaluate(FETCH, spec))
        finally:
            browser.close()
    with open(result_file, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
