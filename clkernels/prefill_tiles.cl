/* flashcl prefill, micro-tiled: exact flash attention where every work-item owns a TILE_M x
 * TILE_N block of the score tile and a TILE_M x (DV_TILE / TN) block of the output.
 *
 *   out[b, h, i, :] = softmax_j(scale * q[b, h, i, :] . k[b, h / G, j, :]) @ v[b, h / G, :, :]
 *
 * Same contract as prefill.cl (bottom-right causal, GQA, DK != DV, float32 or half storage,
 * quantized K/V caches dequantized as staged, online softmax in exp2, a row that sees no key gives
 * zeros and lse = -inf, the variants of prefill_common.h); same buffers, arguments and grid,
 * except that a work-group is TM x TN work-items.
 *
 * Why a second kernel. In prefill.cl each work-item owns one query row: every K or V value it
 * reads from local memory feeds one FMA. Local memory returns 128 bytes per clock per SM on
 * NVIDIA GPUs, 32 floats, so that layout tops out near 32 FMAs per clock per SM, a quarter of the
 * FP32 peak; on an H100 it reaches 24%, with float4 or scalar loads alike. Here a work-item
 * multiplies a TILE_M-row slice of Q by a TILE_N-key slice of K: TILE_M + TILE_N loads feed
 * TILE_M * TILE_N FMAs (8x2: 1.6 per load; the P V product reuses more), the register blocking
 * of a GEMM, with far fewer registers per work-item than a whole q row plus a DV slice (what
 * small register files want). Measured on the H100, fp32 (1, 32/8, 2048) causal, tuned:
 * d=64 21.3 TFLOP/s (17.1 before the launch order of prefill_common.h) against 14.6 for
 * prefill.cl, d=128 14.6 against 12.0. CPU drivers (PoCL)
 * run it 20-35x slower than prefill.cl: the tuner leaves it out there.
 *
 *   work-item (ty, tx), ty < TM, tx < TN:   rows  ty*TILE_M .. +TILE_M      of the query block
 *                                           keys  tx*TILE_N .. +TILE_N      of the KV tile
 *                                           cols  tx*RD     .. +RD          of the DV slice
 *   BLOCK_M = TM * TILE_M,  BLOCK_N = TN * TILE_N,  DV_TILE = TN * RD
 *
 * Local memory (floats): Q^T [DK][BLOCK_M] (loaded once, pre-scaled), one buffer holding K^T
 * [DK][BLOCK_N] and then V [BLOCK_N][DV_TILE], P^T [BLOCK_N][BLOCK_M + max(TILE_M, 4)] and the
 * row-max partials [BLOCK_M][TN + 1]. Per KV tile: load K -> S = Q K^T (registers) -> per-row
 * max over the TN work-items sharing a row (local memory) -> load V over K, P = exp2(S - m) to
 * local memory -> O = O * alpha + P V. The running
 * row sum l is kept per work-item over its own keys (every work-item of a row rescales by the
 * same alpha) and summed across the row once at the end. In a KV tile that crosses the causal
 * diagonal the P V product skips, per row, the keys that row cannot see (p = 0 times inf or NaN in
 * their V is NaN); tiles below the diagonal take the unguarded loop. Window edges and masks
 * are handled as in prefill.cl: loop bounds, the tile_map's skipped tiles, and p = -0 marking
 * the keys a mask hides in a partly hidden tile.
 */

/* ---- tunables ------------------------------------------------------------------------------ */
#ifndef BLOCK_M
#define BLOCK_M 64        // query rows per work-group
#endif
#ifndef BLOCK_N
#define BLOCK_N 32        // KV rows per local-memory tile
#endif
#ifndef DV_TILE
#define DV_TILE HEAD_DV   // output columns per work-group (HEAD_DV: one pass)
#endif
#ifndef TILE_M
#define TILE_M 4          // query rows per work-item (2, 4 or 8)
#endif
#ifndef TILE_N
#define TILE_N 4          // keys per work-item (2, 4 or 8)
#endif

/* ---- problem constants set by the host: see prefill_common.h ----------------------------- */
#include "prefill_common.h"

