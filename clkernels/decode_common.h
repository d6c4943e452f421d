/* What the two decode kernel files (decode.cl: portable, decode_mma.cl: NVIDIA tensor cores)
 * share, so that the host launches either with one argument list: the parameters, the split's
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

/* This split's keys [*k0, *k1) of a sequence of n keys: chunks of whole tiles of `tile` keys,
 * so that only the sequence's last tile is partial; a split past the end is empty (k0 == k1). */
static inline void split_range(const int n, const int num_splits, const int split, const int tile,
                               int *k0, int *k1)
{
    const int per_split = (n + num_splits - 1) / num_splits;
    const int chunk = (per_split + tile - 1) / tile * tile;
    *k0 = min(split * chunk, n);
    *k1 = min(*k0 + chunk, n);
}

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
#else
#define RAW_NAN ((raw_t)(NAN))
#endif

/* chunk offset (in raw_t units) of key j's row, relative to the (batch, KV head) base; *ok is
 * false where the row's block id is out of range (the row must not be read) */
static inline ulong row_offset(const int j, __global const int *bt_row, const int block_shift,
                               const int num_blocks, const ulong s0, const ulong s1, bool *ok)
{
#if PAGED
    const int block = bt_row[j >> block_shift];
    *ok = (uint)block < (uint)num_blocks;  /* one compare: a negative id is a large uint */
    return (ulong)block * s0 + (ulong)(j & ((1 << block_shift) - 1)) * s1;
#else
    *ok = true;
    return (ulong)j * s1;
#endif
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

#if DECODE_NV_PTX
/* x of the work-item whose lane in the 32-wide NVIDIA warp is this one's lane xor mask (inline
 * PTX: OpenCL 1.2 has no subgroup shuffles); the whole warp must call it together. */
static inline float warp_xor(const float x, const int mask)
{
    float y;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(mask));
    return y;
}
#endif

#endif
