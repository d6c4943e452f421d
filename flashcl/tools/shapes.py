"""The problem shapes the benchmarks and the tuner run by default, in one place (docs/design.md §7)."""

# Prefill (B, H_q, H_kv, N, d, causal).
PREFILL_REFERENCE = [(1, 32, 32, 1024, 128, True), (1, 32, 32, 4096, 128, True), (4, 32, 32, 4096, 128, True),
                     (1, 32, 32, 4096, 128, False), (8, 12, 12, 1024, 64, True), (16, 12, 12, 512, 64, False),
                     (1, 32, 8, 2048, 128, True)]
PREFILL_LONG = [(1, 32, 32, 8192, 128, True), (1, 32, 32, 16384, 128, True)]
PREFILL_PRESETS = {
    "reference": PREFILL_REFERENCE,
    "target": [(1, 32, 8, 2048, 128, True), (1, 32, 8, 2048, 64, True)],
    # the reference shapes scaled to what a 2-core CPU finishes in seconds, plus the PoCL target
    "cpu": [(1, 8, 2, 512, 128, True), (1, 8, 8, 512, 128, False), (2, 12, 12, 256, 64, True),
            (1, 8, 2, 1024, 128, True)],
}

# Decode (B, H_q, H_kv, ctx) at head dim DECODE_HEAD_DIM, paged with blocks of 16 tokens.
DECODE_HEAD_DIM = 128
DECODE_REFERENCE = [(8, 32, 32, 2048), (8, 32, 32, 8192), (8, 32, 8, 2048), (32, 32, 8, 2048),
                    (4, 64, 8, 2048), (8, 64, 8, 2048), (16, 32, 1, 4096), (1, 32, 8, 32768),
                    (1, 32, 8, 131072)]
DECODE_PRESETS = {
    "reference": DECODE_REFERENCE,
    "target": [(1, 32, 8, 32768), (16, 32, 1, 4096)],
    # the same scaled for a 2-core CPU (ctx / 16)
    "cpu": [(8, 32, 32, 128), (8, 32, 32, 512), (8, 32, 8, 128), (32, 32, 8, 128), (4, 64, 8, 128),
            (8, 64, 8, 128), (16, 32, 1, 256), (1, 32, 8, 2048), (1, 32, 8, 8192)],
}
