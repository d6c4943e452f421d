/* The quantized K/V formats every kernel reads (flashcl/quant.py, docs/quantized-formats.md):
 * K_QUANT / V_QUANT pick each cache's format at compile time; 0 (the default) is a plain
 * store_t cache and leaves a kernel as it is. The host's codes: flashcl/opencl/arrays.py. */
#ifndef FLASHCL_KV_FORMATS_H
#define FLASHCL_KV_FORMATS_H

#include "target.h"

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
#define QUANT_BLOCK_BYTES(fmt) ((fmt) == QUANT_Q8_0 ? 2 + QUANT_BLOCK : 2 + QUANT_BLOCK / 2)  // d + quants

#if K_QUANT < 0 || K_QUANT > 3 || V_QUANT < 0 || V_QUANT > 3
#error "K_QUANT and V_QUANT must be 0 (plain), 1 (q8_0), 2 (q4_0) or 3 (int8)"
#endif
#if (K_QUANT == QUANT_Q8_0 || K_QUANT == QUANT_Q4_0) && HEAD_DK % QUANT_BLOCK != 0
#error "q8_0 / q4_0 K caches need HEAD_DK a multiple of 32 (ggml blocks)"
#endif
#if (V_QUANT == QUANT_Q8_0 || V_QUANT == QUANT_Q4_0) && HEAD_DV % QUANT_BLOCK != 0
#error "q8_0 / q4_0 V caches need HEAD_DV a multiple of 32 (ggml blocks)"
#endif

/* Dequantized values as flashcl.dequantize gives them: a float16 (bfloat16) cache's (STORE_HALF,
 * STORE_BF16: common.h) rounded to fp16 (bf16), as the oracle and the tensor-core kernels attend
 * them (left in float32, large logits made the half-ulp differences errors past the tolerance). */
#if STORE_HALF
#define FLASHCL_AS_STORED(N)                                                                 \
static inline float##N as_stored##N(const float##N x)                                        \
{                                                                                            \
    ushort h[N];  /* through a private array: no half arithmetic without cl_khr_fp16 */     \
    vstore_half##N##_rte(x, 0, (__private half *)h);                                         \
    return vload_half##N(0, (const __private half *)h);                                      \
}
#elif STORE_BF16
#define FLASHCL_AS_STORED(N)                                                                 \
static inline float##N as_stored##N(const float##N x)                                        \
{                                                                                            \
    return as_float##N(convert_uint##N(bf16_round##N(x)) << 16);                             \
}
#else
#define FLASHCL_AS_STORED(N) static inline float##N as_stored##N(const float##N x) { return x; }
#endif

/* x86 (a CPU driver's clang): the F16C conversions themselves, one instruction each way. PoCL's
 * vstore_half16_rte takes 256-bit halves with moves between them (docs/notes/pocl-decode.md);
 * FLASHCL_NO_F16C builds the OpenCL form instead (the tests run both). */
#if STORE_HALF && defined(__F16C__) && !defined(FLASHCL_NO_F16C)
#define FLASHCL_F16C 1
static inline float4 as_stored4(const float4 x)
{
    return __builtin_ia32_vcvtph2ps(__builtin_ia32_vcvtps2ph(x, 0));  /* 0: round to nearest even */
}
static inline float8 as_stored8(const float8 x)
{
    return __builtin_ia32_vcvtph2ps256(__builtin_ia32_vcvtps2ph256(x, 0));
}
#else
#define FLASHCL_F16C 0
FLASHCL_AS_STORED(4)
FLASHCL_AS_STORED(8)
#endif
#if FLASHCL_F16C && defined(__AVX512F__)
static inline float16 as_stored16(const float16 x)
{
    const short16 h = __builtin_ia32_vcvtps2ph512_mask(x, 0, (short16)(0), (ushort)0xFFFF);
    return __builtin_ia32_vcvtph2ps512_mask(h, (float16)(0.0f), (ushort)0xFFFF, 4);  /* 4: current mode */
}
#else
FLASHCL_AS_STORED(16)
#endif

/* A ggml block's d: its first two bytes, fp16 (block offsets are even, so the ushort read is
 * aligned). On CPUs through a vector conversion: PoCL's scalar vload_half is a routine of some
 * 20 instructions, its vector form one instruction. */
static inline float ggml_block_d(__global const uchar *blk)
{
#if FLASHCL_CPU_BUILD
    ushort4 bits = (ushort4)(*(__global const ushort *)blk);
    return vload_half4(0, (const __private half *)&bits).s0;
#else
    return vload_half(0, (__global const half *)blk);
#endif
}

#endif
