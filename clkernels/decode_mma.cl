/* flashcl decode on NVIDIA tensor cores: decode.cl's kernels (same arguments, same outputs and
 * split states, merged by decode.cl's flash_decode_merge), with both products on mma.sync.
 *
 * Why: decode.cl scores a key with 16 work-items per row, each doing 4 heads x 8 dims of FMAs, a
 * 4-step shuffle sum per head and its own online softmax: ~115 warp instructions per key row, so
 * on an H100 the SMs run out of issue slots before HBM runs out of bandwidth (52% of copy at
 * (1, 32/8, 32k)). One m16n8k16 instruction does 16 x 8 x 16 multiply-adds: here a warp spends
 * one MMA and ~25 other instructions per key of an fp16 cache
 * (docs/notes/opencl-decode-nvidia.md, "Keys as the MMAs' rows").
 *
 * One work-group = MMA_WARPS warps serves one (sequence, KV head, split) and up to 16 query heads
 * of its GQA group (one or two n-tiles of 8 heads, NH; heads past G are zeros and never stored):
 * the whole group for G <= 16; a larger group takes ceil(G / 16) work-groups, which read the same
 * K/V rows at the same time, the second from L2. Warp w takes the 16-key tiles w, w + MMA_WARPS,
 * ... of the split and keeps its own online-softmax state; the warps' states meet in local memory
 * at the end.
 *
 * Keys are the MMAs' M rows, query heads their N columns (a GQA group of 4-8 fills N = 8, where
 * heads as M rows left 8-12 of 16 rows as padding, whose zeros cost a move per register per MMA).
 * Per 16-key tile, with g = lane / 4 and c = lane % 4 (PTX ISA "mma.m16n8k16" fragments):
 *
 *   S^T = K Q^T   A = K (16 keys x 16 dims per k-step), B = Q^T (16 dims x 8 heads).
 *                 The order of the dims inside a dot product is free, so k-position 2c+e (e < 2)
 *                 of step s is dim c*DK/4 + 4s + e and k-position 2c+8+e is dim c*DK/4 + 4s+2+e:
 *                 a work-item's fragments of K come from two rows (keys t0 + g, t0 + 8 + g), a
 *                 contiguous quarter c of each -- plain 16-byte loads, no shuffles.
 *   O^T += V^T P^T  A = V^T (16 output dims x 16 keys), DV/16 m-tiles: m-tile d, row r < 8 is
 *                 dim r * DV/8 + 2d and row r + 8 dim r * DV/8 + 2d + 1, so a work-item's A
 *                 fragments are the contiguous eighth g of the V rows 2c, 2c+1, 8+2c, 9+2c, two
 *                 rows' halves paired by a byte permute. B = P^T (16 keys x 8 heads): S^T's
 *                 accumulator holds keys g and g + 8 of heads 2c, 2c+1, the rows of two 8 x 8
 *                 blocks of P; one movmatrix.trans each makes them P^T's B fragments.
 *
 * Numerics as decode.cl: fp16 products exact in fp32, fp32 accumulation, scores in log2 units
 * (the scale is applied to S in fp32, q stays exact), P rounded to fp16 for the second MMA (as
 * every tensor-core flash attention does). A bfloat16 cache (STORE_BF16, plain rows) takes the
 * bf16 MMA with P as two bf16 parts (hi + lo: 16 significant bits, past fp16's 11) in two MMAs,
 * so that out is the oracle rounded to bf16 as decode.cl's is. Keys past the split's end score
 * -inf and read the row of its last key (a visible row: P = 0 times finite values, and no zero-fill or branch per
 * row in the loop), and the tables are checked as in decode.cl (decode_common.h): a
 * context length outside [0, capacity] or a used block id outside [0, num_blocks) reads nothing
 * out of bounds and gives the sequence NaN out and lse.
 *
 * Variants as in decode.cl (decode_common.h): the window narrows the split ranges, softcap and
 * ALiBi change the log2-domain scores before the softmax, a sink joins the warps' final merge.
 * Quantized caches (K_QUANT / V_QUANT, decode_common.h): a work-item loads the same K quarter and
 * V eighth of the quantized row (int8 as pieces of 8 dims, ggml as the 16-byte chunks holding its
 * bytes), both a tile ahead, and turns them into the words of f16 pairs a plain row's chunks
 * would be (value = fp16(q * scale), as flashcl.dequantize rounds) only when they are used, K
 * before S^T = K Q^T, V before O^T += V^T P^T. int8 K goes in as its integers (exact in fp16),
 * its row scale applied to the fp32 scores.
 *
 * MMA_EMULATE=1 replaces the three PTX instructions (mma.sync, movmatrix, shfl.sync) by
 * local-memory exchanges with the same fragment semantics, so that the fragment bookkeeping above
 * is checked against the float64 oracle on any OpenCL device (PoCL in CI); it is for tests, not
 * speed. Every loop that contains them has the same trip count on the whole work-group (barriers).
 */

#include "common.h"   /* HEAD_DK, HEAD_DV, STORE_HALF, STORE_BF16, lse_of_state */
#ifndef GROUP
#error "GROUP (query heads per KV head, H_q / H_kv) must be defined by the host"
#endif
#ifndef MMA_WARPS
#define MMA_WARPS 4       // warps per work-group, each on its own 16-key tiles
#endif
#ifndef MMA_EMULATE
#define MMA_EMULATE 0
#endif
#ifndef QUANT_V_AHEAD
/* 1: a quantized V read a tile ahead, like K (rows of half a plain row's bytes or less leave too
 * few bytes in flight otherwise: docs/notes/opencl-decode-nvidia.md); 0 for comparisons */
#define QUANT_V_AHEAD 1
#endif

#if !STORE_2B
#error "decode_mma.cl: fp16 or bf16 storage only (an fp32 cache would need TF32 products: not exact)"
#endif
#if STORE_BF16 && (K_QUANT || V_QUANT)
#error "decode_mma.cl: quantized caches dequantize to fp16 words: fp16 q only"
#endif
#if GROUP < 1
#error "GROUP must be positive"
#endif
#if HEAD_DK % 32 != 0 || HEAD_DK > 256 || HEAD_DV % 64 != 0 || HEAD_DV > 128
#error "decode_mma.cl: DK a multiple of 32 up to 256, DV 64 or 128 (16-byte loads, registers)"
#endif
#if K_QUANT && (HEAD_DK & (HEAD_DK - 1)) != 0
#error "decode_mma.cl: a quantized K needs DK 32, 64, 128 or 256 (whole or aligned blocks per work-item)"
#endif

