// The tensor-core backward for float16 / bfloat16 inputs (included by kernels.cu after
// forward_mma.cuh when STREAMKL_INPUT != 0): the SPEC's dS1 = g p (d - E), dS2 = g (q - p) on
// 64 x 64 tiles of the schedule, every product on mma.sync with float32 accumulation.
//
// Two kernels, each owning its outputs (bitwise reproducible gradients), and a fused mode:
// - kl_backward_dq_mma, query-major: a block owns 64 query rows of one (sequence, head), a warp
//   16 of them, as the forward does. Per 32-key half of a key tile it recomputes s1, s2 (C
//   fragments, rows x keys), turns them into dS in registers, and multiplies dS (its C fragments
//   reused as A fragments, rounded to input_t) by K (B fragments by ldmatrix.trans): dq stays in
//   registers for the whole key list.
// - kl_backward_dk_mma, key-major: a block owns 64 keys of one (sequence, key head), a warp 16 of
//   them, and walks the query tiles that visit its key tile (the transposed schedule) for each
//   query head of the GQA group. Per 32-query half it computes s^T = K Q^T (keys x queries),
//   dS^T, and dK += dS^T Q the same way: dk stays in registers.
// - kl_backward_dk_mma with DQ_ATOMIC (deterministic=False): the key-major kernel also adds dS K to
//   dq by float32 atomics (dS^T through shared memory, FlashAttention-2's structure), so each
//   score pair is recomputed once instead of twice.
// The tiles the other operand streams (key tiles for dq, query tiles and their row statistics for
// dk) pass through a STAGES-deep cp.async ring, as in the forward.
//
// Half-precision dS: the upstream gradients g are multiplied by one power of two (from max |g|,
// `gradient_factor`) so that dS keeps its significant bits whatever the reduction's scale (a mean
// over many rows makes g tiny); the factor is divided out, exactly, when the gradient is stored.
#pragma once
#include "warp_ops.cuh"

#define SK_MMA_BWD_TILE 64  // the schedule tile of both kernels, queries and keys
#define SK_MMA_BWD_SUB 32   // the other side's rows per score step (4 C fragments per 16-row block)

// A power of two bringing max |g| into [1, 2); 1 when that maximum is 0, not finite or extreme.
SK_DEVICE float gradient_factor(const KLParams& p) {
    const float largest = *reinterpret_cast<const float*>(p.grad_max);
    const unsigned exponent = __float_as_uint(largest) & 0x7f800000u;
    if (!(largest > 0.0f) || exponent == 0u || exponent >= 0x7f000000u) return 1.0f;
    return __uint_as_float(0x7f000000u - exponent);  // 2^(127 - e) for largest = 2^(e - 127) * m
}

// The A fragment of a 16 x 16 product operand from two 16 x 8 C fragments (columns 0-7, 8-15):
// the C layout of a row block is the A layout, element for element, rounded to input_t.
SK_DEVICE void fragments_to_a(unsigned (&a)[4], const float (&low)[4], const float (&high)[4]) {
    a[0] = sk_pack_floats(low[0], low[1]);
    a[1] = sk_pack_floats(low[2], low[3]);
    a[2] = sk_pack_floats(high[0], high[1]);
    a[3] = sk_pack_floats(high[2], high[3]);
}

// acc[n] (16 rows x columns 8n..8n+7) += A (16 x 16) times rows[0..15][0..DP): the B fragments
// come from ldmatrix.trans of 16 rows of `rows` (row stride DP + 8): matrices 0 and 1 hold rows
// 0-7 and 8-15 of columns 16dd..16dd+7, matrices 2 and 3 the next 8 columns.
template <int DP>
SK_DEVICE void warp_accumulate(float (&acc)[DP / 8][4], const unsigned (&a)[4], const input_t* rows, int lane) {
    constexpr int ST = DP + 8;
    const sk_smem lane_rows =
        sk_advance(sk_shared_address(rows), ((lane % 8) + ((lane / 8) % 2) * 8) * ST + (lane / 16) * 8);
#pragma unroll
    for (int dd = 0; dd < DP / 16; ++dd) {
        unsigned b[4];
        sk_ldmatrix_x4_trans(b, sk_advance(lane_rows, dd * 16));
        const unsigned low[2] = {b[0], b[1]}, high[2] = {b[2], b[3]};
        sk_mma_16816(acc[2 * dd], a, low);
        sk_mma_16816(acc[2 * dd + 1], a, high);
    }
}

