// Linear layers on GGUF block-quantized weights, exact: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of
// 32 weights along K) and the K-quants Q4_K, Q5_K (super-blocks of 256: 8 sub-blocks of 32, each
// with a 6-bit scale and min) and Q6_K (256: 16 sub-blocks of 16, each with an int8 scale).
//
// The weights stay in the file's blocks (a quarter to a half of the float32 bytes a one-row step
// must read) and are dequantized in registers inside the matrix product, as gguf's numpy
// dequantize computes them (float32, one rounding per operation, in its order):
//   Q4_0  w = d * (q - 8)                  q in 0..15
//   Q4_1  w = d * q + m                    q in 0..15
//   Q5_0  w = d * (q - 16)                 q in 0..31
//   Q5_1  w = d * q + m                    q in 0..31
//   Q8_0  w = d * q                        q in -128..127
//   Q4_K  w = (d * sc) * q - (dmin * mn)   q in 0..15, sc and mn in 0..63 per 32 weights
//   Q5_K  w = (d * sc) * q - (dmin * mn)   q in 0..31
//   Q6_K  w = (d * sc) * (q - 32)          q in 0..63, sc in -128..127 per 16 weights
//   MXFP4 w = d * v[q]                     q in 0..15, v the doubled E2M1 values (0, 1, 2, 3,
//                                          4, 6, 8, 12 and their negatives), d = 2^(e - 128)
// with d, m and dmin float16 (MXFP4's d from its E8M0 byte e: exact, a power of two). Every product there is exact in float32: d has an 11-bit
// significand (a float16 subnormal too), d * sc at most 18 bits, times q at most 23. So the only
// rounding is the final add (Q4_1, Q5_1) or subtraction (Q4_K, Q5_K), and one FMA (FMS) gives
// gguf's two-step value. Each w is thus the very float32 a dequantized copy holds, and the
// product then runs the float32 micro-kernel's operations in its order (y[m, n] accumulates
// x[m, k] * w[n, k] for k = 0..K-1, one FMA a step, in simd.h's chains of KB k's, folded at
// the end of the sub-block that ends one): the outputs are the same bits as
// ps_linear's on the dequantized weight, for any row count (row-invariant, as invariant.cpp).
// Up to MR_MAX rows dequantize in registers; more rows dequantize each panel once into a
// thread's buffer and run the float32 micro-kernel over it (the same values, the same order).
// One row (a decode step of one stream) walks two panels at once (qmicro_row): each output's
// operations are unchanged, but the two panels' accumulation chains overlap their FMA latency,
// which is what bounds a one-row product (docs/benchmarks.md: 1.2-1.5x, the same bits).
//
// The packed layout (kernels/qlayout.py `pack_blocks`): panels of NR output columns; in a panel,
// for each block of QK along K: the float16 fields of the NR columns (d[NR], then m[NR] for Q4_1
// and Q5_1 or dmin[NR] for Q4_K and Q5_K), the K-quants' scale bytes as the file holds them
// (byte i of column c at i * NR + c: Q4_K/Q5_K's 12 packed bytes, Q6_K's 16 int8), then the QK
// rows of NR quants, one row per k: Q8 one int8 a column; otherwise the low 4 bits two columns a
// byte (byte j holds column j in its low nibble and column j + W in its high one). The 5- and
// 6-bit formats' quants sit in int32 lanes instead: per sub-block (32 k's; Q6_K's 16) and per
// half of the panel, `words` vectors of W lanes (5, or Q6_K's 3), column c's quants side by side
// in the bits of its lanes (k j at bit 5 j or 6 j), so a k's quant is a shift and a mask of a
// vector (two, or-ed, where it straddles two lanes): fewer operations than joining a row of
// nibbles and a row of high bits (one-row products 1.27-1.37x, docs/benchmarks.md). A panel is
// then the file's bytes for its columns, moved. Padded columns are zeros (d = 0).
#include <cstring>
#include <memory>

#include "probserve.h"
#include "simd.h"

namespace {

enum Format : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, MXFP4 = 8 };