/* ---- derived constants and impossible combinations ------------------------------------------ */
#define TM (BLOCK_M / TILE_M)             // work-items along the query rows
#define TN (BLOCK_N / TILE_N)             // work-items along the keys (and the DV slice)
#define WG (TM * TN)
#define RD (DV_TILE / TN)                 // output columns per work-item
#define DV4 (DV_TILE / 4)
#define P_STRIDE (BLOCK_M + (TILE_M > 4 ? TILE_M : 4))  // padded (P^T rows of different keys start in
                                  // different banks), still a multiple of TILE_M
#define R_STRIDE (TN + 1)                 // padded row-max partials
#define KV_FLOATS (HEAD_DK > DV_TILE ? HEAD_DK * BLOCK_N : DV_TILE * BLOCK_N)

#if (TILE_M != 2 && TILE_M != 4 && TILE_M != 8) || (TILE_N != 2 && TILE_N != 4 && TILE_N != 8)
#error "TILE_M and TILE_N must be 2, 4 or 8"
#endif
#if BLOCK_M % TILE_M != 0 || BLOCK_N % TILE_N != 0
#error "TILE_M must divide BLOCK_M and TILE_N must divide BLOCK_N"
#endif
#if HEAD_DV % DV_TILE != 0 || DV_TILE % TN != 0 || RD % 4 != 0
#error "DV_TILE must divide HEAD_DV and split into TN column blocks of a multiple of 4"
#endif

#include "storage.h"
#if HAS_SOFTCAP
#include "softcap.h"
FLASHCL_SOFTCAP_FN(float, softcap_score, native_exp2, native_recip)
#endif

#define floatTM FLASHCL_CAT(float, TILE_M)
#define floatTN FLASHCL_CAT(float, TILE_N)
#define vstoreTM FLASHCL_CAT(vstore, TILE_M)
#define vstoreTN FLASHCL_CAT(vstore, TILE_N)

#ifndef UNROLL_K
#define UNROLL_K 0        // unroll factor of the loops over head dims and keys (0: full)
#endif
/* UNROLL, PER_ITEM: prefill_common.h. Innermost loops take PER_ITEM trip counts, but the scores'
 * (PoCL vectorizes them across work-items: 1.8x faster at 4x4): with the others horizontal, PoCL
 * 3.x never staged the V tile and P V read the K tile left in its buffer. */
#define FLASHCL_PRAGMA(x) _Pragma(#x)
#if UNROLL_LOOPS && UNROLL_K
#define UNROLL_OUTER FLASHCL_PRAGMA(unroll UNROLL_K)
#else
#define UNROLL_OUTER UNROLL
#endif

/* vector-typed local loads (see LDS_ALIGNED in common.h): every offset below is a multiple of the
 * vector width */
#define LDS_TM(p) (*(__local const floatTM *)(p))
#define LDS_TN(p) (*(__local const floatTN *)(p))
#define LDS_4(p) (*(__local const float4 *)(p))

