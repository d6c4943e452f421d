/* flashcl decode: flash-decoding, one new query token per sequence over its KV cache.
 *
 *   out[b, h, :] = softmax_j(scale * q[b, h, :] . k[b, h / G, j, :]) @ v[b, h / G, :, :],  j < ctx[b]
 *
 * G = GROUP = H_q / H_kv. One work-group serves one (sequence, KV head, split) and the WHOLE GQA
 * group of G query heads, so every K/V row is read from global memory once per group. Keys are
 * cut into num_splits contiguous chunks (whole BLOCK_N tiles); a split that starts past the end
 * of its sequence is the empty state (-inf, 0, 0).
 *
 *   flash_decode        num_splits == 1: normalizes and writes out and lse itself (single pass)
 *   flash_decode_split  writes the unnormalized float32 state (m in log2 units, l, acc) per split
 *   flash_decode_merge  rescales the splits to their shared max and writes out and lse
 *
 * Variants (decode_common.h, each a -D flag; the plain build is unchanged): a sliding window
 * narrows the keys the splits divide to [ctx - 1 - left, ctx), so keys left of it are never read;
 * softcap and ALiBi change each score in the log2 domain before the online softmax; a sink joins
 * the final normalizer of the single pass, or split 0's state under split-k (exactly once).
 *
 * Keys at or past ctx[b] are never read (their chunks are zeros), so whatever the cache holds
 * there (the tail of a contiguous cache, the unwritten slots of a partial last block) cannot
 * reach out. NaN in q or in a visible K makes out and lse NaN, never lse = -inf ("saw no key").
 * The tables may be device-resident and are checked here (decode_common.h): a sequence whose
 * context length is outside [0, capacity] (capacity = max_blocks * block_size paged, N_max
 * contiguous) or whose used blocks include an id outside [0, num_blocks) reads nothing out of
 * bounds and gets NaN out and lse.
 *
 * Buffers (element offsets and strides from the host; the head dim is contiguous):
 *   q        [B][H_q][HEAD_DK]                        at q + q_off + b*q_sb + h*q_sh
 *   k, v     contiguous: [B][H_kv][N_max][D]           row j at b*k_s0 + kvh*k_sh + j*k_s1
 *            paged:      [num_blocks][block_size][H_kv][D]
 *                        row j at block_table[b][j >> block_shift]*k_s0 + (j & mask)*k_s1 + kvh*k_sh
 *            K/V offsets and strides are in units of 16-byte chunks (raw_t) and every row starts
 *            16-byte aligned (the host checks), so rows are read with whole 16-byte loads.
 *            A quantized cache (K_QUANT / V_QUANT): the same layouts of quantized rows, offsets
 *            and strides in bytes (see "quantized K/V caches" below).
 *   out      [B][H_q][HEAD_DV]                        at out + o_off + b*o_sb + h*o_sh
 *   lse      [B][H_q] float32, natural log, contiguous
 *   part_m, part_l  [B][H_q][num_splits] float32; part_acc [B][H_q][num_splits][HEAD_DV] float32
 *   block_table [B][bt_stride] int32; context_lens [B] int32 (checked: see above)
 *
 * Work-group of WG = LANES x ROWS x NHT work-items (lane fastest):
 *
 *     key tile (BLOCK_N = ROWS*UNROLL keys)        16-byte chunk c of a row = dims [VW*c, VW*c+VW)
 *        row r  | lane 0 | lane 1 | ... | lane LANES-1 |   <- consecutive work-items read
 *        row r+1| lane 0 | lane 1 | ...                   consecutive chunks of one K/V row
 *
 *   per work-item (lane, row, head tile ht): q chunk and acc chunk of HEAD_TILE query heads
 *   (registers), its own online-softmax state (m, l) for the keys of its row slot.
 *   local memory: partial dot products [GROUP][BLOCK_N][LANES] -> scores [GROUP][BLOCK_N];
 *   with several head tiles (NHT > 1) the K/V tile itself, so that each chunk is still loaded
 *   from global memory once and then read from local memory by every head tile.
 *   Each iteration prefetches the next tile into registers before computing on the current one.
 *   At the end the ROWS row-slot states are merged in local memory (rescale to the shared max).
 */

