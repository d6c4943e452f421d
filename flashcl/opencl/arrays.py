"""Input handling shared by the OpenCL entry points: which device runs a call, and moving
numpy / torch CPU / pyopencl inputs to device arrays the kernels can address."""

from __future__ import annotations

import math

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from ..quant import BLOCK_BYTES, QK
from .runtime import DeviceHandle, get_device


def handle_for_inputs(tensors: dict, device) -> DeviceHandle:
    """pyopencl Array inputs run on their own queue (and must share a context), which ``device``
    may name (their device, or their queue or context itself); anything else on ``device``
    (docs/design.md §1, device)."""
    on_device = {name: t for name, t in tensors.items() if isinstance(t, cla.Array)}
    if not on_device:
        return get_device(device)
    first = next(iter(on_device.values()))
    others = [name for name, t in on_device.items() if t.context != first.context]
    if others:
        raise ValueError(f"{', '.join(on_device)} are pyopencl Arrays of different contexts "
                         f"({', '.join(others)} differ from the first)")
    if device is not None:
        queue = first.queue
        if isinstance(device, (cl.CommandQueue, cl.Context)):  # theirs itself, not another on their device
            own = device.int_ptr == (queue if isinstance(device, cl.CommandQueue) else first.context).int_ptr
        else:
            named = device if isinstance(device, cl.Device) else get_device(device).device
            own = named.int_ptr == queue.device.int_ptr
        if not own:
            raise ValueError(f"device={device!r} is not where the pyopencl Array inputs are: they run on their "
                             f"own queue, on {queue.device.name.strip()}; leave device= out or name that one")
    return get_device(first.queue)


def elem_strides(arr: cla.Array) -> tuple[int, ...]:
    return tuple(s // arr.dtype.itemsize for s in arr.strides)


class HostBuffer:
    """A call's own device buffer, C-contiguous: a host input (a copy, or on a CPU device its
    memory itself: host_buffer), or a result to read back. It has the attributes the launches read of a
    pyopencl Array (base_data, data, offset, shape, strides, dtype, queue), for a fraction of the
    cost: pyopencl's Array constructor checks the shape through numpy (~10 us), and a call on host
    arrays made six."""

    __slots__ = ("queue", "base_data", "shape", "dtype", "strides")
    offset = 0

    def __init__(self, queue, buf, shape, dtype):
        self.queue, self.base_data, self.shape, self.dtype = queue, buf, tuple(shape), np.dtype(dtype)
        strides, step = [], self.dtype.itemsize
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        self.strides = tuple(reversed(strides))

    @property
    def data(self) -> cl.Buffer:
        return self.base_data

    @classmethod
    def empty(cls, queue, shape, dtype) -> "HostBuffer":
        return cls(queue, cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, max(nbytes(shape, dtype), 1)),
                   shape, dtype)


def to_device_4d(x, queue, rank: int, *, borrow: bool = False):
    """numpy / torch CPU / pyopencl Array -> 4-D device array with a contiguous head dim: the
    pyopencl Array itself, or a HostBuffer of the host array (``borrow``: host_buffer's)."""
    if isinstance(x, cla.Array):
        if rank == 3:
            if not x.flags.c_contiguous:
                raise ValueError("a 3-D pyopencl Array input must be C-contiguous (it is viewed as 4-D with B=1)")
            x = x.reshape(1, *x.shape)
        arr = x
        if arr.strides[3] != arr.dtype.itemsize and arr.shape[3] > 1:
            raise ValueError(f"pyopencl Array inputs need a contiguous head dim (stride {arr.dtype.itemsize} "
                             f"bytes), got strides {arr.strides}; pass arr.copy() or a numpy array")
        if any(s < 0 or s % arr.dtype.itemsize for s in arr.strides):
            raise ValueError(f"pyopencl Array strides {arr.strides} must be non-negative multiples of the item size")
        if not arr.dtype.isnative:
            raise TypeError(f"pyopencl Array of dtype {arr.dtype.str}: the kernels read the device's byte "
                            "order; convert on the host first")
        return arr
    host = native_host(x)
    if rank == 3:
        host = host[None]
    return host_buffer(queue, host, borrow=borrow)


