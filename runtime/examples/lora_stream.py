"""A LoRA fine-tune of a diffusers transformer in a plain PyTorch loop, with the Stagehand runtime's
weight streaming, activation spill and Conductor all on (``docs/runtime.md``).

    python runtime/examples/lora_stream.py                 # CUDA when present, else the CPU
    python runtime/examples/lora_stream.py --device cpu --steps 3

The model is a tiny random FLUX transformer, saved and loaded back as a real checkpoint is
(``from_pretrained`` on a folder of safetensors), so frozen block weights stream from the file.
The budgets are tiny on purpose: 1 MB of device memory to load blocks ahead in, every block evicted
after its use, every saved activation spilled to the host (a real run moves that much only when
the card is that small). Imports only ``stagehand``, torch, diffusers and peft. Prints one line
per step, then a JSON line of figures (``tests/runtime/test_example.py`` checks them).
"""

import argparse
import json
import shutil
import sys
import tempfile

import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig

from stagehand import build_strategy
from stagehand.common.telemetry import ListSink, Telemetry

MEMORY = {  # the memory section (stagehand.config.memory.MemoryConfig); sizes in MB of 2**20 B
    "strategy": "stagehand",
    "stagehand": {  # weight streaming: 1 MB to load ahead in, every block evicted after its use
        "vram_high_watermark_mb": 1, "vram_low_watermark_mb": 0, "prefetch_window_blocks": 1,
        "pinned_pool_mb": 8, "pinned_slab_mb": 1,  # host staging pool: 8 slabs of 1 MB
        "activation_stagehand": {  # spill every saved activation (watermarks 0) to the host
            "vram_high_watermark_mb": 0, "vram_low_watermark_mb": 0,
            "pinned_pool_classes_mb": [1, 4], "slabs_per_class": 4},
        "conductor_config": {"enabled": True, "pinned_budget_mb": 64},  # arbitration on
    },
}  # fmt: skip


def run(device: str, steps: int = 3, memory: dict = MEMORY) -> dict:
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="lora_stream_")  # the "checkpoint", removed at the end
    FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)).save_pretrained(folder)  # fmt: skip
    model = FluxTransformer2DModel.from_pretrained(folder).requires_grad_(False)  # 1. load
    model.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))  # 2. LoRA
    model.enable_gradient_checkpointing()  # 3. checkpointing
    model.train()  # 4. train mode
    sink = ListSink()
    strategy = build_strategy(  # 5. the one call that switches the runtime on
        model, memory, device=device, telemetry=Telemetry(sink), checkpoint_dir=folder
    )
    lora = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().cpu().clone() for p in lora]
    optimizer = torch.optim.AdamW(lora, lr=1e-3)  # 6. the optimizer after build_strategy
    g = torch.Generator().manual_seed(0)  # one batch: 64 latent tokens, 16 text tokens
    shapes = {"hidden_states": (1, 64, 4), "encoder_hidden_states": (1, 16, 32),
        "pooled_projections": (1, 32), "target": (1, 64, 4)}  # fmt: skip
    batch = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    batch |= {
        "img_ids": torch.zeros(64, 3),
        "txt_ids": torch.zeros(16, 3),
        "timestep": torch.ones(1),
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    target, losses = batch.pop("target"), []
    for step in range(steps):
        with strategy.step(step):
            with strategy.forward():
                loss = (model(**batch).sample - target).pow(2).mean()
            with strategy.backward():
                loss.backward()
            with strategy.optimizer(optimizer):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        work = strategy.counters()  # this step's work (docs/runtime.md, "Counters")
        print(f"step {step}: loss {losses[-1]:.6f}, {work['blocks_loaded']} blocks loaded "
            f"({work['prefetch_hits']} prefetched), {work['spill_bytes']} bytes spilled, "
            f"{work['grants']} Conductor grants")  # fmt: skip
    figures = {**strategy.counters(), "losses": losses, "device": device}
    changed = sum(not torch.equal(b, p.cpu()) for b, p in zip(before, lora, strict=True))
    figures["lora_changed"], figures["lora_tensors"] = changed, len(lora)
    figures["records"] = len(sink.records)  # telemetry records the runtimes wrote
    strategy.close()  # ordinary resident weights again; the pools are freed
    shutil.rmtree(folder)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    figures = run(args.device, args.steps)
    print(json.dumps({**figures, "workbench_imported": "workbench" in sys.modules}))
