"""The training worker (``workbench train``): two-stage diffusers + peft LoRA trainer.

Modules: ``cli`` (entry point, run orchestration), ``scan`` (which files of the data folder make
samples, and why the others do not), ``data`` (images and frame stacks to tensors, buckets),
``families`` (flux / sd3 / ltx adapters, flow matching), ``encode`` (stage 1 caching), ``loop``
(stage 2), ``control`` (SIGTERM; the control folder is ``contract.control``), ``outputs`` (LoRA,
checkpoints, samples),
``progress`` (terminal bar or plain lines), ``demo`` (the demo's VAE and base model trained on
the digits) and ``demo_cli`` (``workbench demo-assets``).
"""
