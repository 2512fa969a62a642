"""The suite's support module (one package: a module per concern, everything importable from
``harness``): helpers for running the real agent against the real dev master.

The fixtures (``dev_master``, ``dev_master_process``, ``recording_master``) live in conftest.py; the
fault-injecting proxy in faultproxy.py. Everything else a test file would otherwise write for itself
lives here, a module per concern — :mod:`harness.core` (the agent, in this process and as a
process; packages; waiting), :mod:`harness.agentproc` (an agent process with the tests' timings),
:mod:`harness.procs` (a task's processes, levels, spider building blocks), :mod:`harness.recording`,
:mod:`harness.rawnode` (a node as raw HTTP, and in the dev master's store), :mod:`harness.checkpointnode`
(its attempts' batches, checkpoint chunks and manifests; a dev master with a short node-lost grace), :mod:`harness.names` (a dev master with a short name-liveness window; an agent process's status port), :mod:`harness.fakes`
(fake masters for the poller and the delivery), :mod:`harness.index` (a package index),
:mod:`harness.npmregistry` (an npm registry), :mod:`harness.nodelocks` (yarn and pnpm lock files, a
node without yarn or pnpm),
:mod:`harness.examples` (the example spiders' runs), :mod:`harness.eggs` (Scrapyd eggs), :mod:`harness.scrapyprojects`
(small Scrapy projects: an HTTP cache, a polite crawl) — and a test imports it from ``harness``:

- :func:`agent_settings` builds a Settings object the way `ckagent run` does (env overrides).
- :func:`running_agent` runs an in-process :class:`ckagent.agent.Agent` in a nursery and stops it.
- :func:`spider_zip` builds a code package from a dict of files; :func:`submit` makes spider + task.
- :class:`AgentProcess` runs `python -m ckagent run -c FILE` as a real process (signals, kill -9).
- :func:`eventually` waits for the state of another process (the master, a spider) to come true.
- :func:`output_lines` and :func:`items_of` read what a task wrote on the node, as the master must
  hold it.
- :class:`MemoryMaster` is the node protocol's seq rules in memory, for ``httpx.MockTransport``
  (put :class:`faultproxy.MockFaults` in front of it for the proxy's faults on the autojump clock).
- :class:`ExampleRuns` runs each sdk/examples spider once per session on each path (``ckagent
  exec``, an agent) for the tests that read that run (the session fixture ``example_runs``);
  :func:`recipe` reads the README's exec recipe.
- :class:`RecordingMaster` is the dev master behind a recorder of the final results it receives
  and the API keys it issues (conftest.py's ``recording_master`` serves one per test);
  :func:`settings_for` gives an in-process agent its settings for it (the containment level in
  ``LEVEL``, which test_supervision.py's ``containment_level`` sets).
- Processes: :func:`alive`, :func:`marked_pids` (a task's processes, read from /proc),
  :func:`pids_in`, and the ``no_strays`` fixture (import it: after each test, it kills the spiders
  a failed test left); spider building blocks :data:`ESCAPE` and :data:`SLOW_BACKEND`.
- :func:`package_index` serves wheels made by :func:`wheel` as a simple index on 127.0.0.1.
- :func:`config_check` runs `ckagent config check` (:func:`unprivileged_config_check`: as a user
  without rights, from the pyz); :func:`check_leftovers` lists what a level check left (nothing).
- :class:`Node` is a node talking raw HTTP to the dev master (:func:`register`); :func:`store_node`,
  :func:`store_spider`, :func:`store_task` make them straight in its store.
- :class:`PollMaster` scripts the poll's answers and :class:`BatchMaster` holds one task's batches under
  the seq rules (with faults per request), both for ``httpx.MockTransport``; :class:`HoldingSupervisor`
  only admits.
- Hostile peers (:mod:`harness.hostile`): :class:`Upstream` (a loopback server that answers with its
  identity or misbehaves by path), :class:`Raw` (a client connection sending bytes as given),
  :func:`proxy_under_test` (the egress proxy of one task, in-process, with its upstreams).
- Behind the egress proxy (:mod:`harness.upstreams`): :class:`IdentityOrigin` (an origin that says who
  it is), :class:`RecordingProxy` (a team's HTTP proxy) and :class:`Socks5Server`, each recording what
  it received.
- What an autoscaler reads (:mod:`harness.autoscale`): :func:`scrape_samples` (a /metrics parsed by
  prometheus-client), :func:`keda_desired` (the manifests' KEDA query), :func:`serve_result_gate` (a dev
  master holding final results until the test opens it), :data:`GO_SPIDER`.
- A pod's PID 1 (:mod:`harness.supervised`): :class:`SupervisedNode` runs ``ckagent supervise`` as PID 1 of
  a pid namespace of its own (:func:`in_pid_namespace`: ``unshare``, root or a plain user) with a real
  agent, and finds the agent's and PID 1's outer pids; :func:`process_table` reads /proc.
- An agent as a process: :func:`agent_process` (test timings), :func:`wait_registered`,
  :func:`wait_exit`, :func:`node_status`; :func:`wait_for_log` waits for a line in the master.
- :func:`another_agent` holds an entry in a registry of agents' ports from a process of its own
  (:mod:`harness.agentports`); :func:`run_as` runs Python as another user and
  :func:`world_directory` gives it a directory it can reach, :func:`searchable_directory` one it can only
  enter (:mod:`harness.users`, root only).
- :func:`demo_with_crawl` runs ``ckagent demo --keep`` and a many-page Scrapy crawl on its agent
  (:mod:`harness.demo`; :func:`user_checkout` for a user who cannot read the checkout), and
  :func:`throwaway_user` makes a system user for one test (:mod:`harness.users`; :func:`unprivileged_user`:
  that, or the suite's own user when it is not root).
- :func:`web_hosts` runs identity web servers on loopback aliases (HTTP and HTTPS, keep-alive; each
  answer says which server gave it and echoes what it received) (:mod:`harness.webhosts`);
  :mod:`harness.webclients` runs real HTTP clients (Python, Node, curl, Chromium) through a task's
  egress proxy (:func:`proxied_task`) and checks their answers (:func:`check_answers`).
- :class:`EnvironProbe` records the environment each Python process started with it was given, so a
  test reads what ``/proc/<pid>/environ`` shows also where it may not read the file (a non-dumpable
  agent of a plain user) (:mod:`harness.environs`).
- :func:`python_or_skip` gives another CPython version (pyenv's, or on PATH) or skips the test saying
  why there is none (:mod:`harness.pythons`; :func:`find_python` for a skip mark).
- Spiders under uids of their own (:mod:`harness.identities`): :func:`spider_uid_env` gives a root test
  agent the default ``spider-uids`` level (its work dir reachable by :func:`spider_reachable`, an
  interpreter every uid runs: :func:`spider_python`); :func:`process_ids` reads who a process runs as,
  :func:`runs_as` whom a task log says its spider ran as (:func:`assert_default_identity`: the level
  a test agent gets, :data:`DEFAULT_IDENTITY`), :func:`id_files` writes passwd/group files naming chosen ids.
- Tasks at the ``nftables`` egress level (:mod:`harness.egresskernel`): :func:`egress_kernel_missing` (why
  not here), :func:`containment_at`, :func:`loopback_listener`, :func:`connect_from` (a child in a task's
  jail), :func:`table_text`, :func:`delete_table` and :func:`tables_deleted` (the test's agent's own table).
- :func:`bounded` runs a call that must not block (the agent reading a spider's FIFO) in a thread and
  fails the test when it does (:mod:`harness.hostilefiles`).
- :func:`loopback_listeners` / :func:`hold_port`: a test's server on 127.0.0.x holds its port number on
  127.0.0.1 too, so no agent's or proxy's listener has it (the ``agent`` egress group refuses those
  ports on every local address) (:mod:`harness.loopback`).
- Spiders as tenants (:mod:`harness.tenants`): a victim spider that keeps running and writes items
  (:data:`VICTIM_PY`, :data:`VICTIM_NODE`) and an attacker (:data:`ATTACKER`) that tries every
  cross-tenant action and reports each result; :func:`run_matrix` runs them on a real agent process
  (:mod:`harness.tenantmatrix`); :func:`user_agent_process` is an agent process a user without root runs
  from the pyz, for a root suite (:mod:`harness.useragent`).
- Crawls that survive their node (issue 38): :class:`CrawlSite` (:mod:`harness.crawlsite`) serves a
  paginated site of many pages at a steady rate and counts the fetches per page; :func:`two_nodes`
  (:mod:`harness.twonodes`) runs a reference master and two real agent processes at chosen levels
  (:data:`RESUME_LEVELS`), each of which can migrate (``ckagent stop --migrate``) or be lost
  (:func:`kill_node`, :mod:`harness.nodekill`: its agent, monitors, tasks and cgroups SIGKILLed, its
  work dir deleted, no other node touched); :func:`hand_over` (:mod:`harness.handover`) runs a crawl
  from node A to node B and checks it (:class:`Handover`).
- :func:`user_temp_dir` is a directory of this user's own in the machine's temp directory, kept across
  runs (:mod:`harness.tempdirs`): fixed names there are shared by every user of the machine.
- :class:`CheckpointMaster` holds checkpoints' chunks and manifests in memory under the protocol's rules,
  with faults per request, for ``httpx.MockTransport`` (:func:`checkpoint_client`); :func:`snapshot_tree`
  writes a spider's snapshot dir (:mod:`harness.checkpointmaster`).
- A spider's state (issue 38): :class:`TaskFiles` plays the agent's side of the control channel
  (:mod:`harness.spiderstate`; :func:`start_spider`, :func:`sdk_env`); :func:`serve_site` serves a site
  of N pages (and the demo shop) for the resumable examples, counting fetches (:mod:`harness.pagedsite`).
- config/k8s as the cluster receives it (:mod:`harness.manifests`): :func:`rendered` gives a variant's
  objects built by a real kustomize (:mod:`harness.kustomize`: the pinned release, fetched from the npm
  registry into the user's cache, or a skip saying why), :func:`schema_errors` and :func:`custom_errors`
  validate them offline (the Kubernetes schemas; the published CRDs of tests/data/crds),
  :func:`pod_settings` loads the settings a pod's agent runs with.
- A fleet on one machine (issue 39): :func:`harness.fleet.fleet` runs a reference master and many real
  agents, queues short and long (resumable) tasks, stops half the fleet mid-run (migrated and lost) and
  lists what broke "exactly once" (:mod:`harness.fleet`, imported from there: bench/fleet.py uses it too).
- A pod without a cluster (issue 39): :class:`harness.podbox.PodBox` starts the agent as a pod does — its
  own PID and mount namespaces (harness/podboxinit.py shapes them), a non-root uid without capabilities,
  a read-only root and cgroup but for its volumes, PID 1 ``ckagent supervise`` — in the manifests'
  variants, runs commands in it as a preStop hook does (:meth:`PodBox.exec_in`); :mod:`harness.podcrawls`
  queues the demo's job and resumable crawls for it and checks them (imported from those modules).
"""

