"""Raw allocators: where the pool's segments come from, and what the driver says about memory.

A raw allocator has this small interface (duck-typed; the pool calls nothing else):

- ``device`` ("host" | "cuda" | ...), ``device_index`` (int)
- ``malloc(nbytes) -> (ptr, handle)``; raises ``MemoryError`` (or a subclass, such as CuPy's
  ``OutOfMemoryError``) when the device has no room; any other exception means a bug
- ``free(ptr, handle)``
- ``mem_info() -> (free_bytes, total_bytes)`` as the driver / OS reports them (None if unknown)
- ``process_bytes() -> int | None``: what the driver / OS says this process uses
- ``nvml_process_bytes() -> int | None``: NVML's figure for this process (None off CUDA)
- ``array(handle, offset, nbytes, shape, dtype, owner)``: an array viewing those bytes
- ``context_bytes`` (int | None): what the driver said this process held on the device when
  the allocator was made (the CUDA context and anything before it; None off CUDA or unknown)

Four implementations: ``HostRawAllocator`` (NumPy buffers, so the whole pool runs without a
GPU), ``CudaRawAllocator`` (cudaMalloc / cudaFree through CuPy, imported lazily),
``PinnedRawAllocator`` (page-locked host memory mapped for the device, cudaHostAlloc) and
``FakeRawAllocator`` (addresses only, for exact-address tests). They are the only places in
TinyLoop that call a raw allocation function (tests/memory/test_memory.py checks it).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from ..errors import BackendUnavailableError
from .arena import ALIGNMENT


def _host_meminfo() -> tuple[int | None, int | None]:
    """(available, total) host bytes from /proc/meminfo, else os.sysconf; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = lambda k: int(fields[k].split()[0]) * 1024  # noqa: E731  "123 kB"
        return kib("MemAvailable"), kib("MemTotal")
    except (OSError, KeyError, ValueError):
        pass                                  # not Linux, or an old kernel: ask sysconf
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return None, None


def _host_rss_bytes() -> int | None:
    """This process's resident set size (VmRSS) in bytes, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class _HostFigures:
    """The driver-side figures of an allocator of host memory: the host's free / total bytes,
    the process's RSS, and no NVML figure."""

    def mem_info(self):
        return _host_meminfo()

    def process_bytes(self):
        return _host_rss_bytes()

    def nvml_process_bytes(self):
        return None


class HostRawAllocator(_HostFigures):
    """Segments are anonymous memory maps viewed as NumPy uint8 buffers (page-aligned, so on a
    512-byte boundary).

    A map's pages are touched only when written, so a reserved but unused segment costs address
    space, not resident memory (the host analogue of CUDA's reserved-but-free bytes); and a
    released segment is unmapped as soon as its buffer dies, whatever the C allocator's heap
    did before (``malloc`` may serve even large requests from its heap once its mmap threshold
    has grown, and then keeps the freed pages).
    """

    device = "host"
    device_index = 0
    context_bytes = None

    def malloc(self, nbytes: int):
        try:
            mm = mmap.mmap(-1, max(int(nbytes), 1))
        except OSError as e:                                    # ENOMEM: no room
            raise MemoryError(f"cannot map {nbytes} bytes of host memory: {e}") from None
        buf = np.frombuffer(mm, dtype=np.uint8, count=nbytes)   # keeps `mm` mapped
        return buf.ctypes.data, buf

    def free(self, ptr: int, handle) -> None:
        pass                                                    # the buffer dies with its handle

    def array(self, handle, offset: int, nbytes: int, shape, dtype, owner):
        return handle[offset:offset + nbytes].view(dtype).reshape(shape)


class CudaRawAllocator:
    """Segments from cudaMalloc on one device (CuPy's runtime bindings, imported here lazily)."""

    device = "cuda"

    def __init__(self, device_index: int | None = None):
        try:
            import cupy
        except ImportError as e:
            raise BackendUnavailableError(f"the cuda memory pool needs CuPy: {e}") from None
        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        self.device_index = (cupy.cuda.runtime.getDevice() if device_index is None
                             else int(device_index))
        # cudaErrorMemoryAllocation (2) is the only cudaMalloc failure that means "full"
        self._oom_status = getattr(self._rt, "errorMemoryAllocation", 2)
        self._nvml = None                                              # pynvml handle, lazily
        # cudaFree(0) makes the primary context if there is none yet: NVML's figure for this
        # process then is the context (and whatever the process held on the device before)
        with cupy.cuda.Device(self.device_index):
            self._rt.free(0)
        self.context_bytes = self.nvml_process_bytes()

    def malloc(self, nbytes: int):
        with self._cupy.cuda.Device(self.device_index):
            try:
                return self._rt.malloc(nbytes), None
            except self._rt.CUDARuntimeError as e:
                if e.status == self._oom_status:
                    raise MemoryError(f"cudaMalloc({nbytes}) on cuda:{self.device_index}: "
                                      "out of memory") from None
                raise

    def free(self, ptr: int, handle) -> None:
        with self._cupy.cuda.Device(self.device_index):
            self._rt.free(ptr)

    def mem_info(self):
        with self._cupy.cuda.Device(self.device_index):
            free, total = self._rt.memGetInfo()
        return int(free), int(total)

    def process_bytes(self):
        return self.nvml_process_bytes()

    def nvml_process_bytes(self):
        """NVML's used-GPU-memory figure for this process on this device; None if unavailable
        (no pynvml, no permission, or a PID namespace that hides this process from NVML)."""
        try:
            import pynvml
        except ImportError:
            return None
        try:
            if self._nvml is None:
                pynvml.nvmlInit()
                bus_id = self._rt.deviceGetPCIBusId(self.device_index)
                if isinstance(bus_id, str):
                    bus_id = bus_id.encode()
                self._nvml = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            pid = os.getpid()
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml):
                if p.pid == pid:
                    return None if p.usedGpuMemory is None else int(p.usedGpuMemory)
            return None
        except pynvml.NVMLError:
            return None

    def array(self, handle, offset: int, nbytes: int, shape, dtype, owner):
        cp = self._cupy
        mem = cp.cuda.UnownedMemory(owner.ptr, nbytes, owner, self.device_index)
        return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(mem, 0))


