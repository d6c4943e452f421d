/* What both prefill layouts (prefill.cl, prefill_tiles.cl) share: the host's switches, the grid
 * mapping of a work-group to its query block and DV slice, and the causal bound on its keys.
 * Include after BLOCK_M and DV_TILE are defined. */
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
#ifndef FIXED_WG
/* 1: declare reqd_work_group_size. NVIDIA's compiler turns it into a launch bound (.reqntid), and
 * ptxas then ignores -cl-nv-maxrregcount; the register-cap check (flashcl tune on a GPU standing
 * in for a smaller register file) builds with 0. */
#define FIXED_WG 1
#endif

#define NUM_DV_TILES (HEAD_DV / DV_TILE)

#if HEAD_DK % 4 != 0 || HEAD_DV % 4 != 0
#error "head dims must be multiples of 4"
#endif

/* Grid dim 0 enumerates (query block, DV slice) pairs, DV slice fastest. Causal work-groups take
 * the query blocks last to first: the longest rows start first, so the short ones fill the tail. */
static inline int query_block(const int n_q)
{
    const int m_block = get_group_id(0) / NUM_DV_TILES;
#if IS_CAUSAL
    return (n_q + BLOCK_M - 1) / BLOCK_M - 1 - m_block;
#else
    return m_block;
#endif
}

static inline int dv_slice_of_group(void)
{
    return get_group_id(0) % NUM_DV_TILES;
}

/* The keys [0, kv_end) the rows [row_base, row_base + BLOCK_M) of a block see: causal stops at
 * the last row's diagonal (bottom-right aligned), so later tiles are skipped, not masked. */
static inline int block_kv_end(const int row_base, const int n_q, const int n_kv)
{
#if IS_CAUSAL
    const int last_row = min(row_base + BLOCK_M, n_q) - 1;
    return clamp(last_row + n_kv - n_q + 1, 0, n_kv);
#else
    return n_kv;
#endif
}

#endif
