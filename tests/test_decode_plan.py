"""The Triton decode's launch plan (flashcl.triton.decode_plan): a pure function of the problem's
shapes and the device's facts, checked here as data on the facts of an H100, an H200, an A100, an
L4 and Triton's interpreter, with no device, no torch and no patching.

The table gives, for the reference shapes at d = 128, fp16, paged blocks of 16, the kernel, the
split count, the merge and the tile each device gets; the properties hold for every plan of a
matrix of shapes; the rule tests pin each rule where it was measured (docs/notes/decode-h100.md,
"The launch plan's rules").
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace

import pytest

from flashcl.triton import decode_plan as dp
from flashcl.triton.decode_plan import DecodeProblem, DeviceFacts, plan

H100 = DeviceFacts(sms=132, smem_per_block=227 * 1024, capability=(9, 0), name="H100")
H200 = DeviceFacts(sms=132, smem_per_block=227 * 1024, capability=(9, 0), name="H200")
A100 = DeviceFacts(sms=108, smem_per_block=163 * 1024, capability=(8, 0), name="A100")
L4 = DeviceFacts(sms=58, smem_per_block=99 * 1024, capability=(8, 9), name="L4")
# Triton's interpreter on the host (decode_plan.facts_of of a CPU device under TRITON_INTERPRET=1)
INTERPRETER = DeviceFacts(sms=4, smem_per_block=0, capability=(0, 0), interpreting=True, gluon=False, name="cpu")
DEVICES = {"H100": H100, "H200": H200, "A100": A100, "L4": L4}

REFERENCE = [(8, 32, 32, 2048), (8, 32, 32, 8192), (8, 32, 8, 2048), (32, 32, 8, 2048), (4, 64, 8, 2048),
             (8, 64, 8, 2048), (16, 32, 1, 4096), (1, 32, 8, 32768), (1, 32, 8, 131072)]

# device -> (B, H_q, H_kv, ctx) -> (kernel, splits, merge, BLOCK_N, num_warps) at d = 128, fp16, block 16
PLANS = {
    "H100": {
        (8, 32, 32, 2048): ("gluon_mha", 1, "none", 64, 4),
        (8, 32, 32, 8192): ("gluon_mha", 1, "none", 64, 4),
        (8, 32, 8, 2048): ("dot", 2, "fused", 64, 2),
        (32, 32, 8, 2048): ("gluon_gqa", 1, "none", 64, 2),
        (4, 64, 8, 2048): ("dot", 4, "fused", 64, 4),
        (8, 64, 8, 2048): ("dot", 2, "fused", 64, 4),
        (16, 32, 1, 4096): ("dot", 8, "reduce", 64, 4),
        (1, 32, 8, 32768): ("gluon_gqa", 32, "reduce", 64, 2),
        (1, 32, 8, 131072): ("gluon_gqa", 32, "reduce", 64, 2),
    },
    "A100": {  # 108 SMs: fewer splits; the GQA kernel's 16 splits at 32k leave it under 1.5 programs per SM
        (8, 32, 32, 2048): ("gluon_mha", 1, "none", 64, 4),
        (8, 32, 32, 8192): ("gluon_mha", 1, "none", 64, 4),
        (8, 32, 8, 2048): ("dot", 2, "fused", 64, 2),
        (32, 32, 8, 2048): ("gluon_gqa", 1, "none", 64, 2),
        (4, 64, 8, 2048): ("dot", 3, "fused", 64, 4),
        (8, 64, 8, 2048): ("dot", 2, "fused", 64, 4),
        (16, 32, 1, 4096): ("dot", 6, "reduce", 64, 4),
        (1, 32, 8, 32768): ("dot", 13, "reduce", 64, 2),
        (1, 32, 8, 131072): ("dot", 13, "reduce", 128, 8),  # the long tile: 163 KiB hold its ring
    },
    "L4": {  # 58 SMs; 99 KiB of shared memory: no long tile
        (8, 32, 32, 2048): ("gluon_mha", 1, "none", 64, 4),
        (8, 32, 32, 8192): ("gluon_mha", 1, "none", 64, 4),
        (8, 32, 8, 2048): ("dot", 1, "none", 64, 2),
        (32, 32, 8, 2048): ("gluon_gqa", 1, "none", 64, 2),
        (4, 64, 8, 2048): ("dot", 2, "fused", 64, 4),
        (8, 64, 8, 2048): ("dot", 1, "none", 64, 4),
        (16, 32, 1, 4096): ("dot", 3, "fused", 64, 4),
        (1, 32, 8, 32768): ("dot", 7, "reduce", 64, 2),
        (1, 32, 8, 131072): ("dot", 7, "reduce", 64, 2),
    },
}
PLANS["H200"] = PLANS["H100"]  # the same SMs, shared memory and capability: the same plans
# 4 "SMs": every reference shape fills them unsplit; no Gluon: MHA on the Triton kernel's loop
PLANS["interpreter"] = {
    (8, 32, 32, 2048): ("mha_fma", 1, "none", 64, 4),
    (8, 32, 32, 8192): ("mha_fma", 1, "none", 64, 4),
    (8, 32, 8, 2048): ("dot", 1, "none", 64, 2),
    (32, 32, 8, 2048): ("dot", 1, "none", 64, 2),
    (4, 64, 8, 2048): ("dot", 1, "none", 64, 4),
    (8, 64, 8, 2048): ("dot", 1, "none", 64, 4),
    (16, 32, 1, 4096): ("dot", 1, "none", 64, 4),
    (1, 32, 8, 32768): ("dot", 1, "none", 64, 2),
    (1, 32, 8, 131072): ("dot", 1, "none", 64, 2),
}


def problem(b, h_q, h_kv, ctx, d=128, dv=None, elt=2, page=16):
    return DecodeProblem(b, h_q, h_kv, d, dv or d, ctx, elt, page)


# --------------------------------------------------------------------------- the table


@pytest.mark.parametrize("device", list(PLANS))
def test_reference_plans(device):
    """Kernel, split count, merge and tile of the reference shapes on each device's facts."""
    facts = {**DEVICES, "interpreter": INTERPRETER}[device]
    got = {}
    for shape in REFERENCE:
        p = plan(problem(*shape), facts)
        got[shape] = (p.kernel, p.num_splits, p.merge, p.block_n, p.num_warps)
    assert got == PLANS[device]


