// Linear layers on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), exact.
//
// The weights stay in the file's 4- or 8-bit blocks (a quarter to a half of the float32 bytes a
// one-row step must read) and are dequantized in registers inside the matrix product:
//   Q4_0  w = d * (q - 8)      q in 0..15
//   Q4_1  w = d * q + m        q in 0..15
//   Q8_0  w = d * q            q in -128..127
// with d and m float16 per block of QK = 32 weights along K, one rounding per operation, as
// gguf's dequantize computes them. So each w is the very float32 a dequantized copy holds, and
// the product then runs the float32 micro-kernel's operations in its order (y[m, n] accumulates
// x[m, k] * w[n, k] for k = 0..K-1, one FMA a step): the outputs are the same bits as
// ps_linear's on the dequantized weight, for any row count (row-invariant, as invariant.cpp).
// Up to MR_MAX rows dequantize in registers; more rows dequantize each panel once into a
// thread's buffer and run the float32 micro-kernel over it (the same values, the same order).
//
// The packed layout (kernels/invariant.py `QuantizedWeight`): panels of NR output columns; in a
// panel, for each block of QK along K: d[NR] (float16), for Q4_1 m[NR] (float16), then the QK
// rows of NR quants: Q4 two columns a byte (byte j holds column j in its low nibble and column
// j + W in its high one), Q8 one int8 a column. Padded columns have d = m = 0.
#include <memory>

#include "simd.h"

namespace {

constexpr int64_t QK = 32;
enum Format : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

template <int F>
struct Layout {
    static constexpr int64_t scales = (F == Q4_1 ? 2 : 1) * NR * 2;  // bytes of d (and m)
    static constexpr int64_t row = F == Q8_0 ? NR : NR / 2;          // bytes of one k's quants
    static constexpr int64_t block = scales + QK * row;
};

template <int F>
inline void block_scales(const uint8_t* blk, vf& d0, vf& d1, vf& m0, vf& m1) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(blk);
    d0 = vhalf(h);
    d1 = vhalf(h + W);
    if constexpr (F == Q4_1) {
        m0 = vhalf(h + NR);
        m1 = vhalf(h + NR + W);
    } else {
        m0 = m1 = vzero();
    }
}

// the NR weights of one k: columns [0, W) in w0, [W, NR) in w1. d * q is exact in float32 (an
// 11-bit significand times an integer of at most 8 bits), so Q4_1's d * q + m rounds once either
// way and one FMA gives gguf's two-step value.
template <int F>
inline void dequant(const uint8_t* q, const Nibbles& nib, vf d0, vf d1, vf m0, vf m1, vf& w0,
                    vf& w1) {
    if constexpr (F == Q8_0) {
        w0 = vmul(vcvt(vload_i8(q)), d0);
        w1 = vmul(vcvt(vload_i8(q + W)), d1);
    } else {
        const vi b = vload_u8(q);
        if constexpr (F == Q4_1) {
            w0 = vfma(d0, nib.lo(b), m0);
            w1 = vfma(d1, nib.hi(b), m1);
        } else {
            w0 = vmul(d0, nib.lo(b));
            w1 = vmul(d1, nib.hi(b));
        }
    }
}

// the quants' offset: Q4_0 stores q + 8
template <int F>
inline Nibbles nibbles() {
    return Nibbles(F == Q4_0 ? -8 : 0);
}

// a block's cache lines, requested ahead of use: the one-row product reads a block in ~60 ns,
// faster than a line arrives from memory unasked (prefetching never faults, even past the end)
constexpr int64_t PREFETCH = 8;  // blocks ahead
template <int F>
inline void prefetch_block(const uint8_t* b) {
    for (int64_t line = 0; line < Layout<F>::block; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + line), _MM_HINT_T0);
}

// every k of one quantized panel in order: body(k, w0, w1) with the k's NR weights dequantized
// (columns [0, W) in w0, [W, NR) in w1), the blocks prefetched ahead
template <int F, class Body>
inline void walk_panel(const uint8_t* panel, int64_t K, Body&& body) {
    using L = Layout<F>;
    const Nibbles nib = nibbles<F>();
    for (int64_t blk = 0; blk < K / QK; ++blk) {
        const uint8_t* b = panel + blk * L::block;
        prefetch_block<F>(b + PREFETCH * L::block);
        vf d0, d1, m0, m1;
        block_scales<F>(b, d0, d1, m0, m1);
        const uint8_t* q = b + L::scales;
        for (int64_t kk = 0; kk < QK; ++kk) {
            vf w0, w1;
            dequant<F>(q + kk * L::row, nib, d0, d1, m0, m1, w0, w1);
            body(blk * QK + kk, w0, w1);
        }
    }
}

// MR rows of x times one quantized panel, dequantizing each k's weights once for all MR rows
template <int MR, int F>
void qmicro(const float* x, int64_t ldx, const uint8_t* panel, int64_t K, const float* bias,
            float* out, int64_t ldo, int64_t ncols) {
    vf a0[MR], a1[MR];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = vzero();
    walk_panel<F>(panel, K,
                  [&](int64_t k, vf w0, vf w1) { accumulate<MR>(a0, a1, x, ldx, k, w0, w1); });
    store_tile<MR>(a0, a1, bias, out, ldo, ncols);
}

