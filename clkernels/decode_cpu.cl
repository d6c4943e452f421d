/* flashcl decode laid out for CPUs: decode.cl's kernels (same arguments, same outputs and split
 * states, merged by decode.cl's flash_decode_merge), one work-item per work-group.
 *
 * Why: decode.cl spreads a K row over 16 work-items and sums their partial dot products through
 * local memory with two barriers per tile. A CPU driver (PoCL) runs a work-group as loops over
 * its work-items, one loop per barrier-free region, with every value live across a barrier kept
 * in memory: at (1, 32/8, 1k, 128) fp32 decode.cl took 6.4 ms on two cores where torch's CPU
 * attention took 1.0 ms (docs/notes/pocl-decode.md). Here one work-item serves one
 * (sequence, KV head, split) and its whole GQA group: it reads each K/V row once, whole, in
 * vector types the CPU compiler maps to SIMD registers, and no value crosses a work-item. A group
 * of more heads (query rows count as heads) than one work-item keeps in L1 is served GROUP_TILE
 * heads a work-group, each tile reading the rows again.
 *
 * Per tile of BLOCK_N keys: the scores of every head of the group for each key (one pass over the
 * key's row), the variants' changes, one online-softmax step per head (one rescale a tile), then
 * acc = alpha acc + p v one vector column at a time. Numerics, tables, variants and quantized rows as decode.cl
 * (decode_common.h): scores in log2 units, fp32 accumulation, keys past the split's end never
 * read, a bad context length or block id gives NaN out and lse, a sink joins the single pass or
 * split 0's state.
 */

/* ---- tunables ------------------------------------------------------------------------------ */
#ifndef BLOCK_N
#define BLOCK_N 8         // keys per online-softmax step (1..64)
#endif

#include "common.h"   /* HEAD_DK, HEAD_DV (required), STORE_HALF, STORE_BF16 */
#ifndef GROUP
#error "GROUP (query heads per KV head, H_q / H_kv) must be defined by the host"
#endif
#if BLOCK_N < 1 || BLOCK_N > 64
#error "BLOCK_N must be in 1..64"
#endif

#ifndef VEC
#define VEC 8             // floats per vector operation: 4, 8 or 16 (dividing both head dims)
#endif
#ifndef GROUP_TILE
#define GROUP_TILE GROUP  // query heads of the group (GQA heads x query rows) one work-item serves
#endif
#define GROUP_TILES ((GROUP + GROUP_TILE - 1) / GROUP_TILE)  // work-groups per KV head
#if GROUP_TILE < 1 || GROUP_TILE > GROUP
#error "GROUP_TILE must be in 1..GROUP"
#endif

#if STORE_HALF
typedef uint4 raw_t;      // a 16-byte chunk (decode_common.h's row addressing counts in them)
typedef half store_t;
#define LOADV(p, i) FLASHCL_CAT(vload_half, VEC)((i), (p))
#define STOREV(x, i, p) FLASHCL_CAT(FLASHCL_CAT(vstore_half, VEC), _rte)((x), (i), (p))
#elif STORE_BF16
typedef uint4 raw_t;
typedef ushort store_t;   // bfloat16 bits
#define LOADV(p, i) BF16_LOAD(VEC, (i), (p))
#define STOREV(x, i, p) BF16_STORE(VEC, (x), (i), (p))
#else
typedef float4 raw_t;
typedef float store_t;
#define LOADV(p, i) FLASHCL_CAT(vload, VEC)((i), (p))
#define STOREV(x, i, p) FLASHCL_CAT(vstore, VEC)((x), (i), (p))
#endif
#include "vec.h"   /* floatV, HSUM_V */
#define CK (HEAD_DK / VEC)                // vectors per K row
#define CV (HEAD_DV / VEC)                // vectors per V row

#if VEC != 4 && VEC != 8 && VEC != 16
#error "VEC must be 4, 8 or 16"
#endif
#if HEAD_DK % VEC != 0 || HEAD_DV % VEC != 0
#error "VEC must divide both head dims"
#endif
#if STORE_2B && VEC == 4
#error "2-byte rows are read 8 values at a time at least (16-byte chunks)"
#endif

