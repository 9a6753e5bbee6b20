// The tensor-core forward for float16 / bfloat16 inputs (included by kernels.cu when
// STREAMKL_INPUT != 0): the SPEC's five streaming statistics per query row, over the same tile
// schedule as kl_forward, with both score tiles s1 = q1 k1^T and s2 = q2 k2^T on mma.sync.
//
// Structure (FlashAttention-2): a block owns BLOCK_Q = 16 * M_TILES * WARPS query rows of one
// (sequence, head); each warp owns M_TILES blocks of 16 consecutive rows and keeps their score
// tiles and statistics in registers, so rows never meet in shared memory. Every key fragment a
// warp loads serves its M_TILES row blocks (M_TILES = 2 halves the shared-memory reads per
// product). q1 and q2 stay in shared memory for the whole block and are read as A fragments
// (ldmatrix) at every key tile, or once into registers (Q_REGS); the key tiles of both sides
// stream through a STAGES-deep cp.async ring, the next tiles landing while the current one is
// multiplied. The tile shape is launch.forward_shape's choice.
//
// Scores stay raw products; scale * log2 e enters through the exponentials' FMAs
// (exp2(s * c - m)), and the statistics convert back to natural logs when the row is written. A
// negative scale is applied as |scale| on a negated q (exact), so raw row maxima are scaled maxima.
//
// Shared memory rows hold DP + 8 elements (DP: the head dim rounded up to 16, padded with zeros),
// an odd number of 16-byte chunks, so the 8 rows of an ldmatrix hit distinct banks.
#pragma once
#include "warp_ops.cuh"

#define SK_LOG2E 1.4426950408889634f
#define SK_LN2 0.6931471805599453f

template <bool VALUE>
struct SkBool {  // a compile-time flag for generic lambdas (no <type_traits> under NVRTC)
    static constexpr bool value = VALUE;
};

// Rows [0, ROWS) and columns [0, DP) of a tile into shared memory (row stride DP + 8), zero at or
// past `valid` rows and `dim` columns. vector: 16-byte cp.async chunks (the host checked that
// every row starts 16-byte aligned and dim % 8 == 0); otherwise element by element.
template <int ROWS, int DP, int THREADS>
SK_DEVICE void load_tile(input_t* dst, const input_t* src, long long row_stride, int valid, int dim, bool vector) {
    constexpr int CHUNKS = DP / 8;
    const sk_smem dst_address = sk_shared_address(dst);
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS;
        const int col = (idx - r * CHUNKS) * 8;
        const bool inside = r < valid && col < dim;
        if (vector) {
            sk_cp_async_16(sk_advance(dst_address, r * (DP + 8) + col),
                           inside ? src + (long long)r * row_stride + col : src, inside ? 16 : 0);
        } else {
            input_t* to = dst + r * (DP + 8) + col;
            for (int e = 0; e < 8; ++e)
                to[e] = (inside && col + e < dim) ? src[(long long)r * row_stride + col + e] : (input_t)0;
        }
    }
}

// s[m][n] += (A fragments a[m]: 16 rows) times keys 8n..8n+7 of `k_rows` (raw products, float32)
template <int DP, int MT, int NT>
SK_DEVICE void warp_scores_kk(float (&s)[MT][NT][4], const unsigned (&a)[MT][4], const input_t* k_rows, int kk,
                              int lane) {
    constexpr int ST = DP + 8;
    // keys 16nn + lane % 8 (+8 for lanes 16-31), columns +8 for lanes 8-15, 24-31
    const sk_smem lane_keys = sk_advance(sk_shared_address(k_rows), ((lane % 8) + (lane / 16) * 8) * ST +
                                                                        kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
    for (int nn = 0; nn < NT / 2; ++nn) {
        unsigned b[4];
        sk_ldmatrix_x4(b, sk_advance(lane_keys, nn * 16 * ST));
        const unsigned low[2] = {b[0], b[1]}, high[2] = {b[2], b[3]};
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            sk_mma_16816(s[m][2 * nn], a[m], low);
            sk_mma_16816(s[m][2 * nn + 1], a[m], high);
        }
    }
}

template <int MT, int NT>
SK_DEVICE void zero_scores(float (&s)[MT][NT][4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int r = 0; r < 4; ++r) s[m][n][r] = 0.0f;
}

