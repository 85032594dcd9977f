// Linear layers on GGUF blocks in integer arithmetic (--products limbs): Q4_0, Q4_1 and Q8_0
// on AVX-512 VNNI. Each product is the exact one of the float32 activations and the dequantized
// weights, rounded (to float32) about once: closer to a float64 forward than the float32 path.
//
// The float32 path (quantized.cpp) dequantizes each weight and adds x * w with one FMA a weight,
// K roundings of running sums. Here each row of x is written, one block of 32 k's at a time, as
// integers sharing one exponent:
//   x[k] = X[k] 2^e + r[k],  X[k] = round-to-nearest(x[k] 2^-e),  |X[k]| <= XMAX = 127 * 16843009
// e the least exponent that keeps the block's largest |x| within XMAX (< 2^31): X holds 31 bits,
// so every x within 2^6 of the block's largest is exact (r = 0: float32 has 24 bits) and any
// other is off by at most half of 2^e, 2^-31 of the largest (an outlier channel costs the rest of
// its block nothing a float32 sum would keep). X is split into four signed bytes,
//   X = a3 * 2^24 + a2 * 2^16 + a1 * 2^8 + a0,  each a in -128..127 (balanced limbs)
// and each limb's dot product with the block's stored quants u (unsigned bytes: Q4_0 and Q4_1 the
// nibble 0..15, Q8_0 its int8 + 128) is exact in 32-bit integers (vpdpbusd: 64 byte products an
// instruction, four summed into each of 16 columns' lanes; at most 32 * 128 * 255 < 2^21). Per
// block, per column:
//   T = (A2 + A3 * 256) * 65536 + (A0 + A1 * 256)    the parts exact in int32 (< 2^29), T < 2^45
//   y += (T * d + S * o) * 2^e     S = the block's sum of X, o = Q4_1's m or the offset's d
// in float64 (Q4_0 w = d (u - 8) and Q8_0 d (u - 128) carry their offset as o = offset * d,
// exact): T, S and the float16 d and m are exact in doubles, T * d and S * o are exact or round
// at 2^-53, and each add rounds at 2^-53 of y. y is rounded to float32 once, at the end. So the
// error against the exact product is one float32 rounding of y, plus |sum_k w[k] r[k]| <= 2^-31
// sum_b max_b|x| sum_k |w[k]| and the float64 roundings (tests/test_quantized.py checks this
// bound on every float16 scale, and that the error is below the float32 path's).
//
// Four limbs are 16 byte products an instruction, a float32 FMA's 16 lanes: on AVX-512 VNNI this
// pays where the float path spends more on dequantizing than on its FMAs (one row: a decode step
// of one stream), not in batched products (docs/benchmarks.md measures both; AMX's tiles would).
//
// Every row's arithmetic is its own: its limbs, its sums over k in order, whatever M is and
// whichever rows share a pass (row-invariant: bitwise batch-invariant, as invariant.cpp).
//
// The packed layout (kernels/qlayout.py `pack_limbs`): panels of NR = 32 columns (two halves of
// 16, one zmm of int32 lanes each); in a panel, for each block of 32 k's: d[32] float16 (Q4_1:
// then m[32]), then per half the quants in vpdpbusd's order: 4-bit, 4 chunks of 64 bytes, chunk c
// byte i holding column i / 4's k 8c + i % 4 in its low nibble and k 8c + 4 + i % 4 in its high
// one; Q8_0, 8 chunks, chunk c byte i column i / 4's k 4c + i % 4 (+ 128). The file's bytes, moved.
#include <cstring>
#include <memory>

#include "probserve.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PS_LIMBS_BUILT 1
#endif