/* ---- tunables ------------------------------------------------------------------------------ */
#ifndef ROWS
#define ROWS 8            // key rows read side by side: work-items along the key axis (1..64)
#endif
#ifndef UNROLL
#define UNROLL 1          // keys per work-item per iteration: loads in flight per work-item (1..8)
#endif
#ifndef HEAD_TILE
#define HEAD_TILE 4       // query heads whose q/acc chunks one work-item keeps in registers
#endif
#ifndef MERGE_WG
#define MERGE_WG 64       // work-items of the merge kernel (power of two, 16..1024)
#endif
#ifndef UNROLL_MERGE
#define UNROLL_MERGE 1    // 1: the merge's loop over splits unrolled by 8 (0 on CPUs: LLVM cannot, and says so)
#endif
#ifndef MERGE_ONLY
#define MERGE_ONLY 0      // 1: only flash_decode_merge (decode_mma.cl runs the decode kernels)
#endif
#ifndef ROW_SHUFFLE
/* 1: sum a K row's partial dot products with register shuffles inside the warp (NVIDIA inline
 * PTX; the host sets it where it holds, see row_sum) instead of through local memory and two
 * barriers per tile. */
#define ROW_SHUFFLE 0
#endif

/* ---- problem constants set by the host ------------------------------------------------------ */
#include "common.h"   /* HEAD_DK, HEAD_DV (required), STORE_HALF, STORE_BF16 */
#ifndef GROUP
#error "GROUP (query heads per KV head, H_q / H_kv) must be defined by the host"
#endif

/* ---- derived constants and impossible combinations ------------------------------------------ */
#if STORE_2B
#define VW 8              // elements per 16-byte chunk
typedef uint4 raw_t;      // a chunk as loaded; converted to float8 by to_float
#if STORE_HALF
typedef half store_t;
#else
typedef ushort store_t;   // bfloat16 bits
#endif
#else
#define VW 4
typedef float4 raw_t;
typedef float store_t;
#endif
#define floatW FLASHCL_CAT(float, VW)

#define CK (HEAD_DK / VW)                 // chunks per K row
#define CV (HEAD_DV / VW)                 // chunks per V row
#define LANES (CK > CV ? CK : CV)         // work-items per row
#define NHT (GROUP / HEAD_TILE)           // head tiles per work-group
#define WG (LANES * ROWS * NHT)           // work-group size
#define BLOCK_N (ROWS * UNROLL)           // keys per iteration
#define STAGED (NHT > 1)                  // K/V tile staged in local memory for several head tiles
#define TILE_CHUNKS (BLOCK_N * (CK + CV))
#define LOADS ((TILE_CHUNKS + WG - 1) / WG)  // chunks each work-item loads per tile when STAGED
#define PSTRIDE (LANES + 1)               // padded: the reducers read rows without bank conflicts

#if HEAD_DK % VW != 0 || HEAD_DV % VW != 0
#error "head dims must be multiples of 8 (half) or 4 (float): rows are read in 16-byte chunks"
#endif
#if GROUP < 1 || HEAD_TILE < 1 || GROUP % HEAD_TILE != 0
#error "HEAD_TILE must divide GROUP"
#endif
#if ROWS < 1 || UNROLL < 1
#error "ROWS and UNROLL must be positive"
#endif
#if MERGE_WG < 1 || (MERGE_WG & (MERGE_WG - 1)) != 0
#error "MERGE_WG must be a power of two (tree reduction)"
#endif

#ifndef SOFTCAP_SPREAD
/* 1: with ROW_SHUFFLE, a row's softcaps are spread over its lanes (one head each) */
#define SOFTCAP_SPREAD (SOFTCAP && ROW_SHUFFLE && HEAD_TILE > 1 && HEAD_TILE <= LANES)
#endif

#if ROW_SHUFFLE && (STAGED || (LANES & (LANES - 1)) != 0 || LANES > 32 || (WG % 32) != 0)
#error "ROW_SHUFFLE needs one head tile, LANES a power of two <= 32 and whole warps"
#endif