// Row statistics in the units the tensor-core backward uses: lse1, lse2 in log2 units (+inf for
// an empty row or one past the end, so that p = q = 0), E, and g times the gradient factor.
struct RowStats {
    float lse1, lse2, expect, g;
};

SK_DEVICE RowStats mma_row_stats(const KLParams& p, int seq, int head, long long token, bool valid, float factor) {
    RowStats stats;
    row_statistics(p, seq, head, token, valid, stats.lse1, stats.lse2, stats.expect, stats.g);
    stats.lse1 *= SK_LOG2E;
    stats.lse2 *= SK_LOG2E;
    stats.g *= factor;
    return stats;
}

// dS of one score pair, in place: x1, x2 enter as the raw products <q1, k1>, <q2, k2> and leave
// as dS1, dS2 (times the gradient factor), as tile_dscores computes them.
SK_DEVICE void mma_dscores(float& x1, float& x2, bool allowed1, bool allowed2, const RowStats& row, float scale1,
                           float scale2) {
    const float prob1 = allowed1 ? sk_exp2(x1 * (scale1 * SK_LOG2E) - row.lse1) : 0.0f;
    const float prob2 = allowed2 ? sk_exp2(x2 * (scale2 * SK_LOG2E) - row.lse2) : 0.0f;
    const float diff = (allowed1 && allowed2) ? x1 * scale1 - x2 * scale2 : 0.0f;
    x1 = row.g * prob1 * (diff - row.expect);
    x2 = allowed2 ? row.g * (prob2 - prob1) : 0.0f;
}

// Rows [0, 16) of a warp's float32 accumulator (C fragments) times `scale` to rows row0 + r
// (r < valid) and columns < dim of a float32 gradient.
template <int DP>
SK_DEVICE void store_fragments(float* dst, long long row_stride, const float (&acc)[DP / 8][4], int valid, int dim,
                               float scale, int lane) {
    const int g = lane / 4, c = lane % 4;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = g + 8 * (r / 2), col = 8 * n + 2 * c + r % 2;
            if (row < valid && col < dim) dst[(long long)row * row_stride + col] = scale * acc[n][r];
        }
}

template <int DP>
SK_DEVICE void zero_fragments(float (&acc)[DP / 8][4]) {
#pragma unroll
    for (int n = 0; n < DP / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[n][r] = 0.0f;
}

// One cp.async ring step (STAGES >= 2: wait for this visit's tile, prefetch visit + STAGES - 1;
// STAGES == 1: load this visit's tile after the previous one is consumed). `load(visit)` issues
// the copies of one visit into slot visit % STAGES; one commit group per visit.
template <int STAGES, typename Load>
SK_DEVICE void ring_step(int visit, int count, Load load) {
    if constexpr (STAGES == 1) {
        __syncthreads();  // the previous visit's tile is consumed
        load(visit);
        sk_cp_async_commit();
        sk_cp_async_wait<0>();
        __syncthreads();
    } else {
        sk_cp_async_wait<STAGES - 2>();
        __syncthreads();  // this visit's tile is in for every thread; the slot of visit - 1 is free
        if (visit + STAGES - 1 < count) load(visit + STAGES - 1);
        sk_cp_async_commit();
    }
}

template <int STAGES, typename Load>
SK_DEVICE void ring_prologue(int count, Load load) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < count) load(s);
        sk_cp_async_commit();
    }
}