// MXFP4's E2M1 values, doubled (ggml's kvalues: the block's scale is 2^(e - 128), half of E8M0's)
constexpr float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <int F>
struct Layout {
    static constexpr bool kmin = F == Q4_K || F == Q5_K;           // w = (d sc) q - dmin mn
    static constexpr bool kquant = kmin || F == Q6_K;
    static constexpr bool plus_m = F == Q4_1 || F == Q5_1;         // w = d q + m
    static constexpr int64_t QK = kquant ? 256 : 32;               // weights per block along K
    static constexpr int64_t SUB = F == Q6_K ? 16 : 32;            // weights per scale
    static constexpr int bits = F == Q8_0 ? 8 : F == Q6_K ? 6 : (F == Q5_0 || F == Q5_1 || F == Q5_K) ? 5 : 4;
    static constexpr int offset = F == Q4_0 ? -8 : F == Q5_0 ? -16 : F == Q6_K ? -32 : 0;
    static constexpr bool table = F == MXFP4;                       // quants through MXFP4_VALUES
    static constexpr int64_t halves = table ? 0 : (plus_m || kmin) ? 2 : 1;  // float16 fields
    static constexpr int64_t scale_bytes = F == Q6_K ? 16 : kmin ? 12 : table ? 1 : 0;  // a column's
    static constexpr bool lanes = bits == 5 || bits == 6;           // quants in int32 lanes
    static constexpr int G = lanes ? SUB : 1;                       // k's a group
    static constexpr int64_t words = lanes ? SUB * bits / 32 : 0;   // a column's int32 lanes
    static constexpr int64_t group = bits == 8 ? NR : lanes ? words * 4 * NR : NR / 2;  // its bytes
    static constexpr int64_t row = group / G;                       // a k's bytes, on average
    static constexpr int64_t head = (halves * 2 + scale_bytes) * NR;
    static constexpr int64_t block = head + QK * row;
    static_assert(SUB % G == 0 && group % G == 0, "a sub-block is whole groups");
};

// the scale s and offset o of sub-block j of a block, columns [0, W) in s0/o0 and [W, NR) in
// s1/o1, as gguf computes them: Q4_0/Q5_0/Q8_0 s = d; Q4_1/Q5_1 s = d, o = m; Q4_K/Q5_K s =
// d * sc, o = dmin * mn (get_scale_min_k4's 6-bit values); Q6_K s = d * sc; and for the formats
// with an offset (Q4_0, Q5_0, Q6_K) o = offset * s, for dequant's FMA. Products exact.
template <int F>
inline void sub_scales(const uint8_t* blk, int64_t j, vf& s0, vf& s1, vf& o0, vf& o1) {
    using L = Layout<F>;
    o0 = o1 = vzero();
    if constexpr (L::table) {  // MXFP4: the E8M0 byte of each column, 2^(e - 128)
        (void)j;
        s0 = e8m0_half(vload_u8(blk));
        s1 = e8m0_half(vload_u8(blk + W));
        return;
    }
    const uint16_t* h = reinterpret_cast<const uint16_t*>(blk);
    const vf d0 = vhalf(h), d1 = vhalf(h + W);
    if constexpr (F == Q6_K) {
        const uint8_t* sc = blk + 2 * NR + j * NR;
        s0 = vmul(d0, vcvt(vload_i8(sc)));
        s1 = vmul(d1, vcvt(vload_i8(sc + W)));
    } else if constexpr (L::kmin) {
        const vf n0 = vhalf(h + NR), n1 = vhalf(h + NR + W);
        const uint8_t* b = blk + 4 * NR;  // byte i of column c at b[i * NR + c]
        auto unpack = [&](int64_t c0, vf d, vf dmin, vf& s, vf& o) {
            vi sc, mn;
            if (j < 4) {  // sc = b[j] & 63, mn = b[j + 4] & 63
                sc = vand_i(vload_u8(b + j * NR + c0), 63);
                mn = vand_i(vload_u8(b + (j + 4) * NR + c0), 63);
            } else {  // sc = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4, mn = (b[j + 4] >> 4) | (b[j] >> 6) << 4
                const vi lo = vload_u8(b + (j + 4) * NR + c0);
                sc = vor_i(vand_i(lo, 15), vsll_i<4>(vsrl_i<6>(vload_u8(b + (j - 4) * NR + c0))));
                mn = vor_i(vsrl_i<4>(lo), vsll_i<4>(vsrl_i<6>(vload_u8(b + j * NR + c0))));
            }
            s = vmul(d, vcvt(sc));
            o = vmul(dmin, vcvt(mn));
        };
        unpack(0, d0, n0, s0, o0);
        unpack(W, d1, n1, s1, o1);
    } else {
        s0 = d0;
        s1 = d1;
        if constexpr (L::plus_m) {
            o0 = vhalf(h + NR);
            o1 = vhalf(h + NR + W);
        }
    }
    if constexpr (L::offset != 0) {  // offset s: exact (a power of two), for dequant's FMA
        o0 = vmul(s0, vset1(static_cast<float>(L::offset)));
        o1 = vmul(s1, vset1(static_cast<float>(L::offset)));
    }
}