def _host_memory(queue) -> bool:
    """Whether the queue's device is a CPU, whose buffers are host memory: there a queue command
    costs a round trip through the driver's threads (~60 us on PoCL whatever its size), so
    transfers avoid them; NVIDIA's driver was slower that way (docs/notes/opencl-host.md)."""
    return bool(queue.device.type & cl.device_type.CPU)


def host_buffer(queue, host: np.ndarray, *, borrow: bool = False) -> HostBuffer:
    """A C-contiguous host array on the device: on a CPU device a buffer filled at its creation
    (COPY_HOST_PTR, no queue command), or with ``borrow`` the array's memory itself, read-only
    (USE_HOST_PTR: PoCL took 14 ms to copy a 32 MB cache into fresh pages, more than the decode
    that reads it); elsewhere a blocking write on the queue. ``borrow`` only where the call waits
    for its kernels, as calls on host arrays do (launch_and_read): ``host`` must outlive them, and
    a thread writing to it meanwhile changes what they read."""
    if host.nbytes == 0:
        return HostBuffer.empty(queue, host.shape, host.dtype)
    if not _host_memory(queue):
        copy = HostBuffer.empty(queue, host.shape, host.dtype)
        cl.enqueue_copy(queue, copy.base_data, host, is_blocking=True)
        return copy
    # Oclgrind (a CPU device too) counts a USE_HOST_PTR buffer's contents as never written
    borrow = borrow and "oclgrind" not in queue.device.platform.name.lower()
    flags = (cl.mem_flags.READ_ONLY | cl.mem_flags.USE_HOST_PTR if borrow
             else cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR)
    return HostBuffer(queue, cl.Buffer(queue.context, flags, hostbuf=host), host.shape, host.dtype)


def host_to_device(queue, host: np.ndarray, *, borrow: bool = False) -> cla.Array:
    """host_buffer as a pyopencl Array (what a QuantizedTensor on the device holds)."""
    return cla.Array(queue, host.shape, host.dtype, data=host_buffer(queue, host, borrow=borrow).base_data)


def device_to_host(*arrays) -> list:
    """Contiguous device arrays (pyopencl Arrays or HostBuffers; None gives None) on one in-order
    queue, read back: on a CPU device every read enqueued without blocking and all waited for
    together (one round trip, not one each), elsewhere blocking reads."""
    present = [a for a in arrays if a is not None]
    blocking = bool(present) and not _host_memory(present[0].queue)
    outs = [None if a is None else np.empty(a.shape, a.dtype) for a in arrays]
    events = [cl.enqueue_copy(a.queue, o, a.base_data, src_offset=a.offset, is_blocking=blocking)
              for a, o in zip(arrays, outs) if o is not None and o.nbytes]
    if events and not blocking:
        cl.wait_for_events(events)
    return outs


def launch_and_read(queue, enqueue, *arrays) -> list:
    """A call on host arrays: ``enqueue()`` its kernels, then read ``arrays`` back (device_to_host).
    Whatever fails once a kernel may be enqueued, the queue is drained before the error unwinds
    the frames that hold the borrowed host memory (host_buffer) those kernels read."""
    try:
        enqueue()
        return device_to_host(*arrays)
    except BaseException:
        queue.finish()
        raise


def host_view(x) -> np.ndarray:
    """numpy / torch CPU -> numpy over the same memory (torch's bfloat16 as its uint16 bits)."""
    if not hasattr(x, "detach"):
        return np.asarray(x)
    x = x.detach().cpu()
    if str(x.dtype) == "torch.bfloat16":
        import torch

        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def native_host(x) -> np.ndarray:
    """numpy / torch CPU -> a C-contiguous numpy array in the machine's byte order (a '>f4' array
    read as little-endian floats would be garbage, mostly NaN); bfloat16 as its uint16 bits."""
    host = host_view(x)
    if not host.dtype.isnative:
        host = host.astype(host.dtype.newbyteorder("="))
    return np.ascontiguousarray(host)


