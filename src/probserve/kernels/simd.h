// The vector layer shared by probserve's kernels: one ISA (AVX-512, or AVX2 + FMA + F16C) behind
// small inline functions, the fixed lane-sum network, a vector exp, and the float32 micro-kernel
// of the linear layers (see invariant.cpp for the row-invariance rules they keep).
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// a vector kept in a register where it is used: the compiler may otherwise fold its load into
// each instruction that uses it (a load per use), which costs more than it saves where loads,
// not arithmetic, bound a loop. Changes no value.
template <class V>
inline void in_register(V& a) {
    asm("" : "+v"(a));
}

// The kernels' threads. A kernel's loop is an orphaned `#pragma omp for` run inside on_team:
// called from ps_layers' one parallel region (every thread of the team calls the kernel), the
// loop is shared out over that team, with no fork or join per kernel, its closing barrier the
// only synchronisation; called alone, the kernel forks a team of its own when the work is `big`,
// else runs on the calling thread (a loop outside any region has a team of one). Every output
// is one thread's fixed arithmetic, so how the loop is shared out never changes a bit.
template <class Body>
inline void on_team(bool big, Body&& body) {
    if (big && !omp_in_parallel()) {
#pragma omp parallel
        body();
    } else {
        body();
    }
}

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int MR_MAX = 12;  // rows per micro-kernel: 24 accumulators of 32 registers
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline __mmask16 lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline vf vload_n(const float* p, int64_t n, float fill) {
    return _mm512_mask_loadu_ps(vset1(fill), lanes(n), p);
}
inline void vstore_n(float* p, vf a, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), a); }
inline __m256 high_half(vf a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }
inline float hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
inline float hmax8(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
inline float hsum(vf a) { return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), high_half(a))); }
inline float hmax(vf a) { return hmax8(_mm256_max_ps(_mm512_castps512_ps256(a), high_half(a))); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {  // 2^n for integral n in [-126, 127]
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
}
inline vf vselect_lt(vf a, vf b, vf then, vf other) {  // a < b ? then : other
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), other, then);
}
inline vf vselect_gt(vf a, vf b, vf then, vf other) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), other, then);
}
inline vf vselect_nan(vf a, vf then, vf other) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), other, then);
}
inline uint32_t vmask_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }  // lane i: bit i
// W vectors in, one out whose lanes are the W vectors' sums, in a fixed but permuted order
inline vf sum_lanes_raw(const vf* a) {
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)  // 512 -> 256: two vectors' halves side by side
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // 256 -> 128: one vector per 128-bit lane
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // 4 -> 2 within each 128-bit lane
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}
inline vf vpermute(vf a, const int32_t* idx) {
    return _mm512_permutexvar_ps(_mm512_loadu_si512(idx), a);
}
// GGUF blocks: W float16 scales, W quants of one byte (or of one nibble: vlow4 / vhigh4)
using vi = __m512i;
inline vf vhalf(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vi vload_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi vload_i8(const uint8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi vload_i32(const uint8_t* p) { return _mm512_loadu_si512(p); }  // W int32 lanes
inline vf vcvt(vi a) { return _mm512_cvtepi32_ps(a); }
// the values q + offset of 4-bit quants, from bytes holding two: a 16-entry table lookup
// (vpermps reads an index's low 4 bits, so the low nibble needs no mask)
struct Nibbles {
    vf table;
    explicit Nibbles(int offset) {
        float v[16];
        for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(i + offset);
        table = _mm512_loadu_ps(v);
    }
    explicit Nibbles(const float* values) : table(_mm512_loadu_ps(values)) {}  // any 16 values
    vf lo(vi bytes) const { return _mm512_permutexvar_ps(bytes, table); }
    vf hi(vi bytes) const { return _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table); }
};
using TableNibbles = Nibbles;  // a table of 16 values (MXFP4's E2M1): the same permute
// 2^(e - 128) for E8M0 exponents e in 0..255 (ggml's half scale of MXFP4: e < 2 subnormal)
inline vf e8m0_half(vi e) {
    const __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    const vi normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const vi sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, sub));
}
// integer lanes: the K-quants' packed 6-bit scales, the 5- and 6-bit quants' high bits
inline vi vzero_i() { return _mm512_setzero_si512(); }
inline vi vand_i(vi a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline vi vor_i(vi a, vi b) { return _mm512_or_si512(a, b); }
template <int N> inline vi vsrl_i(vi a) { return _mm512_srli_epi32(a, N); }
template <int N> inline vi vsll_i(vi a) { return _mm512_slli_epi32(a, N); }
inline vf vfms(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }  // a * b - c, one rounding
// float64 lanes: a float32 vector's lanes [0, W/2) and [W/2, W) added (exactly widened) into lo, hi
using vd = __m512d;
inline vd vzero_d() { return _mm512_setzero_pd(); }
inline void vadd_wide(vf a, vd& lo, vd& hi) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(high_half(a)));
}
inline void vstore_d(double* p, vd a) { _mm512_storeu_pd(p, a); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int W = 8;
constexpr int MR_MAX = 6;  // 12 accumulators of 16 registers
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline __m256i lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vload_n(const float* p, int64_t n, float fill) {
    __m256i m = lanes(n);
    return _mm256_blendv_ps(vset1(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void vstore_n(float* p, vf a, int64_t n) { _mm256_maskstore_ps(p, lanes(n), a); }
inline float hsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
inline float hmax(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2i(vf n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
}
inline vf vselect_lt(vf a, vf b, vf then, vf other) {
    return _mm256_blendv_ps(other, then, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
}
inline vf vselect_gt(vf a, vf b, vf then, vf other) {
    return _mm256_blendv_ps(other, then, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
}
inline vf vselect_nan(vf a, vf then, vf other) {
    return _mm256_blendv_ps(other, then, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
inline uint32_t vmask_gt(vf a, vf b) {  // lane i: bit i
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)));
}
inline vf sum_lanes_raw(const vf* a) {
    vf b[4], d[2];
    for (int i = 0; i < 4; ++i)  // 256 -> 128: one vector per 128-bit lane
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)
        d[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(d[0], d[1], 0x88), _mm256_shuffle_ps(d[0], d[1], 0xDD));
}
inline vf vpermute(vf a, const int32_t* idx) {
    return _mm256_permutevar8x32_ps(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)));
}
using vi = __m256i;
inline vf vhalf(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vi vload_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vi vload_i8(const uint8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vi vload_i32(const uint8_t* p) {  // W int32 lanes
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline vf vcvt(vi a) { return _mm256_cvtepi32_ps(a); }
struct Nibbles {  // as AVX-512's, with a mask, an add and a conversion
    vi offset;
    explicit Nibbles(int off) : offset(_mm256_set1_epi32(off)) {}
    vf lo(vi bytes) const {
        return vcvt(_mm256_add_epi32(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), offset));
    }
    vf hi(vi bytes) const { return vcvt(_mm256_add_epi32(_mm256_srli_epi32(bytes, 4), offset)); }
};
struct TableNibbles {  // any 16 values (MXFP4's E2M1): two 8-entry permutes and a blend
    vf t0, t1;
    explicit TableNibbles(const float* values)
        : t0(_mm256_loadu_ps(values)), t1(_mm256_loadu_ps(values + 8)) {}
    vf at(vi idx) const {
        const __m256 high = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
        return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, idx), _mm256_permutevar8x32_ps(t1, idx), high);
    }
    vf lo(vi bytes) const { return at(_mm256_and_si256(bytes, _mm256_set1_epi32(15))); }
    vf hi(vi bytes) const { return at(_mm256_srli_epi32(bytes, 4)); }
};
inline vf e8m0_half(vi e) {  // as AVX-512's
    const vi small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    const vi normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const vi sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, small));
}
inline vi vzero_i() { return _mm256_setzero_si256(); }
inline vi vand_i(vi a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
inline vi vor_i(vi a, vi b) { return _mm256_or_si256(a, b); }
template <int N> inline vi vsrl_i(vi a) { return _mm256_srli_epi32(a, N); }
template <int N> inline vi vsll_i(vi a) { return _mm256_slli_epi32(a, N); }
inline vf vfms(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }
using vd = __m256d;
inline vd vzero_d() { return _mm256_setzero_pd(); }
inline void vadd_wide(vf a, vd& lo, vd& hi) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
}
inline void vstore_d(double* p, vd a) { _mm256_storeu_pd(p, a); }
#else
#error "probserve's deterministic kernels need a CPU with AVX2, FMA and F16C, or AVX-512"
#endif

// Where sum_lanes_raw puts each input's sum, found once by running it on constants.
struct LaneOrder {
    int32_t idx[W];
    LaneOrder() {
        vf a[W];
        for (int i = 0; i < W; ++i) a[i] = vset1(static_cast<float>(i));
        float out[W];
        vstore(out, sum_lanes_raw(a));
        for (int lane = 0; lane < W; ++lane) idx[static_cast<int>(out[lane]) / W] = lane;
    }
};

// lane i: the sum of a[i]'s lanes (each sum a fixed tree, chosen by i alone)
inline vf sum_lanes(const vf* a) {
    static const LaneOrder order;
    return vpermute(sum_lanes_raw(a), order.idx);
}

// the sum of vadd_wide's W float64 lanes (lo's, then hi's), in lane order
inline double hsum_wide(vd lo, vd hi) {
    double l[W];
    vstore_d(l, lo);
    vstore_d(l + W / 2, hi);
    double s = 0.0;
    for (int i = 0; i < W; ++i) s += l[i];
    return s;
}

constexpr int NR = 2 * W;  // columns per packed weight panel
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float POS_INF = std::numeric_limits<float>::infinity();

// exp(x) to ~1 ulp (Cephes' single-precision polynomial); results below FLT_MIN are flushed
// to 0 (exp(-inf) = 0), above the float range +inf, NaN stays NaN.
inline vf vexp(vf x) {
    const vf hi = vset1(88.3762626647949f), lo = vset1(-87.3365447505531f);
    vf c = vmin(vmax(x, lo), hi);
    vf n = vround(vmul(c, vset1(1.44269504088896341f)));
    vf r = vfnma(n, vset1(0.693359375f), c);
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
    vf y = vmul(p, vpow2i(n));
    y = vselect_lt(x, lo, vzero(), y);
    y = vselect_gt(x, hi, vset1(POS_INF), y);
    return vselect_nan(x, x, y);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1): vexp's fixed operations (exp(2x) overflows to inf for large x,
// giving 1; underflows to 0 for very negative x, giving -1)
inline vf vtanh(vf x) {
    const vf one = vset1(1.0f), two = vset1(2.0f);
    const vf y = vsub(one, vdiv(two, vadd(vexp(vmul(x, two)), one)));
    return vselect_nan(x, x, y);
}

// sum_k a[k] * b[k], W lanes in order then the lane tree
inline float dot(const float* a, const float* b, int64_t n) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + W <= n; i += W) acc = vfma(vload(a + i), vload(b + i), acc);
    if (i < n) acc = vfma(vload_n(a + i, n - i, 0.0f), vload_n(b + i, n - i, 0.0f), acc);
    return hsum(acc);
}