// the 5- and 6-bit formats' quants of k J of a group (a sub-block), from a half's vectors of
// int32 lanes at p: each lane's B bits at bit B J of the column's lanes, B = 5 or 6 (a shift and
// a mask; an or of two where they straddle two lanes)
template <int F, int J>
inline vi lane_field(const uint8_t* p) {
    constexpr int B = Layout<F>::bits, at = B * J, i = at / 32, o = at % 32, mask = (1 << B) - 1;
    const vi v = vload_i32(p + i * 4 * W);
    if constexpr (o + B > 32) {
        return vor_i(vsrl_i<o>(v), vand_i(vsll_i<32 - o>(vload_i32(p + (i + 1) * 4 * W)), mask));
    } else if constexpr (o == 0) {
        return vand_i(v, mask);
    } else if constexpr (o + B == 32) {
        return vsrl_i<o>(v);
    } else {
        return vand_i(vsrl_i<o>(v), mask);
    }
}

// the NR quants of k J of a group as exact floats, with the format's offset (OFFSET: q - 8,
// q - 16, q - 32, the block sums' values) or as stored (the exact product's: dequant folds the
// offset into its FMA): columns [0, W) in q0, [W, NR) in q1. `nib` is quant_nibbles<F, OFFSET>().
// They are exact small integers.
template <int F, int J, bool OFFSET, class Nib>
inline void quants(const uint8_t* grp, const Nib& nib, vf& q0, vf& q1) {
    using L = Layout<F>;
    if constexpr (F == Q8_0) {
        q0 = vcvt(vload_i8(grp));
        q1 = vcvt(vload_i8(grp + W));
    } else if constexpr (L::lanes) {
        q0 = vcvt(lane_field<F, J>(grp));
        q1 = vcvt(lane_field<F, J>(grp + L::words * 4 * W));
        if constexpr (OFFSET && L::offset != 0) {
            q0 = vadd(q0, vset1(static_cast<float>(L::offset)));
            q1 = vadd(q1, vset1(static_cast<float>(L::offset)));
        }
    } else {
        const vi b = vload_u8(grp);
        q0 = nib.lo(b);
        q1 = nib.hi(b);
    }
}

// the 4-bit formats' nibble decoder, with the offset or without (quants' OFFSET); MXFP4's
// through its table of values
template <int F, bool OFFSET>
inline auto quant_nibbles() {
    if constexpr (Layout<F>::table) {
        return TableNibbles(MXFP4_VALUES);
    } else {
        return Nibbles(OFFSET ? Layout<F>::offset : 0);
    }
}

// the NR weights of k J of a group: columns [0, W) in w0, [W, NR) in w1, each gguf's float32
// value. The quants come as stored (`nib` is quant_nibbles<F, false>()): the offset is folded
// into the one FMA (Q4_0, Q5_0, Q6_K: s q + (offset s), every term exact and so is s (q + offset),
// the one rounding giving that exact value: an integer add a lane less than offsetting q).
template <int F, int J, class Nib>
inline void dequant(const uint8_t* grp, const Nib& nib, vf s0, vf s1, vf o0, vf o1, vf& w0,
                    vf& w1) {
    using L = Layout<F>;
    vf q0, q1;
    quants<F, J, false>(grp, nib, q0, q1);
    if constexpr (L::kmin) {  // (d sc) q exact: one rounding, as numpy's d * q - dm
        w0 = vfms(s0, q0, o0);
        w1 = vfms(s1, q1, o1);
    } else if constexpr (L::plus_m || L::offset != 0) {  // d q exact: one rounding, as d * q + m
        w0 = vfma(s0, q0, o0);
        w1 = vfma(s1, q1, o1);
    } else {
        w0 = vmul(s0, q0);
        w1 = vmul(s1, q1);
    }
}

// every k of one sub-block (its quants from q) in order, a group at a time: body(kk, grp, J)
// with kk the k's index in the sub-block, grp its group (a walk of P panels in lockstep finds
// panel i's at grp + i * apart) and J (std::integral_constant) the k's index in its group
template <int F, class Body>
inline void each_k(const uint8_t* q, Body&& body) {
    using L = Layout<F>;
    for (int64_t g = 0; g < L::SUB / L::G; ++g) {
        const uint8_t* grp = q + g * L::group;
        static_for<L::G>([&](auto J) { body(g * L::G + decltype(J)::value, grp, J); });
    }
}

// a panel's cache lines, requested ahead of use: the one-row product reads a Q4_0 block in
// ~60 ns, faster than a line arrives from memory unasked (prefetching never faults, even past
// the end). The distance is 8 sub-blocks' bytes (8 blocks of the 32-wide formats, as before).
template <int F>
constexpr int64_t PREFETCH_BYTES = 8 * Layout<F>::block * Layout<F>::SUB / Layout<F>::QK;

