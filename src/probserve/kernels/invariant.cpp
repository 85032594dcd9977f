// Row-invariant float32 kernels: probserve's --deterministic mode (see kernels/__init__.py).
//
// Every output element is computed by one thread with one fixed sequence of floating-point
// operations that depends only on that element's own inputs and on sizes the caller fixes for it
// (K, the hidden size, a row's key count, the vocabulary size), never on how many rows the call
// holds, where they sit in the batch, or how many threads run. So a token's numbers are the same
// bits whether it is alone or among 63 others, in a prompt chunk of any size, cached or not.
//   - linear: y[m, n] accumulates x[m, k] * w[n, k] for k = 0, 1, ..., K-1 in order, one fused
//     multiply-add per step (outer-product micro-kernels; a row's result does not depend on the
//     micro-kernel height or the panel a thread takes);
//   - reductions along a row (RMSNorm's sum of squares, softmax's sum, entropy, a dot product
//     over the head dimension): W lanes accumulated in order, then one fixed lane tree;
//   - exp: one vector routine for every element (tails are masked vector operations, never a
//     scalar path that rounds differently).
// Built with -march=native for the machine it runs on (kernels/build.py).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace {

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
#elif defined(__AVX2__) && defined(__FMA__)
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
#else
#error "probserve's deterministic kernels need a CPU with AVX2 and FMA, or AVX-512"
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

// sum_k a[k] * b[k], W lanes in order then the lane tree
inline float dot(const float* a, const float* b, int64_t n) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + W <= n; i += W) acc = vfma(vload(a + i), vload(b + i), acc);
    if (i < n) acc = vfma(vload_n(a + i, n - i, 0.0f), vload_n(b + i, n - i, 0.0f), acc);
    return hsum(acc);
}

template <int MR>
void micro(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
           float* out, int64_t ldo, int64_t ncols) {
    vf a0[MR], a1[MR];
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = vzero();
    for (int64_t k = 0; k < K; ++k) {
        const vf w0 = vload(panel + k * NR), w1 = vload(panel + k * NR + W);
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) {
            const vf b = vset1(x[r * ldx + k]);
            a0[r] = vfma(b, w0, a0[r]);
            a1[r] = vfma(b, w1, a1[r]);
        }
    }
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

using Micro = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t,
                       int64_t);

template <int... R>
constexpr auto micro_table(std::integer_sequence<int, R...>) {
    return std::array<Micro, sizeof...(R)>{&micro<R + 1>...};
}

// Attention's inner loops with the sizes known at compile time (head_dim = FAST_NV vectors),
// so the accumulators live in registers. The operations and their order are those of the
// generic loops in ps_attention, so either path gives the same bits.
constexpr int FAST_NV = 64 / W;
constexpr int FAST_PG6 = 24 / FAST_NV;  // the P.V pass's pairs per group (R / FAST_NV)
constexpr int FAST_PG3 = 3;             // one token of a 3-heads-per-KV-head model (decode)

// scores of n <= W keys for one query head: lane i = q . k_i (W lanes in order, then the lane
// network), times scale
template <int NV>
inline vf scores_fast(const float* qh, const float* kc, const int64_t* offs, int64_t n, float scale) {
    vf qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = vload(qh + c * W);
    vf acc[W];
    for (int i = 0; i < W; ++i) acc[i] = vzero();
    for (int64_t i = 0; i < n; ++i) {
        const float* kp = kc + offs[i];
        vf a = vzero();
        for (int c = 0; c < NV; ++c) a = vfma(qv[c], vload(kp + c * W), a);
        acc[i] = a;
    }
    return vmul(sum_lanes(acc), vset1(scale));
}

// acc[p * NV + c] += p_j * v_j[c] for keys [j0, j1), PG (token, head) pairs all attending to them
template <int NV, int PG>
inline void pv_fast(vf* acc, const float* vc, const int64_t* offs, int64_t j0, int64_t j1,
                    const float* const* probs) {
    vf a[PG * NV];
    for (int i = 0; i < PG * NV; ++i) a[i] = acc[i];
    for (int64_t j = j0; j < j1; ++j) {
        const float* vp = vc + offs[j];
        vf v[NV];
        for (int c = 0; c < NV; ++c) v[c] = vload(vp + c * W);
        for (int p = 0; p < PG; ++p) {
            const vf pb = vset1(probs[p][j]);
            for (int c = 0; c < NV; ++c) a[p * NV + c] = vfma(pb, v[c], a[p * NV + c]);
        }
    }
    for (int i = 0; i < PG * NV; ++i) acc[i] = a[i];
}

}  // namespace