// ---------------------------------------------------------------------------------- dq (q-major)
// grid (query tiles, sequence * head), 128 threads. DQ1, DQ2: which of dq1, dq2 this launch
// computes (0 or 1); both score sides are always recomputed.
template <int D1P, int D2P, int STAGES, int DQ1, int DQ2>
__global__ void __launch_bounds__(128) kl_backward_dq_mma(const KLParams p) {
    constexpr int THREADS = 128, TILE = SK_MMA_BWD_TILE, SUB = SK_MMA_BWD_SUB, NT = SUB / 8;
    constexpr int ST1 = D1P + 8, ST2 = D2P + 8;
    constexpr int STAGE = TILE * (ST1 + ST2);
    static_assert(D1P % 16 == 0 && D2P % 16 == 0 && STAGES >= 1 && (DQ1 || DQ2), "variant");

    SK_DYNAMIC_SMEM(dq_smem);
    input_t* q1s = reinterpret_cast<input_t*>(dq_smem);  // [TILE][ST1]
    input_t* q2s = q1s + TILE * ST1;                      // [TILE][ST2]
    input_t* ring = q2s + TILE * ST2;                     // STAGES x ([TILE][ST1] k1, [TILE][ST2] k2)

    const int pair = block_pair();
    if (pair >= p.batch_heads) return;
    const int seq = pair / p.heads;
    const int head = pair - seq * p.heads;
    const int tile = (int)(gridDim.x - 1 - blockIdx.x);  // last tiles first: causal ones have the most keys
    const SeqSpan span = seq_span(p, seq);
    const int row0 = tile * TILE;
    if (row0 >= span.len_q) return;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const bool vector = p.vector_loads != 0;
    const int valid_q = span.len_q - row0;
    load_tile<TILE, D1P, THREADS>(q1s,
                                  reinterpret_cast<const input_t*>(p.q1) + seq * p.q1_b +
                                      (long long)(span.q_start + row0) * p.q1_n + head * p.q1_h,
                                  p.q1_n, valid_q, p.dim1, vector);
    load_tile<TILE, D2P, THREADS>(q2s,
                                  reinterpret_cast<const input_t*>(p.q2) + seq * p.q2_b +
                                      (long long)(span.q_start + row0) * p.q2_n + head * p.q2_h,
                                  p.q2_n, valid_q, p.dim2, vector);
    const input_t* k1_head = reinterpret_cast<const input_t*>(p.k1) + seq * p.k1_b + (head / p.group1) * p.k1_h +
                             (long long)span.k_start * p.k1_n;
    const input_t* k2_head = reinterpret_cast<const input_t*>(p.k2) + seq * p.k2_b + (head / p.group2) * p.k2_h +
                             (long long)span.k_start * p.k2_n;

    const Visits visits = schedule_visits(p, seq, head, tile);
    const int count = visits.count;
    const int* kv_index = visits.index;
    const signed char* kv_partial = visits.partial;
    const SideMasks masks = side_masks(p, seq, head);

    auto load_keys = [&](int visit) {
        const int key0 = kv_index[visit] * TILE;
        input_t* k1s = ring + (visit % STAGES) * STAGE;
        load_tile<TILE, D1P, THREADS>(k1s, k1_head + (long long)key0 * p.k1_n, p.k1_n, span.len_k - key0, p.dim1,
                                      vector);
        load_tile<TILE, D2P, THREADS>(k1s + TILE * ST1, k2_head + (long long)key0 * p.k2_n, p.k2_n,
                                      span.len_k - key0, p.dim2, vector);
    };
    sk_cp_async_commit();  // q1, q2: their own group, retired by the first visit's wait (or the last)
    ring_prologue<STAGES>(count, load_keys);

    const float factor = gradient_factor(p);
    const int warp_row0 = row0 + warp * 16 + g;  // sequence-local query row of h = 0 (h = 1: + 8)
    RowStats rows[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
        rows[h] = mma_row_stats(p, seq, head, span.q_start + warp_row0 + 8 * h, warp_row0 + 8 * h < span.len_q,
                                factor);
    float acc1[DQ1 ? D1P / 8 : 1][4], acc2[DQ2 ? D2P / 8 : 1][4];
    if constexpr (DQ1) zero_fragments<D1P>(acc1);
    if constexpr (DQ2) zero_fragments<D2P>(acc2);

    for (int visit = 0; visit < count; ++visit) {
        ring_step<STAGES>(visit, count, load_keys);
        const input_t* k1s = ring + (visit % STAGES) * STAGE;
        const input_t* k2s = k1s + TILE * ST1;
        const bool partial = kv_partial[visit] != 0;
        const int key0 = kv_index[visit] * TILE;
#pragma unroll 1
        for (int sub = 0; sub < TILE / SUB; ++sub) {
            float s1[1][NT][4], s2[1][NT][4];
            warp_scores<D1P, 1, NT>(s1, q1s + warp * 16 * ST1, k1s + sub * SUB * ST1, lane);
            warp_scores<D2P, 1, NT>(s2, q2s + warp * 16 * ST2, k2s + sub * SUB * ST2, lane);
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    bool allowed1 = true, allowed2 = true;
                    if (partial)
                        element_allowed(p, masks, warp_row0 + 8 * (r / 2), key0 + sub * SUB + 8 * n + 2 * c + r % 2,
                                        span.len_q, span.len_k, allowed1, allowed2);
                    mma_dscores(s1[0][n][r], s2[0][n][r], allowed1, allowed2, rows[r / 2], p.scale1, p.scale2);
                }
#pragma unroll
            for (int kk = 0; kk < NT / 2; ++kk) {
                unsigned a[4];
                if constexpr (DQ1) {
                    fragments_to_a(a, s1[0][2 * kk], s1[0][2 * kk + 1]);
                    warp_accumulate<D1P>(acc1, a, k1s + (sub * SUB + 16 * kk) * ST1, lane);
                }
                if constexpr (DQ2) {
                    fragments_to_a(a, s2[0][2 * kk], s2[0][2 * kk + 1]);
                    warp_accumulate<D2P>(acc2, a, k2s + (sub * SUB + 16 * kk) * ST2, lane);
                }
            }
        }
    }
    sk_cp_async_wait<0>();  // only empty groups remain; leave none in flight at exit

    const long long token = span.q_start + row0 + warp * 16;
    const int valid = span.len_q - (row0 + warp * 16);
    if constexpr (DQ1)
        store_fragments<D1P>(reinterpret_cast<float*>(p.dq1) + seq * p.dq1_b + token * p.dq1_n + head * p.dq1_h,
                             p.dq1_n, acc1, valid, p.dim1, p.scale1 / factor, lane);
    if constexpr (DQ2)
        store_fragments<D2P>(reinterpret_cast<float*>(p.dq2) + seq * p.dq2_b + token * p.dq2_n + head * p.dq2_h,
                             p.dq2_n, acc2, valid, p.dim2, p.scale2 / factor, lane);
}

