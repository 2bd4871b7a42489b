"""The runtime's configuration and the formats it writes, torch-free (the standard library and
pydantic only), so a server or a planner reads them without loading torch:

- ``stagehand.config.memory``: the memory section's schema (``MemoryConfig``: ``strategy``, the
  weight runtime's ``stagehand``, ``activation_stagehand``, ``conductor``, ``squareq``;
  ``LiveLimits``, the limits a training loop may change between steps);
- ``stagehand.config.limits``: the live limits' fields, each one's config path, the watermark
  pairs and the one watermark rule (low <= high, ``"auto"`` in configs);
- ``stagehand.config.records``: the ``(source, kind)`` of the records the runtimes emit that a
  reader looks up by name;
- ``stagehand.config.wire``: a telemetry record's JSONL line (``encode``: non-finite floats as
  ``null``; ``decode``), the file name and the stdout copy's marker;
- ``stagehand.config.safe_read``: how a model folder's JSON and safetensors headers are read:
  regular files only, a bounded prefix, JSON nested at most ``MAX_JSON_DEPTH`` levels;
- ``stagehand.config.cache``: the cache folder (SquareQ's 8-bit images live there).
"""
