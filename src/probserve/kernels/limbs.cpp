// Linear layers on GGUF blocks in integer arithmetic (--products limbs): every native format
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) on AVX-512 VNNI, and on AVX2 (limbs_avx2.h:
// the same sums, the same bits, from vpmaddubsw runs). Each product is the exact one
// of the float32 activations and the dequantized weights, rounded (to float32) about once:
// closer to a float64 forward than the float32 path.
//
// The float32 path (quantized.cpp) dequantizes each weight and adds x * w with one FMA a weight,
// K roundings of running sums. Here each row of x is written, one block of 32 k's at a time (a
// K-quant's super-block of 256: the span of limbs_super.h's join), as integers sharing one
// exponent:
//   x[k] = X[k] 2^e + r[k],  X[k] = round-to-nearest(x[k] 2^-e),  |X[k]| <= XMAX = 127 * 16843009
// e the least exponent that keeps the block's largest |x| within XMAX (< 2^31): X holds 31 bits,
// so every x within 2^6 of the block's largest is exact (r = 0: float32 has 24 bits) and any
// other is off by at most half of 2^e, below max|x| / XMAX (2^-31 of the largest, times 1.004:
// 2^e < 2 max|x| / XMAX) (an outlier channel costs the rest of
// its block nothing a float32 sum would keep). X is split into four signed bytes,
//   X = a3 * 2^24 + a2 * 2^16 + a1 * 2^8 + a0,  each a in -128..127 (balanced limbs)
// Every format's weight is w = s (u + offset) or s u + o, u the stored unsigned quant (0..15,
// 0..31, 0..63, or Q8_0's int8 + 128), per group of k's sharing a scale s (and o):
//   Q4_0, Q5_0, Q8_0  s = d,          offset -8, -16, -128         group = the block of 32
//   Q4_1, Q5_1        s = d,          o = m                        group = the block of 32
//   Q4_K, Q5_K        s = d * sc,     o = -(dmin * mn)             group = a sub-block of 32
//   Q6_K              s = d * sc,     offset -32                   group = a sub-block of 16
// (d, m, dmin float16, sc and mn 6-bit, Q6_K's sc int8: s and o are exact in doubles). Each limb's
// dot product with a group's quants u is exact in 32-bit integers (vpdpbusd: 64 byte products an
// instruction, four summed into each of 16 columns' lanes; at most 32 * 128 * 255 < 2^21). Per
// group, per column:
//   T = (A2 + A3 * 256) * 65536 + (A0 + A1 * 256)    the parts exact in int32 (< 2^29), T < 2^45
//   y += ((T + offset * S) * s) * 2^e   or   y += (T * s + S * o) * 2^e
// in float64, S the group's sum of X: T + offset * S is an integer below 2^53 (exact), so the
// offset formats round twice a group (the product by s, the add to y), the others three times
// (T * s, its sum with S * o, the add), each at 2^-53 of its operands. y is rounded to float32
// once, at the end. So the error against the exact product is one float32 rounding of y, plus
// |sum_k w[k] r[k]| <= sum_b max_b|x| / XMAX sum_k |w[k]|, plus the float64 roundings (at most
// 2^-51 of sum_k |x[k]| (|s u| + |o|) a block). gguf's float32 copy rounds the sums d u + m and
// (d sc) u - dmin mn once; these products use the exact value. (tests/test_quantized.py checks
// this bound on every float16 scale, and that the error is below the float32 path's.)
//
// That is the arithmetic of the formats in blocks of 32. The K-quants (Q4_K, Q5_K, Q6_K) never
// form s and o: they join once a super-block instead (limbs_super.h: the sub-block scales sc and
// mn multiplied in integers, three float64 roundings a super-block, the exponent the span's; the
// same bound with the span for the block, the same bits on every path).
//
// Four limbs are 16 byte products an instruction, a float32 FMA's 16 lanes: on AVX-512 VNNI this
// pays where the float path spends more on dequantizing than on its FMAs (one row: a decode step
// of one stream), not in batched products (docs/benchmarks.md measures both): batches of 8 or 10
// rows or more go to AMX tiles where the CPU has them (limbs_amx.h: the same sums, the same bits).
// On AVX2 (three instructions for 32 byte products) it is slower than the float path at every
// row count: there it buys accuracy only.
//
// Every row's arithmetic is its own: its limbs, its sums over k in order, whatever M is and
// whichever rows share a pass (row-invariant: bitwise batch-invariant, as invariant.cpp).
//
// The packed layout (kernels/qlayout.py `pack_limbs`): panels of NR = 32 columns (two halves of
// 16, one zmm of int32 lanes each); in a panel, for each block of QK k's (32; the K-quants' 256):
// the float16 fields of the 32 columns (d[32]; Q4_1, Q5_1 then m[32]; Q4_K, Q5_K dmin[32]), then
// for each sub-block of 32 k's: the K-quants' scale bytes (Q4_K, Q5_K: sc[32] then mn[32], the
// 6-bit values unpacked; Q6_K: the int8 sc[32] of its first 16 k's, then of its second 16), then
// per half the quants in vpdpbusd's order, in chunks of 64 bytes, byte 4j + i holding column j's
// k 4c + i of chunk c (c = 0..7): Q8_0 eight chunks (int8 + 128); the others first four chunks of
// nibbles, chunk i holding chunk 2i's low 4 bits in its low nibbles and chunk 2i + 1's in its
// high ones, then the high bits: 5-bit, one chunk, bit c of a byte the bit 4 of chunk c's;
// Q6_K, two chunks, bits 2j and 2j + 1 of chunk t's bytes bits 4 and 5 of chunk 4t + j's. The
// file's bytes, moved (Q8_0's shifted by 128; the K-quants' 6-bit scales a byte each: Q4_K and
// Q5_K hold 4 more bytes a column per 256 k's than the file).
#include <cstdlib>
#include <cstring>
#include <memory>

#include "probserve.h"
#include "simd.h"
#include "tiles.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PS_LIMBS_VNNI 1  // the CPU runs the AVX-512 path's instructions itself
#endif

#if defined(PS_LIMBS_SIMDE)  // PROBSERVE_KERNEL_ISA=avx512-emulated (tests): the AVX-512 path on any CPU
#include "avx512_emulated.h"
#define PS_LIMBS_BUILT 1
#define PS_LIMBS_ZMM 1
#elif defined(PS_LIMBS_VNNI)
#define PS_LIMBS_BUILT 1
#define PS_LIMBS_ZMM 1  // vpdpbusd on 16 columns' lanes
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PS_LIMBS_BUILT 1  // vpmaddubsw + vpmaddwd on 8 columns' lanes (limbs_avx2.h)
#endif

namespace {

// quantized.cpp's format ids
enum LimbFormat : int { L4_0 = 0, L4_1 = 1, L8_0 = 2, L5_0 = 3, L5_1 = 4, L4_K = 5, L5_K = 6, L6_K = 7 };

constexpr int64_t LP = 32;  // columns a panel

template <int F>
struct LimbLayout {
    static constexpr bool kmin = F == L4_K || F == L5_K;               // s = d sc, o = -dmin mn
    static constexpr bool kquant = kmin || F == L6_K;
    static constexpr bool plus_m = F == L4_1 || F == L5_1;             // o = m
    static constexpr int bits = F == L8_0 ? 8 : F == L6_K ? 6 : (F == L5_0 || F == L5_1 || F == L5_K) ? 5 : 4;
    static constexpr int offset = F == L4_0 ? -8 : F == L5_0 ? -16 : F == L8_0 ? -128 : F == L6_K ? -32 : 0;
    static constexpr int64_t QK = kquant ? 256 : 32;
    static constexpr int64_t subs = QK / 32;                          // sub-blocks of 32 a block
    static constexpr int groups = F == L6_K ? 2 : 1;                  // scales a sub-block
    static constexpr int64_t head = (plus_m || kmin ? 2 : 1) * 2 * LP;  // float16 fields
    static constexpr int64_t scale_bytes = kquant ? 2 * LP : 0;        // a sub-block's
    static constexpr int64_t chunks = bits == 8 ? 8 : bits;            // 64-byte chunks a half
    static constexpr int64_t sub = scale_bytes + 2 * chunks * 64;
    static constexpr int64_t block = head + subs * sub;
};

#ifdef PS_LIMBS_BUILT

constexpr int LIMBS = 4;
constexpr double XMAX = 127.0 * 16843009.0;  // the largest |X| four balanced limbs hold (< 2^31)
constexpr int LMR = 3;                       // rows a pass over a panel

// The rows' limbs: l[i][m * K + k] limb i of row m's X[k]; per row m and block of 32 b (at = m *
// nb + b), scale[at] = 2^e, sum[at] the sum of the block's X and sum16[2 at + j] that of its
// j-th 16 (exact in doubles: < 2^36)
struct RowLimbs {
    std::vector<int8_t> l[LIMBS];
    std::vector<double> scale, sum, sum16;
    int64_t K = 0, nb = 0;
    RowLimbs(int64_t M, int64_t K_) : K(K_), nb(K_ / 32) {
        for (auto& v : l) v.resize(M * K);
        scale.resize(M * nb);
        sum.resize(M * nb);
        sum16.resize(2 * M * nb);
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

#ifdef PS_LIMBS_ZMM

// row m's limbs, the k's in spans of `span` (32, or a K-quant's 256) sharing one exponent: the
// least that keeps the span's largest |x| within XMAX; a span with a non-finite x gets scale NaN
// (its outputs NaN). scale, sum and sum16 stay per block of 32 (a span's blocks share a scale)
void row_limbs(const float* x, int64_t m, RowLimbs& r, int64_t span) {
    const int64_t K = r.K, per = span / 32;
    const __m512i c128 = _mm512_set1_epi32(128), m255 = _mm512_set1_epi32(255);
    for (int64_t b0 = 0; b0 < r.nb; b0 += per) {
        float top = 0.0f;
        bool nan = false;
        for (int64_t b = b0; b < b0 + per; ++b) {
            const float* xb = x + m * K + b * 32;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            top = std::max(top, _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))));
            nan = nan || _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) || _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        }
        const bool finite = !nan && std::isfinite(top);  // (max drops a NaN: asked apart)
        const int e = finite && top > 0.0f ? block_exponent(top) : 0;
        const double scale = finite ? std::ldexp(1.0, e) : std::numeric_limits<double>::quiet_NaN();
        const __m512d inv = _mm512_set1_pd(finite ? std::ldexp(1.0, -e) : 0.0);
        for (int64_t b = b0; b < b0 + per; ++b) {
            const float* xb = x + m * K + b * 32;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const int64_t at = m * r.nb + b;
            r.scale[at] = scale;
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
                // integers below 2^35: exact
                r.sum16[2 * at + h] =
                    _mm512_reduce_add_pd(_mm512_add_pd(_mm512_cvtepi32_pd(lo), _mm512_cvtepi32_pd(hi)));
            }
            r.sum[at] = r.sum16[2 * at] + r.sum16[2 * at + 1];
        }
    }
}