// out[r, :ncols] = a0[r] | a1[r] (+ bias): a micro-kernel's tile, tails stored masked
template <int MR>
inline void store_tile(const vf* a0, const vf* a1, const float* bias, float* out, int64_t ldo,
                       int64_t ncols) {
    for (int r = 0; r < MR; ++r) {
        vf y0 = a0[r], y1 = a1[r];
        if (bias) {
            y0 = vadd(y0, vload(bias));
            y1 = vadd(y1, vload(bias + W));
        }
        float* o = out + r * ldo;
        if (ncols == NR) {
            vstore(o, y0);
            vstore(o + W, y1);
        } else if (ncols > W) {
            vstore(o, y0);
            vstore_n(o + W, y1, ncols - W);
        } else {
            vstore_n(o, y0, ncols);
        }
    }
}

// The linear layers' sums over k come in chains of KB consecutive k (k in [i KB, (i + 1) KB)):
// each chain accumulates from zero, one FMA a step, and the chains' sums are added in order
// into the output's total (t = t + chain, t from zero). A float32 sum of K products in one chain
// rounds against a running sum that grows with k (error ~ K roundings: at K = 576 and 1536,
// SmolLM2's prompt logprobs drifted 1.2e-4 from a float64 forward where transformers' float32
// drifted 4.2e-5); in chains, ~KB + K / KB (then 2.6e-6 to 2.5e-5). The order depends on k
// alone, never on rows or threads, and every linear kernel (float32, and the quantized ones on
// their dequantized weights) keeps it, so their bits stay equal. A multiple of every GGUF
// sub-block (16, 32): they fold at their ends.
constexpr int64_t KB = 64;