#if VW == 8
#define HSUM_W(x) ((((x).s0 + (x).s1) + ((x).s2 + (x).s3)) + (((x).s4 + (x).s5) + ((x).s6 + (x).s7)))
#if STORE_HALF
#define LOAD_W(p, i) vload_half8((i), (p))
#define STORE_W(x, i, p) vstore_half8_rte((x), (i), (p))
#else
#define LOAD_W(p, i) BF16_LOAD(8, (i), (p))
#define STORE_W(x, i, p) BF16_STORE(8, (x), (i), (p))
#endif
#else
#define HSUM_W(x) (((x).s0 + (x).s1) + ((x).s2 + (x).s3))
#define LOAD_W(p, i) vload4((i), (p))
#define STORE_W(x, i, p) vstore4((x), (i), (p))
#endif

#define DECODE_NV_PTX ROW_SHUFFLE
#define QPIECE VW         // a lane's dims: the piece of a quantized row it dequantizes
#include "decode_common.h"

static inline floatW to_float(raw_t r)
{
#if STORE_HALF
    return vload_half8(0, (const __private half *)&r);
#elif STORE_BF16  /* element 2i in the low half of word i */
    const uint hi = 0xffff0000u;
    return as_float8((uint8)(r.x << 16, r.x & hi, r.y << 16, r.y & hi, r.z << 16, r.z & hi, r.w << 16, r.w & hi));
#else
    return r;
#endif
}

#if K_QUANT
#define K_TO_FLOAT(r) dequant(K_QUANT, (r))
#else
#define K_TO_FLOAT(r) to_float(r)
#endif
#if V_QUANT
#define V_TO_FLOAT(r) dequant(V_QUANT, (r))
#else
#define V_TO_FLOAT(r) to_float(r)
#endif

/* a K/V chunk as fetched: a build with a quantized side keeps its pieces as loaded (qpiece_t)
 * and packs them (qpacked) where the tile is consumed */
#if K_QUANT || V_QUANT
typedef qpiece_t chunk_t;
#define CHUNK_OF(x) qpiece_of(x)
#define PACKED(fmt, x) qpacked((fmt), (x))
#else
typedef raw_t chunk_t;
#define CHUNK_OF(x) (x)
#define PACKED(fmt, x) (x)
#endif

#if ROW_SHUFFLE
/* Sum of x over the LANES work-items of one K row: they are consecutive and LANES-aligned in a
 * 32-wide NVIDIA warp (lane fastest, LANES a power of two), so an xor butterfly inside the warp
 * reaches exactly them. Every lane ends with the same bits (each step adds the same two values). */
static inline float row_sum(float x)
{
    for (int offset = LANES / 2; offset > 0; offset >>= 1)
        x += warp_xor(x, offset);
    return x;
}
#endif

/* The split's attention state of HEAD_TILE query heads; written normalized (final) or raw. */
static inline void decode_body(DECODE_PARAMS VARIANT_PARAMS QUANT_PARAMS, const bool partial,
                               __local float *partials, __local float *scores, __local raw_t *tile,
                               __local float *red_m, __local float *red_l, __local float *red_acc)
{
    const int tid = get_local_id(0);
    const int lane = tid % LANES;
    const int row = (tid / LANES) % ROWS;
    const int ht = tid / (LANES * ROWS);
    const int split = get_group_id(0);
    const int kv_head = get_group_id(1);
    const int batch = get_group_id(2);
    const int head0 = kv_head * GROUP + ht * HEAD_TILE;  /* first query head of this work-item */

    DECODE_SPAN(BLOCK_N)  /* k0, k1, n_used, ctx_ok, bt_row, k_base, v_base, k_rel, v_rel */
#if K_QUANT
#define LOAD_K(j, part) load_quant(K_QUANT, HEAD_DK, (__global const uchar *)k, k_off, k_rel, K_SCALES, \
                                   (j), bt_row, block_shift, num_blocks, k_s0, k_s1, VW * (part))
#else
#define LOAD_K(j, part) CHUNK_OF(load_chunk(k_base, (j), bt_row, block_shift, num_blocks, k_s0, k_s1, (part)))
#endif
#if V_QUANT
#define LOAD_V(j, part) load_quant(V_QUANT, HEAD_DV, (__global const uchar *)v, v_off, v_rel, V_SCALES, \
                                   (j), bt_row, block_shift, num_blocks, v_s0, v_s1, VW * (part))