// chunk C's high bits (the 5- and 6-bit formats) moved to bits 4 (and 5) of each byte, the rest
// zero; h the half's high chunks (epi16 shifts: no bit that is kept crosses a byte)
template <int F, int C>
inline __m512i high_bits(const __m512i* h) {
    using L = LimbLayout<F>;
    constexpr int at = L::bits == 5 ? C : 2 * (C % 4);  // where chunk C's bits are in a byte
    const __m512i v = h[L::bits == 5 ? 0 : C / 4];
    const __m512i mask = _mm512_set1_epi8(L::bits == 5 ? 16 : 48);
    if constexpr (at < 4) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - at), mask);
    else if constexpr (at == 4) return _mm512_and_si512(v, mask);
    else return _mm512_and_si512(_mm512_srli_epi16(v, at - 4), mask);
}

template <int F, int C>
inline void add_high(__m512i* w, const __m512i* h) {
    if constexpr (C < 8) {
        const __m512i bits = high_bits<F, C>(h);  // (apart: the intrinsic may be a macro)
        w[C] = _mm512_or_si512(w[C], bits);
        add_high<F, C + 1>(w, h);
    }
}

// a half's quants of one sub-block, unsigned bytes in vpdpbusd's order: w[c] holds k's 4c..4c+3
template <int F>
inline void half_quants(const uint8_t* q, __m512i* w) {
    using L = LimbLayout<F>;
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
        if constexpr (L::bits > 4) {
            __m512i h[2];
            for (int t = 0; t < L::bits - 4; ++t) h[t] = _mm512_loadu_si512(q + 64 * (4 + t));
            add_high<F, 0>(w, h);
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

// sixteen int32 lanes as two vectors of eight doubles
inline void i32_pd(__m512i v, __m512d& lo, __m512d& hi) {
    lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(v));
    hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v, 1));
}