/* The loops over the group's heads and over a row's vectors are unrolled here: PoCL's LLVM left
 * them rolled, which kept dot[] and a[] in memory, each FMA waiting on the previous one's store
 * (docs/notes/pocl-decode.md) */
#define FLASHCL_UNROLL _Pragma("unroll")

#define QPIECE 8          // decode_common.h's load_quant piece (unused here: quant_vec reads rows)
#include "decode_common.h"

typedef __global const store_t *plain_row_t;

/* The first element of key j's plain row, or NULL where its block id is out of range */
static inline plain_row_t row_at(__global const raw_t *rows, const int j, __global const int *bt_row,
                                 const int block_shift, const int num_blocks, const ulong s0, const ulong s1)
{
    bool ok;
    const ulong off = row_offset(j, bt_row, block_shift, num_blocks, s0, s1, &ok);
    return ok ? (plain_row_t)(rows + off) : (plain_row_t)0;
}

/* A quantized row of key j: its first byte (NULL where its block id is out of range) and, int8,
 * its float32 scale (kept with the row, at the row's byte offset / dim); `rel` is the
 * (batch, KV head) base in bytes. */
typedef struct { __global const uchar *p; float scale; } qrow_t;

static inline qrow_t qrow_at(const int fmt, const int dim, __global const uchar *data, const ulong off,
                             const ulong rel, __global const float *scales, const ulong s_off, const int j,
                             __global const int *bt_row, const int block_shift, const int num_blocks,
                             const ulong s0, const ulong s1)
{
    bool ok;
    const ulong row = rel + row_offset(j, bt_row, block_shift, num_blocks, s0, s1, &ok);
    qrow_t r;
    r.p = ok ? data + off + row : (__global const uchar *)0;
    r.scale = (ok && fmt == QUANT_INT8) ? scales[s_off + row / dim] : 0.0f;
    return r;
}

#define ucharV FLASHCL_CAT(uchar, VEC)
#define AS_STORED_V FLASHCL_CAT(as_stored, VEC)

/* dims [e, e + VEC) of a quantized row, as flashcl.dequantize gives them (NaN for a bad block):
 * one vector load of the values (VEC divides the 32 of a ggml block, so they lie in one block)
 * and the block's d or the row's scale, no per-piece packing (decode.cl's pieces are a GPU's) */
static inline floatV quant_vec(const int fmt, const qrow_t r, const int e)
{
    if (!r.p)
        return (floatV)(NAN);
    if (fmt == QUANT_INT8)
        return AS_STORED_V(FLASHCL_CAT(convert_float, VEC)(FLASHCL_CAT(vload, VEC)(0, (__global const char *)(r.p + e)))
                           * r.scale);
    __global const uchar *blk = r.p + (e / QUANT_BLOCK) * QUANT_BLOCK_BYTES(fmt);
    const float d = ggml_block_d(blk);
    const int at = e % QUANT_BLOCK;
    if (fmt == QUANT_Q8_0)
        return AS_STORED_V(FLASHCL_CAT(convert_float, VEC)(FLASHCL_CAT(vload, VEC)(0, (__global const char *)(blk + 2 + at)))
                           * d);
    /* q4_0: dims 16..31 of a block are the high nibbles of bytes 0..15 */
    const ucharV b = (FLASHCL_CAT(vload, VEC)(0, blk + 2 + at % 16) >> (ucharV)(at >= 16 ? 4 : 0)) & (ucharV)(15);
    return AS_STORED_V((FLASHCL_CAT(convert_float, VEC)(b) - 8.0f) * d);
}

/* key j's K (V) row, found once a key (ROW_T its type), its vector c as floats (a plain row's,
 * NaN for a bad block id, or a quantized row's, dequantized), and its first byte and size (the
 * prefetch's) */
#define QROW_BYTES(fmt, dim) ((fmt) == QUANT_INT8 ? (dim) : (dim) / QUANT_BLOCK * QUANT_BLOCK_BYTES(fmt))
#if K_QUANT
#define K_ROW_T qrow_t
#define K_ROW(j) qrow_at(K_QUANT, HEAD_DK, (__global const uchar *)k, k_off, k_rel, K_SCALES, (j), bt_row, \
                         block_shift, num_blocks, k_s0, k_s1)
