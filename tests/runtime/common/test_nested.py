"""The one walker over nested structures (``stagehand.common.nested``): every tensor found, and
the structure rebuilt with the same types around the replaced tensors."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from stagehand.common.nested import flatten, in_backward

Pair = namedtuple("Pair", "first second")


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    note: str
    extra: int = dataclasses.field(default=7, init=False)


def test_flatten_finds_every_tensor_and_rebuilds_the_same_types():
    t = [torch.full((1,), float(i)) for i in range(6)]
    obj = (
        Pair(t[0], [t[1], "x", None]),
        {"k": t[2], "od": OrderedDict(z=t[3])},
        Frozen(t[4], "keep"),
        Transformer2DModelOutput(sample=t[5]),
        3,
    )
    found: list[torch.Tensor] = []
    rebuild = flatten(obj, found)
    assert [x.item() for x in found] == [0, 1, 2, 3, 4, 5]
    new = rebuild([x + 10 for x in found])
    pair, mapping, frozen, output, three = new
    assert type(pair) is Pair and pair.first.item() == 10 and pair.second[1:] == ["x", None]
    assert type(mapping["od"]) is OrderedDict and mapping["od"]["z"].item() == 13
    assert type(frozen) is Frozen and frozen.a.item() == 14 and frozen.note == "keep"
    assert frozen.extra == 7
    assert type(output) is Transformer2DModelOutput and output.sample.item() == 15
    assert output[0] is output.sample  # BaseOutput's tuple view follows the new field
    assert three == 3 and obj[2].a.item() == 4  # the original is untouched


def test_in_backward_is_true_only_inside_autograd():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(in_backward()))
    y.sum().backward()
    assert seen == [True] and not in_backward()
