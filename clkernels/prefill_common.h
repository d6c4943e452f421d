/* What both prefill layouts (prefill.cl, prefill_tiles.cl) share: the host's switches, the grid
 * mapping of a work-group to its query block and DV slice, the causal and window bounds on its
 * keys, the attention variants (flashcl/variants.py) and the reading of plain or quantized K/V
 * rows into the tiles. Include after BLOCK_M, BLOCK_N and DV_TILE are defined. */
#ifndef FLASHCL_PREFILL_COMMON_H
#define FLASHCL_PREFILL_COMMON_H

#include "common.h"

#ifndef IS_CAUSAL
#define IS_CAUSAL 0       // 1: bottom-right aligned causal mask
#endif
#ifndef WRITE_LSE
#define WRITE_LSE 0       // 1: also write the per-row log-sum-exp
#endif
#ifndef UNROLL_LOOPS
#define UNROLL_LOOPS 1    // 1: fully unroll the loops over private arrays (GPUs); 0 on CPUs
#endif
/* PoCL (POCL_DEVICE_ADDRESS_BITS is its predefine) builds the rolled loops whatever it is given:
 * its work-group compiler (3.x) takes a per-key branch of the unrolled guarded P V loops for a
 * uniform one (wrong rows with a mask), and a source exported for a GPU may be built there. */
#if UNROLL_LOOPS && defined(POCL_DEVICE_ADDRESS_BITS)
#undef UNROLL_LOOPS
#define UNROLL_LOOPS 0
#endif

/* On GPUs every loop over a private array is fully unrolled so that the array lives in
 * registers: a loop left rolled indexes the array dynamically, which puts it in (off-chip)
 * private memory -- CL_KERNEL_PRIVATE_MEM_SIZE > 0 with no spill reported by the compiler. On
 * CPUs only the loops over a row's vectors (UNROLL_VEC, a few iterations) are: rolled, their
 * accumulators stayed in memory, a load and a store per FMA (docs/notes/pocl-prefill.md);
 * unrolling every loop there multiplied build time ~10x. */
#if UNROLL_LOOPS
#define UNROLL _Pragma("unroll")
#define UNROLL_VEC UNROLL
#define PER_ITEM(n) (n)
#else
#define UNROLL
#define UNROLL_VEC _Pragma("unroll")
/* PoCL (CPUs) turns each innermost loop whose trip count it can prove uniform across the
 * work-group into a "horizontal" loop: one iteration for every work-item, then the next, with
 * each work-item's accumulators and loop counter in memory (~12 instructions per vector FMA,
 * measured with perf). A trip count that depends on the work-item keeps the loop inside each
 * work-item, where the accumulators stay in registers. `lid > INT_MAX - 1` is never true. */
#define PER_ITEM(n) ((n) + (lid > 0x7ffffffe))  // lid: the kernel's work-item index
#endif

/* Attention variants, each compiled in only when on (off, the kernels are the plain ones). Their
 * runtime values are kernel arguments that are passed always and read only when the flag is on. */
#ifndef HAS_WINDOW
#define HAS_WINDOW 0      // 1: row at position p sees keys p - win_left <= j <= p + win_right
#endif
#ifndef HAS_SOFTCAP
#define HAS_SOFTCAP 0     // 1: s = c * tanh(s / c) with c = softcap_log2 (log2 domain)
#endif
#ifndef HAS_SINKS
#define HAS_SINKS 0       // 1: sinks[head] (natural log) joins each row's normalizer and its lse
#endif
#ifndef HAS_ALIBI
#define HAS_ALIBI 0       // 1: s -= alibi[b, head] * |p - j| (slopes in natural-log units)
#endif
#ifndef MASK_KIND
#define MASK_KIND 0       // 0: no mask; 1: bool mask (uchar, 0 hides); 2: additive float (MASK_HIDES_AT hides)
#endif
#if MASK_KIND < 0 || MASK_KIND > 2
#error "MASK_KIND must be 0 (none), 1 (bool) or 2 (additive float)"
#endif

/* Mask element type; every mask kernel also reads tile_map (uchar per query block and key tile:
 * TILE_HIDDEN = every key hidden, the tile is skipped; TILE_PARTIAL = some key hidden, the tile
 * is guarded per key; TILE_VISIBLE = none hidden, a bool mask is not even read). */