@pytest.mark.parametrize("device", list(PLANS))
def test_reference_plans_launch_fields(device):
    """What the table implies for the launch: the MHA loops run without a ring on one query row,
    the dot path on the group padded to 16 rows or more; PDL wherever a split launch runs on
    sm_90; the reduce kernel merges 2 or 4 heads per program, every split in one step."""
    facts = {**DEVICES, "interpreter": INTERPRETER}[device]
    for shape in REFERENCE:
        p = plan(problem(*shape), facts)
        group = shape[1] // shape[2]
        assert (p.num_stages, p.block_g) == ((1, 1) if p.mha_loop else (3, max(16, group))), shape
        assert p.block_dk == p.block_dv == 128 and p.early_pages and p.whole_pages and p.offs32
        assert p.pdl is (p.num_splits > 1 and facts.capability >= (9, 0) and not facts.interpreting), shape
        if p.merge == "reduce":
            assert p.reduce_heads in (2, 4) and p.reduce_chunk >= p.num_splits, shape
        else:
            assert (p.reduce_heads, p.reduce_chunk) == (0, 0)


# --------------------------------------------------------------------------- properties


def _matrix():
    """Problems over batch, heads, head dims, contexts, block sizes and element sizes."""
    for b, (h_q, h_kv), (dk, dv), ctx, page, elt in itertools.product(
            (1, 3, 8, 32, 128), ((32, 32), (32, 8), (64, 8), (12, 4), (32, 1), (64, 2), (48, 3)),
            ((32, 32), (64, 64), (96, 96), (128, 128), (128, 96), (256, 256)),
            (1, 17, 1000, 2048, 8192, 32768, 131072), (0, 1, 16, 64, 256), (2, 4)):
        yield DecodeProblem(b, h_q, h_kv, dk, dv, ctx if page == 0 else -(-ctx // page) * page, elt, page)


FACTS = {**DEVICES, "interpreter": INTERPRETER, "T4": DeviceFacts(40, 64 * 1024, (7, 5), name="T4"),
         "H100 without Gluon": replace(H100, gluon=False), "H100 interpreted": replace(H100, interpreting=True)}


@pytest.mark.parametrize("device", list(FACTS))
def test_plan_properties(device):
    """For every problem of the matrix: the Gluon kernels only where they run (a Triton with Gluon,
    compiled, compute capability 8.0 or newer) and PDL only on sm_90 or newer; on the four GPUs,
    the dot path's K/V ring and its scratch within shared memory; at least one split, and the automatic
    ones each at least _MIN_TILES_PER_SPLIT of the default tile (GQA_MIN_CONTEXT tokens for the
    GQA kernel); the merge that the split count needs; the same plan for the same input."""
    facts = FACTS[device]
    for pr in _matrix():
        p = plan(pr, facts)
        assert p.kernel in dp.KERNELS and p.merge in dp.MERGES
        if p.kernel.startswith("gluon"):
            assert facts.gluon and not facts.interpreting and facts.capability >= (8, 0), (pr, p.kernel)
        assert not p.pdl or (facts.capability >= (9, 0) and not facts.interpreting)
        if device in DEVICES:
            ring = (p.num_stages - 1) * p.block_n * (p.block_dk + p.block_dv) * pr.elt_bytes
            assert ring + dp._SMEM_HEADROOM <= facts.smem_per_block, (pr, p.block_n, p.num_stages)
        assert p.num_splits >= 1 and (p.num_splits == p.auto_splits or p.config["gluon_gqa"]), pr
        if p.num_splits > 1:
            if p.kernel == "gluon_gqa":
                assert pr.n_ctx_bound >= dp.GQA_MIN_CONTEXT * p.num_splits, pr
            else:
                tile = dp._tile_config(pr.elt_bytes, p.block_dk, p.block_dv, pr.quantized)["BLOCK_N"]
                assert -(-pr.n_ctx_bound // tile) >= dp._MIN_TILES_PER_SPLIT * p.num_splits, pr
        assert (p.merge == "none") is (p.num_splits == 1)
        assert p.merge != "fused" or 2 <= p.num_splits <= 4
        if p.mha_loop:
            assert pr.h_q == pr.h_kv and pr.page_size and p.block_n % pr.page_size == 0
        assert plan(pr, facts) == p


def test_no_gluon_without_its_conditions():
    """The reference shapes take no Gluon kernel on the interpreter, on sm_75, or without Gluon."""
    for facts in (INTERPRETER, FACTS["T4"], FACTS["H100 without Gluon"], FACTS["H100 interpreted"]):
        for shape in REFERENCE:
            assert plan(problem(*shape), facts).kernel in ("dot", "mha_fma"), (facts.name, shape)


def test_importable_without_torch():
    """decode_plan imports neither torch nor triton: plans are computed anywhere."""
    code = "import sys, flashcl.triton.decode_plan; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_facts_of_host():
    """facts_of a CPU device: the interpreter's facts (whether it interprets read from the environment)."""
    pytest.importorskip("torch")
    from flashcl.triton import interpreting

    assert dp.facts_of("cpu") == replace(INTERPRETER, interpreting=interpreting())


def test_plan_serves():
    """A plan launches only its own problem, and 32-bit offsets only where the caches allow them."""
    p = plan(problem(8, 32, 8, 2048), H100)
    assert p.offs32 and p.serves(problem(8, 32, 8, 2048))
    assert not p.serves(problem(8, 32, 8, 4096)) and not p.serves(problem(8, 32, 4, 2048))
    assert not p.serves(replace(problem(8, 32, 8, 2048), max_offset=2**31))
    wide = plan(replace(problem(8, 32, 8, 2048), max_offset=2**31), H100)
    assert not wide.offs32 and wide.kernel == "dot" and wide.serves(problem(8, 32, 8, 2048))


# --------------------------------------------------------------------------- the rules

# 132 SMs and nothing else known: the dot path's rules alone (no shared memory, Gluon or PDL)
SMS_132 = replace(INTERPRETER, sms=132)
SMS_132_SMEM = replace(SMS_132, smem_per_block=227 * 1024)


def test_split_heuristic():
    """Shapes only: a full grid stays single pass; a small grid splits, bounded by the context."""
    assert dp.choose_num_splits(132, 256, 2048, 64) == 1
    assert [dp.choose_num_splits(132, p, 131072, 64) for p in (8, 16, 32, 64, 128)] == [16, 8, 4, 2, 1]
    assert dp.choose_num_splits(132, 70, 131072, 64) == 2  # one wave of 70 leaves 47% of the SMs idle
    assert dp.choose_num_splits(132, 8, 64, 64) == 1  # one tile: nothing to split
    assert dp.choose_num_splits(132, 16, 4096, 64) <= 4096 // 64 // 4


def test_plan_knobs():
    """Unknown config keys are refused; forced knobs win over the automatic choice."""
    with pytest.raises(KeyError):
        plan(problem(1, 8, 2, 1024, d=64), INTERPRETER, {"fused": True})
    for key in ("no_dot", "evict_first", "mask_tail_only"):  # removed knobs
        with pytest.raises(KeyError):
            plan(problem(1, 8, 2, 1024, d=64), INTERPRETER, {key: True})
    default = plan(problem(1, 8, 2, 1024), INTERPRETER)
    assert default.config["BLOCK_N"] == 64 and default.block_g == 16
    forced = plan(problem(1, 8, 2, 1024), INTERPRETER, {"fused_reduce": False, "pdl": True, "early_pages": False})
    assert default.num_splits == forced.num_splits == 2
    assert forced.config["fused_reduce"] is False and forced.config["pdl"] is True
    assert forced.config["early_pages"] is False
    assert forced.merge == "reduce" and not forced.pdl  # the interpreter runs no PDL
    assert plan(problem(1, 8, 2, 1024), H100, {"pdl": True}).pdl


# (B, H_q, H_kv, ctx) -> splits on an H100's 132 SMs with the dot path's rules alone, the shapes
# the knobs were measured on
_H100_SPLITS = {(8, 32, 32, 2048): 1, (8, 32, 32, 8192): 1, (8, 32, 8, 2048): 2, (32, 32, 8, 2048): 1,
                (4, 64, 8, 2048): 4, (8, 64, 8, 2048): 2, (16, 32, 1, 4096): 8, (1, 32, 8, 32768): 16,
                (1, 32, 8, 131072): 16}


def test_auto_knobs_follow_split_count():
    """The default plan (shapes only): fused_reduce on exactly for 2..4 splits, pdl from 2 splits,
    early_pages always. config["pdl"] is the plan's request (plan.pdl: where the device runs it)."""
    # the interpreter's plan (4 "SMs"): one KV head of one sequence -> 4 splits; 4 of them -> 1
    four = plan(problem(1, 8, 1, 4096), INTERPRETER)
    one = plan(problem(2, 8, 2, 4096), INTERPRETER)
    assert four.num_splits == 4 and four.config["fused_reduce"] and four.config["early_pages"]
    assert one.num_splits == 1 and not one.config["fused_reduce"] and one.config["early_pages"]
    assert four.config["pdl"] and not one.config["pdl"]
    # 132 SMs: the measured shapes
    for (b, h_q, h_kv, ctx), splits in _H100_SPLITS.items():
        p = plan(problem(b, h_q, h_kv, ctx), SMS_132)
        assert p.num_splits == p.auto_splits == splits, (b, h_q, h_kv, ctx)
        assert p.config["fused_reduce"] is (2 <= splits <= 4), (b, h_q, h_kv, ctx, splits)
        assert p.config["pdl"] is (splits >= 2), (b, h_q, h_kv, ctx, splits)
        assert p.config["early_pages"] is True
    # an explicit split count: the automatic knobs follow the count launched
    for ns, fused, pdl in ((1, False, False), (2, True, True), (4, True, True), (5, False, True),
                           (16, False, True)):
        p = plan(problem(8, 32, 8, 2048), SMS_132, None, ns)
        assert p.auto_splits == 2 and p.num_splits == ns
        assert p.config["fused_reduce"] is fused and p.config["pdl"] is pdl, ns


def test_long_tile_rule():
    """The 128-row tile on 8 warps only for a grid of at most one program per SM whose splits are
    >= 4096 tokens, heads padded to 128 or more, only where shared memory holds its ring, never
    when the config sets the tile."""
    for smem, long_ok in ((227 * 1024, True), (99 * 1024, False)):  # H100; sm_89
        facts = replace(SMS_132, smem_per_block=smem)
        for (b, h_q, h_kv, ctx), splits in _H100_SPLITS.items():
            cfg = plan(problem(b, h_q, h_kv, ctx), facts).config
            want = long_ok and ctx // splits >= 4096 and b * h_kv * splits <= 132  # (1, 32/8, 128k) only
            short_warps = 2 if 2 <= h_q // h_kv <= 4 else 4  # see test_two_warps_rule
            assert (cfg["BLOCK_N"], cfg["num_warps"]) == ((128, 8) if want else (64, short_warps)), \
                (b, h_q, h_kv, ctx, smem)
        # d = 256 fp16: a 128-row ring is 256 KB, more than any GPU has
        cfg = plan(problem(1, 32, 8, 131072, d=256), facts).config
        assert cfg["BLOCK_N"] < 128
        # heads up to 64: the small-head rows on 4 warps instead; d = 96 is padded to 128
        for d, rows in ((64, 128), (32, 256)):
            cfg = plan(problem(1, 32, 8, 131072, d=d), facts).config
            assert (cfg["BLOCK_N"], cfg["num_warps"]) == (rows, 4), (d, smem)
        cfg = plan(problem(1, 32, 8, 131072, d=96), facts).config
        assert ((cfg["BLOCK_N"], cfg["num_warps"]) == (128, 8)) == long_ok
    # forced tile or forced split count that leaves short splits: the default tile
    assert plan(problem(1, 32, 8, 131072), SMS_132, {"num_stages": 2}).block_n == 64
    assert plan(problem(1, 32, 8, 131072), SMS_132, None, 64).block_n == 64


def test_gluon_gqa_rule():
    """gqa_takes: groups of 4 to 8, splits of 1024 tokens or more, 1.5 programs per SM or more,
    head dims 128, 2-byte K/V; forced, any group of 2 to 16; not where the Gluon kernels do not
    run; gqa_splits: two programs per SM; the plan takes the kernel's split count."""
    def takes(group=4, programs=256, ctx=2048, splits=1, d=128, elt=2, forced=False, facts=H100):
        return dp.gqa_takes(group, d, d, elt, splits, programs, ctx, facts, forced)

    assert takes() and takes(group=8) and takes(programs=198) and takes(ctx=1024)
    assert not takes(programs=197) and not takes(ctx=1023) and not takes(splits=2, ctx=2047)
    assert takes(programs=8, splits=32, ctx=32768) and not takes(programs=8, splits=16, ctx=32768)
    assert not takes(group=2) and not takes(group=16) and not takes(group=1, forced=True)
    assert takes(group=2, forced=True) and takes(group=16, programs=8, ctx=16, forced=True)
    assert not takes(group=17, forced=True) and not takes(d=64, forced=True) and not takes(elt=4, forced=True)
    assert not takes(facts=SMS_132) and not takes(facts=FACTS["T4"], forced=True)
    assert [dp.gqa_splits(n, 132) for n in (8, 16, 32, 100, 132, 133, 256)] == [32, 16, 8, 2, 2, 1, 1]
    assert [dp.gqa_splits(n, 132, 3) for n in (8, 64, 132, 400)] == [49, 6, 3, 1]  # three per SM

    def gqa(b, h_q, h_kv, ctx=2048, config=None, num_splits=0, page=16):
        p = plan(problem(b, h_q, h_kv, ctx, page=page), H100, config, num_splits)
        return p.config["gluon_gqa"], p.num_splits, p.config["fused_reduce"]

    assert gqa(32, 32, 8) == (True, 1, False) and gqa(32, 32, 8, config={"gluon_gqa": False})[0] is False
    assert gqa(1, 32, 8, ctx=131072) == (True, 32, False) and gqa(16, 32, 8, ctx=4096) == (True, 2, False)
    assert gqa(8, 32, 8) == (False, 2, True)  # 512-token splits: the dot path, fused
    assert gqa(1, 32, 8, ctx=131072, num_splits=16)[:2] == (False, 16)  # 128 programs
    assert not gqa(32, 32, 8, page=0)[0] and not gqa(32, 32, 8, config={"BLOCK_N": 64})[0]
    assert gqa(8, 32, 8, config={"gluon_gqa": True})[:2] == (True, 2)  # forced: the dot path's count
    assert plan(problem(8, 32, 8, 2048), H100, {"gluon_gqa": True}).merge == "reduce"


def test_mha_fma_rule():
    """On where it was measured to pay: MHA, 2-byte K/V, head dims 65..128, more programs than SMs;
    a config forces it either way (never for GQA)."""
    def on(b, h_q, h_kv, d=128, elt=2, config=None):
        return plan(problem(b, h_q, h_kv, 2048, d=d, elt=elt), SMS_132, config).config["mha_fma"]

    assert on(8, 32, 32) and on(16, 32, 32) and on(8, 32, 32, d=96) and on(8, 32, 32, d=72)
    assert not on(8, 32, 32, d=64) and not on(8, 32, 32, d=32)  # small heads: the dot path, more rows
    assert not on(4, 32, 32)  # 128 programs: one per SM
    assert not on(8, 32, 8) and not on(16, 32, 1)  # GQA, MQA
    assert not on(8, 32, 32, elt=4) and not on(8, 32, 32, d=256)
    assert on(4, 32, 32, config={"mha_fma": True}) and not on(8, 32, 32, config={"mha_fma": False})
    assert not on(8, 32, 8, config={"mha_fma": True})
    assert plan(problem(8, 32, 32, 2048), SMS_132).kernel == "mha_fma"  # no Gluon: the Triton loop


def test_mha_fma_small_heads_rule():
    """Heads up to 64 take the MHA loop only where the Gluon kernel can run it (one split, 2-byte
    K/V, DK == DV, whole pages of its tile), on its tile: 128 rows on 8 warps up to two programs per
    SM, then 64 rows on 4 warps at d = 64 and 128 rows on 4 warps at d = 32."""
    def mha(b, h_q, h_kv, d=64, dv=None, elt=2, ctx=2048, config=None, ns=0, page=16):
        p = plan(problem(b, h_q, h_kv, ctx, d=d, dv=dv, elt=elt, page=page), H100, config, ns)
        return p.config["BLOCK_N"], p.config["num_warps"], p.config["mha_fma"]

    assert mha(8, 32, 32) == mha(8, 32, 32, d=48) == mha(8, 32, 32, d=32) == (128, 8, True)  # 256 programs
    assert mha(16, 32, 32) == (64, 4, True) and mha(16, 32, 32, d=32) == (128, 4, True)  # 512 programs
    assert mha(8, 32, 32, d=96) == mha(8, 32, 32, d=128) == (64, 4, True)
    assert mha(8, 32, 32, page=128) == (128, 8, True) and mha(16, 32, 32, page=128)[2] is False  # whole pages
    assert mha(8, 32, 32, page=0)[2] is False  # a contiguous cache: the dot path's tile
    assert mha(8, 32, 32, d=128, page=256)[2] is False  # blocks larger than the loop's tile: the dot path
    assert mha(8, 32, 32, ns=2)[2] is False and mha(8, 32, 32, dv=32)[2] is False  # splits, DK != DV
    assert mha(8, 32, 32, elt=4)[2] is False and mha(8, 32, 8)[2] is False and mha(4, 32, 32)[2] is False
    assert mha(8, 32, 32, config={"gluon_mha": False}) == (64, 4, False)  # the dot path
    assert mha(8, 32, 32, config={"BLOCK_N": 64}) == (64, 4, False)  # a set tile: not the kernel's
    assert mha(8, 32, 32, config={"mha_fma": True}) == (64, 4, True)  # forced: the default tile
    assert plan(problem(8, 32, 32, 2048, d=64), H100).kernel == "gluon_mha"
    assert plan(problem(8, 32, 32, 2048, d=64), H100, {"mha_fma": True, "gluon_mha": False}).kernel == "mha_fma"
    assert plan(problem(8, 32, 32, 2048, d=64), A100).kernel == "gluon_mha"  # compiled for sm_80 too


def test_small_head_rows_rule():
    """Heads below 128 get more rows, so that a K+V tile holds 16 KB (32 KB where a program has its
    SM to itself), up to 256 rows and within the device's shared memory; head dims of 128 and more,
    groups over 16, the MHA loop, a config that sets the tile and the interpreter (no shared memory
    known) keep the default."""
    def rows(b, h_q, h_kv, d=128, elt=2, ctx=2048, config=None, dv=None, smem=227 * 1024):
        facts = replace(SMS_132, smem_per_block=smem)
        return plan(problem(b, h_q, h_kv, ctx, d=d, dv=dv, elt=elt), facts, config).config["BLOCK_N"]

    assert rows(8, 32, 32) == rows(32, 32, 8) == rows(1, 32, 8, ctx=32768) == rows(16, 32, 1, ctx=4096) == 64
    assert rows(16, 32, 1, d=32, ctx=4096) == 64  # MQA: the group of 32 keeps 64 rows
    assert rows(4, 32, 32, d=96) == rows(4, 32, 32, d=64) == 128  # 128 programs: one per SM
    assert rows(4, 32, 32, d=96, config={"mha_fma": True}) == 64  # the MHA loop keeps 64 rows
    assert rows(8, 32, 32, d=64) == rows(32, 32, 8, d=64) == rows(8, 32, 32, d=96) == 64  # 256 programs
    assert rows(8, 32, 32, d=32) == rows(32, 32, 8, d=32) == 128
    assert rows(1, 32, 8, d=64, ctx=32768) == rows(1, 32, 8, d=96, ctx=32768) == 128  # one program per SM
    assert rows(1, 32, 8, d=32, ctx=32768) == rows(1, 32, 8, d=16, ctx=32768) == 256
    assert rows(1, 32, 8, d=192, dv=128, ctx=32768) == 32  # the default
    assert rows(1, 32, 8, elt=4, ctx=32768) == 64  # float32's ring of 2 stages (d = 128 only)
    assert rows(1, 32, 8, d=256, elt=4, ctx=8192) == 16
    assert rows(1, 32, 8, d=32, ctx=32768, config={"num_stages": 3}) == 64  # the config sets the tile
    # sm_89: the d = 96 ring of 128 rows (128 KB) does not fit
    assert rows(1, 32, 8, d=96, ctx=32768, smem=99 * 1024) == 64
    assert rows(1, 32, 8, d=32, ctx=32768, smem=99 * 1024) == 256
    assert rows(1, 32, 8, d=32, ctx=32768, smem=0) == 64  # the interpreter


def test_two_programs_per_sm_rule():
    """Split launches of groups of 17 to 32 whose tile holds under 32 KB of K+V (heads up to 64 in
    2-byte types) aim at two programs per SM (within the split cap), as float32 K/V do; unsplit
    launches, heads padded to 128, groups of 16 and of 64 keep one program per SM."""
    def splits(b, h_q, h_kv, ctx, d=64, elt=2):
        p = plan(problem(b, h_q, h_kv, ctx, d=d, elt=elt), SMS_132_SMEM)
        assert p.num_splits == p.auto_splits
        return p.num_splits

    assert [splits(16, 32, 1, 4096), splits(8, 32, 1, 8192), splits(32, 32, 1, 2048), splits(8, 64, 2, 4096),
            splits(64, 32, 1, 1024)] == [16, 32, 8, 16, 4]
    assert splits(16, 32, 1, 4096, d=32) == 16 and splits(4, 32, 1, 16384, d=32) == 64
    assert splits(8, 32, 1, 16384) == 33 and splits(4, 32, 1, 32768) == 66
    assert splits(4, 32, 1, 16384) == 64 and splits(2, 32, 1, 32768) == 128  # capped: 4 tiles a split, 128
    assert splits(128, 32, 1, 512) == 1  # unsplit at one program per SM: stays unsplit
    assert splits(16, 32, 1, 4096, d=128) == 8  # 32 KB tiles
    assert splits(16, 32, 1, 4096, elt=4) == 16 and splits(1, 32, 8, 32768, d=128, elt=4) == 33  # float32 K/V
    assert splits(16, 32, 1, 4096, d=96) == 8  # padded to 128
    assert splits(16, 64, 1, 4096) == splits(8, 32, 2, 4096) == 8  # groups of 64 and of 16
    # a forced count is launched as given
    assert plan(problem(16, 32, 1, 4096, d=64), SMS_132_SMEM, None, 8).num_splits == 8


def test_two_warps_on_a_contiguous_cache_rule():
    """A contiguous cache's split launch on the 2-warp tile aims at two programs per SM, at a
    power of two, where its splits are too short for the long tile (H200: (1, 32/8, 32k) 16 splits
    46 us, 32 splits 39-40); paged caches, the long tile's lengths and forced tiles keep theirs."""
    def run(ctx, page=0, h_q=32, h_kv=8, d=128, window=-1, config=None):
        prob = replace(problem(1, h_q, h_kv, ctx, d=d, page=page), window_left=window,
                       variants=("window",) if window >= 0 else ())
        p = plan(prob, SMS_132_SMEM, config)
        return p.num_splits, p.block_n, p.num_warps

    assert run(8192) == run(32768) == (32, 64, 2) and run(32768, h_q=16) == (32, 64, 2)
    assert run(131072) == (16, 128, 8)  # splits of 8k keys: the long tile, one program per SM
    assert run(32768, h_q=64) == (16, 64, 4)  # groups of 8: 4 warps, one program per SM
    assert run(32768, page=16)[0] == run(32768, config={"num_warps": 2})[0] == 16
    # a count the keys cap is not rounded below it; not measured: windows, padded heads, fewer programs
    assert run(3072)[0] == 12 and run(1280)[0] == 5
    assert run(32768, window=767)[0] == 12 and run(32768, d=96)[0] == 16
    assert run(32768, h_q=8, h_kv=2)[0] == 66


def test_quantized_rows_tile_rule():
    """A prefill's rows run as a decode of a quantized cache take 64 keys on 4 warps from 64 rows
    a KV head (H200: 1.7-1.9x at (1, 32/8, 16, 32k)); fewer rows keep their format's tile."""
    def tile(n_q, fmt):
        p = plan(replace(problem(1, 32 * n_q, 8, 32768, page=0), query_rows=n_q, kv_formats=(fmt, fmt)),
                 SMS_132_SMEM)
        return p.block_n, p.num_warps

    assert [tile(16, f) for f in ("q8_0", "q4_0", "int8", "fp8_e4m3")] == [(64, 4)] * 4
    assert tile(12, "q8_0") == (64, 4)  # 48 rows: the kernel pads them to 64
    assert tile(8, "q8_0") == tile(8, "int8") == (64, 2) and tile(8, "q4_0") == (32, 2)
    # one row of 64 heads with a mask (a decode's shape, not the rows measured) keeps the format's
    one_row = plan(replace(problem(1, 64, 1, 32768, page=0), row_mask=True, kv_formats=("q8_0", "q8_0")),
                   SMS_132_SMEM)
    assert (one_row.block_n, one_row.num_warps) == (64, 2)


def test_two_warps_rule():
    """The default 64-row tile runs on 2 warps exactly where it was measured to pay: GQA groups of
    2 to 4, 2-byte K/V, head dims 128; never where the config sets the tile, never the long tile
    or the MHA loop."""
    def warps(b, h_q, h_kv, d=128, elt=2, ctx=2048, config=None):
        return plan(problem(b, h_q, h_kv, ctx, d=d, elt=elt), SMS_132_SMEM, config).config["num_warps"]

    assert warps(32, 32, 8) == warps(8, 32, 8) == warps(1, 32, 8, ctx=32768) == warps(8, 16, 8) == 2
    assert warps(1, 32, 8, ctx=131072) == 8  # the long tile
    assert warps(8, 64, 8) == warps(16, 32, 1) == 4  # groups of 8 and 32
    assert warps(8, 32, 32) == warps(4, 32, 32) == 4  # MHA: the CUDA-core loop, or tl.dot on 4 warps
    assert warps(32, 32, 8, d=64) == warps(32, 32, 8, elt=4) == 4  # not measured: kept on 4
    assert warps(32, 32, 8, config={"num_stages": 3}) == 4  # the config sets the tile


def test_reduce_shape_rule():
    """The reduce kernel's heads per program and splits per step (_reduce_shape): 4 heads, fewer
    where one step then merges every split."""
    assert [dp._reduce_shape(ns, 32) for ns in (5, 20, 70)] == [(4, 8), (4, 32), (2, 128)]
    assert [dp._reduce_shape(ns, 128) for ns in (10, 20, 70)] == [(4, 16), (2, 32), (1, 64)]
    p = plan(problem(1, 32, 1, 131072), H100)
    assert p.merge == "reduce" and (p.reduce_heads, p.reduce_chunk) == dp._reduce_shape(p.num_splits, 128)


def test_knob_defaults_hold_while_they_last():
    """knob_defaults: the plans made inside take the overrides (the bench's --knob), the defaults
    come back after, also when the block raises; an unknown knob is a KeyError before any change."""
    gqa = problem(1, 32, 8, 32768)
    base = plan(gqa, H100)
    with dp.knob_defaults({"gqa_programs_per_sm": 3}):
        inside = plan(gqa, H100)
    assert (inside.num_splits, inside.gqa_registers) == (dp.gqa_splits(8, H100.sms, 3), 168)
    assert plan(gqa, H100).num_splits == base.num_splits and plan(gqa, H100).gqa_registers == 0
    with pytest.raises(RuntimeError), dp.knob_defaults({"sort_pages": False}):
        assert not plan(gqa, H100).sort_pages
        raise RuntimeError("inside")
    assert plan(gqa, H100).sort_pages
    with pytest.raises(KeyError, match="unknown decode knobs"), dp.knob_defaults({"programs": 3}):
        pass
    for bad in ({"gqa_programs_per_sm": 5}, {"gqa_programs_per_sm": True}, {"gluon_gqa": 1}, {"pdl": "yes"},
                {"sort_pages": None}, {"merge_stages": 0}):
        with pytest.raises(ValueError, match="decode knob"), dp.knob_defaults(bad):
            pass
        with pytest.raises(ValueError, match=next(iter(bad))):  # a config's value too
            plan(gqa, H100, bad)
    assert plan(gqa, H100) == base
    # the cap follows what the grid needs: one program per SM at 4 asked needs none; 2.06 per SM, 3
    one = plan(problem(1, 32, 8, 32768), H100, {"gqa_programs_per_sm": 1})
    assert (one.num_splits, one.gqa_registers) == (16, 0)
    wide = plan(problem(34, 32, 8, 2048), H100, {"gqa_programs_per_sm": 4})  # 272 programs, one split
    assert (wide.num_splits, wide.gqa_registers) == (1, 168)
    # groups past 8 (forced onto the kernel) keep two per SM whatever the format's entry
    big = replace(problem(1, 64, 4, 32768), kv_formats=("int8", "int8"))
    forced = plan(big, H100, {"gluon_gqa": True})
    assert forced.kernel == "gluon_gqa" and forced.gqa_registers == 0
    assert plan(replace(problem(1, 32, 8, 32768), kv_formats=("int8", "int8")), H100).gqa_registers == 168


def test_query_rows_gluon_gqa_rule():
    """A decode's query rows (query heads x rows a KV head) run on the Gluon GQA kernel where its
    rule takes a group of that many heads, 8 at most (H200, (1, 32/8, 2 rows, 32k) paged: q8_0
    55.3 -> 33.0 us, fp16 42.7 -> 38.6); 16 (measured slower for int8 and fp16) and a row mask stay
    on the dot path."""
    def kernel(h_q, h_kv, n_q, fmt="", row_mask=False):
        prob = replace(problem(1, h_q * n_q, h_kv, 32768), query_rows=n_q, row_mask=row_mask, kv_formats=(fmt, fmt))
        return plan(prob, H200).kernel

    assert kernel(32, 8, 2) == kernel(32, 8, 2, "q8_0") == kernel(32, 8, 2, "int8") == "gluon_gqa"
    assert kernel(32, 32, 2, "q8_0") == kernel(32, 16, 4, "q4_0") == "gluon_gqa"  # MHA and GQA 2
    assert kernel(32, 8, 4) == kernel(32, 8, 4, "q8_0") == "dot"
    assert kernel(32, 8, 2, "q8_0", row_mask=True) == "dot"
    assert kernel(32, 32, 2) == "dot"  # fp16 MHA rows: a group of 2, not the rule's (nor the MHA kernels')
    one_row = replace(problem(1, 32, 8, 32768), row_mask=True)
    assert plan(one_row, H200) == plan(replace(one_row, query_rows=1), H200) and plan(one_row, H200).kernel == "dot"