extern "C" {

int ps_lanes() { return W; }
int ps_panel_width() { return NR; }

// out[M, N] = x[M, K] . w^T + bias; w packed as panels [ceil(N / NR), K, NR] (zero padded);
// bias padded to a multiple of NR, or null.
void ps_linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t N,
               const float* bias, float* out) {
    static constexpr auto table = micro_table(std::make_integer_sequence<int, MR_MAX>{});
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (M * N * K > (1 << 18))
    for (int64_t p = 0; p < panels; ++p) {
        const float* panel = packed + p * K * NR;
        const float* b = bias ? bias + p * NR : nullptr;
        const int64_t ncols = std::min<int64_t>(NR, N - p * NR);
        for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
            const int64_t mr = std::min<int64_t>(MR_MAX, M - m0);
            table[mr - 1](x + m0 * K, K, panel, K, b, out + m0 * N + p * NR, N, ncols);
        }
    }
}

// rows of a packed [N, K] weight: out[t] = w[ids[t]] (a tied embedding read from the head's
// panels, so the weight is held once)
void ps_packed_rows(const float* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
#pragma omp parallel for schedule(static) if (T * K > (1 << 16))
    for (int64_t t = 0; t < T; ++t) {
        const float* src = packed + (ids[t] / NR) * K * NR + ids[t] % NR;
        float* o = out + t * K;
        for (int64_t k = 0; k < K; ++k) o[k] = src[k * NR];
    }
}

// out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, per row of H
void ps_rms_norm(const float* x, int64_t M, int64_t H, const float* w, float eps, float* out) {
#pragma omp parallel for schedule(static) if (M * H > (1 << 16))
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * H;
        float* o = out + m * H;
        const float inv = 1.0f / std::sqrt(dot(xr, xr, H) / static_cast<float>(H) + eps);
        const vf vi = vset1(inv);
        int64_t i = 0;
        for (; i + W <= H; i += W) vstore(o + i, vmul(vload(w + i), vmul(vload(xr + i), vi)));
        if (i < H)
            vstore_n(o + i, vmul(vload_n(w + i, H - i, 0.0f), vmul(vload_n(xr + i, H - i, 0.0f), vi)),
                     H - i);
    }
}

// out[m, i] = silu(gu[m, i]) * gu[m, I + i], rows of 2I in, rows of I out
void ps_silu_mul(const float* gu, int64_t M, int64_t I, float* out) {
    const vf one = vset1(1.0f);
#pragma omp parallel for schedule(static) if (M * I > (1 << 15))
    for (int64_t m = 0; m < M; ++m) {
        const float* g = gu + m * 2 * I;
        const float* u = g + I;
        float* o = out + m * I;
        for (int64_t i = 0; i < I; i += W) {
            const int64_t n = std::min<int64_t>(W, I - i);
            const vf gv = vload_n(g + i, n, 0.0f);
            const vf s = vdiv(gv, vadd(one, vexp(vsub(vzero(), gv))));
            vstore_n(o + i, vmul(s, vload_n(u + i, n, 0.0f)), n);
        }
    }
}

// log_softmax of each row of V: (x - max) - log(sum exp(x - max))
void ps_log_softmax(const float* x, int64_t M, int64_t V, float* out) {
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * V;
        float* o = out + m * V;
        vf mx = vset1(NEG_INF);
        for (int64_t i = 0; i < V; i += W) mx = vmax(mx, vload_n(xr + i, std::min<int64_t>(W, V - i), NEG_INF));
        const vf vm = vset1(hmax(mx));
        vf acc = vzero();
        for (int64_t i = 0; i < V; i += W)
            acc = vadd(acc, vexp(vsub(vload_n(xr + i, std::min<int64_t>(W, V - i), NEG_INF), vm)));
        const vf lse = vset1(std::log(hsum(acc)));
        for (int64_t i = 0; i < V; i += W) {
            const int64_t n = std::min<int64_t>(W, V - i);
            vstore_n(o + i, vsub(vsub(vload_n(xr + i, n, 0.0f), vm), lse), n);
        }
    }
}

// entropy of each row of log-probabilities: -sum exp(lp) * lp (terms with lp = -inf add 0)
void ps_entropy(const float* lp, int64_t M, int64_t V, float* out) {
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; ++m) {
        const float* r = lp + m * V;
        vf acc = vzero();
        for (int64_t i = 0; i < V; i += W) {
            const vf v = vload_n(r + i, std::min<int64_t>(W, V - i), NEG_INF);
            const vf term = vselect_gt(v, vset1(NEG_INF), vmul(vexp(v), v), vzero());
            acc = vsub(acc, term);
        }
        out[m] = hsum(acc);
    }
}