#if MASK_KIND == 2
typedef float mask_t;
#else
typedef uchar mask_t;
#endif
#define TILE_HIDDEN 0
#define TILE_PARTIAL 1
#define TILE_VISIBLE 2

#define NUM_DV_TILES (HEAD_DV / DV_TILE)

#if HEAD_DK % 4 != 0 || HEAD_DV % 4 != 0
#error "head dims must be multiples of 4"
#endif

/* The work-group's tile: grid dim 0 enumerates (DV slice, (batch, head), query block) with the
 * DV slice fastest, in sections of head_section (batch, head) pairs (the host sizes a section so
 * that its K/V fit in the cache). Inside a section the query blocks go by rank and the section's
 * heads are interleaved; causal work-groups take the query blocks last to first. Dispatch follows
 * group order, so the longest causal rows of every head of the section start first and the
 * short ones fill the tail: the run is no longer than the longest work-group, and in head-by-head
 * order the last heads' long blocks would start last (measured on the H100 at d=64, N=2048: a
 * causal run took as long as a non-causal one). */
static inline void tile_of_group(const int n_q, const int h_q, const int head_section,
                                 int *batch, int *head, int *m_block, int *dv_slice)
{
    const int num_m = (n_q + BLOCK_M - 1) / BLOCK_M;
    int gid = get_group_id(0);
    *dv_slice = gid % NUM_DV_TILES;
    gid /= NUM_DV_TILES;
    const int pairs = get_num_groups(0) / NUM_DV_TILES / num_m;  /* B * H_q */
    const int first = gid / (head_section * num_m) * head_section;
    const int heads = min(head_section, pairs - first);          /* the last section may be short */
    const int in_section = gid - first * num_m;
    const int pair = first + in_section % heads;
    const int rank = in_section / heads;
#if IS_CAUSAL
    *m_block = num_m - 1 - rank;
#else
    *m_block = rank;
#endif
    *batch = pair / h_q;
    *head = pair % h_q;
}

/* The keys [.., kv_end) the rows [row_base, row_base + BLOCK_M) of a block see: causal stops at
 * the last row's diagonal (bottom-right aligned) and a window at the last row's right edge, so
 * later tiles are skipped, not masked. */
static inline int block_kv_end(const int row_base, const int n_q, const int n_kv, const int win_right)
{
    const int last_pos = min(row_base + BLOCK_M, n_q) - 1 + n_kv - n_q;
    int end = n_kv;
#if IS_CAUSAL
    end = clamp(last_pos + 1, 0, end);
#endif
#if HAS_WINDOW
    end = clamp(last_pos + win_right + 1, 0, end);
#endif
    return end;
}

/* The first KV tile the block sees: a window starts at the first row's left edge; earlier
 * tiles are never staged. Tiles stay aligned to multiples of BLOCK_N (the mask's tile_map). */
static inline int block_kv_begin(const int row_base, const int n_q, const int n_kv, const int win_left)
{
#if HAS_WINDOW
    return max(0, row_base + n_kv - n_q - win_left) / BLOCK_N * BLOCK_N;
#else
    return 0;
#endif
}

/* 1 when a row of the block (first position first_pos) may not see some key of the tile at n0
 * because of where it lies (causal diagonal, window edges): its P V product is guarded per key,
 * since p = 0 times a hidden V holding inf or NaN would be NaN. */
static inline bool tile_crosses_edge(const int n0, const int first_pos, const int win_left,
                                     const int win_right)
{
    bool crosses = false;
#if IS_CAUSAL
    crosses = n0 + BLOCK_N - 1 > first_pos;
#endif
#if HAS_WINDOW
    crosses = crosses || n0 < first_pos + BLOCK_M - 1 - win_left || n0 + BLOCK_N - 1 > first_pos + win_right;
#endif
    return crosses;
}

/* ---- K/V caches: store_t rows, or quantized rows (kv_quant.h) dequantized while staged ---------
 * A plain buffer is addressed in store_t elements, a quantized one in bytes; the tiles in local
 * memory are float32 either way. */
#include "storage.h"
#include "kv_quant.h"

