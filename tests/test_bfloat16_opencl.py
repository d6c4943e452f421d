"""bfloat16 on the OpenCL kernels (torch CPU tensors; numpy has no bfloat16 of its own): every kernel reads
the values as the high half of a float32 and rounds its output once, to nearest even. Checked
against the float64 oracle: the output is the oracle's value rounded to bfloat16 (not merely near
it), over both prefill layouts, decode.cl and decode_cpu.cl, contiguous and paged caches, split
counts, GQA, DK != DV, the variants and quantized caches (whose dequantized values round to
bfloat16, as flashcl.dequantize gives them). The fuzzers draw bfloat16 too."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashcl  # noqa: E402
from flashcl import reference  # noqa: E402

from ._check import check_out_and_lse  # noqa: E402

PREFILL_LAYOUTS = {  # "auto": flashcl's choice (a CPU runs few causal rows as a decode)
    "auto": None,
    "rows": {"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 16, "VEC": 4},
    "tiles": {"VARIANT": "tiles", "BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 32, "TILE_M": 4, "TILE_N": 4},
}
DECODE_KERNELS = {  # params that pick each kernel on any device
    "decode.cl": {"ROWS": 2, "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 64},
    "decode_cpu.cl": {"VARIANT": "rows", "BLOCK_N": 16, "VEC": 8, "MERGE_WG": 64},
}


def _bf16(shape, seed: int, scale: float = 1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _f64(x) -> np.ndarray:
    return x.double().numpy() if hasattr(x, "double") else np.asarray(x, np.float64)


def assert_rounded_oracle(out, ref, what: str) -> None:
    """``out`` (bfloat16) is ``ref`` rounded to nearest even, except where ref lies within float32
    arithmetic's error of a rounding midpoint: at least 99% of the values exactly, all within one
    unit in the last place (past float32's error on the largest value). A truncating conversion
    gets about half of them."""
    assert out.dtype == torch.bfloat16, what
    want = torch.from_numpy(np.asarray(ref, np.float32)).to(torch.bfloat16)  # ref is far from float32's ulp
    got, want = out.float(), want.float()
    ulp = torch.finfo(torch.bfloat16).eps * want.abs() + 1e-6 * float(np.abs(ref).max())
    assert bool(((got - want).abs() <= ulp).all()), f"{what}: a value more than one bfloat16 ulp from the oracle"
    exact = float((got == want).float().mean())
    assert exact >= 0.99, f"{what}: only {exact:.1%} of the values are the oracle's rounded to nearest even"


def check_prefill(device, layout: str, causal: bool, n_q: int = 37, n_kv: int = 70, dk: int = 96, dv: int = 64):
    q, k, v = _bf16((2, 8, n_q, dk), 0, 2.0), _bf16((2, 2, n_kv, dk), 1), _bf16((2, 2, n_kv, dv), 2)
    out, lse = flashcl.prefill(q, k, v, causal=causal, return_lse=True, device=device,
                               params=PREFILL_LAYOUTS[layout])
    ref, ref_lse = reference.attention(_f64(q), _f64(k), _f64(v), causal=causal, return_lse=True)
    assert lse.dtype == torch.float32
    check_out_and_lse(out.double().numpy(), lse.numpy(), ref, ref_lse, "bfloat16", layout, lse_rtol=1e-5)
    assert_rounded_oracle(out, ref, f"prefill {layout}")


def check_decode(device, kernel: str, paged: bool, splits: int, n: int = 150, dk: int = 64, dv: int = 32):
    b, h_kv, bs = 2, 2, 16
    q = _bf16((b, 8, dk), 3, 2.0)
    k, v = _bf16((b, h_kv, n, dk), 4), _bf16((b, h_kv, n, dv), 5)
    lens = torch.tensor([n, n // 4], dtype=torch.int32)
    table = None
    if paged:  # the same rows in blocks of a permuted table
        per_seq = -(-n // bs)
        ids = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(6)).reshape(b, per_seq)
        table = ids.to(torch.int32)
        kp, vp = (torch.empty((b * per_seq, bs, h_kv, x.shape[-1]), dtype=torch.bfloat16) for x in (k, v))
        for i in range(b):
            for j in range(per_seq):
                rows = slice(j * bs, min(n, (j + 1) * bs))
                for src, dst in ((k, kp), (v, vp)):
                    dst[ids[i, j], : rows.stop - rows.start] = src[i, :, rows].transpose(0, 1)
        caches = kp, vp
    else:
        caches = k, v
    out, lse = flashcl.decode(q, *caches, block_table=table, context_lens=lens, num_splits=splits,
                              return_lse=True, device=device, params=DECODE_KERNELS[kernel])
    ref, ref_lse = reference.decode_attention(_f64(q), _f64(k), _f64(v), context_lens=lens.numpy(), return_lse=True)
    what = f"decode {kernel} paged={paged} splits={splits}"
    check_out_and_lse(out.double().numpy(), lse.numpy(), ref, ref_lse, "bfloat16", what, lse_rtol=1e-5)
    assert_rounded_oracle(out, ref, what)


def check_quantized(device, fmt: str, n: int = 90, n_q: int = 5, layouts=("auto", "rows")):
    """The dequantized values are bfloat16 (q * d rounded to it), as the oracle attends them."""
    k, v = _bf16((1, 2, n, 64), 10, 30.0), _bf16((1, 2, n, 64), 11)
    kq, vq = flashcl.quantize(k, fmt), flashcl.quantize(v, fmt)
    kd, vd = (flashcl.dequantize(x) for x in (kq, vq))
    assert kd.dtype == torch.bfloat16
    q = _bf16((1, 8, n_q, 64), 12)
    for layout in layouts:
        out = flashcl.prefill(q, kq, vq, causal=True, device=device, params=PREFILL_LAYOUTS[layout])
        ref = reference.attention(_f64(q), _f64(kd), _f64(vd), causal=True)
        assert_rounded_oracle(out, ref, f"prefill {layout} {fmt}")
    qd, lens = q[:, :, 0].contiguous(), torch.tensor([n], dtype=torch.int32)
    for name, params in DECODE_KERNELS.items():
        out = flashcl.decode(qd, kq, vq, context_lens=lens, device=device, params=params)
        ref = reference.decode_attention(_f64(qd), _f64(kd), _f64(vd), context_lens=lens.numpy())
        assert_rounded_oracle(out, ref, f"decode {name} {fmt}")


@pytest.mark.parametrize("layout", sorted(PREFILL_LAYOUTS))
@pytest.mark.parametrize("causal", [True, False])
def test_prefill(cl_device, layout, causal):
    check_prefill(cl_device, layout, causal)


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode(cl_device, kernel, paged, splits):
    check_decode(cl_device, kernel, paged, splits)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_quantized_caches(cl_device, fmt):
    check_quantized(cl_device, fmt)


def test_variants(cl_device):
    """Window, softcap, sinks, ALiBi and a mask on the prefill; the same but the mask on the decode;
    NaN in every key no row may see."""
    q, k, v = _bf16((1, 4, 9, 64), 7, 3.0), _bf16((1, 2, 40, 64), 8), _bf16((1, 2, 40, 64), 9)
    k[:, :, :5], v[:, :, :5] = float("nan"), float("nan")  # left of every row's window
    var = {"window": (20, 0), "softcap": 5.0, "sinks": np.linspace(-1, 1, 4, dtype=np.float32),
           "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.05], np.float32)}
    mask = np.ones((1, 1, 9, 40), bool)
    mask[..., 30:33] = False
    out = flashcl.prefill(q, k, v, causal=True, mask=mask, device=cl_device, **var)
    ref = reference.attention(_f64(q), np.nan_to_num(_f64(k)), np.nan_to_num(_f64(v)), causal=True,
                              mask=mask, **var)
    assert_rounded_oracle(out, ref, "prefill with variants")
    qd = q[:, :, -1].contiguous()
    lens = torch.tensor([40], dtype=torch.int32)
    out = flashcl.decode(qd, k, v, context_lens=lens, device=cl_device, **var)
    ref = reference.decode_attention(_f64(qd), np.nan_to_num(_f64(k)), np.nan_to_num(_f64(v)),
                                     context_lens=lens.numpy(), **var)
    assert_rounded_oracle(out, ref, "decode with variants")


# (H_q, H_kv, DK, DV): a GQA group of 4, a partial second n-tile (12), two work-groups per KV head (32)
MMA_CASES = [(8, 2, 128, 128), (12, 1, 96, 64), (32, 1, 64, 64)]


def check_tensor_core_kernel(device, h_q: int, h_kv: int, dk: int, dv: int, fused: bool, lens=(1, 17, 300),
                             splits=(1, 3, 40)):
    """decode_mma.cl on a bfloat16 cache (the bf16 MMA, P in two bf16 parts): the real PTX on NVIDIA
    (sm_80+), its emulation elsewhere. Paged in a permuted table, split-k in two launches or one
    (``fused``); the output is the oracle rounded to bfloat16."""
    import pyopencl.array as cla

    from flashcl.opencl.arrays import from_stored
    from flashcl.opencl.decode import DecodeKernel, DecodeProblem, choose_params, tensor_cores_ok
    from flashcl.opencl.runtime import get_device

    h = get_device(device)
    b, bs, lens = len(lens), 16, np.array(lens, np.int32)
    prob = DecodeProblem(b, h_q, h_kv, dk, dv, True, "bfloat16")
    mode = True if tensor_cores_ok(h, prob) else "emulate"
    kern = DecodeKernel(h, prob, choose_params(h, prob).params, tensor_cores=mode, fused_merge=fused)
    per_seq = -(-int(lens.max()) // bs)
    table = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(h_q)).reshape(b, per_seq)
    q = _bf16((b, h_q, dk), 20 + h_q, 4.0)
    k, v = _bf16((b * per_seq, bs, h_kv, dk), 21), _bf16((b * per_seq, bs, h_kv, dv), 22)
    bits = [cla.to_device(h.queue, x.view(torch.int16).numpy().view(np.uint16)) for x in (q, k, v)]
    td, ld = cla.to_device(h.queue, table.to(torch.int32).numpy()), cla.to_device(h.queue, lens)
    ref, ref_lse = reference.decode_attention(_f64(q), _f64(k), _f64(v), block_table=table.numpy(),
                                              context_lens=lens, return_lse=True)
    # one out and lse for every call (Oclgrind's uninitialized-value tracking goes stale where a
    # released buffer's slot is reused: test_oclgrind.keep_decode_workspaces)
    out, lse = cla.empty(h.queue, (b, h_q, dv), np.uint16), cla.empty(h.queue, (b, h_q), np.float32)
    for n in splits:
        out.fill(0x7fc0)  # NaN until written
        lse.fill(np.nan)
        kern(*bits, out, lse, td, ld, dk ** -0.5, n)[-1].wait()
        got = torch.from_numpy(from_stored(out.get(), "bfloat16")).to(torch.bfloat16)
        what = f"decode_mma.cl ({mode}) bfloat16 fused={fused} splits={n}"
        assert_rounded_oracle(got, ref, what)
        np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-5, atol=1e-5, err_msg=what)


def test_tensor_core_kernel_takes_plain_bfloat16_only():
    """decode_mma.cl reads bfloat16 rows as they are stored; its dequantization builds fp16 words,
    so a quantized cache under bfloat16 q stays with decode.cl (which rounds its values to bf16)."""
    from flashcl.opencl.decode import DecodeProblem, _mma_shape_ok

    assert _mma_shape_ok(DecodeProblem(2, 8, 2, 128, 128, True, "bfloat16"))
    for k_fmt, v_fmt in (("q8_0", None), (None, "int8"), ("q4_0", "q4_0")):
        assert not _mma_shape_ok(DecodeProblem(2, 8, 2, 128, 128, True, "bfloat16", k_fmt, v_fmt))
        assert _mma_shape_ok(DecodeProblem(2, 8, 2, 128, 128, True, "float16", k_fmt, v_fmt))


@pytest.mark.parametrize("h_q,h_kv,dk,dv", MMA_CASES)
@pytest.mark.parametrize("fused", [False, True])
def test_tensor_core_kernel(cl_device, h_q, h_kv, dk, dv, fused):
    """1-key sequences, more splits than keys, partial n-tiles, two work-groups per KV head."""
    check_tensor_core_kernel(cl_device, h_q, h_kv, dk, dv, fused)


def test_tensor_core_kernel_rows_hide_nonfinite_v(cl_device):
    """decode_mma.cl on bfloat16 with causal query rows (QUERY_ROWS: 4 rows of 4 heads): a V of inf
    and of NaN at keys only the later rows see reach none of the earlier rows (K NaN there too),
    and a V of 3e37 in those tiles is a value, not hidden (bf16's exponent bits). Emulated off NVIDIA."""
    import pyopencl.array as cla

    from flashcl.opencl.arrays import from_stored
    from flashcl.opencl.decode import DecodeKernel, DecodeProblem, DecodeVariants, choose_params, tensor_cores_ok
    from flashcl.opencl.runtime import get_device

    h = get_device(cl_device)
    n, n_q, dk = 40, 4, 64
    prob = DecodeProblem(1, 4 * n_q, 1, dk, dk, False, "bfloat16")
    mode = True if tensor_cores_ok(h, prob) else "emulate"
    var = DecodeVariants.of(None, prob, query_rows=n_q)
    kern = DecodeKernel(h, prob, choose_params(h, prob).params, tensor_cores=mode, variant_flags=var.flags())
    q, k, v = _bf16((1, 4, n_q, dk), 30, 2.0), _bf16((1, 1, n, dk), 31), _bf16((1, 1, n, dk), 32)
    v[0, 0, -3, 9] = 3e37  # finite, though fp16's exponent bits are all set in its bf16 bits
    kp, vp = k.clone(), v.clone()
    vp[0, 0, -1, 5], vp[0, 0, -2, 7], kp[0, 0, -1, 3] = float("inf"), float("nan"), float("nan")
    bits = [cla.to_device(h.queue, x.view(torch.int16).numpy().view(np.uint16)) for x in (q.reshape(1, -1, dk), kp, vp)]
    lens = cla.to_device(h.queue, np.array([n], np.int32))
    out, lse = cla.empty(h.queue, (1, 4 * n_q, dk), np.uint16), cla.empty(h.queue, (1, 4 * n_q), np.float32)
    for splits in (1, 3):
        kern(*bits, out, lse, lens, lens, dk ** -0.5, splits, variants=var)[-1].wait()
        got = torch.from_numpy(from_stored(out.get(), "bfloat16").reshape(1, 4, n_q, dk)).to(torch.bfloat16)
        ref = reference.decode_attention(_f64(q), _f64(k), _f64(v), context_lens=np.array([n]))
        what = f"decode_mma.cl ({mode}) bfloat16 rows, splits={splits}"
        assert_rounded_oracle(got[:, :, : n_q - 2], ref[:, :, : n_q - 2], what)  # rows that see neither key
        assert bool(got[:, :, n_q - 1].float().isnan().any()), f"{what}: the last row sees the NaN"


def test_nan_in_q_stays_nan_and_merge_states_takes_bfloat16(cl_device):
    q, k, v = _bf16((1, 2, 3, 32), 13), _bf16((1, 2, 20, 32), 14), _bf16((1, 2, 20, 32), 15)
    q[0, 1, 2, 0] = float("nan")
    o1, l1 = flashcl.prefill(q, k[:, :, :7], v[:, :, :7], return_lse=True, device=cl_device)
    o2, l2 = flashcl.prefill(q, k[:, :, 7:], v[:, :, 7:], return_lse=True, device=cl_device)
    assert bool(o1[0, 1, 2].isnan().all()) and not bool(o1[0, :, :2].isnan().any())
    out, _ = flashcl.merge_states([o1, o2], [l1, l2])
    ref = reference.attention(_f64(q), _f64(k), _f64(v))
    keep = ~np.isnan(ref)
    assert out.dtype == torch.bfloat16
    assert np.abs(out.double().numpy() - ref)[keep].max() <= 2e-2 * np.abs(ref[keep]).max()


def test_ml_dtypes_arrays_come_back_in_their_dtype(cl_device):
    """numpy and pyopencl arrays of ml_dtypes.bfloat16 run too; the result keeps their dtype."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import pyopencl.array as cla

    from flashcl.opencl.runtime import get_device

    q, k, v = _bf16((1, 4, 6, 32), 16), _bf16((1, 2, 30, 32), 17), _bf16((1, 2, 30, 32), 18)
    q_np, k_np, v_np = (x.float().numpy().astype(ml_dtypes.bfloat16) for x in (q, k, v))
    ref = reference.attention(_f64(q), _f64(k), _f64(v), causal=True)
    out = flashcl.prefill(q_np, k_np, v_np, causal=True, device=cl_device)
    assert out.dtype == ml_dtypes.bfloat16
    assert_rounded_oracle(torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16), ref, "numpy ml_dtypes")
    queue = get_device(cl_device).queue
    out = flashcl.prefill(*(cla.to_device(queue, x) for x in (q_np, k_np, v_np)), causal=True)
    assert out.dtype == ml_dtypes.bfloat16
    assert_rounded_oracle(torch.from_numpy(out.get().astype(np.float32)).to(torch.bfloat16), ref, "pyopencl")
