"""OffloadCheckpointLayer: keyword, nested and dataclass tensors become checkpoint inputs."""

import dataclasses

import pytest
import torch
from torch import nn

from stagehand.layer_offload.checkpoint_layer import OffloadCheckpointLayer, install, uninstall


@dataclasses.dataclass(frozen=True)
class Cond:
    temb: torch.Tensor
    scale: float


class Toy(nn.Module):
    """A block called like diffusers' (keyword tensors, a tuple, a dataclass)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, context, cond, rotary=None):
        cos, sin = rotary
        y = self.lin(x) * torch.sigmoid(cond.temb) + context.mean(1, keepdim=True) * cond.scale
        return y * cos + sin, context * 2


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    ctx = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    temb = torch.randn(2, 1, 8, generator=g, requires_grad=True)
    rotary = (torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g))
    return x, ctx, temb, rotary


def _call(module, x, ctx, temb, rotary):
    y, c = module(x, context=ctx, cond=Cond(temb, 0.5), rotary=rotary)
    (y.square().sum() + c.sum()).backward()
    return y.detach(), [t.grad.clone() for t in (x, ctx, temb)]


@pytest.mark.parametrize("share_temb", [False, True])
def test_every_tensor_is_a_checkpoint_input_unless_shared(share_temb):
    torch.manual_seed(0)
    toy = Toy()
    x, ctx, temb, rotary = _inputs()
    ref_y, ref_grads = _call(toy, x, ctx, temb, rotary)
    for t in (x, ctx, temb):
        t.grad = None

    calls = []
    wrapper = OffloadCheckpointLayer(
        toy,
        0,
        device=torch.device("cpu"),
        before_layer=lambda i, r: calls.append(("before", r)),
        after_layer=lambda i, r: calls.append(("after", r)),
        shared=(lambda t: t is temb) if share_temb else None,
    )
    assert [n for n, _ in wrapper.named_parameters()] == ["lin.weight", "lin.bias"]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, grads = _call(wrapper, x, ctx, temb, rotary)
    assert torch.equal(y, ref_y)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)
    # Outside the region only the checkpoint's inputs are saved: every tensor passed as a
    # keyword, in the tuple and in the dataclass (the seed's kwargs bug), by identity.
    ids = {id(t) for t in saved}
    expected = [x, ctx, rotary[0], rotary[1]] + ([] if share_temb else [temb])
    assert all(id(t) in ids for t in expected)
    assert (id(temb) in ids) is not share_temb
    assert len(saved) == len(expected) + 1  # + the output's square (outside the region)
    # Forward and recomputation both enter the layer; the early-stopped recomputation never
    # reaches ``after_layer``.
    assert calls == [("before", False), ("after", False), ("before", True)]


def test_install_and_uninstall_keep_names_and_restore_originals():
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([Toy(), Toy()]))
    names = [n for n, _ in model.named_parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    originals = list(model[1])
    noop = lambda i, r: None  # noqa: E731
    installed = install(
        model,
        [("1.0", originals[0]), ("1.1", originals[1])],
        lambda i, m: OffloadCheckpointLayer(
            m, i, device=torch.device("cpu"), before_layer=noop, after_layer=noop
        ),
    )
    assert all(isinstance(m, OffloadCheckpointLayer) for m in model[1])
    assert [n for n, _ in model.named_parameters()] == names
    assert model.state_dict().keys() == state.keys()
    model.eval()
    assert not originals[0].training and not model[1][0].training
    uninstall(installed)
    assert list(model[1]) == originals


def test_install_refuses_a_module_that_is_not_where_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="block '1' is not module '1'"):
        install(model, [("1", model[0])], lambda i, m: m)
