// streamkl CUDA kernels: the FMA forward and the two FMA backward kernels (q-major dq, key-major dk).
//
// Compiled by CuPy (NVRTC) once per input dtype with -DSTREAMKL_INPUT=0 (float32), 1 (float16) or
// 2 (bfloat16); no system header is included, so NVRTC needs no CUDA include path, and the local
// includes (input.cuh, forward_mma.cuh, backward_mma.cuh, warp_ops.cuh) are inlined
// (source.inline_includes) so that CuPy's cache keys on the whole text. The same file also
// compiles as host C++ under emulate.h (STREAMKL_EMULATE), which runs it on the CPU for tests.
// float16 / bfloat16 inputs take the tensor-core kernels of forward_mma.cuh and backward_mma.cuh;
// the kernels below serve float32 (exact FMA).
//
// Layout of the work: 256 threads per block, each thread owns one row (a query row in the forward
// and dq kernels, a key row in the dk kernel) and one "part" of the other side's tile. A thread
// keeps its own online-softmax statistics over the keys of its part; the parts of a row are merged
// once at the end (forward) or meet in shared memory (the dS tiles of the backward). Tiles are
// staged in shared memory as float32, rows padded to an odd number of float4 so that 8 consecutive
// rows read as float4 hit distinct banks. Every product is a float32 FMA (float32 inputs stay full
// float32, half inputs are converted exactly on load).
//
// The host side (launch.py) walks the tile schedule of streamkl/sparse/schedule.py: block_q = 64,
// block_k = 32 for the kernels of this file, the tensor-core kernels' own tiles for them
// (launch.forward_variant; 64 x 64 for the tensor-core backward). KLParams below is the single source of truth for the argument layout:
// launch.py parses this struct to build the matching NumPy record.

#include "input.cuh"

// ------------------------------------------------------------------------------------ parameters
// One record for all three kernels. 8-byte fields first, then 4-byte ones, so the C layout and the
// NumPy record built from this text agree without guessing padding rules.
struct KLParams {
    // device addresses
    sk_u64 q1, k1, q2, k2;
    sk_u64 kl_rows, lse1, lse2, expect, grad_rows;
    sk_u64 dq1, dk1, dq2, dk2;
    sk_u64 cu_q, cu_k;
    sk_u64 sched_count, sched_index, sched_partial;
    sk_u64 mask1, mask2;
    sk_u64 grad_max;  // tensor-core backward: float32 max |grad_rows| (its dS scale, backward_mma.cuh)
    // strides in elements: inputs (batch, token, head), batch stride 0 for packed sequences
    long long q1_b, q1_n, q1_h;
    long long k1_b, k1_n, k1_h;
    long long q2_b, q2_n, q2_h;
    long long k2_b, k2_n, k2_h;
    long long row_b, row_n, row_h;      // kl_rows (batch, token, head)
    long long grad_b, grad_n, grad_h;   // grad_rows (batch, token, head)
    long long stat_b, stat_h, stat_n;   // lse1, lse2, expect (batch, head, token)
    long long dq1_b, dq1_n, dq1_h;
    long long dk1_b, dk1_n, dk1_h;
    long long dq2_b, dq2_n, dq2_h;
    long long dk2_b, dk2_n, dk2_h;
    long long count_s, count_h, count_t;  // schedule counts (sequence, head, tile), 0 on broadcast dims
    long long index_s, index_h, index_t;  // schedule index and partial flags, last dim contiguous
    long long mask1_s, mask1_h, mask1_q, mask1_k;
    long long mask2_s, mask2_h, mask2_q, mask2_k;
    // sizes and flags
    int heads, group1, group2;   // query heads, query heads per key head on each side
    int group_drive, heads_drive;  // dk kernel: group size and key heads of the side it drives
    int dim1, dim2;
    int stride1, stride2;        // shared-memory row strides (floats) for each side
    int seqlen_q, seqlen_k;      // dense lengths, or max_seqlen for packed sequences
    int varlen, has_mask1, has_mask2;
    int mask1_bq, mask1_bk, mask2_bq, mask2_bk;
    int window_left, window_right;  // causality folded into window_right; -1 is unbounded
    int need_dq1, need_dk1, need_dq2, need_dk2;
    int batch_heads;             // number of (sequence, head) pairs in the launch grid
    int vector_loads;            // tensor-core forward: every input row starts 16-byte aligned, dims % 8 == 0
    float scale1, scale2;
};

