// streamkl CUDA kernels for the DSA indexer loss (SPEC 8): the forward and the two backward kernels.
//
// Compiled by CuPy (NVRTC) once per input dtype with -DSTREAMKL_INPUT=0 (float32), 1 (float16) or
// 2 (bfloat16), input.cuh inlined (source.inline_includes); no system header. Under
// indexer_emulate.cpp the same file compiles as host C++ (STREAMKL_EMULATE) and runs on the CPU
// for tests.
//
// The unit of work is a chunk of IX_CHUNK (query row, key) pairs, the "slots" of the chunk:
// - indexer_forward and indexer_backward_row: one block per query row; the slots are the row's next
//   IX_CHUNK allowed keys (dense: 0..causal end; top-k: its selected keys, deduplicated);
// - indexer_backward_key: one block per key; the slots are the next IX_CHUNK rows that see the key
//   (dense: a range; top-k: a key-major list built on the host), so dki is owned by one block and
//   the gradients are bitwise reproducible (no atomics anywhere).
// For each chunk the block computes the teacher scores S[h][slot] and the indexer dots Zp[t][slot]
// in shared memory (threads over (head, slot) items), then one thread per slot turns them into
// T (the heads' mean probability) and z (the indexer logit). Statistics are float32; every product
// is a float32 FMA (half inputs are converted exactly on load). Nothing of size Nq x Nk exists.

#include "input.cuh"

// ------------------------------------------------------------------------------------ parameters
// One record for the three kernels; indexer.py parses this struct to build the matching NumPy
// record. 8-byte fields first, then 4-byte ones, so the two layouts agree without padding rules.
struct IndexerParams {
    // device addresses
    sk_u64 q, k, qi, ki, w, topk, head_lse, index_lse, grad_rows, loss;
    sk_u64 dqi, dki, dw;
    sk_u64 cu_q, cu_k;
    sk_u64 key_offsets, key_rows;  // top-k backward: rows that selected each key (key-major lists)
    // strides in elements, batch stride 0 for packed sequences
    long long q_b, q_n, q_h;
    long long k_b, k_n, k_h;
    long long qi_b, qi_n, qi_h;
    long long ki_b, ki_n;
    long long w_b, w_n, w_h;
    long long topk_b, topk_n, topk_s;
    long long lse_b, lse_h, lse_n;  // head_lse (batch, head, token)
    long long ilse_b, ilse_n;       // index_lse (batch, token)
    long long grad_b, grad_n;       // grad_rows (batch, token)
    long long loss_b, loss_n;
    long long dqi_b, dqi_n, dqi_h;
    long long dki_b, dki_n;
    long long dw_b, dw_n, dw_h;
    // sizes and flags
    int heads, group, dim;         // teacher query heads, query heads per key head, head dim
    int index_heads, index_dim;
    int seqlen_q, seqlen_k;        // dense lengths, or max_seqlen for packed sequences
    int varlen, causal, topk_count, lse_given;
    float scale;
};

// ------------------------------------------------------------------------------------ constants
#define IX_THREADS 128
#define IX_CHUNK 64                // slots per chunk
#define IX_PITCH (IX_CHUNK + 1)    // shared row pitch of S and Zp: (head, slot) reads hit distinct banks

SK_DEVICE float ix_inf() { return __uint_as_float(0x7f800000u); }

struct IxSpan {
    int q_start, len_q, k_start, len_k;
};