#define K_VEC(row, c) quant_vec(K_QUANT, (row), VEC * (c))
#define K_ROW_PTR(row) ((row).p)
#define K_ROW_BYTES QROW_BYTES(K_QUANT, HEAD_DK)
#else
#define K_ROW_T plain_row_t
#define K_ROW(j) row_at(k_base, (j), bt_row, block_shift, num_blocks, k_s0, k_s1)
#define K_VEC(row, c) ((row) ? LOADV((row), (c)) : (floatV)(NAN))
#define K_ROW_PTR(row) ((__global const uchar *)(row))
#define K_ROW_BYTES (HEAD_DK * (int)sizeof(store_t))
#endif
#if V_QUANT
#define V_ROW_T qrow_t
#define V_ROW(j) qrow_at(V_QUANT, HEAD_DV, (__global const uchar *)v, v_off, v_rel, V_SCALES, (j), bt_row, \
                         block_shift, num_blocks, v_s0, v_s1)
#define V_VEC(row, c) quant_vec(V_QUANT, (row), VEC * (c))
#define V_ROW_PTR(row) ((row).p)
#define V_ROW_BYTES QROW_BYTES(V_QUANT, HEAD_DV)
#else
#define V_ROW_T plain_row_t
#define V_ROW(j) row_at(v_base, (j), bt_row, block_shift, num_blocks, v_s0, v_s1)
#define V_VEC(row, c) ((row) ? LOADV((row), (c)) : (floatV)(NAN))
#define V_ROW_PTR(row) ((__global const uchar *)(row))
#define V_ROW_BYTES (HEAD_DV * (int)sizeof(store_t))
#endif

/* PREFETCH: how many tiles ahead rows are prefetched, where the compiler lowers a prefetch to an
 * instruction (a CPU's clang); 0 elsewhere (compiled out). 1, 2 and 4 timed alike on PoCL. */
#include "target.h"
#ifndef PREFETCH
#define PREFETCH FLASHCL_CPU_BUILD
#endif
#if PREFETCH
/* every 64-byte line a row touches, from the line its first byte is in (quantized rows are not
 * line-aligned); none for a bad block id's NULL */
#define PREFETCH_ROW(ptr, bytes)                                        \
    do {                                                                \
        __global const uchar *p_ = (ptr);                               \
        if (p_)                                                         \
            for (int b_ = -(int)((ulong)p_ & 63); b_ < (bytes); b_ += 64) \
                __builtin_prefetch(p_ + b_);                            \
    } while (0)
#endif

/* A whole tile of scores as one vector where BLOCK_N is a vector width: exp2 and the softcap on
 * it are one vector libm call each, not one call a score (docs/notes/pocl-decode.md) */
#define TILE_VECTOR (BLOCK_N == 4 || BLOCK_N == 8 || BLOCK_N == 16)
#if TILE_VECTOR
#define floatT FLASHCL_CAT(float, BLOCK_N)
#define LOAD_TILE(p) FLASHCL_CAT(vload, BLOCK_N)(0, (p))
#define STORE_TILE(x, p) FLASHCL_CAT(vstore, BLOCK_N)((x), 0, (p))
#if SOFTCAP
FLASHCL_SOFTCAP_FN(floatT, softcap_tile, native_exp2, native_recip)  /* softcap_score, lane by lane */
#endif
#endif

/* query head of tile head h: padding heads past the group's end read the last head's */
#define HEAD(h) (head0 + min((h), heads - 1))