// t[r] += a[r], then a[r] = 0: one chain of an MR-row tile folded into its totals
template <int MR>
inline void fold(vf* t0, vf* t1, vf* a0, vf* a1) {
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
        t0[r] = vadd(t0[r], a0[r]);
        t1[r] = vadd(t1[r], a1[r]);
        a0[r] = a1[r] = vzero();
    }
}

// one step k of an MR-row tile: a[r] += x[r, k] * w, one FMA per output (the only arithmetic
// the linear kernels accumulate with, whatever the weights' storage)
template <int MR>
inline void accumulate(vf* a0, vf* a1, const float* x, int64_t ldx, int64_t k, vf w0, vf w1) {
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
        const vf b = vset1(x[r * ldx + k]);
        a0[r] = vfma(b, w0, a0[r]);
        a1[r] = vfma(b, w1, a1[r]);
    }
}

// MR rows of x times one panel [K, NR]: each output accumulates over k in order, one FMA a step,
// in chains of KB k's folded into its total
template <int MR>
void micro(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
           float* out, int64_t ldo, int64_t ncols) {
    vf a0[MR], a1[MR], t0[MR], t1[MR];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = t0[r] = t1[r] = vzero();
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = std::min<int64_t>(K, k0 + KB);
        for (int64_t k = k0; k < k1; ++k) {
            // the panel's lines, requested ahead of use (a prefetch never faults past the end)
            _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 16) * NR), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 16) * NR + NR / 2), _MM_HINT_T0);
            accumulate<MR>(a0, a1, x, ldx, k, vload(panel + k * NR), vload(panel + k * NR + W));
        }
        fold<MR>(t0, t1, a0, a1);
    }
    store_tile<MR>(t0, t1, bias, out, ldo, ncols);
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                       int64_t);

// body(std::integral_constant<int, J>{}) for J = 0..N-1, unrolled (J a constant in each)
template <class Body, int... J>
inline void static_for_seq(Body&& body, std::integer_sequence<int, J...>) {
    (body(std::integral_constant<int, J>{}), ...);
}
template <int N, class Body>
inline void static_for(Body&& body) {
    static_for_seq(body, std::make_integer_sequence<int, N>{});
}

template <int... R>
constexpr auto micro_table(std::integer_sequence<int, R...>) {
    return std::array<Micro, sizeof...(R)>{&micro<R + 1>...};
}


}  // namespace