// s[m][n] = rows 16m..16m+15 of `q_rows` times keys 8n..8n+7 (raw products, float32), C fragments
template <int DP, int MT, int NT>
SK_DEVICE void warp_scores(float (&s)[MT][NT][4], const input_t* q_rows, const input_t* k_rows, int lane) {
    zero_scores(s);
    const sk_smem lane_rows = sk_advance(sk_shared_address(q_rows), (lane % 16) * (DP + 8) + (lane / 16) * 8);
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) sk_ldmatrix_x4(a[m], sk_advance(lane_rows, 16 * m * (DP + 8) + kk * 16));
        warp_scores_kk<DP, MT, NT>(s, a, k_rows, kk, lane);
    }
}

// butterfly over the 4 lanes that share a row (lanes 4g .. 4g+3)
SK_DEVICE float quad_max(float v) {
    v = fmaxf(v, sk_shfl_xor(v, 1));
    return fmaxf(v, sk_shfl_xor(v, 2));
}

SK_DEVICE float quad_sum(float v) {
    v += sk_shfl_xor(v, 1);
    return v + sk_shfl_xor(v, 2);
}

// s[m][n] = the held A fragments a[m][kk] (16 rows each) times keys 8n..8n+7 (raw products, float32)
template <int DP, int MT, int NT>
SK_DEVICE void warp_scores_held(float (&s)[MT][NT][4], const unsigned (&a)[MT][DP / 16][4], const input_t* k_rows,
                                int lane) {
    zero_scores(s);
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        unsigned ak[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int r = 0; r < 4; ++r) ak[m][r] = a[m][kk][r];
        warp_scores_kk<DP, MT, NT>(s, ak, k_rows, kk, lane);
    }
}

// A fragments of rows 16m..16m+15 of `q_rows`, every 16-column step kk, into registers
template <int DP, int MT>
SK_DEVICE void load_fragments(unsigned (&a)[MT][DP / 16][4], const input_t* q_rows, int lane) {
    const sk_smem lane_rows = sk_advance(sk_shared_address(q_rows), (lane % 16) * (DP + 8) + (lane / 16) * 8);
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk)
#pragma unroll
        for (int m = 0; m < MT; ++m) sk_ldmatrix_x4(a[m][kk], sk_advance(lane_rows, 16 * m * (DP + 8) + kk * 16));
}

// Flip the sign bit of every element of `words` 32-bit words (pairs of half elements) in shared memory
template <int THREADS>
SK_DEVICE void negate_pairs(input_t* rows, int words) {
    unsigned* w = reinterpret_cast<unsigned*>(rows);
    for (int idx = threadIdx.x; idx < words; idx += THREADS) w[idx] ^= 0x80008000u;
}