typedef uint4 raw_t;      // one 16-byte chunk of a K/V row: 8 halves
#if STORE_HALF
typedef half store_t;
#define STORE_OUT(x, i, p) vstore_half_rte((x), (i), (p))
#define STORE_OUT4(x, i, p) vstore_half4_rte((x), (i), (p))
#define EXPONENT_BITS 0x7c00u     // an fp16 word's exponent: all ones for inf and NaN
#define MMA_TYPE "f16"
#else
typedef ushort store_t;   // bfloat16 bits
#define STORE_OUT(x, i, p) ((p)[i] = bf16_round(x))
#define STORE_OUT4(x, i, p) BF16_STORE(4, (x), (i), (p))
#define EXPONENT_BITS 0x7f80u
#define MMA_TYPE "bf16"
#endif
#define DECODE_NV_PTX (!MMA_EMULATE)
#define QPIECE 8          // dims per dequantized piece of a quantized row: 4 words of f16 pairs
#include "decode_common.h"

/* KV_EVICT_FIRST (default: with the PTX instructions): the loop's K/V loads are marked
 * L1::evict_first, each row being read once; the first tile's K stays plain (marked too, it was
 * no faster). Up to 1% on an H100: docs/notes/opencl-decode-nvidia.md. */
#ifndef KV_EVICT_FIRST
#define KV_EVICT_FIRST DECODE_NV_PTX
#endif
static inline raw_t load_kv_plain(__global const raw_t *p) { return *p; }
#if KV_EVICT_FIRST && DECODE_NV_PTX
static inline raw_t load_kv_streamed(__global const raw_t *p)
{
    raw_t r;
    asm("ld.global.L1::evict_first.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
#else
#define load_kv_streamed load_kv_plain
#endif

#define WG (32 * MMA_WARPS)
#define TILE 16                     // keys per warp per iteration: the k extent of O^T += V^T P^T
#define ROUND (TILE * MMA_WARPS)    // keys per work-group per iteration
#define KSTEPS (HEAD_DK / 16)       // k-steps of S^T = K Q^T
#define KQ (HEAD_DK / 4)            // dims of a K row per work-item (quarter c)
#define KCH (KQ / 8)                // ... in 16-byte chunks
#define NTV (HEAD_DV / 8)           // dims of a V row per work-item
#define MTV (HEAD_DV / 16)          // m-tiles of O^T (16 output dims each)
#define VCH (NTV / 8)               // ... in 16-byte chunks
#define MTILES ((GROUP + 15) / 16)  // work-groups per KV head: one per 16 query heads
#define MT_ROWS (GROUP < 16 ? GROUP : 16)  // query heads of one work-group (the last may have fewer)
#define NH (MT_ROWS > 8 ? 2 : 1)    // n-tiles of 8 query heads

/* ---- the warp-level primitives -------------------------------------------------------------- */

#if MMA_EMULATE
/* Local scratch of one warp for the emulations: the A and B fragments of an MMA and the values
 * of a shuffle. Halves are handled as integer bits (no type punning through memory). */
typedef struct { uint a[32 * 4]; uint b[32 * 2]; float x[32]; } warp_scratch;

static inline float half_to_float(const uint h)
{
    const uint sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (e == 0)         /* zero or subnormal: mant * 2^-24 */
        return as_float(sign | as_uint((float)mant * 0x1p-24f));
    if (e == 31)        /* inf or nan */
        return as_float(sign | 0x7f800000u | (mant << 13));
    return as_float(sign | ((e + 112) << 23) | (mant << 13));
}

static inline uint float_to_half(const float f)   /* round to nearest even, as cvt.rn */
{
    const uint x = as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)
        return sign | 0x7e00u;                       /* nan */
    if (ax >= 0x477ff000u)
        return sign | 0x7c00u;                       /* >= 65520 and inf: inf */
    if (ax < 0x38800000u)                            /* below 2^-14: a subnormal half (or 0) */
        return sign | (uint)rint(as_float(ax) * 0x1p24f);
    uint r = ax - 0x38000000u;                       /* exponent bias 127 -> 15 */
    r += 0x0fffu + ((r >> 13) & 1u);                 /* round the 13 dropped bits to even */
    return sign | (r >> 13);
}

static inline float warp_xor_emulated(const float x, const int mask, __local warp_scratch *ws)
{
    const int lane = get_local_id(0) % 32;
    barrier(CLK_LOCAL_MEM_FENCE);
    ws->x[lane] = x;
    barrier(CLK_LOCAL_MEM_FENCE);
    return ws->x[lane ^ mask];
}
#define WARP_XOR(x, mask) warp_xor_emulated((x), (mask), ws)

/* movmatrix.m8n8.trans.b16: the 8 x 8 matrix of halves whose row lane / 4 holds columns
 * 2 (lane % 4), +1 in this lane's word, transposed */
static inline uint transpose8_emulated(const uint w, __local warp_scratch *ws)
{
    const int lane = get_local_id(0) % 32, g = lane >> 2, c = lane & 3;
    barrier(CLK_LOCAL_MEM_FENCE);
    ws->b[lane] = w;
    barrier(CLK_LOCAL_MEM_FENCE);
    /* element (row r, column j) sits in lane 4r + j / 2, half j % 2 */
    const uint lo = ws->b[4 * (2 * c) + g / 2], hi = ws->b[4 * (2 * c + 1) + g / 2];
    return ((g & 1) ? lo >> 16 : lo & 0xffffu) | (((g & 1) ? hi >> 16 : hi & 0xffffu) << 16);
}
#define TRANSPOSE8(w) transpose8_emulated((w), ws)

/* one 16-bit MMA input as float: fp16 or bf16 bits */
static inline float in_to_float(const uint bits)
{
    return STORE_BF16 ? as_float(bits << 16) : half_to_float(bits);
}

/* D = A B + C with the fragment layout of mma.sync.m16n8k16.row.col.f32.{f16,bf16}.f32 */
static inline void mma_16816(float d[4], const uint a0, const uint a1, const uint a2, const uint a3,
                             const uint b0, const uint b1, __local warp_scratch *ws)
{
    const int lane = get_local_id(0) % 32, g = lane >> 2, c = lane & 3;
    barrier(CLK_LOCAL_MEM_FENCE);
    ws->a[4 * lane + 0] = a0; ws->a[4 * lane + 1] = a1; ws->a[4 * lane + 2] = a2; ws->a[4 * lane + 3] = a3;
    ws->b[2 * lane + 0] = b0; ws->b[2 * lane + 1] = b1;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r >> 1), col = 2 * c + (r & 1);
        float sum = 0.0f;
        for (int kk = 0; kk < 16; ++kk) {
            /* A[row][kk]: lane (row % 8) * 4 + (kk % 8) / 2, register (row >= 8) + 2 (kk >= 8) */
            const uint aw = ws->a[4 * ((row % 8) * 4 + (kk % 8) / 2) + (row >= 8) + 2 * (kk >= 8)];
            /* B[kk][col]: lane col * 4 + (kk % 8) / 2, register (kk >= 8) */
            const uint bw = ws->b[2 * (col * 4 + (kk % 8) / 2) + (kk >= 8)];
            /* the element with the lower k index is in the lower half */
            sum = fma(in_to_float((kk & 1) ? aw >> 16 : aw & 0xffffu),
                      in_to_float((kk & 1) ? bw >> 16 : bw & 0xffffu), sum);
        }
        d[r] += sum;
    }
}
#define MMA(d, a0, a1, a2, a3, b0, b1) mma_16816((d), (a0), (a1), (a2), (a3), (b0), (b1), ws)
#if STORE_BF16
#define PACK2(lo, hi) ((uint)bf16_round(lo) | ((uint)bf16_round(hi) << 16))
#else
#define PACK2(lo, hi) (float_to_half(lo) | (float_to_half(hi) << 16))
#endif