// dq rows of SUB queries += dS K by float32 atomics, from the key-major kernel: each warp puts its
// dS^T C fragments (16 keys x SUB queries) into `buffer` ([TILE keys][SUB + 8], input_t), then warp
// w multiplies queries 16 (w % 2) .. + 15 by every key of the tile for the 8-column groups
// j = w / 2, w / 2 + 2, ...: A from the buffer by ldmatrix.x4.trans, B from K by ldmatrix.x2.trans.
template <int DP, int NT>
SK_DEVICE void atomic_dq(input_t* buffer, const float (&ds)[1][NT][4], const input_t* k_rows, float* dq,
                         long long dq_stride, int valid_rows, int dim, float scale, int warp, int lane) {
    constexpr int BS = SK_MMA_BWD_SUB + 8, ST = DP + 8, GROUPS = DP / 8, PER_WARP = (GROUPS + 1) / 2;
    const int g = lane / 4, c = lane % 4;
    __syncthreads();  // the buffer's previous contents are consumed
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *reinterpret_cast<unsigned*>(buffer + (warp * 16 + g + 8 * h) * BS + 8 * n + 2 * c) =
                sk_pack_floats(ds[0][n][2 * h], ds[0][n][2 * h + 1]);
    __syncthreads();
    const int m = warp % 2;
    // matrices of A: (queries 0-7 | 8-15) x (keys 0-7 | 8-15), stored keys x queries; of B: keys
    // 0-7 | 8-15 of the 8 columns
    const sk_smem lane_ds = sk_advance(sk_shared_address(buffer), ((lane / 16) * 8 + lane % 8) * BS + m * 16 +
                                                                      ((lane / 8) % 2) * 8);
    const sk_smem lane_keys = sk_advance(sk_shared_address(k_rows), ((lane % 8) + ((lane / 8) % 2) * 8) * ST);
    float acc[PER_WARP][4];
#pragma unroll
    for (int t = 0; t < PER_WARP; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[t][r] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < SK_MMA_BWD_TILE / 16; ++kk) {
        unsigned a[4];
        sk_ldmatrix_x4_trans(a, sk_advance(lane_ds, kk * 16 * BS));
#pragma unroll
        for (int t = 0; t < PER_WARP; ++t) {
            const int j = warp / 2 + 2 * t;
            if (j < GROUPS) {
                unsigned b[2];
                sk_ldmatrix_x2_trans(b, sk_advance(lane_keys, kk * 16 * ST + 8 * j));
                sk_mma_16816(acc[t], a, b);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < PER_WARP; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = m * 16 + g + 8 * (r / 2), col = 8 * (warp / 2 + 2 * t) + 2 * c + r % 2;
            if (col < dim && row < valid_rows) atomicAdd(dq + row * dq_stride + col, scale * acc[t][r]);
        }
}

// ---------------------------------------------------------------------------------- dk (key-major)
// grid (key tiles, sequence * key head of the driving side), 128 threads. DK1, DK2: which of dk1,
// dk2 this launch computes (both only when the two sides group their query heads alike).
// DQ_ATOMIC: it also adds dq of those sides, by atomics (the non-deterministic mode).
template <int D1P, int D2P, int STAGES, int DK1, int DK2, int DQ_ATOMIC>
__global__ void __launch_bounds__(128) kl_backward_dk_mma(const KLParams p) {
    constexpr int THREADS = 128, TILE = SK_MMA_BWD_TILE, SUB = SK_MMA_BWD_SUB, NT = SUB / 8;
    constexpr int ST1 = D1P + 8, ST2 = D2P + 8;
    constexpr int STATS = 4 * TILE * (int)(sizeof(float) / sizeof(input_t));  // lse1, lse2, E, g per query row
    constexpr int STAGE = TILE * (ST1 + ST2) + STATS;
    static_assert(D1P % 16 == 0 && D2P % 16 == 0 && STAGES >= 1 && (DK1 || DK2), "variant");

    SK_DYNAMIC_SMEM(dk_smem);
    input_t* k1s = reinterpret_cast<input_t*>(dk_smem);  // [TILE][ST1]
    input_t* k2s = k1s + TILE * ST1;                      // [TILE][ST2]
    input_t* ring = k2s + TILE * ST2;  // STAGES x ([TILE][ST1] q1, [TILE][ST2] q2, float [4][TILE] stats)
    input_t* ds_buffer = ring + STAGES * STAGE;  // DQ_ATOMIC: [TILE keys][SUB + 8] dS^T

    const int pair = block_pair();
    if (pair >= p.batch_heads) return;
    const int seq = pair / p.heads_drive;
    const int head_k = pair - seq * p.heads_drive;
    const int k_tile = blockIdx.x;
    const SeqSpan span = seq_span(p, seq);
    const int key0 = k_tile * TILE;
    if (key0 >= span.len_k) return;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const bool vector = p.vector_loads != 0;
    const int valid_k = span.len_k - key0;
    const float factor = gradient_factor(p);
    const int warp_key0 = key0 + warp * 16 + g;  // sequence-local key of h = 0 (h = 1: + 8)
    float acc1[DK1 ? D1P / 8 : 1][4], acc2[DK2 ? D2P / 8 : 1][4];
    if constexpr (DK1) zero_fragments<D1P>(acc1);
    if constexpr (DK2) zero_fragments<D2P>(acc2);

    for (int member = 0; member < p.group_drive; ++member) {
        const int head = head_k * p.group_drive + member;
        __syncthreads();  // the previous head's keys and query tiles are consumed
        load_tile<TILE, D1P, THREADS>(k1s,
                                      reinterpret_cast<const input_t*>(p.k1) + seq * p.k1_b +
                                          (long long)(span.k_start + key0) * p.k1_n + (head / p.group1) * p.k1_h,
                                      p.k1_n, valid_k, p.dim1, vector);
        load_tile<TILE, D2P, THREADS>(k2s,
                                      reinterpret_cast<const input_t*>(p.k2) + seq * p.k2_b +
                                          (long long)(span.k_start + key0) * p.k2_n + (head / p.group2) * p.k2_h,
                                      p.k2_n, valid_k, p.dim2, vector);
        const input_t* q1_head = reinterpret_cast<const input_t*>(p.q1) + seq * p.q1_b + head * p.q1_h +
                                 (long long)span.q_start * p.q1_n;
        const input_t* q2_head = reinterpret_cast<const input_t*>(p.q2) + seq * p.q2_b + head * p.q2_h +
                                 (long long)span.q_start * p.q2_n;
        const Visits visits = schedule_visits(p, seq, head, k_tile);
        const int count = visits.count;
        const int* q_index = visits.index;
        const signed char* q_partial = visits.partial;
        const SideMasks masks = side_masks(p, seq, head);

        auto load_queries = [&](int visit) {
            const int row0 = q_index[visit] * TILE;
            input_t* q1s = ring + (visit % STAGES) * STAGE;
            load_tile<TILE, D1P, THREADS>(q1s, q1_head + (long long)row0 * p.q1_n, p.q1_n, span.len_q - row0,
                                          p.dim1, vector);
            load_tile<TILE, D2P, THREADS>(q1s + TILE * ST1, q2_head + (long long)row0 * p.q2_n, p.q2_n,
                                          span.len_q - row0, p.dim2, vector);
            // plain stores: visible to the block after the barrier that opens this visit
            float* stats = reinterpret_cast<float*>(q1s + TILE * (ST1 + ST2));
            if (threadIdx.x < TILE) {
                const int r = threadIdx.x;
                const RowStats row = mma_row_stats(p, seq, head, span.q_start + row0 + r, row0 + r < span.len_q,
                                                   factor);
                stats[r] = row.lse1;
                stats[TILE + r] = row.lse2;
                stats[2 * TILE + r] = row.expect;
                stats[3 * TILE + r] = row.g;
            }
        };
        sk_cp_async_commit();  // the key tiles: their own group, retired by the first visit's wait
        ring_prologue<STAGES>(count, load_queries);

        for (int visit = 0; visit < count; ++visit) {
            ring_step<STAGES>(visit, count, load_queries);
            const input_t* q1s = ring + (visit % STAGES) * STAGE;
            const input_t* q2s = q1s + TILE * ST1;
            const float* stats = reinterpret_cast<const float*>(q2s + TILE * ST2);
            const bool partial = q_partial[visit] != 0;
            const int row0 = q_index[visit] * TILE;
#pragma unroll 1
            for (int sub = 0; sub < TILE / SUB; ++sub) {
                if (row0 + sub * SUB >= span.len_q) break;  // uniform over the block
                float s1[1][NT][4], s2[1][NT][4];  // keys (this warp's 16) x queries
                warp_scores<D1P, 1, NT>(s1, k1s + warp * 16 * ST1, q1s + sub * SUB * ST1, lane);
                warp_scores<D2P, 1, NT>(s2, k2s + warp * 16 * ST2, q2s + sub * SUB * ST2, lane);
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int col = sub * SUB + 8 * n + 2 * c + r % 2;  // query row within the tile
                        bool allowed1 = true, allowed2 = true;
                        if (partial)
                            element_allowed(p, masks, row0 + col, warp_key0 + 8 * (r / 2), span.len_q, span.len_k,
                                            allowed1, allowed2);
                        RowStats row;
                        row.lse1 = stats[col];
                        row.lse2 = stats[TILE + col];
                        row.expect = stats[2 * TILE + col];
                        row.g = stats[3 * TILE + col];
                        mma_dscores(s1[0][n][r], s2[0][n][r], allowed1, allowed2, row, p.scale1, p.scale2);
                    }
#pragma unroll
                for (int kk = 0; kk < NT / 2; ++kk) {
                    unsigned a[4];
                    if constexpr (DK1) {
                        fragments_to_a(a, s1[0][2 * kk], s1[0][2 * kk + 1]);
                        warp_accumulate<D1P>(acc1, a, q1s + (sub * SUB + 16 * kk) * ST1, lane);
                    }
                    if constexpr (DK2) {
                        fragments_to_a(a, s2[0][2 * kk], s2[0][2 * kk + 1]);
                        warp_accumulate<D2P>(acc2, a, q2s + (sub * SUB + 16 * kk) * ST2, lane);
                    }
                }
                if constexpr (DQ_ATOMIC) {
                    const long long token = span.q_start + row0 + sub * SUB;
                    const int valid_rows = span.len_q - (row0 + sub * SUB);
                    if constexpr (DK1)
                        atomic_dq<D1P, NT>(ds_buffer, s1, k1s,
                                           reinterpret_cast<float*>(p.dq1) + seq * p.dq1_b + token * p.dq1_n +
                                               head * p.dq1_h,
                                           p.dq1_n, valid_rows, p.dim1, p.scale1 / factor, warp, lane);
                    if constexpr (DK2)
                        atomic_dq<D2P, NT>(ds_buffer, s2, k2s,
                                           reinterpret_cast<float*>(p.dq2) + seq * p.dq2_b + token * p.dq2_n +
                                               head * p.dq2_h,
                                           p.dq2_n, valid_rows, p.dim2, p.scale2 / factor, warp, lane);
                }
            }
        }
        sk_cp_async_wait<0>();  // this head's ring is drained (empty groups); the next reuses it
    }

    const long long token = span.k_start + key0 + warp * 16;
    const int valid = valid_k - warp * 16;
    if constexpr (DK1)
        store_fragments<D1P>(reinterpret_cast<float*>(p.dk1) + seq * p.dk1_b + token * p.dk1_n + head_k * p.dk1_h,
                             p.dk1_n, acc1, valid, p.dim1, p.scale1 / factor, lane);
    if constexpr (DK2)
        store_fragments<D2P>(reinterpret_cast<float*>(p.dk2) + seq * p.dk2_b + token * p.dk2_n + head_k * p.dk2_h,
                             p.dk2_n, acc2, valid, p.dim2, p.scale2 / factor, lane);
}
