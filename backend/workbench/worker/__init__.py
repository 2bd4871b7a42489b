"""Stagehand Workbench's training worker: ``workbench train PRESET_OR_CONFIG --run-dir DIR``, the
process the server launches for each run, a two-stage diffusers + peft LoRA trainer that runs
under the memory runtimes (``runtime``).

The life of a run, once (each module named beside its part):

1. ``cli``: read the preset (``preset``: by name or a JSON path, checked whole) and the device;
   ``run.Run`` takes it from there, writing everything it reports into ONE telemetry stream,
   ``DIR/telemetry.jsonl`` (``stagehand.config.wire``), shared with the memory strategy.
2. ``setup``: the family adapter (``families`` for the factory models, ``pipelines/`` for a
   diffusers pipeline folder or a single file), the folders, the held-out samples, the LoRA
   targets, and the checks that refuse a run before anything is written.
3. ``stage1``: scan the data folder (``scan``; images through ``data``, clips through
   ``clips``), then cache one text row per caption and one latent per sample (``encode``), the
   text encoder streamed under the weight runtime; the encoders are released before stage 2.
4. ``loop``: load the transformer, attach the LoRA, build the memory strategy
   (``stagehand.strategy.build_strategy``), train; between steps read the control folder (stop,
   live limits) and the SIGTERM flag (``control``). Each step's batch, noise and sigmas come
   from a generator seeded with ``(seed, step)``, so a resumed run computes the same losses.
5. ``sampling`` and ``outputs``: sample images before the first step, every
   ``samples.every`` steps and at the end; checkpoints; the LoRA in diffusers' and ComfyUI's
   layouts; the final record (``records``).

Beside the trainer, what it loads: ``assets/`` (the model and data factory: random models from
small configs, the digits, the text encoder), ``asset_status`` (the demo build's status file,
read torch-free by the server), ``demo``, ``demo_stages`` and ``demo_cli`` (the embedded demo's
VAE and base model, trained on the digits at asset-build time: ``workbench demo-assets``).

What the worker and the server agree on (statuses, records, the control folder) is
``contract``'s; ``docs/contracts.md`` describes the run folder.
"""
