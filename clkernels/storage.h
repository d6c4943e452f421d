/* Storage type vs compute type (docs/design.md §4): data may be stored as half or bfloat16,
 * arithmetic is float32.
 * Half data is read and written with vload_halfN/vstore_halfN, which every OpenCL 1.2 device has,
 * so no kernel here needs cl_khr_fp16; bfloat16 data as ushort bits (common.h: BF16_LOAD, BF16_STORE).
 *
 *   store_t          element type of the global buffers
 *   LOAD4(p, i)      float4 from elements p[4i .. 4i+3]
 *   STORE4(x, i, p)  float4 x to elements p[4i .. 4i+3] (rounded to nearest even for 2-byte types)
 *   stage_transposed a block of rows into local memory, transposed (see below)
 */
#ifndef FLASHCL_STORAGE_H
#define FLASHCL_STORAGE_H

#if STORE_HALF
typedef half store_t;
#define LOAD4(p, i) vload_half4((i), (p))
#define STORE4(x, i, p) vstore_half4_rte((x), (i), (p))
#elif STORE_BF16
typedef ushort store_t;
#define LOAD4(p, i) BF16_LOAD(4, (i), (p))
#define STORE4(x, i, p) BF16_STORE(4, (x), (i), (p))
#else
typedef float store_t;
#define LOAD4(p, i) vload4((i), (p))
#define STORE4(x, i, p) vstore4((x), (i), (p))
#endif

/* Stage rows [first, first + rows) of a row-major block (row stride `stride` elements, `dim`
 * columns, dim % 4 == 0) into local memory TRANSPOSED: dst[col * rows + r], as float32. Rows at or
 * past `limit` are zeros, never garbage (p * garbage could be NaN). Work-items lid, lid + wg, ...
 * share the work with r varying fastest, so consecutive work-items store to consecutive banks. */
static inline void stage_transposed(__local float *dst, __global const store_t *src, const ulong stride,
                                    const int first, const int limit, const int rows, const int dim,
                                    const float scale, const int lid, const int wg)
{
    for (int i = lid; i < rows * (dim / 4); i += wg) {
        const int r = i % rows, c = i / rows;
        const float4 x = (first + r < limit) ? LOAD4(src + (ulong)(first + r) * stride, c) * scale
                                             : (float4)(0.0f);
        dst[(4 * c + 0) * rows + r] = x.x;
        dst[(4 * c + 1) * rows + r] = x.y;
        dst[(4 * c + 2) * rows + r] = x.z;
        dst[(4 * c + 3) * rows + r] = x.w;
    }
}

#endif