// every sub-block of one quantized panel in order: body(b, j, q, k0) with b its block, j its
// index in the block, q its first row of quants and k0 its first k; the lines prefetched ahead
template <int F, class Body>
inline void walk_subblocks(const uint8_t* panel, int64_t K, Body&& body) {
    using L = Layout<F>;
    const uint8_t* ahead = panel;  // the lines below it have been requested
    for (int64_t blk = 0; blk < K / L::QK; ++blk) {
        const uint8_t* b = panel + blk * L::block;
        for (int64_t j = 0; j < L::QK / L::SUB; ++j) {
            const uint8_t* q = b + L::head + j * L::SUB * L::row;
            for (const uint8_t* until = q + L::SUB * L::row + PREFETCH_BYTES<F>; ahead < until; ahead += 64)
                _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
            body(b, j, q, blk * L::QK + j * L::SUB);
        }
    }
}

// every k of one quantized panel in order: body(k, w0, w1) with the k's NR weights dequantized
// (columns [0, W) in w0, [W, NR) in w1); then, after each sub-block, ended(k1) with k1 the k
// after it
template <int F, class Body, class Ended>
inline void walk_panel(const uint8_t* panel, int64_t K, Body&& body, Ended&& ended) {
    using L = Layout<F>;
    const auto nib = quant_nibbles<F, false>();
    walk_subblocks<F>(panel, K, [&](const uint8_t* b, int64_t j, const uint8_t* q, int64_t k0) {
        vf s0, s1, o0, o1;
        sub_scales<F>(b, j, s0, s1, o0, o1);
        each_k<F>(q, [&](int64_t kk, const uint8_t* grp, auto J) {
            vf w0, w1;
            dequant<F, decltype(J)::value>(grp, nib, s0, s1, o0, o1, w0, w1);
            body(k0 + kk, w0, w1);
        });
        ended(k0 + L::SUB);
    });
}

// a chain of the sums ends at k1 (simd.h's KB): where micro() folds it
inline bool chain_ends(int64_t k1, int64_t K) { return k1 % KB == 0 || k1 == K; }

// MR rows of x times one quantized panel, dequantizing each k's weights once for all MR rows
// (micro()'s chains and folds: the same bits)
template <int MR, int F>
void qmicro(const float* x, int64_t ldx, const uint8_t* panel, int64_t K, const float* bias,
            float* out, int64_t ldo, int64_t ncols) {
    static_assert(KB % Layout<F>::SUB == 0, "a chain is whole sub-blocks");
    vf a0[MR], a1[MR], t0[MR], t1[MR];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = t0[r] = t1[r] = vzero();
    walk_panel<F>(
        panel, K, [&](int64_t k, vf w0, vf w1) { accumulate<MR>(a0, a1, x, ldx, k, w0, w1); },
        [&](int64_t k1) {
            if (chain_ends(k1, K)) fold<MR>(t0, t1, a0, a1);
        });
    store_tile<MR>(t0, t1, bias, out, ldo, ncols);
}