#else
#define WARP_XOR(x, mask) warp_xor((x), (mask))

static inline uint transpose8(const uint w)
{
    uint r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(w));
    return r;
}
#define TRANSPOSE8(w) transpose8(w)

static inline void mma_16816(float d[4], const uint a0, const uint a1, const uint a2, const uint a3,
                             const uint b0, const uint b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1),
          "f"(d[0]), "f"(d[1]), "f"(d[2]), "f"(d[3]));
}
#define MMA(d, a0, a1, a2, a3, b0, b1) mma_16816((d), (a0), (a1), (a2), (a3), (b0), (b1))

static inline uint pack2(const float lo, const float hi)
{
    uint r;  /* cvt.rn.{f16,bf16}x2.f32 d, a, b puts a in the upper half */
    asm("cvt.rn." MMA_TYPE "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#define PACK2(lo, hi) pack2((lo), (hi))
#endif

/* the 16-bit halves of two words side by side: (lo(a), lo(b)) or (hi(a), hi(b)), one byte
 * permute each (the C expressions took two instructions) */
#if MMA_EMULATE
#define PAIR_LO(a, b) (((a) & 0xffffu) | ((b) << 16))
#define PAIR_HI(a, b) (((a) >> 16) | ((b) & 0xffff0000u))
#else
static inline uint byte_perm(const uint a, const uint b, const uint sel)
{
    uint r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
#define PAIR_LO(a, b) byte_perm((a), (b), 0x5410u)
#define PAIR_HI(a, b) byte_perm((a), (b), 0x7632u)
#endif

/* ---- quantized rows: a work-item's pieces from whole 16-byte loads --------------------------- */

#if K_QUANT || V_QUANT
/* A lane's bytes of one ggml block as loaded: the 16-byte aligned chunks holding [s, s + len)
 * (one to three loads instead of len / 2 two-byte ones, which left the load units, not HBM, the
 * limit), s's offset o in the first chunk, the block's d as fp16 bits. Nothing touches the loaded
 * words until the piece is used (span_pieces): a shift or select at the load made every K prefetch
 * and V load wait there (docs/notes/opencl-decode-nvidia.md). The chunk holding a buffer's last
 * bytes may reach up to 14 bytes past its end (unused; mapped memory on NVIDIA, whose allocations
 * are 256-byte aligned); Oclgrind flags it for a buffer whose size is not a multiple of 16. */
#define SPAN_CHUNKS(len) (((len) + 29) / 16)   /* chunks len bytes at a 2-byte aligned start touch */
typedef struct { uint4 ch[3]; uint o, d; } ggml_span;
#define SPANS(np) (((np) + 3) / 4)   /* blocks a lane's np pieces of a row touch */

static inline ggml_span load_span(__global const uchar *blk, const int at, const int len)
{
    ggml_span sp;
    const size_t a = (size_t)(blk + 2 + at);
    __global const uint4 *base = (__global const uint4 *)(a & ~(size_t)15);
    sp.o = (uint)(a & 15);
    const int last = (int)((sp.o + len - 1) / 16);  /* a chunk past it repeats it: no branch */
    for (int k_ = 0; k_ < SPAN_CHUNKS(len); ++k_)
        sp.ch[k_] = base[min(k_, last)];
    sp.d = *(__global const ushort *)blk;
    return sp;
}

/* the len / 4 words from byte o of the span's chunks: from word o / 4 on, one bit of it per
 * select step (two selects a word where a four-way pick took six), then the 2-byte shift of an
 * odd half-word offset */
static inline void span_words(const ggml_span sp, const int len, uint *sw)
{
    uint raw[12], u[11], w[9];
    for (int k_ = 0; k_ < SPAN_CHUNKS(len); ++k_) {
        raw[4 * k_] = sp.ch[k_].x; raw[4 * k_ + 1] = sp.ch[k_].y;
        raw[4 * k_ + 2] = sp.ch[k_].z; raw[4 * k_ + 3] = sp.ch[k_].w;
    }
    for (int j = 0; j < len / 4 + 3; ++j)
        u[j] = (sp.o & 4) ? raw[j + 1] : raw[j];
    for (int j = 0; j < len / 4 + 1; ++j)
        w[j] = (sp.o & 8) ? u[j + 2] : u[j];
    for (int i = 0; i < len / 4; ++i)
        sw[i] = (uint)(((ulong)w[i + 1] << 32 | w[i]) >> (8 * (sp.o & 2)));
}

/* Where a lane's np pieces of 8 dims from dim e0 sit in a ggml row: one span per block (the
 * pieces of one lane never straddle a block: e0 is a multiple of 8 np, np <= 4 or a multiple of
 * 4), b0 the first piece of block b0 / 4. A whole q4_0 block is its 16 quant bytes (dims 16..31
 * the high nibbles); a part of one, the bytes of its dims modulo 16. */
#define SPAN_AT(fmt, e, npb) ((fmt) == QUANT_Q8_0 ? (e) % 32 : (npb) == 4 ? 0 : (e) % 16)
#define SPAN_LEN(fmt, npb) ((fmt) == QUANT_Q4_0 && (npb) == 4 ? 16 : 8 * (npb))

/* Key j's row, whose table entry is `block`: the lane's pieces as loaded, int8 as its pieces
 * (aligned 16-byte loads: the host checks 16-byte aligned rows, and one scale load), ggml as
 * spans. A row of an out-of-range block is not read (the head's first row is, in its place) and
 * carries a NaN scale. */
static inline void load_pieces(const int fmt, const int dim, __global const uchar *data, const ulong off,
                               const ulong rel, __global const float *scales, const ulong s_off,
                               const int j, const int block, const int block_shift,
                               const int num_blocks, const ulong s0, const ulong s1, const int e0,
                               const int np, raw_t *pieces, ggml_span *spans)
{
    bool ok;
    const ulong at = block_row_offset(block, j, block_shift, num_blocks, s0, s1, &ok);
    const ulong row = rel + (ok ? at : 0);
    __global const uchar *r = data + off + row;
    if (fmt == QUANT_INT8) {
        const uint sc = ok ? as_uint(scales[s_off + row / dim]) : as_uint(NAN);
        if (np == 1) {
            const uint2 x = *(__global const uint2 *)(r + e0);
            pieces[0] = (uint4)(x.x, x.y, sc, 0u);
        }
        for (int p_ = 0; p_ + 1 < np; p_ += 2) {
            const uint4 x = *(__global const uint4 *)(r + e0 + 8 * p_);
            pieces[p_] = (uint4)(x.x, x.y, sc, 0u);
            pieces[p_ + 1] = (uint4)(x.z, x.w, sc, 0u);
        }
        return;
    }
    for (int b0 = 0; b0 < np; b0 += 4) {
        const int e = e0 + 8 * b0, npb = min(np - b0, 4);
        spans[b0 / 4] = load_span(r + (e / QUANT_BLOCK) * QUANT_BLOCK_BYTES(fmt), SPAN_AT(fmt, e, npb),
                                  SPAN_LEN(fmt, npb));
        if (!ok)
            spans[b0 / 4].d = 0x7e00u;   /* fp16 NaN */
    }
}

/* The pieces load_pieces' ggml spans hold, as piece_words takes them (quant bytes, d's fp16
 * bits, q4_0 nibble shift) */
static inline void span_pieces(const int fmt, const ggml_span *spans, const int e0, const int np,
                               raw_t *out)
{
    for (int b0 = 0; b0 < np; b0 += 4) {
        const int e = e0 + 8 * b0, npb = min(np - b0, 4);
        const ggml_span sp = spans[b0 / 4];
        uint sw[8];
        span_words(sp, SPAN_LEN(fmt, npb), sw);
        for (int p_ = 0; p_ < npb; ++p_) {
            if (fmt == QUANT_Q8_0)
                out[b0 + p_] = (uint4)(sw[2 * p_], sw[2 * p_ + 1], sp.d, 0u);
            else if (npb == 4)
                out[b0 + p_] = (uint4)(sw[2 * (p_ % 2)], sw[2 * (p_ % 2) + 1], sp.d, (p_ >= 2) ? 4u : 0u);
            else
                out[b0 + p_] = (uint4)(sw[2 * p_], sw[2 * p_ + 1], sp.d, (e % 32 >= 16) ? 4u : 0u);
        }
    }
}

/* A piece (load_pieces, span_pieces) as the 4 words of f16 pairs a plain row's 16-byte chunk
 * would be, each value fp16(q * scale) as flashcl.dequantize rounds it; `scaled` false: q alone,
 * exact in fp16 (int8 K, whose row scale goes on the scores instead). ggml: the scale d is fp16, so q times d
 * in f16x2 arithmetic rounds the same; a byte becomes the half 1024 + byte with one byte permute
 * per pair (prmt), the bias goes with one sub.f16x2: ~1.5 instructions a value against ~5
 * through cvt (a quarter-rate instruction) and fp32. int8 V (a float32 scale): fp32, a byte
 * permuted into the float 2^23 + byte, less 2^23. */
static inline void piece_words(const int fmt, const raw_t piece, const bool scaled, uint *dst)
{
    const uint4 r = piece;
#if !MMA_EMULATE
    if (fmt != QUANT_INT8 || !scaled) {
        uint d2, bias2;
        uint w[2] = {r.x, r.y};
        if (fmt == QUANT_Q4_0) {          /* nibbles, value n - 8 */
            w[0] = (w[0] >> r.w) & 0x0f0f0f0fu;
            w[1] = (w[1] >> r.w) & 0x0f0f0f0fu;
            bias2 = 0x64086408u;          /* 1032 = 1024 + 8 */
        } else {                          /* signed bytes: + 128 makes them unsigned */
            w[0] ^= 0x80808080u;
            w[1] ^= 0x80808080u;
            bias2 = 0x64806480u;          /* 1152 = 1024 + 128 */
        }
        if (scaled)
            d2 = r.z | (r.z << 16);       /* d's fp16 bits in both halves */
        for (int i = 0; i < 4; ++i) {
            uint h;
            asm("prmt.b32 %0, %1, %2, %3;"   /* two bytes as the halves 1024 + byte */
                : "=r"(h) : "r"(w[i >> 1]), "r"(0x64646464u), "r"((i & 1) ? 0x4342u : 0x4140u));
            asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(h), "r"(bias2));
            if (scaled)
                asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(h), "r"(d2));
            dst[i] = h;
        }
        return;
    }
#endif
    float f[8];
    if (fmt == QUANT_INT8) {
        const uint w[2] = {r.x ^ 0x80808080u, r.y ^ 0x80808080u};
        const float sc = scaled ? as_float(r.z) : 1.0f;
        for (int i = 0; i < 8; ++i) {
#if MMA_EMULATE
            const uint bits = 0x4b000000u | ((w[i >> 2] >> (8 * (i & 3))) & 0xffu);
#else
            uint bits;  /* bytes (w's byte i % 4, 0, 0, 0x4b) */
            asm("prmt.b32 %0, %1, %2, %3;" : "=r"(bits) : "r"(w[i >> 2]), "r"(0x4b000000u), "r"(0x7440u | (i & 3)));
#endif
            f[i] = (as_float(bits) - 8388736.0f) * sc;
        }
    }
#if MMA_EMULATE   /* ggml (the PTX path returned above); dequant takes the scale as float bits */
    else {
        const float8 x = dequant(fmt, (uint4)(r.x, r.y, as_uint(half_to_float(r.z)), r.w));
        f[0] = x.s0; f[1] = x.s1; f[2] = x.s2; f[3] = x.s3; f[4] = x.s4; f[5] = x.s5; f[6] = x.s6; f[7] = x.s7;
    }
#endif
    for (int i = 0; i < 4; ++i)
        dst[i] = PACK2(f[2 * i], f[2 * i + 1]);
}

/* a lane's part of a row as load_pieces left it (np pieces from dim e0), as 4 np words of f16
 * pairs */
static inline void part_words(const int fmt, const raw_t *pieces, const ggml_span *spans, const int e0,
                              const int np, const bool scaled, uint *dst)
{
    raw_t p[8];
    if (fmt == QUANT_INT8) {
        for (int p_ = 0; p_ < np; ++p_)
            p[p_] = pieces[p_];
    } else {
        span_pieces(fmt, spans, e0, np, p);
    }
    for (int p_ = 0; p_ < np; ++p_)
        piece_words(fmt, p[p_], scaled, dst + 4 * p_);
}
#endif

#if QUERY_ROWS > 1 || ROW_MASK
#if MMA_EMULATE
#define WS_PARAM , __local warp_scratch *ws
#define WS_ARG , ws
#else
#define WS_PARAM
#define WS_ARG
#endif
/* The V halves of inf / NaN in this lane's words (keys t0 + 2c + (r & 1) + 8 (r >> 1)) set to 0;
 * the keys that held any, gathered over the warp, make l NaN for each head whose row sees one */
static inline void hide_nonfinite_v(uint vw[4][NTV / 2], const int t0, const int k1, const int n_used,
                                    const int batch, const int head0, const int rows, const int c, float l[NH][2],
                                    const int window_left ROW_MASK_PARAM WS_PARAM)
{
    uint bad = 0u;
    for (int r = 0; r < 4; ++r)
        for (int d = 0; d < NTV / 2; ++d) {
            const uint w = vw[r][d];
            const uint nonfinite = (((w & EXPONENT_BITS) == EXPONENT_BITS) ? 0xffffu : 0u)
                                   | (((w & (EXPONENT_BITS << 16)) == (EXPONENT_BITS << 16)) ? 0xffff0000u : 0u);
            vw[r][d] = w & ~nonfinite;
            bad |= (nonfinite != 0u) ? 1u << (2 * c + (r & 1) + 8 * (r >> 1)) : 0u;
        }
    /* the key bits as the mantissa of a float in [1, 2): shuffled as a normal number */
    for (int mask = 1; mask < 32; mask <<= 1)
        bad |= as_uint(WARP_XOR(as_float(0x3f800000u | bad), mask)) & 0xffffu;
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < 2; ++i) {
            const int head = head0 + min(8 * h + 2 * c + i, rows - 1);  /* padding heads: the last */
            uint seen = 0u;
            for (int j = 0; j < TILE; ++j)
                seen |= (t0 + j < k1 && ROW_VISIBLE(batch, head, t0 + j, n_used)) ? 1u << j : 0u;
            if (bad & seen)
                l[h][i] = NAN;
        }
}
#endif

