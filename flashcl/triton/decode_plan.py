"""The launch plan of the Triton decode (``decode.py``): for one decode problem on one device, the
kernel that runs it, its tile, its split count and how the splits are merged.

    plan(DecodeProblem(b, h_q, h_kv, dk, dv, n_ctx_bound, elt_bytes, page_size), facts) -> DecodePlan
        kernel: "dot" | "mha_fma" | "gluon_mha" | "gluon_gqa"     merge: "none" | "fused" | "reduce"

``plan`` is a pure function of the problem's shapes (never the context lengths: the launch does
no host sync and is CUDA-graph capturable) and of the device's facts (``DeviceFacts``: SMs, shared
memory per block, compute capability, whether Triton interprets, whether it has Gluon).
``facts_of(device)`` is the one place that asks a device; the rest is plain Python, so the plan of
any device can be computed anywhere.

Each rule states its reason; the measurements behind them are in docs/notes/decode-h100.md,
section "The launch plan's rules" (H100, fp16, d = 128, paged blocks of 16 unless it says otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from . import FLOAT32_DOTS, interpreting

# --------------------------------------------------------------------------- the records


@dataclass(frozen=True)
class DeviceFacts:
    """What the plan knows of a device. ``smem_per_block``: the shared memory one block may opt in
    to, in bytes (0: unknown, the default tile only); ``interpreting``: the kernels run in Triton's
    interpreter; ``gluon``: this Triton has Gluon (decode_gluon's kernels; facts written by hand,
    for a device elsewhere, assume it)."""
    sms: int
    smem_per_block: int
    capability: tuple[int, int]
    interpreting: bool = False
    gluon: bool = True
    name: str = ""


@dataclass(frozen=True)
class DecodeProblem:
    """The shapes of one decode launch: B sequences, H_q query heads over H_kv KV heads, head dims
    DK and DV, contexts of at most ``n_ctx_bound`` tokens (max_blocks * page_size, or a contiguous
    cache's N_max), K/V elements of ``elt_bytes``; ``page_size``: the paged cache's block size, 0
    for a contiguous cache; ``max_offset``: the largest element offset of K or V from its start.
    ``variants``: the attention variants on (sorted names of VARIANTS); ``window_left``: the
    sliding window's left extent (-1: none), so that the split count follows the keys a query
    sees, not the bound. With quantized K/V (``kv_formats``) ``elt_bytes`` is q's: the kernel
    dequantizes into q's type before the dot."""
    b: int
    h_q: int
    h_kv: int
    dk: int
    dv: int
    n_ctx_bound: int
    elt_bytes: int
    page_size: int = 16
    max_offset: int = 0
    variants: tuple = ()
    window_left: int = -1
    kv_formats: tuple = ("", "")  # K's and V's quantized formats (flashcl.quant), "" for plain
    q_dtype: str = "float16"  # q's torch dtype name: the GQA kernel reads quantized caches for fp16 / bf16 q
    query_rows: int = 1  # > 1: the heads are causal query rows (the kernels' QUERY_ROWS)
    row_mask: bool = False  # the rows' own mask (prefill's; the dot path's ROW_MASK)
    # the 32-bit words every row of ggml K and V starts on (4, 2, 1; 0: off a 4-byte boundary):
    # stored order needs one (stored_order), its loads take that width
    ggml_row_words: int = 1

    @property
    def quantized(self) -> bool:
        return any(self.kv_formats)

    @property
    def rows_differ(self) -> bool:
        """Whether the heads are query rows that see different keys (the kernels' QUERY_ROWS, ROW_MASK)."""
        return self.query_rows > 1 or self.row_mask

    @property
    def n_ctx_seen(self) -> int:
        """The most keys one program's queries see: the bound, or the window's (left + the rows)."""
        return self.n_ctx_bound if self.window_left < 0 else min(self.n_ctx_bound, self.window_left + self.query_rows)


KERNELS = ("dot", "mha_fma", "gluon_mha", "gluon_gqa")
# The attention variants decode takes (flashcl.variants, and decode's key_start); the Triton
# kernel ("dot", "mha_fma"), the merges and decode_gluon's GQA kernel take them all, its MHA kernel
# none: an MHA launch with any variant on is planned as on a device without Gluon (a documented
# kernel choice, never a dropped variant).
VARIANTS = ("alibi", "key_start", "sinks", "softcap", "window")
# Quantized K/V (flashcl.quant) run on the dot path (no MHA loop) over whole pages, each K/V tile
# dequantized after its load: the formats the kernel reads. The Gluon GQA kernel also reads the
# formats GQA_QUANTIZED with fp16 q (gqa_reads), under its own rule (gqa_takes).
QUANTIZED = ("q8_0", "q4_0", "int8", "fp8_e4m3")
GQA_QUANTIZED = ("int8", "fp8_e4m3", "q8_0", "q4_0")
MERGES = ("none", "fused", "reduce")


@dataclass(frozen=True)
class DecodePlan:
    """How one decode problem is launched (see ``plan``).

    kernel: "dot" (decode's Triton kernel, tl.dot on the group padded to ``block_g`` rows),
    "mha_fma" (its MHA loop on CUDA cores), "gluon_mha" or "gluon_gqa" (decode_gluon's kernels;
    where the tensors do not fit them, ``decode_gluon.operands_fit``, the launch runs the Triton
    kernel instead: the MHA loop, the dot path). merge: "none" (one split), "fused" (the last
    split program of each (b, h_kv) merges), "reduce" (decode's _reduce_kernel, ``reduce_heads``
    query heads and ``reduce_chunk`` splits per step). ``num_stages``, ``block_g``, the page
    flags and ``kv_evict`` are what the Triton kernel is launched with; ``pdl`` is what the device
    runs (``config["pdl"]`` the request). ``config``: the tile and every knob of ``_KNOBS``, resolved.
    """
    problem: DecodeProblem
    kernel: str
    merge: str
    num_splits: int
    auto_splits: int
    block_n: int
    num_warps: int
    num_stages: int
    block_g: int
    block_dk: int
    block_dv: int
    pdl: bool
    early_pages: bool
    whole_pages: bool   # tiles of whole pages (BLOCK_N a multiple of the page size)
    page_tiles: bool    # tiles inside one page (pages larger than BLOCK_N)
    offs32: bool        # 32-bit row offsets into the pages
    kv_evict: str       # the MHA loop's in-loop K/V loads: "evict_first" or ""
    merge_stages: int   # the fused merge's pipeline depth
    block_gm: int       # the fused merge's padded group
    reduce_heads: int
    reduce_chunk: int
    evict_first: bool   # the Gluon kernels' K/V loads marked L1::evict_first
    sort_pages: bool    # the Gluon kernels sort long splits' pages
    gqa_registers: int  # the Gluon GQA kernel's register cap (gqa_registers), 0: none
    stored_order: bool  # the dot path, where it runs, reads ggml K and V in stored order (rows allowing)
    config: Mapping = field(hash=False)

    @property
    def mha_loop(self) -> bool:
        """The Triton kernel, where it runs, runs its MHA loop (MHA_FMA)."""
        return self.kernel in ("mha_fma", "gluon_mha")

    def serves(self, problem: DecodeProblem) -> bool:
        """Whether this plan may launch ``problem``: the same shapes, 32-bit offsets only where its
        caches allow them (a plan made for larger caches is safe), stored order only on rows that
        lie on 4-byte boundaries."""
        same = replace(self.problem, max_offset=problem.max_offset, ggml_row_words=problem.ggml_row_words) == problem
        return (same and (not self.offs32 or problem.max_offset < _OFFS32_LIMIT)
                and (not self.stored_order or problem.ggml_row_words >= 1))


# --------------------------------------------------------------------------- the device's facts

# Triton's interpreter on the host: any small SM count exercises the split path; no shared memory
# is known, so the tile stays the default
_HOST_SMS = 4


def facts_of(device) -> DeviceFacts:
    """The facts of a torch device (a ``torch.device`` or its name), queried once per CUDA device;
    whether Triton interprets is read at each call (TRITON_INTERPRET)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return _host_facts(device.type, interpreting())
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_facts(index, interpreting())


@functools.lru_cache(maxsize=None)
def _host_facts(kind: str, interp: bool) -> DeviceFacts:
    return DeviceFacts(sms=_HOST_SMS, smem_per_block=0, capability=(0, 0), interpreting=interp, gluon=False,
                       name=kind)


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int, interp: bool) -> DeviceFacts:
    import torch

    from . import decode_gluon

    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
    return DeviceFacts(sms=props.multi_processor_count, smem_per_block=int(smem),
                       capability=(props.major, props.minor), interpreting=interp,
                       gluon=decode_gluon.gluon is not None, name=props.name)


def gluon_runs(facts: DeviceFacts) -> bool:
    """decode_gluon's kernels compile and run: a Triton with Gluon, not interpreting, a CUDA device
    of compute capability 8.0 or newer."""
    return facts.gluon and not facts.interpreting and tuple(facts.capability) >= (8, 0)


def pdl_runs(facts: DeviceFacts) -> bool:
    """Programmatic dependent launch: sm_90 or newer, not interpreting."""
    return not facts.interpreting and tuple(facts.capability) >= (9, 0)


# --------------------------------------------------------------------------- the knobs

# Launch knobs, keys of ``config`` next to BLOCK_N / num_warps / num_stages. None: chosen by the
# plan; benchmarks force True / False. decode.py's docstring says what each does.
_KNOBS = {
    # the split partition from the context bound, not context_lens: the first block-table load
    # need not wait for the length
    "early_pages": True,
    # the last split program of each (b, h_kv) merges the partials (no _reduce_kernel launch)
    "fused_reduce": None,
    # programmatic dependent launch (sm_90+, ignored elsewhere): hides the next kernel's launch
    "pdl": None,
    # software-pipeline depth of the fused merge's loop over the splits
    "merge_stages": 3,
    # paged KV whose tiles hold whole pages: in-page offsets hoisted, 32-bit offsets, no row mask
    "whole_pages": True,
    # MHA over whole pages on CUDA cores with register double buffering (None: _mha_fma_pays)
    "mha_fma": None,
    # the MHA loop's launches that gluon_takes allows run as decode_gluon's kernel
    "gluon_mha": True,
    # the MHA loops' and the GQA kernel's in-loop K/V loads marked L1::evict_first: each row is
    # read once ("The L1 hint and the page sort")
    "kv_evict_first": True,
    # GQA of head dim 128 as decode_gluon's GQA kernel (None: gqa_takes at its own split count;
    # True: wherever it can run, at the dot path's count)
    "gluon_gqa": None,
    # the GQA kernel's programs per SM (its split count and register cap; None: GQA_PROGRAMS_PER_SM)
    "gqa_programs_per_sm": None,
    # the Gluon kernels visit the pages of splits of 256 to 1024 pages in address order
    "sort_pages": True,
    # q4_0 (and q8_0 under float32 q) K and V read in stored order where their rows allow
    # (ggml_stored); off: the byte gather
    "ggml_stored": True,
}
_TILE_KEYS = ("BLOCK_N", "num_warps", "num_stages")
GQA_MAX_PROGRAMS_PER_SM = 4  # 128 registers a thread (gqa_registers); fewer spill every build


def check_knobs(overrides: Mapping) -> None:
    """KeyError for a name that is not a knob, ValueError for a value the knob does not take: the
    ones whose default is None take None (the plan's choice), True or False; merge_stages an
    integer >= 1; gqa_programs_per_sm None or 1 .. GQA_MAX_PROGRAMS_PER_SM; the others a bool."""
    unknown = set(overrides) - set(_KNOBS)
    if unknown:
        raise KeyError(f"unknown decode knobs {sorted(unknown)}; expected some of {sorted(_KNOBS)}")
    for key, value in overrides.items():
        if key == "merge_stages":
            ok, want = type(value) is int and value >= 1, "an integer >= 1"
        elif key == "gqa_programs_per_sm":
            ok = value is None or (type(value) is int and 1 <= value <= GQA_MAX_PROGRAMS_PER_SM)
            want = f"none or 1 .. {GQA_MAX_PROGRAMS_PER_SM}"
        elif _KNOBS[key] is None:
            ok, want = value is None or type(value) is bool, "none, true or false"
        else:
            ok, want = type(value) is bool, "true or false"
        if not ok:
            raise ValueError(f"decode knob {key}: expected {want}, got {value!r}")


@contextlib.contextmanager
def knob_defaults(overrides: Mapping):
    """The plans made inside take ``overrides`` in place of _KNOBS' defaults: what a benchmark's
    knob comparison needs of calls that take no config (decode's op). Process-wide while it lasts:
    not for concurrent callers. Names and values are checked first (check_knobs)."""
    check_knobs(overrides)
    saved = dict(_KNOBS)
    _KNOBS.update(overrides)
    try:
        yield
    finally:
        _KNOBS.clear()
        _KNOBS.update(saved)


_OFFS32_LIMIT = 2**31  # caches whose every element lies below this offset use 32-bit row offsets


def _auto_knobs(num_splits: int) -> dict:
    """fused_reduce for 2..4 splits (beyond, one program merging every split serially costs more
    than a second kernel); pdl from 2 splits (with one it costs 3-10%): "Fused reduce and PDL"."""
    return {"fused_reduce": 2 <= num_splits <= 4, "pdl": num_splits >= 2}


# --------------------------------------------------------------------------- the dot path's tile

# Shared memory the K/V software pipeline may take per program: num_stages - 1 K+V tiles in flight.
# 72 KiB fits sm_89 (99 KiB per block), three programs per sm_90 SM and two per sm_80 one; the
# depth moved TB/s by under 3% ("The pipeline budget").
_SMEM_BUDGET = 72 * 1024
_NUM_STAGES = 3
_NUM_WARPS = 4  # GQA groups of 2 to 4 run the default tile on 2 (_two_warps_pay)
# float32 (tf32x3 dots): at d = 128 64 rows on 2 stages led ten tiles at (1, 32/8, 32k) (3 stages: 22%
# slower); at d = 256 16 rows on 3, the 2-byte rule's tile, led ("float32 K/V")
_FP32_STAGES = 2


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_config(elt_bytes: int, block_dk: int, block_dv: int, quantized: bool = False) -> dict:
    """BLOCK_N, num_warps, num_stages: the largest KV tile (<= 64 rows) whose pipeline fits the
    budget; 64 KiB of K+V in flight per program at d = 128 is far above what HBM needs per SM
    (Little's law: ~3 TB/s x ~1 us / 132 SMs ~ 23 KB). Plain 4-byte K/V of heads padded to 128
    keep their rows on a shorter ring (_FP32_STAGES)."""
    block_n = 64
    fp32_ring = elt_bytes == 4 and not quantized and max(block_dk, block_dv) == 128
    stages = _FP32_STAGES if fp32_ring else _NUM_STAGES
    while block_n > 16 and (stages - 1) * block_n * (block_dk + block_dv) * elt_bytes > _SMEM_BUDGET:
        block_n //= 2
    return {"BLOCK_N": block_n, "num_warps": _NUM_WARPS, "num_stages": stages}


# The long tile: where a program has its SM to itself and streams a long split, 128 rows on 8 warps
# keep twice the bytes in flight; on short splits, or with more than one program per SM, it loses
# ("The long tile").
_LONG_TILE = {"BLOCK_N": 128, "num_warps": 8}
_LONG_SPLIT = 4096          # tokens per split from which a one-wave grid takes the long tile
_SMEM_HEADROOM = 24 * 1024  # Q, P and layout-conversion scratch next to the K/V ring (<= 20 KB seen)


def _long_tile_fits(smem_per_block: int, elt_bytes: int, block_dk: int, block_dv: int) -> bool:
    return _ring_fits(_LONG_TILE["BLOCK_N"], smem_per_block, elt_bytes, block_dk, block_dv)


def _long_tile_pays(n_ctx: int, splits: int, smem_per_block: int, elt_bytes: int, block_dk: int,
                    block_dv: int) -> bool:
    """Splits of at least _LONG_SPLIT tokens, heads padded to 128 or more, and a ring that fits:
    where a one-wave grid takes _LONG_TILE."""
    return (max(block_dk, block_dv) >= 128 and _cdiv(n_ctx, splits) >= _LONG_SPLIT
            and _long_tile_fits(smem_per_block, elt_bytes, block_dk, block_dv))


def _ring_fits(block_n: int, smem_per_block: int, elt_bytes: int, block_dk: int, block_dv: int) -> bool:
    ring = (_NUM_STAGES - 1) * block_n * (block_dk + block_dv) * elt_bytes
    return ring + _SMEM_HEADROOM <= smem_per_block


# Tile rows for heads below 128: 64 rows of d = 32 keep a quarter of the bytes in flight of d = 128,
# so rows double until a K+V tile holds _TILE_BYTES (_TILE_BYTES_ALONE where a program has its SM
# to itself), within _MAX_ROWS and the device's shared memory ("Small-head rows").
_TILE_BYTES = 16 * 1024
_TILE_BYTES_ALONE = 32 * 1024
_MAX_ROWS = 256
_SMALL_HEAD_MAX_GROUP = 16  # larger groups (MQA-sized) keep the default rows: measured no better


def _small_head_rows(block_n: int, dk: int, dv: int, elt_bytes: int, block_dk: int, block_dv: int,
                     alone: bool, smem_per_block: int) -> int:
    if max(dk, dv) >= 128:
        return block_n  # measured at d = 128 and above with the default tile
    target = _TILE_BYTES_ALONE if alone else _TILE_BYTES
    while (block_n < _MAX_ROWS and block_n * (dk + dv) * elt_bytes < target
           and _ring_fits(2 * block_n, smem_per_block, elt_bytes, block_dk, block_dv)):
        block_n *= 2
    return block_n


def _two_warps_pay(group: int, elt_bytes: int, block_dk: int, block_dv: int) -> bool:
    """The dot path's 64-row tile on 2 warps instead of 4 for GQA groups of 2 to 4, 2-byte K/V,
    head dims 128: fewer warps split the score tile's row max and sum, which cross warps through
    shared memory behind barriers ("Two warps for small groups")."""
    return 2 <= group <= 4 and elt_bytes == 2 and block_dk == block_dv == 128


# --------------------------------------------------------------------------- splits

_MIN_FILL = 0.75            # below this fraction of the SMs busy, take one more split
_MIN_TILES_PER_SPLIT = 4    # a split streams >= 4 KV tiles (256 tokens), or the reduce dominates
_MAX_SPLITS = 128
# A sliding window's few keys make a latency-bound launch: splits of one tile finish sooner than
# splits of four (H100, (1, 32/8, 32k), window 1023: 16 splits 6.8 us, 4 splits 9.3 us)
_MIN_TILES_PER_WINDOW_SPLIT = 1


def choose_num_splits(sm_count: int, batch_heads: int, n_ctx_bound: int, block_n: int,
                      min_tiles: int = _MIN_TILES_PER_SPLIT) -> int:
    """Split-k count from shapes only (never the context_lens values): the largest count with
    B * H_kv * splits <= SMs (one program streams enough for its SM; a program past the SM count
    is a second wave), one more if a quarter of the SMs would idle ("The split count"); each
    split streams at least ``min_tiles`` tiles."""
    if batch_heads >= sm_count:
        return 1
    n_tiles = _cdiv(n_ctx_bound, block_n)
    max_splits = max(1, min(_MAX_SPLITS, n_tiles // min_tiles))
    splits = sm_count // batch_heads
    if batch_heads * splits < _MIN_FILL * sm_count:
        splits += 1
    return max(1, min(max_splits, splits))


def _two_programs_per_sm(group: int, block_n: int, block_dk: int, block_dv: int, elt_bytes: int) -> bool:
    """A split launch aims at two programs per SM for groups of 17 to 32 whose tile holds under
    _TILE_BYTES_ALONE of K+V (heads up to 64 in 2-byte types): one such program keeps too few bytes
    in flight to stream for its SM alone ("Two programs per SM"); and for 4-byte K/V, whose
    dots a second program overlaps (32-33 splits 82 us at (1, 32/8, 32k), 16: 116; "float32 K/V")."""
    return elt_bytes == 4 or (_SMALL_HEAD_MAX_GROUP < group <= 32
                              and block_n * (block_dk + block_dv) * elt_bytes < _TILE_BYTES_ALONE)


# Quantized caches: programs per SM their split launches aim at (_dequant_programs_per_sm), and
# their tiles (_dequant_tile). Dequantizing programs are latency bound: more, smaller programs hide
# it (int8 / fp8 read as words, q8_0 as byte pairs or stored order, q4_0 in stored order).
_WORD_TILE = {"BLOCK_N": 64, "num_warps": 2}
_GGML_TILES = {"q8_0": _WORD_TILE, "q4_0": {"BLOCK_N": 32, "num_warps": 2}}


_ROWS_FOUR_WARPS = 64  # padded group rows from which a quantized few-row launch takes _QUANT_ROWS_TILE
_QUANT_ROWS_TILE = {"BLOCK_N": 64, "num_warps": 4}


# q8_0 under float32 q, in stored order: 128 rows on 4 warps, 2 stages, two programs per SM (H200,
# (1, 32/8, 32k / 128k): 91 / 329 us against 127 / 453 on the 64-row 2-warp tile at four per SM)
_Q8_0_STORED_TILE = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}


def q_in_parts(q_dtype: str) -> bool:
    """Whether q enters the dots against quantized values as three bf16 parts (quant_words.dot):
    float32 q with tf32x3 dots."""
    return q_dtype == "float32" and FLOAT32_DOTS == "tf32x3"


# Stacked rows (blocks x group rows) the stored-order path takes: at 16 (d = 128, groups to 4) the
# sm_90 compile spills nothing; at 32 it spills 320-928 bytes (not timed); at 64 and more it spills
# kilobytes and needs up to 120 KB of shared memory, past sm_89's 99 KB: those take the byte gather.
MAX_STACKED_ROWS = 32


def stacked_rows(group: int, dk: int, dv: int) -> int:
    """Rows of one stacked block in stored order (ggml_stored; the kernel's BLOCK_G): the group
    padded so that blocks x rows >= 16 (tl.dot's least)."""
    rows = 1 << max(0, group - 1).bit_length()
    return max(rows, 16 // (min(dk, dv) // 32))


def stored_order(problem: DecodeProblem, on: bool = True) -> bool:
    """Whether the dot path reads K and V in stored order (ggml_stored): q4_0 of head dim 64, 128
    or 256, or q8_0 of head dim 128 under float32 q (q_in_parts: its values exact in bf16), on
    both sides; rows on 4-byte boundaries; one query row a head; at most MAX_STACKED_ROWS stacked
    rows. ``on``: the ggml_stored knob. (q8_0 at d = 64 ran 1.3x slower this way than by its
    gather; 256 is not measured.)"""
    p = problem
    parts = q_in_parts(p.q_dtype)

    def takes(fmt: str, d: int) -> bool:
        return (fmt == "q4_0" and d in (64, 128, 256)) or (fmt == "q8_0" and parts and d == 128)

    return (on and not p.rows_differ and p.ggml_row_words >= 1 and takes(p.kv_formats[0], p.dk)
            and takes(p.kv_formats[1], p.dv)
            and stacked_rows(p.h_q // p.h_kv, p.dk, p.dv) * max(p.dk, p.dv) // 32 <= MAX_STACKED_ROWS)


def _dequant_programs_per_sm(problem: DecodeProblem, tile: Optional[dict]) -> int:
    """The programs per SM a quantized split launch aims at on its ``tile`` (_dequant_tile; None
    where the config sets it): 4, 2 on _Q8_0_STORED_TILE (1 plain). One program dequantizing its
    tiles does not stream enough for its SM; four on the small tiles beat two on the larger (H200,
    (1, 32/8, 32k / 128k): q8_0 on 66 splits 52 / 177 us, on 33 81 / 293; q4_0 79 / 272 against
    126 / 458; int8 34.2 / 101.4 against 128 rows on 4 warps and 33 splits 34.4 / 109.1):
    docs/notes/quantized-decode.md."""
    if tile is _Q8_0_STORED_TILE:
        return 2
    return 4 if problem.quantized else 1


def _dequant_tile(problem: DecodeProblem, stored: bool) -> Optional[dict]:
    """The tile of a quantized launch: _Q8_0_STORED_TILE for q8_0 in stored order, a ggml cache's
    (q8_0's where both kinds are there), else _WORD_TILE for int8 / fp8 (_dequant_programs_per_sm);
    None plain."""
    p = problem
    if stored and "q8_0" in p.kv_formats and max(p.dk, p.dv) <= 128:  # with q4_0 at 256: not measured
        return _Q8_0_STORED_TILE
    formats = {f for f in problem.kv_formats if f}
    for fmt in _GGML_TILES:
        if fmt in formats:
            return _GGML_TILES[fmt]
    return _WORD_TILE if formats else None


# The reduce kernel: HEADS adjacent query heads per program, CHUNK_S splits merged per step (one
# round trip to memory each); four heads per program beat one or two ("The reduce kernel").
_REDUCE_HEADS = 4            # query heads per reduce program (fewer for many splits: _reduce_shape)
_REDUCE_TILE = 8192          # HEADS x CHUNK_S x BLOCK_DV fp32 values per step: 64 per thread on 4 warps


def _reduce_step(block_dv: int, heads: int) -> int:
    """Splits the reduce kernel merges per step with ``heads`` query heads per program: 16 at
    d = 128, 32 at d = 64 with 4 heads; each step more costs about 1.4 us."""
    return max(1, _REDUCE_TILE // (heads * block_dv))


def _reduce_shape(num_splits: int, block_dv: int) -> tuple[int, int]:
    """(query heads per reduce program, splits per step): _REDUCE_HEADS heads, halved (down to one)
    until one step merges every split: one round trip to memory instead of several."""
    heads = _REDUCE_HEADS
    while heads > 1 and num_splits > _reduce_step(block_dv, heads):
        heads //= 2
    return heads, min(_next_pow2(num_splits), _reduce_step(block_dv, heads))


# --------------------------------------------------------------------------- the MHA loops


def _mha_fma_pays(group: int, elt_bytes: int, block_dk: int, block_dv: int, programs: int, sms: int,
                  gluon: bool) -> bool:
    """MHA takes the CUDA-core loop with 2-byte K/V and more programs than SMs (two share an SM,
    each computing one tile while the next loads), head dims padded to 128 (wider ones spill), and
    up to 64 where the Gluon kernel runs it (``gluon``) ("The MHA loop: where it pays")."""
    return (group == 1 and elt_bytes == 2 and programs > sms
            and (block_dk == block_dv == 128 or (gluon and block_dk == block_dv <= 64)))


# The Gluon MHA kernel's tiles: padded head dim -> (rows, warps) for grids of at most two programs
# per SM, then for larger ones (gluon_tile). A row is BLOCK_D // 8 lanes of 8 columns.
_TILES = {128: ((64, 4), (64, 4)), 64: ((128, 8), (64, 4)), 32: ((128, 8), (128, 4))}


def gluon_block_d(d: int) -> int:
    """The Gluon kernels' padded head dim: 32, 64 or 128 (or more, which they do not take)."""
    return max(32, 1 << (d - 1).bit_length())


def gluon_takes(dk: int, dv: int, elt_bytes: int, num_splits: int, facts: DeviceFacts) -> bool:
    """Whether the Gluon MHA kernel can run a launch: one split, 2-byte K/V, DK == DV <= 128, on a
    device where gluon_runs."""
    return num_splits == 1 and elt_bytes == 2 and dk == dv and gluon_block_d(dk) in _TILES and gluon_runs(facts)


def gluon_tile(d: int, programs: int, sms: int) -> tuple[int, int]:
    """(rows, warps) of the Gluon MHA kernel for head dim ``d``: 32 KB of K+V per program up to two
    programs per SM; past that, a smaller tile, which costs less than a second wave ("The Gluon
    MHA kernel's tiles")."""
    wide, narrow = _TILES[gluon_block_d(d)]
    return wide if programs <= 2 * sms else narrow


# The Gluon GQA kernel takes groups GQA_GROUPS whose grid holds GQA_MIN_PROGRAMS_PER_SM programs
# per SM or more and whose splits are GQA_MIN_CONTEXT tokens or longer, at its own split count of
# two programs per SM (GQA_PROGRAMS_PER_SM: gqa_splits); measured faster than the
# dot path only there ("The Gluon GQA rule").
GQA_GROUPS = range(4, 9)
GQA_MIN_CONTEXT = 1024
GQA_MIN_PROGRAMS_PER_SM = 1.5


def gqa_splits(batch_heads: int, sms: int, per_sm: int = 2) -> int:
    """The GQA kernel's split count: the largest power of two that keeps the grid within two
    programs per SM (one split where B * H_kv alone fills that); for any other ``per_sm``
    (gqa_programs_per_sm), the largest count within that many."""
    if per_sm != 2:
        return max(1, per_sm * sms // batch_heads)
    splits = 1
    while batch_heads * (2 * splits) <= 2 * sms:  # twice the splits still within two per SM
        splits *= 2
    return splits


# Programs of the GQA kernel (4 warps) an SM holds, by (K, V) format (others: 2), at 168 registers
# for 3 (gqa_registers). Each warp keeps its next tiles in registers: more programs, more bytes in
# flight; fp16 and q8_0 measured best at 2 (docs/notes/quantized-decode.md, "Keys as the mma's rows").
GQA_PROGRAMS_PER_SM = {(fmt, fmt): 3 for fmt in ("int8", "fp8_e4m3", "q4_0")}


def gqa_programs_per_sm(kv_formats: tuple) -> int:
    """The GQA kernel's programs per SM for these K/V formats (GQA_PROGRAMS_PER_SM, else 2)."""
    return GQA_PROGRAMS_PER_SM.get(tuple(kv_formats), 2)


def gqa_registers(per_sm: int) -> int:
    """The register cap that lets ``per_sm`` programs of 128 threads share an SM's 65536 registers
    (in ptxas's units of 8); 0 (none) for two."""
    return 0 if per_sm <= 2 else 65536 // (128 * per_sm) // 8 * 8


def gqa_reads(kv_formats: tuple, q_dtype: str, facts: DeviceFacts) -> bool:
    """Whether the GQA kernel reads caches of these formats: plain, or GQA_QUANTIZED with fp16 or
    bf16 q (its byte permutes give fp16 values; a bf16 q enters their mma in fp16, scaled per row
    by a power of two: exact), fp8_e4m3 on sm_89 or newer (its convert instruction)."""
    formats = set(kv_formats) - {""}
    if not formats:
        return True
    return (formats <= set(GQA_QUANTIZED) and q_dtype in ("float16", "bfloat16")
            and ("fp8_e4m3" not in formats or tuple(facts.capability) >= (8, 9)))


def gqa_takes(group: int, dk: int, dv: int, elt_bytes: int, num_splits: int, programs: int,
              n_ctx_bound: int, facts: DeviceFacts, forced: bool = False) -> bool:
    """Whether the GQA kernel runs a launch of ``programs`` = B * H_kv programs per split: head dims
    128, 2-byte K/V, groups of 2 to 16, on a device where gluon_runs; unless ``forced``, only where
    it measured faster than the dot path (GQA_GROUPS, GQA_MIN_PROGRAMS_PER_SM, GQA_MIN_CONTEXT)."""
    if not (elt_bytes == 2 and dk == dv == 128 and 2 <= group <= 16 and gluon_runs(facts)):
        return False
    return forced or (group in GQA_GROUPS and n_ctx_bound >= GQA_MIN_CONTEXT * num_splits
                      and programs * num_splits >= GQA_MIN_PROGRAMS_PER_SM * facts.sms)


# Quantized caches (GQA_QUANTIZED) also go to the Gluon GQA kernel on grids of at most half an SM
# count of (sequence, KV head) programs, groups GQA_QUANTIZED_GROUPS, at any context: splits of
# GQA_QUANTIZED_MIN_SPLIT tokens or more up to its own count. There the dot path ran 1.1-3.5x
# slower (H200; docs/notes/quantized-decode.md, "Short contexts and small groups").
GQA_QUANTIZED_GROUPS = range(2, 9)
GQA_QUANTIZED_MIN_SPLIT = 128


def gqa_takes_quantized(group: int, dk: int, dv: int, elt_bytes: int, programs: int, facts: DeviceFacts) -> bool:
    """Whether the GQA kernel takes a quantized launch of ``programs`` = B * H_kv programs per
    split whatever its context (gqa_takes' own rule covers the long ones)."""
    return (group in GQA_QUANTIZED_GROUPS and 2 * programs <= facts.sms
            and gqa_takes(group, dk, dv, elt_bytes, 1, programs, 0, facts, forced=True))


def gqa_quantized_splits(programs: int, n_ctx: int, sms: int, per_sm: int) -> int:
    """The split count of such a launch: the kernel's own (gqa_splits), at most one split per
    GQA_QUANTIZED_MIN_SPLIT tokens of the context."""
    return max(1, min(gqa_splits(programs, sms, per_sm), n_ctx // GQA_QUANTIZED_MIN_SPLIT))


# --------------------------------------------------------------------------- the plan


@functools.lru_cache(maxsize=1024)
def planned(problem: DecodeProblem, facts: DeviceFacts, num_splits: int = 0) -> DecodePlan:
    """``plan`` without a config, kept: a serving loop's problem (a paged cache of fixed size)
    repeats every step, and planning costs the host ~12 us a call."""
    return plan(problem, facts, None, num_splits)


def plan(problem: DecodeProblem, facts: DeviceFacts, config: Optional[Mapping] = None,
         num_splits: int = 0) -> DecodePlan:
    """The launch plan of ``problem`` on a device of ``facts``. ``config`` keys override the
    defaults (the tile, ``_KNOBS``; an unknown key is a KeyError); ``num_splits`` > 0 overrides the
    automatic split count (the automatic knobs then follow the given count).

    Unless the config sets the tile: a grid of at most one program per SM whose splits are at least
    _LONG_SPLIT tokens and whose heads pad to 128 or more takes _LONG_TILE where shared memory holds
    it; the dot path's default tile takes more rows for heads below 128 (_small_head_rows) and runs
    on 2 warps where _two_warps_pay; MHA takes the Gluon kernel's tile where it runs; quantized
    caches take _dequant_tile. The automatic split count aims at two programs per SM where
    _two_programs_per_sm, at _dequant_programs_per_sm with quantized caches, and at the GQA
    kernel's own count (gqa_splits, at gqa_programs_per_sm) where that kernel takes the launch
    (its rule judged at two programs per SM; quantized caches also where gqa_takes_quantized, at
    gqa_quantized_splits)."""
    p = problem
    unknown = set(p.variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown decode variants {sorted(unknown)}; expected a subset of {VARIANTS}")
    bad = set(p.kv_formats) - set(QUANTIZED) - {""}
    if bad:
        raise ValueError(f"unknown quantized K/V formats {sorted(bad)}; expected one of {QUANTIZED}")
    # decode_gluon's GQA kernel reads GQA_QUANTIZED caches and takes every variant; its MHA kernel
    # reads plain caches and takes no variant (mha_facts)
    if not gqa_reads(p.kv_formats, p.q_dtype, facts) or p.row_mask:  # a row mask: the dot path's
        facts = replace(facts, gluon=False)
    mha_facts = replace(facts, gluon=False) if p.variants or p.rows_differ else facts
    n_ctx = p.n_ctx_seen  # the keys a program streams drive the split count and the tile
    group = p.h_q // p.h_kv
    paged = p.page_size > 0
    block_dk, block_dv = max(16, _next_pow2(p.dk)), max(16, _next_pow2(p.dv))
    cfg = {**_tile_config(p.elt_bytes, block_dk, block_dv, p.quantized), **_KNOBS, **(config or {})}
    unknown = set(cfg) - set(_KNOBS) - set(_TILE_KEYS)
    if unknown:
        raise KeyError(f"unknown decode config keys {sorted(unknown)}")
    check_knobs({k: v for k, v in (config or {}).items() if k in _KNOBS})
    if p.quantized or p.rows_differ:
        # quantized K/V and query rows: not the MHA loop (the dot path's loads dequantize, QUANTIZED)
        cfg.update(mha_fma=False)
    sms = facts.sms
    programs = p.b * p.h_kv  # per split
    min_tiles = _MIN_TILES_PER_SPLIT if p.window_left < 0 else _MIN_TILES_PER_WINDOW_SPLIT
    auto_splits = choose_num_splits(sms, programs, n_ctx, cfg["BLOCK_N"], min_tiles)
    tile_forced = bool(set(config or {}) & set(_TILE_KEYS))
    stored = stored_order(p, cfg["ggml_stored"])
    dequant_tile = None if tile_forced else _dequant_tile(p, stored)
    rows = dequant_tile["BLOCK_N"] if dequant_tile else cfg["BLOCK_N"]
    per_sm = _dequant_programs_per_sm(p, dequant_tile)
    # two programs per SM at a power of two for query rows (prefill's few-row route) and for a
    # contiguous cache's 2-warp tile whose splits are too short for the long tile: 32 splits of
    # (1, 32/8, 32k) ran 14-17% faster than 16, 33 as slowly as 16 (triton-prefill.md, decode-h100.md)
    short_two_warp_splits = (auto_splits > 1 and not paged and not tile_forced and dequant_tile is None
                             and p.window_left < 0 and p.dk == p.dv == 128 and programs >= 8
                             and _two_warps_pay(group, p.elt_bytes, block_dk, block_dv)
                             and not _long_tile_pays(n_ctx, auto_splits, facts.smem_per_block, p.elt_bytes,
                                                     block_dk, block_dv))
    if auto_splits > 1 and (p.rows_differ or short_two_warp_splits
                            or _two_programs_per_sm(group, cfg["BLOCK_N"], block_dk, block_dv, p.elt_bytes)):
        per_sm = max(per_sm, 2)
    if auto_splits > 1 and per_sm > 1:
        one_per_sm = auto_splits
        auto_splits = choose_num_splits(per_sm * sms, programs, n_ctx, rows, min_tiles)
        if p.rows_differ or short_two_warp_splits:
            auto_splits = 1 << (auto_splits.bit_length() - 1)
        if short_two_warp_splits:  # a count capped by the keys stays as it was, not rounded below
            auto_splits = max(auto_splits, one_per_sm)
    splits = num_splits if num_splits > 0 else auto_splits

    # the Gluon GQA kernel: forced, wherever it can run; by default where its rule takes the launch
    # (judged at two programs per SM), at its own split count (gqa_programs_per_sm) or the one given.
    # Groups past 8 take the mma's 16 columns: their builds hold more than 168 registers
    gqa_per_sm = cfg["gqa_programs_per_sm"] or (gqa_programs_per_sm(p.kv_formats) if group <= 8 else 2)
    gluon_gqa = False
    if cfg["gluon_gqa"] is not False and not tile_forced and paged:
        if cfg["gluon_gqa"] is True:
            gluon_gqa = gqa_takes(group, p.dk, p.dv, p.elt_bytes, splits, programs, n_ctx, facts, forced=True)
        else:
            g_splits = num_splits if num_splits > 0 else gqa_splits(programs, sms)
            if gqa_takes(group, p.dk, p.dv, p.elt_bytes, g_splits, programs, n_ctx, facts):
                own = gqa_splits(programs, sms, gqa_per_sm)
                gluon_gqa, splits = True, g_splits if num_splits > 0 else own
            elif p.quantized and gqa_takes_quantized(group, p.dk, p.dv, p.elt_bytes, programs, facts):
                own = gqa_quantized_splits(programs, n_ctx, sms, gqa_per_sm)
                gluon_gqa, splits = True, num_splits if num_splits > 0 else own

    alone = programs * splits <= sms  # at most one program per SM
    quant_tile = dequant_tile is not None
    if quant_tile:
        cfg.update(dequant_tile)
        # a prefill's rows padded to 64 a KV head dequantizing on 2 warps: 64 keys on 4 (H200, (1,
        # 32/8, 16, 32k): q8_0 160 -> 84 us, int8 170 -> 98, q4_0 155 -> 89; triton-prefill.md)
        if p.query_rows > 1 and _next_pow2(group) >= _ROWS_FOUR_WARPS:
            cfg.update(_QUANT_ROWS_TILE)
    long_tile = (not tile_forced and not quant_tile and alone
                 and _long_tile_pays(n_ctx, splits, facts.smem_per_block, p.elt_bytes, block_dk, block_dv))
    if long_tile:
        cfg.update(_LONG_TILE)
    for key, on in _auto_knobs(splits).items():
        cfg[key] = on if cfg[key] is None else bool(cfg[key])
    if gluon_gqa:
        cfg["fused_reduce"] = False  # the GQA kernel's splits are merged by the reduce kernel

    # the MHA loop: on where it pays, on the Gluon kernel's tile where that kernel can take it
    g_tile = None
    if cfg["mha_fma"] is None:
        if (not tile_forced and cfg["gluon_mha"] and paged
                and gluon_takes(p.dk, p.dv, p.elt_bytes, splits, mha_facts)):
            g_tile = gluon_tile(p.dv, programs * splits, sms)
            if g_tile[0] % p.page_size:
                g_tile = None  # not whole pages
        cfg["mha_fma"] = _mha_fma_pays(group, p.elt_bytes, block_dk, block_dv, programs * splits, sms,
                                       g_tile is not None)
    cfg["early_pages"] = bool(cfg["early_pages"])
    cfg["whole_pages"] = bool(cfg["whole_pages"])
    # the MHA loop reads tiles of whole pages (blocks larger than its tile take the dot path)
    mha_rows = g_tile[0] if g_tile else cfg["BLOCK_N"]
    cfg["mha_fma"] = bool(cfg["mha_fma"]) and group == 1 and paged and mha_rows % p.page_size == 0
    default_tile = not (tile_forced or long_tile or quant_tile or cfg["mha_fma"])  # the dot path's, not set by the config
    if default_tile and group <= _SMALL_HEAD_MAX_GROUP:
        cfg["BLOCK_N"] = _small_head_rows(cfg["BLOCK_N"], p.dk, p.dv, p.elt_bytes, block_dk, block_dv, alone,
                                          facts.smem_per_block)
    if default_tile and cfg["BLOCK_N"] == 64 and _two_warps_pay(group, p.elt_bytes, block_dk, block_dv):
        cfg["num_warps"] = 2
    if cfg["mha_fma"] and g_tile:
        cfg["BLOCK_N"], cfg["num_warps"] = g_tile
    cfg["gluon_gqa"] = gluon_gqa
    # the register cap only where the grid needs more than two programs per SM, for as many as it needs
    need = min(gqa_per_sm, _cdiv(programs * splits, sms))

    # what runs: the page addressing (paged, whole_pages and early_pages), then the kernel
    on_pages = paged and cfg["whole_pages"] and cfg["early_pages"]
    whole = on_pages and cfg["BLOCK_N"] % p.page_size == 0  # else a tile lies inside one page
    offs32 = on_pages and p.max_offset < _OFFS32_LIMIT
    kernel = "dot"
    if whole and cfg["mha_fma"]:
        kernel = "mha_fma"
        if (offs32 and cfg["gluon_mha"] and gluon_takes(p.dk, p.dv, p.elt_bytes, splits, mha_facts)
                and (cfg["BLOCK_N"], cfg["num_warps"]) in _TILES[gluon_block_d(p.dk)]):
            kernel = "gluon_mha"
    elif cfg["gluon_gqa"] and offs32:
        kernel = "gluon_gqa"
    mha_loop = kernel in ("mha_fma", "gluon_mha")
    merge = "none" if splits == 1 else "fused" if cfg["fused_reduce"] else "reduce"
    reduce_heads, reduce_chunk = _reduce_shape(splits, block_dv) if merge == "reduce" else (0, 0)
    return DecodePlan(
        problem=p, kernel=kernel, merge=merge, num_splits=splits, auto_splits=auto_splits,
        block_n=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
        num_stages=1 if mha_loop else cfg["num_stages"],  # the MHA loop's next tile waits in registers
        block_g=1 if mha_loop else max(16, _next_pow2(group)),  # tl.dot needs 16 rows; the loop none
        block_dk=block_dk, block_dv=block_dv,
        pdl=cfg["pdl"] and pdl_runs(facts),
        early_pages=cfg["early_pages"], whole_pages=whole, page_tiles=on_pages and not whole, offs32=offs32,
        kv_evict="evict_first" if mha_loop and cfg["kv_evict_first"] else "",
        merge_stages=int(cfg["merge_stages"]), block_gm=_next_pow2(group),
        reduce_heads=reduce_heads, reduce_chunk=reduce_chunk,
        evict_first=bool(cfg["kv_evict_first"]), sort_pages=bool(cfg["sort_pages"]),
        gqa_registers=gqa_registers(need) if gluon_gqa else 0, stored_order=stored,
        config=types.MappingProxyType(cfg))
