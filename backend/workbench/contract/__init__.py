"""What the worker, the server and the browser must agree on, each rule written once.

Three processes meet here: the worker (``workbench train``, ``worker``) writes a run
folder, the server (``backend``) launches, tails and steers it, and the dashboard reads what the
server sends. Every name or format two of them must spell alike lives in this package, and both
sides import it:

- ``workbench.contract.status``: a run's status names and the moves between them;
- ``workbench.contract.javascript``: ``/static/js/contract.js``, what the dashboard imports
  instead of keeping lists of its own (the statuses, the live-limit fields, the allowed values);
- ``workbench.contract.records``: the ``(source, kind)`` of the trainer's telemetry records the
  server reads (the runtimes' own are ``stagehand.config.records``);
- ``workbench.contract.control``: the run's control folder (stop, live limits): the server
  writes requests (``write_request``), the worker consumes them (``ControlDir``);
- ``workbench.contract.preset``: the preset schema (pydantic), its errors and the merge of
  overrides into a preset (``merge_overrides``);
- ``workbench.contract.plan_inputs``, ``workbench.contract.text``: the planner's device profiles
  the API accepts, how a user's text is shown.

It builds on the runtime's configuration (``stagehand.config``: the memory section's schema, the
live limits and their watermark rule, the telemetry wire, the cache folder and how a user's
folder is read), which both sides import the same way.

The standard library, pydantic and ``stagehand.config`` only: no torch (``tests/test_layers.py``
holds it to that), so the server imports it without the runtimes. Field-level formats are in ``docs/contracts.md``.
"""
