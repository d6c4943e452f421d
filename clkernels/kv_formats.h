/* The quantized K/V formats every kernel reads (flashcl/quant.py, docs/quantized-formats.md):
 * K_QUANT / V_QUANT pick each cache's format at compile time; 0 (the default) is a plain
 * store_t cache and leaves a kernel as it is. The host's codes: flashcl/opencl/arrays.py. */
#ifndef FLASHCL_KV_FORMATS_H
#define FLASHCL_KV_FORMATS_H

#ifndef K_QUANT
#define K_QUANT 0         // K cache format: 0 store_t rows, 1 q8_0, 2 q4_0, 3 int8
#endif
#ifndef V_QUANT
#define V_QUANT 0         // V cache format, as K_QUANT
#endif
#define QUANT_Q8_0 1
#define QUANT_Q4_0 2
#define QUANT_INT8 3
#define QUANT_BLOCK 32    // values per ggml block (q8_0, q4_0)

#if K_QUANT < 0 || K_QUANT > 3 || V_QUANT < 0 || V_QUANT > 3
#error "K_QUANT and V_QUANT must be 0 (plain), 1 (q8_0), 2 (q4_0) or 3 (int8)"
#endif
#if (K_QUANT == QUANT_Q8_0 || K_QUANT == QUANT_Q4_0) && HEAD_DK % QUANT_BLOCK != 0
#error "q8_0 / q4_0 K caches need HEAD_DK a multiple of 32 (ggml blocks)"
#endif
#if (V_QUANT == QUANT_Q8_0 || V_QUANT == QUANT_Q4_0) && HEAD_DV % QUANT_BLOCK != 0
#error "q8_0 / q4_0 V caches need HEAD_DV a multiple of 32 (ggml blocks)"
#endif

/* Dequantized values as flashcl.dequantize gives them: a float16 cache's (STORE_HALF, common.h)
 * rounded to fp16, as the oracle and the tensor-core kernels attend them (left in float32, large
 * logits made the half-ulp differences errors past the float16 tolerance). Through a private
 * array: OpenCL 1.2 has no half arithmetic without cl_khr_fp16. */
#if STORE_HALF
#define FLASHCL_AS_STORED(N)                                                                 \
static inline float##N as_stored##N(const float##N x)                                        \
{                                                                                            \
    ushort h[N];                                                                             \
    vstore_half##N##_rte(x, 0, (__private half *)h);                                         \
    return vload_half##N(0, (const __private half *)h);                                      \
}
#else
#define FLASHCL_AS_STORED(N) static inline float##N as_stored##N(const float##N x) { return x; }
#endif
FLASHCL_AS_STORED(4)
FLASHCL_AS_STORED(8)
FLASHCL_AS_STORED(16)

#endif