#else
#define LOAD_V(j, part) CHUNK_OF(load_chunk(v_base, (j), bt_row, block_shift, num_blocks, v_s0, v_s1, (part)))
#endif

    /* q chunks, pre-scaled so that scores are in the log2 domain; lanes past DK hold zeros.
     * The empty state, or NaN for a bad context length (it survives every merge). */
    floatW qv[HEAD_TILE], acc[HEAD_TILE];
    float m[HEAD_TILE], l[HEAD_TILE], slope[HEAD_TILE];
    for (int i = 0; i < HEAD_TILE; ++i) {
        slope[i] = ALIBI_SLOPE_LOG2(batch, head0 + i);
        __global const store_t *q_row = q + q_off + batch * q_sb + (head0 + i) * q_sh;
        qv[i] = (lane < CK) ? LOAD_W(q_row, lane) * scale_log2 : (floatW)(0.0f);
        acc[i] = (floatW)(ctx_ok ? 0.0f : NAN);
        m[i] = -INFINITY;
        l[i] = ctx_ok ? 0.0f : NAN;
    }

    /* keys past k1 are never loaded: their chunks stay zero (p * garbage could be NaN); the rows
     * of an out-of-range block read as NaN (load_chunk) */
#if STAGED
    chunk_t pre[LOADS];
#define FETCH_TILE(t0)                                                                      \
    for (int c_ = 0; c_ < LOADS; ++c_) {                                                    \
        const int c = tid + c_ * WG;                                                        \
        const int key = c / (CK + CV), part = c % (CK + CV), j = (t0) + key;                \
        pre[c_] = CHUNK_OF((raw_t)(0));                                                     \
        if (c < TILE_CHUNKS && j < k1)                                                      \
            pre[c_] = (part < CK) ? LOAD_K(j, part) : LOAD_V(j, part - CK);                 \
    }
#else
    chunk_t kn[UNROLL], vn[UNROLL];
#define FETCH_TILE(t0)                                                                      \
    for (int u = 0; u < UNROLL; ++u) {                                                      \
        const int j = (t0) + u * ROWS + row;                                                \
        kn[u] = CHUNK_OF((raw_t)(0));                                                       \
        vn[u] = CHUNK_OF((raw_t)(0));                                                       \
        if (j < k1) {                                                                       \
            if (lane < CK)                                                                  \
                kn[u] = LOAD_K(j, lane);                                                    \
            if (lane < CV)                                                                  \
                vn[u] = LOAD_V(j, lane);                                                    \
        }                                                                                   \
    }
#endif

    FETCH_TILE(k0)
    for (int t0 = k0; t0 < k1; t0 += BLOCK_N) {
        raw_t kc[UNROLL], vc[UNROLL];
#if STAGED
        for (int c_ = 0; c_ < LOADS; ++c_)
            if (tid + c_ * WG < TILE_CHUNKS)
                tile[tid + c_ * WG] = ((tid + c_ * WG) % (CK + CV) < CK) ? PACKED(K_QUANT, pre[c_])
                                                                        : PACKED(V_QUANT, pre[c_]);
        if (t0 + BLOCK_N < k1) {
            FETCH_TILE(t0 + BLOCK_N)  /* next tile in flight while this one is computed */
        }
        /* the tile is complete before any head tile reads it */
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int u = 0; u < UNROLL; ++u) {
            const int base = (u * ROWS + row) * (CK + CV);
            kc[u] = (lane < CK) ? tile[base + lane] : (raw_t)(0);
            vc[u] = (lane < CV) ? tile[base + CK + lane] : (raw_t)(0);
        }
#else
        for (int u = 0; u < UNROLL; ++u) {
            kc[u] = PACKED(K_QUANT, kn[u]);
            vc[u] = PACKED(V_QUANT, vn[u]);
        }
        if (t0 + BLOCK_N < k1) {
            FETCH_TILE(t0 + BLOCK_N)  /* next tile in flight while this one is computed */
        }
#endif