// ------------------------------------------------------------------------------------ constants
#define SK_THREADS 256
#define SK_BLOCK_Q 64   // schedule query tile
#define SK_BLOCK_K 32   // schedule key tile
#define SK_FWD_ROWS 64  // forward: 64 query rows x 4 parts of 8 keys
#define SK_FWD_PARTS 4
#define SK_FWD_KEYS (SK_BLOCK_K / SK_FWD_PARTS)
#define SK_BWD_ROWS 32  // backward: 32 rows x 8 parts of 4 (the other side's 32-row chunk)
#define SK_BWD_PARTS 8
#define SK_BWD_OTHER (32 / SK_BWD_PARTS)

SK_DEVICE float sk_inf() { return __uint_as_float(0x7f800000u); }
SK_DEVICE float sk_nan() { return __uint_as_float(0x7fc00000u); }

struct SeqSpan {
    int q_start, len_q, k_start, len_k;
};

// One (sequence, head, tile)'s list in the tile schedule: how many tiles it visits, their indices
// and partial flags (the key tiles of a query tile, or the query tiles of a key tile).
struct Visits {
    int count;
    const int* index;
    const signed char* partial;
};

SK_DEVICE Visits schedule_visits(const KLParams& p, int seq, int head, int tile) {
    const long long list = seq * p.index_s + head * p.index_h + tile * p.index_t;
    Visits visits;
    visits.count = reinterpret_cast<const int*>(p.sched_count)[seq * p.count_s + head * p.count_h + tile * p.count_t];
    visits.index = reinterpret_cast<const int*>(p.sched_index) + list;
    visits.partial = reinterpret_cast<const signed char*>(p.sched_partial) + list;
    return visits;
}

SK_DEVICE SeqSpan seq_span(const KLParams& p, int seq) {
    SeqSpan span;
    if (p.varlen) {
        const int* cu_q = reinterpret_cast<const int*>(p.cu_q);
        const int* cu_k = reinterpret_cast<const int*>(p.cu_k);
        span.q_start = cu_q[seq];
        span.len_q = cu_q[seq + 1] - span.q_start;
        span.k_start = cu_k[seq];
        span.len_k = cu_k[seq + 1] - span.k_start;
    } else {
        span.q_start = 0;
        span.len_q = p.seqlen_q;
        span.k_start = 0;
        span.len_k = p.seqlen_k;
    }
    return span;
}

// (sequence, head) of this block: grid.y * grid.z covers batch_heads (grid.y is capped at 65535)
SK_DEVICE int block_pair() { return (int)(blockIdx.z * gridDim.y + blockIdx.y); }

// Rows [0, count) of one head, starting at `src` (row 0), into shared memory [count][stride] as
// float32; rows at or past `valid` and columns at or past `dim` are zero.
SK_DEVICE void load_rows(float* dst, int stride, const input_t* src, long long row_stride, int valid, int count,
                         int dim) {
    const int total = count * stride;
    for (int idx = threadIdx.x; idx < total; idx += SK_THREADS) {
        const int r = idx / stride;
        const int d = idx - r * stride;
        float value = 0.0f;
        if (r < valid && d < dim) value = to_float(src[(long long)r * row_stride + d]);
        dst[idx] = value;
    }
}

// out[c] = <mine, others[c]> for N rows of `others` spaced `stride` apart; rows hold n4 float4
template <int N>
SK_DEVICE void dot_rows(float (&out)[N], const float* mine, const float* others, int stride, int n4) {
#pragma unroll
    for (int c = 0; c < N; ++c) out[c] = 0.0f;
    const float4* a4 = reinterpret_cast<const float4*>(mine);
    for (int d4 = 0; d4 < n4; ++d4) {
        const float4 a = a4[d4];
#pragma unroll
        for (int c = 0; c < N; ++c) {
            const float4 b = reinterpret_cast<const float4*>(others + c * stride)[d4];
            out[c] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
        }
    }
}

// Is key j allowed for query i (both sequence-local) by bounds, causality and window?
SK_DEVICE bool structural_allowed(const KLParams& p, int i, int j, int len_q, int len_k) {
    if (i >= len_q || j >= len_k) return false;
    const int offset = len_k - len_q;  // bottom-right alignment
    if (p.window_left >= 0 && j < i + offset - p.window_left) return false;
    if (p.window_right >= 0 && j > i + offset + p.window_right) return false;
    return true;
}

// One side's block pattern at (i, j); `pattern` already points at this (sequence, head)
SK_DEVICE bool block_allowed(const unsigned char* pattern, long long stride_q, long long stride_k, int block_q,
                             int block_k, int i, int j) {
    return pattern[(long long)(i / block_q) * stride_q + (long long)(j / block_k) * stride_k] != 0;
}

struct SideMasks {
    const unsigned char* pattern1;
    const unsigned char* pattern2;
};

SK_DEVICE SideMasks side_masks(const KLParams& p, int seq, int head) {
    SideMasks masks;
    masks.pattern1 = reinterpret_cast<const unsigned char*>(p.mask1) + seq * p.mask1_s + head * p.mask1_h;
    masks.pattern2 = reinterpret_cast<const unsigned char*>(p.mask2) + seq * p.mask2_s + head * p.mask2_h;
    return masks;
}