// a half's (16 columns, h) scales of one block of 32 (the K-quants: limbs_super.h): s and o,
// columns 0..7 in [0], 8..15 in [1] (exact: float16s)
template <int F>
inline void half_scales(const uint8_t* blk, int64_t h, __m512d* s, __m512d* o) {
    using L = LimbLayout<F>;
    static_assert(!L::kquant, "the K-quants' scales: limbs_super.h");
    const __m256i* h16 = reinterpret_cast<const __m256i*>(blk);
    const __m256i dh = _mm256_loadu_si256(h16 + h);
    s[0] = half_pd<0>(dh);
    s[1] = half_pd<1>(dh);
    o[0] = o[1] = _mm512_setzero_pd();
    if constexpr (L::plus_m) {
        const __m256i mh = _mm256_loadu_si256(h16 + 2 + h);
        o[0] = half_pd<0>(mh);
        o[1] = half_pd<1>(mh);
    }
}

// the four limbs' exact dot products (a[i], int32, 16 columns) with CG chunks of quants w (the
// chunks from c0 of a block: p[i][c0 + c] the limb's broadcast word of chunk c0 + c)
template <int CG>
inline void group_sums(const __m512i* w, const int32_t* const* p, int c0, __m512i* a) {
#pragma GCC unroll 4
    for (int i = 0; i < LIMBS; ++i) a[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < CG; ++c)
#pragma GCC unroll 4
        for (int i = 0; i < LIMBS; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w[c], _mm512_set1_epi32(p[i][c0 + c]));
}

