/* What the decode kernel files (decode.cl: GPUs, decode_cpu.cl: CPUs, decode_mma.cl: NVIDIA
 * tensor cores) share, so that the host launches any of them with one argument list: the parameters, the split's
 * key range, the address of a K/V row and the checks of the tables. Include after raw_t (one
 * 16-byte chunk) and store_t. */
#ifndef FLASHCL_DECODE_COMMON_H
#define FLASHCL_DECODE_COMMON_H

#ifndef PAGED
#define PAGED 0           // 1: paged cache addressed through block_table, 0: contiguous cache
#endif

#define DECODE_PARAMS                                                                        \
    __global const store_t *q, __global const raw_t *k, __global const raw_t *v,             \
    __global store_t *out, __global float *lse,                                              \
    __global float *part_m, __global float *part_l, __global float *part_acc,                \
    __global const int *block_table, __global const int *context_lens,                       \
    const int h_q, const int num_splits, const int bt_stride, const int block_shift,         \
    const int num_blocks, const int capacity, const float scale_log2,                        \
    const ulong q_off, const ulong q_sb, const ulong q_sh,                                   \
    const ulong k_off, const ulong k_s0, const ulong k_sh, const ulong k_s1,                 \
    const ulong v_off, const ulong v_s0, const ulong v_sh, const ulong v_s1,                 \
    const ulong o_off, const ulong o_sb, const ulong o_sh

#define DECODE_ARGS                                                                          \
    q, k, v, out, lse, part_m, part_l, part_acc, block_table, context_lens,                  \
    h_q, num_splits, bt_stride, block_shift, num_blocks, capacity, scale_log2, q_off, q_sb, q_sh, \
    k_off, k_s0, k_sh, k_s1, v_off, v_s0, v_sh, v_s1, o_off, o_sb, o_sh

/* ---- attention variants (flashcl/variants.py), each a compile-time flag: off costs nothing ---- */
#ifndef WINDOW
#define WINDOW 0          // 1: sliding window: the query at p = ctx - 1 sees keys [p - window_left, ctx)
#endif
#ifndef SOFTCAP
#define SOFTCAP 0         // 1: logit softcap, s = c tanh(s / c) (softcap_log2 = c log2(e))
#endif
#ifndef SINKS
#define SINKS 0           // 1: one sink logit per query head joins the normalizer (sinks[h_q])
#endif
#ifndef ALIBI
#define ALIBI 0           // 1: s -= slope[b, h] (p - j) (alibi_slopes[B][h_q])
#endif
#ifndef KEY_START
#define KEY_START 0       // 1: sequence b's keys start at key_start[b] (decode's key_start)
#endif
#ifndef QUERY_ROWS
#define QUERY_ROWS 1      // > 1: head h is row h % QUERY_ROWS of causal rows ending at the last key
#endif                    //   (a decode's rows, prefill's few-row route; export --decode-rows)
#ifndef ROW_MASK
#define ROW_MASK 0        // the rows' own mask (prefill's few-row route; not exported): 1 bool
#endif                    //   (uchar), 2 additive (float), [Bm][Hm][QUERY_ROWS][N_kv] by strides
#define DECODE_VARIANTS (WINDOW || SOFTCAP || SINKS || ALIBI || KEY_START || QUERY_ROWS > 1 || ROW_MASK)
#if KEY_START
#define KEY_START_PARAM , __global const int *key_start
#define KEY_START_ARG , key_start
#else
#define KEY_START_PARAM
#define KEY_START_ARG
#endif
#if ROW_MASK
#define ROW_MASK_T FLASHCL_CAT(ROW_MASK_TYPE_, ROW_MASK)
#define ROW_MASK_TYPE_1 uchar
#define ROW_MASK_TYPE_2 float
#define ROW_MASK_PARAM , __global const ROW_MASK_T *row_mask, const ulong rm_sb, const ulong rm_sh, const ulong rm_sq
#define ROW_MASK_ARG , row_mask, rm_sb, rm_sh, rm_sq
#else
#define ROW_MASK_PARAM
#define ROW_MASK_ARG
#endif

/* The variants' run-time values follow DECODE_PARAMS only in builds with a variant on, so the
 * plain kernels keep their argument list. */
#if DECODE_VARIANTS
#define VARIANT_PARAMS , const int window_left, const float softcap_log2,                    \
                         __global const float *sinks, __global const float *alibi_slopes KEY_START_PARAM \
                         ROW_MASK_PARAM