/* ---- the kernel body ------------------------------------------------------------------------ */

static inline void decode_mma_body(DECODE_PARAMS VARIANT_PARAMS QUANT_PARAMS, const bool partial,
                                   __local float *red_m, __local float *red_l, __local float *red_acc
#if MMA_EMULATE
                                   , __local warp_scratch *scratch
#endif
                                   )
{
    const int tid = get_local_id(0);
    const int warp = tid / 32, lane = tid % 32, g = lane >> 2, c = lane & 3;
    const int split = get_group_id(0), batch = get_group_id(2);
    const int kv_head = get_group_id(1) / MTILES, mtile = get_group_id(1) % MTILES;
    const int head0 = kv_head * GROUP + mtile * 16;       /* query head of MMA column 0 */
    const int rows = min(GROUP - mtile * 16, 16);          /* MMA columns that are query heads */
#if MMA_EMULATE
    __local warp_scratch *ws = scratch + warp;
#endif

    DECODE_SPAN(ROUND)  /* k0, k1, n_used, ctx_ok (else no key and a NaN state), bt_row, k_base, ... */
    const int rounds = (k1 - k0 + ROUND - 1) / ROUND;  /* every warp runs them all (uniform barriers) */

    /* Q^T's B fragments, q's exact bits, n-tile h = heads 8h .. 8h + 7 of this work-group
     * (heads past G are zeros): word qb[h][s][e] holds dims c*KQ + 4s + 2e, +1 of head g + 8h */
    uint qb[NH][KSTEPS][2];
    for (int h = 0; h < NH; ++h) {
        const int row = g + 8 * h;
        __global const ushort *q_row = (__global const ushort *)q + q_off + batch * q_sb
                                       + (head0 + min(row, rows - 1)) * q_sh + c * KQ;
        for (int s = 0; s < KSTEPS; ++s)
            for (int e = 0; e < 2; ++e)
                qb[h][s][e] = (row < rows) ? ((uint)q_row[4 * s + 2 * e] | ((uint)q_row[4 * s + 2 * e + 1] << 16))
                                            : 0u;
    }

    /* per head 8h + 2c + i: running max (log2 units), this lane's share of the sum, ALiBi slope
     * (padding heads: the last head's) */
    float m[NH][2], l[NH][2], slope[NH][2];
    /* O^T's C fragments, m-tile d: [d][h][i] dim NTV*g + 2d, [d][h][2 + i] dim NTV*g + 2d + 1,
     * both of head 8h + 2c + i */
    float acc[MTV][NH][4];
    for (int h = 0; h < NH; ++h) {
        for (int i = 0; i < 2; ++i) {
            slope[h][i] = ALIBI_SLOPE_LOG2(batch, head0 + min(8 * h + 2 * c + i, rows - 1));
            m[h][i] = -INFINITY;
            l[h][i] = ctx_ok ? 0.0f : NAN;
        }
        for (int d = 0; d < MTV; ++d)
            for (int r = 0; r < 4; ++r)
                acc[d][h][r] = ctx_ok ? 0.0f : NAN;
    }

    /* K: the quarter c of keys t0 + g (M row g) and t0 + 8 + g (row g + 8), as 32-bit words;
     * V: the eighth g of keys t0 + 2c, 2c + 1, 8 + 2c, 9 + 2c. Keys past k1 read key k1 - 1's
     * row (LAST_KEY: the loop runs only where k0 < k1). A row of an out-of-range block is not read:
     * K reads NaN (its key's P, then out and lse, are NaN), a plain V the head's first row. */
    uint kw[2][KQ / 2], vw[4][NTV / 2];
    /* the table entries of the next K and V rows to load, read an iteration before those rows:
     * a row load that waits on its entry (a DRAM round trip of its own once per 32 pages) left
     * the quantized formats, whose rows are fewer bytes per wait, no faster than fp16 */
    int kb[2], vb[4];
#define LAST_KEY(j) min((j), k1 - 1)
#define TABLE_K(t0)                                                                          \
    for (int t = 0; t < 2; ++t)                                                              \
        kb[t] = table_entry(LAST_KEY((t0) + 8 * t + g), bt_row, block_shift);
#define TABLE_V(t0)                                                                          \
    for (int r = 0; r < 4; ++r)                                                              \
        vb[r] = table_entry(LAST_KEY((t0) + 2 * c + (r & 1) + 8 * (r >> 1)), bt_row, block_shift);
#if K_QUANT
    /* quantized K: the pieces of 8 dims (int8) or the ggml spans as loaded (load_pieces), turned
     * into f16 pairs when used */
    raw_t kq[2][KQ / 8];
    ggml_span ks[2][SPANS(KQ / 8)];
#define LOAD_K(t0, LOAD)                                                                     \
    for (int t = 0; t < 2; ++t)                                                              \
        load_pieces(K_QUANT, HEAD_DK, (__global const uchar *)k, k_off, k_rel, K_SCALES,       \
                    LAST_KEY((t0) + 8 * t + g), kb[t], block_shift, num_blocks, k_s0, k_s1, c * KQ, \
                    KQ / 8, kq[t], ks[t]);
#else
#define LOAD_K(t0, LOAD)                                                                     \
    for (int t = 0; t < 2; ++t) {                                                            \
        bool ok;  /* its block id in range */                                                \
        const ulong at = block_row_offset(kb[t], LAST_KEY((t0) + 8 * t + g), block_shift, num_blocks, \
                                          k_s0, k_s1, &ok);                                  \
        const ulong off = (ok ? at : 0) + c * KCH;                                           \
        for (int i = 0; i < KCH; ++i) {                                                      \
            const uint4 x = ok ? LOAD(k_base + off + i) : RAW_NAN;                           \
            kw[t][4 * i] = x.x; kw[t][4 * i + 1] = x.y; kw[t][4 * i + 2] = x.z; kw[t][4 * i + 3] = x.w; \
        }                                                                                    \
    }
#endif
#if V_QUANT
    raw_t vq[4][NTV / 8];
    ggml_span vs[4][SPANS(NTV / 8)];
#define LOAD_V(t0)                                                                           \
    for (int r = 0; r < 4; ++r)                                                              \
        load_pieces(V_QUANT, HEAD_DV, (__global const uchar *)v, v_off, v_rel, V_SCALES,       \
                    LAST_KEY((t0) + 2 * c + (r & 1) + 8 * (r >> 1)), vb[r], block_shift, num_blocks, \
                    v_s0, v_s1, g * NTV, NTV / 8, vq[r], vs[r]);
#else
#define LOAD_V(t0)                                                                           \
    for (int r = 0; r < 4; ++r) {                                                            \
        bool ok;  /* its block id in range (else K reads NaN) */                             \
        const ulong at = block_row_offset(vb[r], LAST_KEY((t0) + 2 * c + (r & 1) + 8 * (r >> 1)), \
                                          block_shift, num_blocks, v_s0, v_s1, &ok);         \
        const ulong off = (ok ? at : 0) + g * VCH;                                           \
        for (int i = 0; i < VCH; ++i) {                                                      \
            const uint4 x = load_kv_streamed(v_base + off + i);                              \
            vw[r][4 * i] = x.x; vw[r][4 * i + 1] = x.y; vw[r][4 * i + 2] = x.z; vw[r][4 * i + 3] = x.w; \
        }                                                                                    \
    }
#endif
#define V_AHEAD (V_QUANT && QUANT_V_AHEAD)

    /* A tile's K words are loaded one iteration ahead (into kw, copied to kc): the next tile's K
     * is in flight while this one is computed. Its V is loaded at the top of its own iteration
     * and arrives during S^T = K Q^T and the softmax (V_AHEAD: an iteration earlier). (H100: no
     * prefetch 184 registers and 6% slower at 32k; a plain V prefetched too, 255 registers with a
     * spill, no faster: docs/notes/opencl-decode-nvidia.md.) */
    if (rounds > 0) {   /* the same for the whole work-group; LAST_KEY needs a key */
        TABLE_K(k0 + warp * TILE)
        TABLE_V(k0 + warp * TILE)
        LOAD_K(k0 + warp * TILE, load_kv_plain)
        TABLE_K(k0 + warp * TILE + ROUND)
#if V_AHEAD
        LOAD_V(k0 + warp * TILE)
        TABLE_V(k0 + warp * TILE + ROUND)
#endif
    }
    for (int it = 0; it < rounds; ++it) {
        const int t0 = k0 + it * ROUND + warp * TILE;   /* this warp's 16 keys */
        uint kc[2][KQ / 2];
#if K_QUANT
        for (int t = 0; t < 2; ++t)
            part_words(K_QUANT, kq[t], ks[t], c * KQ, KQ / 8, K_QUANT != QUANT_INT8, kc[t]);
#if K_QUANT == QUANT_INT8
        /* int8 K goes into S^T = K Q^T as its integers, and the row scale onto the scores: key
         * t0 + g + 8t (S^T's row) is the row this lane loaded as kq[t], taken before the next
         * tile's loads overwrite it */
        const float k_scale[2] = {as_float(kq[0][0].z), as_float(kq[1][0].z)};
#define K_SCALE(t) k_scale[t]
#else
#define K_SCALE(t) 1.0f
#endif
#else
#define K_SCALE(t) 1.0f
        for (int t = 0; t < 2; ++t)
            for (int i = 0; i < KQ / 2; ++i)
                kc[t][i] = kw[t][i];
#endif
#if V_AHEAD
        for (int r = 0; r < 4; ++r)
            part_words(V_QUANT, vq[r], vs[r], g * NTV, NTV / 8, true, vw[r]);
        if (it + 1 < rounds) {
            LOAD_K(t0 + ROUND, load_kv_streamed)
            LOAD_V(t0 + ROUND)
            TABLE_K(t0 + 2 * ROUND)
            TABLE_V(t0 + 2 * ROUND)
        }
#else
        if (it + 1 < rounds) {
            LOAD_K(t0 + ROUND, load_kv_streamed)
            TABLE_K(t0 + 2 * ROUND)
        }
        LOAD_V(t0)
        TABLE_V(t0 + ROUND)
#endif

        /* S^T = K Q^T: st[h][r] = key t0 + g + 8 (r >> 1), head 8h + 2c + (r & 1) */
        float st[NH][4];
        for (int h = 0; h < NH; ++h) {
            for (int r = 0; r < 4; ++r)
                st[h][r] = 0.0f;
            for (int s = 0; s < KSTEPS; ++s)
                MMA(st[h], kc[0][2 * s], kc[1][2 * s], kc[0][2 * s + 1], kc[1][2 * s + 1],
                    qb[h][s][0], qb[h][s][1]);
        }

        /* online softmax per head: its 16 keys on the 8 lanes of one c (3 shuffles for the max),
         * each lane's share of the sum added up at the end. P^T's B fragments (pb[h][0]: keys 2c,
         * 2c+1 of head g + 8h; [1]: 8+2c, 9+2c) transpose the lanes' 8 x 8 blocks; bf16: p_lo too */
        uint pb[NH][2];
#if STORE_BF16
        uint p_lo[NH][2];
#endif
        for (int h = 0; h < NH; ++h) {
            float x[4], p[4], alpha[2];
            for (int r = 0; r < 4; ++r) {
                const int key = t0 + g + 8 * (r >> 1), head = head0 + min(8 * h + 2 * c + (r & 1), rows - 1);
                const float s_log2 = st[h][r] * K_SCALE(r >> 1) * scale_log2;
                x[r] = (key < k1 && ROW_VISIBLE(batch, head, key, n_used))
                       ? SCORE_VARIANTS(s_log2, slope[h][r & 1], ROW_POS(head, n_used) - key) + MASK_ADD(batch, head, key)
                       : -INFINITY;
            }
            for (int i = 0; i < 2; ++i) {
                float mx = fmax(x[i], x[2 + i]);
                mx = fmax(mx, WARP_XOR(mx, 4));
                mx = fmax(mx, WARP_XOR(mx, 8));
                mx = fmax(mx, WARP_XOR(mx, 16));
                const float m_new = fmax(m[h][i], mx);
                /* nothing seen: no inf - inf */
                const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;
                alpha[i] = exp2(m[h][i] - m_use);
                p[i] = exp2(x[i] - m_use);
                p[2 + i] = exp2(x[2 + i] - m_use);
                l[h][i] = l[h][i] * alpha[i] + (p[i] + p[2 + i]);
                m[h][i] = m_new;
            }
            for (int d = 0; d < MTV; ++d)
                for (int r = 0; r < 4; ++r)
                    acc[d][h][r] *= alpha[r & 1];
            const uint p01 = PACK2(p[0], p[1]), p23 = PACK2(p[2], p[3]);
            pb[h][0] = TRANSPOSE8(p01);
            pb[h][1] = TRANSPOSE8(p23);
#if STORE_BF16
            p_lo[h][0] = TRANSPOSE8(PACK2(p[0] - as_float(p01 << 16), p[1] - as_float(p01 & 0xffff0000u)));
            p_lo[h][1] = TRANSPOSE8(PACK2(p[2] - as_float(p23 << 16), p[3] - as_float(p23 & 0xffff0000u)));
#endif
        }

#if V_QUANT && !V_AHEAD
        for (int r = 0; r < 4; ++r)
            part_words(V_QUANT, vq[r], vs[r], g * NTV, NTV / 8, true, vw[r]);
#endif
#if QUERY_ROWS > 1 || ROW_MASK
        /* where the rows see different keys (the same test for the whole work-group: barriers
         * in the emulation), a V of inf / NaN at a key must not reach the rows that do not see
         * it through 0 x inf in the MMA: it becomes 0, and the rows that see it get a NaN sum */
        if (ROWS_DIFFER(t0 - warp * TILE, ROUND, n_used))
            hide_nonfinite_v(vw, t0, k1, n_used, batch, head0, rows, c, l, window_left ROW_MASK_ARG WS_ARG);
#endif
        /* O^T += V^T P^T, one m-tile (16 output dims) at a time: row g is dim NTV*g + 2d (word d's
         * low halves of keys 2c, 2c+1 | 8+2c, 9+2c), row g + 8 dim NTV*g + 2d + 1 (high halves) */
        for (int d = 0; d < MTV; ++d) {
            const uint a0 = PAIR_LO(vw[0][d], vw[1][d]), a1 = PAIR_HI(vw[0][d], vw[1][d]);
            const uint a2 = PAIR_LO(vw[2][d], vw[3][d]), a3 = PAIR_HI(vw[2][d], vw[3][d]);
            for (int h = 0; h < NH; ++h) {
#if STORE_BF16
                MMA(acc[d][h], a0, a1, a2, a3, p_lo[h][0], p_lo[h][1]);  /* the smaller part first */
#endif
                MMA(acc[d][h], a0, a1, a2, a3, pb[h][0], pb[h][1]);
            }
        }
    }
#undef LOAD_K
#undef LOAD_V
#undef TABLE_K
#undef TABLE_V
#undef LAST_KEY
#undef V_AHEAD
#undef K_SCALE

    /* each head's sum over its 8 lanes; then the warps' states meet: shared max per head, the
     * accumulators rescaled to it and summed in local memory */
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < 2; ++i) {
            l[h][i] += WARP_XOR(l[h][i], 4);
            l[h][i] += WARP_XOR(l[h][i], 8);
            l[h][i] += WARP_XOR(l[h][i], 16);
            const int head = 8 * h + 2 * c + i;
            if (g == 0 && head < rows) {
                red_m[warp * MT_ROWS + head] = m[h][i];
                red_l[warp * MT_ROWS + head] = l[h][i];
            }
        }
    barrier(CLK_LOCAL_MEM_FENCE);
    const bool takes_sink = !partial || split == 0;   /* exactly once per query head */
    for (int h = 0; h < NH; ++h)
        for (int i = 0; i < 2; ++i) {
            const int head = 8 * h + 2 * c + i;
            if (head >= rows)
                continue;
            float mx = SINK_LOG2(head0 + head, takes_sink);
            for (int w = 0; w < MMA_WARPS; ++w)
                mx = fmax(mx, red_m[w * MT_ROWS + head]);
            const float f = exp2(m[h][i] - ((mx == -INFINITY) ? 0.0f : mx));  /* empty warp: 0 */
            __local float *dst = red_acc + (warp * MT_ROWS + head) * HEAD_DV + NTV * g;
            for (int d = 0; d < MTV; ++d) {
                dst[2 * d] = acc[d][h][i] * f;
                dst[2 * d + 1] = acc[d][h][2 + i] * f;
            }
        }
    barrier(CLK_LOCAL_MEM_FENCE);

    for (int x = tid; x < rows * HEAD_DV; x += WG) {
        const int row = x / HEAD_DV, dim = x % HEAD_DV;
        const float sink = SINK_LOG2(head0 + row, takes_sink);  /* a slot of value zero */
        float mx = sink;
        for (int w = 0; w < MMA_WARPS; ++w)
            mx = fmax(mx, red_m[w * MT_ROWS + row]);
        const float m_use = (mx == -INFINITY) ? 0.0f : mx;
        float a = 0.0f, l_all = SINKS ? exp2(sink - m_use) : 0.0f;
        for (int w = 0; w < MMA_WARPS; ++w) {
            a += red_acc[(w * MT_ROWS + row) * HEAD_DV + dim];
            l_all += red_l[w * MT_ROWS + row] * exp2(red_m[w * MT_ROWS + row] - m_use);
        }
        const int head = head0 + row;
        const ulong state = ((ulong)batch * h_q + head) * num_splits + split;
        if (partial) {
            part_acc[state * HEAD_DV + dim] = a;
            if (dim == 0) {
                part_m[state] = mx;
                part_l[state] = l_all;
            }
        } else {
            const float inv_l = (l_all > 0.0f) ? 1.0f / l_all : 0.0f;  /* no key: zeros */
            STORE_OUT(a * inv_l, dim, out + o_off + batch * o_sb + head * o_sh);
            if (dim == 0)
                lse[(ulong)batch * h_q + head] = lse_of_state(mx, l_all);
        }
    }
}