// allowed on side 1 and on side 2 for (i, j), sequence-local
SK_DEVICE void element_allowed(const KLParams& p, const SideMasks& masks, int i, int j, int len_q, int len_k,
                               bool& allowed1, bool& allowed2) {
    const bool base = structural_allowed(p, i, j, len_q, len_k);
    allowed1 = base;
    allowed2 = base;
    if (base && p.has_mask1)
        allowed1 = block_allowed(masks.pattern1, p.mask1_q, p.mask1_k, p.mask1_bq, p.mask1_bk, i, j);
    if (base && p.has_mask2)
        allowed2 = block_allowed(masks.pattern2, p.mask2_q, p.mask2_k, p.mask2_bq, p.mask2_bk, i, j);
}

// ================================================================================== forward
#ifndef SK_TENSOR_CORE_ONLY  // the tensor-core modules leave the FMA kernels out (compile time)
// grid (query tiles, sequence*head); the SPEC's five running statistics per (row, part), merged
// over the parts at the end; writes kl_rows, lse1, lse2, expect for every row of the tile.
extern "C" __global__ void __launch_bounds__(SK_THREADS) kl_forward(const KLParams p) {
    SK_DYNAMIC_SMEM(smem);
    const int pair = block_pair();
    if (pair >= p.batch_heads) return;
    const int seq = pair / p.heads;
    const int head = pair - seq * p.heads;
    const int tile = blockIdx.x;
    const SeqSpan span = seq_span(p, seq);
    const int row0 = tile * SK_BLOCK_Q;
    if (row0 >= span.len_q) return;  // a tile past this sequence's end (packed sequences)

    const int row = threadIdx.x % SK_FWD_ROWS;
    const int part = threadIdx.x / SK_FWD_ROWS;
    const int st1 = p.stride1, st2 = p.stride2;
    const int n4_1 = (p.dim1 + 3) / 4, n4_2 = (p.dim2 + 3) / 4;
    float* q1s = smem;                       // [64][st1]
    float* q2s = q1s + SK_FWD_ROWS * st1;    // [64][st2]
    float* k1s = q2s + SK_FWD_ROWS * st2;    // [32][st1]
    float* k2s = k1s + SK_BLOCK_K * st1;     // [32][st2]
    float* merge = k2s + SK_BLOCK_K * st2;   // [6][parts][rows]

    const int head_k1 = head / p.group1, head_k2 = head / p.group2;
    const int valid_q = span.len_q - row0;
    load_rows(q1s, st1,
              reinterpret_cast<const input_t*>(p.q1) + seq * p.q1_b + (long long)(span.q_start + row0) * p.q1_n +
                  head * p.q1_h,
              p.q1_n, valid_q, SK_FWD_ROWS, p.dim1);
    load_rows(q2s, st2,
              reinterpret_cast<const input_t*>(p.q2) + seq * p.q2_b + (long long)(span.q_start + row0) * p.q2_n +
                  head * p.q2_h,
              p.q2_n, valid_q, SK_FWD_ROWS, p.dim2);
    const input_t* k1_head = reinterpret_cast<const input_t*>(p.k1) + seq * p.k1_b + head_k1 * p.k1_h;
    const input_t* k2_head = reinterpret_cast<const input_t*>(p.k2) + seq * p.k2_b + head_k2 * p.k2_h;

    const Visits visits = schedule_visits(p, seq, head, tile);
    const int count = visits.count;
    const int* kv_index = visits.index;
    const signed char* kv_partial = visits.partial;
    const SideMasks masks = side_masks(p, seq, head);

    const float neg_inf = -sk_inf();
    float m1 = neg_inf, l1 = 0.0f, m2 = neg_inf, l2 = 0.0f, acc = 0.0f;
    bool uncovered = false;  // a key allowed on side 1 only (structure)
    bool seen1 = false;      // any key allowed on side 1 (structure)
    const int i = row0 + row;  // sequence-local query row
    for (int visit = 0; visit < count; ++visit) {
        const int k_tile = kv_index[visit];
        const bool partial = kv_partial[visit] != 0;
        const int key0 = k_tile * SK_BLOCK_K;
        __syncthreads();  // the previous key tile is consumed
        const int valid_k = span.len_k - key0;
        load_rows(k1s, st1, k1_head + (long long)(span.k_start + key0) * p.k1_n, p.k1_n, valid_k, SK_BLOCK_K,
                  p.dim1);
        load_rows(k2s, st2, k2_head + (long long)(span.k_start + key0) * p.k2_n, p.k2_n, valid_k, SK_BLOCK_K,
                  p.dim2);
        __syncthreads();

        float s1[SK_FWD_KEYS], s2[SK_FWD_KEYS], diff[SK_FWD_KEYS];
        dot_rows<SK_FWD_KEYS>(s1, q1s + row * st1, k1s + part * SK_FWD_KEYS * st1, st1, n4_1);
        dot_rows<SK_FWD_KEYS>(s2, q2s + row * st2, k2s + part * SK_FWD_KEYS * st2, st2, n4_2);
#pragma unroll
        for (int c = 0; c < SK_FWD_KEYS; ++c) {
            s1[c] *= p.scale1;
            s2[c] *= p.scale2;
            diff[c] = s1[c] - s2[c];
        }
        if (partial) {
#pragma unroll
            for (int c = 0; c < SK_FWD_KEYS; ++c) {
                bool allowed1, allowed2;
                element_allowed(p, masks, i, key0 + part * SK_FWD_KEYS + c, span.len_q, span.len_k, allowed1,
                                allowed2);
                if (!allowed1) s1[c] = neg_inf;
                if (!allowed2) s2[c] = neg_inf;
                if (!(allowed1 && allowed2)) diff[c] = 0.0f;
                uncovered = uncovered || (allowed1 && !allowed2);
                seen1 = seen1 || allowed1;
            }
        } else {
            seen1 = true;  // a full tile allows every key to every row on both sides
        }
        float max1 = neg_inf, max2 = neg_inf;
#pragma unroll
        for (int c = 0; c < SK_FWD_KEYS; ++c) {
            max1 = fmaxf(max1, s1[c]);
            max2 = fmaxf(max2, s2[c]);
        }
        const float m1_new = fmaxf(m1, max1);
        const float m2_new = fmaxf(m2, max2);
        // a row with no key yet keeps max -inf: shift by 0 so that no inf - inf appears
        const float shift1 = m1_new == neg_inf ? 0.0f : m1_new;
        const float shift2 = m2_new == neg_inf ? 0.0f : m2_new;
        float sum1 = 0.0f, sum_diff = 0.0f, sum2 = 0.0f;
#pragma unroll
        for (int c = 0; c < SK_FWD_KEYS; ++c) {
            const float e1 = expf(s1[c] - shift1);
            sum1 += e1;
            sum_diff += e1 * diff[c];
            sum2 += expf(s2[c] - shift2);
        }
        const float alpha1 = expf(m1 - shift1);
        l1 = l1 * alpha1 + sum1;
        acc = acc * alpha1 + sum_diff;
        l2 = l2 * expf(m2 - shift2) + sum2;
        m1 = m1_new;
        m2 = m2_new;
    }

    // merge the parts of each row
    __syncthreads();
    const int slot = part * SK_FWD_ROWS + row;
    const int plane = SK_FWD_PARTS * SK_FWD_ROWS;
    merge[0 * plane + slot] = m1;
    merge[1 * plane + slot] = l1;
    merge[2 * plane + slot] = m2;
    merge[3 * plane + slot] = l2;
    merge[4 * plane + slot] = acc;
    merge[5 * plane + slot] = (uncovered ? 1.0f : 0.0f) + (seen1 ? 2.0f : 0.0f);
    __syncthreads();
    if (part != 0 || i >= span.len_q) return;
    float max1 = neg_inf, max2 = neg_inf;
    for (int q = 0; q < SK_FWD_PARTS; ++q) {
        max1 = fmaxf(max1, merge[0 * plane + q * SK_FWD_ROWS + row]);
        max2 = fmaxf(max2, merge[2 * plane + q * SK_FWD_ROWS + row]);
    }
    const float shift1 = max1 == neg_inf ? 0.0f : max1;
    const float shift2 = max2 == neg_inf ? 0.0f : max2;
    float sum1 = 0.0f, sum2 = 0.0f, sum_diff = 0.0f;
    bool any_uncovered = false, any_seen1 = false;
    for (int q = 0; q < SK_FWD_PARTS; ++q) {
        const int at = q * SK_FWD_ROWS + row;
        const float w1 = expf(merge[0 * plane + at] - shift1);
        sum1 += merge[1 * plane + at] * w1;
        sum_diff += merge[4 * plane + at] * w1;
        sum2 += merge[3 * plane + at] * expf(merge[2 * plane + at] - shift2);
        const int flags = static_cast<int>(merge[5 * plane + at]);
        any_uncovered = any_uncovered || (flags & 1) != 0;
        any_seen1 = any_seen1 || (flags & 2) != 0;
    }
    // finalize (SPEC 4): lse = m + log l, E = a / l1, KL = E - lse1 + lse2 with the large terms
    // cancelled first; empty rows KL 0, uncovered rows +inf (E stays finite for the backward), both
    // by structure; a sum of 0 on a row that is neither: its allowed scores are all -inf by value (an
    // infinite input), and it reads NaN (E too), as softmax does
    const bool empty1 = !any_seen1;
    const float log_l1 = logf(sum1), log_l2 = logf(sum2);
    const float lse1 = max1 + log_l1;
    const float lse2 = max2 + log_l2;
    const float expect = empty1 ? 0.0f : sum_diff / sum1;
    float kl = expect - (max1 - max2) - log_l1 + log_l2;
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
#endif  // SK_TENSOR_CORE_ONLY

// ================================================================================== backward
// dS1 = g * p * (d - E) with d = s1 - s2 on keys allowed on both sides (0 elsewhere),
// dS2 = g * (q - p) on side 2's keys; p = exp(s1 - lse1), q = exp(s2 - lse2). Row statistics
// arrive already made safe: lse of an empty row is +inf (so p = 0), g and E are 0 off the rows.
SK_DEVICE void tile_dscores(float s1, float s2, bool partial, bool allowed1, bool allowed2, float lse1, float lse2,
                            float expect, float g, float& ds1, float& ds2) {
    if (partial) {
        const float neg_inf = -sk_inf();
        const float masked1 = allowed1 ? s1 : neg_inf;
        const float masked2 = allowed2 ? s2 : neg_inf;
        const float diff = (allowed1 && allowed2) ? s1 - s2 : 0.0f;
        const float prob1 = expf(masked1 - lse1);
        ds1 = g * prob1 * (diff - expect);
        ds2 = allowed2 ? g * (expf(masked2 - lse2) - prob1) : 0.0f;
    } else {
        const float prob1 = expf(s1 - lse1);
        ds1 = g * prob1 * ((s1 - s2) - expect);
        ds2 = g * (expf(s2 - lse2) - prob1);
    }
}

// (lse1, lse2, E, g) of query row `token` of (seq, head), safe for tile_dscores
SK_DEVICE void row_statistics(const KLParams& p, int seq, int head, long long token, bool valid, float& lse1,
                              float& lse2, float& expect, float& g) {
    const float inf = sk_inf();
    lse1 = inf;
    lse2 = inf;
    expect = 0.0f;
    g = 0.0f;
    if (!valid) return;
    const long long stat = seq * p.stat_b + head * p.stat_h + token * p.stat_n;
    const float raw1 = reinterpret_cast<const float*>(p.lse1)[stat];
    const float raw2 = reinterpret_cast<const float*>(p.lse2)[stat];
    lse1 = raw1 == -inf ? inf : raw1;  // an empty row: p = exp(s - inf) = 0, never exp(+inf)
    lse2 = raw2 == -inf ? inf : raw2;
    expect = reinterpret_cast<const float*>(p.expect)[stat];
    g = reinterpret_cast<const float*>(p.grad_rows)[seq * p.grad_b + token * p.grad_n + head * p.grad_h];
}

// acc[row][d] += sum_r weights[r] * rows[r][d] for this thread's float4 columns part, part + 8, ...
SK_DEVICE void accumulate_rows(float* acc_row, const float (&weights)[32], const float* rows, int stride, int n4,
                               int part) {
    float4* acc4 = reinterpret_cast<float4*>(acc_row);
    for (int d4 = part; d4 < n4; d4 += SK_BWD_PARTS) {
        float4 sum = acc4[d4];
#pragma unroll
        for (int r = 0; r < 32; ++r) {  // fully unrolled: the weights stay in registers
            const float4 v = reinterpret_cast<const float4*>(rows + r * stride)[d4];
            const float w = weights[r];
            sum.x += w * v.x;
            sum.y += w * v.y;
            sum.z += w * v.z;
            sum.w += w * v.w;
        }
        acc4[d4] = sum;
    }
}

// Writes rows [0, valid) of a shared [32][stride] accumulator, times `scale`, to float32 memory.
SK_DEVICE void store_rows(float* dst, long long row_stride, const float* acc, int stride, int valid, int dim,
                          float scale) {
    const int rows = valid < 32 ? valid : 32;
    const int total = rows * dim;
    for (int idx = threadIdx.x; idx < total; idx += SK_THREADS) {
        const int r = idx / dim;
        const int d = idx - r * dim;
        dst[(long long)r * row_stride + d] = scale * acc[r * stride + d];
    }
}

SK_DEVICE void zero_shared(float* dst, int count) {
    for (int idx = threadIdx.x; idx < count; idx += SK_THREADS) dst[idx] = 0.0f;
}

#ifndef SK_TENSOR_CORE_ONLY  // the tensor-core modules leave the FMA kernels out (compile time)
// ---------------------------------------------------------------------------------- dq (q-major)
// grid (query tiles * 2, sequence*head): 32 query rows per block, each thread one row and a part
// of 4 keys of every key tile; dq rows are owned by one block: plain stores, no atomics.
extern "C" __global__ void __launch_bounds__(SK_THREADS) kl_backward_dq(const KLParams p) {
    SK_DYNAMIC_SMEM(smem);
    const int pair = block_pair();
    if (pair >= p.batch_heads) return;
    const int seq = pair / p.heads;
    const int head = pair - seq * p.heads;
    const int tile = blockIdx.x / 2;
    const SeqSpan span = seq_span(p, seq);
    const int row0 = tile * SK_BLOCK_Q + (blockIdx.x % 2) * SK_BWD_ROWS;
    if (row0 >= span.len_q) return;

    const int row = threadIdx.x % SK_BWD_ROWS;
    const int part = threadIdx.x / SK_BWD_ROWS;
    const int st1 = p.stride1, st2 = p.stride2;
    const int n4_1 = (p.dim1 + 3) / 4, n4_2 = (p.dim2 + 3) / 4;
    float* q1s = smem;                        // [32][st1]
    float* q2s = q1s + SK_BWD_ROWS * st1;     // [32][st2]
    float* k1s = q2s + SK_BWD_ROWS * st2;     // [32][st1]
    float* k2s = k1s + SK_BLOCK_K * st1;      // [32][st2]
    float* acc1 = k2s + SK_BLOCK_K * st2;     // [32][st1]
    float* acc2 = acc1 + SK_BWD_ROWS * st1;   // [32][st2]
    float* ds1t = acc2 + SK_BWD_ROWS * st2;   // [32 keys][32 rows]
    float* ds2t = ds1t + SK_BLOCK_K * SK_BWD_ROWS;

    const int head_k1 = head / p.group1, head_k2 = head / p.group2;
    const int valid_q = span.len_q - row0;
    load_rows(q1s, st1,
              reinterpret_cast<const input_t*>(p.q1) + seq * p.q1_b + (long long)(span.q_start + row0) * p.q1_n +
                  head * p.q1_h,
              p.q1_n, valid_q, SK_BWD_ROWS, p.dim1);
    load_rows(q2s, st2,
              reinterpret_cast<const input_t*>(p.q2) + seq * p.q2_b + (long long)(span.q_start + row0) * p.q2_n +
                  head * p.q2_h,
              p.q2_n, valid_q, SK_BWD_ROWS, p.dim2);
    if (p.need_dq1) zero_shared(acc1, SK_BWD_ROWS * st1);
    if (p.need_dq2) zero_shared(acc2, SK_BWD_ROWS * st2);
    const input_t* k1_head = reinterpret_cast<const input_t*>(p.k1) + seq * p.k1_b + head_k1 * p.k1_h;
    const input_t* k2_head = reinterpret_cast<const input_t*>(p.k2) + seq * p.k2_b + head_k2 * p.k2_h;

    const int i = row0 + row;
    float lse1, lse2, expect, g;
    row_statistics(p, seq, head, span.q_start + i, i < span.len_q, lse1, lse2, expect, g);

    const Visits visits = schedule_visits(p, seq, head, tile);
    const int count = visits.count;
    const int* kv_index = visits.index;
    const signed char* kv_partial = visits.partial;
    const SideMasks masks = side_masks(p, seq, head);

    for (int visit = 0; visit < count; ++visit) {
        const int k_tile = kv_index[visit];
        const bool partial = kv_partial[visit] != 0;
        const int key0 = k_tile * SK_BLOCK_K;
        __syncthreads();  // the previous tile's keys and dS are consumed
        const int valid_k = span.len_k - key0;
        load_rows(k1s, st1, k1_head + (long long)(span.k_start + key0) * p.k1_n, p.k1_n, valid_k, SK_BLOCK_K,
                  p.dim1);
        load_rows(k2s, st2, k2_head + (long long)(span.k_start + key0) * p.k2_n, p.k2_n, valid_k, SK_BLOCK_K,
                  p.dim2);
        __syncthreads();

        float s1[SK_BWD_OTHER], s2[SK_BWD_OTHER];
        dot_rows<SK_BWD_OTHER>(s1, q1s + row * st1, k1s + part * SK_BWD_OTHER * st1, st1, n4_1);
        dot_rows<SK_BWD_OTHER>(s2, q2s + row * st2, k2s + part * SK_BWD_OTHER * st2, st2, n4_2);
#pragma unroll
        for (int c = 0; c < SK_BWD_OTHER; ++c) {
            const int key = part * SK_BWD_OTHER + c;
            bool allowed1 = true, allowed2 = true;
            if (partial) element_allowed(p, masks, i, key0 + key, span.len_q, span.len_k, allowed1, allowed2);
            float ds1, ds2;
            tile_dscores(s1[c] * p.scale1, s2[c] * p.scale2, partial, allowed1, allowed2, lse1, lse2, expect, g,
                         ds1, ds2);
            ds1t[key * SK_BWD_ROWS + row] = ds1;
            ds2t[key * SK_BWD_ROWS + row] = ds2;
        }
        __syncthreads();

        float weights[32];
        if (p.need_dq1) {
#pragma unroll
            for (int key = 0; key < 32; ++key) weights[key] = ds1t[key * SK_BWD_ROWS + row];
            accumulate_rows(acc1 + row * st1, weights, k1s, st1, n4_1, part);
        }
        if (p.need_dq2) {
#pragma unroll
            for (int key = 0; key < 32; ++key) weights[key] = ds2t[key * SK_BWD_ROWS + row];
            accumulate_rows(acc2 + row * st2, weights, k2s, st2, n4_2, part);
        }
    }
    __syncthreads();
    const long long token0 = span.q_start + row0;
    if (p.need_dq1)
        store_rows(reinterpret_cast<float*>(p.dq1) + seq * p.dq1_b + token0 * p.dq1_n + head * p.dq1_h, p.dq1_n,
                   acc1, st1, valid_q, p.dim1, p.scale1);
    if (p.need_dq2)
        store_rows(reinterpret_cast<float*>(p.dq2) + seq * p.dq2_b + token0 * p.dq2_n + head * p.dq2_h, p.dq2_n,
                   acc2, st2, valid_q, p.dim2, p.scale2);
}
#endif  // SK_TENSOR_CORE_ONLY

#ifndef SK_TENSOR_CORE_ONLY  // the tensor-core modules leave the FMA kernels out (compile time)
// ---------------------------------------------------------------------------------- dk (key-major)
// grid (key tiles, sequence * key head of the driving side): 32 key rows per block, looping over
// the query heads of that key head's group (the GQA sum stays in the block) and, for each, over
// the query tiles that visit this key tile (the transposed schedule), 32 query rows at a time.
extern "C" __global__ void __launch_bounds__(SK_THREADS) kl_backward_dk(const KLParams p) {
    SK_DYNAMIC_SMEM(smem);
    const int pair = block_pair();
    if (pair >= p.batch_heads) return;
    const int seq = pair / p.heads_drive;
    const int head_k = pair - seq * p.heads_drive;
    const int k_tile = blockIdx.x;
    const SeqSpan span = seq_span(p, seq);
    const int key0 = k_tile * SK_BLOCK_K;
    if (key0 >= span.len_k) return;

    const int key = threadIdx.x % SK_BLOCK_K;
    const int part = threadIdx.x / SK_BLOCK_K;
    const int st1 = p.stride1, st2 = p.stride2;
    const int n4_1 = (p.dim1 + 3) / 4, n4_2 = (p.dim2 + 3) / 4;
    float* k1s = smem;                        // [32][st1]
    float* k2s = k1s + SK_BLOCK_K * st1;      // [32][st2]
    float* q1s = k2s + SK_BLOCK_K * st2;      // [32][st1]
    float* q2s = q1s + SK_BWD_ROWS * st1;     // [32][st2]
    float* acc1 = q2s + SK_BWD_ROWS * st2;    // [32][st1]
    float* acc2 = acc1 + SK_BLOCK_K * st1;    // [32][st2]
    float* ds1t = acc2 + SK_BLOCK_K * st2;    // [32 rows][32 keys]
    float* ds2t = ds1t + SK_BWD_ROWS * SK_BLOCK_K;
    float* stats = ds2t + SK_BWD_ROWS * SK_BLOCK_K;  // [4][32]: lse1, lse2, E, g

    if (p.need_dk1) zero_shared(acc1, SK_BLOCK_K * st1);
    if (p.need_dk2) zero_shared(acc2, SK_BLOCK_K * st2);
    const int valid_k = span.len_k - key0;
    const int j = key0 + key;  // sequence-local key

    for (int member = 0; member < p.group_drive; ++member) {
        const int head = head_k * p.group_drive + member;
        const int head_k1 = head / p.group1, head_k2 = head / p.group2;
        __syncthreads();  // the previous head's keys are consumed
        load_rows(k1s, st1,
                  reinterpret_cast<const input_t*>(p.k1) + seq * p.k1_b +
                      (long long)(span.k_start + key0) * p.k1_n + head_k1 * p.k1_h,
                  p.k1_n, valid_k, SK_BLOCK_K, p.dim1);
        load_rows(k2s, st2,
                  reinterpret_cast<const input_t*>(p.k2) + seq * p.k2_b +
                      (long long)(span.k_start + key0) * p.k2_n + head_k2 * p.k2_h,
                  p.k2_n, valid_k, SK_BLOCK_K, p.dim2);
        const input_t* q1_head = reinterpret_cast<const input_t*>(p.q1) + seq * p.q1_b + head * p.q1_h;
        const input_t* q2_head = reinterpret_cast<const input_t*>(p.q2) + seq * p.q2_b + head * p.q2_h;

        const Visits visits = schedule_visits(p, seq, head, k_tile);
        const int count = visits.count;
        const int* q_index = visits.index;
        const signed char* q_partial = visits.partial;
        const SideMasks masks = side_masks(p, seq, head);

        for (int visit = 0; visit < count; ++visit) {
            const int q_tile = q_index[visit];
            const bool partial = q_partial[visit] != 0;
            for (int half = 0; half < SK_BLOCK_Q / SK_BWD_ROWS; ++half) {
                const int row0 = q_tile * SK_BLOCK_Q + half * SK_BWD_ROWS;
                if (row0 >= span.len_q) break;  // uniform over the block
                const int valid_q = span.len_q - row0;
                __syncthreads();  // the previous chunk's queries, dS and statistics are consumed
                load_rows(q1s, st1, q1_head + (long long)(span.q_start + row0) * p.q1_n, p.q1_n, valid_q,
                          SK_BWD_ROWS, p.dim1);
                load_rows(q2s, st2, q2_head + (long long)(span.q_start + row0) * p.q2_n, p.q2_n, valid_q,
                          SK_BWD_ROWS, p.dim2);
                if (threadIdx.x < SK_BWD_ROWS) {
                    const int r = threadIdx.x;
                    float lse1, lse2, expect, g;
                    row_statistics(p, seq, head, span.q_start + row0 + r, r < valid_q, lse1, lse2, expect, g);
                    stats[0 * SK_BWD_ROWS + r] = lse1;
                    stats[1 * SK_BWD_ROWS + r] = lse2;
                    stats[2 * SK_BWD_ROWS + r] = expect;
                    stats[3 * SK_BWD_ROWS + r] = g;
                }
                __syncthreads();

                float s1[SK_BWD_OTHER], s2[SK_BWD_OTHER];
                dot_rows<SK_BWD_OTHER>(s1, k1s + key * st1, q1s + part * SK_BWD_OTHER * st1, st1, n4_1);
                dot_rows<SK_BWD_OTHER>(s2, k2s + key * st2, q2s + part * SK_BWD_OTHER * st2, st2, n4_2);
#pragma unroll
                for (int c = 0; c < SK_BWD_OTHER; ++c) {
                    const int r = part * SK_BWD_OTHER + c;
                    bool allowed1 = true, allowed2 = true;
                    if (partial) element_allowed(p, masks, row0 + r, j, span.len_q, span.len_k, allowed1, allowed2);
                    float ds1, ds2;
                    tile_dscores(s1[c] * p.scale1, s2[c] * p.scale2, partial, allowed1, allowed2,
                                 stats[0 * SK_BWD_ROWS + r], stats[1 * SK_BWD_ROWS + r], stats[2 * SK_BWD_ROWS + r],
                                 stats[3 * SK_BWD_ROWS + r], ds1, ds2);
                    ds1t[r * SK_BLOCK_K + key] = ds1;
                    ds2t[r * SK_BLOCK_K + key] = ds2;
                }
                __syncthreads();

                float weights[32];
                if (p.need_dk1) {
#pragma unroll
                    for (int r = 0; r < 32; ++r) weights[r] = ds1t[r * SK_BLOCK_K + key];
                    accumulate_rows(acc1 + key * st1, weights, q1s, st1, n4_1, part);
                }
                if (p.need_dk2) {
#pragma unroll
                    for (int r = 0; r < 32; ++r) weights[r] = ds2t[r * SK_BLOCK_K + key];
                    accumulate_rows(acc2 + key * st2, weights, q2s, st2, n4_2, part);
                }
            }
        }
    }
    __syncthreads();
    const long long token0 = span.k_start + key0;
    if (p.need_dk1)
        store_rows(reinterpret_cast<float*>(p.dk1) + seq * p.dk1_b + token0 * p.dk1_n + head_k * p.dk1_h, p.dk1_n,
                   acc1, st1, valid_k, p.dim1, p.scale1);
    if (p.need_dk2)
        store_rows(reinterpret_cast<float*>(p.dk2) + seq * p.dk2_b + token0 * p.dk2_n + head_k * p.dk2_h, p.dk2_n,
                   acc2, st2, valid_k, p.dim2, p.scale2);
}
#endif  // SK_TENSOR_CORE_ONLY

#if STREAMKL_INPUT != 0
#include "forward_mma.cuh"
#include "backward_mma.cuh"
#endif
