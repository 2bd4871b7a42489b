"""Copies between host and device: CUDA streams, events and pinned memory when a GPU is present,
the same calls as synchronous copies on ordinary host memory when not.

The runtimes never call ``torch.cuda.synchronize()`` in the hot path: the compute stream waits on
an event recorded after a copy (``TransferEvent.wait``), a device-side wait. A host wait
(``TransferEvent.synchronize``) is only for D2H copies whose destination the host reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


def uses_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


CPU_ALIGN = 64
"""Byte alignment of PyTorch's CPU allocator (c10's ``gAlignment``): an ordinary CPU tensor's data
starts at a multiple of it."""


def own_storage(
    module: torch.nn.Module, device: torch.device | str | None = None
) -> torch.nn.Module:
    """``module`` moved to ``device`` (None: where it is) with every parameter and buffer in an
    ordinary allocation: values, shapes and strides unchanged, data aligned as the device's
    allocator aligns it. Returns ``module``.

    ``from_pretrained`` leaves CPU weights as views into the mmap'd safetensors file at the
    file's byte offsets (most of them not 64-byte aligned), and ``.to("cpu")`` keeps them there;
    on some CPUs a GEMM's rounding depends on its inputs' alignment. A model on a GPU has its
    weights in ordinary allocations; this gives a CPU model the same. NOTE [ Exact numbers ] in
    ``runtime/stagehand/__init__.py``.
    """
    if device is not None:
        module.to(device)
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for tensor in table.values():
                if tensor is not None:
                    tensor.data = ordinary(tensor.data)
    return module


def ordinary(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it in its own aligned allocation when it is a CPU tensor whose
    data is not ``CPU_ALIGN``-aligned (a view into an mmap'd file); see ``own_storage``."""
    if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % CPU_ALIGN:
        return tensor.clone()
    return tensor


def device_empty(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``nbytes`` bytes on the compute ``device``, allocated on
    the calling thread's current stream (inside ``TransferStream.use()``: that stream's), whose
    caching allocator hands the memory to later work on that stream only once it is freed: a
    buffer another stream still reads must be kept with ``TransferStream.hold``. Under the test
    double of the device layer (``TransferStream.double``) its own per-stream allocator gives it,
    and poisons it when freed."""
    double = TransferStream.double
    if double is not None and not uses_cuda(device):
        return double.empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def on_device(tensor: torch.Tensor, device: torch.device | str) -> bool:
    """Whether ``tensor``'s memory is the compute ``device``'s. On a CPU "device" a host tensor
    is on it too, except under the test double, whose device memory is apart from the host's
    (only what ``device_empty`` and ``to_device`` gave, and views of it)."""
    double = TransferStream.double
    if double is not None and not uses_cuda(device):
        return double.owns(tensor)
    return same_device(tensor.device, torch.device(device))


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device: a CUDA device without an index is the current
    one (``torch.device("cuda")`` and ``cuda:0`` compare unequal, yet name the same card)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is host memory: a CPU tensor, except the device memory of the test
    double (``on_device``). On a CPU "device" a tensor is on both."""
    double = TransferStream.double
    return tensor.device.type == "cpu" and not (double is not None and double.owns(tensor))


def to_device(
    tensor: torch.Tensor, device: torch.device | str, non_blocking: bool = False
) -> torch.Tensor:
    """A copy of ``tensor`` on the compute ``device`` (always a new tensor), on the current
    stream: asynchronous from pinned host memory when ``non_blocking`` (the caller keeps the
    source unchanged until the stream passed the copy)."""
    double = TransferStream.double
    if double is not None and not uses_cuda(device):
        out = double.empty(tensor.nbytes).view(tensor.dtype).view(tensor.shape)
        return out.copy_(tensor)
    return tensor.to(device, copy=True, non_blocking=non_blocking)