namespace {

enum LimbFormat : int { L4_0 = 0, L4_1 = 1, L8_0 = 2 };  // quantized.cpp's Q4_0, Q4_1, Q8_0 ids

template <int F>
struct LimbLayout {
    static constexpr int64_t QK = 32;
    static constexpr int64_t halves = F == L4_1 ? 2 : 1;               // float16 fields: d (, m)
    static constexpr int64_t chunks = F == L8_0 ? 8 : 4;               // 64-byte chunks a half
    static constexpr int64_t head = halves * 2 * 32;
    static constexpr int64_t block = head + 2 * chunks * 64;           // = 32 file blocks
    static constexpr int offset = F == L4_0 ? -8 : F == L8_0 ? -128 : 0;
};

#ifdef PS_LIMBS_BUILT

constexpr int LIMBS = 4;
constexpr double XMAX = 127.0 * 16843009.0;  // the largest |X| four balanced limbs hold (< 2^31)
constexpr int LMR = 3;                       // rows a pass over a panel

// The rows' limbs: l[i][m * K + k] limb i of row m's X[k]; per row m and block b (at = m * nb +
// b), scale[at] = 2^e and sum[at] the sum of the block's X (exact in a double: < 2^36)
struct RowLimbs {
    std::vector<int8_t> l[LIMBS];
    std::vector<double> scale;
    std::vector<double> sum;  // exact: |sum| < 32 * 2^31
    int64_t K = 0, nb = 0;
    RowLimbs(int64_t M, int64_t K_) : K(K_), nb(K_ / 32) {
        for (auto& v : l) v.resize(M * K);
        scale.resize(M * nb);
        sum.resize(M * nb);
    }
};

// e for a block whose largest |x| is `top` (finite, > 0): the least with top 2^-e <= XMAX
inline int block_exponent(float top) {
    uint32_t bits;
    std::memcpy(&bits, &top, 4);
    int E = static_cast<int>(bits >> 23) - 126;  // top < 2^E (a normal float)
    if (E == -126) E = -125 - static_cast<int>(__builtin_clz(bits & 0x7fffffu)) + 8;  // subnormal
    int e = E - 31;
    if (std::ldexp(static_cast<double>(top), -e) > XMAX) e += 1;
    return e;
}

// row m's limbs; a block with a non-finite x gets scale NaN (its outputs NaN)
void row_limbs(const float* x, int64_t m, RowLimbs& r) {
    const int64_t K = r.K;
    const __m512i c128 = _mm512_set1_epi32(128), m255 = _mm512_set1_epi32(255);
    for (int64_t b = 0; b < r.nb; ++b) {
        const float* xb = x + m * K + b * 32;
        const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const int64_t at = m * r.nb + b;
        const bool nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        const bool finite = !nan && std::isfinite(top);  // (max drops a NaN: asked apart)
        const int e = finite && top > 0.0f ? block_exponent(top) : 0;
        r.scale[at] = finite ? std::ldexp(1.0, e) : std::numeric_limits<double>::quiet_NaN();
        const __m512d inv = _mm512_set1_pd(finite ? std::ldexp(1.0, -e) : 0.0);
        __m512d total = _mm512_setzero_pd();
        for (int h = 0; h < 2; ++h) {
            const __m512 v = h ? v1 : v0;
            // x 2^-e is exact in a double; the conversion rounds to nearest (even)
            const __m256i lo = _mm512_cvtpd_epi32(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), inv));
            const __m256i hi = _mm512_cvtpd_epi32(_mm512_mul_pd(
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))), inv));
            const __m512i X = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            const __m512i a0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, c128), m255), c128);
            const __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, a0), 8);
            const __m512i a1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X1, c128), m255), c128);
            const __m512i X2 = _mm512_srai_epi32(_mm512_sub_epi32(X1, a1), 8);
            const __m512i a2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X2, c128), m255), c128);
            const __m512i a3 = _mm512_srai_epi32(_mm512_sub_epi32(X2, a2), 8);
            const int64_t k = m * K + b * 32 + 16 * h;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(r.l[0].data() + k), _mm512_cvtepi32_epi8(a0));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(r.l[1].data() + k), _mm512_cvtepi32_epi8(a1));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(r.l[2].data() + k), _mm512_cvtepi32_epi8(a2));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(r.l[3].data() + k), _mm512_cvtepi32_epi8(a3));
            total = _mm512_add_pd(total, _mm512_add_pd(_mm512_cvtepi32_pd(lo), _mm512_cvtepi32_pd(hi)));
        }
        r.sum[at] = _mm512_reduce_add_pd(total);  // integers below 2^37: exact
    }
}

// a half's quants of one block, unsigned bytes in vpdpbusd's order: w[c] holds k's 4c..4c+3
template <int F>
inline void half_quants(const uint8_t* q, __m512i* w) {
    if constexpr (F == L8_0) {
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(q + 64 * c);
    } else {
        const __m512i lo4 = _mm512_set1_epi8(15);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(q + 64 * c);
            w[2 * c] = _mm512_and_si512(v, lo4);
            w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        }
    }
}

// eight doubles from the low (H = 0) or high eight float16s of 16
template <int H>
inline __m512d half_pd(__m256i h16) {
    const __m512 f = _mm512_cvtph_ps(h16);
    return _mm512_cvtps_pd(H ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))
                             : _mm512_castps512_ps256(f));
}