// the k largest of each row, ordered by value (descending) then id (ascending): one total
// order, so the answer is unique and a row's top-k is a prefix of its top-(k + 1)
void ps_topk(const float* x, int64_t M, int64_t V, int64_t k, float* vals, int64_t* ids) {
#pragma omp parallel for schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; ++m) {
        const float* r = x + m * V;
        float* bv = vals + m * k;
        int64_t* bi = ids + m * k;
        if (k <= 64) {
            int64_t n = 0;
            for (int64_t i = 0; i < V; ++i) {
                const float v = r[i];
                if (n == k && !(v > bv[k - 1])) continue;  // ties keep the lower id
                int64_t j = n < k ? n++ : k - 1;
                while (j > 0 && v > bv[j - 1]) {
                    bv[j] = bv[j - 1];
                    bi[j] = bi[j - 1];
                    --j;
                }
                bv[j] = v;
                bi[j] = i;
            }
        } else {
            std::vector<int64_t> order(V);
            std::iota(order.begin(), order.end(), 0);
            std::partial_sort(order.begin(), order.begin() + k, order.end(),
                              [r](int64_t a, int64_t b) { return r[a] > r[b] || (r[a] == r[b] && a < b); });
            for (int64_t j = 0; j < k; ++j) {
                bi[j] = order[j];
                bv[j] = r[order[j]];
            }
        }
    }
}