// one row of x times P quantized panels in lockstep (`apart` bytes from one to the next): each
// output's operations are qmicro<1>'s (k in order, one FMA a step: the same bits), but the P
// panels' 2P accumulation chains are independent, so the FMAs' latency overlaps (alone, a
// panel's two chains wait on each FMA's result: a one-row product is latency-bound)
template <int F, int P>
void qmicro_row(const float* x, const uint8_t* panel, int64_t apart, int64_t K, const float* bias,
                float* out, int64_t ncols_last) {
    using L = Layout<F>;
    const auto nib = quant_nibbles<F, false>();
    vf a0[P], a1[P], t0[P], t1[P];
#pragma GCC unroll 8
    for (int i = 0; i < P; ++i) a0[i] = a1[i] = t0[i] = t1[i] = vzero();
    // the lines below `ahead` (and P - 1 panels on) have been requested; past the panel's end the
    // next P panels' (the group a thread walks next: its groups are contiguous), so a thread's
    // streams run on from group to group instead of starting cold (a 576-wide panel is ~6 KB)
    const uint8_t* ahead = panel;
    for (int64_t blk = 0; blk < K / L::QK; ++blk) {
        const uint8_t* bk = panel + blk * L::block;
        for (int64_t j = 0; j < L::QK / L::SUB; ++j) {
            const uint8_t* q = bk + L::head + j * L::SUB * L::row;
            for (const uint8_t* until = q + L::SUB * L::row + PREFETCH_BYTES<F>; ahead < until; ahead += 64) {
                const int64_t next = ahead - panel >= apart ? (P - 1) * apart : 0;
#pragma GCC unroll 8
                for (int i = 0; i < P; ++i)
                    _mm_prefetch(reinterpret_cast<const char*>(ahead + i * apart + next), _MM_HINT_T0);
            }
            vf s0[P], s1[P], o0[P], o1[P];
#pragma GCC unroll 8
            for (int i = 0; i < P; ++i) sub_scales<F>(bk + i * apart, j, s0[i], s1[i], o0[i], o1[i]);
            const float* xs = x + blk * L::QK + j * L::SUB;
            each_k<F>(q, [&](int64_t kk, const uint8_t* grp, auto J) {
                const vf b = vset1(xs[kk]);
#pragma GCC unroll 8
                for (int i = 0; i < P; ++i) {
                    vf w0, w1;
                    dequant<F, decltype(J)::value>(grp + i * apart, nib, s0[i], s1[i], o0[i],
                                                   o1[i], w0, w1);
                    a0[i] = vfma(b, w0, a0[i]);
                    a1[i] = vfma(b, w1, a1[i]);
                }
            });
            if (chain_ends(blk * L::QK + (j + 1) * L::SUB, K)) {
#pragma GCC unroll 8
                for (int i = 0; i < P; ++i) fold<1>(&t0[i], &t1[i], &a0[i], &a1[i]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < P; ++i) {
        const float* bi = bias ? bias + i * NR : nullptr;
        store_tile<1>(&t0[i], &t1[i], bi, out + i * NR, 0, i == P - 1 ? ncols_last : NR);
    }
}

// one panel as float32 [K, NR], the layout micro() reads
template <int F>
void dequant_panel(const uint8_t* panel, int64_t K, float* dst) {
    walk_panel<F>(
        panel, K,
        [dst](int64_t k, vf w0, vf w1) {
            vstore(dst + k * NR, w0);
            vstore(dst + k * NR + W, w1);
        },
        [](int64_t) {});
}

using QMicro = void (*)(const float*, int64_t, const uint8_t*, int64_t, const float*, float*,
                        int64_t, int64_t);

template <int F, int... R>
constexpr auto qmicro_table(std::integer_sequence<int, R...>) {
    return std::array<QMicro, sizeof...(R)>{&qmicro<R + 1, F>...};
}

// every panel of an [M, K] x [N, K]^T product, shared out over the OpenMP team (on_team: a
// team of its own for more than 2^18 multiply-adds): body(panel, its bias or null, its first
// column, its columns, buf) with buf a thread's buffer for one panel as floats [K, NR], 64-byte aligned (micro's
// loads then never split lines), or null unless `buffered`
template <class Body>
void each_panel(int64_t M, int64_t N, int64_t K, const uint8_t* packed, int64_t panel_bytes,
                const float* bias, bool buffered, Body&& body) {
    const int64_t panels = (N + NR - 1) / NR;
    on_team(M * N * K > (1 << 18), [&] {
        std::vector<float> space(buffered ? K * NR + 16 : 0);
        void* at = space.data();
        size_t room = space.size() * sizeof(float);
        float* buf = buffered ? static_cast<float*>(std::align(64, K * NR * sizeof(float), at, room)) : nullptr;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p)
            body(packed + p * panel_bytes, bias ? bias + p * NR : nullptr, p * NR,
                 std::min<int64_t>(NR, N - p * NR), buf);
    });
}

constexpr int ROW_PANELS = 2;  // panels a one-row product walks together (measured best of 2-4 here)

template <int F>
void qlinear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
             const float* bias, float* out) {
    static constexpr auto quant = qmicro_table<F>(std::make_integer_sequence<int, MR_MAX>{});
    static constexpr auto dense = micro_table(std::make_integer_sequence<int, MR_MAX>{});
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t panel_bytes = (K / Layout<F>::QK) * Layout<F>::block;
    if (M == 1) {  // one row: the panels ROW_PANELS at a time (qmicro_row), the same bits
        constexpr int G = ROW_PANELS;
        const int64_t groups = (panels + G - 1) / G;
        on_team(N * K > (1 << 18), [&] {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t p = g * G;
                const uint8_t* panel = packed + p * panel_bytes;
                const float* b = bias ? bias + p * NR : nullptr;
                const int64_t last = std::min<int64_t>(NR, N - (p + G - 1) * NR);
                if (p + G <= panels) {
                    qmicro_row<F, G>(x, panel, panel_bytes, K, b, out + p * NR, last);
                    continue;
                }
                for (int64_t q = p; q < panels; ++q)  // the last few alone
                    quant[0](x, K, packed + q * panel_bytes, K, bias ? bias + q * NR : nullptr,
                             out + q * NR, N, std::min<int64_t>(NR, N - q * NR));
            }
        });
        return;
    }
    each_panel(M, N, K, packed, panel_bytes, bias, M > MR_MAX,
               [&](const uint8_t* panel, const float* b, int64_t col, int64_t ncols, float* buf) {
                   if (M <= MR_MAX) {
                       quant[M - 1](x, K, panel, K, b, out + col, N, ncols);
                       return;
                   }
                   dequant_panel<F>(panel, K, buf);
                   for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
                       const int64_t mr = std::min<int64_t>(MR_MAX, M - m0);
                       dense[mr - 1](x + m0 * K, K, buf, K, b, out + m0 * N + col, N, ncols);
                   }
               });
}

