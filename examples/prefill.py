"""Causal GQA prefill on the default OpenCL device, checked against the float64 oracle."""

import numpy as np

import flashcl

rng = np.random.default_rng(0)
q = rng.standard_normal((1, 8, 300, 64)).astype(np.float16)   # (B, H_q, N_q, DK)
k = rng.standard_normal((1, 2, 300, 64)).astype(np.float16)   # (B, H_kv, N_kv, DK): GQA 4:1
v = rng.standard_normal((1, 2, 300, 64)).astype(np.float16)   # (B, H_kv, N_kv, DV)

out, lse = flashcl.prefill(q, k, v, causal=True, return_lse=True)
ref = flashcl.reference.attention(q, k, v, causal=True)
err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
print(f"prefill {out.shape} {out.dtype}: relative error {err:.1e} against float64")
assert err < 2e-3