// one group's four limb sums (int32, 16 columns) into the row's y: limbs 0 and 1, 2 and 3 joined
// in int32 (below 2^29), then T in a double, scaled by the group's scales s and offsets o (the
// row's sum S) and the row's block scale e. The vpdpbusd and the tile paths both end here, so
// they give the same bits by construction
// (FOLDED: the tile path's sums of an offset format, whose quants entered the products as the
// signed u + offset: T + offset S itself, the same integer, so the same double and the same bits
// without the add)
template <int F, bool FOLDED = false>
inline void add_group(const __m512i* a, double S, const __m512d* s, const __m512d* o, __m512d e,
                      __m512d* y) {
    using L = LimbLayout<F>;
    static_assert(!FOLDED || L::offset != 0, "only an offset format's sums fold the offset");
    const __m512i a01 = _mm512_add_epi32(a[0], _mm512_slli_epi32(a[1], 8));
    const __m512i a23 = _mm512_add_epi32(a[2], _mm512_slli_epi32(a[3], 8));
    __m512d l01, h01, l23, h23;
    i32_pd(a01, l01, h01);
    i32_pd(a23, l23, h23);
    const __m512d big = _mm512_set1_pd(65536.0);
    const __m512d t0 = _mm512_fmadd_pd(l23, big, l01), t1 = _mm512_fmadd_pd(h23, big, h01);
    __m512d u0, u1;
    if constexpr (FOLDED) {  // (T + offset S) s: the sums are T + offset S already
        (void)S;
        u0 = _mm512_mul_pd(t0, s[0]);
        u1 = _mm512_mul_pd(t1, s[1]);
    } else if constexpr (L::offset != 0) {  // (T + offset S) s: the sum exact
        const __m512d os = _mm512_set1_pd(S * L::offset);
        u0 = _mm512_mul_pd(_mm512_add_pd(t0, os), s[0]);
        u1 = _mm512_mul_pd(_mm512_add_pd(t1, os), s[1]);
    } else {  // T s + S o
        const __m512d Sv = _mm512_set1_pd(S);
        u0 = _mm512_fmadd_pd(Sv, o[0], _mm512_mul_pd(t0, s[0]));
        u1 = _mm512_fmadd_pd(Sv, o[1], _mm512_mul_pd(t1, s[1]));
    }
    y[0] = _mm512_fmadd_pd(u0, e, y[0]);
    y[1] = _mm512_fmadd_pd(u1, e, y[1]);
}