SK_DEVICE IxSpan ix_span(const IndexerParams& p, int seq) {
    IxSpan span;
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

// The shared-memory carve-up, identical in every kernel (indexer.py's shared_bytes mirrors it).
struct IxShared {
    float* scores;    // [heads][IX_PITCH]: teacher scores, then probabilities
    float* dots;      // [index_heads][IX_PITCH]: <qi_t, ki>, then backward coefficients
    int* slot_row;    // [IX_CHUNK]: sequence-local query row of each slot, -1 when empty
    int* slot_key;    // [IX_CHUNK]: sequence-local key of each slot, -1 when empty
    float* head_m;    // [heads]: forward, per-head running max (owned by one thread each)
    float* head_l;    // [heads]: forward, per-head running sum
    float* slot_val;  // [IX_CHUNK]: backward dz of each slot
    float* acc;       // [max(index_heads, index_dim)]: dw or dki accumulators
    float* merge;     // [6][IX_CHUNK]: forward, per-slot-thread statistics to merge
};

SK_DEVICE IxShared ix_shared(const IndexerParams& p, float* smem) {
    IxShared s;
    s.scores = smem;
    s.dots = s.scores + p.heads * IX_PITCH;
    s.slot_row = reinterpret_cast<int*>(s.dots + p.index_heads * IX_PITCH);
    s.slot_key = s.slot_row + IX_CHUNK;
    s.head_m = reinterpret_cast<float*>(s.slot_key + IX_CHUNK);
    s.head_l = s.head_m + p.heads;
    s.slot_val = s.head_l + p.heads;
    s.acc = s.slot_val + IX_CHUNK;
    const int acc_size = p.index_heads > p.index_dim ? p.index_heads : p.index_dim;
    s.merge = s.acc + acc_size;
    return s;
}

// Is key j allowed for row i (both sequence-local) by bounds and causality (bottom-right aligned)?
SK_DEVICE bool ix_key_allowed(const IndexerParams& p, const IxSpan& span, int i, int j) {
    if (j < 0 || j >= span.len_k || i < 0 || i >= span.len_q) return false;
    return !p.causal || j <= i + span.len_k - span.len_q;
}

// Number of slot positions a row walks: its causal key range (dense) or its K selections (top-k).
SK_DEVICE int ix_row_positions(const IndexerParams& p, const IxSpan& span, int i) {
    if (p.topk_count > 0) return p.topk_count;
    if (!p.causal) return span.len_k;
    const int end = i + span.len_k - span.len_q + 1;
    return end < 0 ? 0 : (end > span.len_k ? span.len_k : end);
}

// Slots [c0, c0 + IX_CHUNK) of row i: dense keys in order, or the row's top-k selections, each
// allowed key counted at its first occurrence only (repeated indices count once).
SK_DEVICE void ix_row_slots(const IndexerParams& p, const IxShared& s, int seq, const IxSpan& span, int i, int c0,
                            int positions) {
    const int c = threadIdx.x;
    if (c >= IX_CHUNK) return;
    const int position = c0 + c;
    int key = -1;
    if (position < positions) {
        if (p.topk_count == 0) {
            key = position;
        } else {
            const int* row = reinterpret_cast<const int*>(p.topk) + seq * p.topk_b +
                             (long long)(span.q_start + i) * p.topk_n;
            const int j = row[position * p.topk_s];
            if (ix_key_allowed(p, span, i, j)) {
                key = j;
                for (int earlier = 0; earlier < position; ++earlier)
                    if (row[earlier * p.topk_s] == j) {
                        key = -1;
                        break;
                    }
            }
        }
    }
    s.slot_row[c] = key >= 0 ? i : -1;
    s.slot_key[c] = key;
}

// scores[h][c] = scale * <q_h[row_c], k_g(h)[key_c]> (-inf on an empty slot) when `teacher`;
// dots[t][c] = <qi_t[row_c], ki[key_c]> (0 on an empty slot) when `indexer`.
SK_DEVICE void ix_chunk_products(const IndexerParams& p, const IxShared& s, int seq, const IxSpan& span,
                                 bool teacher, bool indexer) {
    const float neg_inf = -ix_inf();
    if (teacher) {
        const int items = p.heads * IX_CHUNK;
        for (int item = threadIdx.x; item < items; item += IX_THREADS) {
            const int h = item / IX_CHUNK;
            const int c = item - h * IX_CHUNK;
            float value = neg_inf;
            const int i = s.slot_row[c];
            if (i >= 0) {
                const input_t* qrow = reinterpret_cast<const input_t*>(p.q) + seq * p.q_b +
                                      (long long)(span.q_start + i) * p.q_n + h * p.q_h;
                const input_t* krow = reinterpret_cast<const input_t*>(p.k) + seq * p.k_b +
                                      (long long)(span.k_start + s.slot_key[c]) * p.k_n + (h / p.group) * p.k_h;
                float dot = 0.0f;
                for (int d = 0; d < p.dim; ++d) dot += to_float(qrow[d]) * to_float(krow[d]);
                value = p.scale * dot;
            }
            s.scores[h * IX_PITCH + c] = value;
        }
    }
    if (indexer) {
        const int items = p.index_heads * IX_CHUNK;
        for (int item = threadIdx.x; item < items; item += IX_THREADS) {
            const int t = item / IX_CHUNK;
            const int c = item - t * IX_CHUNK;
            float dot = 0.0f;
            const int i = s.slot_row[c];
            if (i >= 0) {
                const input_t* qirow = reinterpret_cast<const input_t*>(p.qi) + seq * p.qi_b +
                                       (long long)(span.q_start + i) * p.qi_n + t * p.qi_h;
                const input_t* kirow = reinterpret_cast<const input_t*>(p.ki) + seq * p.ki_b +
                                       (long long)(span.k_start + s.slot_key[c]) * p.ki_n;
                for (int d = 0; d < p.index_dim; ++d) dot += to_float(qirow[d]) * to_float(kirow[d]);
            }
            s.dots[t * IX_PITCH + c] = dot;
        }
    }
}

// scores[h][c] <- exp(scores[h][c] - head_lse[row_c][h]): each head's probability of the slot
SK_DEVICE void ix_chunk_probabilities(const IndexerParams& p, const IxShared& s, int seq, const IxSpan& span) {
    const float* head_lse = reinterpret_cast<const float*>(p.head_lse) + seq * p.lse_b;
    const int items = p.heads * IX_CHUNK;
    for (int item = threadIdx.x; item < items; item += IX_THREADS) {
        const int h = item / IX_CHUNK;
        const int c = item - h * IX_CHUNK;
        const int i = s.slot_row[c];
        float prob = 0.0f;
        if (i >= 0) prob = expf(s.scores[h * IX_PITCH + c] - head_lse[h * p.lse_h + (long long)(span.q_start + i) * p.lse_n]);
        s.scores[h * IX_PITCH + c] = prob;
    }
}

// Slot c's teacher probability T (the heads' mean) and indexer logit z = sum_t w_t relu(dot_t)
SK_DEVICE void ix_slot_values(const IndexerParams& p, const IxShared& s, int seq, const IxSpan& span, int c,
                              float& teacher, float& logit) {
    float sum = 0.0f;
    for (int h = 0; h < p.heads; ++h) sum += s.scores[h * IX_PITCH + c];
    teacher = sum / (float)p.heads;
    const input_t* wrow = reinterpret_cast<const input_t*>(p.w) + seq * p.w_b +
                          (long long)(span.q_start + s.slot_row[c]) * p.w_n;
    float z = 0.0f;
    for (int t = 0; t < p.index_heads; ++t) {
        const float dot = s.dots[t * IX_PITCH + c];
        z += to_float(wrow[t * p.w_h]) * (dot < 0.0f ? 0.0f : dot);  // relu keeps NaN, as torch does
    }
    logit = z;
}

// dz = g * (exp(z - index_lse) - T) of slot c, 0 on an empty slot
SK_DEVICE float ix_slot_dz(const IndexerParams& p, const IxShared& s, int seq, const IxSpan& span, int c) {
    const int i = s.slot_row[c];
    if (i < 0) return 0.0f;
    float teacher, logit;
    ix_slot_values(p, s, seq, span, c, teacher, logit);
    const long long token = span.q_start + i;
    const float index_lse = reinterpret_cast<const float*>(p.index_lse)[seq * p.ilse_b + token * p.ilse_n];
    const float g = reinterpret_cast<const float*>(p.grad_rows)[seq * p.grad_b + token * p.grad_n];
    return g * (expf(logit - index_lse) - teacher);
}

// ================================================================================== forward
// grid (rows, sequences). Pass 1 (unless the teacher's lse is given): each head's online max and
// sum over the row's slots, one thread per head, written to head_lse. Pass 2: per slot thread, the
// online lse of z (m, l) and a = sum T log T, b = sum T (z - m), sum T; merged over the slot
// threads at the end: loss = a - b + log(l) * sum T (the max m cancels exactly).
extern "C" __global__ void __launch_bounds__(IX_THREADS) indexer_forward(const IndexerParams p) {
    SK_DYNAMIC_SMEM(smem);
    const int seq = blockIdx.y;
    const int i = blockIdx.x;
    const IxSpan span = ix_span(p, seq);
    if (i >= span.len_q) return;
    const IxShared s = ix_shared(p, smem);
    const float neg_inf = -ix_inf();
    const long long token = span.q_start + i;
    const int positions = ix_row_positions(p, span, i);

    if (!p.lse_given) {
        for (int h = threadIdx.x; h < p.heads; h += IX_THREADS) {
            s.head_m[h] = neg_inf;
            s.head_l[h] = 0.0f;
        }
        for (int c0 = 0; c0 < positions; c0 += IX_CHUNK) {
            __syncthreads();  // the previous chunk is consumed
            ix_row_slots(p, s, seq, span, i, c0, positions);
            __syncthreads();
            ix_chunk_products(p, s, seq, span, true, false);
            __syncthreads();
            for (int h = threadIdx.x; h < p.heads; h += IX_THREADS) {
                const float* row = s.scores + h * IX_PITCH;
                float chunk_max = neg_inf;
                for (int c = 0; c < IX_CHUNK; ++c) chunk_max = fmaxf(chunk_max, row[c]);
                const float m_new = fmaxf(s.head_m[h], chunk_max);
                const float shift = m_new == neg_inf ? 0.0f : m_new;  // no inf - inf before any key
                float sum = 0.0f;
                for (int c = 0; c < IX_CHUNK; ++c) sum += expf(row[c] - shift);
                s.head_l[h] = s.head_l[h] * expf(s.head_m[h] - shift) + sum;
                s.head_m[h] = m_new;
            }
        }
        float* head_lse = reinterpret_cast<float*>(p.head_lse) + seq * p.lse_b + token * p.lse_n;
        for (int h = threadIdx.x; h < p.heads; h += IX_THREADS)
            head_lse[h * p.lse_h] = s.head_m[h] + logf(s.head_l[h]);  // -inf + log 0 = -inf: empty row
        __syncthreads();  // head_lse is read back by every thread below
    }

    float m = neg_inf, l = 0.0f, a = 0.0f, b = 0.0f, mass = 0.0f;
    bool seen = false;
    for (int c0 = 0; c0 < positions; c0 += IX_CHUNK) {
        __syncthreads();
        ix_row_slots(p, s, seq, span, i, c0, positions);
        __syncthreads();
        ix_chunk_products(p, s, seq, span, true, true);
        __syncthreads();
        ix_chunk_probabilities(p, s, seq, span);
        __syncthreads();
        const int c = threadIdx.x;
        if (c < IX_CHUNK && s.slot_row[c] >= 0) {
            float teacher, z;
            ix_slot_values(p, s, seq, span, c, teacher, z);
            seen = true;
            const float m_new = fmaxf(m, z);
            if (m != neg_inf) {  // rescale to the new max; nothing to rescale before the first key
                l *= expf(m - m_new);
                b += mass * (m - m_new);
            }
            l += expf(z - m_new);
            b += teacher * (z - m_new);
            a += teacher == 0.0f ? 0.0f : teacher * logf(teacher);  // 0 log 0 = 0; NaN stays NaN
            mass += teacher;
            m = m_new;
        }
    }

    __syncthreads();
    const int c = threadIdx.x;
    if (c < IX_CHUNK) {
        s.merge[0 * IX_CHUNK + c] = m;
        s.merge[1 * IX_CHUNK + c] = l;
        s.merge[2 * IX_CHUNK + c] = a;
        s.merge[3 * IX_CHUNK + c] = b;
        s.merge[4 * IX_CHUNK + c] = mass;
        s.merge[5 * IX_CHUNK + c] = seen ? 1.0f : 0.0f;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    float row_max = neg_inf;
    bool any = false;
    for (int q = 0; q < IX_CHUNK; ++q) {
        row_max = fmaxf(row_max, s.merge[0 * IX_CHUNK + q]);
        any = any || s.merge[5 * IX_CHUNK + q] != 0.0f;
    }
    float total_l = 0.0f, total_a = 0.0f, total_b = 0.0f, total_mass = 0.0f;
    for (int q = 0; q < IX_CHUNK; ++q) {
        if (s.merge[5 * IX_CHUNK + q] == 0.0f) continue;
        const float mq = s.merge[0 * IX_CHUNK + q];
        const float mass_q = s.merge[4 * IX_CHUNK + q];
        total_l += s.merge[1 * IX_CHUNK + q] * expf(mq - row_max);
        total_b += s.merge[3 * IX_CHUNK + q] + mass_q * (mq - row_max);
        total_a += s.merge[2 * IX_CHUNK + q];
        total_mass += mass_q;
    }
    const float log_l = logf(total_l);
    float* loss = reinterpret_cast<float*>(p.loss) + seq * p.loss_b + token * p.loss_n;
    float* index_lse = reinterpret_cast<float*>(p.index_lse) + seq * p.ilse_b + token * p.ilse_n;
    *loss = any ? total_a - total_b + log_l * total_mass : 0.0f;
    *index_lse = any ? row_max + log_l : neg_inf;
}

// ================================================================================== backward
// grid (rows, sequences): dqi and dw of one row, owned by its block. Per chunk: dz of each slot,
// dw_t += sum_c dz_c relu(dot_tc), dqi_t += w_t sum_c dz_c [dot_tc > 0] ki[key_c].
extern "C" __global__ void __launch_bounds__(IX_THREADS) indexer_backward_row(const IndexerParams p) {
    SK_DYNAMIC_SMEM(smem);
    const int seq = blockIdx.y;
    const int i = blockIdx.x;
    const IxSpan span = ix_span(p, seq);
    if (i >= span.len_q) return;
    const IxShared s = ix_shared(p, smem);
    const long long token = span.q_start + i;
    const int positions = ix_row_positions(p, span, i);
    float* dqi = reinterpret_cast<float*>(p.dqi) + seq * p.dqi_b + token * p.dqi_n;
    const int items = p.index_heads * p.index_dim;
    // each (t, d) item and each dw_t has one owner thread across the whole kernel: no races
    for (int item = threadIdx.x; item < items; item += IX_THREADS) {
        const int t = item / p.index_dim;
        dqi[t * p.dqi_h + (item - t * p.index_dim)] = 0.0f;
    }
    for (int t = threadIdx.x; t < p.index_heads; t += IX_THREADS) s.acc[t] = 0.0f;

    for (int c0 = 0; c0 < positions; c0 += IX_CHUNK) {
        __syncthreads();
        ix_row_slots(p, s, seq, span, i, c0, positions);
        __syncthreads();
        ix_chunk_products(p, s, seq, span, true, true);
        __syncthreads();
        ix_chunk_probabilities(p, s, seq, span);
        __syncthreads();
        if (threadIdx.x < IX_CHUNK) s.slot_val[threadIdx.x] = ix_slot_dz(p, s, seq, span, threadIdx.x);
        __syncthreads();
        for (int t = threadIdx.x; t < p.index_heads; t += IX_THREADS) {
            float sum = 0.0f;
            for (int c = 0; c < IX_CHUNK; ++c) {
                if (s.slot_row[c] < 0) continue;
                const float dot = s.dots[t * IX_PITCH + c];
                sum += s.slot_val[c] * (dot < 0.0f ? 0.0f : dot);
            }
            s.acc[t] += sum;
        }
        for (int item = threadIdx.x; item < items; item += IX_THREADS) {
            const int t = item / p.index_dim;
            const int d = item - t * p.index_dim;
            float sum = 0.0f;
            for (int c = 0; c < IX_CHUNK; ++c) {
                if (s.slot_row[c] < 0 || !(s.dots[t * IX_PITCH + c] > 0.0f)) continue;
                const input_t* kirow = reinterpret_cast<const input_t*>(p.ki) + seq * p.ki_b +
                                       (long long)(span.k_start + s.slot_key[c]) * p.ki_n;
                sum += s.slot_val[c] * to_float(kirow[d]);
            }
            dqi[t * p.dqi_h + d] += sum;
        }
    }

    const input_t* wrow = reinterpret_cast<const input_t*>(p.w) + seq * p.w_b + token * p.w_n;
    float* dw = reinterpret_cast<float*>(p.dw) + seq * p.dw_b + token * p.dw_n;
    for (int t = threadIdx.x; t < p.index_heads; t += IX_THREADS) dw[t * p.dw_h] = s.acc[t];
    for (int item = threadIdx.x; item < items; item += IX_THREADS) {
        const int t = item / p.index_dim;
        dqi[t * p.dqi_h + (item - t * p.index_dim)] *= to_float(wrow[t * p.w_h]);
    }
}

// grid (keys, sequences): dki of one key, owned by its block. The slots are the rows that see the
// key: a range (dense) or the key's list of selecting rows (top-k, sorted: a repeated row is
// adjacent and counted once). dki += sum_c sum_t dz_c w_t[row_c] [dot_tc > 0] qi_t[row_c].
extern "C" __global__ void __launch_bounds__(IX_THREADS) indexer_backward_key(const IndexerParams p) {
    SK_DYNAMIC_SMEM(smem);
    const int seq = blockIdx.y;
    const int j = blockIdx.x;
    const IxSpan span = ix_span(p, seq);
    if (j >= span.len_k) return;
    const IxShared s = ix_shared(p, smem);
    int first = 0, count = 0;  // positions: rows first.. (dense) or list entries first.. (top-k)
    const int* rows = reinterpret_cast<const int*>(p.key_rows);
    if (p.topk_count > 0) {
        const long long key_id = p.varlen ? (long long)span.k_start + j : (long long)seq * p.seqlen_k + j;
        first = reinterpret_cast<const int*>(p.key_offsets)[key_id];
        count = reinterpret_cast<const int*>(p.key_offsets)[key_id + 1] - first;
    } else {
        first = p.causal ? j - (span.len_k - span.len_q) : 0;
        if (first < 0) first = 0;
        count = span.len_q > first ? span.len_q - first : 0;
    }
    for (int d = threadIdx.x; d < p.index_dim; d += IX_THREADS) s.acc[d] = 0.0f;

    for (int c0 = 0; c0 < count; c0 += IX_CHUNK) {
        __syncthreads();
        if (threadIdx.x < IX_CHUNK) {
            const int position = c0 + threadIdx.x;
            int row = -1;
            if (position < count) {
                if (p.topk_count > 0) {
                    row = rows[first + position];
                    if (position > 0 && rows[first + position - 1] == row) row = -1;
                } else {
                    row = first + position;
                }
                if (row >= 0 && !ix_key_allowed(p, span, row, j)) row = -1;
            }
            s.slot_row[threadIdx.x] = row;
            s.slot_key[threadIdx.x] = row >= 0 ? j : -1;
        }
        __syncthreads();
        ix_chunk_products(p, s, seq, span, true, true);
        __syncthreads();
        ix_chunk_probabilities(p, s, seq, span);
        __syncthreads();
        if (threadIdx.x < IX_CHUNK) s.slot_val[threadIdx.x] = ix_slot_dz(p, s, seq, span, threadIdx.x);
        __syncthreads();
        const int items = p.index_heads * IX_CHUNK;
        for (int item = threadIdx.x; item < items; item += IX_THREADS) {  // dots -> dz w [dot > 0]
            const int t = item / IX_CHUNK;
            const int c = item - t * IX_CHUNK;
            const int row = s.slot_row[c];
            float coefficient = 0.0f;
            if (row >= 0 && s.dots[t * IX_PITCH + c] > 0.0f) {
                const input_t* wrow = reinterpret_cast<const input_t*>(p.w) + seq * p.w_b +
                                      (long long)(span.q_start + row) * p.w_n;
                coefficient = s.slot_val[c] * to_float(wrow[t * p.w_h]);
            }
            s.dots[t * IX_PITCH + c] = coefficient;
        }
        __syncthreads();
        for (int d = threadIdx.x; d < p.index_dim; d += IX_THREADS) {
            float sum = 0.0f;
            for (int c = 0; c < IX_CHUNK; ++c) {
                const int row = s.slot_row[c];
                if (row < 0) continue;
                const input_t* qirow = reinterpret_cast<const input_t*>(p.qi) + seq * p.qi_b +
                                       (long long)(span.q_start + row) * p.qi_n;
                for (int t = 0; t < p.index_heads; ++t) {
                    const float coefficient = s.dots[t * IX_PITCH + c];
                    if (coefficient != 0.0f) sum += coefficient * to_float(qirow[t * p.qi_h + d]);
                }
            }
            s.acc[d] += sum;
        }
    }
    float* dki = reinterpret_cast<float*>(p.dki) + seq * p.dki_b + (long long)(span.k_start + j) * p.dki_n;
    for (int d = threadIdx.x; d < p.index_dim; d += IX_THREADS) dki[d] = s.acc[d];
}