#if ROW_SHUFFLE
        /* scores of this row slot's keys, summed across the row's lanes in registers; keys past
         * k1 (the tail of the last tile) are -inf */
        float sc[UNROLL][HEAD_TILE];
        for (int u = 0; u < UNROLL; ++u) {
            const floatW kf = K_TO_FLOAT(kc[u]);
            const int key = t0 + u * ROWS + row;
            float s_[HEAD_TILE];
            for (int i = 0; i < HEAD_TILE; ++i)
                s_[i] = row_sum(HSUM_W(qv[i] * kf));
#if SOFTCAP_SPREAD
            /* every lane of the row holds every head's score: lane i of the row caps head i's
             * (lanes past HEAD_TILE repeat) and the row's lanes read the capped ones from there */
            float mine = s_[0];
            for (int i = 1; i < HEAD_TILE; ++i)
                mine = (lane % HEAD_TILE == i) ? s_[i] : mine;
            mine = SOFTCAP_SCORE(mine);
            for (int i = 0; i < HEAD_TILE; ++i)
                s_[i] = warp_idx(mine, (tid % 32) - lane + i);
#define CAPPED(s) (s)
#else
#define CAPPED(s) SOFTCAP_SCORE(s)
#endif
            for (int i = 0; i < HEAD_TILE; ++i)
                sc[u][i] = (key < k1 && ROW_VISIBLE(batch, head0 + i, key, n_used))
                           ? ALIBI_SCORE(CAPPED(s_[i]), slope[i], ROW_POS(head0 + i, n_used) - key)
                             + MASK_ADD(batch, head0 + i, key)
                           : -INFINITY;
#undef CAPPED
        }
#define SCORE(u, i) sc[u][i]
#else
        /* partial dot products over this lane's VW dims, for every head of the tile */
        for (int u = 0; u < UNROLL; ++u) {
            const floatW kf = K_TO_FLOAT(kc[u]);
            for (int i = 0; i < HEAD_TILE; ++i)
                partials[((ht * HEAD_TILE + i) * BLOCK_N + u * ROWS + row) * PSTRIDE + lane] =
                    HSUM_W(qv[i] * kf);
        }
        /* all partials are written before they are summed (also: everyone has read the K/V
         * tile, so the next iteration may overwrite it) */
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int x = tid; x < GROUP * BLOCK_N; x += WG) {
            float s = 0.0f;
            for (int c = 0; c < CK; ++c)
                s += partials[x * PSTRIDE + c];
            const int key = t0 + x % BLOCK_N, head = kv_head * GROUP + x / BLOCK_N;
            s = SCORE_VARIANTS(s, ALIBI_SLOPE_LOG2(batch, head), ROW_POS(head, n_used) - key);
            /* the tail of the last tile, and (QUERY_ROWS, ROW_MASK) the keys a row does not see */
            scores[x] = (key < k1 && ROW_VISIBLE(batch, head, key, n_used)) ? s + MASK_ADD(batch, head, key)
                                                                            : -INFINITY;
        }
        /* scores complete before they are read; the next write to them is after the next
         * iteration's first barrier, which every work-item reaches only after reading them */
        barrier(CLK_LOCAL_MEM_FENCE);

#define SCORE(u, i) scores[(ht * HEAD_TILE + (i)) * BLOCK_N + (u) * ROWS + row]
#endif

        /* online softmax of this row slot's keys: rescale acc to the new max, add p @ v */
        floatW vf[UNROLL];
        for (int u = 0; u < UNROLL; ++u)
            vf[u] = V_TO_FLOAT(vc[u]);
        for (int i = 0; i < HEAD_TILE; ++i) {
            float s[UNROLL];
            float tile_max = -INFINITY;
            for (int u = 0; u < UNROLL; ++u) {
                s[u] = SCORE(u, i);
                tile_max = fmax(tile_max, s[u]);
            }
            const float m_new = fmax(m[i], tile_max);
            const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;  /* nothing seen: no inf - inf */
            const float alpha = exp2(m[i] - m_use);
            l[i] *= alpha;
            acc[i] *= alpha;
            for (int u = 0; u < UNROLL; ++u) {
                const float p = exp2(s[u] - m_use);
                l[i] += p;
                /* a key a row does not see adds nothing to it, even a V of inf (0 inf = NaN); the
                 * tail past k1 is zeros. Plain builds: every row sees every key, no test */
                const int key = t0 + u * ROWS + row;
                if (!(QUERY_ROWS > 1 || ROW_MASK) || (key < k1 && ROW_VISIBLE(batch, head0 + i, key, n_used)))
                    acc[i] = fma((floatW)(p), vf[u], acc[i]);
            }
            m[i] = m_new;
        }
#undef SCORE
    }
