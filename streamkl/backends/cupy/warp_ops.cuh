// Warp-level primitives of the tensor-core kernels: ldmatrix, mma.sync m16n8k16 (float32
// accumulation), float32 -> half pair conversion (cvt.rn), cp.async with commit / wait groups, a
// butterfly shuffle, and exp2 flushing subnormal results to zero (ex2.approx.ftz).
//
// On the GPU each is one PTX instruction. Under the host emulator (STREAMKL_EMULATE) each is an
// exact model of the PTX ISA's fragment layouts: every lane deposits its operands in a per-warp
// scratch, the warp meets at a barrier, and every lane reads what the hardware would hand it. The
// kernels call only these functions, so the emulator checks their fragment bookkeeping on the CPU.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" and "ldmatrix"), with
// g = lane / 4 and c = lane % 4; a 32-bit register holds two 16-bit elements, the lower column
// (or row, for B) in the low half:
//   A 16x16 (row major): a0 (g, 2c..2c+1), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)
//   B 16x8  (column):    b0 (rows 2c..2c+1, col g), b1 (rows 2c+8..2c+9, col g)
//   C 16x8  (float32):   c0, c1 (g, 2c..2c+1), c2, c3 (g+8, 2c..2c+1)
//   ldmatrix m8n8 (x1, x2, x4): lanes 8i..8i+7 give the row addresses of matrix i; register i
//   of lane t holds row t/4, columns 2(t%4)..2(t%4)+1 of matrix i (.trans: the transpose).
#pragma once

#ifdef STREAMKL_EMULATE
// ------------------------------------------------------------------------------------ emulated
SK_DEVICE int sk_lane() { return (int)(threadIdx.x % 32u); }

SK_DEVICE unsigned sk_pack(unsigned short low, unsigned short high) { return (unsigned)low | ((unsigned)high << 16); }

SK_DEVICE unsigned short sk_half_of(unsigned word, int which) { return (unsigned short)(which ? word >> 16 : word); }

// one deposit of a value per lane, then every lane reads the others' through `slot`
SK_DEVICE sk_u64* sk_exchange() { return emu_warp_scratch(); }

// a shared-memory operand of ldmatrix / cp.async: here the host address (on the GPU, 32 bits of
// the shared window)
typedef size_t sk_smem;
SK_DEVICE sk_smem sk_shared_address(const void* pointer) { return (size_t)pointer; }

template <int MATRICES, bool TRANS>
SK_DEVICE void sk_ldmatrix(unsigned* regs, sk_smem row_address) {
    sk_u64* slot = sk_exchange();
    const int lane = sk_lane();
    slot[lane * EMU_SCRATCH_SLOTS] = (sk_u64)row_address;
    emu_warp_sync();
    const int g = lane / 4, c = lane % 4;
    for (int m = 0; m < MATRICES; ++m) {
        if (!TRANS) {
            const unsigned short* row = (const unsigned short*)(size_t)slot[(m * 8 + g) * EMU_SCRATCH_SLOTS];
            regs[m] = sk_pack(row[2 * c], row[2 * c + 1]);
        } else {
            const unsigned short* row0 = (const unsigned short*)(size_t)slot[(m * 8 + 2 * c) * EMU_SCRATCH_SLOTS];
            const unsigned short* row1 = (const unsigned short*)(size_t)slot[(m * 8 + 2 * c + 1) * EMU_SCRATCH_SLOTS];
            regs[m] = sk_pack(row0[g], row1[g]);
        }
    }
    emu_warp_sync();
}

SK_DEVICE void sk_ldmatrix_x4(unsigned (&regs)[4], sk_smem row_address) { sk_ldmatrix<4, false>(regs, row_address); }
SK_DEVICE void sk_ldmatrix_x2(unsigned (&regs)[2], sk_smem row_address) { sk_ldmatrix<2, false>(regs, row_address); }
SK_DEVICE void sk_ldmatrix_x4_trans(unsigned (&regs)[4], sk_smem row_address) {
    sk_ldmatrix<4, true>(regs, row_address);
}
SK_DEVICE void sk_ldmatrix_x2_trans(unsigned (&regs)[2], sk_smem row_address) {
    sk_ldmatrix<2, true>(regs, row_address);
}

// d += A B for one 16x16 A and one 16x8 B fragment (input_t elements, float32 products and sums)
SK_DEVICE void sk_mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    sk_u64* slot = sk_exchange();
    const int lane = sk_lane();
    for (int r = 0; r < 4; ++r) slot[lane * EMU_SCRATCH_SLOTS + r] = a[r];
    for (int r = 0; r < 2; ++r) slot[lane * EMU_SCRATCH_SLOTS + 4 + r] = b[r];
    emu_warp_sync();
    const int g = lane / 4, c = lane % 4;
    float result[4];
    for (int idx = 0; idx < 4; ++idx) {
        const int row = g + 8 * (idx / 2), col = 2 * c + (idx % 2);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) {
            const int k_lane = (k % 8) / 2, half = k % 2, k_high = k / 8;
            const unsigned a_word = (unsigned)slot[((row % 8) * 4 + k_lane) * EMU_SCRATCH_SLOTS + (row / 8) + 2 * k_high];
            const unsigned b_word = (unsigned)slot[(col * 4 + k_lane) * EMU_SCRATCH_SLOTS + 4 + k_high];
            sum += to_float(sk_half_of(a_word, half)) * to_float(sk_half_of(b_word, half));
        }
        result[idx] = sum;
    }
    emu_warp_sync();
    for (int idx = 0; idx < 4; ++idx) d[idx] += result[idx];
}

