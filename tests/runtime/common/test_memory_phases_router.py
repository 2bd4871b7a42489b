import pytest
import torch

from stagehand.common.memory import DeviceMemory
from stagehand.common.phases import Phase, PhaseError, check_transition
from stagehand.common.saved_tensors import SavedTensorRouter
from stagehand.config.memory import MB


def test_tracked_memory_counts_categories_and_peak():
    mem = DeviceMemory("cpu")
    assert mem.source == "tracked"
    mem.track(3 * MB, "weights")
    mem.track(1 * MB, "activations")
    mem.untrack(2 * MB, "weights")
    assert mem.allocated_bytes() == mem.usage_bytes() == 2 * MB
    assert mem.tracked_bytes("weights") == MB
    assert mem.peak_bytes() == 4 * MB
    mem.reset_peak()
    assert mem.peak_bytes() == 2 * MB
    snap = mem.snapshot()
    assert snap["vram_allocated_mb"] == 2.0 and snap["vram_source"] == "tracked"


def test_untracking_more_than_tracked_raises():
    mem = DeviceMemory("cpu")
    mem.track(10, "weights")
    with pytest.raises(RuntimeError, match="more than tracked"):
        mem.untrack(11, "weights")
    with pytest.raises(RuntimeError):
        mem.untrack(1, "activations")


def test_cuda_figures_read_the_allocator_once_per_change(monkeypatch):
    """On CUDA one read of the allocator's statistics serves every figure until the runtimes'
    own bytes change or ``STATS_REUSE_S`` passed (the allocator read stands in for CUDA)."""
    from stagehand.common import memory as memory_module

    reads = []

    def stats(device):
        reads.append(device)
        n = len(reads)
        return {
            "allocated_bytes": {"all": {"current": 100 * n}},
            "reserved_bytes": {"all": {"current": 300 * n}},
            "inactive_split_bytes": {"all": {"current": 7}},
        }

    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", stats)
    monkeypatch.setattr(memory_module, "STATS_REUSE_S", 60.0)
    mem = DeviceMemory("cuda")
    assert mem.allocated_and_reserved() == (100, 300)
    assert mem.usage_bytes() == 107 and mem.allocated_bytes() == 100 and len(reads) == 1
    mem.track(5, "weights")  # the runtime placed bytes: the next figure is read anew
    assert mem.allocated_bytes() == 200 and mem.reserved_bytes() == 600 and len(reads) == 2
    mem.untrack(5, "weights")
    assert mem.usage_bytes() == 307 and len(reads) == 3
    monkeypatch.setattr(memory_module, "STATS_REUSE_S", 0.0)
    mem.allocated_bytes()
    mem.allocated_bytes()
    assert len(reads) == 5  # no reuse once the window has passed


def test_phase_order():
    order = [Phase.STEP_BEGIN, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.STEP_END]
    current = None
    for phase in order + [Phase.STEP_BEGIN, Phase.FORWARD, Phase.STEP_END]:
        check_transition(current, phase)
        current = phase
    with pytest.raises(
        PhaseError, match="after FORWARD expected BACKWARD or STEP_END, got OPTIMIZER"
    ):
        check_transition(Phase.FORWARD, Phase.OPTIMIZER)
    with pytest.raises(PhaseError, match="after no phase expected STEP_BEGIN"):
        check_transition(None, Phase.FORWARD)


class _Handle:
    def __init__(self, tensor, log):
        self.tensor, self.log = tensor.clone(), log

    def unpack(self):
        self.log.append("unpack")
        return self.tensor


def test_router_first_claim_wins_and_gradients_match():
    log = []
    claimed = []

    def first(t):
        return None  # claims nothing

    def second(t):
        if t.numel() >= 4:
            claimed.append(t.shape)
            return _Handle(t, log)
        return None

    router = SavedTensorRouter([first, second])
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    with router.hooks():
        y = (x @ w).tanh().sum()
    y.backward()
    grad = w.grad.clone()
    w.grad = None
    (x @ w).tanh().sum().backward()
    assert torch.equal(grad, w.grad)
    assert claimed and log.count("unpack") == len(claimed)