#undef FETCH_TILE
#undef LOAD_K
#undef LOAD_V

    /* merge the ROWS row-slot states: shared max per head, then sum l and acc over the rows; a
     * sink joins as one more slot of value zero */
    for (int i = 0; i < HEAD_TILE; ++i)
        if (lane == 0)
            red_m[row * GROUP + ht * HEAD_TILE + i] = m[i];
    barrier(CLK_LOCAL_MEM_FENCE);
    float m_all[HEAD_TILE], l_all[HEAD_TILE], sink[HEAD_TILE];
    for (int i = 0; i < HEAD_TILE; ++i) {
        sink[i] = SINK_LOG2(head0 + i, !partial || split == 0);
        float mx = sink[i];
        for (int r = 0; r < ROWS; ++r)
            mx = fmax(mx, red_m[r * GROUP + ht * HEAD_TILE + i]);
        const float w = exp2(m[i] - ((mx == -INFINITY) ? 0.0f : mx));  /* empty slot: w = 0 */
        acc[i] *= w;
        l[i] *= w;
        m_all[i] = mx;
        if (lane == 0)
            red_l[row * GROUP + ht * HEAD_TILE + i] = l[i];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int i = 0; i < HEAD_TILE; ++i) {
        /* the sink's term; none here, or no key and no sink: exp2(-inf) = 0 */
        float sum = SINKS ? exp2(sink[i] - ((m_all[i] == -INFINITY) ? 0.0f : m_all[i])) : 0.0f;
        for (int r = 0; r < ROWS; ++r)
            sum += red_l[r * GROUP + ht * HEAD_TILE + i];
        l_all[i] = sum;
    }

    for (int i = 0; i < HEAD_TILE; ++i) {
        floatW a = acc[i];
#if ROWS > 1
        if (lane < CV)
            FLASHCL_CAT(vstore, VW)(a, 0, red_acc + (row * NHT + ht) * HEAD_DV + lane * VW);
        /* every row slot's share is in local memory before row 0 sums them */
        barrier(CLK_LOCAL_MEM_FENCE);
        if (row == 0 && lane < CV) {
            a = (floatW)(0.0f);
            for (int r = 0; r < ROWS; ++r)
                a += FLASHCL_CAT(vload, VW)(0, red_acc + (r * NHT + ht) * HEAD_DV + lane * VW);
        }
        /* row 0 has read red_acc before the next head overwrites it */
        barrier(CLK_LOCAL_MEM_FENCE);
#endif
        if (row != 0)
            continue;
        const int head = head0 + i;
        const ulong state = ((ulong)batch * h_q + head) * num_splits + split;
        if (partial) {
            if (lane < CV)
                FLASHCL_CAT(vstore, VW)(a, lane, part_acc + state * HEAD_DV);
            if (lane == 0) {
                part_m[state] = m_all[i];
                part_l[state] = l_all[i];
            }
        } else {
            const float inv_l = (l_all[i] > 0.0f) ? 1.0f / l_all[i] : 0.0f;  /* no key: zeros */
            if (lane < CV)
                STORE_W(a * inv_l, lane, out + o_off + batch * o_sb + head * o_sh);
            if (lane == 0)
                lse[(ulong)batch * h_q + head] = lse_of_state(m_all[i], l_all[i]);
        }
    }
}

#define DECODE_KERNEL(NAME, IS_PARTIAL)                                                      \
__kernel FLASHCL_REQD_WG(WG)                                                                 \
void NAME(DECODE_PARAMS VARIANT_PARAMS QUANT_PARAMS)                                         \
{                                                                                            \
    __local float partials[ROW_SHUFFLE ? 1 : GROUP * BLOCK_N * PSTRIDE];                     \
    __local float scores[ROW_SHUFFLE ? 1 : GROUP * BLOCK_N];                                 \
    __local raw_t tile[STAGED ? TILE_CHUNKS : 1];                                            \
    __local float red_m[ROWS * GROUP], red_l[ROWS * GROUP];                                  \
    __local float red_acc[ROWS > 1 ? ROWS * NHT * HEAD_DV : 4];                              \
    decode_body(DECODE_ARGS VARIANT_ARGS QUANT_ARGS, IS_PARTIAL, partials, scores, tile, red_m, red_l, \
                red_acc);                                                                    \
}

#if !MERGE_ONLY
DECODE_KERNEL(flash_decode, false)
DECODE_KERNEL(flash_decode_split, true)
#endif

