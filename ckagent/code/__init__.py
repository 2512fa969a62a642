"""A spider's code and dependencies: its package on this node, its working copy, its environments.

- :mod:`.frameworks` — one record per framework (runtime, tool, packages, default command, markers,
  hooks), read by everything below and above that asks; :mod:`.scrapyhook` — Scrapy's hooks;
- :mod:`.workspace`, :mod:`.unpack` — ``work_dir/spiders/<spiderId>/<version>/``, fetched and written
  atomically; a package's rules (paths, kinds, sizes) and its extraction;
- :mod:`.workcopy` — a task's private working copy, and the per-spider directories that outlive runs;
- :mod:`.deps` (the one door), :mod:`.deps_python`, :mod:`.deps_node`, :mod:`.pyplan`, :mod:`.pylocks`,
  :mod:`.installenv` — content-addressed, shared environments (uv for Python, npm for Node) and what
  goes into their key; :mod:`.installer` — how one installer runs (bounded, in the task's box);
- :mod:`.envstore` — the environments' directory: built once, shared, collected;
- :mod:`.runtimes`, :mod:`.capabilities` — what this node can run, and what it cannot.

May import: :mod:`ckagent.node`, :mod:`ckagent.master` (to fetch packages),
:mod:`ckagent.containment` (installers run in the task's box, under the one process supervisor).
"""
