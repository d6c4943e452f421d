"""Host side of the OpenCL prefill kernel (clkernels/prefill.cl)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from .. import tuning
from ..quant import BLOCK_BYTES, QuantizedTensor, dtype_name
from ..reference import causal_mask, window_mask
from ..variants import DECODE_GROUP_ROWS, DECODE_ROWS, Variants, mask_block_map, mask_visible
from .arrays import (HostBuffer, attach_events, check_fits, elem_strides, handle_for_inputs, host_buffer,
                     host_result, host_to_device, host_view, launch_and_read, native_host, nbytes, row_bytes,
                     storage_defines, storage_dtype, to_device_4d, wait_for_inputs, QUANT_CODES)
from .runtime import DeviceHandle, build, check_variant, launch, probe_errors, spill_report

KERNEL = "prefill"
_LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class PrefillProblem:
    b: int
    h_q: int
    h_kv: int
    n_q: int
    n_kv: int
    dk: int
    dv: int
    causal: bool
    dtype: str  # "float32" | "float16" | "bfloat16"
    k_fmt: str | None = None  # quantized K cache format (QUANT_CODES), None: dtype rows
    v_fmt: str | None = None

    @property
    def flops(self) -> float:
        """4·B·H·N_q·N_kv·d' with d' = (DK + DV)/2; causal counts only the visible half."""
        f = 2.0 * self.b * self.h_q * self.n_q * self.n_kv * (self.dk + self.dv)
        if self.causal:
            # visible (query, key) pairs under bottom-right alignment, exactly
            offset = self.n_kv - self.n_q
            rows = np.arange(self.n_q)
            visible = np.clip(rows + offset + 1, 0, self.n_kv).sum()
            f *= visible / (self.n_q * self.n_kv)
        return f


def choose_params(handle: DeviceHandle, prob: PrefillProblem, params: dict | None = None) -> tuning.Choice:
    """User override, else the tuning database, else the profile default; always validated.
    Without an override the choice is kept on the handle (DeviceHandle.chosen) under what it
    depends on: the database's problem fields and length bucket, not the batch, heads or exact
    lengths (a server's prompts of every length hit it)."""
    if params is None:
        key = (KERNEL, prob.dtype, prob.dk, prob.dv, prob.causal, tuning.seq_bucket(max(prob.n_q, prob.n_kv)))
        return handle.chosen(key, lambda: _choose_params(handle, prob, None))
    return _choose_params(handle, prob, params)


def rows_for_short_queries(handle: DeviceHandle, prob: PrefillProblem, params: dict) -> dict:
    """The tiles a call runs: ``params``, but on a CPU device the rows layout's block shrunk to
    N_q's next power of two where N_q < BLOCK_M. A CPU runs the work-items one after another, each
    a query row, so a block computes all BLOCK_M rows whatever N_q is: a padded batch's decode
    step (N_q = 1 with a mask) took 13x a decode call (docs/notes/pocl-prefill.md)."""
    if not handle.is_cpu or params.get("VARIANT", "rows") != "rows" or prob.n_q >= params["BLOCK_M"]:
        return params
    return dict(params, BLOCK_M=1 << (prob.n_q - 1).bit_length())


def _choose_params(handle: DeviceHandle, prob: PrefillProblem, params: dict | None) -> tuning.Choice:
    def errors(p):
        return tuning.check_params(KERNEL, p, prob.dk, prob.dv, local_mem=handle.local_mem,
                                   max_work_group=handle.max_work_group) or probe_errors(handle, KERNEL, prob.dtype, p)

    if (params is not None and params.get("VARIANT", "rows") == "rows" and "VEC" not in params
            and {"BLOCK_N", "DV_TILE"} <= params.keys()):
        params = dict(params, VEC=tuning.widest_vec(params["BLOCK_N"], params["DV_TILE"], 4))
    check_variant(handle, KERNEL, prob.dtype, params or {})
    return tuning.resolve(
        KERNEL, handle, params, errors=errors, dtype=prob.dtype, dk=prob.dk, dv=prob.dv,
        causal=prob.causal, n=max(prob.n_q, prob.n_kv),
        default=lambda: tuning.default_params(KERNEL, handle.profile, prob.dk, prob.dv,
                                              local_mem=handle.local_mem,
                                              max_work_group=handle.max_work_group))


# The variant switches of prefill_common.h, by the name flashcl.variants.Variants.flags() gives.
_FLAG_DEFINES = {"window": "HAS_WINDOW", "softcap": "HAS_SOFTCAP", "sinks": "HAS_SINKS", "alibi": "HAS_ALIBI"}
_MASK_KINDS = {None: 0, "bool": 1, "add": 2}


def variant_defines(flags: dict | None) -> dict:
    """The ``-D`` defines of the variants that are on (``Variants.flags()``); none when all are
    off, so that the plain kernels build exactly as without variants."""
    if not flags:
        return {}
    unknown = set(flags) - set(_FLAG_DEFINES) - {"mask"}
    if unknown or flags.get("mask") not in _MASK_KINDS:
        raise ValueError(f"variant flags: unknown {sorted(unknown) or flags.get('mask')!r}; expected the "
                         f"keys of flashcl.variants.Variants.flags()")
    defines = {define: 1 for name, define in _FLAG_DEFINES.items() if flags.get(name)}
    if flags.get("mask"):
        defines["MASK_KIND"] = _MASK_KINDS[flags["mask"]]
    return defines


def program(prob: PrefillProblem, params: dict, *, write_lse: bool = True,
            unroll_loops: bool = True, flags: dict | None = None) -> tuple[str, str, dict]:
    """The source in clkernels/, the kernel's name and the ``-D`` defines of the prefill kernel for
    one problem class and parameter set: what PrefillKernel builds and `flashcl export` writes.
    ``unroll_loops``: off on CPUs (prefill_common.h: UNROLL_LOOPS; PoCL builds the loops rolled
    whatever it is). ``flags``: the variants compiled in (``Variants.flags()``; None or all off:
    the plain kernel)."""
    defines = {
        "HEAD_DK": prob.dk, "HEAD_DV": prob.dv, **storage_defines(prob.dtype),
        "IS_CAUSAL": prob.causal, "WRITE_LSE": write_lse,
        "BLOCK_M": params["BLOCK_M"], "BLOCK_N": params["BLOCK_N"], "DV_TILE": params["DV_TILE"],
        "UNROLL_LOOPS": unroll_loops, **variant_defines(flags),
        **{name: QUANT_CODES[fmt] for name, fmt in (("K_QUANT", prob.k_fmt), ("V_QUANT", prob.v_fmt)) if fmt},
    }
    if params.get("VARIANT", "rows") == "tiles":
        defines.update(TILE_M=params["TILE_M"], TILE_N=params["TILE_N"], UNROLL_K=params.get("UNROLL_K", 0))
        return "prefill_tiles.cl", "flash_prefill_tiles", defines
    defines.update(VEC=params["VEC"], Q_IN_REGS=params.get("Q_IN_REGS", 1))
    return "prefill.cl", "flash_prefill", defines


def launch_grid(prob: PrefillProblem, params: dict) -> tuple[tuple, tuple]:
    """(global, local) sizes: one dimension of B * H_q * query blocks * DV slices work-groups; the
    kernel maps a group to its tile (prefill_common.h: tile_of_group)."""
    wg = tuning.work_group_size(KERNEL, params)
    num_m = -(-prob.n_q // params["BLOCK_M"])
    num_dv = prob.dv // params["DV_TILE"]
    return (prob.b * prob.h_q * num_m * num_dv * wg, 1, 1), (wg, 1, 1)


def head_section(prob: PrefillProblem, cache_bytes: int) -> int:
    """(batch, head) pairs per launch-order section: whole GQA groups whose K/V together fit in
    ``cache_bytes`` of global-memory cache (at least one group). Any value >= 1 gives the same
    result; this one lets the work-groups in flight re-read K/V from the cache."""
    kv_bytes = max(1, prob.n_kv * (row_bytes(prob.k_fmt, prob.dk, prob.dtype)
                                   + row_bytes(prob.v_fmt, prob.dv, prob.dtype)))
    kv_heads = max(1, int(cache_bytes) // kv_bytes)
    return min(prob.b * prob.h_q, kv_heads * (prob.h_q // prob.h_kv))


# The arguments of flash_prefill and flash_prefill_tiles, in order: (name, OpenCL C type, meaning).
# store_t is float, or half when STORE_HALF. PrefillKernel.__call__ passes them in this order.
ARGS = (
    ("q", "__global const store_t *", "queries (B, H_q, N_q, DK): element (b, h, i, d) at "
                                      "q_off + b*q_sb + h*q_sh + i*q_sn + d"),
    ("k", "__global const store_t *", "keys (B, H_kv, N_kv, DK), addressed with k_off, k_sb, k_sh, k_sn; "
                                      "with K_QUANT its packed rows (kv_quant.h), addressed in bytes"),
    ("v", "__global const store_t *", "values (B, H_kv, N_kv, DV), addressed with v_off, v_sb, v_sh, v_sn; "
                                      "with V_QUANT its packed rows, addressed in bytes"),
    ("out", "__global store_t *", "output (B, H_q, N_q, DV), written; addressed with o_off, o_sb, o_sh, o_sn"),
    ("lse", "__global float *", "log-sum-exp (B, H_q, N_q), float32, contiguous, natural log; written "
                                "when WRITE_LSE is 1, else unused (pass any buffer); a row that sees no "
                                "key gets -inf"),
    ("n_q", "const int", "N_q, query rows per (batch, head)"),
    ("n_kv", "const int", "N_kv, keys per (batch, KV head); causal is bottom-right aligned: row i "
                          "sees keys j <= i + N_kv - N_q"),
    ("h_q", "const int", "H_q, query heads"),
    ("group", "const int", "H_q / H_kv, query heads per KV head (1 MHA, H_q MQA)"),
    ("head_section", "const int", "(batch, head) pairs per launch-order section, >= 1; every value "
                                  "gives the same result, flashcl passes min(B*H_q, max(1, "
                                  "CL_DEVICE_GLOBAL_MEM_CACHE_SIZE / (N_kv*(DK+DV)*sizeof(store_t))) "
                                  "* group) so that a section's K/V stay in the cache"),
    ("scale_log2", "const float", "softmax scale times log2(e); the scale is usually 1/sqrt(DK)"),
    *((f"{t}_{s}", "const ulong", f"{what}{' in elements' if s == 'off' else ' stride in elements'}")
      for t, name in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))
      for s, what in (("off", f"offset of {name}[0, 0, 0, 0]"), ("sb", f"{name} batch"),
                      ("sh", f"{name} head"), ("sn", f"{name} row"))),
    # the variants' values (prefill_common.h): always passed, read only where their flag is on
    ("win_left", "const int", "HAS_WINDOW: a row at position p = i + N_kv - N_q sees keys j >= p - "
                              "win_left (N_q + N_kv for unbounded)"),
    ("win_right", "const int", "HAS_WINDOW: ... and j <= p + win_right (N_q + N_kv for unbounded)"),
    ("softcap_log2", "const float", "HAS_SOFTCAP: softcap times log2(e)"),
    ("sinks", "__global const float *", "HAS_SINKS: (H_q,) float32 sink logits, natural log"),
    ("alibi", "__global const float *", "HAS_ALIBI: (B, H_q) float32 ALiBi slopes, natural log"),
    ("mask", "__global const mask_t *", "MASK_KIND 1 (mask_t uchar, 0 hides) or 2 (mask_t float, "
                                        "additive, -inf or any value <= MASK_HIDES_AT hides): (Bm, Hm, N_q, "
                                        "N_kv), Bm in {1, B}, Hm in {1, H_q}"),
    *((f"mask_{s}", "const ulong", f"MASK_KIND: mask {what} stride in elements (0 broadcasts)")
      for s, what in (("sb", "batch"), ("sh", "head"), ("sn", "row"))),
    ("tile_map", "__global const uchar *", "MASK_KIND: (Bm, Hm, ceil(N_q / BLOCK_M), ceil(N_kv / "
                                           "BLOCK_N)) uchar: 0 every key of the tile hidden (skipped), "
                                           "1 some hidden, 2 none hidden"),
    *((f"map_{s}", "const ulong", f"MASK_KIND: tile_map {what} stride in elements (0 broadcasts)")
      for s, what in (("sb", "batch"), ("sh", "head"))),
    # an int8 cache's row scales: always passed, read only where K_QUANT / V_QUANT is int8
    *((f"{t}_scales", "__global const float *", f"{t.upper()}_QUANT int8: one float32 scale per row of "
                                                 f"{t}, at [row's byte offset in {t} / D]")
      for t in ("k", "v")),
)


def mask_tile_map(mask: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """The kernels' tile_map of a 4-D mask: uint8 per (query block, key tile), 0 when every key
    is hidden (the tile is skipped), 1 when some is (guarded per key), 2 when none is."""
    visible = mask_visible(mask)
    if block_n % 8:
        some_visible = mask_block_map(visible, block_m, block_n)
        some_hidden = mask_block_map(~visible, block_m, block_n)  # padding counts as not hidden
        return (some_visible * (2 - some_hidden)).astype(np.uint8)
    # each row's keys as bits (block_n / 8 bytes a tile), OR-ed and AND-ed over a block's rows:
    # ~0.3 ms for a 2048 x 2048 mask, where the boolean reductions above take ~4.5
    bm, hm, n_q, n_kv = visible.shape
    tq, tk, nb = -(-n_q // block_m), -(-n_kv // block_n), block_n // 8
    bits = np.packbits(visible, axis=3)
    bits = np.pad(bits, ((0, 0), (0, 0), (0, 0), (0, tk * nb - bits.shape[3])))

    def over_rows(reduce, pad):  # rows past n_q: no key visible (OR), none hidden (AND)
        rows = np.pad(bits, ((0, 0), (0, 0), (0, tq * block_m - n_q), (0, 0)), constant_values=pad)
        return reduce(rows.reshape(bm, hm, tq, block_m, tk, nb), axis=3)

    full = np.packbits(np.arange(tk * block_n) < n_kv).reshape(tk, nb)  # keys past n_kv: not hidden
    some_visible = (over_rows(np.bitwise_or.reduce, 0) != 0).any(axis=4)
    none_hidden = (over_rows(np.bitwise_and.reduce, 0xFF) == full).all(axis=4)
    return np.where(some_visible, np.where(none_hidden, 2, 1), 0).astype(np.uint8)


def _broadcast_strides(shape: tuple) -> tuple[int, int]:
    """(batch, head) element strides of a contiguous (Bm, Hm, ...) array; 0 on a broadcast dim."""
    inner = int(np.prod(shape[2:]))
    return (shape[1] * inner if shape[0] > 1 else 0, inner if shape[1] > 1 else 0)


class PrefillKernel:
    """The prefill kernel built for one problem class and parameter set on one device.

    Two layouts (``params["VARIANT"]``): "rows" (clkernels/prefill.cl, the default: one query
    row per work-item, work-group = BLOCK_M) and "tiles" (clkernels/prefill_tiles.cl: TILE_M x
    TILE_N micro-tiles per work-item, work-group = (BLOCK_M / TILE_M) x (BLOCK_N / TILE_N))."""

    def __init__(self, handle: DeviceHandle, prob: PrefillProblem, params: dict, *,
                 write_lse: bool = True, verbose: bool = False, extra_options=(), flags: dict | None = None):
        self.handle, self.prob, self.params = handle, prob, dict(params)
        self.variant = params.get("VARIANT", "rows")
        self.flags = {k: v for k, v in (flags or {}).items() if v}  # the variants compiled in
        source, entry, self.defines = program(prob, params, write_lse=write_lse, unroll_loops=not handle.is_cpu,
                                              flags=self.flags)
        self.work_group = tuning.work_group_size(KERNEL, params)
        self.section = self.head_section()  # fixed by the problem class: one device query per kernel
        self.built = build(handle, source, self.defines, kernel=KERNEL, verbose=verbose,
                           extra_options=extra_options)
        self.kernel = self.built.kernel(entry)
        kwg = int(self.kernel.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, handle.device))
        if kwg < self.work_group:
            raise ValueError(f"params: a work-group of {self.work_group} exceeds this kernel's max "
                             f"work-group size {kwg} on {handle.name} (too many registers per "
                             f"work-item); use smaller tiles")

    @property
    def built_programs(self) -> tuple:
        return (self.built,)

    def spills(self) -> dict:
        return spill_report(self.built, self.kernel, self.handle)

    def grid(self) -> tuple[tuple, tuple]:
        """One dimension of B * H_q * query blocks * DV slices work-groups; the kernel maps a group
        to its tile (prefill_common.h: tile_of_group)."""
        return launch_grid(self.prob, self.params)

    def head_section(self) -> int:
        """(batch, head) pairs per launch-order section: whole GQA groups whose K/V together
        fit in the device's global-memory cache (at least one group), so that the work-groups in
        flight, which run every head of a section at once, re-read K/V from the cache."""
        return head_section(self.prob, int(self.handle.device.global_mem_cache_size))

    def __call__(self, q, k, v, out, lse, scale: float, wait_for=None, variants: Variants | None = None) -> cl.Event:
        """Enqueue on pyopencl Arrays (4-D, head dim contiguous); returns the kernel's event.
        ``variants`` (numpy arrays) must be those the kernel was built for (``flags``). A K or V
        the kernel was built quantized for (``prob.k_fmt`` / ``v_fmt``) is a QuantizedTensor of
        that format whose data (and int8 scales) are 4-D pyopencl Arrays (as quantize makes them)."""
        p = self.prob
        k_buf, k_addr, k_scales = _kv_operand("k", k, p.k_fmt, p.dk)
        v_buf, v_addr, v_scales = _kv_operand("v", v, p.v_fmt, p.dv)
        args = [q.base_data, k_buf, v_buf, out.base_data,
                lse.base_data if lse is not None else out.base_data,
                np.int32(p.n_q), np.int32(p.n_kv), np.int32(p.h_q), np.int32(p.h_q // p.h_kv),
                np.int32(self.section), np.float32(scale * _LOG2E)]
        args += _addressing(q) + k_addr + v_addr + _addressing(out)
        args += self.variant_args(variants, dummy=out.base_data)
        args += [out.base_data if sc is None else sc for sc in (k_scales, v_scales)]
        gsize, lsize = self.grid()
        return launch(self.handle, self.kernel, gsize, lsize, args, name=KERNEL, params=self.params)

    def variant_args(self, variants: Variants | None, dummy) -> list:
        """The trailing arguments of ARGS, from ``variants``; ``dummy`` (any buffer) stands for
        the arrays of the variants that are off, which the kernel never reads."""
        flags = {k: v for k, v in (variants.flags() if variants is not None else {}).items() if v}
        if flags != self.flags:
            raise ValueError(f"variants {flags} differ from those this kernel was built for {self.flags}")
        p, queue = self.prob, self.handle.queue
        unbounded = p.n_q + p.n_kv  # past any key from any row
        left, right = variants.window if variants is not None and variants.window is not None else (-1, -1)
        softcap = variants.softcap if variants is not None and variants.softcap is not None else 1.0

        def upload(x):
            return dummy if x is None else host_buffer(queue, np.ascontiguousarray(x)).base_data

        sinks = upload(None if variants is None else variants.sinks)
        alibi = upload(None if variants is None else variants.alibi_slopes)
        mask, map_ = dummy, dummy
        mask_strides, map_strides = (0, 0, 0), (0, 0)
        if variants is not None and variants.mask is not None:
            m = np.ascontiguousarray(variants.mask)
            tiles = mask_tile_map(m, self.params["BLOCK_M"], self.params["BLOCK_N"])
            mask = upload(m.view(np.uint8) if m.dtype == np.bool_ else m.astype(np.float32, copy=False))
            map_ = upload(tiles)
            mask_strides = (*_broadcast_strides(m.shape), p.n_kv)
            map_strides = _broadcast_strides(tiles.shape)
        return ([np.int32(unbounded if left < 0 else left), np.int32(unbounded if right < 0 else right),
                 np.float32(softcap * _LOG2E), sinks, alibi, mask]
                + [np.uint64(s) for s in mask_strides] + [map_] + [np.uint64(s) for s in map_strides])


def _addressing(arr: cla.Array) -> list:
    """An array's offset and (batch, head, row) strides, in its elements (bytes for uint8/int8)."""
    return [np.uint64(arr.offset // arr.dtype.itemsize)] + [np.uint64(s) for s in elem_strides(arr)[:3]]


def _kv_operand(name: str, x, fmt: str | None, d: int) -> tuple:
    """(buffer, addressing arguments, int8 scales buffer or None) of a K or V operand: a store_t
    Array when ``fmt`` is None, else a QuantizedTensor of ``fmt`` with pyopencl data, addressed in
    bytes. Refuses what the kernel would misread (kv_quant.h)."""
    if fmt is None:
        if isinstance(x, QuantizedTensor):
            raise ValueError(f"{name}: a {x.fmt} QuantizedTensor, but this kernel was built for a plain {name}")
        return x.base_data, _addressing(x), None
    if not isinstance(x, QuantizedTensor) or x.fmt != fmt or not isinstance(x.data, cla.Array):
        raise ValueError(f"{name}: this kernel was built for a {fmt} {name}: pass a QuantizedTensor of "
                         "that format with pyopencl data")
    data = x.data
    if fmt in BLOCK_BYTES:
        if data.ndim != 5 or data.strides[4] != 1 or (data.shape[3] > 1 and data.strides[3] != BLOCK_BYTES[fmt]):
            raise ValueError(f"{name}: a {fmt} cache (B, H_kv, N, D/32, {BLOCK_BYTES[fmt]}) needs the blocks "
                             f"of each row contiguous, got shape {data.shape} strides {data.strides}")
        if data.offset % 2 or any(s % 2 for s in data.strides[:3]):
            raise ValueError(f"{name}: a {fmt} cache needs even byte offset and strides (each block's fp16 d "
                             f"is read as a half), got offset {data.offset} strides {data.strides}")
        return data.base_data, _addressing(data), None
    scales = x.scales
    if data.ndim != 4 or (d > 1 and data.strides[3] != 1):
        raise ValueError(f"{name}: an int8 cache (B, H_kv, N, D) needs contiguous rows, got strides {data.strides}")
    # the kernel finds a row's scale at [its byte offset / D]: the scales must sit as the rows do
    lays_out = (isinstance(scales, cla.Array) and scales.offset * d == data.offset * 4
                and all(n < 2 or ss * d == ds * 4
                        for n, ss, ds in zip(data.shape[:3], scales.strides, data.strides)))
    if not lays_out:
        raise ValueError(f"{name}: int8 scales must be laid out like the rows (a row's scale at its byte "
                         "offset / D, as quantize makes them); pass contiguous data and scales")
    return data.base_data, _addressing(data), scales.base_data


def _quantized_to_device(qt: QuantizedTensor, queue, rank: int, *, borrow: bool = False) -> QuantizedTensor:
    """``qt`` with 4-D (B, H_kv, N, ...) data and int8 scales as pyopencl Arrays on ``queue``;
    pyopencl ones stay where they are. ggml scales live inside the data: not carried."""
    def dev(x):
        if isinstance(x, cla.Array):
            if rank == 3:
                if not x.flags.c_contiguous:
                    raise ValueError("a 3-D quantized pyopencl input must be C-contiguous (it is viewed as 4-D "
                                     "with B=1)")
                x = x.reshape(1, *x.shape)
            return x
        host = native_host(x)
        return host_to_device(queue, host[None] if rank == 3 else host, borrow=borrow)

    shape = (1, *qt.shape) if rank == 3 else tuple(qt.shape)
    return QuantizedTensor(dev(qt.data), dev(qt.scales) if qt.fmt == "int8" else None, qt.fmt, shape, qt.dtype)


def _arrays_of(name: str, x) -> dict:
    """The arrays an operand is held in: itself, or a QuantizedTensor's data and int8 scales."""
    if not isinstance(x, QuantizedTensor):
        return {name: x}
    return {f"{name}.data": x.data, **({f"{name}.scales": x.scales} if x.fmt == "int8" else {})}


def mask_key_start(mask: np.ndarray, b: int, *, causal: bool = False, window=None) -> np.ndarray | None:
    """The first key of each sequence, where a mask (Bm, Hm, N_q, N_kv) adds nothing to causal
    and the window (left, right) but that key (a left-padded batch's): every row of the sequence
    sees, of the keys the band (causal and the window) shows it, exactly those from that key on,
    the same in every head. int32 (B,), N_kv where no row sees a key. None for any other mask (a
    hole, rows or heads that differ, an additive value that neither is 0 nor hides)."""
    vis = mask_visible(mask)
    if mask.dtype != np.bool_ and not ((mask == 0) | ~vis).all():
        return None
    n_q, n_kv = vis.shape[-2:]
    band = window_mask(n_q, n_kv, window if window is not None else (-1, -1))  # bottom-right
    if causal:
        band &= causal_mask(n_q, n_kv)
    key = np.arange(n_kv)
    seen = vis & band
    # the earliest key a row sees is the start; the band's later edges cut the other rows
    start = np.where(seen.any(axis=-1), seen.argmax(axis=-1), n_kv).min(axis=-1)  # (Bm, Hm)
    if (start != start[:, :1]).any() or not (seen == ((key >= start[:, :, None, None]) & band)).all():
        return None
    return np.ascontiguousarray(np.broadcast_to(start[:, 0], (b,)), dtype=np.int32)


def mask_first_keys(mask: np.ndarray, b: int) -> np.ndarray:
    """int32 (B,): the first key any row of each sequence sees by a mask (Bm, Hm, N_q, N_kv), N_kv
    where none does: no row sees a key before it."""
    seen = mask_visible(mask).any(axis=(1, 2))  # (Bm, N_kv)
    first = np.where(seen.any(axis=-1), seen.argmax(axis=-1), mask.shape[-1])
    return np.ascontiguousarray(np.broadcast_to(first, (b,)), dtype=np.int32)


# The largest head dim a prefill of several rows runs as a decode: a CPU's as measured, a GPU's
# what its decode kernels take (the rows: every count decode takes, DECODE_ROWS, DECODE_GROUP_ROWS)
DECODE_HEAD_DIMS = {"cpu": 128, "gpu": 256}


def decode_head_dim(handle: DeviceHandle) -> int:
    """The largest head dim a prefill of several rows runs as a decode on this device."""
    return DECODE_HEAD_DIMS["cpu" if handle.is_cpu else "gpu"]


def _runs_as_decode(handle: DeviceHandle, prob: "PrefillProblem", rank: int, params, k, v, variants) -> bool:
    """Whether a prefill of few query rows may run as flashcl's decode (_prefill_rows_as_decode):
    the decode kernels stream a KV head's rows once for its whole group, every query row of it,
    split over the keys, where the prefill kernels give each query head's few rows one work-group
    that streams every key alone (docs/notes/pocl-prefill.md; on GPUs
    docs/notes/opencl-decode-nvidia.md, "Few query rows as a decode"). One row takes every
    variant; more rows (DECODE_ROWS, DECODE_GROUP_ROWS, decode_head_dim) a window or ALiBi only
    when causal (QUERY_ROWS puts each row at its own position), on a CPU only where the decode
    runs decode_cpu.cl. A mask the caller turns into first keys (mask_key_start) or, on causal
    rows, reads per row (ROW_MASK). The tiles chosen by flashcl, quantized K/V only as 4-D caches."""
    if not (params is None and (rank == 4 or not any(isinstance(x, QuantizedTensor) for x in (k, v)))):
        return False
    if prob.n_q == 1:
        return True
    if (prob.n_q > DECODE_ROWS or prob.h_q // prob.h_kv * prob.n_q > DECODE_GROUP_ROWS
            or max(prob.dk, prob.dv) > decode_head_dim(handle)):
        return False
    if variants is not None and not prob.causal and (variants.window is not None
                                                     or variants.alibi_slopes is not None):
        return False
    if not handle.is_cpu:
        return True
    from . import decode as cl_decode

    rows = cl_decode.DecodeProblem(prob.b, prob.h_q * prob.n_q, prob.h_kv, prob.dk, prob.dv, False, prob.dtype,
                                   prob.k_fmt, prob.v_fmt)
    return cl_decode.is_rows(cl_decode.choose_params(handle, rows, None, prob.n_kv).params)


def _prefill_rows_as_decode(q, k, v, *, rank: int, shapes, causal: bool, scale: float, device, return_lse: bool,
                            variants, key_start, row_mask=None):
    """prefill of N_q query rows as the decode of the same keys, each query head's rows heads of its
    KV head's group: q (.., H_q, N_q, DK) as (B, H_q N_q, DK), K/V as a contiguous cache (rank 3
    with B = 1), causal rows as QUERY_ROWS (row i sees the keys before N_kv - (N_q - 1 - i), as
    prefill's bottom-right causal), the sinks repeated per row, a left-padding mask as each
    sequence's first key (``key_start``, from mask_key_start; None: no mask), any other mask
    read per row in the kernel (``row_mask``, ROW_MASK). The last row sits at N_kv - 1 in both
    and row i at N_kv - N_q + i, where QUERY_ROWS puts its window and ALiBi distances; the ALiBi
    slopes are repeated per row like the sinks."""
    from .decode import decode

    (b, h_q, n_q, dk), (_, h_kv, n_kv, _), (_, _, _, dv) = shapes
    geo = {"B": b, "H_q": h_q * n_q, "H_kv": h_kv, "DK": dk, "DV": dv, "paged": False, "block_size": None,
           "num_blocks": None, "N_max": n_kv}
    k4 = k if rank == 4 else k.reshape(1, *k.shape)
    v4 = k4 if v is k else v if rank == 4 else v.reshape(1, *v.shape)  # one array, one buffer
    q3 = q.reshape(b, h_q * n_q, dk)
    if not isinstance(q, cla.Array) and any(_overlap(q, x) for x in (k, v)):  # a second buffer over K/V's memory
        q3 = q3.copy() if isinstance(q3, np.ndarray) else q3.clone()
    if variants is not None:
        variants = replace(variants, mask=None).per_row(n_q)
    out, lse = decode(q3, k4, v4, geo=geo, block_table=None, context_lens=None, scale=scale, num_splits=None,
                      device=device, params=None, return_lse=True, variants=variants, key_start=key_start,
                      query_rows=n_q if causal and n_q > 1 else 1,
                      row_mask=row_mask)
    return _rows_result(out, lse, rank, shapes, return_lse)


def _rows_result(out, lse, rank: int, shapes, return_lse: bool):
    """A decode route's out (and lse) viewed as prefill returns them: (.., H_q, N_q, DV)."""
    (b, h_q, n_q, _), _, (_, _, _, dv) = shapes
    lead = (b,) if rank == 4 else ()
    out = out.reshape(*lead, h_q, n_q, dv)
    return (out, lse.reshape(*lead, h_q, n_q)) if return_lse else out


def _overlap(a, b) -> bool:
    """Whether host arrays ``a`` and ``b`` (numpy, torch CPU, or a QuantizedTensor's data) may share
    memory (their address ranges meet; no copy is made to tell)."""
    a, b = (x.data if isinstance(x, QuantizedTensor) else x for x in (a, b))
    return np.may_share_memory(host_view(a), host_view(b))


def _packs_group(handle: DeviceHandle, n_q: int, h_q: int, h_kv: int, is_cl: bool, params, variants) -> bool:
    """Whether a call runs its GQA group's query heads as the rows of one head (N_q = 1 with a
    mask that is not a left padding: those run as a decode). On a CPU each query head's
    work-group staged its KV head's tiles again; as rows of one block the group stages them once.
    Only where the rows' results do not depend on their positions or heads: one query row, no
    window, sinks or ALiBi (per head), host arrays, the tiles chosen by flashcl."""
    return (handle.is_cpu and n_q == 1 and h_q > h_kv and not is_cl and params is None
            and (variants is None or (variants.window is None and variants.sinks is None
                                      and variants.alibi_slopes is None)))


def _prefill_group_as_rows(q, k, v, *, rank: int, shapes, scale: float, device, return_lse: bool, variants):
    """prefill of one query row per head with each GQA group's heads as the rows of its KV head:
    q (.., H_q, 1, DK) viewed as (.., H_kv, group, DK), a mask's (Bm, H_q or 1, 1, N_kv) as
    (Bm, H_kv or 1, group, N_kv); causal off (one row at the bottom sees every key either way)."""
    (b, h_q, _, dk), (_, h_kv, n_kv, _), vs = shapes
    group = h_q // h_kv
    packed = (b, h_kv, group, dk)
    if variants is not None and variants.mask is not None:
        m = variants.mask
        m = (np.broadcast_to(m, (m.shape[0], 1, group, n_kv)) if m.shape[1] == 1
             else m.reshape(m.shape[0], h_kv, group, n_kv))
        variants = replace(variants, mask=m)
    res = prefill(q.reshape(packed[1:] if rank == 3 else packed), k, v, rank=rank, shapes=(packed, shapes[1], vs),
                  causal=False, scale=scale, device=device, params=None, return_lse=return_lse, variants=variants)
    out, lse = res if return_lse else (res, None)
    return _rows_result(out, lse, rank, shapes, return_lse)


def prefill(q, k, v, *, rank: int, shapes, causal: bool, scale: float, device, params,
            return_lse: bool, variants=None):
    """OpenCL path of flashcl.prefill: inputs already validated by flashcl.api. k and/or v may be
    QuantizedTensors in QUANT_CODES' formats (kind and dtype checked by the API)."""
    (b, h_q, n_q, dk), (_, h_kv, n_kv, _), (_, _, _, dv) = shapes
    is_cl = isinstance(q, cla.Array)
    inputs = {"q": q, **_arrays_of("k", k), **_arrays_of("v", v)}
    handle = handle_for_inputs(inputs, device)
    dtype = dtype_name(q)
    k_fmt, v_fmt = (x.fmt if isinstance(x, QuantizedTensor) else None for x in (k, v))
    for name, fmt in (("k", k_fmt), ("v", v_fmt)):
        if fmt is not None and fmt not in QUANT_CODES:
            raise TypeError(f"{name}: the OpenCL prefill kernels read {', '.join(QUANT_CODES)} caches, got {fmt!r}")
    # before the routes below, so that an input too large is named as prefill names it
    check_fits(handle, {"q": nbytes(shapes[0], dtype), "k": b * h_kv * n_kv * row_bytes(k_fmt, dk, dtype),
                        "v": b * h_kv * n_kv * row_bytes(v_fmt, dv, dtype), "out": nbytes((b, h_q, n_q, dv), dtype),
                        "lse": nbytes((b, h_q, n_q), np.float32) if return_lse else 0})
    prob = PrefillProblem(b, h_q, h_kv, n_q, n_kv, dk, dv, causal, dtype, k_fmt, v_fmt)
    # device arrays: q, and rank-3 K/V, viewed with new shapes (a view only where contiguous)
    views = all(x.flags.c_contiguous for x in (q, *((k, v) if rank == 3 else ())) if isinstance(x, cla.Array))
    if views and _runs_as_decode(handle, prob, rank, params, k, v, variants):
        mask = None if variants is None else variants.mask
        starts = None if mask is None else mask_key_start(mask, b, causal=causal, window=variants.window)
        if mask is None or starts is not None:
            return _prefill_rows_as_decode(q, k, v, rank=rank, shapes=shapes, causal=causal, scale=scale,
                                           device=device, return_lse=return_lse, variants=variants,
                                           key_start=starts)
        # any other mask read per row (its keys before every row's first skipped): causal rows, or
        # one row on a GPU (a CPU runs one row's mask as its GQA group's rows: _packs_group)
        if (n_q > 1 and causal) or (n_q == 1 and not handle.is_cpu):
            return _prefill_rows_as_decode(q, k, v, rank=rank, shapes=shapes, causal=causal, scale=scale,
                                           device=device, return_lse=return_lse, variants=variants,
                                           key_start=mask_first_keys(mask, b), row_mask=mask)
    if _packs_group(handle, n_q, h_q, h_kv, is_cl, params, variants):
        return _prefill_group_as_rows(q, k, v, rank=rank, shapes=shapes, scale=scale, device=device,
                                      return_lse=return_lse, variants=variants)
    choice = choose_params(handle, prob, params)
    tiles = choice.params if params is not None else rows_for_short_queries(handle, prob, choice.params)
    flags = variants.flags() if variants is not None else {}
    kern = handle.reuse("prefill", (prob, tuple(sorted(tiles.items())), tuple(sorted(flags.items())),
                                    bool(return_lse)),
                        lambda: PrefillKernel(handle, prob, tiles, write_lse=return_lse, flags=flags))

    queue = handle.queue
    # a call on host arrays waits for its results (launch_and_read): its inputs' buffers may be
    # their memory, one buffer per array (two buffers over one array are undefined in OpenCL)
    def operand(t, fmt):
        return (to_device_4d(t, queue, rank, borrow=not is_cl) if fmt is None
                else _quantized_to_device(t, queue, rank, borrow=not is_cl))

    qd = operand(q, None)
    kd = qd if k is q else operand(k, k_fmt)
    vd = qd if v is q else kd if v is k else operand(v, v_fmt)
    empty = cla.empty if is_cl else HostBuffer.empty
    out = empty(queue, (b, h_q, n_q, dv), q.dtype if is_cl else storage_dtype(dtype))
    lse = empty(queue, (b, h_q, n_q), np.float32) if return_lse else None
    wait_for_inputs(queue, list(inputs.values()))
    if is_cl:
        event = kern(qd, kd, vd, out, lse, scale, variants=variants)
        if rank == 3:
            out = out.reshape(h_q, n_q, dv)
            lse = lse.reshape(h_q, n_q) if lse is not None else None
        attach_events((out, lse), [event])
        return (out, lse) if return_lse else out
    out_h, lse_h = launch_and_read(queue, lambda: kern(qd, kd, vd, out, lse, scale, variants=variants), out, lse)
    if rank == 3:
        out_h = out_h.reshape(h_q, n_q, dv)
        lse_h = lse_h.reshape(h_q, n_q) if lse_h is not None else None
    out_h = host_result(out_h, q, dtype)
    lse_h = host_result(lse_h, q, "float32") if lse_h is not None else None
    return (out_h, lse_h) if return_lse else out_h