// grid (query tiles, sequence * head), WARPS * 32 threads; the schedule's tiles are BLOCK_Q x BLOCK_K.
// Q_REGS: each warp holds its q1, q2 A fragments in registers for the whole block (no ldmatrix of
// q per key tile). Writes kl_rows, lse1, lse2, expect for every row of the tile, as kl_forward does.
template <int D1P, int D2P, int BLOCK_K, int M_TILES, int WARPS, int STAGES, int Q_REGS>
__global__ void __launch_bounds__(WARPS * 32) kl_forward_mma(const KLParams p) {
    constexpr int THREADS = WARPS * 32;
    constexpr int WARP_ROWS = 16 * M_TILES;
    constexpr int BLOCK_Q = WARP_ROWS * WARPS;
    constexpr int ROWS = 2 * M_TILES;  // rows of this lane: g and g + 8 of each 16-row block
    constexpr int ST1 = D1P + 8, ST2 = D2P + 8;
    constexpr int NT = BLOCK_K / 8;  // 8-key C fragments per 16-row block
    constexpr int STAGE = BLOCK_K * (ST1 + ST2);
    static_assert(D1P % 16 == 0 && D2P % 16 == 0 && BLOCK_K % 16 == 0 && NT <= 16 && STAGES >= 2, "tile shape");

    SK_DYNAMIC_SMEM(mma_smem);  // its own name: kernels.cu's extern "C" kernels declare `smem`
    input_t* q1s = reinterpret_cast<input_t*>(mma_smem);  // [BLOCK_Q][ST1]
    input_t* q2s = q1s + BLOCK_Q * ST1;                    // [BLOCK_Q][ST2]
    input_t* ring = q2s + BLOCK_Q * ST2;                   // STAGES x ([BLOCK_K][ST1], [BLOCK_K][ST2])

    const int pair = block_pair();
    if (pair >= p.batch_heads) return;
    const int seq = pair / p.heads;
    const int head = pair - seq * p.heads;
    const int tile = (int)(gridDim.x - 1 - blockIdx.x);  // last tiles first: causal ones have the most keys
    const SeqSpan span = seq_span(p, seq);
    const int row0 = tile * BLOCK_Q;
    if (row0 >= span.len_q) return;  // a tile past this sequence's end (packed sequences)

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4;
    const bool vector = p.vector_loads != 0;
    const int valid_q = span.len_q - row0;
    load_tile<BLOCK_Q, D1P, THREADS>(q1s,
                                     reinterpret_cast<const input_t*>(p.q1) + seq * p.q1_b +
                                         (long long)(span.q_start + row0) * p.q1_n + head * p.q1_h,
                                     p.q1_n, valid_q, p.dim1, vector);
    load_tile<BLOCK_Q, D2P, THREADS>(q2s,
                                     reinterpret_cast<const input_t*>(p.q2) + seq * p.q2_b +
                                         (long long)(span.q_start + row0) * p.q2_n + head * p.q2_h,
                                     p.q2_n, valid_q, p.dim2, vector);
    sk_cp_async_commit();  // q1, q2: a group of their own, retired before the key loop
    const input_t* k1_head = reinterpret_cast<const input_t*>(p.k1) + seq * p.k1_b + (head / p.group1) * p.k1_h +
                             (long long)span.k_start * p.k1_n;
    const input_t* k2_head = reinterpret_cast<const input_t*>(p.k2) + seq * p.k2_b + (head / p.group2) * p.k2_h +
                             (long long)span.k_start * p.k2_n;

    const Visits visits = schedule_visits(p, seq, head, tile);
    const int count = visits.count;
    const int* kv_index = visits.index;
    const signed char* kv_partial = visits.partial;
    const SideMasks masks = side_masks(p, seq, head);

    // prologue: the first STAGES - 1 key tiles; one group per tile, empty past the list, so that
    // wait<STAGES - 2> always means "this visit's tile is in"
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < count) {
            const int key0 = kv_index[s] * BLOCK_K;
            input_t* k1s = ring + s * STAGE;
            load_tile<BLOCK_K, D1P, THREADS>(k1s, k1_head + (long long)key0 * p.k1_n, p.k1_n, span.len_k - key0,
                                             p.dim1, vector);
            load_tile<BLOCK_K, D2P, THREADS>(k1s + BLOCK_K * ST1, k2_head + (long long)key0 * p.k2_n, p.k2_n,
                                             span.len_k - key0, p.dim2, vector);
        }
        sk_cp_async_commit();
    }
    int ahead_key0 = STAGES - 1 < count ? kv_index[STAGES - 1] * BLOCK_K : 0;  // read one visit early

    // Scores stay raw products; scale * log2 e enters through the exponentials' FMAs. A negative
    // scale is taken as |scale| times the negated q (exact), so a raw row maximum is the scaled one.
    sk_cp_async_wait<STAGES - 1>();
    __syncthreads();  // q1, q2 are in
    if (p.scale1 < 0.0f || p.scale2 < 0.0f) {
        if (p.scale1 < 0.0f) negate_pairs<THREADS>(q1s, BLOCK_Q * ST1 / 2);
        if (p.scale2 < 0.0f) negate_pairs<THREADS>(q2s, BLOCK_Q * ST2 / 2);
        __syncthreads();
    }
    const input_t* warp_q1 = q1s + warp * WARP_ROWS * ST1;
    const input_t* warp_q2 = q2s + warp * WARP_ROWS * ST2;
    unsigned qa1[Q_REGS ? M_TILES : 1][Q_REGS ? D1P / 16 : 1][4];  // held A fragments (Q_REGS)
    unsigned qa2[Q_REGS ? M_TILES : 1][Q_REGS ? D2P / 16 : 1][4];
    if constexpr (Q_REGS != 0) {
        load_fragments<D1P, M_TILES>(qa1, warp_q1, lane);
        load_fragments<D2P, M_TILES>(qa2, warp_q2, lane);
    }

    const float neg_inf = -sk_inf();
    const float c1 = fabsf(p.scale1) * SK_LOG2E, c2 = fabsf(p.scale2) * SK_LOG2E;
    // statistics of this lane's rows (h: block h / 2, row g + 8 (h % 2)): maxima in log2 units;
    // l1, l2 and dot1, dot2 (sums of p1 times raw s1, raw s2 over keys allowed on both sides) are
    // this lane's partial sums (its 2 of every 8 keys), summed over the quad at the end
    float m1[ROWS], m2[ROWS], l1[ROWS], l2[ROWS], dot1[ROWS], dot2[ROWS];
    bool uncovered[ROWS], seen1[ROWS];  // a key allowed on side 1 only / any key on side 1 (structure)