def check_fits(handle: DeviceHandle, buffers: dict) -> None:
    """Fail before any copy when a buffer (name -> bytes) exceeds the device's largest allocation
    or all of them its global memory; the message names the limit."""
    dev, gib = handle.device, 2.0 ** 30
    max_alloc, total = int(dev.max_mem_alloc_size), int(dev.global_mem_size)
    for name, nbytes in buffers.items():
        if nbytes > max_alloc:
            raise ValueError(f"{name}: {nbytes / gib:.2f} GiB exceeds the largest buffer {handle.name} allows "
                             f"(CL_DEVICE_MAX_MEM_ALLOC_SIZE = {max_alloc / gib:.2f} GiB)")
    need = sum(buffers.values())
    if need > total:
        raise ValueError(f"inputs, outputs and workspace need {need / gib:.2f} GiB, more than {handle.name}'s "
                         f"global memory (CL_DEVICE_GLOBAL_MEM_SIZE = {total / gib:.2f} GiB)")


def nbytes(shape, dtype) -> int:
    return math.prod(int(n) for n in shape) * storage_dtype(dtype).itemsize


def storage_dtype(dtype) -> np.dtype:
    """The numpy dtype of a buffer of ``dtype`` (a name or a numpy dtype): bfloat16 as its uint16 bits."""
    return np.dtype(np.uint16) if str(dtype) == "bfloat16" else np.dtype(dtype)


def bf16_bits(x) -> np.ndarray:
    """Float values -> their bfloat16 bits (uint16), rounded to nearest even, NaN kept NaN (as
    torch and the kernels round)."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((u >> 16) | 0x40).astype(np.uint16), rounded)


def to_stored(x, dtype: str) -> np.ndarray:
    """Float values as a buffer of ``dtype`` holds them (bfloat16: bf16_bits)."""
    return bf16_bits(x) if dtype == "bfloat16" else np.asarray(x, dtype)


def from_stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """A buffer of ``dtype`` read back as its values (bfloat16 bits as float32)."""
    return (x.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else x


def stored_values(x, dtype: str) -> np.ndarray:
    """Float values as ``dtype`` holds them (rounded to it; bfloat16's as float32)."""
    return from_stored(to_stored(x, dtype), dtype)


def storage_defines(dtype: str) -> dict:
    """The kernels' storage defines (clkernels/common.h) of a float32, float16 or bfloat16 problem."""
    return {"STORE_HALF": dtype == "float16", "STORE_BF16": dtype == "bfloat16"}


def host_result(out: np.ndarray, like, dtype: str):
    """A result read back (``out``, in its storage_dtype) as the caller's kind: torch for torch
    inputs (``like``), else numpy; bfloat16 from its bits (numpy has no bfloat16 of its own)."""
    if hasattr(like, "detach"):
        import torch

        t = torch.from_numpy(out)
        return t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out.view(like.dtype) if dtype == "bfloat16" else out


def wait_for_inputs(queue, tensors) -> None:
    """Make the kernels enqueued next on ``queue`` wait for the events of pyopencl Array inputs
    (their producers may still be running, on this queue or another of the context)."""
    events = [e for t in tensors if isinstance(t, cla.Array) for e in t.events]
    if events:
        cl.enqueue_barrier(queue, wait_for=events)


def attach_events(arrays, events) -> None:
    """A device-resident result carries the events that write it, so ``out.finish()`` waits."""
    for arr in arrays:
        if arr is not None:
            for e in events:
                arr.add_event(e)


# Quantized cache formats the kernels read (their K_QUANT / V_QUANT codes: the three decode files and both prefill layouts); flashcl.quant has the bytes.
QUANT_CODES = {"q8_0": 1, "q4_0": 2, "int8": 3}


def row_bytes(fmt: str | None, d: int, dtype: str) -> int:
    """Bytes of one stored K or V row of d values: plain (fmt None), ggml blocks of 32 values, or
    int8 values and their float32 row scale."""
    if fmt is None:
        return d * storage_dtype(dtype).itemsize
    if fmt in BLOCK_BYTES:
        return d // QK * BLOCK_BYTES[fmt]
    return d + 4
