"""Attention over a long context computed in two parts and merged exactly with their lse."""

import numpy as np

import flashcl

rng = np.random.default_rng(0)
q = rng.standard_normal((4, 64, 64)).astype(np.float32)      # (H, N_q, D): B = 1
k = rng.standard_normal((4, 1000, 64)).astype(np.float32)
v = rng.standard_normal((4, 1000, 64)).astype(np.float32)

o1, l1 = flashcl.prefill(q, k[:, :600], v[:, :600], return_lse=True)
o2, l2 = flashcl.prefill(q, k[:, 600:], v[:, 600:], return_lse=True)
out, lse = flashcl.merge_states([o1, o2], [l1, l2])

ref, ref_lse = flashcl.reference.attention(q, k, v, return_lse=True)
err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
print(f"two parts merged: relative error {err:.1e}, lse max error {np.abs(lse - ref_lse).max():.1e}")
assert err < 1e-5
