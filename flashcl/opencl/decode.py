"""Host side of the OpenCL flash-decoding kernels: clkernels/decode.cl (GPUs, the "lanes"
layout), clkernels/decode_cpu.cl (CPUs, the "rows" layout) and clkernels/decode_mma.cl (NVIDIA
tensor cores); decode.cl's merge combines the split states of all three.

One work-group per (sequence, KV head, split) serves the whole GQA group (a larger one takes
several: decode_mma.cl 16 query heads each, decode_cpu.cl up to ROWS_GROUP_TILE); ``num_splits ==
1`` is a single pass that writes the normalized output itself, more splits write float32 partial
states that ``flash_decode_merge`` combines exactly. The split count, when not forced, comes from
:func:`choose_num_splits` (``DecodeKernel.auto_splits``).

On NVIDIA devices of compute capability 8.0+ with an fp16 or unquantized bf16 cache
(``tensor_cores_ok``) the two decode kernels come from decode_mma.cl: both products on mma.sync
(inline PTX), keys as the MMAs' rows and query heads as their columns, ~26 warp instructions per key
of an fp16 cache instead of ~115, so the SMs no longer run out of issue slots before HBM runs out of
bandwidth; split-k runs there in one launch (flash_decode_fused: the last work-group merges).
decode.cl serves the other GPUs and fp32 caches; decode_cpu.cl, one work-item reading whole rows in
SIMD vectors, serves CPUs (docs/notes/pocl-decode.md). What was measured for both, and every variant
that lost: docs/notes/opencl-decode-nvidia.md.

Attention variants (window, softcap, sinks, ALiBi: :class:`DecodeVariants`) and quantized caches
(q8_0, q4_0, int8 QuantizedTensors: ``DecodeProblem.k_fmt`` / ``v_fmt``) are -D flags of both
kernel files, so the plain builds are unchanged; a window narrows the keys the splits divide to
the ones the query sees, and the split count is chosen from that length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from .. import tuning
from ..tuning import rows_group_tile, rows_tiles
from ..quant import BLOCK_BYTES, QK, QuantizedTensor, dtype_name
from ..tables import check_tables, host_ints as _host_ints
from ..variants import window_bounds
from .arrays import (HostBuffer, attach_events, check_fits, elem_strides, handle_for_inputs, host_buffer,
                     host_result, host_to_device, launch_and_read, native_host, nbytes, row_bytes, storage_defines,
                     storage_dtype, to_device_4d, wait_for_inputs, QUANT_CODES)
from .runtime import DeviceHandle, build, check_variant, launch_sequence, probe_errors, spill_report

KERNEL = "decode"
_LOG2E = 1.0 / math.log(2.0)
CHUNK_BYTES = tuning.CHUNK_BYTES  # K/V rows are read in 16-byte chunks: 8 halves or 4 floats per work-item

# The decode tuning space (parameters, constraints with their reasons, the register and local
# memory model, the defaults) is data in the tuning layer; what follows reads it.
DECODE_SPACE = tuning.SPACES[KERNEL]
_PARAM_NAMES = tuning.DECODE_DEFINES  # the kernel's -D tunables; SPLIT_* are read by the host

MERGE_WG = tuning.DECODE_MERGE_WG   # default work-group of the merge kernel (see default_params)

# Split heuristic constants (see choose_num_splits); WAVES and KEYS_PER_SPLIT are the defaults of
# the tunables SPLIT_WAVES and SPLIT_KEYS.
WAVES = tuning.SPLIT_WAVES          # work-groups per compute unit the split count aims for
KEYS_PER_SPLIT = tuning.SPLIT_KEYS  # keys one split aims to cover on long contexts
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64         # automatic choice only; a forced num_splits may go up to MAX_FORCED_SPLITS
MAX_FORCED_SPLITS = 4096  # the merge keeps one weight per split in local memory


def _dims(group: int, dk: int, dv: int, dtype: str) -> tuning.Dims:
    return tuning.Dims(dk, dv, group, dtype)


def chunk_elems(dtype: str) -> int:
    return tuning.chunk_elems(dtype)


def lanes(dk: int, dv: int, dtype: str) -> int:
    return tuning.lanes(dk, dv, dtype)


def work_group_size(params: dict, group: int, dk: int, dv: int, dtype: str) -> int:
    return DECODE_SPACE.work_group_size(params, _dims(group, dk, dv, dtype))


def local_bytes(params: dict, group: int, dk: int, dv: int, dtype: str) -> int:
    """Local memory of the decode kernel (decode.cl's __local arrays), bytes."""
    return DECODE_SPACE.local_bytes(params, _dims(group, dk, dv, dtype))


def private_floats(params: dict, dk: int, dv: int, dtype: str) -> int:
    """The register model per work-item (DECODE_SPACE.private_floats)."""
    return DECODE_SPACE.private_floats(params, _dims(1, dk, dv, dtype))


def check_params(params: dict, group: int, dk: int, dv: int, dtype: str, *, local_mem: int,
                 max_work_group: int) -> list[str]:
    """Every violated constraint as a sentence; [] when valid."""
    return DECODE_SPACE.check(params, _dims(group, dk, dv, dtype),
                              {"local_mem": local_mem, "max_work_group": max_work_group})


def default_params(profile, group: int, dk: int, dv: int, dtype: str, *, local_mem: int,
                   max_work_group: int) -> dict:
    """Working parameters for an untuned device (DECODE_SPACE.defaults says how they are chosen)."""
    return DECODE_SPACE.default(profile, _dims(group, dk, dv, dtype), local_mem=local_mem,
                                max_work_group=max_work_group)


def layout_params(handle: DeviceHandle, prob: "DecodeProblem", layout: str) -> dict:
    """The untuned parameters of one layout ("lanes": decode.cl, "rows": decode_cpu.cl) on this
    device, whichever its profile defaults to (comparisons and tests of both)."""
    return tuning.decode_layout_defaults(layout, handle.profile, _dims(prob.group, prob.dk, prob.dv, prob.dtype),
                                         {"local_mem": handle.local_mem, "max_work_group": handle.max_work_group})


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _fullest_last_wave(slots: int, batch_heads: int, max_splits: int) -> int:
    """The smallest power-of-two split count whose work-groups fill their last wave of ``slots``
    within 85% of the best count's fill."""
    counts = [1 << i for i in range(max(1, max_splits).bit_length())]
    fill = {s: batch_heads * s / slots / math.ceil(batch_heads * s / slots) for s in counts}
    best = max(fill.values())
    return next(s for s in counts if fill[s] >= 0.85 * best)


def choose_num_splits(compute_units: int, batch_heads: int, n_ctx: int, *, waves: int = WAVES,
                      keys_per_split: int = KEYS_PER_SPLIT, min_keys: int = MIN_KEYS_PER_SPLIT,
                      max_splits: int = MAX_SPLITS, params: dict | None = None,
                      mean_ctx: float | None = None, short_keys: int = 0) -> int:
    """The split-k count when the caller does not force one.

    Decode is bandwidth bound, so the whole device must be reading, and each work-group must have
    enough keys in flight to hide memory latency. Two lower bounds, the larger wins:

    * fill the device: B·H_kv work-groups exist without splits; aim for ``waves`` (4) work-groups
      per compute unit, rounded DOWN to a power of two — ``pow2_floor(waves·CUs / (B·H_kv))``
      (four: what an NVIDIA SM holds of the default work-group, and the measured optimum);
    * bound the work of one work-group: a split covers about ``keys_per_split`` (512) keys —
      ``pow2_floor(n_ctx / keys_per_split)`` — so long contexts split even when B·H_kv already
      fills the device (a 2k-key work-group is one long serial chain of loads).

    Splits of fewer than ``short_keys`` keys (0: no such bound) number at most one work-group per
    compute unit: where each split is short, its fixed cost (prologue, state, merge) outweighs
    a second wave of parallelism.

    A split keeps at least ``min_keys`` (256) keys (its partial state and merge share stay small
    next to 128 KiB of K/V) and there are at most ``max_splits`` (64); powers of two, as every
    measured optimum was. ``n_ctx`` is the longest context of the batch (the keys its query sees).

    ``keys_per_split`` None (decode_mma.cl with the lengths on the host): the second bound
    balances instead of capping a split's keys. The longest sequence is split until its
    work-groups hold about as many keys as the mean work-group of a full wave: the split count
    whose last wave is fullest (the smallest power of two within 85% of the best, FlashAttention's
    rule) times ``n_ctx / mean_ctx`` rounded to the nearest power of two; ``mean_ctx`` None: the
    batch's lengths are taken as equal.

    ``params``: the configuration in use; its SPLIT_WAVES and SPLIT_KEYS, where set (a tuned
    entry, measured on the path that runs), replace ``waves`` and ``keys_per_split`` (SPLIT_KEYS
    not in the balancing mode: the tuner times the capped rule). The measurements behind the
    constants: docs/notes/opencl-decode-nvidia.md, "The split rule's constants".
    """
    balance = keys_per_split is None
    if params:
        waves = params.get("SPLIT_WAVES", waves)
        if not balance:
            keys_per_split = params.get("SPLIT_KEYS", keys_per_split)
    slots = waves * max(1, compute_units)
    if balance:  # the fullest last wave is never below the fill bound
        uneven = max(1.0, n_ctx / max(1.0, float(mean_ctx if mean_ctx is not None else n_ctx)))
        want = _fullest_last_wave(slots, max(1, batch_heads), max_splits) << round(math.log2(uneven))
    else:
        fill = _pow2_floor(slots // max(1, batch_heads)) if slots >= max(1, batch_heads) else 1
        work = _pow2_floor(n_ctx // keys_per_split) if n_ctx >= keys_per_split else 1
        want = max(fill, work)
    if short_keys and n_ctx < want * short_keys:
        want = min(want, _pow2_floor(max(1, compute_units // max(1, batch_heads))))
    cap = _pow2_floor(max(1, min(max_splits, n_ctx // min_keys)))
    return int(max(1, min(want, cap)))


@dataclass(frozen=True)
class DecodeProblem:
    b: int
    h_q: int
    h_kv: int
    dk: int
    dv: int
    paged: bool
    dtype: str  # "float32" | "float16" | "bfloat16"
    k_fmt: str | None = None   # quantized K cache format (QUANT_CODES), None: dtype rows
    v_fmt: str | None = None

    @property
    def group(self) -> int:
        return self.h_q // self.h_kv

    @property
    def quantized(self) -> bool:
        return self.k_fmt is not None or self.v_fmt is not None

    def bytes_moved(self, ctx_total: int) -> int:
        """Fewest bytes one decode step moves: every K and V row read once per GQA group, as
        stored (ctx_total = Σ_b context_len[b] keys, per KV head), q read and out written once.

            bytes = H_kv · Σ_b ctx_b · (row_bytes(K) + row_bytes(V))  +  B · H_q · (DK + DV) · e

        row_bytes: (DK or DV) · e plain, 34 or 18 per 32 values for q8_0 / q4_0, D + 4 for int8
        (its float32 row scale). Block table, context lengths and split-k partials are overhead,
        not counted."""
        e = storage_dtype(self.dtype).itemsize
        per_key = row_bytes(self.k_fmt, self.dk, self.dtype) + row_bytes(self.v_fmt, self.dv, self.dtype)
        return self.h_kv * ctx_total * per_key + self.b * self.h_q * (self.dk + self.dv) * e


def choose_params(handle: DeviceHandle, prob: DecodeProblem, params: dict | None = None,
                  n_ctx: int = 0) -> tuning.Choice:
    """User override, else the tuning database (kernel "decode"), else the default; validated.
    Without an override the choice is kept on the handle per problem class and length bucket."""
    if params is None:
        return handle.chosen((KERNEL, prob, tuning.seq_bucket(max(n_ctx, 1))),
                             lambda: _choose_params(handle, prob, None, n_ctx))
    return _choose_params(handle, prob, params, n_ctx)


def _choose_params(handle: DeviceHandle, prob: DecodeProblem, params: dict | None, n_ctx: int) -> tuning.Choice:
    def errors(p):
        return check_params(p, prob.group, prob.dk, prob.dv, prob.dtype, local_mem=handle.local_mem,
                            max_work_group=handle.max_work_group) or probe_errors(handle, KERNEL, prob.dtype, p)

    if params is not None:  # the probe's own error, before resolve's validation of them
        check_variant(handle, KERNEL, prob.dtype, params)
    choice = tuning.resolve(
        KERNEL, handle, params, errors=errors, dtype=prob.dtype, dk=prob.dk, dv=prob.dv,
        causal=False, n=max(n_ctx, 1), group=prob.group,
        default=lambda: _untuned(handle, prob))
    if params is None:  # the layout that runs, a default too (tuned entries passed `errors`)
        check_variant(handle, KERNEL, prob.dtype, choice.params)
    return choice


def _untuned(handle: DeviceHandle, prob: DecodeProblem) -> dict:
    """The profile's default, or decode.cl's layout where the probe found that the device's
    compiler fails decode_cpu.cl (as a failed 16-wide prefill narrows the profile's SIMD width)."""
    p = default_params(handle.profile, prob.group, prob.dk, prob.dv, prob.dtype,
                       local_mem=handle.local_mem, max_work_group=handle.max_work_group)
    if is_rows(p) and probe_errors(handle, KERNEL, prob.dtype, p):
        return layout_params(handle, prob, "lanes")
    return p


def row_shuffle_ok(handle: DeviceHandle, params: dict, group: int, dk: int, dv: int, dtype: str) -> bool:
    """Whether decode.cl's ROW_SHUFFLE path applies: NVIDIA (inline PTX shfl.sync in 32-wide
    warps), one head tile per work-group, the lanes of a K row a power of two <= 32 and the
    work-group whole warps. Measured against the local-memory sums: the module docstring."""
    if is_rows(params):
        return False
    ln = lanes(dk, dv, dtype)
    return (handle.is_nvidia and group // params["HEAD_TILE"] == 1 and ln <= 32 and ln & (ln - 1) == 0
            and work_group_size(params, group, dk, dv, dtype) % 32 == 0)


MMA_WARPS = 4  # warps per work-group of decode_mma.cl
# choose_num_splits for decode_mma.cl: 2 work-groups an SM (158-253 registers a work-item), >= 256
# keys a split, splits under 512 keys one work-group an SM at most; host lengths balance the splits,
# device tables split past 4096 keys a split (docs/notes/opencl-decode-nvidia.md, "Short splits")
MMA_WAVES = 2
# decode_mma.cl's split-k in one launch (flash_decode_fused: the last work-group of a head tile
# merges) instead of the split kernel and flash_decode_merge: 1-33% less time, most on short
# decodes, where a launch is a large share (docs/notes/opencl-decode-nvidia.md)
FUSED_MERGE = True
MMA_KEYS_PER_SPLIT = 4096
MMA_MIN_KEYS_PER_SPLIT = 256
MMA_SHORT_SPLIT_KEYS = 512


# choose_num_splits for decode_cpu.cl (CPUs): one work-group per compute unit and a split every
# 16384 keys (a core streams a long context as fast as several splits do; the merge is a second
# launch; tuning._decode_rows_defaults has the measurements)
ROWS_WAVES = tuning.ROWS_SPLIT_WAVES
ROWS_KEYS_PER_SPLIT = tuning.ROWS_SPLIT_KEYS


def split_defaults(params: dict, tensor_cores: bool) -> dict:
    """The split rule's constants (choose_num_splits' keywords) for the decode kernel that runs
    with ``params``: decode_mma.cl's, decode_cpu.cl's or decode.cl's; a configuration's
    SPLIT_WAVES / SPLIT_KEYS replace them."""
    if tensor_cores:
        return {"waves": MMA_WAVES, "keys_per_split": MMA_KEYS_PER_SPLIT, "min_keys": MMA_MIN_KEYS_PER_SPLIT,
                "short_keys": MMA_SHORT_SPLIT_KEYS}
    if is_rows(params):
        return {"waves": ROWS_WAVES, "keys_per_split": ROWS_KEYS_PER_SPLIT, "min_keys": MIN_KEYS_PER_SPLIT}
    return {"waves": WAVES, "keys_per_split": KEYS_PER_SPLIT, "min_keys": MIN_KEYS_PER_SPLIT}


def tensor_cores_ok(handle: DeviceHandle, prob: "DecodeProblem") -> bool:
    """Whether decode_mma.cl's real path applies: an NVIDIA device of compute capability 8.0+
    (mma.sync.m16n8k16 with f16 or bf16 inputs, inline PTX), an fp16 cache or an unquantized bf16
    one, DK a multiple of 32 up to 256 (a quantized K: 32, 64, 128 or 256) and DV 64 or 128 (16-byte
    row slices per work-item, the accumulator in registers). Any GQA group: 16 query heads per
    work-group."""
    if not handle.is_nvidia or not _mma_shape_ok(prob):
        return False
    try:
        return int(handle.device.compute_capability_major_nv) >= 8
    except (cl.LogicError, AttributeError):  # no cl_nv_device_attribute_query
        return False


# what _mma_shape_ok takes, in words (DecodeKernel's errors)
_MMA_SHAPES = ("an fp16 cache or an unquantized bf16 one, DK a multiple of 32 up to 256 (a quantized K: 32, 64, "
               "128 or 256) and DV 64 or 128")


def _mma_shape_ok(prob: "DecodeProblem") -> bool:
    # a work-item reads a quarter of a K row: a quantized one must be whole ggml blocks or one
    # block's aligned part (DK / 4 of 8, 16, 32 or 64 dims), else decode.cl reads it
    k_ok = prob.dk in (32, 64, 128, 256) if prob.k_fmt else prob.dk % 32 == 0 and prob.dk <= 256
    dtype_ok = prob.dtype == "float16" or (prob.dtype == "bfloat16" and not prob.quantized)
    return dtype_ok and k_ok and prob.dv in (64, 128)


def mma_tiles(group: int) -> int:
    """Work-groups of decode_mma.cl per KV head: one per 16 query heads of the group."""
    return -(-group // 16)


# --------------------------------------------------------------------------- variants

@dataclass(frozen=True)
class DecodeVariants:
    """What the decode kernels specialize on (decode_common.h's -D flags) and the run-time values
    they take, from a flashcl.variants.Variants. The query of sequence b sits at ctx[b] - 1 (with
    query_rows, the last row), so a window's right side hides nothing and a left side of -1 is no
    window at all."""

    window_left: int | None = None   # keys [ctx - 1 - window_left, ctx); None: every key
    softcap: float | None = None
    sinks: np.ndarray | None = None          # float32 (H_q,): numpy, or a pyopencl Array
    alibi_slopes: np.ndarray | None = None   # float32 (B, H_q): numpy, or a pyopencl Array
    # int32 (B,): sequence b's first key (keys before it hidden; decode's key_start, and
    # prefill's route for one left-padded row): numpy, or a pyopencl Array
    key_start: np.ndarray | None = None
    # > 1: head h is causal query row h % query_rows of the sequence's last positions (prefill's
    # few-row route, opencl.prefill._prefill_rows_as_decode; every decode kernel)
    query_rows: int = 1
    # that route's mask (Bm, Hm, query_rows, N_kv), bool as uint8 or float32 additive, contiguous
    # host memory: head h is row h % query_rows of prefill's head h // query_rows (ROW_MASK)
    row_mask: np.ndarray | None = None

    @classmethod
    def of(cls, variants, prob: "DecodeProblem", key_start=None, query_rows: int = 1,
           row_mask=None) -> "DecodeVariants | None":
        """None when nothing changes the plain kernels' answer (they then run unchanged; a host
        ``key_start`` of zeros or less hides no key, a device one is not read back)."""
        extra = {"query_rows": query_rows} if query_rows > 1 else {}
        if row_mask is not None:
            extra["row_mask"] = np.ascontiguousarray(row_mask, np.uint8 if row_mask.dtype == np.bool_ else np.float32)
        if isinstance(key_start, cla.Array) or (key_start is not None and np.any(np.asarray(key_start) > 0)):
            extra["key_start"] = (key_start if isinstance(key_start, cla.Array)
                                  else np.ascontiguousarray(key_start, dtype=np.int32).reshape(prob.b))
        if extra:
            return replace(cls.of(variants, prob) or cls(), **extra)
        if variants is None:
            return None
        if getattr(variants, "mask", None) is not None:
            raise ValueError("decode takes no mask (one query row per sequence: use window, or "
                             "context_lens to end a sequence)")
        left = None
        if variants.window is not None and variants.window[0] >= 0:
            left = int(variants.window[0])
        sinks = slopes = None
        if variants.sinks is not None:
            sinks = np.ascontiguousarray(_host(variants.sinks), dtype=np.float32).reshape(prob.h_q)
        if variants.alibi_slopes is not None:
            slopes = np.ascontiguousarray(np.broadcast_to(_host(variants.alibi_slopes).astype(np.float32),
                                                          (prob.b, prob.h_q)))
        out = cls(left, None if variants.softcap is None else float(variants.softcap), sinks, slopes)
        return out if out.flags() else None

    def flags(self) -> dict:
        """The -D defines of the variants that are on (the plain build has none of them)."""
        on = {"WINDOW": self.window_left is not None, "SOFTCAP": self.softcap is not None,
              "SINKS": self.sinks is not None, "ALIBI": self.alibi_slopes is not None,
              "KEY_START": self.key_start is not None}
        flags = {k: 1 for k, v in on.items() if v}
        if self.query_rows > 1:
            flags["QUERY_ROWS"] = self.query_rows
        if self.row_mask is not None:
            flags["ROW_MASK"] = 1 if self.row_mask.dtype == np.uint8 else 2
        return flags

    def keys_seen(self, n_ctx):
        """Keys the queries of a sequence of n_ctx keys see through the window, its rows together
        (what the split count is chosen from); n_ctx an int or an array of lengths."""
        if self.window_left is None:
            return n_ctx
        seen = np.minimum(n_ctx, self.window_left + self.query_rows)
        return int(seen) if np.ndim(seen) == 0 else seen

    def kernel_args(self, queue, dummy) -> list:
        """VARIANT_PARAMS (decode_common.h): window_left, softcap_log2, sinks, alibi_slopes (an
        unused buffer argument gets ``dummy``, never read), then key_start where it is on. Host
        arrays are copied to the device; their buffers, held by the list until the launch, are
        then kept by OpenCL until the kernels that use them have run."""
        # window_bounds' 2^30 for no window: a row's position less it stays within int
        left = window_bounds(None if self.window_left is None else (self.window_left, 0))[0]
        cap = 0.0 if self.softcap is None else self.softcap * _LOG2E
        arrays = [x if x is None or isinstance(x, cla.Array) else host_buffer(queue, x)
                  for x in (self.sinks, self.alibi_slopes, self.key_start)]
        starts = [] if arrays[2] is None else [arrays[2].data]
        mask = []
        if self.row_mask is not None:  # its element strides; a dim of 1 broadcasts
            st = [s // self.row_mask.itemsize if n > 1 else 0 for s, n in zip(self.row_mask.strides, self.row_mask.shape)]
            mask = [host_buffer(queue, self.row_mask).data, *(np.uint64(x) for x in st[:3])]
        return [np.int32(left), np.float32(cap), *(dummy if a is None else a.data for a in arrays[:2]), *starts,
                *mask]


def quant_defines(prob: DecodeProblem) -> dict:
    """K_QUANT / V_QUANT of a quantized side (kv_formats.h); none for plain caches."""
    return {name: QUANT_CODES[fmt] for name, fmt in (("K_QUANT", prob.k_fmt), ("V_QUANT", prob.v_fmt)) if fmt}


is_rows = tuning.is_rows  # decode_cpu.cl's configuration ("rows") rather than decode.cl's


def program_defines(prob: DecodeProblem, params: dict, *, row_shuffle: bool = False,
                    unroll_merge: bool = True, merge_only: bool = False, variant_flags=None) -> dict:
    """The ``-D`` defines of decode.cl for one problem class and parameter set: what DecodeKernel
    builds and `flashcl export` writes. ``row_shuffle``: NVIDIA only (row_shuffle_ok);
    ``unroll_merge``: off on CPUs; ``merge_only``: decode_mma.cl runs the two decode kernels;
    ``variant_flags``: DecodeVariants.flags() (none: the plain kernels)."""
    return {
        "HEAD_DK": prob.dk, "HEAD_DV": prob.dv, "GROUP": prob.group,
        **storage_defines(prob.dtype), "PAGED": prob.paged,
        "ROW_SHUFFLE": row_shuffle, "UNROLL_MERGE": unroll_merge, "MERGE_ONLY": merge_only,
        **{k: params[k] for k in _PARAM_NAMES}, **(variant_flags or {}), **quant_defines(prob),
    }


def merge_defines(prob: DecodeProblem, params: dict, *, unroll_merge: bool = True) -> dict:
    """The ``-D`` defines of decode.cl built for flash_decode_merge alone (MERGE_ONLY), where
    decode_mma.cl or decode_cpu.cl runs the decode kernels: the merge depends on the output's
    head dim and storage and on MERGE_WG only."""
    return {"HEAD_DK": prob.dv, "HEAD_DV": prob.dv, "GROUP": 1, **storage_defines(prob.dtype),
            "MERGE_WG": params["MERGE_WG"], "UNROLL_MERGE": unroll_merge, "MERGE_ONLY": 1, "HEAD_TILE": 1}


def head_tiles(group: int, tensor_cores, rows: bool) -> int:
    """Work-groups per KV head along grid dimension 1: decode_mma.cl's and decode_cpu.cl's tiles
    of a large group, else 1."""
    return mma_tiles(group) if tensor_cores else rows_tiles(group) if rows else 1


def rows_defines(prob: DecodeProblem, params: dict, variant_flags=None) -> dict:
    """The ``-D`` defines of decode_cpu.cl (the "rows" layout)."""
    return {
        "HEAD_DK": prob.dk, "HEAD_DV": prob.dv, "GROUP": prob.group, "GROUP_TILE": rows_group_tile(prob.group),
        **storage_defines(prob.dtype), "PAGED": prob.paged,
        "BLOCK_N": params["BLOCK_N"], "VEC": params["VEC"], **(variant_flags or {}), **quant_defines(prob),
    }


def launch_grid(prob: DecodeProblem, wg: int, num_splits: int, head_tiles: int = 1) -> tuple[tuple, tuple]:
    """(global, local) sizes of flash_decode and flash_decode_split: one work-group per (split, KV
    head tile, sequence)."""
    return (wg * num_splits, prob.h_kv * head_tiles, prob.b), (wg, 1, 1)


def merge_grid(prob: DecodeProblem, merge_wg: int) -> tuple[tuple, tuple]:
    """(global, local) sizes of flash_decode_merge: one work-group per (query head, sequence)."""
    return (merge_wg * prob.h_q, prob.b), (merge_wg, 1)


def workspace_shapes(prob: DecodeProblem, num_splits: int) -> tuple:
    """The float32 partial states of flash_decode_split: part_m, part_l, part_acc."""
    return ((prob.b, prob.h_q, num_splits), (prob.b, prob.h_q, num_splits),
            (prob.b, prob.h_q, num_splits, prob.dv))


# The arguments of flash_decode and flash_decode_split (decode_common.h: DECODE_PARAMS), in order:
# (name, OpenCL C type, meaning). store_t is float, half (STORE_HALF) or ushort (STORE_BF16's bits);
# raw_t, one 16-byte chunk, is float4, or uint4 holding 8 16-bit values. DecodeKernel.__call__ passes
# them in this order.
_KV_STRIDES = ("in 16-byte chunks (elements / 4 for float, / 8 for half); rows start 16-byte aligned "
               "(a quantized cache, K_QUANT / V_QUANT: in bytes)")
ARGS = (
    ("q", "__global const store_t *", "queries (B, H_q, DK): element (b, h, d) at q_off + b*q_sb + h*q_sh + d"),
    ("k", "__global const raw_t *", "K cache, paged (num_blocks, block_size, H_kv, DK) or contiguous "
                                    "(B, H_kv, N_max, DK) (PAGED), head dim contiguous; addressed with "
                                    "k_off, k_s0, k_sh, k_s1"),
    ("v", "__global const raw_t *", "V cache, as k with DV; addressed with v_off, v_s0, v_sh, v_s1"),
    ("out", "__global store_t *", "output (B, H_q, DV): written by flash_decode (num_splits == 1), not "
                                  "by flash_decode_split; addressed with o_off, o_sb, o_sh"),
    ("lse", "__global float *", "log-sum-exp (B, H_q), float32, contiguous, natural log: written by "
                                "flash_decode, not by flash_decode_split"),
    ("part_m", "__global float *", "flash_decode_split: running max per split (B, H_q, num_splits), "
                                   "float32, written; flash_decode does not use it (pass any buffer)"),
    ("part_l", "__global float *", "flash_decode_split: softmax denominator per split (B, H_q, num_splits), "
                                   "float32, written; unused by flash_decode"),
    ("part_acc", "__global float *", "flash_decode_split: unnormalized output per split (B, H_q, "
                                     "num_splits, DV), float32, written; unused by flash_decode"),
    ("block_table", "__global const int *", "paged: (B, bt_stride) block ids, any order; contiguous: any "
                                            "int buffer (not read). Ids a sequence uses outside "
                                            "[0, num_blocks) make its out and lse NaN"),
    ("context_lens", "__global const int *", "(B,) keys per sequence; a length outside [0, capacity] "
                                             "makes that sequence's out and lse NaN"),
    ("h_q", "const int", "H_q, query heads (H_kv = H_q / GROUP)"),
    ("num_splits", "const int", "split-k count: 1 runs flash_decode alone; more run flash_decode_split "
                                "then flash_decode_merge"),
    ("bt_stride", "const int", "paged: max_blocks, the block table's row length; contiguous: 0"),
    ("block_shift", "const int", "paged: log2(block_size), block_size a power of two 1..256; contiguous: 0"),
    ("num_blocks", "const int", "paged: blocks in the cache; contiguous: 0"),
    ("capacity", "const int", "paged: max_blocks * block_size; contiguous: N_max"),
    ("scale_log2", "const float", "softmax scale times log2(e); the scale is usually 1/sqrt(DK)"),
    ("q_off", "const ulong", "offset of q[0, 0, 0] in elements"),
    ("q_sb", "const ulong", "q batch stride in elements"),
    ("q_sh", "const ulong", "q head stride in elements"),
    *((f"{t}_{s}", "const ulong", what + " " + _KV_STRIDES)
      for t in ("k", "v")
      for s, what in (("off", f"offset of the {t.upper()} cache"),
                      ("s0", f"{t.upper()} block stride (paged) or batch stride (contiguous)"),
                      ("sh", f"{t.upper()} KV-head stride"),
                      ("s1", f"{t.upper()} slot stride within a block (paged) or token stride (contiguous)"))),
    ("o_off", "const ulong", "offset of out[0, 0, 0] in elements"),
    ("o_sb", "const ulong", "out batch stride in elements"),
    ("o_sh", "const ulong", "out head stride in elements"),
)

# Arguments that follow ARGS only in builds that need them (decode_common.h VARIANT_PARAMS, with
# KEY_START_PARAM last in KEY_START builds, then decode.cl QUANT_PARAMS); a quantized K or V
# cache also takes its offset and strides in bytes.
VARIANT_ARGS = (
    ("window_left", "const int", "WINDOW: the query at p = ctx - 1 (QUERY_ROWS: row r at ctx - QUERY_ROWS + r) "
                                 "sees keys [p - window_left, p]"),
    ("softcap_log2", "const float", "SOFTCAP: the softcap times log2(e)"),
    ("sinks", "__global const float *", "SINKS: (H_q,) sink logits, natural log; else any buffer"),
    ("alibi_slopes", "__global const float *", "ALIBI: (B, H_q) slopes; else any buffer"),
)
KEY_START_ARGS = (
    ("key_start", "__global const int *", "KEY_START: (B,) int32, the first key sequence b's query sees "
                                          "(earlier keys hidden, never read)"),
)
QUANT_ARGS = (
    ("k_scales", "__global const float *", "int8 K: one float32 scale per row, in the rows' order; else any buffer"),
    ("v_scales", "__global const float *", "int8 V: as k_scales"),
    ("ks_off", "const ulong", "offset of k_scales[0] in floats"),
    ("vs_off", "const ulong", "offset of v_scales[0] in floats"),
)

# The arguments of flash_decode_merge, in order; it runs after flash_decode_split when num_splits > 1.
MERGE_ARGS = (
    ("part_m", "__global const float *", "flash_decode_split's part_m (B, H_q, num_splits)"),
    ("part_l", "__global const float *", "flash_decode_split's part_l (B, H_q, num_splits)"),
    ("part_acc", "__global const float *", "flash_decode_split's part_acc (B, H_q, num_splits, DV)"),
    ("out", "__global store_t *", "output (B, H_q, DV), written; addressed with o_off, o_sb, o_sh"),
    ("lse", "__global float *", "log-sum-exp (B, H_q), float32, contiguous, natural log, written"),
    ("h_q", "const int", "H_q, query heads"),
    ("num_splits", "const int", "the split count flash_decode_split ran with (at most 4096)"),
    ("o_off", "const ulong", "offset of out[0, 0, 0] in elements"),
    ("o_sb", "const ulong", "out batch stride in elements"),
    ("o_sh", "const ulong", "out head stride in elements"),
    ("weights", "__local float *", "local memory of 4 * num_splits bytes (clSetKernelArg with a NULL value)"),
)


class DecodeKernel:
    """The decode kernels built for one problem class and parameter set on one device.

    ``tensor_cores`` None: decode_mma.cl's kernels wherever tensor_cores_ok, elsewhere those of
    the parameters' layout (decode.cl, or decode_cpu.cl for VARIANT="rows"; the separate merge
    always comes from decode.cl); False forces the layout's file; "emulate"
    builds decode_mma.cl with its PTX instructions emulated in local memory, on any device (tests
    of the fragment bookkeeping, slow). decode_mma.cl's PTX (movmatrix: PTX ISA 7.8) needs an
    NVIDIA driver of R520 or later. ``fused_merge`` None: split-k in one launch
    (flash_decode_fused) with the real PTX, two launches elsewhere; True / False force it
    (decode_mma.cl only). ``row_shuffle`` None: decode.cl's ROW_SHUFFLE wherever row_shuffle_ok
    (False forces the local-memory sums, for comparisons).

    The kernels check the tables themselves (they may be device-resident, never read back): a
    sequence whose context length is outside [0, capacity] (max_blocks * block_size paged, N_max
    contiguous) or whose used blocks include an id outside [0, num_blocks) reads nothing out of
    bounds and gets NaN in every element of its out and lse rows, so that a bad table shows
    instead of passing for an answer; the other sequences are unaffected. Cache rows at or past
    a sequence's context length are never read."""

    def __init__(self, handle: DeviceHandle, prob: DecodeProblem, params: dict, *,
                 verbose: bool = False, extra_options=(), row_shuffle: bool | None = None,
                 tensor_cores: bool | str | None = None, mma_warps: int = MMA_WARPS,
                 variant_flags: dict | None = None, fused_merge: bool | None = None):
        self.handle, self.prob, self.params = handle, prob, dict(params)
        self.variant_flags = dict(variant_flags or {})
        shuffle_ok = row_shuffle_ok(handle, params, prob.group, prob.dk, prob.dv, prob.dtype)
        if row_shuffle and not shuffle_ok:
            raise ValueError("row_shuffle: needs an NVIDIA device, HEAD_TILE == G, and K rows of a "
                             "power-of-two number of lanes <= 32 in whole warps")
        self.row_shuffle = shuffle_ok if row_shuffle is None else bool(row_shuffle)
        mma_ok = tensor_cores_ok(handle, prob)
        if tensor_cores == "emulate" and not _mma_shape_ok(prob):
            raise ValueError(f"tensor_cores='emulate': needs {_MMA_SHAPES}")
        if tensor_cores is True and not mma_ok:
            raise ValueError(f"tensor_cores: needs an NVIDIA device of compute capability 8.0+, {_MMA_SHAPES}")
        self.tensor_cores = mma_ok if tensor_cores is None else tensor_cores
        # decode.cl runs every kernel, or only the merge where another file runs the decode kernels
        self.rows = is_rows(params) and not self.tensor_cores
        unroll_merge = not handle.is_cpu
        if self.tensor_cores or self.rows:
            self.defines = merge_defines(prob, params, unroll_merge=unroll_merge)
        else:
            self.defines = program_defines(prob, params, row_shuffle=self.row_shuffle, unroll_merge=unroll_merge,
                                           variant_flags=self.variant_flags)
        self.built = build(handle, "decode.cl", self.defines, kernel=KERNEL, verbose=verbose,
                           extra_options=extra_options)
        self.built_decode = self.built  # the program of flash_decode and flash_decode_split
        self.wg = work_group_size(params, prob.group, prob.dk, prob.dv, prob.dtype)
        if self.tensor_cores:
            mma_defines = {"HEAD_DK": prob.dk, "HEAD_DV": prob.dv, "GROUP": prob.group, **storage_defines(prob.dtype),
                           "PAGED": prob.paged, "MMA_WARPS": mma_warps,
                           "MMA_EMULATE": self.tensor_cores == "emulate", **self.variant_flags, **quant_defines(prob)}
            self.built_decode = build(handle, "decode_mma.cl", mma_defines, kernel=KERNEL, verbose=verbose,
                                      extra_options=extra_options)
            self.wg = 32 * mma_warps
        elif self.rows:
            self.built_decode = build(handle, "decode_cpu.cl", rows_defines(prob, params, self.variant_flags),
                                      kernel=KERNEL, verbose=verbose, extra_options=extra_options)
        self.kernels = {"flash_decode": self.built_decode.kernel("flash_decode"),
                        "flash_decode_split": self.built_decode.kernel("flash_decode_split"),
                        "flash_decode_merge": self.built.kernel("flash_decode_merge")}
        if fused_merge and not self.tensor_cores:
            raise ValueError("fused_merge: decode_mma.cl only (tensor_cores)")
        # by default only with the real PTX (membar.gl orders the states before the arrival count):
        # OpenCL 1.2 orders nothing between work-groups, so Oclgrind calls the emulated one racy
        self.fused_merge = ((FUSED_MERGE and self.tensor_cores is True) if fused_merge is None
                            else bool(fused_merge))
        if self.tensor_cores:
            self.kernels["flash_decode_fused"] = self.built_decode.kernel("flash_decode_fused")
        self.head_tiles = head_tiles(prob.group, self.tensor_cores, self.rows)
        for name, need in (("flash_decode", self.wg), ("flash_decode_merge", params["MERGE_WG"]),
                           *((("flash_decode_fused", self.wg),) if self.tensor_cores else ())):
            kwg = int(self.kernels[name].get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE,
                                                             handle.device))
            if kwg < need:
                raise ValueError(f"params: {name} needs a work-group of {need} but the kernel allows "
                                 f"{kwg} on {handle.name} (too many registers per work-item); use a "
                                 f"smaller ROWS or HEAD_TILE")

    @property
    def built_programs(self) -> tuple:
        return (self.built,) if self.built_decode is self.built else (self.built, self.built_decode)

    @property
    def path(self) -> str:
        """Which decode kernel runs, in words (benchmark tables)."""
        if self.tensor_cores == "emulate":
            return "decode_mma.cl, emulated"
        if self.tensor_cores:
            return "decode_mma.cl (tensor cores)"
        if self.rows:
            return "decode_cpu.cl (whole rows)"
        return "decode.cl (" + ("warp shuffles" if self.row_shuffle else "local-memory sums") + ")"

    @property
    def quant_piece(self) -> int:
        """The alignment in bytes an int8 row's loads need: 16 in decode_mma.cl, a chunk's values
        (8 half, 4 float) in decode.cl, none in decode_cpu.cl (vloadn of chars)."""
        if self.tensor_cores:
            return 16
        return 1 if self.rows else chunk_elems(self.prob.dtype)

    def spills(self) -> dict:
        """Spill signals per kernel (ptxas lines appear when built with verbose=True on NVIDIA)."""
        return {name: spill_report(self.built if name == "flash_decode_merge" else self.built_decode, k,
                                   self.handle)
                for name, k in self.kernels.items()}

    def arrivals(self) -> cl.Buffer:
        """flash_decode_fused's int32 arrival counts, one per (sequence, grid row): zeros, the
        device handle's scratch (each launch leaves them at zero). A launch that did not finish
        would leave them non-zero for the next."""
        return self.handle.scratch("arrivals", 4 * self.prob.b * self.prob.h_kv * self.head_tiles, zeroed=True)

    def workspace(self, num_splits: int) -> tuple:
        """The buffers of the partial states (m, l, acc) for ``num_splits``: the device handle's
        scratch, shared by the decodes on its queue."""
        return tuple(self.handle.scratch(name, 4 * math.prod(shape))
                     for name, shape in zip(("part_m", "part_l", "part_acc"), workspace_shapes(self.prob, num_splits)))

    def __call__(self, q, k, v, out, lse, block_table, context_lens, scale: float, num_splits: int,
                 wait_for=None, variants: DecodeVariants | None = None) -> list[cl.Event]:
        """Enqueue on pyopencl Arrays; returns the events (decode, and merge when num_splits > 1
        and the merge is not fused).
        The arguments as launches() takes them."""
        seq = self.launches(q, k, v, out, lse, block_table, context_lens, scale, num_splits, variants=variants)
        return launch_sequence(self.handle, seq, params=self.params)

    def launches(self, q, k, v, out, lse, block_table, context_lens, scale: float, num_splits: int,
                 variants: DecodeVariants | None = None) -> list[tuple]:
        """The kernels one call enqueues, as (name, kernel, global size, local size, arguments):
        the decode kernel, and the merge when num_splits > 1 unless ``fused_merge`` (then one
        kernel, flash_decode_fused, merges in its last work-groups; benchmarks/opencl_under_ncu.py
        launches the first through the CUDA driver).

        q (B, H_q, DK) and out (B, H_q, DV): head dim contiguous. k/v: contiguous (B, H_kv, N_max, D)
        or paged (num_blocks, block_size, H_kv, D), head dim contiguous, offsets and other strides
        multiples of 16 bytes. block_table (B, max_blocks) int32 (paged; any int32 array otherwise),
        context_lens (B,) int32, lse (B, H_q) float32; all contiguous. Bad table values: see the
        class docstring. ``variants``: the run-time values of the variants this kernel was built
        for (the same flags), or None for a plain build.
        """
        p, h = self.prob, self.handle
        given = variants.flags() if variants is not None else {}
        if given != self.variant_flags:
            raise ValueError(f"variants: this kernel was built for {sorted(self.variant_flags) or 'none'}, "
                             f"the call has {sorted(given) or 'none'}")
        extra = variants.kernel_args(h.queue, lse.data) if variants else []
        w = chunk_elems(p.dtype)
        kv_args, scale_args = [], []
        for arr, fmt in ((k, p.k_fmt), (v, p.v_fmt)):
            if fmt is not None:
                kv_args += _quantized_addressing(arr, fmt, p.paged, self.quant_piece)
                scale_args.append(arr.scales if fmt == "int8" else None)
                continue
            scale_args.append(None)
            strides = elem_strides(arr)
            off = arr.offset // arr.dtype.itemsize
            if p.paged:   # (num_blocks, block_size, H_kv, D): s0 = block, s1 = slot
                s0, s1, sh = strides[0], strides[1], strides[2]
            else:         # (B, H_kv, N_max, D): s0 = batch, s1 = token
                s0, sh, s1 = strides[0], strides[1], strides[2]
            if any(x % w for x in (off, s0, s1, sh)) or (strides[3] != 1 and arr.shape[3] > 1):
                raise ValueError(f"k_cache/v_cache: offsets and strides must be multiples of {w} "
                                 f"elements (16 bytes) with a contiguous head dim; got offset {off}, "
                                 f"strides {strides}; pass a contiguous copy")
            kv_args += [np.uint64(off // w), np.uint64(s0 // w), np.uint64(sh // w), np.uint64(s1 // w)]
        block_size = k.shape[1] if p.paged else 1
        bt_stride = block_table.shape[1] if p.paged else 0
        # what the kernels check the tables against: block ids < num_blocks, lengths <= capacity
        num_blocks = min(k.shape[0], v.shape[0]) if p.paged else 0
        capacity = bt_stride * block_size if p.paged else min(k.shape[2], v.shape[2])
        qs, os_ = elem_strides(q), elem_strides(out)
        common = [np.int32(p.h_q), np.int32(num_splits), np.int32(bt_stride),
                  np.int32(int(block_size).bit_length() - 1), np.int32(min(num_blocks, 2**31 - 1)),
                  np.int32(min(capacity, 2**31 - 1)), np.float32(scale * _LOG2E),
                  np.uint64(q.offset // q.dtype.itemsize), np.uint64(qs[0]), np.uint64(qs[1]),
                  *kv_args,
                  np.uint64(out.offset // out.dtype.itemsize), np.uint64(os_[0]), np.uint64(os_[1]),
                  *extra]
        if "int8" in (p.k_fmt, p.v_fmt):  # QUANT_PARAMS: the int8 row scales and their offsets
            common += [lse.data if sc is None else sc.base_data for sc in scale_args]
            common += [np.uint64(0 if sc is None else sc.offset // 4) for sc in scale_args]
        gsize, lsize = launch_grid(p, self.wg, num_splits, self.head_tiles)
        if num_splits == 1:
            args = [q.base_data, _buffer(k), _buffer(v), out.base_data, lse.data,
                    lse.data, lse.data, lse.data, block_table.data, context_lens.data, *common]
            return [(KERNEL, self.kernels["flash_decode"], gsize, lsize, args)]
        pm, pl, pacc = self.workspace(num_splits)
        args = [q.base_data, _buffer(k), _buffer(v), out.base_data, lse.data,
                pm, pl, pacc, block_table.data, context_lens.data, *common]
        mwg = self.params["MERGE_WG"]
        margs = [pm, pl, pacc, out.base_data, lse.data, np.int32(p.h_q),
                 np.int32(num_splits), np.uint64(out.offset // out.dtype.itemsize),
                 np.uint64(os_[0]), np.uint64(os_[1]), cl.LocalMemory(4 * num_splits)]
        if self.fused_merge:
            return [(KERNEL, self.kernels["flash_decode_fused"], gsize, lsize, args + [self.arrivals()])]
        return [(KERNEL, self.kernels["flash_decode_split"], gsize, lsize, args),
                (KERNEL + "_merge", self.kernels["flash_decode_merge"], *merge_grid(p, mwg), margs)]

    def auto_splits(self, n_ctx: int, mean_ctx: float | None = None) -> int:
        """The split count choose_num_splits gives this kernel for a query that sees up to n_ctx
        keys (with a window: the windowed length, DecodeVariants.keys_seen); ``mean_ctx``, the
        mean of those lengths over the batch where the host knows them, balances decode_mma.cl's
        splits (None: device tables, 4096 keys a split at most)."""
        rule = split_defaults(self.params, bool(self.tensor_cores))
        if self.tensor_cores:
            rule.update(mean_ctx=mean_ctx, keys_per_split=MMA_KEYS_PER_SPLIT if mean_ctx is None else None)
        return choose_num_splits(int(self.handle.device.max_compute_units),
                                 self.prob.b * self.prob.h_kv * self.head_tiles, n_ctx, **rule,
                                 params=self.params)


def _quant_format(x, name: str) -> str | None:
    """A cache's QUANT_CODES format, None for a plain one; a format decode.cl cannot read raises."""
    if not isinstance(x, QuantizedTensor):
        return None
    if x.fmt not in QUANT_CODES:
        raise TypeError(f"{name}: the OpenCL decode kernels read {', '.join(QUANT_CODES)} caches, got {x.fmt!r}")
    return x.fmt


def quantized_to_device(qt: QuantizedTensor, queue, *, borrow: bool = False) -> QuantizedTensor:
    """The QuantizedTensor with data (and int8 scales) as pyopencl Arrays; pyopencl ones stay
    (``borrow``: host_buffer's)."""
    def dev(x):
        return x if isinstance(x, cla.Array) else host_to_device(queue, native_host(x), borrow=borrow)

    scales = dev(qt.scales) if qt.fmt == "int8" else None  # ggml scales live inside data
    return QuantizedTensor(dev(qt.data), scales, qt.fmt, tuple(qt.shape), qt.dtype)


def _buffer(x):
    """The buffer a K/V argument reads: a plain Array's, or a quantized cache's data."""
    return x.data.base_data if isinstance(x, QuantizedTensor) else x.base_data


def _quantized_addressing(qt: QuantizedTensor, fmt: str, paged: bool, piece: int) -> list:
    """decode.cl's off, s0, sh, s1 of a quantized cache (pyopencl data), in bytes. Rows must be
    contiguous and their pieces aligned as the kernels read them: 2 bytes in ggml blocks; int8
    ``piece`` bytes (DecodeKernel.quant_piece), its scales one contiguous float32 per row in the
    rows' order."""
    data = qt.data
    if not isinstance(data, cla.Array):
        raise TypeError(f"a quantized cache's data must be a pyopencl Array here, got {type(data).__name__}")
    st = data.strides
    row = qt.shape[-1] // QK * BLOCK_BYTES[fmt] if fmt in BLOCK_BYTES else qt.shape[-1]
    contiguous_row = (st[-1] == 1 and st[-2] == BLOCK_BYTES[fmt]) if fmt in BLOCK_BYTES else st[-1] == 1
    align = 2 if fmt in BLOCK_BYTES else piece  # load_quant's uint, uint2 or decode_mma.cl's uint4
    if fmt == "int8" and not (data.flags.c_contiguous and qt.scales.flags.c_contiguous):
        raise ValueError("int8 k_cache/v_cache: data and scales must be C-contiguous (the row scale is "
                         "found at the row's byte offset / D)")
    if not contiguous_row or any(x % align for x in (data.offset, *st[:3])):
        raise ValueError(f"{fmt} k_cache/v_cache: rows of {row} contiguous bytes with offset and strides "
                         f"multiples of {align} needed; got offset {data.offset}, strides {st}")
    if paged:   # (num_blocks, block_size, H_kv, ...): s0 = block, s1 = slot
        s0, s1, sh = st[0], st[1], st[2]
    else:       # (B, H_kv, N_max, ...): s0 = batch, s1 = token
        s0, sh, s1 = st[0], st[1], st[2]
    return [np.uint64(data.offset), np.uint64(s0), np.uint64(sh), np.uint64(s1)]


# --------------------------------------------------------------------------- host-side checks

def _host(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _int_to_device(x, queue, fill=None, shape=None, *, borrow: bool = False):
    if x is None:
        return host_buffer(queue, np.full(shape, fill, dtype=np.int32))
    if isinstance(x, cla.Array):
        if not x.flags.c_contiguous:
            raise ValueError("block_table/context_lens/key_start pyopencl Arrays must be C-contiguous")
        if not x.dtype.isnative:
            raise TypeError(f"block_table/context_lens/key_start: a pyopencl Array of dtype {x.dtype.str} is not "
                            "in the device's byte order")
        return x
    return host_buffer(queue, np.ascontiguousarray(_host(x), dtype=np.int32), borrow=borrow)


def max_context(geo: dict, context_lens) -> int:
    """The longest context (from host tables), else the cache's capacity."""
    lens = _host_ints(context_lens)
    if lens is not None and len(lens):
        return int(lens.max())
    return geo["N_max"]


def keys_seen(context_lens, var: "DecodeVariants | None") -> np.ndarray | None:
    """The keys each sequence's query sees (its length less what the window and a host key_start
    hide), from host tables; None for device tables (not read back). A device key_start counts
    as hiding nothing."""
    lens = _host_ints(context_lens)
    if lens is None or not len(lens):
        return None
    lens = np.clip(lens.astype(np.int64).reshape(-1), 0, None)
    if var is None:
        return lens
    seen = var.keys_seen(lens)
    if isinstance(var.key_start, np.ndarray):
        seen = np.minimum(seen, lens - np.clip(var.key_start.astype(np.int64), 0, lens))
    return seen


def mean_keys_seen(context_lens, var: "DecodeVariants | None") -> float | None:
    """The mean over the batch of keys_seen; None for device tables."""
    seen = keys_seen(context_lens, var)
    return None if seen is None else float(seen.mean())


def decode(q, k_cache, v_cache, *, geo: dict, block_table, context_lens, scale: float, num_splits,
           device, params, return_lse: bool, variants=None, key_start=None, query_rows: int = 1, row_mask=None):
    """OpenCL path of flashcl.decode: shapes and dtypes already validated by flashcl.api.
    ``key_start``: int32 (B,) first keys (DecodeVariants.key_start), numpy or a pyopencl Array;
    ``query_rows`` / ``row_mask``: DecodeVariants' (prefill's few-row route)."""
    check_tables(geo, block_table, context_lens)
    if num_splits is not None and num_splits > MAX_FORCED_SPLITS:
        raise ValueError(f"num_splits={num_splits} is above {MAX_FORCED_SPLITS} (the merge keeps one "
                         f"weight per split in local memory)")
    is_cl = isinstance(q, cla.Array)
    stored = {name: (t.data if isinstance(t, QuantizedTensor) else t)  # the arrays that hold the bytes
              for name, t in (("k_cache", k_cache), ("v_cache", v_cache))}
    handle = handle_for_inputs({"q": q, **stored}, device)
    dtype = dtype_name(q)
    b, h_q, h_kv = geo["B"], geo["H_q"], geo["H_kv"]
    k_fmt, v_fmt = (_quant_format(t, name) for name, t in (("k_cache", k_cache), ("v_cache", v_cache)))
    prob = DecodeProblem(b, h_q, h_kv, geo["DK"], geo["DV"], geo["paged"], dtype, k_fmt, v_fmt)
    if isinstance(key_start, cla.Array):
        _int_to_device(key_start, handle.queue)  # its layout and byte order checked
    var = DecodeVariants.of(variants, prob, key_start, query_rows, row_mask)
    n_ctx = max_context(geo, context_lens)
    check_fits(handle, {"q": nbytes(q.shape, dtype),
                        **{name: nbytes(t.shape, dtype_name(t)) for name, t in stored.items()},
                        "out": nbytes((b, h_q, geo["DV"]), dtype),
                        "partial states": nbytes((b, h_q, num_splits or 1, geo["DV"] + 2), np.float32)})
    choice = choose_params(handle, prob, params, n_ctx)
    flags = var.flags() if var else {}
    kern = handle.reuse("decode", (prob, tuple(sorted(choice.params.items())), tuple(sorted(flags.items()))),
                        lambda: DecodeKernel(handle, prob, choice.params, variant_flags=flags))
    if num_splits is None:  # sized by the keys the queries see: a window or left padding reads fewer
        seen = keys_seen(context_lens, var)
        if seen is None:  # device tables: the bound's
            num_splits = kern.auto_splits(int(var.keys_seen(n_ctx)) if var else n_ctx)
        else:
            num_splits = kern.auto_splits(int(seen.max()), mean_ctx=float(seen.mean()))

    queue = handle.queue
    if is_cl:
        if q.strides[2] != q.dtype.itemsize:
            raise ValueError(f"q: a pyopencl Array needs a contiguous head dim, got strides {q.strides}")
        if not q.dtype.isnative:
            raise TypeError(f"q: a pyopencl Array of dtype {q.dtype.str} is not in the device's byte order")
        qd = q
    else:
        qd = host_buffer(queue, native_host(q), borrow=True)  # a call on host arrays waits for its results

    def operand(t):
        return (quantized_to_device(t, queue, borrow=not is_cl) if isinstance(t, QuantizedTensor)
                else to_device_4d(t, queue, 4, borrow=not is_cl))

    kd = operand(k_cache)
    vd = kd if v_cache is k_cache else operand(v_cache)  # two buffers over one array: undefined in OpenCL
    lens_d = _int_to_device(context_lens, queue, fill=geo["N_max"], shape=(b,), borrow=not is_cl)
    table_d = _int_to_device(block_table, queue, fill=0, shape=(1,), borrow=not is_cl) if geo["paged"] else lens_d
    empty = cla.empty if is_cl else HostBuffer.empty
    out = empty(queue, (b, h_q, geo["DV"]), q.dtype if is_cl else storage_dtype(dtype))
    lse = empty(queue, (b, h_q), np.float32)
    wait_for_inputs(queue, (q, *stored.values(), block_table, context_lens, key_start))
    if is_cl:
        events = kern(qd, kd, vd, out, lse, table_d, lens_d, scale, num_splits, variants=var)
        attach_events((out, lse), events[-1:])
        return (out, lse) if return_lse else out
    out_h, lse_h = launch_and_read(queue, lambda: kern(qd, kd, vd, out, lse, table_d, lens_d, scale, num_splits,
                                                       variants=var), out, lse)
    out_h, lse_h = host_result(out_h, q, dtype), host_result(lse_h, q, "float32")
    return (out_h, lse_h) if return_lse else out_h