// float32 -> float16 / bfloat16 bits, round to nearest even (what cvt.rn does)
SK_DEVICE unsigned short sk_round_to_input(float value) {
    unsigned bits;
    std::memcpy(&bits, &value, sizeof bits);
    const unsigned sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (unsigned short)(sign | 0x7fffu);  // NaN
#if STREAMKL_INPUT == 1
    if (magnitude >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // 65520 and up round to inf
    if (magnitude < 0x38800000u)  // below 2^-14: a subnormal half, a multiple of 2^-24 (rintf: ties to even)
        return (unsigned short)(sign | (unsigned)rintf(std::fabs(value) * 16777216.0f));
    return (unsigned short)(sign | ((magnitude + 0xfffu + ((magnitude >> 13) & 1u) - 0x38000000u) >> 13));
#else
    return (unsigned short)(sign | ((magnitude + 0x7fffu + ((magnitude >> 16) & 1u)) >> 16));
#endif
}

// two floats rounded to input_t and packed into one register, `low` in the low half
SK_DEVICE unsigned sk_pack_floats(float low, float high) {
    return sk_pack(sk_round_to_input(low), sk_round_to_input(high));
}

// 16 bytes global -> shared, the bytes past `src_bytes` (0 or 16) zero-filled, visible after the
// wait that retires its group (the emulator defers the copy until then, as the hardware may)
SK_DEVICE void sk_cp_async_16(sk_smem dst, const void* src, int src_bytes) {
    emu_cp_async(reinterpret_cast<void*>(dst), src, 16, src_bytes);
}
SK_DEVICE void sk_cp_async_commit() { emu_cp_async_commit(); }
template <int PENDING>
SK_DEVICE void sk_cp_async_wait() {
    emu_cp_async_wait(PENDING);
}

// 2^x with results below 2^-126 flushed to zero (the single instruction ex2.approx.ftz)
SK_DEVICE float sk_exp2(float x) {
    const float result = exp2f(x);
    return result < 1.17549435e-38f ? 0.0f : result;
}

SK_DEVICE float sk_shfl_xor(float value, int mask) {
    sk_u64* slot = sk_exchange();
    const int lane = sk_lane();
    unsigned bits;
    std::memcpy(&bits, &value, sizeof bits);
    slot[lane * EMU_SCRATCH_SLOTS] = bits;
    emu_warp_sync();
    const unsigned other = (unsigned)slot[(lane ^ mask) * EMU_SCRATCH_SLOTS];
    emu_warp_sync();
    return __uint_as_float(other);
}

#else
// ------------------------------------------------------------------------------------ PTX
// A shared-memory operand of ldmatrix / cp.async: its byte address in the shared window, 32 bits.
// Callers convert a tile's pointer once and offset the address in 32-bit arithmetic: NVRTC (unlike
// nvcc) gives shared pointers 64 bits, so addresses derived from pointers cost two registers each
// and an add + cvt per use (docs/cupy.md, "Registers: NVRTC and nvcc").
typedef unsigned sk_smem;
SK_DEVICE sk_smem sk_shared_address(const void* pointer) { return (sk_smem)__cvta_generic_to_shared(pointer); }

SK_DEVICE void sk_ldmatrix_x4(unsigned (&regs)[4], sk_smem row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(row_address));
}

SK_DEVICE void sk_ldmatrix_x2(unsigned (&regs)[2], sk_smem row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(regs[0]), "=r"(regs[1])
                 : "r"(row_address));
}

SK_DEVICE void sk_ldmatrix_x4_trans(unsigned (&regs)[4], sk_smem row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(row_address));
}

SK_DEVICE void sk_ldmatrix_x2_trans(unsigned (&regs)[2], sk_smem row_address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(regs[0]), "=r"(regs[1])
                 : "r"(row_address));
}

#if STREAMKL_INPUT == 1
#define SK_MMA_TYPES "f32.f16.f16.f32"
#else
#define SK_MMA_TYPES "f32.bf16.bf16.f32"
#endif

SK_DEVICE void sk_mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col." SK_MMA_TYPES
                 " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// two floats rounded to input_t (nearest even) and packed into one register, `low` in the low half
SK_DEVICE unsigned sk_pack_floats(float low, float high) {
    unsigned packed;
#if STREAMKL_INPUT == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(high), "f"(low));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(high), "f"(low));
#endif
    return packed;
}

SK_DEVICE void sk_cp_async_16(sk_smem dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

SK_DEVICE void sk_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
SK_DEVICE void sk_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

SK_DEVICE float sk_shfl_xor(float value, int mask) { return __shfl_xor_sync(0xffffffffu, value, mask); }

// 2^x with results below 2^-126 flushed to zero: one MUFU.EX2 (exp2f adds subnormal fix-ups)
SK_DEVICE float sk_exp2(float x) {
    float result;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(result) : "f"(x));
    return result;
}
#endif

// the shared address `elements` input_t elements past `address`
SK_DEVICE sk_smem sk_advance(sk_smem address, int elements) {
    return address + (sk_smem)(elements * (int)sizeof(input_t));
}
