/* flashcl prefill: exact flash attention, one query row per work-item.
 *
 *   out[b, h, i, :] = softmax_j(scale * q[b, h, i, :] . k[b, h / G, j, :]) @ v[b, h / G, :, :]
 *
 * with G = H_q / H_kv (GQA/MQA), online softmax in float32 (exp2 of log2-scaled scores) and
 * bottom-right causal alignment: row i sees keys j <= i + N_kv - N_q. A row that sees no key gets
 * out = 0 and lse = -inf (= its sink with HAS_SINKS). The variants of prefill_common.h (window,
 * softcap, sinks, ALiBi, bool or additive mask) change the scores in flashcl/variants.py's order.
 *
 * Buffers (element strides; the head dim is contiguous, stride 1):
 *   q    [B][H_q ][N_q ][HEAD_DK]   at q + q_off + b*q_sb + h*q_sh + i*q_sn
 *   k    [B][H_kv][N_kv][HEAD_DK]   likewise with k_*
 *   v    [B][H_kv][N_kv][HEAD_DV]   likewise with v_*
 *   out  [B][H_q ][N_q ][HEAD_DV]   likewise with o_*
 *   lse  [B][H_q ][N_q]  float32, contiguous, natural log (written when WRITE_LSE)
 *   sinks [H_q] float32, alibi [B][H_q] float32 (natural-log units)
 *   mask [Bm][Hm][N_q][N_kv] mask_t at mask + b*mask_sb + h*mask_sh + i*mask_sn + j (a stride
 *        of 0 broadcasts), tile_map [Bm][Hm][query blocks][key tiles] uchar at
 *        tile_map + b*map_sb + h*map_sh + m_block*(key tiles) + tile
 *   A quantized k or v (K_QUANT / V_QUANT, kv_quant.h) holds packed rows (q8_0, q4_0 or int8
 *   bytes), addressed as above in bytes; k_scales / v_scales [B][H_kv][N_kv] float32 hold an
 *   int8 cache's row scales, laid out like its rows (any buffer otherwise: never read). The
 *   rows are dequantized as a tile is staged, so local memory holds float32 as for plain caches.
 *
 * Grid: dim 0 = B x H_q x query blocks x DV slices work-groups of BLOCK_M work-items, in the
 * order of tile_of_group() (prefill_common.h: longest causal blocks first, heads in L2 sections).
 *
 *        keys ->  |<- BLOCK_N ->|
 *              +--------------------+   K tile  (HEAD_DK x BLOCK_N, transposed) in local memory
 *   BLOCK_M    | s = q.k^T          |   V slice (BLOCK_N x DV_TILE) in local memory
 *   query rows | (registers, one    |   q row   (HEAD_DK)  private, pre-scaled
 *   (1 / item) |  row per item)     |   acc     (DV_TILE)  private: the DV slice of out
 *              +--------------------+
 *
 * The output is produced DV_TILE columns at a time so that the accumulator fits in the register
 * file of small GPUs; each DV slice is its own work-group (they recompute the scores, but run side
 * by side on a large GPU instead of one pass after another). DV_TILE = HEAD_DV is a single pass.
 * Causal work-groups stop at the last KV tile their last row can see: tiles wholly above the
 * diagonal are never loaded. A key a row cannot see never reaches it, whatever its K or V hold
 * (NaN, inf): scores are masked by a select, keys past N_kv are staged as zeros, and in a tile that
 * crosses the diagonal each row skips the V rows of the keys it cannot see (p = 0 times inf is
 * NaN); the tiles below the diagonal take the unguarded P V loop. A window bounds the KV loop on
 * both sides the same way, and a mask's tile_map skips the tiles it wholly hides; in a tile that
 * a mask partly hides, hidden keys carry p = -0 so that the P V loop can tell them apart from
 * visible keys whose p underflowed to +0.
 */

/* ---- tunables ------------------------------------------------------------------------------ */
#ifndef BLOCK_M
#define BLOCK_M 64        // query rows per work-group = work-group size (one row per work-item)
#endif
#ifndef BLOCK_N
#define BLOCK_N 32        // KV rows per local-memory tile (4..128)
#endif
#ifndef DV_TILE
#define DV_TILE HEAD_DV   // output columns accumulated per pass; HEAD_DV means one pass
#endif
#ifndef VEC
#define VEC 4             // SIMD width of score/accumulator vectors: 4 on GPUs, 8 or 16 on CPUs
#endif

/* ---- problem constants set by the host (HEAD_DK, HEAD_DV, STORE_HALF, IS_CAUSAL, WRITE_LSE,
 *      UNROLL_LOOPS: see prefill_common.h; FIXED_WG: see common.h) --------------------------- */
