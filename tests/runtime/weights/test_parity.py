"""What streaming does along the way while training exactly as the plain model (the exactness
matrix over models, methods, strategies and checkpointing is ``tests/runtime/test_exactness.py``)."""

import pytest
import torch

from stagehand.common import ListSink, Telemetry
from stagehand.weights import WeightRuntime

from ._train import assert_same_training, config, make_model, train

pytestmark = pytest.mark.parity  # run again with ATEN_CPU_CAPABILITY=default by ./dev test


@pytest.mark.parametrize("backing", ["module", "file"])
def test_streaming_trace_prefetch_and_close(tiny_flux, backing):
    arch, method, checkpointing, path = "flux", "lora", True, tiny_flux
    reference = train(make_model(arch, path, method, checkpointing))
    model = make_model(arch, path, method, checkpointing)
    sink = ListSink()
    runtime = WeightRuntime(
        model,
        config(),
        device="cpu",
        telemetry=Telemetry(sink),
        checkpoint_dir=path if backing == "file" else None,
    )
    if backing == "file":
        frozen = [s for b in runtime.blocks for s in b.layout if not s.trainable]
        assert frozen and all(s.key is not None and s.param.numel() == 0 for s in frozen)
    assert_same_training(reference, train(model, runtime))
    steps = sink.of("stagehand", "step")
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert steps[0]["prefetch_hits"] == 0 and steps[2]["prefetch_misses"] == 0
    assert steps[2]["prefetch_hits"] >= len(runtime.blocks)
    runtime.close()
    # close() restores ordinary weights: the model runs without the runtime
    plain = make_model(arch, path, method, checkpointing)
    with torch.no_grad():
        plain.load_state_dict(model.state_dict())
    assert all(p.numel() > 0 for p in model.parameters())