#if K_QUANT
typedef uchar k_elem_t;
#else
typedef store_t k_elem_t;
#endif
#if V_QUANT
typedef uchar v_elem_t;
/* a quantized V row is read from its start (its blocks cannot be offset to a DV slice by
 * pointer): stage_quant_v starts at the slice's first column */
#define V_SLICE_ELEMS(dv0) 0
#else
typedef store_t v_elem_t;
#define V_SLICE_ELEMS(dv0) (dv0)
#endif

/* K rows [n0, n0 + BLOCK_N) of one (batch, KV head), k_rows, into local memory transposed
 * (dst[d][j]), dequantized when K is quantized; keys past n_kv are zeros. k_scales: the int8
 * scales of k_rows (read only by int8 builds). wg work-items share the copy. */
static inline void stage_k_tile(__local float *dst, __global const k_elem_t *k_rows, const ulong k_sn,
                                __global const float *k_scales, const int n0, const int n_kv,
                                const int lid, const int wg)
{
#if K_QUANT
    stage_quant_transposed(K_QUANT, dst, k_rows, k_sn, k_scales, k_sn / HEAD_DK, n0, n_kv, BLOCK_N, HEAD_DK,
                           lid, wg);
#else
    stage_transposed(dst, k_rows, k_sn, n0, n_kv, BLOCK_N, HEAD_DK, 1.0f, lid, wg);
#endif
}

/* The DV slice [dv0, dv0 + DV_TILE) of V rows [n0, n0 + BLOCK_N) into local memory (dst[j][col]),
 * dequantized when V is quantized; keys past n_kv are zeros. A plain v_rows already points at the
 * slice (V_SLICE_ELEMS); v_scales: the int8 scales of v_rows. */
static inline void stage_v_tile(__local float *dst, __global const v_elem_t *v_rows, const ulong v_sn,
                                __global const float *v_scales, const int n0, const int n_kv,
                                const int dv0, const int lid, const int wg)
{
#if V_QUANT
    stage_quant_rows(V_QUANT, dst, v_rows, v_sn, v_scales, v_sn / HEAD_DV, n0, n_kv, BLOCK_N, dv0, DV_TILE,
                     lid, wg);
#else
    for (int i = lid; i < BLOCK_N * (DV_TILE / 4); i += wg) {
        const int j = i / (DV_TILE / 4), c = i % (DV_TILE / 4);
        const float4 x = (n0 + j < n_kv) ? LOAD4(v_rows + (ulong)(n0 + j) * v_sn, c) : (float4)(0.0f);
        vstore4(x, i, dst);
    }
#endif
}

/* The row of a mask's tile map that a work-group's query block m_block reads (one uchar per key
 * tile: TILE_HIDDEN, TILE_PARTIAL, TILE_VISIBLE) */
#define TILE_MAP_ROW(batch, head, m_block) \
    (tile_map + (batch) * map_sb + (head) * map_sh + (ulong)(m_block) * ((n_kv + BLOCK_N - 1) / BLOCK_N))

#if MASK_KIND
/* [*begin, *end) narrowed to the block's first and last tiles its mask does not wholly hide: a
 * hidden tile the loop steps over still costs an iteration (on PoCL a pass over the work-group's
 * items, ~2 us: a causal rule as a mask took 1.3x causal=True). Hidden tiles between stay skipped. */
static inline void mask_kv_range(__global const uchar *block_map, int *begin, int *end)
{
    while (*begin < *end && block_map[*begin / BLOCK_N] == TILE_HIDDEN)
        *begin += BLOCK_N;
    while (*end > *begin && block_map[(*end - 1) / BLOCK_N] == TILE_HIDDEN)
        *end = (*end - 1) / BLOCK_N * BLOCK_N;
}
#endif

#if HAS_SINKS
/* Fold a head's sink (logit sink_log2, value zero) into a row's final state (max m, sum l):
 * returns the factor that rescales the row's accumulator to the new max. */
static inline float fold_sink(const float sink_log2, float *m, float *l)
{
    const float m_new = fmax(*m, sink_log2);
    const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;  /* no key and a -inf sink */
    const float alpha = exp2(*m - m_use);
    *l = *l * alpha + exp2(sink_log2 - m_use);
    *m = m_new;
    return alpha;
}
#endif

#endif