#pragma unroll
    for (int h = 0; h < ROWS; ++h) {
        m1[h] = m2[h] = neg_inf;
        l1[h] = l2[h] = dot1[h] = dot2[h] = 0.0f;
        uncovered[h] = seen1[h] = false;
    }
    const int warp_row0 = row0 + warp * WARP_ROWS + g;  // sequence-local query row of h = 0

    // the statistics update with the scores of visit `visit`, compiled twice: full tiles (every key
    // allowed on both sides, no element tests) and partial ones
    auto update = [&](auto partial_tile, int visit, float (&s1)[M_TILES][NT][4], float (&s2)[M_TILES][NT][4]) {
        constexpr bool PARTIAL = decltype(partial_tile)::value;
        // bit 2n + (r % 2) of both[h]: key 8n + 2c + (r % 2) is allowed on both sides for row h,
        // where it enters dot1, dot2 (0 elsewhere)
        unsigned both[ROWS];
#pragma unroll
        for (int h = 0; h < ROWS; ++h) {
            both[h] = 0xffffffffu;
            if (!PARTIAL) seen1[h] = true;
        }
        if constexpr (PARTIAL) {
            const int key0 = kv_index[visit] * BLOCK_K;
#pragma unroll
            for (int m = 0; m < M_TILES; ++m)
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int h = 2 * m + r / 2;
                        bool allowed1, allowed2;
                        element_allowed(p, masks, warp_row0 + 8 * h, key0 + 8 * n + 2 * c + (r % 2), span.len_q,
                                        span.len_k, allowed1, allowed2);
                        if (!allowed1) s1[m][n][r] = neg_inf;
                        if (!allowed2) s2[m][n][r] = neg_inf;
                        if (!(allowed1 && allowed2)) both[h] &= ~(1u << (2 * n + r % 2));
                        uncovered[h] = uncovered[h] || (allowed1 && !allowed2);
                        seen1[h] = seen1[h] || allowed1;
                    }
        }