#include "prefill_common.h"
#ifndef Q_IN_REGS
#define Q_IN_REGS 1       // 1: the q row lives in registers; 0: re-read per KV tile (saves HEAD_DK registers)
#endif

/* ---- derived constants and impossible combinations ------------------------------------------ */
#define DK4 (HEAD_DK / 4)
#define DV4 (DV_TILE / 4)
#define BNV (BLOCK_N / VEC)
#define DVV (DV_TILE / VEC)

#if DV_TILE % 4 != 0 || HEAD_DV % DV_TILE != 0
#error "DV_TILE must be a multiple of 4 that divides HEAD_DV"
#endif
#if VEC != 4 && VEC != 8 && VEC != 16
#error "VEC must be 4, 8 or 16"
#endif
#if BLOCK_M < 1 || BLOCK_N < VEC || BLOCK_N % VEC != 0 || DV_TILE % VEC != 0
#error "BLOCK_N and DV_TILE must be positive multiples of VEC"
#endif

#include "storage.h"
#include "vec.h"
#if HAS_SOFTCAP
#include "softcap.h"
FLASHCL_SOFTCAP_FN(floatV, softcap_vec, native_exp2, native_recip)
#endif

/* Chains of dependent FMAs each score vector is summed in (1 or 4): 4 where the loops stay rolled
 * (CPUs; any PoCL device), whose FMA units idle on one chain's latency (d=128: 1.48x,
 * docs/notes/pocl-prefill.md); 1 on GPUs, where other work-items hide it and registers are scarce */
#ifndef SCORE_CHAINS
#define SCORE_CHAINS (UNROLL_LOOPS ? 1 : 4)
#endif
#if SCORE_CHAINS != 1 && SCORE_CHAINS != 4
#error "SCORE_CHAINS must be 1 or 4"
#endif

/* acc += p[j] * v_tile[j] over the keys j of the tile for which `sees` holds */
#define PV_PRODUCT(sees)                                                                     \
    UNROLL                                                                                   \
    for (int j = 0; j < PER_ITEM(BLOCK_N); ++j) {                                           \
        if (sees) {                                                                          \
            const floatV pj = (floatV)(p[j]);                                                \
            UNROLL_VEC                                                                       \
            for (int c = 0; c < DVV; ++c)                                                    \
                acc[c] = fma(pj, LDS_LOADV(c, v_tile + j * DV_TILE), acc[c]);                \
        }                                                                                    \
    }

/* The guard of a tile that some row cannot wholly see: p's sign where a mask may hide keys
 * (hidden keys carry -0), else the key's position against the row's bounds. */
#if MASK_KIND
#define ROW_SEES(j) (!signbit(p[j]))
#elif HAS_WINDOW
#define ROW_SEES(j) (n0 + (j) >= key_lo && n0 + (j) <= key_hi)
#else
#define ROW_SEES(j) (n0 + (j) <= row_limit)
#endif

#if MASK_KIND
/* The mask values of keys col0 .. col0 + VEC - 1 of a row; keys past n_kv are never read */
static inline floatV mask_values(__global const mask_t *mask_row, const int col0, const int n_kv)
{
    if (col0 + VEC <= n_kv)
        return FLASHCL_CAT(convert_float, VEC)(VLOADV(0, mask_row + col0));
    float x[VEC];
    UNROLL
    for (int t = 0; t < VEC; ++t)
        x[t] = (col0 + t < n_kv) ? (float)mask_row[col0 + t] : 0.0f;
    return VLOADV(0, x);
}
#endif