// one panel as float32 [K, NR], the layout micro() reads
template <int F>
void dequant_panel(const uint8_t* panel, int64_t K, float* dst) {
    walk_panel<F>(panel, K, [dst](int64_t k, vf w0, vf w1) {
        vstore(dst + k * NR, w0);
        vstore(dst + k * NR + W, w1);
    });
}

using QMicro = void (*)(const float*, int64_t, const uint8_t*, int64_t, const float*, float*,
                        int64_t, int64_t);

template <int F, int... R>
constexpr auto qmicro_table(std::integer_sequence<int, R...>) {
    return std::array<QMicro, sizeof...(R)>{&qmicro<R + 1, F>...};
}

template <int F>
void qlinear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
             const float* bias, float* out) {
    static constexpr auto quant = qmicro_table<F>(std::make_integer_sequence<int, MR_MAX>{});
    static constexpr auto dense = micro_table(std::make_integer_sequence<int, MR_MAX>{});
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t panel_bytes = (K / QK) * Layout<F>::block;
#pragma omp parallel if (M * N * K > (1 << 18))
    {
        // a panel's float32 weights, 64-byte aligned (micro's loads then never split lines)
        std::vector<float> space(M > MR_MAX ? K * NR + 16 : 0);
        void* at = space.data();
        size_t room = space.size() * sizeof(float);
        float* buf = M > MR_MAX ? static_cast<float*>(std::align(64, K * NR * sizeof(float), at, room)) : nullptr;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint8_t* panel = packed + p * panel_bytes;
            const float* b = bias ? bias + p * NR : nullptr;
            const int64_t ncols = std::min<int64_t>(NR, N - p * NR);
            if (M <= MR_MAX) {
                quant[M - 1](x, K, panel, K, b, out + p * NR, N, ncols);
                continue;
            }
            dequant_panel<F>(panel, K, buf);
            for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
                const int64_t mr = std::min<int64_t>(MR_MAX, M - m0);
                dense[mr - 1](x + m0 * K, K, buf, K, b, out + m0 * N + p * NR, N, ncols);
            }
        }
    }
}

// rows of a quantized [N, K] weight, dequantized: out[t] = w[ids[t]] (a tied embedding read from
// the head's blocks); scalar, with the vector path's operations (exact in any form)
template <int F>
void qrows(const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
    using L = Layout<F>;
    const int64_t panel_bytes = (K / QK) * L::block;
#pragma omp parallel for schedule(static) if (T * K > (1 << 16))
    for (int64_t t = 0; t < T; ++t) {
        const uint8_t* panel = packed + (ids[t] / NR) * panel_bytes;
        const int64_t c = ids[t] % NR;
        float* o = out + t * K;
        for (int64_t blk = 0; blk < K / QK; ++blk) {
            const uint8_t* b = panel + blk * L::block;
            const uint16_t* h = reinterpret_cast<const uint16_t*>(b);
            const float d = _cvtsh_ss(h[c]);
            const float m = F == Q4_1 ? _cvtsh_ss(h[NR + c]) : 0.0f;
            const uint8_t* q = b + L::scales;
            for (int64_t kk = 0; kk < QK; ++kk) {
                const uint8_t* row = q + kk * L::row;
                int v;
                if constexpr (F == Q8_0) {
                    v = static_cast<int8_t>(row[c]);
                } else {
                    v = c < W ? row[c] & 15 : row[c - W] >> 4;
                    if constexpr (F == Q4_0) v -= 8;
                }
                float w = d * static_cast<float>(v);
                if constexpr (F == Q4_1) w = w + m;
                o[blk * QK + kk] = w;
            }
        }
    }
}

}  // namespace

extern "C" {

int64_t ps_qblock_bytes(int fmt) {
    switch (fmt) {
        case Q4_0: return Layout<Q4_0>::block;
        case Q4_1: return Layout<Q4_1>::block;
        case Q8_0: return Layout<Q8_0>::block;
        default: return -1;
    }
}

// out[M, N] = x[M, K] . w^T + bias, w quantized in format `fmt`, packed as above (K a multiple
// of QK); bias padded to a multiple of NR, or null
void ps_qlinear(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                const float* bias, float* out) {
    switch (fmt) {
        case Q4_0: return qlinear<Q4_0>(x, M, K, packed, N, bias, out);
        case Q4_1: return qlinear<Q4_1>(x, M, K, packed, N, bias, out);
        case Q8_0: return qlinear<Q8_0>(x, M, K, packed, N, bias, out);
        default: return;
    }
}

void ps_qrows(int fmt, const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
    switch (fmt) {
        case Q4_0: return qrows<Q4_0>(packed, K, ids, T, out);
        case Q4_1: return qrows<Q4_1>(packed, K, ids, T, out);
        case Q8_0: return qrows<Q8_0>(packed, K, ids, T, out);
        default: return;
    }
}

}  // extern "C"
