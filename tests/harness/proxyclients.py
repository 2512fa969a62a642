"""A spider that keeps requesting through its egress proxy while the agent dies and comes back.

:data:`PROXY_CLIENTS` (a task's ``main.py``, stdlib only) runs two clients through ``HTTP_PROXY`` against
``params.site`` (a harness.pagedsite site): one keeps its proxy connection alive, one opens a new
connection per request. Each fetches its own pages in order (keep-alive: odd pages, new-connection:
even ones) and retries a page until it is served — as Scrapy's retry does for a cut connection — but
counts every refused connect (ECONNREFUSED, what Scrapy gives up on) and every other error by kind. It
prints ``ready`` once both clients got a page, and runs until the file ``go`` appears in its task dir
(bounded: 3 minutes). Then it writes one item per page fetched and a summary item: ``refused``,
``errors`` {kind: count}, ``longest`` (seconds, the longest request: its wait for a response included),
``fds`` (its descriptors at its start, ``/proc/self/fd`` readlinks) and ``env`` (the names of its store
variables it saw: none expected).
"""

from __future__ import annotations

import textwrap
from typing import Any

__all__ = ["PROXY_CLIENTS", "summary_of"]

PROXY_CLIENTS = textwrap.dedent("""
    import base64, http.client, json, os, threading, time, urllib.parse
    fds = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            fds[entry] = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            pass
    env = sorted(k for k in os.environ if k.startswith("LISTEN_") or "FDSTORE" in k)
    params = json.loads(os.environ.get("CK_PARAMS") or "{}")
    site = params["site"].rstrip("/")
    proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
    auth = base64.b64encode(f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password)}".encode()).decode()
    go = os.path.join(os.environ["CK_TASK_DIR"], "go")
    lock = threading.Lock()
    stats = {"refused": 0, "errors": {}, "longest": 0.0, "pages": {}}
    first = threading.Barrier(3, timeout=120)
    deadline = time.monotonic() + 180

    def note(kind):
        with lock:
            stats["errors"][kind] = stats["errors"].get(kind, 0) + 1

    def client(name, start, keep):
        conn = None
        page, got = start, []
        while time.monotonic() < deadline and not os.path.exists(go):
            began = time.monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=60)
                headers = {"Proxy-Authorization": "Basic " + auth}
                if not keep:
                    headers["Connection"] = "close"
                conn.request("GET", f"{site}/page/{page}/", headers=headers)
                response = conn.getresponse()
                body = response.read()
                if response.status != 200 or b"<h1>Page %d</h1>" % page not in body:
                    note(f"status {response.status}")
                    conn.close(); conn = None
                    time.sleep(0.05)
                    continue
                got.append(page)
                if len(got) == 1:
                    first.wait()
                page += 2
                if not keep:
                    conn.close(); conn = None
            except ConnectionRefusedError:
                with lock:
                    stats["refused"] += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
                continue
            except (OSError, http.client.HTTPException) as exc:
                note(type(exc).__name__)
                if conn is not None:
                    conn.close()
                conn = None
                continue
            finally:
                with lock:
                    stats["longest"] = max(stats["longest"], time.monotonic() - began)
            time.sleep(0.02)
        with lock:
            stats["pages"][name] = got

    threads = [threading.Thread(target=client, args=("keep", 1, True)),
               threading.Thread(target=client, args=("new", 2, False))]
    for thread in threads:
        thread.start()
    first.wait()
    print("ready", flush=True)
    for thread in threads:
        thread.join()
    with open(os.environ["CK_ITEMS_FILE"], "a") as items:
        for name, pages in stats["pages"].items():
            for page in pages:
                items.write(json.dumps({"client": name, "page": page}) + "\\n")
        items.write(json.dumps({"summary": True, "refused": stats["refused"], "errors": stats["errors"],
                                "longest": stats["longest"], "fds": fds, "env": env}) + "\\n")
    print("done", flush=True)
""")
"""The spider (module docstring)."""


def summary_of(items: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """(the summary item, {client: pages in the order fetched}) of :data:`PROXY_CLIENTS`' items."""
    summaries = [item for item in items if item.get("summary")]
    assert len(summaries) == 1, f"{len(summaries)} summary items"
    pages: dict[str, list[int]] = {}
    for item in items:
        if "client" in item:
            pages.setdefault(item["client"], []).append(item["page"])
    return summaries[0], pages
