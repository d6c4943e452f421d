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