// MR rows (from m0) of the limbs times one packed panel, HS halves (16 columns each) a pass
// starting at half h0: y[r] accumulates in doubles, columns in order
template <int F, int MR, int HS>
void limb_micro(const RowLimbs& R, int64_t m0, const uint8_t* panel, int64_t h0, const float* bias,
                float* out, int64_t ldo, int64_t ncols) {
    using L = LimbLayout<F>;
    const int64_t K = R.K, nb = R.nb;
    __m512d y[MR][HS][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < HS; ++h) y[r][h][0] = y[r][h][1] = _mm512_setzero_pd();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = panel + b * L::block;
        for (int64_t i = 0; i < L::block; i += 64)
            _mm_prefetch(reinterpret_cast<const char*>(blk + 8 * L::block + i), _MM_HINT_T0);
        const __m256i* h16 = reinterpret_cast<const __m256i*>(blk);
#pragma GCC unroll 2
        for (int h = 0; h < HS; ++h) {
            const int64_t hh = h0 + h;
            const __m256i dh = _mm256_loadu_si256(h16 + hh);
            const __m512d d0 = half_pd<0>(dh), d1 = half_pd<1>(dh);
            __m512d n0, n1;  // o: the offset's scale (offset d, exact), or m
            if constexpr (F == L4_1) {
                const __m256i mh = _mm256_loadu_si256(h16 + 2 + hh);
                n0 = half_pd<0>(mh);
                n1 = half_pd<1>(mh);
            } else {
                n0 = _mm512_mul_pd(d0, _mm512_set1_pd(L::offset));
                n1 = _mm512_mul_pd(d1, _mm512_set1_pd(L::offset));
            }
            __m512i w[8];
            half_quants<F>(blk + L::head + hh * L::chunks * 64, w);
#pragma GCC unroll 4
            for (int r = 0; r < MR; ++r) {
                const int64_t m = m0 + r, at = m * nb + b;
                __m512i a[LIMBS];
                const int32_t* p[LIMBS];
#pragma GCC unroll 4
                for (int i = 0; i < LIMBS; ++i) {
                    a[i] = _mm512_setzero_si512();
                    p[i] = reinterpret_cast<const int32_t*>(R.l[i].data() + m * K + b * 32);
                }
#pragma GCC unroll 8
                for (int c = 0; c < 8; ++c)
#pragma GCC unroll 4
                    for (int i = 0; i < LIMBS; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w[c], _mm512_set1_epi32(p[i][c]));
                // limbs 0 and 1, 2 and 3 joined in int32 (below 2^29), then T in a double (< 2^53)
                const __m512i a01 = _mm512_add_epi32(a[0], _mm512_slli_epi32(a[1], 8));
                const __m512i a23 = _mm512_add_epi32(a[2], _mm512_slli_epi32(a[3], 8));
                const __m512d big = _mm512_set1_pd(65536.0), e = _mm512_set1_pd(R.scale[at]);
                const __m512d t0 = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(a23)), big,
                                                   _mm512_cvtepi32_pd(_mm512_castsi512_si256(a01)));
                const __m512d t1 = _mm512_fmadd_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a23, 1)), big,
                                                   _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a01, 1)));
                // T d + S o: both products exact (o = offset d, or Q4_1's m)
                const __m512d S = _mm512_set1_pd(R.sum[at]);
                const __m512d u0 = _mm512_fmadd_pd(S, n0, _mm512_mul_pd(t0, d0));
                const __m512d u1 = _mm512_fmadd_pd(S, n1, _mm512_mul_pd(t1, d1));
                y[r][h][0] = _mm512_fmadd_pd(u0, e, y[r][h][0]);
                y[r][h][1] = _mm512_fmadd_pd(u1, e, y[r][h][1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < HS; ++h) {
            const int64_t c0 = (h0 + h) * 16;
            if (c0 >= ncols) continue;
            const __m256 lo = _mm512_cvtpd_ps(y[r][h][0]), hi = _mm512_cvtpd_ps(y[r][h][1]);
            __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c0));
            const int64_t n = std::min<int64_t>(16, ncols - c0);
            _mm512_mask_storeu_ps(out + (m0 + r) * ldo + c0, static_cast<__mmask16>((1u << n) - 1u), v);
        }
}

