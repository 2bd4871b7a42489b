"""``page_locked_buffer``'s lock lifetime, against a recording stand-in for the CUDA runtime's
``cudaHostRegister``/``cudaHostUnregister`` (this machine has no GPU; the calls' order, ranges
and timing are ours): a range is unregistered once, while still mapped, when ``unlock`` is called
or when the last view of the buffer is freed; a failed lock clears the CUDA error it left."""

from __future__ import annotations

import ctypes
import gc
import mmap

import pytest
import torch

from stagehand.common import device


class FakeCudart:
    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[tuple[int, bytes]] = []
        self.calls: list[tuple[str, int, object]] = []
        """(call, flags, the current device when called: ``FakeDevice.current``)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, size))
        self.calls.append(("register", flags, FakeDevice.current))
        return self.register_error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        # Reading the range's first byte here segfaults if it was unmapped before the unlock.
        self.unregistered.append((ptr, ctypes.string_at(ptr, 1)))
        self.calls.append(("unregister", 0, FakeDevice.current))
        return 0


class FakeDevice:
    """``torch.cuda.device`` on a machine without CUDA: which device the calls inside run on."""

    current: object = "cuda:0"

    def __init__(self, device) -> None:
        self.device = str(torch.device(device))

    def __enter__(self) -> None:
        self.before, FakeDevice.current = FakeDevice.current, self.device

    def __exit__(self, *exc) -> None:
        FakeDevice.current = self.before


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_the_lock_covers_whole_pages_and_ends_with_the_last_view(cudart):
    page = mmap.PAGESIZE
    buffer = device.page_locked_buffer(2 * page + 5)
    assert buffer.numel() == 2 * page + 5 and buffer.dtype == torch.uint8
    ptr = buffer.data_ptr()
    assert ptr % page == 0
    assert cudart.registered == [(ptr, 3 * page)]
    buffer[0] = 42
    view = buffer[page:]
    del buffer
    gc.collect()
    assert cudart.unregistered == []  # a view still reads the range
    del view
    gc.collect()
    assert cudart.unregistered == [(ptr, b"\x2a")]  # once, with the pages still mapped
    assert ptr not in device._LOCKED


def test_unlock_ends_the_lock_once(cudart):
    buffer = device.page_locked_buffer(100)
    ptr = buffer.data_ptr()
    device.unlock(buffer)
    device.unlock(buffer)
    assert [p for p, _ in cudart.unregistered] == [ptr]
    buffer[:] = 7  # still valid (pageable) memory
    del buffer
    gc.collect()
    assert len(cudart.unregistered) == 1


def test_a_failed_lock_raises_and_clears_the_cuda_error(monkeypatch):
    fake = FakeCudart(register_error=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    cleared = []
    monkeypatch.setattr(device, "_clear_cuda_error", lambda on=None: cleared.append(True))
    with pytest.raises(RuntimeError, match="cudaHostRegister of 100 bytes failed with cudaError 2"):
        device.page_locked_buffer(100)
    assert cleared == [True]
    gc.collect()
    assert fake.unregistered == []  # nothing was locked: nothing to unlock


def test_a_second_gpu_locks_portable_memory_without_touching_the_first(cudart, monkeypatch):
    """Defect 6: the range is registered portable (flag 1, as ``torch.cuda._pin_memory_utils``
    does: a copy on any GPU reads it asynchronously), and every runtime call, the unregister and
    the error clearing's kernel included, runs on the runtime's device: before, flags 0 and
    ``torch.zeros(1, device="cuda")`` on the current device (GPU 0: a context made there)."""
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    buffer = device.page_locked_buffer(100, torch.device("cuda:1"))
    device.unlock(buffer)
    assert cudart.calls == [("register", 1, "cuda:1"), ("unregister", 0, "cuda:1")]
    assert FakeDevice.current == "cuda:0"  # restored

    cudart.register_error = 2
    kernels = []

    def zeros(*size, device=None, **kwargs):
        kernels.append((str(device), FakeDevice.current))
        raise RuntimeError("CUDA error: out of memory")  # the stale code the launch reads

    monkeypatch.setattr(torch, "zeros", zeros)
    with pytest.raises(RuntimeError, match="cudaError 2"):
        device.page_locked_buffer(100, "cuda:1")
    assert kernels == [("cuda:1", "cuda:0")]


def test_a_mapping_refused_by_the_kernel_is_a_runtime_error(cudart, monkeypatch):
    """Defect 4: under strict overcommit ``mmap`` raises ``OSError`` (ENOMEM); the callers
    handle ``RuntimeError`` as a refusal, so it becomes one (before, the ``OSError`` escaped)."""

    def enomem(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", enomem)
    with pytest.raises(RuntimeError, match="cannot map 4096 bytes .*Cannot allocate memory"):
        device.page_locked_buffer(100)
    assert cudart.registered == []


@pytest.mark.gpu
def test_a_failed_registration_is_cleared_and_the_next_kernel_runs():
    """Defect 8, on a GPU (``./dev gpu-check tests``): registering a range already registered
    fails with 712 (``cudaErrorHostMemoryAlreadyRegistered``); ``_clear_cuda_error`` resets the
    thread's last error, so the next kernel runs. Then the premise: without it, the next
    kernel's launch check raises the stale code (and that resets it)."""
    gpu = torch.device("cuda", torch.cuda.current_device())
    page = mmap.PAGESIZE
    buffer = device.page_locked_buffer(page, gpu)
    assert buffer.is_pinned()
    cudart = torch.cuda.cudart()
    again = int(cudart.cudaHostRegister(buffer.data_ptr(), page, device.HOST_REGISTER_PORTABLE))
    assert again == 712
    device._clear_cuda_error(gpu)
    assert torch.ones(8, device=gpu).sum().item() == 8
    assert int(cudart.cudaHostRegister(buffer.data_ptr(), page, 1)) == 712
    with pytest.raises(RuntimeError):
        torch.ones(8, device=gpu).sum().item()
    assert torch.ones(8, device=gpu).sum().item() == 8
    device.unlock(buffer)
    assert not buffer.is_pinned()