// ---- block sums (--block-sums): the scale applied once to each sub-block's sum --------------
//
// The exact product above spends one multiply (or FMA) per weight on its scale. Here the quants
// are multiplied as they are and the scale once per sub-block and output:
//   y[m, n] = sum over sub-blocks j, in order, of  s_j[n] * B_j[m, n]  (+ or -  o_j[n] * X_j[m])
//   B_j[m, n] = sum over the sub-block's k, in order, of x[m, k] * q[n, k]   (one FMA a step)
//   X_j[m]    = sum over the sub-block's k, in order, of x[m, k]             (Q4_1, Q5_1: + m;
//                                                                             Q4_K, Q5_K: - dmin mn)
// with q the exact quant (offset applied) and s, o the sub-block's scale and offset (products
// exact, sub_scales). Each row's outputs are the same operations in the same order for any row
// count, so they are row-invariant (bitwise batch-invariant), but they are not the bits of the
// product on the dequantized weights: the rounding differs within float32's (docs/logprobs.md).
// Up to BR_MAX rows unpack the quants in registers; more rows unpack each panel's quants once
// into a thread's buffer (the same values) and run over it BR_MAX rows at a time.
constexpr int BR_MAX = MR_MAX / 2;  // two more accumulators a row: the sub-block's sums

template <int F>
constexpr bool has_offset = Layout<F>::plus_m || Layout<F>::kmin;

// X_j[m] for every row and sub-block: xs[m * subs + j]
template <int F>
void row_sums(const float* x, int64_t M, int64_t K, float* xs) {
    constexpr int64_t SUB = Layout<F>::SUB;
    const int64_t subs = K / SUB;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < subs; ++j) {
            float t = 0.0f;
            for (int64_t kk = 0; kk < SUB; ++kk) t += x[m * K + j * SUB + kk];
            xs[m * subs + j] = t;
        }
}

// MR rows of x times one quantized panel, the scales applied per sub-block; the quants of k
// from `qs(grp, hi, J, k, q0, q1)` (unpacked in registers from the panel, or loaded from a
// buffer of them)
template <int MR, int F, class Quants>
inline void bsum_tile(const float* x, int64_t ldx, const float* xs, int64_t subs,
                      const uint8_t* panel, int64_t K, const float* bias, float* out, int64_t ldo,
                      int64_t ncols, Quants&& qs) {
    using L = Layout<F>;
    vf a0[MR], a1[MR];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = vzero();
    walk_subblocks<F>(panel, K, [&](const uint8_t* b, int64_t j, const uint8_t* q, int64_t k0) {
        vf b0[MR], b1[MR];
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) b0[r] = b1[r] = vzero();
        each_k<F>(q, [&](int64_t kk, const uint8_t* grp, auto J) {
            vf q0, q1;
            qs(grp, J, k0 + kk, q0, q1);
            accumulate<MR>(b0, b1, x, ldx, k0 + kk, q0, q1);
        });
        vf s0, s1, o0, o1;
        sub_scales<F>(b, j, s0, s1, o0, o1);
        const int64_t sub = k0 / L::SUB;
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) {
            a0[r] = vfma(s0, b0[r], a0[r]);
            a1[r] = vfma(s1, b1[r], a1[r]);
            if constexpr (has_offset<F>) {
                const vf xr = vset1(xs[r * subs + sub]);
                if constexpr (L::kmin) {
                    a0[r] = vfnma(o0, xr, a0[r]);
                    a1[r] = vfnma(o1, xr, a1[r]);
                } else {
                    a0[r] = vfma(o0, xr, a0[r]);
                    a1[r] = vfma(o1, xr, a1[r]);
                }
            }
        }
    });
    store_tile<MR>(a0, a1, bias, out, ldo, ncols);
}

template <int MR, int F>
void bsum_micro(const float* x, int64_t ldx, const float* xs, int64_t subs, const uint8_t* panel,
                int64_t K, const float* bias, float* out, int64_t ldo, int64_t ncols) {
    const auto nib = quant_nibbles<F, true>();
    bsum_tile<MR, F>(x, ldx, xs, subs, panel, K, bias, out, ldo, ncols,
                     [&](const uint8_t* grp, auto J, int64_t, vf& q0, vf& q1) {
                         quants<F, decltype(J)::value, true>(grp, nib, q0, q1);
                     });
}