/* Merge the num_splits states of one (batch, query head): grid (MERGE_WG * H_q, B).
 * Work-items stride over the splits for the max and the denominator (lanes past num_splits hold
 * the empty-state sentinel -inf / 0), then share the weighted sum of the accumulators by columns
 * and by groups of splits. */
#define MERGE_COLS (HEAD_DV / 4 < MERGE_WG ? HEAD_DV / 4 : MERGE_WG)  // float4 column work-items
#define MERGE_GROUPS (MERGE_WG / MERGE_COLS)                            // groups of splits
__kernel __attribute__((reqd_work_group_size(MERGE_WG, 1, 1)))
void flash_decode_merge(__global const float *part_m, __global const float *part_l,
                        __global const float *part_acc, __global store_t *out, __global float *lse,
                        const int h_q, const int num_splits,
                        const ulong o_off, const ulong o_sb, const ulong o_sh,
                        __local float *weights /* num_splits floats */)
{
    __local float red[MERGE_WG];
    __local float red_acc[MERGE_GROUPS * HEAD_DV] LDS_ALIGNED;
    const int tid = get_local_id(0);
    const int head = get_group_id(0);
    const int batch = get_group_id(1);
    const ulong state0 = ((ulong)batch * h_q + head) * num_splits;

    float mx = -INFINITY;
    for (int s = tid; s < num_splits; s += MERGE_WG)
        mx = fmax(mx, part_m[state0 + s]);
    red[tid] = mx;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = MERGE_WG / 2; w > 0; w /= 2) {
        if (tid < w)
            red[tid] = fmax(red[tid], red[tid + w]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float m_all = red[0];
    const float m_use = (m_all == -INFINITY) ? 0.0f : m_all;  /* every split empty: no inf - inf */
    /* everyone has read red[0] before it is reused for the denominator */
    barrier(CLK_LOCAL_MEM_FENCE);

    float l_sum = 0.0f;
    for (int s = tid; s < num_splits; s += MERGE_WG) {
        const float w = exp2(part_m[state0 + s] - m_use);  /* empty split: exp2(-inf) = 0 */
        weights[s] = w;
        l_sum += part_l[state0 + s] * w;
    }
    red[tid] = l_sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = MERGE_WG / 2; w > 0; w /= 2) {
        if (tid < w)
            red[tid] += red[tid + w];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float l_all = red[0];
    const float inv_l = (l_all > 0.0f) ? 1.0f / l_all : 0.0f;

    /* weighted sum of the accumulators: float4 columns (HEAD_DV is a multiple of 4) over
     * MERGE_COLS work-items and the splits over MERGE_GROUPS groups of them, so that each work-item
     * keeps several independent loads in flight (one work-item per column walking every split is
     * a serial chain of loads: 11 us of a 97 us decode at 64 splits on an H100); the groups' sums
     * meet in local memory */
    const int col = tid % MERGE_COLS;
    const int grp = tid / MERGE_COLS;
    if (grp < MERGE_GROUPS) {
        for (int c = col; c < HEAD_DV / 4; c += MERGE_COLS) {
            float4 a = (float4)(0.0f);
#if UNROLL_MERGE
#pragma unroll 8
#endif
            for (int s = grp; s < num_splits; s += MERGE_GROUPS)
                a = fma((float4)(weights[s]), vload4(c, part_acc + (state0 + s) * HEAD_DV), a);
            vstore4(a, c, red_acc + grp * HEAD_DV);
        }
    }
    /* every group's sums are in local memory before they are added */
    barrier(CLK_LOCAL_MEM_FENCE);
    __global store_t *o_row = out + o_off + batch * o_sb + head * o_sh;
    for (int d = tid; d < HEAD_DV; d += MERGE_WG) {
        float a = 0.0f;
        for (int g = 0; g < MERGE_GROUPS; ++g)
            a += red_acc[g * HEAD_DV + d];
#if STORE_HALF
        vstore_half_rte(a * inv_l, d, o_row);
#elif STORE_BF16
        o_row[d] = bf16_round(a * inv_l);
#else
        o_row[d] = a * inv_l;
#endif
    }
    if (tid == 0)
        lse[(ulong)batch * h_q + head] = lse_of_state(m_all, l_all);
}