__kernel FLASHCL_REQD_WG(BLOCK_M)
void flash_prefill(__global const store_t *q, __global const store_t *k,
                   __global const store_t *v, __global store_t *out, __global float *lse,
                   const int n_q, const int n_kv, const int h_q, const int group, const int head_section,
                   const float scale_log2,  /* softmax scale * log2(e) */
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
    __local float k_tile[BLOCK_N * HEAD_DK] LDS_ALIGNED;  /* offsets below are multiples of VEC */
    __local float v_tile[BLOCK_N * DV_TILE] LDS_ALIGNED;

    const int lid = get_local_id(0);
    int batch, head, m_block, dv_slice;
    tile_of_group(n_q, h_q, head_section, &batch, &head, &m_block, &dv_slice);
    const int kv_head = head / group;
    const int row = m_block * BLOCK_M + lid;
    const bool row_valid = row < n_q;
    const int dv0 = dv_slice * DV_TILE;

    __global const store_t *q_row = q + q_off + batch * q_sb + head * q_sh + (ulong)min(row, n_q - 1) * q_sn;
    /* K/V rows of (batch, KV head): store_t elements, or bytes of quantized rows (kv_quant.h) */
    const ulong k_rows = k_off + batch * k_sb + kv_head * k_sh, v_rows = v_off + batch * v_sb + kv_head * v_sh;
    __global const k_elem_t *k_base = (__global const k_elem_t *)k + k_rows;
    __global const v_elem_t *v_base = (__global const v_elem_t *)v + v_rows + V_SLICE_ELEMS(dv0);
    /* int8 rows' scales lie at scales[row byte offset / D] (read only when K/V are int8) */
    __global const float *k_row_scales = k_scales + k_rows / HEAD_DK;
    __global const float *v_row_scales = v_scales + v_rows / HEAD_DV;

#if Q_IN_REGS
    /* q row, pre-scaled so that scores are already in the log2 domain */
    float q_reg[HEAD_DK];
    UNROLL
    for (int c = 0; c < DK4; ++c)
        vstore4(LOAD4(q_row, c) * scale_log2, c, q_reg);
#define Q_CHUNK(c) vload4((c), q_reg)
#else
    /* q is re-read per KV tile (a cache hit after the first tile): HEAD_DK fewer live registers */
#define Q_CHUNK(c) (LOAD4(q_row, (c)) * scale_log2)
#endif

    const int row_base = m_block * BLOCK_M;
    int kv_begin = block_kv_begin(row_base, n_q, n_kv, win_left);
    int kv_end = block_kv_end(row_base, n_q, n_kv, win_right);
    const int pos = row + n_kv - n_q;  /* bottom-right aligned position of this row */
#if IS_CAUSAL
    const int row_limit = pos;  /* this row sees keys j <= row_limit */
#endif
#if HAS_WINDOW
    const int key_lo = pos - win_left;
    const int key_hi = IS_CAUSAL ? pos : pos + win_right;  /* win_right >= 0 */
#endif
#if HAS_SOFTCAP
    const float inv_softcap = 1.0f / softcap_log2;
#endif
#if HAS_ALIBI
    const float slope_log2 = alibi[batch * h_q + head] * M_LOG2E_F;
#endif
#if MASK_KIND
    __global const mask_t *mask_row = mask + batch * mask_sb + head * mask_sh + (ulong)min(row, n_q - 1) * mask_sn;
    __global const uchar *block_map = TILE_MAP_ROW(batch, head, m_block);
    mask_kv_range(block_map, &kv_begin, &kv_end);
#endif

    float m_i = -INFINITY;  /* running max (log2 domain) */
    float l_i = 0.0f;       /* running sum of exp2(s - m_i) */
    floatV acc[DVV];
    UNROLL_VEC
    for (int c = 0; c < DVV; ++c)
        acc[c] = (floatV)(0.0f);

    for (int n0 = kv_begin; n0 < kv_end; n0 += BLOCK_N) {
#if MASK_KIND
        /* the same value for the whole work-group: skipping the tile skips both barriers */
        const uchar tile_state = block_map[n0 / BLOCK_N];
        if (tile_state == TILE_HIDDEN)
            continue;
#endif
        /* every work-item is done reading the previous tile before it is overwritten */
        barrier(CLK_LOCAL_MEM_FENCE);
        /* K is stored transposed (k_tile[d][j]) so scores come out BLOCK_N-wide as vectors */
        stage_k_tile(k_tile, k_base, k_sn, k_row_scales, n0, n_kv, lid, BLOCK_M);
        stage_v_tile(v_tile, v_base, v_sn, v_row_scales, n0, n_kv, dv0, lid, BLOCK_M);
        /* the whole tile is in local memory before anyone reads it */
        barrier(CLK_LOCAL_MEM_FENCE);

        /* scores of this row against the tile, VEC keys per vector: sv[jv] = q . k[VEC*jv ..] */
        floatV sv[BNV];
        UNROLL_VEC
        for (int jv = 0; jv < BNV; ++jv)
            sv[jv] = (floatV)(0.0f);
#if SCORE_CHAINS == 4
        floatV s1[BNV], s2[BNV], s3[BNV];
        UNROLL_VEC
        for (int jv = 0; jv < BNV; ++jv)
            s1[jv] = s2[jv] = s3[jv] = (floatV)(0.0f);
#else  /* one chain: the four FMAs a chunk in sequence */
#define s1 sv
#define s2 sv
#define s3 sv
#endif
        UNROLL
        for (int c = 0; c < PER_ITEM(DK4); ++c) {
            const float4 qc = Q_CHUNK(c);
            __local const float *kc = k_tile + 4 * c * BLOCK_N;
            UNROLL_VEC
            for (int jv = 0; jv < BNV; ++jv) {
                sv[jv] = fma((floatV)(qc.x), LDS_LOADV(jv, kc), sv[jv]);
                s1[jv] = fma((floatV)(qc.y), LDS_LOADV(jv, kc + BLOCK_N), s1[jv]);
                s2[jv] = fma((floatV)(qc.z), LDS_LOADV(jv, kc + 2 * BLOCK_N), s2[jv]);
                s3[jv] = fma((floatV)(qc.w), LDS_LOADV(jv, kc + 3 * BLOCK_N), s3[jv]);
            }
        }
#if SCORE_CHAINS == 4
        UNROLL_VEC
        for (int jv = 0; jv < BNV; ++jv)
            sv[jv] = (sv[jv] + s1[jv]) + (s2[jv] + s3[jv]);
#else
#undef s1
#undef s2
#undef s3
#endif

        /* the variants' scores, then mask the tile edge, the diagonal, the window and the mask;
         * then the tile max */
        floatV maxv = (floatV)(-INFINITY);
        UNROLL_VEC
        for (int jv = 0; jv < BNV; ++jv) {
            const intV col = (intV)(n0 + VEC * jv) + IOTA_V;
            intV visible = col < (intV)(n_kv);
#if IS_CAUSAL
            visible = visible & (col <= (intV)(row_limit));
#endif
#if HAS_WINDOW
            visible = visible & (col >= (intV)(key_lo)) & (col <= (intV)(key_hi));
#endif
#if HAS_SOFTCAP
            sv[jv] = softcap_vec(sv[jv], softcap_log2, inv_softcap);
#endif
#if HAS_ALIBI
            sv[jv] -= slope_log2 * FLASHCL_CAT(convert_float, VEC)(abs(col - (intV)(pos)));
#endif
#if MASK_KIND == 1
            if (tile_state == TILE_PARTIAL)
                visible = visible & (mask_values(mask_row, n0 + VEC * jv, n_kv) != (floatV)(0.0f));
#elif MASK_KIND == 2
            const floatV add = mask_values(mask_row, n0 + VEC * jv, n_kv);
            visible = visible & (add > (floatV)(MASK_HIDES_AT));
            sv[jv] += add * M_LOG2E_F;
#endif
            sv[jv] = select((floatV)(-INFINITY), sv[jv], visible);
            maxv = fmax(maxv, sv[jv]);
        }
        const float tile_max = HMAX_V(maxv);

        /* rescale acc to the new max; while nothing is visible, exp2 args stay finite */
        const float m_new = fmax(m_i, tile_max);
        const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;
        const float alpha = exp2(m_i - m_use);
        l_i *= alpha;
        UNROLL_VEC
        for (int c = 0; c < DVV; ++c)
            acc[c] *= alpha;

        /* p = exp2(s - m), then acc += p @ v_tile */
        float p[BLOCK_N];
        floatV lv = (floatV)(0.0f);
        UNROLL_VEC
        for (int jv = 0; jv < BNV; ++jv) {
            floatV pv = exp2(sv[jv] - (floatV)(m_use));
#if MASK_KIND
            pv = select(pv, (floatV)(-0.0f), sv[jv] == (floatV)(-INFINITY));  /* hidden: -0 */
#endif
            lv += pv;
            VSTOREV(pv, jv, p);
        }
        l_i += HSUM_V(lv);
#if IS_CAUSAL || HAS_WINDOW || MASK_KIND
        /* a tile that some row of the block cannot wholly see (the diagonal, a window edge or the
         * mask cross it) */
        bool guarded = tile_crosses_edge(n0, row_base + n_kv - n_q, win_left, win_right);
#if MASK_KIND
        guarded = guarded || tile_state == TILE_PARTIAL;
#endif
        if (guarded) {
            PV_PRODUCT(ROW_SEES(j))
        } else
#endif
        {
            PV_PRODUCT(1)
        }
        m_i = m_new;
    }

    float out_scale = 1.0f;
#if HAS_SINKS
    out_scale = fold_sink(sinks[head] * M_LOG2E_F, &m_i, &l_i);
#endif
    if (row_valid) {
        const float inv_l = (l_i > 0.0f) ? out_scale / l_i : 0.0f;  /* no visible key: zeros, not NaN */
        __global store_t *o_row = out + o_off + batch * o_sb + head * o_sh + (ulong)row * o_sn + dv0;
        UNROLL
        for (int c = 0; c < DVV; ++c) {
            float out_v[VEC];
            VSTOREV(acc[c] * inv_l, 0, out_v);
            UNROLL
            for (int t = 0; t < VEC / 4; ++t)
                STORE4(vload4(t, out_v), c * (VEC / 4) + t, o_row);
        }
#if WRITE_LSE
        if (dv_slice == 0)
            lse[((ulong)batch * h_q + head) * n_q + row] = lse_of_state(m_i, l_i);
#endif
    }
}