#if MMA_EMULATE
#define SCRATCH_DECL __local warp_scratch scratch[MMA_WARPS];
#define SCRATCH_ARG , scratch
#else
#define SCRATCH_DECL
#define SCRATCH_ARG
#endif

#define DECODE_MMA_KERNEL(NAME, IS_PARTIAL)                                                  \
__kernel FLASHCL_REQD_WG(WG)                                                                 \
void NAME(DECODE_PARAMS VARIANT_PARAMS QUANT_PARAMS)                                         \
{                                                                                            \
    __local float red_m[MMA_WARPS * MT_ROWS], red_l[MMA_WARPS * MT_ROWS];                    \
    __local float red_acc[MMA_WARPS * MT_ROWS * HEAD_DV];                                    \
    SCRATCH_DECL                                                                             \
    decode_mma_body(DECODE_ARGS VARIANT_ARGS QUANT_ARGS, IS_PARTIAL, red_m, red_l, red_acc     \
                    SCRATCH_ARG);                                                            \
}

DECODE_MMA_KERNEL(flash_decode, false)
DECODE_MMA_KERNEL(flash_decode_split, true)

/* ---- split-k in one launch ------------------------------------------------------------------ */

/* Device-wide order of this work-item's global writes before its later ones (and of its later
 * reads after the others' writes it has seen through an atomic) */
