/* Quantized K/V rows (flashcl/quant.py, docs/quantized-formats.md), dequantized to float32 (the
 * values flashcl.dequantize gives: as_stored4) as the prefill kernels stage them into local
 * memory. K_QUANT / V_QUANT pick each cache's format at compile time; 0 (the default) is a plain
 * store_t cache and leaves the kernels as they are.
 *
 * A quantized cache is read as bytes (offsets and strides in bytes); each row of D values holds:
 *
 *   q8_0 (1)  D/32 blocks of 34 bytes      | d fp16 | qs[0] .. qs[31] int8 |      value = d * qs[e]
 *   q4_0 (2)  D/32 blocks of 18 bytes      | d fp16 | byte i = q[i] | q[i + 16] << 4, i < 16 |
 *                                                                            value = d * (q[e] - 8)
 *   int8 (3)  D int8 bytes, and one float32 scale per row   value = scale * qs[e]
 *
 * (d little-endian, ggml's block_q8_0 / block_q4_0.) An int8 row's scale lies at scales[row byte
 * offset / D]: the host passes scales laid out like the rows (flashcl/opencl/prefill.py). */
#ifndef FLASHCL_KV_QUANT_H
#define FLASHCL_KV_QUANT_H

#include "kv_formats.h"

/* Dims [e, e + 4) of the ggml block at blk (e a multiple of 4), whose fp16 d is `d` */
static inline float4 ggml_values4(const int fmt, __global const uchar *blk, const int e, const float d)
{
    if (fmt == QUANT_Q8_0)
        return as_stored4(convert_float4(vload4(0, (__global const char *)(blk + 2 + e))) * d);
    /* q4_0: dims 0..15 are the low nibbles of bytes 0..15, dims 16..31 their high nibbles */
    const uchar4 b = vload4(0, blk + 2 + e % (QUANT_BLOCK / 2));
    const uchar4 q = (e < QUANT_BLOCK / 2) ? (b & (uchar4)(0x0F)) : (b >> (uchar4)(4));
    return as_stored4((convert_float4(q) - 8.0f) * d);
}

/* Dims [4c, 4c + 4) of a quantized row as float32; row_scale is the int8 row's scale (unused by
 * the ggml formats, whose d sits in each block). fmt is a compile-time constant at every call. */
static inline float4 dequant4(const int fmt, __global const uchar *row, const int c, const float row_scale)
{
    if (fmt == QUANT_INT8)
        return as_stored4(convert_float4(vload4(c, (__global const char *)row)) * row_scale);
    __global const uchar *blk = row + (c / (QUANT_BLOCK / 4)) * QUANT_BLOCK_BYTES(fmt);
    return ggml_values4(fmt, blk, 4 * (c % (QUANT_BLOCK / 4)), ggml_block_d(blk));
}

/* The 32 values of block `blk` of a ggml row (q8_0, q4_0) as float32 into x, reading d once */
static inline void dequant_block(const int fmt, __global const uchar *row, const int blk, float *x)
{
    __global const uchar *p = row + blk * QUANT_BLOCK_BYTES(fmt);
    const float d = ggml_block_d(p);
    for (int c = 0; c < QUANT_BLOCK / 4; ++c)
        vstore4(ggml_values4(fmt, p, 4 * c, d), c, x);
}

/* The values of row r (`first + r`, of `stride` bytes) at dims [4c, 4c + 4): zeros at or past
 * `limit`, which are never read; row_scales: the int8 scales of the rows, scale_stride apart. */
static inline float4 quant_row4(const int fmt, __global const uchar *src, const ulong stride,
                                __global const float *row_scales, const ulong scale_stride,
                                const int row, const int limit, const int c)
{
    if (row >= limit)
        return (float4)(0.0f);
    return dequant4(fmt, src + (ulong)row * stride, c,
                    (fmt == QUANT_INT8) ? row_scales[(ulong)row * scale_stride] : 1.0f);
}

/* storage.h's stage_transposed for a quantized source: rows [first, first + rows) of `dim`
 * values into dst[col * rows + r] as float32, rows at or past `limit` as zeros. ggml rows go a
 * block per step, int8 rows (any dim) 4 values per step; r varies fastest across work-items. */
static inline void stage_quant_transposed(const int fmt, __local float *dst, __global const uchar *src,
                                          const ulong stride, __global const float *row_scales,
                                          const ulong scale_stride, const int first, const int limit,
                                          const int rows, const int dim, const int lid, const int wg)
{
    if (fmt != QUANT_INT8) {
        for (int i = lid; i < rows * (dim / QUANT_BLOCK); i += wg) {
            const int r = i % rows, blk = i / rows;
            float x[QUANT_BLOCK] = {0.0f};
            if (first + r < limit)
                dequant_block(fmt, src + (ulong)(first + r) * stride, blk, x);
            for (int e = 0; e < QUANT_BLOCK; ++e)
                dst[(QUANT_BLOCK * blk + e) * rows + r] = x[e];
        }
        return;
    }
    for (int i = lid; i < rows * (dim / 4); i += wg) {
        const int r = i % rows, c = i / rows;
        const float4 x = quant_row4(fmt, src, stride, row_scales, scale_stride, first + r, limit, c);
        dst[(4 * c + 0) * rows + r] = x.x;
        dst[(4 * c + 1) * rows + r] = x.y;
        dst[(4 * c + 2) * rows + r] = x.z;
        dst[(4 * c + 3) * rows + r] = x.w;
    }
}

/* Rows [first, first + rows), dims [col0, col0 + cols) (col0 a multiple of cols), into
 * dst[r * cols + col] as float32 (not transposed), rows at or past `limit` as zeros: ggml rows a
 * block per step where whole blocks give every work-item one (the step count of the plain
 * kernels' V loop otherwise: with fewer steps than work-items, prefill_tiles.cl's V tiles came
 * out wrong on PoCL's CPU driver at -O2, plain caches included), else 4 values per step. */
static inline void stage_quant_rows(const int fmt, __local float *dst, __global const uchar *src,
                                    const ulong stride, __global const float *row_scales,
                                    const ulong scale_stride, const int first, const int limit,
                                    const int rows, const int col0, const int cols, const int lid, const int wg)
{
    if (fmt != QUANT_INT8 && cols % QUANT_BLOCK == 0 && rows * (cols / QUANT_BLOCK) >= wg) {
        const int blocks = cols / QUANT_BLOCK;
        for (int i = lid; i < rows * blocks; i += wg) {
            const int r = i / blocks, b = i % blocks;
            float x[QUANT_BLOCK] = {0.0f};
            if (first + r < limit)
                dequant_block(fmt, src + (ulong)(first + r) * stride, col0 / QUANT_BLOCK + b, x);
            for (int c = 0; c < QUANT_BLOCK / 4; ++c)
                vstore4(vload4(c, x), QUANT_BLOCK / 4 * i + c, dst);
        }
        return;
    }
    for (int i = lid; i < rows * (cols / 4); i += wg) {
        const int r = i / (cols / 4), c = i % (cols / 4);
        vstore4(quant_row4(fmt, src, stride, row_scales, scale_stride, first + r, limit, col0 / 4 + c), i, dst);
    }
}

#endif