class PinnedRawAllocator(_HostFigures):
    """Segments of page-locked host memory mapped into the device's address space
    (cudaHostAlloc, portable | mapped): with unified addressing the host pointer is valid on
    the device, so kernels write results there that the host reads without a copy. Blocks
    view as NumPy arrays. Device memory is untouched: the driver's figures are the host's."""

    device = "pinned"
    context_bytes = None
    _FLAGS = 0x01 | 0x02             # cudaHostAllocPortable | cudaHostAllocMapped

    def __init__(self, device_index: int | None = None):
        try:
            import cupy
        except ImportError as e:
            raise BackendUnavailableError(f"the pinned memory pool needs CuPy: {e}") from None
        self._rt = cupy.cuda.runtime
        self.device_index = (self._rt.getDevice() if device_index is None
                             else int(device_index))
        self._oom_status = getattr(self._rt, "errorMemoryAllocation", 2)

    def malloc(self, nbytes: int):
        try:
            return self._rt.hostAlloc(nbytes, self._FLAGS), None
        except self._rt.CUDARuntimeError as e:
            if e.status == self._oom_status:
                raise MemoryError(f"cudaHostAlloc({nbytes}): out of memory") from None
            raise

    def free(self, ptr: int, handle) -> None:
        self._rt.freeHost(ptr)

    def array(self, handle, offset: int, nbytes: int, shape, dtype, owner):
        buf = (ctypes.c_char * nbytes).from_address(owner.ptr)
        return np.frombuffer(buf, dtype=dtype).reshape(shape)


class FakeRawAllocator:
    """Addresses without bytes, for exact-address tests.

    Segments are handed out from ``base`` upwards with no gap (so two segments may be adjacent:
    the pool must still never merge across them); freed address ranges are not reused, so every
    address in a test is predictable. ``capacity`` (bytes live at once) makes ``malloc`` raise
    MemoryError like a full device; ``fail_next`` forces that many failures. ``log`` records
    ("malloc" | "free", ptr, nbytes) in order; ``live`` maps ptr -> nbytes. ``nvml_bytes`` is
    the driver's figure for this process (None: unknown; tests set it to play NVML) and
    ``context_bytes`` the one at construction.
    """

    def __init__(self, base: int = 0x10_0000_0000, capacity: int | None = None,
                 device: str = "fake", total_bytes: int | None = None,
                 nvml_bytes: int | None = None):
        self.device = device
        self.device_index = 0
        self.capacity = capacity
        self.total_bytes = total_bytes if total_bytes is not None else capacity
        self.nvml_bytes = nvml_bytes
        self.context_bytes = nvml_bytes
        self.fail_next = 0
        self.live: dict[int, int] = {}
        self.log: list[tuple[str, int, int]] = []
        self._next = base

    @property
    def used_bytes(self) -> int:
        return sum(self.live.values())

    def malloc(self, nbytes: int):
        if self.fail_next > 0:
            self.fail_next -= 1
            raise MemoryError(f"fake malloc({nbytes}): forced failure")
        if self.capacity is not None and self.used_bytes + nbytes > self.capacity:
            raise MemoryError(f"fake malloc({nbytes}): {self.used_bytes} of "
                              f"{self.capacity} bytes in use")
        ptr = self._next
        self._next += nbytes
        self.live[ptr] = nbytes
        self.log.append(("malloc", ptr, nbytes))
        return ptr, None

    def free(self, ptr: int, handle) -> None:
        nbytes = self.live.pop(ptr)               # KeyError: the pool freed a foreign pointer
        self.log.append(("free", ptr, nbytes))

    def mem_info(self):
        if self.capacity is None:
            return None, self.total_bytes
        return self.capacity - self.used_bytes, self.total_bytes

    def process_bytes(self):
        return self.nvml_bytes

    def nvml_process_bytes(self):
        return self.nvml_bytes

    def array(self, handle, offset, nbytes, shape, dtype, owner):
        raise TypeError("a FakeRawAllocator has addresses but no bytes; use HostRawAllocator "
                        "to view a block's memory")
