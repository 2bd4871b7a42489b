"""What the worker, the server and the browser must agree on, each rule written once.

Three processes meet here: the worker (``workbench train``, ``worker``) writes a run
folder, the server (``backend``) launches, tails and steers it, and the dashboard reads what the
server sends. Every name or format two of them must spell alike lives in this package, and both
sides import it:

- ``contract.status``: a run's status names and the moves between them;
- ``contract.javascript``: ``/static/js/contract.js``, what the dashboard imports instead of
  keeping lists of its own (the statuses, the live-limit fields, the allowed values);
- ``contract.records``: the ``(source, kind)`` of the telemetry records the server reads;
- ``contract.wire``: the telemetry stream on the wire: the file name (``telemetry.jsonl``), a
  record's JSONL line (``encode``: non-finite floats as ``null``; ``decode`` on the reading side),
  the stdout marker and the environment variable that turns the stdout copy on;
- ``contract.control``: the run's control folder (stop, live limits): the server writes
  requests (``write_request``), the worker consumes them (``ControlDir``);
- ``contract.limits``: the live limits: their fields, each field's config path, the watermark
  pairs and the one watermark rule (low <= high, ``"auto"`` in configs);
- ``contract.preset``: the preset schema (pydantic), its errors and the merge of overrides
  into a preset (``merge_overrides``);
- ``contract.config``: the memory config schema (``MemoryConfig``, the runtimes' sections,
  ``LiveLimits``) that presets, the planner and the runtimes read;
- ``contract.cache``: the cache folder the server and the worker share;
- ``contract.safe_read``: how the server and the worker read what a user hands them (model
  folders' JSON and safetensors headers, captions, request bodies): regular files only, a
  bounded prefix, JSON nested at most ``MAX_JSON_DEPTH`` levels.

The standard library and pydantic only (the schemas): no torch, nothing else of the project
(``tests/test_layers.py`` holds it to that), so the server imports it without the runtimes and a reader finds the whole
agreement in one folder. Field-level formats are in ``docs/contracts.md``.
"""