// MR rows (from m0) of the limbs times one packed panel, HS halves (16 columns each) a pass
// starting at half h0: y[r] accumulates in doubles, groups in order
template <int F, int MR, int HS>
void limb_micro(const RowLimbs& R, int64_t m0, const uint8_t* panel, int64_t h0, const float* bias,
                float* out, int64_t ldo, int64_t ncols) {
    using L = LimbLayout<F>;
    static_assert(!L::kquant, "the K-quants: limb_micro_k");
    constexpr int64_t stride = L::block / L::subs;  // bytes a sub-block, heads spread
    const int64_t K = R.K, nb = R.nb;
    __m512d y[MR][HS][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < HS; ++h) y[r][h][0] = y[r][h][1] = _mm512_setzero_pd();
    for (int64_t b = 0; b < K / L::QK; ++b) {
        const uint8_t* blk = panel + b * L::block;
        for (int64_t j = 0; j < L::subs; ++j) {
            const uint8_t* sb = blk + L::head + j * L::sub;
            for (int64_t i = 0; i < stride; i += 64)
                _mm_prefetch(reinterpret_cast<const char*>(sb + 8 * stride + i), _MM_HINT_T0);
            const int64_t kb = b * L::subs + j;  // the block of 32 k's
#pragma GCC unroll 2
            for (int h = 0; h < HS; ++h) {
                const int64_t hh = h0 + h;
                __m512d s[2], o[2];
                half_scales<F>(blk, hh, s, o);
                __m512i w[8];
                half_quants<F>(sb + L::scale_bytes + hh * L::chunks * 64, w);
#pragma GCC unroll 4
                for (int r = 0; r < MR; ++r) {
                    const int64_t m = m0 + r, at = m * nb + kb;
                    const __m512d e = _mm512_set1_pd(R.scale[at]);
                    const int32_t* p[LIMBS];
#pragma GCC unroll 4
                    for (int i = 0; i < LIMBS; ++i)
                        p[i] = reinterpret_cast<const int32_t*>(R.l[i].data() + m * K + kb * 32);
                    __m512i a[LIMBS];
                    group_sums<8>(w, p, 0, a);
                    add_group<F>(a, R.sum[at], s, o, e, y[r][h]);
                }
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

#include "limbs_super.h"

// rows 0..M-1 of the limbs times one panel: a few rows at a time, each half in turn (the rows'
// limbs then come from the cache for the second half: the activations are read once a panel, as
// the float path's); one row both halves a pass (independent sums in flight)
template <int F>
void panel_rows(const RowLimbs& R, int64_t M, const uint8_t* panel, const float* b, float* o, int64_t N,
                int64_t ncols) {
    constexpr bool kquant = LimbLayout<F>::kquant;  // limbs_super.h's one join a super-block
    int64_t m0 = 0;
    if constexpr (kquant)  // four rows a pass: the K-quants' sums need no float64 registers
        for (; m0 + 4 <= M; m0 += 4)
            for (int64_t h = 0; h < 2; ++h) limb_micro_k<F, 4, 1>(R, m0, panel, h, b, o, N, ncols);
    for (; m0 + LMR <= M; m0 += LMR)
        for (int64_t h = 0; h < 2; ++h) {
            if constexpr (kquant) limb_micro_k<F, LMR, 1>(R, m0, panel, h, b, o, N, ncols);
            else limb_micro<F, LMR, 1>(R, m0, panel, h, b, o, N, ncols);
        }
    for (; m0 + 2 <= M; m0 += 2)
        for (int64_t h = 0; h < 2; ++h) {
            if constexpr (kquant) limb_micro_k<F, 2, 1>(R, m0, panel, h, b, o, N, ncols);
            else limb_micro<F, 2, 1>(R, m0, panel, h, b, o, N, ncols);
        }
    for (; m0 < M; ++m0) {
        if constexpr (kquant) limb_micro_k<F, 1, 2>(R, m0, panel, 0, b, o, N, ncols);
        else limb_micro<F, 1, 2>(R, m0, panel, 0, b, o, N, ncols);
    }
}

#include "limbs_amx.h"
static_assert(TROWS == 16, "ps_limb_linear's TILE_PASS");

#else  // the AVX2 path

#include "limbs_avx2.h"

#endif  // PS_LIMBS_ZMM

template <int F>
void limb_linear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                 const float* bias, float* out) {
    using L = LimbLayout<F>;
    const int64_t panels = (N + LP - 1) / LP, panel_bytes = (K / L::QK) * L::block;
    on_team(M * N * K > (1 << 18), [&] {
        // the rows' limbs: a few rows, each thread its own (no barrier); more, one buffer the
        // team fills (a row a thread) and then reads. The same limbs either way.
        const bool few = M <= LMR;
        std::unique_ptr<RowLimbs> own(few ? new RowLimbs(M, K) : nullptr);
        RowLimbs* shared = own.get();
        if (few) {
            for (int64_t m = 0; m < M; ++m) row_limbs(x, m, *shared, L::QK);
        } else {
#pragma omp single copyprivate(shared)
            shared = new RowLimbs(M, K);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; ++m) row_limbs(x, m, *shared, L::QK);
        }
        const RowLimbs& R = *shared;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint8_t* panel = packed + p * panel_bytes;
            const float* b = bias ? bias + p * LP : nullptr;
            float* o = out + p * LP;
            panel_rows<F>(R, M, panel, b, o, N, std::min<int64_t>(LP, N - p * LP));
        }
        if (!few) {
#pragma omp single
            delete shared;  // every thread is past the loop's barrier
        }
    });
}

// rows of the weight, dequantized as gguf computes them (float32, in its order: the products
// exact, the one add rounded)
template <int F>
void limb_rows(const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
    using L = LimbLayout<F>;
    const int64_t panel_bytes = (K / L::QK) * L::block;
    for (int64_t t = 0; t < T; ++t) {
        const uint8_t* panel = packed + (ids[t] / LP) * panel_bytes;
        const int64_t c = ids[t] % LP, col = c % 16;
        for (int64_t k = 0; k < K; ++k) {
            const uint8_t* blk = panel + (k / L::QK) * L::block;
            const uint8_t* sb = blk + L::head + ((k % L::QK) / 32) * L::sub;
            const uint8_t* q = sb + L::scale_bytes + (c / 16) * L::chunks * 64;
            const int64_t kk = k % 32, chunk = kk / 4, at = col * 4 + kk % 4;
            const uint16_t* h16 = reinterpret_cast<const uint16_t*>(blk);
            const float d = _cvtsh_ss(h16[c]);
            int u;
            if constexpr (F == L8_0) {
                u = q[chunk * 64 + at];
            } else {
                const uint8_t byte = q[(chunk / 2) * 64 + at];
                u = chunk % 2 ? byte >> 4 : byte & 15;
                if constexpr (L::bits == 5) u |= ((q[4 * 64 + at] >> chunk) & 1) << 4;
                if constexpr (L::bits == 6) u |= ((q[(4 + chunk / 4) * 64 + at] >> (2 * (chunk % 4))) & 3) << 4;
            }
            float w;
            if constexpr (L::kmin) {
                const float s = d * static_cast<float>(sb[c]);
                const float o = _cvtsh_ss(h16[LP + c]) * static_cast<float>(sb[LP + c]);
                w = s * static_cast<float>(u) - o;
            } else if constexpr (F == L6_K) {
                const float s = d * static_cast<float>(static_cast<int8_t>(sb[(kk / 16) * LP + c]));
                w = s * static_cast<float>(u + L::offset);
            } else if constexpr (L::plus_m) {
                w = d * static_cast<float>(u) + _cvtsh_ss(h16[LP + c]);
            } else {
                w = d * static_cast<float>(u + L::offset);
            }
            out[t * K + k] = w;
        }
    }
}

#endif  // PS_LIMBS_BUILT

// How a call multiplies: vpdpbusd (or the AVX2 path), AMX tiles, or the tiles' emulation
enum LimbTiles : int { TILES_NONE = 0, TILES_AMX = 1, TILES_EMULATED = 2 };

// the fewest rows worth a tile pass (16 rows, padded with zero rows): a pass costs about as much
// for any number of rows up to 16, and below this many the vpdpbusd path is as fast (measured on
// an Intel Xeon with AMX, bench/limb_tiles.py: the K-quants' passes from 8 rows, the blocks of
// 32's from 10); either path gives the same bits
inline int64_t tile_rows(int fmt) { return fmt == L4_K || fmt == L5_K || fmt == L6_K ? 8 : 10; }
constexpr int64_t TILE_PASS = 16;  // rows a tile pass (limbs_amx.h's TROWS)

// the tiles the automatic choice (ps_limb_linear) takes for many rows, asked once a process:
// PROBSERVE_LIMB_TILES=off none, =emulate the emulation (the AMX kernels' code on any CPU), else
// (unset or "auto") AMX where the CPU has it and Linux grants the tile state; none on the AVX2
// path (kernels/build.py checks the variable's value before it loads the library)
inline int chosen_tiles() {
#ifdef PS_LIMBS_ZMM
    static const int tiles = [] {
        const char* v = std::getenv("PROBSERVE_LIMB_TILES");
        if (v && std::strcmp(v, "off") == 0) return static_cast<int>(TILES_NONE);
        if (v && std::strcmp(v, "emulate") == 0) return static_cast<int>(TILES_EMULATED);
        return static_cast<int>(amx_usable() ? TILES_AMX : TILES_NONE);
    }();
    return tiles;
#else
    return TILES_NONE;
#endif
}

// the format's template instance (F a LimbFormat), or `none` for any other id
template <class Fn, class None>
inline auto by_format(int fmt, Fn&& fn, None&& none) {
    switch (fmt) {
        case L4_0: return fn(std::integral_constant<int, L4_0>{});
        case L4_1: return fn(std::integral_constant<int, L4_1>{});
        case L8_0: return fn(std::integral_constant<int, L8_0>{});
        case L5_0: return fn(std::integral_constant<int, L5_0>{});
        case L5_1: return fn(std::integral_constant<int, L5_1>{});
        case L4_K: return fn(std::integral_constant<int, L4_K>{});
        case L5_K: return fn(std::integral_constant<int, L5_K>{});
        case L6_K: return fn(std::integral_constant<int, L6_K>{});
        default: return none();
    }
}

}  // namespace