#define VARIANT_ARGS , window_left, softcap_log2, sinks, alibi_slopes KEY_START_ARG ROW_MASK_ARG
#else
#define VARIANT_PARAMS
#define VARIANT_ARGS
#endif

/* The first key the query of a sequence of n keys sees (with QUERY_ROWS, its first row): the
 * split-k ranges divide [first, n), so the keys left of a window are never read. */
#if WINDOW
#define FIRST_KEY(n) max(0, (n) - QUERY_ROWS - window_left)
#else
#define FIRST_KEY(n) 0
#endif
/* QUERY_ROWS: head h is causal row h % QUERY_ROWS of a sequence of n keys' last positions; its
 * position (the ALiBi distances' origin), whether it sees `key` (causal, and its own window's left
 * edge), and whether the rows see different keys in the tile of keys [t0, t0 + nt): only in the
 * last tiles (causal) and, with a window, in the first ones (its left edge moves with the row) */
#if QUERY_ROWS > 1
#define ROW_POS(h, n) ((n) - QUERY_ROWS + (h) % QUERY_ROWS)
#if WINDOW
#define ROW_SEES(h, key, n) ((key) <= ROW_POS(h, n) && (key) >= ROW_POS(h, n) - window_left)
#define ROWS_DIFFER(t0, nt, n) ((t0) + (nt) > (n) - (QUERY_ROWS - 1) || (t0) < (n) - 1 - window_left)
#else
#define ROW_SEES(h, key, n) ((key) <= ROW_POS(h, n))
#define ROWS_DIFFER(t0, nt, n) ((t0) + (nt) > (n) - (QUERY_ROWS - 1))
#endif
#else
#define ROW_POS(h, n) ((n) - 1)
#define ROW_SEES(h, key, n) true
#define ROWS_DIFFER(t0, nt, n) false
#endif
/* ROW_MASK: whether query head h (row h % QUERY_ROWS of prefill's head h / QUERY_ROWS) of
 * sequence `batch` may see `key` by its mask, and the mask's additive term (log2 units); the
 * mask may hide any key, so the rows differ in every tile */
#if ROW_MASK
#define ROW_MASK_AT(batch, h, key) row_mask[(ulong)(batch) * rm_sb + (ulong)((h) / QUERY_ROWS) * rm_sh \
                                            + (ulong)((h) % QUERY_ROWS) * rm_sq + (ulong)(key)]
#if ROW_MASK == 1
#define MASK_SEES(batch, h, key) (ROW_MASK_AT(batch, h, key) != 0)
#define MASK_ADD(batch, h, key) 0.0f
#else
#define MASK_SEES(batch, h, key) (ROW_MASK_AT(batch, h, key) > MASK_HIDES_AT)
#define MASK_ADD(batch, h, key) (ROW_MASK_AT(batch, h, key) * M_LOG2E_F)
#endif
#undef ROWS_DIFFER
#define ROWS_DIFFER(t0, nt, n) true
#else
#define MASK_SEES(batch, h, key) true
#define MASK_ADD(batch, h, key) 0.0f
#endif
/* every row: whether it sees `key` (its causal cut, window and mask) */
#define ROW_VISIBLE(batch, h, key, n) (ROW_SEES(h, key, n) && MASK_SEES(batch, h, key))

/* ... and of sequence `batch`, whose keys before key_start[batch] are hidden (a left-padded row) */
#if KEY_START
#define SEQ_FIRST_KEY(n, batch) max(FIRST_KEY(n), min(key_start[batch], (n)))
#else
#define SEQ_FIRST_KEY(n, batch) FIRST_KEY(n)
#endif

/* ALiBi slope of query head `head` in log2 units; 0 when ALiBi is off */
#if ALIBI
#define ALIBI_SLOPE_LOG2(batch, head) (alibi_slopes[(ulong)(batch) * h_q + (head)] * M_LOG2E_F)
#else
#define ALIBI_SLOPE_LOG2(batch, head) 0.0f
#endif

/* The sink logit of query head `head` in log2 units, where this state takes it (the single pass,
 * or split 0 of split-k: exactly once), else -inf, which adds nothing. */
#if SINKS
#define SINK_LOG2(head, takes) ((takes) ? sinks[head] * M_LOG2E_F : -INFINITY)
#else
#define SINK_LOG2(head, takes) (-INFINITY)
#endif