template <int MR, int F>
void bsum_micro_buf(const float* x, int64_t ldx, const float* xs, int64_t subs,
                    const uint8_t* panel, const float* qbuf, int64_t K, const float* bias,
                    float* out, int64_t ldo, int64_t ncols) {
    bsum_tile<MR, F>(x, ldx, xs, subs, panel, K, bias, out, ldo, ncols,
                     [qbuf](const uint8_t*, auto, int64_t k, vf& q0, vf& q1) {
                         q0 = vload(qbuf + k * NR);
                         q1 = vload(qbuf + k * NR + W);
                     });
}

// one panel's quants as floats [K, NR], offset applied, unscaled
template <int F>
void quant_panel(const uint8_t* panel, int64_t K, float* dst) {
    const auto nib = quant_nibbles<F, true>();
    walk_subblocks<F>(panel, K, [&](const uint8_t*, int64_t, const uint8_t* q, int64_t k0) {
        each_k<F>(q, [&](int64_t kk, const uint8_t* grp, auto J) {
            vf q0, q1;
            quants<F, decltype(J)::value, true>(grp, nib, q0, q1);
            vstore(dst + (k0 + kk) * NR, q0);
            vstore(dst + (k0 + kk) * NR + W, q1);
        });
    });
}

using BMicro = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, int64_t,
                        const float*, float*, int64_t, int64_t);
using BMicroBuf = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*,
                           const float*, int64_t, const float*, float*, int64_t, int64_t);

template <int F, int... R>
constexpr auto bsum_tables(std::integer_sequence<int, R...>) {
    return std::make_pair(std::array<BMicro, sizeof...(R)>{&bsum_micro<R + 1, F>...},
                          std::array<BMicroBuf, sizeof...(R)>{&bsum_micro_buf<R + 1, F>...});
}

template <int F>
void qlinear_bsum(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                  const float* bias, float* out) {
    static constexpr auto micros = bsum_tables<F>(std::make_integer_sequence<int, BR_MAX>{});
    const int64_t panel_bytes = (K / Layout<F>::QK) * Layout<F>::block;
    const int64_t subs = K / Layout<F>::SUB;
    std::vector<float> xs(has_offset<F> ? M * subs : 0);
    if constexpr (has_offset<F>) row_sums<F>(x, M, K, xs.data());
    each_panel(M, N, K, packed, panel_bytes, bias, M > BR_MAX,
               [&](const uint8_t* panel, const float* b, int64_t col, int64_t ncols, float* buf) {
                   if (M <= BR_MAX) {
                       micros.first[M - 1](x, K, xs.data(), subs, panel, K, b, out + col, N, ncols);
                       return;
                   }
                   quant_panel<F>(panel, K, buf);
                   for (int64_t m0 = 0; m0 < M; m0 += BR_MAX) {
                       const int64_t mr = std::min<int64_t>(BR_MAX, M - m0);
                       micros.second[mr - 1](x + m0 * K, K, xs.data() + m0 * subs, subs, panel, buf,
                                             K, b, out + m0 * N + col, N, ncols);
                   }
               });
}

// column c's quant at k kk of a sub-block whose quants start at q, offset applied (q - 8,
// q - 16, q - 32 or q)
template <int F>
inline int quant_at(const uint8_t* q, int64_t kk, int64_t c) {
    using L = Layout<F>;
    if constexpr (F == Q8_0) {
        return static_cast<int8_t>(q[kk * NR + c]);
    } else if constexpr (L::lanes) {  // bits B kk .. B kk + B - 1 of the column's lanes
        constexpr int B = L::bits;
        const uint8_t* lanes = q + (c / W) * L::words * 4 * W + (c % W) * 4;
        const int64_t at = B * kk, i = at / 32, o = at % 32;
        uint32_t lo = 0, hi = 0;
        std::memcpy(&lo, lanes + i * 4 * W, 4);
        if (o + B > 32) std::memcpy(&hi, lanes + (i + 1) * 4 * W, 4);
        const uint32_t v = (lo >> o) | (o + B > 32 ? hi << (32 - o) : 0u);
        return static_cast<int>(v & ((1u << B) - 1)) + L::offset;
    } else {
        const uint8_t* nibs = q + kk * (NR / 2);
        const int v = c < W ? nibs[c] & 15 : nibs[c - W] >> 4;
        if constexpr (L::table) return static_cast<int>(MXFP4_VALUES[v]);
        return v + L::offset;
    }
}

