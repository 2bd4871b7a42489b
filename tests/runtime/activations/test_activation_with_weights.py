"""The activation runtime composed with the weight runtime through one ``SavedTensorRouter``
(weight packer first), sharing one ``DeviceMemory``, nested as the seed shows; with and
without gradient checkpointing. Gradients must equal those of the model without either."""

import pytest
import torch

from stagehand.activations import ActivationRuntime
from stagehand.common.memory import DeviceMemory
from stagehand.common.saved_tensors import SavedTensorRouter
from stagehand.config.memory import ActivationStagehandConfig, StagehandConfig
from workbench.bench.activations import lora_model, train_steps
from workbench.worker.assets import example_inputs, output_tensor

pytestmark = pytest.mark.parity  # run again with ATEN_CPU_CAPABILITY=default by ./dev test

weights_runtime = pytest.importorskip("stagehand.weights")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_weights_and_activations_together_match_plain_training(tiny_flux, checkpointing):
    ref = train_steps(lora_model("flux", tiny_flux, checkpointing=checkpointing), 3)
    model = lora_model("flux", tiny_flux, checkpointing=checkpointing)
    memory = DeviceMemory("cpu")
    weights = weights_runtime.WeightRuntime(
        model,
        StagehandConfig(
            pinned_pool_mb=4,
            pinned_slab_mb=1,
            prefetch_window_blocks=1,
            vram_high_watermark_mb=1000,
            vram_low_watermark_mb=0,  # every block streams (NOTE [ Eviction policy ])
        ),
        device="cpu",
        memory=memory,
        checkpoint_dir=tiny_flux,
    )
    acts = ActivationRuntime(
        ActivationStagehandConfig(
            vram_high_watermark_mb=0,
            vram_low_watermark_mb=0,
            min_spill_bytes=0,
            pinned_pool_classes_mb=(0.0625, 0.25),
            slabs_per_class=(128, 8),
        ),
        device="cpu",
        memory=memory,
        model=model,
    )
    router = SavedTensorRouter([weights.packer, acts.packer])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        inputs = example_inputs(model, seed=step)
        weights.begin_step(step)
        acts.begin_step(step)
        with router.hooks():
            with weights.managed_forward(install_hooks=False), acts.managed_forward(False):
                loss = output_tensor(model(**inputs)).float().square().mean()
            acts.backward_begin()
            with weights.managed_backward():
                loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        for i, (a, b) in enumerate(zip(ref["grads"][step], grads, strict=True)):
            assert torch.equal(a, b), f"step {step}: gradient {i} differs"
        with weights.optimizer_context(optimizer):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        acts.end_step()
        weights.end_step()
        m = acts.step_metrics()
        assert m["activations_spilled"] > 0
        assert m["activations_restored"] == m["activations_spilled"]
        assert m["activations_saved"] == m["activations_kept"] + m["activations_spilled"]
        assert memory.tracked_bytes("activations") == 0
        assert weights.step_metrics()["blocks_loaded"] > 0
    assert m["stall_count"] == 0  # traced after the first step
    acts.close()
    weights.close()
