"""Stagehand Workbench's memory runtimes: weight streaming (``stagehand.weights``), activation spill
(``stagehand.activations``) and the Conductor (``stagehand.conductor``), composed behind one
``MemoryStrategy`` (``stagehand.strategy``) that a training loop drives.

A library: it imports itself and third-party packages (torch, safetensors, psutil, pydantic),
never the workbench (``tests/test_layers.py`` holds it to that). Its configuration, the memory
section's schema, is ``stagehand.config`` (torch-free). The public API and a whole training loop:
``docs/runtime.md``; a runnable one (weight streaming, activation spill and the Conductor on a
small FLUX transformer): ``runtime/examples/lora_stream.py``. The one call that switches the
runtime on is ``stagehand.build_strategy`` (``stagehand.strategy.build_strategy``, loaded on
first use: ``import stagehand.config`` runs this module, and must not import torch).

The call order, once (each step has its reason):

1. load the model (``from_pretrained``; a folder of safetensors, sharded or not);
2. add the LoRA adapter, so the runtime sees which parameters train (they stay module-backed,
   frozen ones stream from the files);
3. enable gradient checkpointing (layer offload replaces it with its own per-layer wrapper);
4. ``model.train()``;
5. ``build_strategy(model, memory_section, device=..., checkpoint_dir=folder)``: it may replace
   parameter objects (a model built on ``meta``), so
6. build the optimizer after it, and pass it to ``strategy.optimizer(optimizer)``: trainable
   parameters of streamed blocks and their optimizer state move to the device for the step.

A complete run (tiny Flux transformer, LoRA, blocks evicted after every use)::

    >>> import tempfile, torch
    >>> from diffusers import FluxTransformer2DModel
    >>> from peft import LoraConfig
    >>> from stagehand import build_strategy
    >>> folder = tempfile.mkdtemp()
    >>> FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
    ...     attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
    ...     pooled_projection_dim=16, axes_dims_rope=(2, 2, 4)).save_pretrained(folder)
    >>> model = FluxTransformer2DModel.from_pretrained(folder)                     # 1
    >>> _ = model.requires_grad_(False)
    >>> model.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))  # 2
    >>> model.enable_gradient_checkpointing()                                      # 3
    >>> model = model.train()                                                      # 4
    >>> strategy = build_strategy(model, {"strategy": "stagehand", "stagehand": {
    ...     "pinned_pool_mb": 4, "pinned_slab_mb": 1, "vram_high_watermark_mb": 0,
    ...     "vram_low_watermark_mb": 0}}, device="cpu", checkpoint_dir=folder)       # 5
    >>> optimizer = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)  # 6
    >>> def inputs(seed):  # a batch of 1: 16 latent tokens of 4 channels, 8 text tokens
    ...     g = torch.Generator().manual_seed(seed)
    ...     return {"hidden_states": torch.randn(1, 16, 4, generator=g),
    ...         "encoder_hidden_states": torch.randn(1, 8, 16, generator=g),
    ...         "pooled_projections": torch.randn(1, 16, generator=g),
    ...         "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3),
    ...         "txt_ids": torch.zeros(8, 3)}
    >>> for step in range(2):
    ...     with strategy.step(step):
    ...         with strategy.forward():
    ...             loss = model(**inputs(step)).sample.pow(2).mean()
    ...         with strategy.backward():
    ...             loss.backward()
    ...         with strategy.optimizer(optimizer):
    ...             optimizer.step()
    ...             optimizer.zero_grad(set_to_none=True)
    >>> work = strategy.counters()  # the last step's: 4 blocks in forward, 4 in backward
    >>> work["blocks_loaded"], work["blocks_evicted"], work["file_reads"] > 0
    (8, 8, True)
    >>> strategy.close()  # ordinary resident weights again; the pools are freed

# NOTE [ Exact numbers ]
The runtimes change memory and time, never the numbers: a streamed model computes exactly what
the same model computes with its weights in ordinary device tensors (loss, every gradient, None
where there is none, and so the weights after any number of optimizer steps; fp32 and bf16
alike, checked with ``torch.equal``). What that takes:

- every weight view inside a block buffer starts at an offset aligned as the device's
  allocator aligns an ordinary tensor (512 bytes, ``registry.ALIGN``), so GEMMs choose the
  kernels they choose for ordinary tensors (on some CPUs a GEMM's last bit depends on its
  inputs' alignment; on CUDA a misaligned view picks other, slower cuBLAS kernels);
- resident weights are ordinary allocations too (``stagehand.common.own_storage``):
  ``from_pretrained`` leaves CPU weights as views into the mmap'd file at unaligned offsets, and
  the plain baseline (``strategy: "none"``) is given the same treatment;
- the backward boundaries add no node on a block's inputs and pass None gradients on
  (NOTE [ Backward block boundaries ] in ``runtime/stagehand/weights/hooks.py``): autograd sums every
  gradient in the same order as without the runtime.

``tests/runtime/test_exactness.py`` checks it for every strategy; ``./dev test`` runs those tests a
second time with ``ATEN_CPU_CAPABILITY=default`` (another CPU kernel path).
"""

__all__ = ["MemoryStrategy", "build_strategy"]


def __getattr__(name: str):
    """``stagehand.build_strategy`` and ``stagehand.MemoryStrategy``, imported on first use.

    Raises:
        AttributeError: ``name`` is neither.
    """
    if name in __all__:
        from stagehand import strategy  # lazy: import stagehand.config runs this, torch-free

        return getattr(strategy, name)
    raise AttributeError(f"module 'stagehand' has no attribute {name!r}")