template <int F>
void limb_linear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                 const float* bias, float* out) {
    using L = LimbLayout<F>;
    const int64_t panels = (N + NR - 1) / NR, panel_bytes = (K / L::QK) * L::block;
    on_team(M * N * K > (1 << 18), [&] {
        // the rows' limbs: a few rows, each thread its own (no barrier); more, one buffer the
        // team fills (a row a thread) and then reads. The same limbs either way.
        const bool few = M <= LMR;
        std::unique_ptr<RowLimbs> own(few ? new RowLimbs(M, K) : nullptr);
        RowLimbs* shared = own.get();
        if (few) {
            for (int64_t m = 0; m < M; ++m) row_limbs(x, m, *shared);
        } else {
#pragma omp single copyprivate(shared)
            shared = new RowLimbs(M, K);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; ++m) row_limbs(x, m, *shared);
        }
        const RowLimbs& R = *shared;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint8_t* panel = packed + p * panel_bytes;
            const float* b = bias ? bias + p * NR : nullptr;
            float* o = out + p * NR;
            const int64_t ncols = std::min<int64_t>(NR, N - p * NR);
            int64_t m0 = 0;  // one row: both halves a pass (six independent sums in flight)
            // a few rows at a time, each half in turn (the rows' limbs then come from the cache
            // for the second half: the activations are read once a panel, as the float path's)
            for (; m0 + LMR <= M; m0 += LMR)
                for (int64_t h = 0; h < 2; ++h) limb_micro<F, LMR, 1>(R, m0, panel, h, b, o, N, ncols);
            for (; m0 + 2 <= M; m0 += 2)
                for (int64_t h = 0; h < 2; ++h) limb_micro<F, 2, 1>(R, m0, panel, h, b, o, N, ncols);
            for (; m0 < M; ++m0) limb_micro<F, 1, 2>(R, m0, panel, 0, b, o, N, ncols);
        }
        if (!few) {
#pragma omp single
            delete shared;  // every thread is past the loop's barrier
        }
    });
}

// rows of the weight, dequantized as gguf computes them (w = d (u + offset), or d u + m)
template <int F>
void limb_rows(const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
    using L = LimbLayout<F>;
    const int64_t panel_bytes = (K / L::QK) * L::block;
    for (int64_t t = 0; t < T; ++t) {
        const uint8_t* panel = packed + (ids[t] / NR) * panel_bytes;
        const int64_t c = ids[t] % NR, h = c / 16, col = c % 16;
        for (int64_t b = 0; b < K / L::QK; ++b) {
            const uint8_t* blk = panel + b * L::block;
            const uint16_t* h16 = reinterpret_cast<const uint16_t*>(blk);
            const float d = _cvtsh_ss(h16[c]);
            const float mm = F == L4_1 ? _cvtsh_ss(h16[NR + c]) : 0.0f;
            const uint8_t* q = blk + L::head + h * L::chunks * 64;
            for (int64_t k = 0; k < 32; ++k) {
                int u;
                if constexpr (F == L8_0) {
                    u = q[(k / 4) * 64 + col * 4 + k % 4];
                } else {
                    const uint8_t byte = q[(k / 8) * 64 + col * 4 + k % 4];
                    u = (k % 8) < 4 ? byte & 15 : byte >> 4;
                }
                float w = d * static_cast<float>(u + L::offset);
                if constexpr (F == L4_1) w = d * static_cast<float>(u) + mm;
                out[t * K + b * 32 + k] = w;
            }
        }
    }
}

#endif  // PS_LIMBS_BUILT

}  // namespace

extern "C" {

// bytes of one packed block of a limb panel (NR file blocks), or -1 where this build has no
// limb product for the format (not Q4_0, Q4_1 or Q8_0, or no AVX-512 VNNI)
int64_t ps_limb_block_bytes(int fmt) {
#ifdef PS_LIMBS_BUILT
    switch (fmt) {
        case L4_0: return LimbLayout<L4_0>::block;
        case L4_1: return LimbLayout<L4_1>::block;
        case L8_0: return LimbLayout<L8_0>::block;
        default: return -1;
    }
#else
    (void)fmt;
    return -1;
#endif
}

// out[M, N] = x[M, K] . w^T + bias, w in the limb layout of format `fmt` (ps_limb_block_bytes)
void ps_limb_linear(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                    const float* bias, float* out) {
#ifdef PS_LIMBS_BUILT
    switch (fmt) {
        case L4_0: return limb_linear<L4_0>(x, M, K, packed, N, bias, out);
        case L4_1: return limb_linear<L4_1>(x, M, K, packed, N, bias, out);
        case L8_0: return limb_linear<L8_0>(x, M, K, packed, N, bias, out);
        default: return;
    }
#else
    (void)fmt, (void)x, (void)M, (void)K, (void)packed, (void)N, (void)bias, (void)out;
#endif
}

// rows `ids` of a weight in the limb layout, dequantized (a tied embedding's lookup)
void ps_limb_rows(int fmt, const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
#ifdef PS_LIMBS_BUILT
    switch (fmt) {
        case L4_0: return limb_rows<L4_0>(packed, K, ids, T, out);
        case L4_1: return limb_rows<L4_1>(packed, K, ids, T, out);
        case L8_0: return limb_rows<L8_0>(packed, K, ids, T, out);
        default: return;
    }
#else
    (void)fmt, (void)packed, (void)K, (void)ids, (void)T, (void)out;
#endif
}

}  // extern "C"
