/* Storage type vs compute type (DESIGN.md §4): data may be stored as half, arithmetic is float32.
 * Half data is read and written with vload_halfN/vstore_halfN, which every OpenCL 1.2 device has,
 * so no kernel here needs cl_khr_fp16.
 *
 *   store_t          element type of the global buffers
 *   LOAD4(p, i)      float4 from elements p[4i .. 4i+3]
 *   STORE4(x, i, p)  float4 x to elements p[4i .. 4i+3] (round to nearest even for half)
 */
#ifndef FLASHCL_STORAGE_H
#define FLASHCL_STORAGE_H

#if STORE_HALF
typedef half store_t;
#define LOAD4(p, i) vload_half4((i), (p))
#define STORE4(x, i, p) vstore_half4_rte((x), (i), (p))
#else
typedef float store_t;
#define LOAD4(p, i) vload4((i), (p))
#define STORE4(x, i, p) vstore4((x), (i), (p))
#endif

#endif
