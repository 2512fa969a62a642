"""A spider that answers the agent's persist requests by hand (no SDK): the control channel of issue 38
exactly as docs/protocol.md and ckagent.task.taskenv lay it out, in a few lines of stdlib Python.

:data:`HAND_ACK_SPIDER` writes item ``{"n": k}`` for k from its state's ``next`` (``CK_STATE_DIR/state.json``;
0 without one) up to its params' ``total``, one every ``pace`` seconds, its state updated after each
item; between items it answers every new request of ``CK_CONTROL_FILE``: the state dir copied to
``CK_SNAPSHOT_DIR/N.tmp``, renamed to ``N``, then ``{"id": N, "itemsOffset": <items file size>, "snapshot":
"N", "pauseMs": …}`` appended to ``CK_CONTROL_ACK_FILE``. It prints ``START <next> <attempt>`` first.
Params: ``fail_at`` (int): exit 3 once that item is written and ``answered`` (int) requests are answered
(a failure after a checkpoint); ``linger`` seconds to wait before that exit (its checkpoint ships meanwhile).
"""

from __future__ import annotations

__all__ = ["HAND_ACK_SPIDER"]

HAND_ACK_SPIDER = r'''
import json, os, shutil, sys, time
env = os.environ
params = json.loads(env["CK_PARAMS"])
state_file = os.path.join(env["CK_STATE_DIR"], "state.json")
n = json.load(open(state_file))["next"] if os.path.exists(state_file) else 0
print("START", n, env["CK_ATTEMPT"], flush=True)
answered = 0
fail_at, need, attempt = params.get("fail_at"), params.get("answered", 1), int(env["CK_ATTEMPT"])
with open(env["CK_ITEMS_FILE"], "a") as items:
    while n < params["total"]:
        items.write(json.dumps({"n": n}) + "\n")
        items.flush()
        n += 1
        with open(state_file + ".tmp", "w") as fh:
            json.dump({"next": n}, fh)
        os.replace(state_file + ".tmp", state_file)
        with open(env["CK_CONTROL_FILE"]) as fh:
            requests = fh.read().splitlines()
        for line in requests[answered:]:
            rid = json.loads(line)["id"]
            started = time.monotonic()
            snap = os.path.join(env["CK_SNAPSHOT_DIR"], str(rid))
            shutil.copytree(env["CK_STATE_DIR"], snap + ".tmp")
            os.rename(snap + ".tmp", snap)
            ack = {"id": rid, "itemsOffset": items.tell(), "snapshot": str(rid),
                   "pauseMs": round((time.monotonic() - started) * 1000, 3)}
            with open(env["CK_CONTROL_ACK_FILE"], "a") as fh:
                fh.write(json.dumps(ack) + "\n")
            print("ANSWERED", rid, "at item", n, flush=True)
        answered = len(requests)
        if attempt == 1 and fail_at is not None and n >= fail_at and answered >= need:
            time.sleep(params.get("linger", 0))
            print("FAILING at", n, flush=True)
            sys.exit(3)
        time.sleep(params["pace"])
'''
