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

from runtime.common import device


class FakeCudart:
    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[tuple[int, bytes]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, size))
        return self.register_error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        # Reading the range's first byte here segfaults if it was unmapped before the unlock.
        self.unregistered.append((ptr, ctypes.string_at(ptr, 1)))
        return 0


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
    monkeypatch.setattr(device, "_clear_cuda_error", lambda: cleared.append(True))
    with pytest.raises(RuntimeError, match="cudaHostRegister of 100 bytes failed with cudaError 2"):
        device.page_locked_buffer(100)
    assert cleared == [True]
    gc.collect()
    assert fake.unregistered == []  # nothing was locked: nothing to unlock
