"""The device layer's own rules (``runtime/stagehand/common/device.py``)."""

import torch

from stagehand.common.device import same_device


def test_a_cuda_device_without_an_index_is_the_current_one(monkeypatch):
    """A runtime built with ``device="cuda"`` finds its gradients and optimizer state on
    ``cuda:0`` already on the device (no copy per use): ``torch.device("cuda") != "cuda:0"``."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cuda, one, zero = torch.device("cuda"), torch.device("cuda:1"), torch.device("cuda:0")
    assert same_device(cuda, one) and same_device(one, cuda) and same_device(cuda, cuda)
    assert not same_device(cuda, zero) and not same_device(zero, one)
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), cuda)
