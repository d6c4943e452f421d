"""Input handling shared by the OpenCL entry points: which device runs a call, and moving
numpy / torch CPU / pyopencl inputs to device arrays the kernels can address."""

from __future__ import annotations

import numpy as np
import pyopencl.array as cla

from .runtime import DeviceHandle, get_device


def dtype_name(x) -> str:
    """'float32' / 'float16' / 'int32' for numpy arrays, torch tensors and pyopencl Arrays."""
    return np.dtype(str(x.dtype).replace("torch.", "")).name


def handle_for_inputs(tensors: dict, device) -> DeviceHandle:
    """pyopencl Array inputs run on their own queue (and must share a context); anything else on
    ``device`` (DESIGN.md §2 device selection)."""
    on_device = {name: t for name, t in tensors.items() if isinstance(t, cla.Array)}
    if not on_device:
        return get_device(device)
    first = next(iter(on_device.values()))
    others = [name for name, t in on_device.items() if t.context != first.context]
    if others:
        raise ValueError(f"{', '.join(on_device)} are pyopencl Arrays of different contexts "
                         f"({', '.join(others)} differ from the first)")
    if device is not None:
        raise ValueError("device= cannot be combined with pyopencl Array inputs (they carry their queue)")
    return get_device(first.queue)


def elem_strides(arr: cla.Array) -> tuple[int, ...]:
    return tuple(s // arr.dtype.itemsize for s in arr.strides)


def to_device_4d(x, queue, rank: int) -> cla.Array:
    """numpy / torch CPU / pyopencl Array -> 4-D pyopencl Array with a contiguous head dim."""
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
        return arr
    host = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
    host = np.ascontiguousarray(host)
    if rank == 3:
        host = host[None]
    return cla.to_device(queue, host)