extern "C" {

// the tiles ps_limb_linear takes for passes of 16 rows, and for a rest of ps_limb_tile_rows(fmt)
// rows or more: 0 none (vpdpbusd, or the AVX2 path, for every row count), 1 AMX, 2 AMX's
// emulation
int ps_limb_tiles() { return chosen_tiles(); }

// the fewest rows of a rest that ps_limb_linear takes to the tiles, for format `fmt`
int64_t ps_limb_tile_rows(int fmt) { return tile_rows(fmt); }

// the limbs' instruction path this build took: 512 (AVX-512 VNNI: vpdpbusd on 16 columns' lanes),
// 256 (AVX2: vpmaddubsw + vpmaddwd), 0 (none)
int ps_limbs_isa() {
#if defined(PS_LIMBS_ZMM)
    return 512;
#elif defined(PS_LIMBS_BUILT)
    return 256;
#else
    return 0;
#endif
}

// 1 where this build's AVX-512 limb path runs through SIMDe's emulation of its intrinsics
// (PROBSERVE_KERNEL_ISA=avx512-emulated: avx512_emulated.h), else 0
int ps_limbs_emulated() {
#if defined(PS_LIMBS_SIMDE) && !defined(PS_LIMBS_VNNI)
    return 1;
#else
    return 0;
#endif
}

// bytes of one packed block of a limb panel (32 columns, QK k's), or -1 where this build has no
// limb product for the format (no AVX2, or not a native format)
int64_t ps_limb_block_bytes(int fmt) {
#ifdef PS_LIMBS_BUILT
    return by_format(fmt, [](auto f) -> int64_t { return LimbLayout<decltype(f)::value>::block; },
                     []() -> int64_t { return -1; });
#else
    (void)fmt;
    return -1;
#endif
}

// out[M, N] = x[M, K] . w^T + bias on the path `tiles` (a LimbTiles) names, whatever the row
// count; 0 when done, -1 (out untouched) where this build or CPU has no such path: AMX where
// amx_usable() is false, either tile path on the AVX2 build, or no limbs for `fmt`
int ps_limb_linear_on(int tiles, int fmt, const float* x, int64_t M, int64_t K, const uint8_t* packed,
                      int64_t N, const float* bias, float* out) {
#ifdef PS_LIMBS_BUILT
    if (ps_limb_block_bytes(fmt) < 0) return -1;
    if (tiles == TILES_NONE) {
        by_format(fmt, [&](auto f) { limb_linear<decltype(f)::value>(x, M, K, packed, N, bias, out); }, [] {});
        return 0;
    }
#ifdef PS_LIMBS_ZMM
    if (tiles == TILES_AMX && amx_usable()) {
        by_format(fmt, [&](auto f) { limb_linear_tiles<decltype(f)::value, AmxTiles>(x, M, K, packed, N, bias, out); },
                  [] {});
        return 0;
    }
    if (tiles == TILES_EMULATED) {
        by_format(fmt, [&](auto f) { limb_linear_tiles<decltype(f)::value, EmuTiles>(x, M, K, packed, N, bias, out); },
                  [] {});
        return 0;
    }
#endif
#endif
    (void)tiles, (void)fmt, (void)x, (void)M, (void)K, (void)packed, (void)N, (void)bias, (void)out;
    return -1;
}

// out[M, N] = x[M, K] . w^T + bias, w in the limb layout of format `fmt` (ps_limb_block_bytes);
// bias padded with zeros to a multiple of 32 columns (a panel's: InvariantKernels.qpack's), or
// null. On the tiles ps_limb_tiles() names: the rows in whole passes of 16, and the rest too
// where they are tile_rows(fmt) or more; the other rows on vpdpbusd: the same bits either way
void ps_limb_linear(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                    const float* bias, float* out) {
    const int tiles = chosen_tiles();
    const int64_t whole = M % TILE_PASS >= tile_rows(fmt) ? M : M / TILE_PASS * TILE_PASS;  // on the tiles
    if (tiles == TILES_NONE || whole == 0) {
        ps_limb_linear_on(TILES_NONE, fmt, x, M, K, packed, N, bias, out);
        return;
    }
    ps_limb_linear_on(tiles, fmt, x, whole, K, packed, N, bias, out);
    if (whole < M) ps_limb_linear_on(TILES_NONE, fmt, x + whole * K, M - whole, K, packed, N, bias, out + whole * N);
}

// rows `ids` of a weight in the limb layout, dequantized (a tied embedding's lookup)
void ps_limb_rows(int fmt, const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
#ifdef PS_LIMBS_BUILT
    by_format(fmt, [&](auto f) { limb_rows<decltype(f)::value>(packed, K, ids, T, out); }, [] {});
#else
    (void)fmt, (void)packed, (void)K, (void)ids, (void)T, (void)out;
#endif
}

}  // extern "C"