// rows of a quantized [N, K] weight, dequantized: out[t] = w[ids[t]] (a tied embedding read from
// the head's blocks); scalar, with the vector path's operations (each product exact, then the
// one rounding: the same values in any form)
template <int F>
void qrows(const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
    using L = Layout<F>;
    const int64_t panel_bytes = (K / L::QK) * L::block;
    on_team(T * K > (1 << 16), [&] {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const uint8_t* panel = packed + (ids[t] / NR) * panel_bytes;
            const int64_t c = ids[t] % NR;
            float* o = out + t * K;
            for (int64_t blk = 0; blk < K / L::QK; ++blk) {
                const uint8_t* b = panel + blk * L::block;
                const uint16_t* h = reinterpret_cast<const uint16_t*>(b);
                float d = L::halves ? _cvtsh_ss(h[c]) : 0.0f;
                if constexpr (L::table) {  // 2^(e - 128), as e8m0_half
                    const uint32_t e = b[c], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
                    std::memcpy(&d, &bits, 4);
                }
                const float d2 = L::halves == 2 ? _cvtsh_ss(h[NR + c]) : 0.0f;  // m or dmin
                for (int64_t j = 0; j < L::QK / L::SUB; ++j) {
                    float s = d, off = d2;
                    if constexpr (F == Q6_K) {
                        s = d * static_cast<float>(static_cast<int8_t>(b[2 * NR + j * NR + c]));
                    } else if constexpr (L::kmin) {
                        const uint8_t* sb = b + 4 * NR + c;  // byte i at sb[i * NR]
                        int sc, mn;
                        if (j < 4) {
                            sc = sb[j * NR] & 63;
                            mn = sb[(j + 4) * NR] & 63;
                        } else {
                            sc = (sb[(j + 4) * NR] & 15) | ((sb[(j - 4) * NR] >> 6) << 4);
                            mn = (sb[(j + 4) * NR] >> 4) | ((sb[j * NR] >> 6) << 4);
                        }
                        s = d * static_cast<float>(sc);
                        off = d2 * static_cast<float>(mn);
                    }
                    const uint8_t* q = b + L::head + j * L::SUB * L::row;
                    for (int64_t kk = 0; kk < L::SUB; ++kk) {
                        float w = s * static_cast<float>(quant_at<F>(q, kk, c));
                        if constexpr (L::plus_m) w = w + off;
                        if constexpr (L::kmin) w = w - off;
                        o[blk * L::QK + j * L::SUB + kk] = w;
                    }
                }
            }
        }
    });
}

}  // namespace

constexpr int PS_BLOCK_SUMS = 16;  // added to a format id: its block-sum product

#define PS_FORMATS(X) X(Q4_0) X(Q4_1) X(Q8_0) X(Q5_0) X(Q5_1) X(Q4_K) X(Q5_K) X(Q6_K) X(MXFP4)

extern "C" {

// bytes of one packed block of a panel (NR times the file's block), or -1 for an unknown format
int64_t ps_qblock_bytes(int fmt) {
    switch (fmt) {
#define X(F) case F: return Layout<F>::block;
        PS_FORMATS(X)
#undef X
        default: return -1;
    }
}

// weights per block along K (32, or 256 for the K-quants), or -1
int64_t ps_qblock_len(int fmt) {
    switch (fmt) {
#define X(F) case F: return Layout<F>::QK;
        PS_FORMATS(X)
#undef X
        default: return -1;
    }
}

// out[M, N] = x[M, K] . w^T + bias, w quantized in format `fmt`, packed as above (K a multiple
// of the format's block length); bias padded to a multiple of NR, or null. `fmt` plus
// PS_BLOCK_SUMS: the scales applied per sub-block sum (row-invariant, not the dequantized bits);
// plus PS_LIMBS: limbs.cpp's layout and integer product
void ps_qlinear(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                const float* bias, float* out) {
    if (fmt >= PS_LIMBS) return ps_limb_linear(fmt - PS_LIMBS, x, M, K, packed, N, bias, out);
    switch (fmt) {
#define X(F) case F: return qlinear<F>(x, M, K, packed, N, bias, out); \
        case F + PS_BLOCK_SUMS: return qlinear_bsum<F>(x, M, K, packed, N, bias, out);
        PS_FORMATS(X)
#undef X
        default: return;
    }
}

int ps_block_sums_flag() { return PS_BLOCK_SUMS; }

// the rows are the weights' exact values whatever the product's arithmetic (PS_BLOCK_SUMS)
void ps_qrows(int fmt, const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
    if (fmt >= PS_LIMBS) return ps_limb_rows(fmt - PS_LIMBS, packed, K, ids, T, out);
    switch (fmt % PS_BLOCK_SUMS) {
#define X(F) case F: return qrows<F>(packed, K, ids, T, out);
        PS_FORMATS(X)
#undef X
        default: return;
    }
}

}  // extern "C"