static inline void decode_body(DECODE_PARAMS VARIANT_PARAMS QUANT_PARAMS, const bool partial)
{
    const int split = get_group_id(0);
    const int kv_head = get_group_id(1) / GROUP_TILES;
    const int batch = get_group_id(2);
    const int tile = get_group_id(1) % GROUP_TILES;
    const int head0 = kv_head * GROUP + tile * GROUP_TILE;
    const int heads = min(GROUP_TILE, GROUP - tile * GROUP_TILE);  /* the last tile's may be fewer */

    DECODE_SPAN(BLOCK_N)  /* k0, k1, n_used, ctx_ok, bt_row, k_base, v_base, k_rel, v_rel */

    /* q pre-scaled into the log2 domain; the empty state, or NaN for a bad context length */
    floatV qv[GROUP_TILE][CK], acc[GROUP_TILE][CV];
    float m[GROUP_TILE], l[GROUP_TILE], slope[GROUP_TILE];
    for (int h = 0; h < GROUP_TILE; ++h) {  /* padding heads (h >= heads): the last head's, not stored */
        __global const store_t *q_row = q + q_off + batch * q_sb + HEAD(h) * q_sh;
        for (int c = 0; c < CK; ++c)
            qv[h][c] = LOADV(q_row, c) * scale_log2;
        for (int c = 0; c < CV; ++c)
            acc[h][c] = (floatV)(ctx_ok ? 0.0f : NAN);
        m[h] = -INFINITY;
        l[h] = ctx_ok ? 0.0f : NAN;
        slope[h] = ALIBI_SLOPE_LOG2(batch, HEAD(h));
    }

    for (int t0 = k0; t0 < k1; t0 += BLOCK_N) {
        const int nt = min(BLOCK_N, k1 - t0);
        float s[GROUP_TILE][BLOCK_N];
        for (int u = 0; u < nt; ++u) {
            const int key = t0 + u;
            floatV dot[GROUP_TILE];
            FLASHCL_UNROLL for (int h = 0; h < GROUP_TILE; ++h)
                dot[h] = (floatV)(0.0f);
            const K_ROW_T row = K_ROW(key);
#if PREFETCH
            /* the rows a tile ahead on their way, one key's at a time between the FMAs: a paged
             * head's rows lie kilobytes apart, where the CPU's own prefetchers do not follow */
            if (key + BLOCK_N * PREFETCH < k1) {
                PREFETCH_ROW(K_ROW_PTR(K_ROW(key + BLOCK_N * PREFETCH)), K_ROW_BYTES);
                PREFETCH_ROW(V_ROW_PTR(V_ROW(key + BLOCK_N * PREFETCH)), V_ROW_BYTES);
            }
#endif
            FLASHCL_UNROLL for (int c = 0; c < CK; ++c) {
                const floatV kf = K_VEC(row, c);
                FLASHCL_UNROLL for (int h = 0; h < GROUP_TILE; ++h)
                    dot[h] = fma(qv[h][c], kf, dot[h]);
            }
            FLASHCL_UNROLL for (int h = 0; h < GROUP_TILE; ++h)
                s[h][u] = HSUM_V(dot[h]);
        }
#if SOFTCAP || ALIBI
        /* the variants that change a score, in SCORE_VARIANTS' order: softcap, then ALiBi */
        for (int h = 0; h < GROUP_TILE; ++h) {
#if SOFTCAP && TILE_VECTOR
            if (nt == BLOCK_N)
                STORE_TILE(softcap_tile(LOAD_TILE(s[h]), SOFTCAP_ARGS), s[h]);
            else
#endif
                for (int u = 0; u < nt; ++u)
                    s[h][u] = SOFTCAP_SCORE(s[h][u]);
            for (int u = 0; u < nt; ++u)
                s[h][u] = ALIBI_SCORE(s[h][u], slope[h], ROW_POS(HEAD(h), n_used) - (t0 + u));
        }
#endif
        const bool rows_differ = ROWS_DIFFER(t0, nt, n_used);
        if (rows_differ)
            for (int h = 0; h < GROUP_TILE; ++h)
                for (int u = 0; u < nt; ++u)
                    s[h][u] = ROW_VISIBLE(batch, HEAD(h), t0 + u, n_used)
                              ? s[h][u] + MASK_ADD(batch, HEAD(h), t0 + u) : -INFINITY;
        /* one online-softmax step per head: the rescale of acc to the tile's max (alpha), then
         * p = 2^(s - m) in place of the scores */
        float alpha[GROUP_TILE];
        for (int h = 0; h < GROUP_TILE; ++h) {
            float tile_max = -INFINITY;
            for (int u = 0; u < nt; ++u)
                tile_max = fmax(tile_max, s[h][u]);
            const float m_new = fmax(m[h], tile_max);
            const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;  /* nothing seen: no inf - inf */
            alpha[h] = exp2(m[h] - m_use);
            l[h] *= alpha[h];
#if TILE_VECTOR
            if (nt == BLOCK_N)
                STORE_TILE(exp2(LOAD_TILE(s[h]) - m_use), s[h]);
            else
#endif
            for (int u = 0; u < nt; ++u)
                s[h][u] = exp2(s[h][u] - m_use);
            for (int u = 0; u < nt; ++u)
                l[h] += s[h][u];
            m[h] = m_new;
        }
        /* acc = alpha acc + p v, one vector column at a time: the group's accumulators of that
         * column stay in registers over the tile's keys (one load and store of acc a tile, not
         * one a key: a CPU stores once a cycle) */
        V_ROW_T vrow[BLOCK_N];
        for (int u = 0; u < nt; ++u)
            vrow[u] = V_ROW(t0 + u);
        for (int c = 0; c < CV; ++c) {
            floatV a[GROUP_TILE];
            FLASHCL_UNROLL for (int h = 0; h < GROUP_TILE; ++h)
                a[h] = acc[h][c] * alpha[h];
            for (int u = 0; u < nt; ++u) {
                const floatV vf = V_VEC(vrow[u], c);
                if (rows_differ) {  /* a key a row does not see adds nothing, even a V of inf */
                    FLASHCL_UNROLL for (int h = 0; h < GROUP_TILE; ++h)
                        if (ROW_VISIBLE(batch, HEAD(h), t0 + u, n_used))
                            a[h] = fma((floatV)(s[h][u]), vf, a[h]);
                } else {
                    FLASHCL_UNROLL for (int h = 0; h < GROUP_TILE; ++h)
                        a[h] = fma((floatV)(s[h][u]), vf, a[h]);
                }
            }
            FLASHCL_UNROLL for (int h = 0; h < GROUP_TILE; ++h)
                acc[h][c] = a[h];
        }
    }

    /* the sink joins as one more key of value zero (here, or in split 0's state only) */
    for (int h = 0; h < heads; ++h) {
        const int head = head0 + h;
        const float sink = SINK_LOG2(head, !partial || split == 0);
        const float m_all = fmax(m[h], sink);
        const float m_use = (m_all == -INFINITY) ? 0.0f : m_all;
        const float w = exp2(m[h] - m_use);  /* no key: w = 0 */
        const float l_all = l[h] * w + (SINKS ? exp2(sink - m_use) : 0.0f);
        if (partial) {
            const ulong state = ((ulong)batch * h_q + head) * num_splits + split;
            for (int c = 0; c < CV; ++c)
                FLASHCL_CAT(vstore, VEC)(acc[h][c] * w, c, part_acc + state * HEAD_DV);
            part_m[state] = m_all;
            part_l[state] = l_all;
        } else {
            const float inv_l = (l_all > 0.0f) ? 1.0f / l_all : 0.0f;  /* no key: zeros */
            __global store_t *o_row = out + o_off + batch * o_sb + head * o_sh;
            for (int c = 0; c < CV; ++c)
                STOREV(acc[h][c] * (w * inv_l), c, o_row);
            lse[(ulong)batch * h_q + head] = lse_of_state(m_all, l_all);
        }
    }
}

__kernel FLASHCL_REQD_WG(1)
void flash_decode(DECODE_PARAMS VARIANT_PARAMS QUANT_PARAMS)
{
    decode_body(DECODE_ARGS VARIANT_ARGS QUANT_ARGS, false);
}

__kernel FLASHCL_REQD_WG(1)
void flash_decode_split(DECODE_PARAMS VARIANT_PARAMS QUANT_PARAMS)
{
    decode_body(DECODE_ARGS VARIANT_ARGS QUANT_ARGS, true);
}