#pragma unroll
        for (int h = 0; h < ROWS; ++h) {
            const int m = h / 2, r0 = 2 * (h % 2);
            float max1 = neg_inf, max2 = neg_inf;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                max1 = fmaxf(max1, fmaxf(s1[m][n][r0], s1[m][n][r0 + 1]));
                max2 = fmaxf(max2, fmaxf(s2[m][n][r0], s2[m][n][r0 + 1]));
            }
            max1 = quad_max(max1);
            max2 = quad_max(max2);
            // c may be 0: a tile without allowed keys keeps -inf (no 0 * inf)
            const float m1_new = fmaxf(m1[h], max1 == neg_inf ? neg_inf : max1 * c1);
            const float m2_new = fmaxf(m2[h], max2 == neg_inf ? neg_inf : max2 * c2);
            // a row with no key yet keeps max -inf: shift by 0 so that no inf - inf appears
            const float shift1 = m1_new == neg_inf ? 0.0f : m1_new;
            const float shift2 = m2_new == neg_inf ? 0.0f : m2_new;
            float sum1 = 0.0f, sum2 = 0.0f, sum_dot1 = 0.0f, sum_dot2 = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float x1 = s1[m][n][r0 + e], x2 = s2[m][n][r0 + e];
                    float arg1 = fmaf(x1, c1, -shift1), arg2 = fmaf(x2, c2, -shift2);
                    if constexpr (PARTIAL) {  // a disallowed key: exp2(-inf) = 0 even where c = 0
                        if (x1 == neg_inf) arg1 = neg_inf;
                        if (x2 == neg_inf) arg2 = neg_inf;
                    }
                    const float e1 = sk_exp2(arg1);
                    sum1 += e1;
                    sum2 += sk_exp2(arg2);
                    if (!PARTIAL || ((both[h] >> (2 * n + e)) & 1u)) {
                        sum_dot1 = fmaf(e1, x1, sum_dot1);
                        sum_dot2 = fmaf(e1, x2, sum_dot2);
                    }
                }
            const float alpha1 = sk_exp2(m1[h] - shift1);
            l1[h] = fmaf(l1[h], alpha1, sum1);
            dot1[h] = fmaf(dot1[h], alpha1, sum_dot1);
            dot2[h] = fmaf(dot2[h], alpha1, sum_dot2);
            l2[h] = fmaf(l2[h], sk_exp2(m2[h] - shift2), sum2);
            m1[h] = m1_new;
            m2[h] = m2_new;
        }
    };

    for (int visit = 0; visit < count; ++visit) {
        sk_cp_async_wait<STAGES - 2>();
        __syncthreads();  // this visit's tile is in for every thread; the tile of visit - 1 is consumed
        const int ahead = visit + STAGES - 1;
        if (ahead < count) {
            input_t* k1s = ring + (ahead % STAGES) * STAGE;
            load_tile<BLOCK_K, D1P, THREADS>(k1s, k1_head + (long long)ahead_key0 * p.k1_n, p.k1_n,
                                             span.len_k - ahead_key0, p.dim1, vector);
            load_tile<BLOCK_K, D2P, THREADS>(k1s + BLOCK_K * ST1, k2_head + (long long)ahead_key0 * p.k2_n, p.k2_n,
                                             span.len_k - ahead_key0, p.dim2, vector);
            ahead_key0 = ahead + 1 < count ? kv_index[ahead + 1] * BLOCK_K : 0;
        }
        sk_cp_async_commit();

        const input_t* k1s = ring + (visit % STAGES) * STAGE;
        float s1[M_TILES][NT][4], s2[M_TILES][NT][4];
        if constexpr (Q_REGS != 0) {
            warp_scores_held<D1P, M_TILES, NT>(s1, qa1, k1s, lane);
            warp_scores_held<D2P, M_TILES, NT>(s2, qa2, k1s + BLOCK_K * ST1, lane);
        } else {
            warp_scores<D1P, M_TILES, NT>(s1, warp_q1, k1s, lane);
            warp_scores<D2P, M_TILES, NT>(s2, warp_q2, k1s + BLOCK_K * ST1, lane);
        }
        if (kv_partial[visit] != 0)
            update(SkBool<true>{}, visit, s1, s2);
        else
            update(SkBool<false>{}, visit, s1, s2);
    }
    sk_cp_async_wait<0>();  // only empty groups remain; leave none in flight at exit

    // finalize (SPEC 4) as kl_forward does, converting log2 units back to natural ones
#pragma unroll
    for (int h = 0; h < ROWS; ++h) {
        const float sum1 = quad_sum(l1[h]), sum2 = quad_sum(l2[h]);
        const float sum_diff = c1 * quad_sum(dot1[h]) - c2 * quad_sum(dot2[h]);  // sum of p1 (s1 - s2), log2 units
        const bool any_uncovered = quad_max(uncovered[h] ? 1.0f : 0.0f) > 0.0f;
        const bool any_seen1 = quad_max(seen1[h] ? 1.0f : 0.0f) > 0.0f;
        const int i = warp_row0 + 8 * h;
        if (c != 0 || i >= span.len_q) continue;
        const bool empty1 = !any_seen1;
        const float log_l1 = log2f(sum1), log_l2 = log2f(sum2);
        const float lse1 = (m1[h] + log_l1) * SK_LN2;
        const float lse2 = (m2[h] + log_l2) * SK_LN2;
        const float expect = empty1 ? 0.0f : sum_diff / sum1 * SK_LN2;
        float kl = expect + ((m2[h] - m1[h]) + (log_l2 - log_l1)) * SK_LN2;
        if (sum1 == 0.0f || sum2 == 0.0f) kl = sk_nan();
        if (any_uncovered) kl = sk_inf();
        if (empty1) kl = 0.0f;
        const long long token = span.q_start + i;
        reinterpret_cast<float*>(p.kl_rows)[seq * p.row_b + token * p.row_n + head * p.row_h] = kl;
        const long long stat = seq * p.stat_b + head * p.stat_h + token * p.stat_n;
        reinterpret_cast<float*>(p.lse1)[stat] = lse1;
        reinterpret_cast<float*>(p.lse2)[stat] = lse2;
        reinterpret_cast<float*>(p.expect)[stat] = expect;
    }
}