def host_buffer(nbytes: int, pin: bool, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A host buffer of ``nbytes`` bytes (1-D, ``dtype``), page-locked when ``pin``.

    ``pin`` must be False without CUDA: ``pin_memory`` raises there.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(f"nbytes ({nbytes}) is not a multiple of {dtype}'s size ({itemsize})")
    return torch.empty(nbytes // itemsize, dtype=dtype, pin_memory=pin)


def host_like(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of ``tensor``'s shape and dtype (contiguous), page-locked
    through PyTorch's caching host allocator when ``pin`` (CUDA only): the destination of an
    asynchronous D2H copy."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)


HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the range counts as page-locked for every CUDA context, not only
the current device's (``torch.cuda._pin_memory_utils.pin_memory`` passes the same flag)."""


def page_locked_buffer(nbytes: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A host buffer of ``nbytes`` bytes (uint8), page-locked with ``cudaHostRegister`` (as
    ``torch.cuda._pin_memory_utils`` does for checkpoint staging, with its flag: portable, so a
    copy on any GPU reads it asynchronously): an anonymous mapping of whole pages, so the
    buffer, its storage and the locked range all start at one page boundary. Unlike
    ``pin_memory``, no power-of-two rounding and no trip through PyTorch's host cache.
    ``is_pinned()`` is True for it and for every view of it (PyTorch asks the driver about the
    storage's first byte).

    ``device``: the CUDA device whose runtime makes the calls (register, unregister, the error
    clearing's kernel), so ``cuda:1`` creates no context on the current device (GPU 0 when the
    thread never chose one); None: the current device.

    The lock ends with ``unlock``, or by itself when the last view of the buffer is freed: the
    pages are unregistered *before* they are unmapped (a range freed while registered stays
    locked until the process exits, and a later mapping at the same address could not be
    registered), so a runtime whose set-up raised, or that was never closed, leaks no lock.

    Raises:
        RuntimeError: the memory cannot be mapped (``OSError``: ``ENOMEM`` under strict
            overcommit) or page-locked (no CUDA, or a pinned-memory cap); the failed
            registration's CUDA error is cleared first (``_clear_cuda_error``). Callers treat it
            as a refusal (the host cache stops, the pool falls back or names the field).
    """
    page = mmap.PAGESIZE
    locked = max(1, -(-nbytes // page)) * page
    try:
        mapping = mmap.mmap(-1, locked)  # page-aligned and zero-filled by the kernel
    except OSError as exc:
        raise RuntimeError(f"cannot map {locked} bytes of host memory to page-lock: {exc}") from exc
    # The tensor holds ``pages`` (a view of ``mapping``); ``pages`` is freed, and its finalizer
    # runs, before it lets go of ``mapping`` (CPython clears weak references first).
    pages = (ctypes.c_ubyte * locked).from_buffer(mapping)
    ptr = ctypes.addressof(pages)
    try:
        with _on(device):
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, locked, HOST_REGISTER_PORTABLE))
    except (AssertionError, RuntimeError) as exc:  # a build or machine without CUDA
        raise RuntimeError(f"cannot page-lock host memory: {exc}") from exc
    if err != 0:
        _clear_cuda_error(device)
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {err}")
    finalizer = weakref.finalize(pages, _unregister, ptr, device)
    finalizer.atexit = False  # at interpreter exit the process's locks end with it
    _LOCKED[ptr] = finalizer
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes]


_LOCKED: dict[int, weakref.finalize] = {}
"""Start address of each range ``page_locked_buffer`` locked -> its unlock (called once)."""


def _on(device: torch.device | str | None) -> contextlib.AbstractContextManager:
    """CUDA runtime calls made on ``device`` (None, or not a CUDA device: the current one)."""
    return (
        torch.cuda.device(device) if _cuda_or_none(device) is not None else contextlib.nullcontext()
    )


def _cuda_or_none(device: torch.device | str | None) -> torch.device | None:
    return torch.device(device) if device is not None and uses_cuda(device) else None


def _unregister(ptr: int, device: torch.device | str | None) -> None:
    _LOCKED.pop(ptr, None)
    with _on(device):
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        _clear_cuda_error(device)


def unlock(buffer: torch.Tensor) -> None:
    """Undo ``page_locked_buffer`` now (the buffer stays valid pageable memory); a no-op for a
    buffer already unlocked."""
    finalizer = _LOCKED.get(buffer.data_ptr())
    if finalizer is not None:
        finalizer()


def _clear_cuda_error(device: torch.device | str | None = None) -> None:
    """Reset the CUDA runtime's last error after a failed call whose code was handled here.

    A failed ``cudaHostRegister`` leaves its code as the thread's last error, and PyTorch checks
    ``cudaGetLastError()`` after every kernel launch: the next kernel would raise it (e.g. "CUDA
    error: out of memory") though the failure was handled. ``torch.cuda.cudart()`` has no
    ``cudaGetLastError``; a kernel launched here reads the stale code (PyTorch's launch check
    calls ``cudaGetLastError``, which resets it) and raises it, which is swallowed. The last
    error is the host thread's, so the kernel runs on ``device`` (the runtime's: on another
    device it would create a context there). Checked on a GPU by ``test_page_lock.py``'s
    ``gpu`` test (``./dev gpu-check tests``).
    """
    try:
        torch.zeros(1, device=_cuda_or_none(device) or "cuda")
    except RuntimeError:
        pass


class TransferEvent:
    """Completion of one copy. On CPU the copy was synchronous, so it is already complete."""

    __slots__ = ("_event", "_device")

    def __init__(self, event: torch.cuda.Event | None, device: torch.device | None = None) -> None:
        self._event = event
        self._device = device

    def query(self) -> bool:
        """True when the copy finished (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream *of the copy's device*, not of the
        current device: on ``cuda:1`` without ``set_device`` the compute would not wait) wait for
        the copy, on the device."""
        if self._event is not None:
            self._event.wait(
                stream if stream is not None else torch.cuda.current_stream(self._device)
            )

    def synchronize(self) -> None:
        """Block the host until the copy finished (for D2H results the host reads)."""
        if self._event is not None:
            self._event.synchronize()


class ComputeWaits:
    """The compute's waits on copies, measured where the compute runs (NOTE [ Window growth ] in
    ``runtime/stagehand/weights/policy.py``): ``wait(event)`` is ``event.wait()`` (the compute stream
    waits for the copy) with the wait measured.

    - CUDA: a timing event is recorded on the compute stream before the wait and one after; the
      gap between them is the device's stall on the copy. ``collect`` reads them (a host wait for
      the last one: call it at a step's end, after the step's loss was read).
    - A device double (``tests/runtime/device_double.py``): the compute is the host, so a copy
      its event says is not ``done`` when the compute waits is a wait (0 ms: the double has no
      clock).
    - The CPU: copies are synchronous, nothing ever waits.
    """

    NOISE_MS = 0.1
    """Gaps at or under it are not waits: two events recorded back to back on one stream time a
    few microseconds apart."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = uses_cuda(self.device)
        self._pairs: list[tuple[Any, Any]] = []
        self._late = 0

    def wait(self, event: TransferEvent | Any) -> None:
        """``event.wait()`` on the compute stream, measured."""
        if not self.cuda:
            if not getattr(event, "done", True):  # a device double's copy not run yet
                self._late += 1
            event.wait()
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        event.wait(stream)
        end.record(stream)
        self._pairs.append((start, end))

    def collect(self, wait: bool = True) -> tuple[int, float]:
        """``(waits, ms)`` since the last call: the waits longer than ``NOISE_MS`` and their
        total in ms (0.0 off CUDA). ``wait=False`` never waits on the host: on CUDA the waits the
        device has not reached yet count at the next call."""
        pairs, self._pairs = self._pairs, []
        late, self._late = self._late, 0
        if pairs and wait:
            pairs[-1][1].synchronize()
        elif pairs:  # in stream order: the first not reached, and all after it, wait their turn
            done = next((i for i, (_, end) in enumerate(pairs) if not end.query()), len(pairs))
            pairs, self._pairs = pairs[:done], pairs[done:]
        gaps = [start.elapsed_time(end) for start, end in pairs]
        waited = [g for g in gaps if g > self.NOISE_MS]
        return late + len(waited), float(sum(waited))


class TransferStream:
    """A dedicated copy stream on CUDA; a synchronous stand-in with the same calls on CPU.

    Copies go through ``copy_`` and kernels through ``launch`` inside ``use()``; completion
    through ``record()``'s event. ``TransferStream.double`` is the seam for a test double of the
    device layer (``tests/runtime/device_double.py``: device memory apart from the host's,
    copies and kernels run late in each stream's order, a caching allocator per stream, freed
    memory poisoned): when set, a CPU stream is built from it, and ``device_empty``,
    ``to_device`` and ``on_device`` ask it.
    """

    double: type[TransferStream] | None = None

    def __new__(cls, device: torch.device | str, priority: int = 0) -> TransferStream:
        double = TransferStream.double
        if cls is TransferStream and double is not None and not uses_cuda(device):
            return double.__new__(double, device, priority)
        return super().__new__(cls)

    def __init__(self, device: torch.device | str, priority: int = 0) -> None:
        self.device = torch.device(device)
        self.stream = (
            torch.cuda.Stream(self.device, priority=priority) if uses_cuda(device) else None
        )
        self._count_lock = threading.Lock()
        self.pageable_copies = 0
        """Copies asked to be asynchronous whose host side was pageable: CUDA runs them
        synchronously (a host stall). None belong in the hot path."""

    @contextlib.contextmanager
    def use(self, after: TransferEvent | None = None) -> Iterator[None]:
        """Issue the enclosed copies on this stream, after the compute stream's pending work:
        the current stream's (of the calling thread), or what ``after`` (``mark()`` called on
        the thread that queues the kernels) covers, for copies issued from another thread."""
        if self.stream is None:
            yield
            return
        if after is not None:
            self.wait(after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def mark(self) -> TransferEvent | None:
        """An event on the calling thread's current (compute) stream, for ``use(after=...)``
        on another thread; None without streams."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return TransferEvent(event, self.device)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` on this stream (inside ``use()``): asynchronous on CUDA, where the
        caller keeps ``src`` and ``dst`` alive and unchanged until ``record()``'s event
        completes. A pageable host side makes it synchronous: counted in ``pageable_copies``."""
        if self.stream is not None:
            host = src if src.device.type == "cpu" else dst
            if host.device.type == "cpu" and not host.is_pinned():
                with self._count_lock:  # reader threads issue copies too
                    self.pageable_copies += 1
        dst.copy_(src, non_blocking=self.non_blocking)

    def wait(self, event: TransferEvent | Any) -> None:
        """Make this stream wait, on the device, for ``event`` (a copy on another stream, or
        the compute work a ``mark()`` covers): work issued here afterwards runs after it. The
        host does not wait. A no-op without streams (copies there are complete)."""
        if self.stream is not None:
            event.wait(self.stream)

    def launch(self, kernel: Callable[..., Any], *tensors: torch.Tensor) -> None:
        """``kernel(*tensors)`` on this stream (inside ``use()``): on CUDA its kernels are
        queued there, after the copies issued before it; ``record()``'s event covers them. On
        the CPU stand-in it runs now. ``tensors``: every device tensor it reads or writes (a
        device double runs it late, and must know what memory it touches)."""
        kernel(*tensors)

    def hold(self, tensor: torch.Tensor) -> None:
        """``tensor`` (device memory) is read or written by work queued on this stream: its
        memory is not handed to new allocations before that work finished, even once freed
        (``record_stream``). A no-op without streams."""
        if self.stream is not None:
            tensor.record_stream(self.stream)

    def record(self) -> TransferEvent:
        """An event completing when the copies issued so far on this stream finished."""
        if self.stream is None:
            return TransferEvent(None)
        event = torch.cuda.Event()
        event.record(self.stream)
        return TransferEvent(event, self.device)

    @property
    def non_blocking(self) -> bool:
        """Whether copies on this stream may be asynchronous (pinned host memory, CUDA)."""
        return self.stream is not None

    @property
    def asynchronous(self) -> bool:
        """Whether a copy may still be running after ``copy_`` returned: then whoever reads its
        destination, or reuses its source, first waits on ``record()``'s event. False only for
        the synchronous CPU stand-in."""
        return self.stream is not None


def slot_views(flat: torch.Tensor, layout: Sequence[Any]) -> list[torch.Tensor]:
    """Each entry's tensor inside a buffer (``flat``: uint8, its size a multiple of every
    entry's ``itemsize``; a block buffer, a host image, SquareQ's block image): one typed view
    of the buffer per dtype and one strided view per entry (a load rebuilds them all: the
    fewer calls, the cheaper a block transition). ``layout``: entries with ``dtype``,
    ``shape``, ``stride`` (elements), ``offset`` (bytes, a multiple of ``itemsize``) and
    ``itemsize`` (bytes): the weight runtime's ``ParamSlot``, SquareQ's ``ImageSlot``."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for slot in layout:
        whole = typed.get(slot.dtype)
        if whole is None:
            whole = typed[slot.dtype] = flat.view(slot.dtype)
        views.append(whole.as_strided(slot.shape, slot.stride, slot.offset // slot.itemsize))
    return views