#if DECODE_NV_PTX
/* 2^x and 1/x as the bare MUFU instructions, the .ftz forms (NVIDIA's native_exp2 / native_recip
 * are the non-.ftz ones, each with a subnormal range check around it). 1 + 2^x is never
 * subnormal, and a subnormal 2^x flushed to 0 moves 1 + 2^x by less than half an ulp. */
static inline float exp2_approx(const float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
static inline float recip_approx(const float x)
{
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#else
#define exp2_approx native_exp2
#define recip_approx native_recip
#endif

#if SOFTCAP
#include "softcap.h"
/* `inv_cap` is 1 / c2, loop-invariant */
#define SOFTCAP_ARGS softcap_log2, 1.0f / softcap_log2
FLASHCL_SOFTCAP_FN(float, softcap_score, exp2_approx, recip_approx)
#define SOFTCAP_SCORE(s) softcap_score((s), SOFTCAP_ARGS)
#else
#define SOFTCAP_SCORE(s) (s)
#endif

/* ALiBi of a key `dist` positions before the query (log2 units) */
#if ALIBI
#define ALIBI_SCORE(s, slope_log2, dist) ((s) - (slope_log2) * (float)(dist))
#else
#define ALIBI_SCORE(s, slope_log2, dist) (s)
#endif

/* A score s (log2 units) with the variants that change it, in the order of flashcl/variants.py:
 * softcap, then ALiBi. */
#define SCORE_VARIANTS(s, slope_log2, dist) ALIBI_SCORE(SOFTCAP_SCORE(s), (slope_log2), (dist))

/* This split's keys [*k0, *k1) of the keys [first, n) a sequence's query sees: chunks of whole
 * tiles of `tile` keys, so that only the last tile is partial; a split past the end is empty
 * (k0 == k1). */
static inline void split_range(const int first, const int n, const int num_splits, const int split,
                               const int tile, int *k0, int *k1)
{
    const int per_split = (n - first + num_splits - 1) / num_splits;
    const int chunk = (per_split + tile - 1) / tile * tile;
    *k0 = first + min(split * chunk, n - first);
    *k1 = min(*k0 + chunk, n);
}

/* What every decode kernel's work-group starts with, for (batch, kv_head, split) in
 * scope: the sequence's context length as used (n_used; 0 where it is outside [0, capacity],
 * ctx_ok false, so no key is read), the split's keys [k0, k1) in whole tiles of `tile` keys, the
 * block-table row, the plain rows' bases (kv_rows) and the quantized rows' byte offsets of
 * (batch, KV head) relative to k_off / v_off. */
#define DECODE_SPAN(tile)                                                                    \
    int k0, k1;                                                                              \
    const int n_ctx = context_lens[batch];                                                   \
    const bool ctx_ok = context_ok(n_ctx, capacity);                                         \
    const int n_used = ctx_ok ? n_ctx : 0;                                                   \
    split_range(SEQ_FIRST_KEY(n_used, batch), n_used, num_splits, split, (tile), &k0, &k1);   \
    __global const int *bt_row = block_table + (ulong)batch * bt_stride;                     \
    __global const raw_t *k_base = kv_rows(k, k_off, k_s0, k_sh, batch, kv_head);            \
    __global const raw_t *v_base = kv_rows(v, v_off, v_s0, v_sh, batch, kv_head);            \
    const ulong k_rel = (PAGED ? 0 : batch * k_s0) + kv_head * k_sh;                         \
    const ulong v_rel = (PAGED ? 0 : batch * v_s0) + kv_head * v_sh;

/* Where the K (or V) rows of (batch, KV head) start, row_offset being relative to it: a paged
 * cache's blocks are shared by every sequence, so there the base is the cache's plus the head. */
static inline __global const raw_t *kv_rows(__global const raw_t *x, const ulong off, const ulong s0,
                                            const ulong sh, const int batch, const int kv_head)
{
#if PAGED
    return x + off + kv_head * sh;
#else
    return x + off + batch * s0 + kv_head * sh;
#endif
}

/* Device-resident tables are not checked by the host (a read-back would sync): a context length
 * outside [0, capacity] reads no key and starts the state as NaN, a block id outside
 * [0, num_blocks) is not read and its rows read as NaN; so a bad table shows as NaN out and lse. */
static inline bool context_ok(const int n, const int capacity)
{
    return n >= 0 && n <= capacity;
}

#if STORE_HALF
#define RAW_NAN ((raw_t)(0x7e007e00u))   /* 8 half NaNs */
#elif STORE_BF16
#define RAW_NAN ((raw_t)(0x7fc07fc0u))   /* 8 bfloat16 NaNs */
#else
#define RAW_NAN ((raw_t)(NAN))
#endif

/* the block-table entry of key j (PAGED; a contiguous cache has none: 0) */
static inline int table_entry(const int j, __global const int *bt_row, const int block_shift)
{
    return PAGED ? bt_row[j >> block_shift] : 0;
}

/* chunk offset (in raw_t units) of key j's row, whose table entry is `block`, relative to the
 * (batch, KV head) base; *ok is false where the block id is out of range (the row must not be
 * read) */
static inline ulong block_row_offset(const int block, const int j, const int block_shift,
                                     const int num_blocks, const ulong s0, const ulong s1, bool *ok)
{
#if PAGED
    *ok = (uint)block < (uint)num_blocks;  /* one compare: a negative id is a large uint */
    return (ulong)block * s0 + (ulong)(j & ((1 << block_shift) - 1)) * s1;
#else
    *ok = true;
    return (ulong)j * s1;
#endif
}

static inline ulong row_offset(const int j, __global const int *bt_row, const int block_shift,
                               const int num_blocks, const ulong s0, const ulong s1, bool *ok)
{
    return block_row_offset(table_entry(j, bt_row, block_shift), j, block_shift, num_blocks, s0, s1, ok);
}

/* chunk `part` of key j's K or V row; NaN where the row's block id is out of range */
static inline raw_t load_chunk(__global const raw_t *rows, const int j, __global const int *bt_row,
                               const int block_shift, const int num_blocks, const ulong s0,
                               const ulong s1, const int part)
{
    bool ok;
    const ulong off = row_offset(j, bt_row, block_shift, num_blocks, s0, s1, &ok);
    return ok ? rows[off + part] : RAW_NAN;
}

/* ---- quantized K/V caches (flashcl/quant.py, docs/quantized-formats.md) -------------------------
 * A quantized cache is read as bytes: offsets and strides in bytes, rows contiguous. A work-item
 * dequantizes pieces of QPIECE consecutive dims (8, or 4 in decode.cl's fp32 builds: the dims it
 * would read of a plain row) from the row's own bytes: q8_0 and q4_0 take their 2-byte aligned
 * piece of a ggml block (34 / 18 bytes: fp16 d, then int8 values / nibble pairs j, j + 16) and the
 * block's d, int8 its QPIECE-byte aligned values and the row's float32 scale (k_scales / v_scales,
 * one per row, at the row's byte offset / D), kept as loaded (qpiece_t) until they are used.
 * Include-site: QPIECE defined. */
#include "kv_formats.h"
#define QUANT_SCALED (K_QUANT == QUANT_INT8 || V_QUANT == QUANT_INT8)

/* int8 scales follow DECODE_PARAMS (and VARIANT_PARAMS) only in builds that read them */
#if QUANT_SCALED
#define QUANT_PARAMS , __global const float *k_scales, __global const float *v_scales,         \
                       const ulong ks_off, const ulong vs_off
#define QUANT_ARGS , k_scales, v_scales, ks_off, vs_off
#define K_SCALES k_scales, ks_off
#define V_SCALES v_scales, vs_off
#else
#define QUANT_PARAMS
#define QUANT_ARGS
#define K_SCALES (__global const float *)0, 0
#define V_SCALES (__global const float *)0, 0
#endif

#if STORE_2B
#define RAW_OF_BITS(x) (x)
#define BITS_OF_RAW(x) (x)
#else
#define RAW_OF_BITS(x) as_float4(x)
#define BITS_OF_RAW(x) as_uint4(x)
#endif

/* A piece of a quantized row as loaded: nothing reads a loaded register at the load, so the
 * prefetch of the next tile stays in flight as for plain rows (a GPU issues in order and waits at
 * the first instruction that reads a load's result: packing the bytes there made every ggml
 * prefetch wait, docs/notes/opencl-decode-nvidia.md). int8: r is the packed piece (quant bytes,
 * scale bits); ggml: r holds the piece's 2-byte quant words one per slot, d the block's d bits,
 * shift the q4_0 nibble shift. qpacked() packs it where it is used. */
typedef struct { raw_t r; uint d, shift; } qpiece_t;

/* The piece of key j's quantized row at dims [e, e + QPIECE); its scale is NaN where the row's
 * block id is out of range (not read). `rel` is the (batch, KV head) base, in bytes. */
static inline qpiece_t load_quant(const int fmt, const int dim, __global const uchar *data, const ulong off,
                                  const ulong rel, __global const float *scales, const ulong s_off,
                                  const int j, __global const int *bt_row, const int block_shift,
                                  const int num_blocks, const ulong s0, const ulong s1, const int e)
{
    bool ok;
    const ulong row = rel + row_offset(j, bt_row, block_shift, num_blocks, s0, s1, &ok);
    uint4 r = (uint4)(0u, 0u, as_uint(NAN), 0u);
    qpiece_t q;
    q.d = 0x7e00u;   /* fp16 NaN */
    q.shift = 0u;
    if (ok) {
        __global const uchar *p = data + off + row;
        if (fmt == QUANT_INT8) {
            r.z = as_uint(scales[s_off + row / dim]);
#if QPIECE == 8
            r.xy = *(__global const uint2 *)(p + e);
#else
            r.x = *(__global const uint *)(p + e);
#endif
        } else {
            __global const uchar *blk = p + (e / QUANT_BLOCK) * QUANT_BLOCK_BYTES(fmt);
            int at = e % QUANT_BLOCK;
            q.d = *(__global const ushort *)blk;
            if (fmt == QUANT_Q4_0) {  /* dims 16..31 of a block are the high nibbles of bytes 0..15 */
                q.shift = (at >= 16) ? 4u : 0u;
                at %= 16;
            }
            __global const ushort *u = (__global const ushort *)(blk + 2 + at);
            r.x = u[0];
            r.y = u[1];
#if QPIECE == 8
            r.z = u[2];
            r.w = u[3];
#endif
        }
    }
    q.r = RAW_OF_BITS(r);
    return q;
}

/* A loaded piece packed as dequant takes it: .x (.y) its quant bytes, .z the scale's bits, .w
 * the q4_0 nibble shift (fmt 0: a plain chunk, as loaded) */
static inline raw_t qpacked(const int fmt, const qpiece_t q)
{
    if (fmt != QUANT_Q8_0 && fmt != QUANT_Q4_0)
        return q.r;
    const uint4 w = BITS_OF_RAW(q.r);
    const ushort d16 = (ushort)q.d;
    const float d = vload_half(0, (const __private half *)&d16);
    return RAW_OF_BITS((uint4)(w.x | (w.y << 16), w.z | (w.w << 16), as_uint(d), q.shift));
}

/* a plain chunk where the build's chunks are pieces (one side quantized) */
static inline qpiece_t qpiece_of(const raw_t x)
{
    qpiece_t q;
    q.r = x;
    q.d = 0u;
    q.shift = 0u;
    return q;
}

/* the QPIECE values of a piece load_quant packed (keys past the split's end: all zero, scale 0),
 * as flashcl.dequantize gives them (as_stored) */
static inline FLASHCL_CAT(float, QPIECE) dequant(const int fmt, const raw_t raw)
{
    const uint4 r = BITS_OF_RAW(raw);
    const float scale = as_float(r.z);
#if QPIECE == 8
    if (fmt == QUANT_Q4_0)
        return as_stored8((convert_float8((as_uchar8(r.xy) >> (uchar8)((uchar)r.w)) & (uchar8)(15)) - 8.0f) * scale);
    return as_stored8(convert_float8(as_char8(r.xy)) * scale);
#else
    if (fmt == QUANT_Q4_0)
        return as_stored4((convert_float4((as_uchar4(r.x) >> (uchar4)((uchar)r.w)) & (uchar4)(15)) - 8.0f) * scale);
    return as_stored4(convert_float4(as_char4(r.x)) * scale);
#endif
}

#if DECODE_NV_PTX
/* x of the work-item whose lane in the 32-wide NVIDIA warp is this one's lane xor mask (inline
 * PTX: OpenCL 1.2 has no subgroup shuffles); the whole warp must call it together. */
static inline float warp_xor(const float x, const int mask)
{
    float y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(mask));
    return y;
}

/* x of the work-item in lane `src` of this one's 32-wide warp; the whole warp calls it together */
static inline float warp_idx(const float x, const int src)
{
    float y;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(src));
    return y;
}
#endif

#endif