// Causal attention of T packed query tokens over a paged KV cache, read in place.
// q [T, nq, d]; kc, vc [slots, nkv, d]; out [T, nq * d]. Token t belongs to the sequence whose
// block table is tables[seq[t]] (width entries of block ids) and attends to its first len[t]
// positions (slot = table[j / block_size] * block_size + j % block_size).
// One unit of work is a tile of up to TQ consecutive tokens of one sequence (a prefill chunk's)
// and one KV head with its group of query heads: K and V are read once for the tile. The
// arithmetic of each (token, head) is the same whatever its tile: scores in key order (each a
// dot product in W lanes, the lanes of W keys summed together by one fixed network, so key j's
// tree depends on j mod W alone), their max, exp and sum in W lanes, p_j = e_j / sum, then
// sum_j p_j v_j in key order.
void ps_attention(const float* q, const float* kc, const float* vc, float* out, int64_t T,
                  int64_t nq, int64_t nkv, int64_t d, float scale, const int64_t* tables,
                  int64_t width, int64_t block_size, const int64_t* seq, const int64_t* len) {
    constexpr int64_t TQ = 4;   // tokens per tile
    constexpr int64_t R = 24;   // accumulators of the P.V pass
    const int64_t group = nq / nkv, nv = (d + W - 1) / W, tail = d - (nv - 1) * W;
    const bool fast = nv == FAST_NV && tail == W;
    std::vector<int64_t> tiles;  // first token of each tile, then T
    int64_t longest = 0;
    for (int64_t t = 0; t < T; ++t) {
        longest = std::max(longest, len[t]);
        const int64_t first = tiles.empty() ? -1 : tiles.back();
        if (first < 0 || t - first >= TQ || seq[t] != seq[first] || len[t] != len[t - 1] + 1)
            tiles.push_back(t);
    }
    const int64_t ntiles = static_cast<int64_t>(tiles.size());
    tiles.push_back(T);
    const int64_t stride = longest + W, pairs_max = TQ * group;
    const int64_t cn = std::min<int64_t>(nv, R), hg = std::max<int64_t>(1, R / cn);
#pragma omp parallel if (T * nkv > 1)
    {
        std::vector<float> s(static_cast<size_t>(pairs_max * stride));
        std::vector<int64_t> offs(static_cast<size_t>(longest + W));  // key j: its K/V offset
        std::vector<const float*> qp(static_cast<size_t>(pairs_max));
        std::vector<const float*> probs(static_cast<size_t>(pairs_max));
        std::vector<float*> op(static_cast<size_t>(pairs_max));
        std::vector<int64_t> lp(static_cast<size_t>(pairs_max));
        std::vector<float> mx(static_cast<size_t>(pairs_max * W));
        vf acc[R > W ? R : W];
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < ntiles * nkv; ++u) {
            const int64_t tile = u / nkv, kvh = u % nkv;
            const int64_t t0 = tiles[tile], nt = tiles[tile + 1] - t0, np = nt * group;
            const int64_t Lmax = len[t0 + nt - 1];
            const int64_t* table = tables + seq[t0] * width;
            for (int64_t b = 0, j = 0; j < Lmax; ++b)  // block by block: no division per key
                for (int64_t o = 0; o < block_size && j < Lmax; ++o, ++j)
                    offs[j] = ((table[b] * block_size + o) * nkv + kvh) * d;
            for (int64_t i = 0; i < nt; ++i)
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t p = i * group + g, head = kvh * group + g;
                    qp[p] = q + ((t0 + i) * nq + head) * d;
                    op[p] = out + (t0 + i) * nq * d + head * d;
                    lp[p] = len[t0 + i];
                    probs[p] = s.data() + p * stride;
                    vstore(mx.data() + p * W, vset1(NEG_INF));
                }
            // scores: each block of W keys once from memory, for every (token, head) of the tile
            for (int64_t j0 = 0; j0 < Lmax; j0 += W) {
                for (int64_t p = 0; p < np; ++p) {
                    if (j0 >= lp[p]) continue;
                    const int64_t n = std::min<int64_t>(W, lp[p] - j0);
                    vf sc;
                    if (fast) {
                        sc = scores_fast<FAST_NV>(qp[p], kc, offs.data() + j0, n, scale);
                    } else {
                        for (int64_t i = 0; i < W; ++i) acc[i] = vzero();
                        for (int64_t i = 0; i < n; ++i) {
                            const float* kp = kc + offs[j0 + i];
                            vf a = vzero();
                            for (int64_t c = 0; c + 1 < nv; ++c) a = vfma(vload(qp[p] + c * W), vload(kp + c * W), a);
                            const int64_t c = nv - 1;
                            acc[i] = vfma(vload_n(qp[p] + c * W, tail, 0.0f), vload_n(kp + c * W, tail, 0.0f), a);
                        }
                        sc = vmul(sum_lanes(acc), vset1(scale));
                    }
                    float* sg = s.data() + p * stride + j0;
                    vstore_n(sg, sc, n);
                    vstore(mx.data() + p * W, vmax(vload(mx.data() + p * W), vload_n(sg, n, NEG_INF)));
                }
            }
            for (int64_t p = 0; p < np; ++p) {  // p_j = exp(s_j - max) / sum
                float* sg = s.data() + p * stride;
                const int64_t L = lp[p];
                const vf vm = vset1(hmax(vload(mx.data() + p * W)));
                vf sum = vzero();
                for (int64_t j = 0; j < L; j += W) {
                    const int64_t n = std::min<int64_t>(W, L - j);
                    const vf e = vexp(vsub(vload_n(sg + j, n, NEG_INF), vm));
                    vstore_n(sg + j, e, n);
                    sum = vadd(sum, e);
                }
                const vf l = vset1(hsum(sum));
                for (int64_t j = 0; j < L; j += W) {
                    const int64_t n = std::min<int64_t>(W, L - j);
                    vstore_n(sg + j, vdiv(vload_n(sg + j, n, 0.0f), l), n);
                }
            }
            // out = sum_j p_j v_j in key order, for groups of (token, head) and of columns
            for (int64_t c0 = 0; c0 < nv; c0 += cn) {
                const int64_t cc = std::min(cn, nv - c0);
                for (int64_t p0 = 0; p0 < np; p0 += hg) {
                    const int64_t pg = std::min(hg, np - p0);
                    int64_t first = lp[p0], last = 0;  // keys every pair / some pair attends to
                    for (int64_t p = p0; p < p0 + pg; ++p) {
                        first = std::min(first, lp[p]);
                        last = std::max(last, lp[p]);
                    }
                    for (int64_t i = 0; i < pg * cc; ++i) acc[i] = vzero();
                    int64_t j = 0;
                    if (fast && pg == FAST_PG6) {
                        pv_fast<FAST_NV, FAST_PG6>(acc, vc, offs.data(), 0, first, probs.data() + p0);
                        j = first;
                    } else if (fast && pg == FAST_PG3) {
                        pv_fast<FAST_NV, FAST_PG3>(acc, vc, offs.data(), 0, first, probs.data() + p0);
                        j = first;
                    }
                    for (; j < last; ++j) {
                        const float* vp = vc + offs[j] + c0 * W;
                        for (int64_t c = 0; c < cc; ++c) {
                            const bool full = c0 + c + 1 < nv || tail == W;
                            const vf v = full ? vload(vp + c * W) : vload_n(vp + c * W, tail, 0.0f);
                            for (int64_t p = 0; p < pg; ++p)
                                if (j < lp[p0 + p])
                                    acc[p * cc + c] = vfma(vset1(probs[p0 + p][j]), v, acc[p * cc + c]);
                        }
                    }
                    for (int64_t p = 0; p < pg; ++p)
                        for (int64_t c = 0; c < cc; ++c) {
                            const bool full = c0 + c + 1 < nv || tail == W;
                            float* o = op[p0 + p] + (c0 + c) * W;
                            if (full) vstore(o, acc[p * cc + c]);
                            else vstore_n(o, acc[p * cc + c], tail);
                        }
                }
            }
        }
    }
}

}  // extern "C"