/* O += P V for this work-item's TILE_M x RD block, over the (key j, row a) pairs where `sees` holds */
#define PV_PRODUCT(sees)                                                                     \
    UNROLL_OUTER                                                                             \
    for (int j = 0; j < BLOCK_N; ++j) {                                                      \
        float pa[TILE_M];                                                                    \
        vstoreTM(LDS_TM(p_t + j * P_STRIDE + r0), 0, pa);                                    \
        UNROLL                                                                               \
        for (int c4 = 0; c4 < RD / 4; ++c4) {                                                \
            const float4 vv = LDS_4(v_s + j * DV_TILE + c0 + 4 * c4);                        \
            UNROLL                                                                           \
            for (int a = 0; a < PER_ITEM(TILE_M); ++a) {                                     \
                if (sees) {                                                                  \
                    acc[a][4 * c4 + 0] = fma(pa[a], vv.x, acc[a][4 * c4 + 0]);               \
                    acc[a][4 * c4 + 1] = fma(pa[a], vv.y, acc[a][4 * c4 + 1]);               \
                    acc[a][4 * c4 + 2] = fma(pa[a], vv.z, acc[a][4 * c4 + 2]);               \
                    acc[a][4 * c4 + 3] = fma(pa[a], vv.w, acc[a][4 * c4 + 3]);               \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

/* The guard of a tile that some row cannot wholly see: p's sign where a mask may hide keys
 * (hidden keys carry -0), else the key's position against row a's bounds. */
#if MASK_KIND
#define ROW_SEES(j, a) (!signbit(pa[a]))
#elif HAS_WINDOW
#define ROW_SEES(j, a) (n0 + (j) >= row_base + r0 + (a) + offset - win_left \
                        && n0 + (j) <= row_base + r0 + (a) + offset + right_bound)
#else
#define ROW_SEES(j, a) (n0 + (j) <= row_base + r0 + (a) + offset)
#endif

__kernel FLASHCL_REQD_WG(WG)
void flash_prefill_tiles(__global const store_t *q, __global const store_t *k,
                         __global const store_t *v, __global store_t *out, __global float *lse,
                         const int n_q, const int n_kv, const int h_q, const int group, const int head_section,
                         const float scale_log2,
                         const ulong q_off, const ulong q_sb, const ulong q_sh, const ulong q_sn,
                         const ulong k_off, const ulong k_sb, const ulong k_sh, const ulong k_sn,
                         const ulong v_off, const ulong v_sb, const ulong v_sh, const ulong v_sn,
                         const ulong o_off, const ulong o_sb, const ulong o_sh, const ulong o_sn,
                         const int win_left, const int win_right, const float softcap_log2,
                         __global const float *sinks, __global const float *alibi,
                         __global const mask_t *mask, const ulong mask_sb, const ulong mask_sh, const ulong mask_sn,
                         __global const uchar *tile_map, const ulong map_sb, const ulong map_sh,
                         __global const float *k_scales, __global const float *v_scales)
{
    __local float q_t[HEAD_DK * BLOCK_M] LDS_ALIGNED;    /* Q^T, pre-scaled: q_t[d][row] */
    /* K^T of the tile (k_t[d][key]) until the scores are computed, then its V slice
     * (v_s[key][col]): one buffer, so that larger tiles fit in local memory */
    __local float kv[KV_FLOATS] LDS_ALIGNED;
    __local float *k_t = kv, *v_s = kv;
    __local float p_t[BLOCK_N * P_STRIDE] LDS_ALIGNED;   /* P^T of the tile: p_t[key][row] */
    __local float row_max[BLOCK_M * R_STRIDE];           /* per-row partial maxima, then sums */

    const int lid = get_local_id(0);
    const int tx = lid % TN, ty = lid / TN;
    const int r0 = ty * TILE_M;    /* first row of this work-item within the block */
    const int j0 = tx * TILE_N;    /* first key within the tile */
    const int c0 = tx * RD;        /* first column within the DV slice */
    int batch, head, m_block, dv_slice;
    tile_of_group(n_q, h_q, head_section, &batch, &head, &m_block, &dv_slice);
    const int kv_head = head / group;
    const int row_base = m_block * BLOCK_M;
    const int dv0 = dv_slice * DV_TILE;

    __global const store_t *q_base = q + q_off + batch * q_sb + head * q_sh;
    /* K/V rows of (batch, KV head): store_t elements, or bytes of quantized rows (kv_quant.h) */
    const ulong k_rows = k_off + batch * k_sb + kv_head * k_sh, v_rows = v_off + batch * v_sb + kv_head * v_sh;
    __global const k_elem_t *k_base = (__global const k_elem_t *)k + k_rows;
    __global const v_elem_t *v_base = (__global const v_elem_t *)v + v_rows + V_SLICE_ELEMS(dv0);
    /* int8 rows' scales lie at scales[row byte offset / D] (read only when K/V are int8) */
    __global const float *k_row_scales = k_scales + k_rows / HEAD_DK;
    __global const float *v_row_scales = v_scales + v_rows / HEAD_DV;

    /* Q^T of the block, pre-scaled; rows past n_q are zero (their results are never stored) */
    stage_transposed(q_t, q_base, q_sn, row_base, n_q, BLOCK_M, HEAD_DK, scale_log2, lid, WG);

    const int offset = n_kv - n_q;
    int kv_begin = block_kv_begin(row_base, n_q, n_kv, win_left);
    int kv_end = block_kv_end(row_base, n_q, n_kv, win_right);
#if HAS_WINDOW
    const int right_bound = IS_CAUSAL ? 0 : win_right;  /* keys j <= p + right_bound; win_right >= 0 */
#endif
#if HAS_SOFTCAP
    const float inv_softcap = 1.0f / softcap_log2;
#endif
#if HAS_ALIBI
    const float slope_log2 = alibi[batch * h_q + head] * M_LOG2E_F;
#endif
#if MASK_KIND
    __global const mask_t *mask_base = mask + batch * mask_sb + head * mask_sh;
    __global const uchar *block_map = TILE_MAP_ROW(batch, head, m_block);
    mask_kv_range(block_map, &kv_begin, &kv_end);
#endif

    float m_i[TILE_M], l_i[TILE_M], acc[TILE_M][RD];
    UNROLL
    for (int a = 0; a < TILE_M; ++a) {
        m_i[a] = -INFINITY;
        l_i[a] = 0.0f;
        UNROLL
        for (int c = 0; c < PER_ITEM(RD); ++c)
            acc[a][c] = 0.0f;
    }

    for (int n0 = kv_begin; n0 < kv_end; n0 += BLOCK_N) {
#if MASK_KIND
        /* the same value for the whole work-group: skipping the tile skips all its barriers */
        const uchar tile_state = block_map[n0 / BLOCK_N];
        if (tile_state == TILE_HIDDEN)
            continue;
#endif
        /* everyone is done with the previous tile's V and P (and Q^T is complete) */
        barrier(CLK_LOCAL_MEM_FENCE);
        stage_k_tile(k_t, k_base, k_sn, k_row_scales, n0, n_kv, lid, WG);
        /* the K tile is in local memory before anyone reads it */
        barrier(CLK_LOCAL_MEM_FENCE);

        /* S = Q K^T for this work-item's TILE_M x TILE_N block: an outer product per dim */
        float s[TILE_M][TILE_N];
        UNROLL
        for (int a = 0; a < TILE_M; ++a)
            UNROLL
            for (int b = 0; b < TILE_N; ++b)
                s[a][b] = 0.0f;
        UNROLL_OUTER
        for (int d = 0; d < HEAD_DK; ++d) {
            float qa[TILE_M], kb[TILE_N];
            vstoreTM(LDS_TM(q_t + d * BLOCK_M + r0), 0, qa);
            vstoreTN(LDS_TN(k_t + d * BLOCK_N + j0), 0, kb);
            UNROLL
            for (int a = 0; a < TILE_M; ++a)
                UNROLL
                for (int b = 0; b < TILE_N; ++b)
                    s[a][b] = fma(qa[a], kb[b], s[a][b]);
        }

        /* the variants' scores, then mask the tile edge, the diagonal, the window and the mask;
         * this work-item's share of each row's max */
        UNROLL
        for (int a = 0; a < TILE_M; ++a) {
            const int pos = row_base + r0 + a + offset;  /* bottom-right aligned position */
#if MASK_KIND
            __global const mask_t *mask_row = mask_base + (ulong)min(row_base + r0 + a, n_q - 1) * mask_sn;
#endif
            float mx = -INFINITY;
            UNROLL
            for (int b = 0; b < TILE_N; ++b) {
                const int col = n0 + j0 + b;
                bool visible = col < n_kv;
#if IS_CAUSAL
                visible = visible && col <= pos;
#endif
#if HAS_WINDOW
                visible = visible && col >= pos - win_left && col <= pos + right_bound;
#endif
#if HAS_SOFTCAP
                s[a][b] = softcap_score(s[a][b], softcap_log2, inv_softcap);
#endif
#if HAS_ALIBI
                s[a][b] -= slope_log2 * (float)abs(col - pos);
#endif
#if MASK_KIND == 1
                if (tile_state == TILE_PARTIAL)
                    visible = visible && mask_row[min(col, n_kv - 1)] != 0;
#elif MASK_KIND == 2
                const float add = mask_row[min(col, n_kv - 1)];
                visible = visible && add > MASK_HIDES_AT;
                s[a][b] += add * M_LOG2E_F;
#endif
                s[a][b] = visible ? s[a][b] : -INFINITY;
                mx = fmax(mx, s[a][b]);
            }
            row_max[(r0 + a) * R_STRIDE + tx] = mx;
        }
        /* every partial max is written before the rows are reduced, and every work-item is done
         * with K^T before the V slice overwrites it */
        barrier(CLK_LOCAL_MEM_FENCE);
        stage_v_tile(v_s, v_base, v_sn, v_row_scales, n0, n_kv, dv0, lid, WG);

        /* P = exp2(S - m_new); rescale O and l to the new max */
        float p_col[TILE_N][TILE_M];  /* P^T of this work-item's block */
        UNROLL
        for (int a = 0; a < TILE_M; ++a) {
            float tile_max = -INFINITY;
            for (int t = 0; t < PER_ITEM(TN); ++t)
                tile_max = fmax(tile_max, row_max[(r0 + a) * R_STRIDE + t]);
            const float m_new = fmax(m_i[a], tile_max);
            const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;  /* nothing visible yet */
            const float alpha = exp2(m_i[a] - m_use);
            float l_add = 0.0f;
            UNROLL
            for (int b = 0; b < PER_ITEM(TILE_N); ++b) {
                p_col[b][a] = exp2(s[a][b] - m_use);
#if MASK_KIND
                p_col[b][a] = (s[a][b] == -INFINITY) ? -0.0f : p_col[b][a];  /* hidden: -0 */
#endif
                l_add += p_col[b][a];
            }
            l_i[a] = l_i[a] * alpha + l_add;
            UNROLL
            for (int c = 0; c < PER_ITEM(RD); ++c)
                acc[a][c] *= alpha;
            m_i[a] = m_new;
        }
        /* P^T to local memory, one TILE_M-wide vector per key: scalar stores here would hit the
         * same bank from every work-item of a row of the grid (rows TILE_N * P_STRIDE apart) */
        UNROLL
        for (int b = 0; b < PER_ITEM(TILE_N); ++b)
            *(__local floatTM *)(p_t + (j0 + b) * P_STRIDE + r0) = FLASHCL_CAT(vload, TILE_M)(0, p_col[b]);
        /* P and the V slice are complete before the P V product reads them */
        barrier(CLK_LOCAL_MEM_FENCE);

#if IS_CAUSAL || HAS_WINDOW || MASK_KIND
        /* a tile that some row of the block cannot wholly see (the diagonal, a window edge or the
         * mask cross it) */
        bool guarded = tile_crosses_edge(n0, row_base + offset, win_left, win_right);
#if MASK_KIND
        guarded = guarded || tile_state == TILE_PARTIAL;
#endif
        if (guarded) {
            PV_PRODUCT(ROW_SEES(j, a))
        } else
#endif
        {
            PV_PRODUCT(1)
        }
    }

    /* each row's sum l over all its keys: the TN work-items sharing the row add their parts */
    barrier(CLK_LOCAL_MEM_FENCE);  /* everyone is done reading the last row maxima */
    UNROLL
    for (int a = 0; a < PER_ITEM(TILE_M); ++a)
        row_max[(r0 + a) * R_STRIDE + tx] = l_i[a];
    barrier(CLK_LOCAL_MEM_FENCE);
    UNROLL
    for (int a = 0; a < TILE_M; ++a) {
        const int row = row_base + r0 + a;
        if (row >= n_q)
            break;
        float l = 0.0f, m = m_i[a], out_scale = 1.0f;
        for (int t = 0; t < PER_ITEM(TN); ++t)
            l += row_max[(r0 + a) * R_STRIDE + t];
#if HAS_SINKS
        out_scale = fold_sink(sinks[head] * M_LOG2E_F, &m, &l);
#endif
        const float inv_l = (l > 0.0f) ? out_scale / l : 0.0f;  /* no visible key: zeros, not NaN */
        __global store_t *o_row = out + o_off + batch * o_sb + head * o_sh + (ulong)row * o_sn + dv0 + c0;
        UNROLL
        for (int c4 = 0; c4 < PER_ITEM(RD / 4); ++c4)
            STORE4((float4)(acc[a][4 * c4], acc[a][4 * c4 + 1], acc[a][4 * c4 + 2], acc[a][4 * c4 + 3]) * inv_l,
                   c4, o_row);
#if WRITE_LSE
        if (dv_slice == 0 && tx == 0)
            lse[((ulong)batch * h_q + head) * n_q + row] = lse_of_state(m, l);
#endif
    }
}
