"""A device double that behaves like CUDA where the runtimes' bugs live: the test double of the
device layer (``runtime/stagehand/common/device.py``).

On CPU the "device" is the host: a copy completes the moment it is issued, a kernel runs at once,
an H2D copy may alias its source, and freed memory keeps its values. Code that forgets an event,
frees a buffer another stream still reads, or reads a result too soon still passes. Under
``device_double(lag)`` the runtimes' CPU device behaves as a GPU does in four ways:

- **Device memory apart from the host's.** ``device_empty`` and ``to_device`` allocate from the
  double's own memory (anonymous mappings), so every H2D and D2H copy really copies and
  ``on_device`` tells a device tensor from a host one.
- **Copies and kernels late, in each stream's order.** Every CPU ``TransferStream`` is a
  ``LaggingStream``: an in-order queue of copies (``copy_``), kernels (``launch``) and events
  (``record``). The device runs a stream's queue up to an event ``lag`` device operations after
  it was recorded (an operation: a ``record`` or a host ``query``), or at once when the compute
  (``TransferEvent.wait``: on CPU the compute is the host) or the host (``synchronize``) waits;
  a stream's wait on another's event (``TransferStream.wait``) is queued on it, as on a GPU.
- **A caching allocator per stream.** Memory is allocated on the calling thread's current
  stream (inside ``use()``: that stream's). Freed memory goes back to its stream's free list once
  the work queued on that stream before the free has run, and after the work of every stream it
  was ``hold``-ed for; it is never handed to another stream.
- **Freed memory poisoned.** Memory going back to a free list is filled with 0xFF bytes: NaN in
  every float dtype (fp32, bf16, fp16, float8_e4m3fn), -1 as int8. A queued copy or kernel that
  touches device memory freed before it ran raises ``UseAfterFreeError`` (on a GPU: whatever the
  next owner wrote, or NaN); a host read of freed memory reads NaN.

A copy's source is snapshotted when it is queued and compared when it runs: a source changed in
between (a slab released and refilled, a weight updated while its copy back was queued) raises
``CopyRaceError``, the error a real device would turn into silently wrong weights.

What it cannot model: the compute stream runs on the host, at once (autograd's kernels are not
queued), so a missing compute-side wait on a copy is caught (the copy has not run: its
destination is poisoned or stale) but compute running ahead of the host is not; memory that
autograd or the optimizer allocate is ordinary host memory, outside the double's allocator.
Lag 0 runs every queue at its event's record.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from stagehand.common.device import TransferStream

LAGS = (0, 1, 2, 4)
SLOW = 10**9
"""A lag no step reaches: the device runs a stream's work only when something waits on it, as a
GPU that the host always runs ahead of (large copies behind queued compute)."""
ALLOC_ROUND = 512
"""Bytes an allocation is rounded up to (CUDA's caching allocator rounds to 512)."""
POISON = 0xFF


class CopyRaceError(AssertionError):
    """A copy's source changed between the copy's issue and its execution."""


class UseAfterFreeError(AssertionError):
    """A queued copy or kernel touched device memory freed before it ran."""


@dataclass(eq=False)
class Chunk:
    """One allocation's memory: an anonymous mapping, owned by the double for its whole life."""

    size: int
    stream: Any
    """The stream it was allocated on (None: the compute stream)."""
    mapping: mmap.mmap = field(init=False)
    base: torch.Tensor = field(init=False)
    """uint8 view of the whole mapping that queued work reads through (it keeps no user
    tensor alive, so the user's last reference frees the allocation as on CUDA)."""
    ptr: int = field(init=False)
    generation: int = 0
    """Bumped each time the memory goes back to its free list."""
    holders: set = field(default_factory=set)
    waiting: int = 0
    """Streams whose queued work must run before a freed chunk is released."""

    def __post_init__(self) -> None:
        self.mapping = mmap.mmap(-1, self.size)
        with torch.inference_mode(False):  # the double's own view: written in any mode
            self.base = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.ptr = self.base.data_ptr()


@dataclass(frozen=True)
class DeviceRef:
    """A device tensor as queued work refers to it: its chunk, the chunk's generation at issue,
    and the view's dtype, shape, stride and offset (elements)."""

    chunk: Chunk
    generation: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def tensor(self, what: str) -> torch.Tensor:
        chunk = self.chunk
        if chunk.generation != self.generation:
            raise UseAfterFreeError(
                f"a queued {what} touched device memory ({chunk.size} bytes allocated on "
                f"{'the compute stream' if chunk.stream is None else 'a transfer stream'}) that "
                "was freed before the device ran it: keep it alive, or hold it for that stream "
                "(TransferStream.hold), until the work's event"
            )
        typed = chunk.base.view(self.dtype)
        return typed.as_strided(self.shape, self.stride, self.offset)


class Device:
    """The double's device: its clock, its streams and its per-stream allocator."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.ops = 0
        self.streams: list[LaggingStream] = []
        self.lock = threading.RLock()
        self.local = threading.local()
        self.chunks: dict[int, Chunk] = {}
        self._starts: list[int] = []
        self.free: dict[tuple[int, int], list[Chunk]] = {}
        """(id of the allocating stream or 0, size) -> chunks ready for reuse on that stream."""
        self.closed = False
        self.copies_run = 0
        self.kernels_run = 0
        self.allocations = 0
        self.reuses = 0
        self.poisoned_bytes = 0
        self.max_pending = 0
        """The most events queued and not yet run at once: > 0 proves the device lagged."""
        self.host_waits = 0
        """Host waits (``synchronize``) on an event the device had not reached: the host stalled."""

    # -- clock ----------------------------------------------------------------------------------
    def tick(self) -> None:
        with self.lock:
            self.ops += 1
            for stream in self.streams:
                stream.run_due()

    def pending(self) -> int:
        return sum(1 for s in self.streams for item in s.queue if item[0] == "event")

    def drain(self) -> None:
        """Let the device finish everything (what a ``torch.cuda.synchronize()`` would do)."""
        with self.lock:
            for stream in self.streams:
                stream.run_all()

    # -- allocator ------------------------------------------------------------------------------
    def current(self) -> LaggingStream | None:
        return getattr(self.local, "stream", None)

    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory (uint8), from the current stream's free list."""
        size = max(ALLOC_ROUND, -(-nbytes // ALLOC_ROUND) * ALLOC_ROUND)
        stream = self.current()
        with self.lock:
            free = self.free.get((id(stream) if stream else 0, size))
            if free:
                chunk = free.pop()
                self.reuses += 1
            else:
                chunk = Chunk(size, stream)
                self.chunks[chunk.ptr] = chunk
                bisect.insort(self._starts, chunk.ptr)
            self.allocations += 1
            chunk.holders = set()
            poison(chunk)  # device memory is never handed out zeroed
        owner = (ctypes.c_ubyte * size).from_buffer(chunk.mapping)
        weakref.finalize(owner, self._freed, chunk, chunk.generation)
        return torch.frombuffer(owner, dtype=torch.uint8)[:nbytes]

    def chunk_of(self, tensor: torch.Tensor) -> Chunk | None:
        if tensor.device.type != "cpu" or not tensor.numel():
            return None
        ptr = tensor.data_ptr()
        with self.lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            chunk = self.chunks[self._starts[i]]
        return chunk if ptr < chunk.ptr + chunk.size else None

    def owns(self, tensor: torch.Tensor) -> bool:
        return self.chunk_of(tensor) is not None

    def ref(self, tensor: torch.Tensor) -> DeviceRef | torch.Tensor:
        """How queued work refers to ``tensor``: a ``DeviceRef`` for device memory (it keeps
        the allocation free to be freed), the tensor itself for host memory."""
        chunk = self.chunk_of(tensor)
        if chunk is None:
            return tensor
        byte = tensor.data_ptr() - chunk.ptr
        itemsize = tensor.element_size()
        assert byte % itemsize == 0, "a device view at an offset its dtype cannot address"
        return DeviceRef(
            chunk,
            chunk.generation,
            tensor.dtype,
            tuple(tensor.shape),
            tuple(tensor.stride()),
            byte // itemsize,
        )

    def hold(self, tensor: torch.Tensor, stream: LaggingStream) -> None:
        chunk = self.chunk_of(tensor)
        if chunk is not None:
            chunk.holders.add(stream)

    def _freed(self, chunk: Chunk, generation: int) -> None:
        """The user's last reference to ``chunk`` went: release it once the work queued before
        now on its own stream and on every stream it was held for has run."""
        if self.closed or chunk.generation != generation:
            return
        with self.lock:
            streams = set(chunk.holders)
            if chunk.stream is not None:
                streams.add(chunk.stream)
            streams = {s for s in streams if s.queue}
            if not streams:
                self._release(chunk)
                return
            chunk.waiting = len(streams)
            for stream in streams:
                stream.queue.append(("free", chunk))

    def _release(self, chunk: Chunk) -> None:
        poison(chunk)
        chunk.generation += 1
        self.poisoned_bytes += chunk.size
        key = (id(chunk.stream) if chunk.stream else 0, chunk.size)
        self.free.setdefault(key, []).append(chunk)

    def release_step(self, chunk: Chunk) -> None:
        chunk.waiting -= 1
        if chunk.waiting == 0:
            self._release(chunk)


class LaggingEvent:
    """A ``TransferEvent`` whose work runs ``lag`` operations after it was recorded."""

    __slots__ = ("stream", "due", "done")

    def __init__(self, stream: LaggingStream, due: int) -> None:
        self.stream, self.due, self.done = stream, due, False

    def query(self) -> bool:
        if not self.done:
            self.stream.device.tick()
        return self.done

    def wait(self, stream: Any = None) -> None:
        self.stream.run_until(self)

    def synchronize(self) -> None:
        if not self.done:
            self.stream.device.host_waits += 1
        self.stream.run_until(self)


class LaggingStream(TransferStream):
    """An in-order queue of copies, kernels and events (see the module docstring)."""

    device: Device  # set per ``device_double`` on a subclass

    def __init__(self, device: torch.device | str, priority: int = 0) -> None:
        self.stream = None
        self.pageable_copies = 0
        self.queue: deque[tuple] = deque()
        self.device.streams.append(self)

    # The class stands in for ``TransferStream.double``: the device layer's seams.
    @classmethod
    def empty(cls, nbytes: int) -> torch.Tensor:
        return cls.device.empty(nbytes)

    @classmethod
    def owns(cls, tensor: torch.Tensor) -> bool:
        return cls.device.owns(tensor)

    @contextlib.contextmanager
    def use(self, after: Any = None) -> Iterator[None]:
        local = self.device.local
        outer = getattr(local, "stream", None)
        local.stream = self
        try:
            yield
        finally:
            local.stream = outer

    def mark(self) -> None:
        return None

    @property
    def asynchronous(self) -> bool:
        return True

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        device = self.device
        with device.lock:
            self.queue.append(("copy", device.ref(dst), device.ref(src), src.detach().clone()))

    def wait(self, event: Any) -> None:
        """Queue a device-side wait: this stream's later work runs after ``event``'s stream
        reached it (the host does not wait)."""
        if not isinstance(event, LaggingEvent) or event.stream is self or event.done:
            return
        with self.device.lock:
            self.queue.append(("wait", event))

    def launch(self, kernel: Callable[..., Any], *tensors: torch.Tensor) -> None:
        device = self.device
        with device.lock:
            self.queue.append(("kernel", kernel, [device.ref(t) for t in tensors]))

    def hold(self, tensor: torch.Tensor) -> None:
        self.device.hold(tensor, self)

    def record(self) -> LaggingEvent:
        device = self.device
        with device.lock:
            device.tick()
            event = LaggingEvent(self, device.ops + device.lag)
            self.queue.append(("event", event))
            device.max_pending = max(device.max_pending, device.pending())
            self.run_due()
        return event

    def _run_next(self) -> None:
        item = self.queue.popleft()
        kind = item[0]
        if kind == "event":
            item[1].done = True
        elif kind == "wait":
            item[1].stream.run_until(item[1])
        elif kind == "free":
            self.device.release_step(item[1])
        elif kind == "kernel":
            _, kernel, refs = item
            kernel(*(_tensor(r, "kernel") for r in refs))
            self.device.kernels_run += 1
        else:
            _, dst_ref, src_ref, snapshot = item
            dst, src = _tensor(dst_ref, "copy"), _tensor(src_ref, "copy")
            if not torch.equal(src, snapshot):
                raise CopyRaceError(
                    f"a copy's source ({tuple(src.shape)} {src.dtype}) changed before the device "
                    "ran the copy: it was released or reused while the copy was pending"
                )
            # As issued: a copy into a tensor made under inference mode runs in inference mode.
            with torch.inference_mode(dst.is_inference()), torch.no_grad():
                dst.copy_(src)
            self.device.copies_run += 1

    def run_due(self) -> None:
        """Run the queue up to the last event whose time has come."""
        with self.device.lock:
            last = None
            for i, item in enumerate(self.queue):
                if item[0] == "event" and item[1].due <= self.device.ops:
                    last = i
            if last is not None:
                for _ in range(last + 1):
                    self._run_next()

    def run_until(self, event: LaggingEvent) -> None:
        with self.device.lock:
            while not event.done:
                self._run_next()

    def run_all(self) -> None:
        with self.device.lock:
            while self.queue:
                self._run_next()


def poison(chunk: Chunk) -> None:
    with torch.inference_mode(False), torch.no_grad():
        chunk.base.fill_(POISON)


def _tensor(ref: DeviceRef | torch.Tensor, what: str) -> torch.Tensor:
    return ref.tensor(what) if isinstance(ref, DeviceRef) else ref


@contextlib.contextmanager
def device_double(lag: int) -> Iterator[Device]:
    """Every CPU ``TransferStream`` built inside is a ``LaggingStream`` of one ``Device`` with
    ``lag``, and the device layer allocates from that device (module docstring)."""
    device = Device(lag)
    outer = TransferStream.double  # a test's own double inside the suite-wide mode's
    TransferStream.double = type("LaggingStream", (LaggingStream,), {"device": device})
    try:
        yield device
    finally:
        TransferStream.double = outer
        device.closed = True
