"""Host-side checks of a decode's tables (context lengths, block table): the values a call reads
without a device round trip. numpy and torch CPU arrays are read; pyopencl Arrays and CUDA tensors
are not (their bad entries make the sequence's output NaN instead, docs/design.md)."""

from __future__ import annotations

import numpy as np


def torch_readable(x) -> bool:
    """Whether a torch tensor's values may be read on the host: not on a GPU (no device sync) and
    not inside torch.compile (a read would break the graph)."""
    import torch

    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def host_ints(x):
    """numpy / torch CPU integer array -> numpy; None for None and device arrays (not read back)."""
    if x is None or type(x).__module__.split(".")[0] == "pyopencl":
        return None
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().numpy() if torch_readable(x) else None
    return np.asarray(x)


def check_tables(geo: dict, block_table, context_lens) -> None:
    """Values of host-side tables: every context length within the cache, every block id a
    sequence uses within [0, num_blocks). Raises ValueError naming the batch index and value."""
    lens = host_ints(context_lens)
    paged = geo["paged"]
    if lens is not None:
        cap = geo["N_max"]
        where = "max_blocks * block_size" if paged else "N_max"
        for i, n in enumerate(lens.tolist()):
            if n < 0:
                raise ValueError(f"context_lens[{i}] = {n} is negative")
            if n > cap:
                raise ValueError(f"context_lens[{i}] = {n} exceeds the cache ({where} = {cap})")
    table = host_ints(block_table)
    if paged and table is not None and lens is not None:
        bs, nb = geo["block_size"], geo["num_blocks"]
        for i, n in enumerate(lens.tolist()):
            used = table[i, : -(-n // bs)]
            bad = (used < 0) | (used >= nb)
            if bad.any():
                j = int(np.argmax(bad))
                raise ValueError(f"block_table[{i}, {j}] = {int(used[j])} is out of range: sequence {i} "
                                 f"(context_lens {n}) uses blocks 0..{len(used) - 1}, block ids must be "
                                 f"in [0, num_blocks={nb})")