#if DECODE_NV_PTX
#define GLOBAL_FENCE() asm volatile("membar.gl;" ::: "memory")
#else
#define GLOBAL_FENCE() mem_fence(CLK_GLOBAL_MEM_FENCE)
#endif

/* flash_decode_split, then flash_decode_merge's arithmetic for this work-group's heads, done by
 * the work-group of their (sequence, KV head, head tile) that finishes last: one launch instead
 * of two, where NVIDIA's OpenCL spends several microseconds per launch. `arrivals`: one int per
 * (sequence, grid row), zero before the first call; the last work-group puts it back to zero
 * (a launch that does not finish leaves it non-zero). It reads the other work-groups' states
 * through volatile loads (L2, not a stale L1). */
__kernel FLASHCL_REQD_WG(WG)
void flash_decode_fused(DECODE_PARAMS VARIANT_PARAMS QUANT_PARAMS, __global int *arrivals)
{
    __local float red_m[MMA_WARPS * MT_ROWS], red_l[MMA_WARPS * MT_ROWS];
    __local float red_acc[MMA_WARPS * MT_ROWS * HEAD_DV];
    __local int last;
    SCRATCH_DECL
    decode_mma_body(DECODE_ARGS VARIANT_ARGS QUANT_ARGS, true, red_m, red_l, red_acc SCRATCH_ARG);

    const int tid = get_local_id(0), batch = get_group_id(2);
    const int slot = batch * (int)get_num_groups(1) + (int)get_group_id(1);
    GLOBAL_FENCE();
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);  /* every work-item's states written */
    if (tid == 0) {
        GLOBAL_FENCE();   /* in the counting work-item too, after the barrier */
        last = atomic_inc(arrivals + slot) == num_splits - 1;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!last)
        return;
    GLOBAL_FENCE();
    if (tid == 0)
        arrivals[slot] = 0;

    const int kv_head = get_group_id(1) / MTILES, mtile = get_group_id(1) % MTILES;
    const int head0 = kv_head * GROUP + mtile * 16, rows = min(GROUP - mtile * 16, 16);
    volatile __global const float *pm = part_m, *pl = part_l, *pacc = part_acc;
    /* one work-item per (head, 4 output dims): the splits' states, rescaled to their shared max */
    for (int x = tid; x < rows * (HEAD_DV / 4); x += WG) {
        const int head = head0 + x / (HEAD_DV / 4), c = x % (HEAD_DV / 4);
        const ulong state0 = ((ulong)batch * h_q + head) * num_splits;
        float m_all = -INFINITY;
        for (int s = 0; s < num_splits; ++s)
            m_all = fmax(m_all, pm[state0 + s]);
        const float m_use = (m_all == -INFINITY) ? 0.0f : m_all;  /* every split empty */
        float l_all = 0.0f;
        float4 a = (float4)(0.0f);
        for (int s = 0; s < num_splits; ++s) {
            const float w = exp2(pm[state0 + s] - m_use);   /* empty split: exp2(-inf) = 0 */
            l_all += pl[state0 + s] * w;
            volatile __global const float *src = pacc + (state0 + s) * HEAD_DV + 4 * c;
            a = fma((float4)(w), (float4)(src[0], src[1], src[2], src[3]), a);
        }
        const float inv_l = (l_all > 0.0f) ? 1.0f / l_all : 0.0f;
        __global store_t *o_row = out + o_off + batch * o_sb + head * o_sh;
        STORE_OUT4(a * inv_l, c, o_row);
        if (c == 0)
            lse[(ulong)batch * h_q + head] = lse_of_state(m_all, l_all);
    }
}