from __future__ import annotations

from harness.agentports import *  # noqa: F403
from harness.agentproc import *  # noqa: F403
from harness.autoscale import *  # noqa: F403
from harness.checkpointmaster import *  # noqa: F403
from harness.checkpointnode import *  # noqa: F403
from harness.core import *  # noqa: F403
from harness.crawlsite import *  # noqa: F403
from harness.demo import *  # noqa: F403
from harness.eggs import *  # noqa: F403
from harness.egresskernel import *  # noqa: F403
from harness.environs import *  # noqa: F403
from harness.examples import *  # noqa: F403
from harness.fakes import *  # noqa: F403
from harness.handack import *  # noqa: F403
from harness.handover import *  # noqa: F403
from harness.hostile import *  # noqa: F403
from harness.hostilefiles import *  # noqa: F403
from harness.identities import *  # noqa: F403
from harness.index import *  # noqa: F403
from harness.kustomize import *  # noqa: F403
from harness.levelcheck import *  # noqa: F403
from harness.loopback import *  # noqa: F403
from harness.manifests import *  # noqa: F403
from harness.names import *  # noqa: F403
from harness.nodekill import *  # noqa: F403
from harness.nodelocks import *  # noqa: F403
from harness.npmregistry import *  # noqa: F403
from harness.pagedsite import *  # noqa: F403
from harness.procs import *  # noqa: F403
from harness.proxyclients import *  # noqa: F403
from harness.pythons import *  # noqa: F403
from harness.pyz import *  # noqa: F403
from harness.rawnode import *  # noqa: F403
from harness.recording import *  # noqa: F403
from harness.runsh import *  # noqa: F403
from harness.scrapyprojects import *  # noqa: F403
from harness.scrapyresume import *  # noqa: F403
from harness.smalldisk import *  # noqa: F403
from harness.spiderstate import *  # noqa: F403
from harness.supervised import *  # noqa: F403
from harness.tempdirs import *  # noqa: F403
from harness.tenantmatrix import *  # noqa: F403
from harness.tenants import *  # noqa: F403
from harness.twonodes import *  # noqa: F403
from harness.upstreams import *  # noqa: F403
from harness.useragent import *  # noqa: F403
from harness.users import *  # noqa: F403
from harness.webclients import *  # noqa: F403
from harness.webhosts import *  # noqa: F403
