"""A spider's code and dependencies: its package on this node, its working copy, its environments.

- :mod:`.frameworks` — one record per framework (runtime, tool, packages, default command, markers,
  hooks), read by everything below and above that asks; :mod:`.scrapyhook` — Scrapy's hooks;
- :mod:`.workspace`, :mod:`.unpack` — ``work_dir/spiders/<spiderId>/<version>/``, fetched and written
  atomically; a package's rules (paths, kinds, sizes) and its extraction; :mod:`.eggs` — Scrapyd eggs
  (their ``[scrapy] settings`` entry point, run as Scrapyd runs them);
- :mod:`.workcopy` — a task's private working copy, and the per-spider directories that outlive runs;
- :mod:`.scrapydata` — Scrapy's project data dir (``.scrapy``) kept in the spider's data dir between its tasks;
- :mod:`.deps` (the one door), :mod:`.deps_python`, :mod:`.deps_node`, :mod:`.pyplan`, :mod:`.pylocks`,
  :mod:`.installenv` — content-addressed, shared environments (uv for Python, npm for Node) and what
  goes into their key; :mod:`.nodetools` — yarn and pnpm for their lock files (the node's own, or
  fetched from the npm registry into a sealed per-version cache; never corepack);
  :mod:`.installer` — how one installer runs (bounded, in the task's box);
  :mod:`.builder` — who installs (the node's builder, never a spider) and how a finished environment
  is sealed read-only; :mod:`.stage`, :mod:`.pyreqs`, :mod:`.nodestage` — what an install reads of a project (regular
  files, no link followed) and what a Python project requires, read without running its code;
- :mod:`.envstore` — the environments' directory: built once, shared, sealed, collected;
- :mod:`.runtimes`, :mod:`.capabilities` — what this node can run, and what it cannot.
- :mod:`.browsers` — whether spiders' Chromium can use its own sandbox here (``CK_CHROMIUM_SANDBOX``).

May import: :mod:`ckagent.node`, :mod:`ckagent.master` (to fetch packages),
:mod:`ckagent.containment` (installers run in the task's box, under the one process supervisor).
"""
