"""One decode step over a paged KV cache (vLLM's layout) with a permuted block table."""

import numpy as np

import flashcl

rng = np.random.default_rng(0)
num_blocks, block_size, h_q, h_kv, d = 48, 16, 8, 2, 64
q = rng.standard_normal((2, h_q, d)).astype(np.float16)                          # (B, H_q, DK)
k_cache = rng.standard_normal((num_blocks, block_size, h_kv, d)).astype(np.float16)
v_cache = rng.standard_normal((num_blocks, block_size, h_kv, d)).astype(np.float16)
block_table = rng.permutation(num_blocks)[:40].reshape(2, 20).astype(np.int32)   # any blocks, any order
context_lens = np.array([317, 45], dtype=np.int32)                               # last block partial

out = flashcl.decode(q, k_cache, v_cache, block_table=block_table, context_lens=context_lens)
ref = flashcl.reference.decode_attention(q, k_cache, v_cache, block_table=block_table,
                                         context_lens=context_lens)
err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
print(f"paged decode {out.shape}: relative error {err:.1e} against float64")
assert err < 2e-3
