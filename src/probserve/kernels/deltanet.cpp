// Gated DeltaNet's recurrence (Qwen3.5, Qwen3-Next; models/deltanet.py): the causal depthwise
// conv1d + SiLU over a step's rows, then the gated delta rule, token by token, from each
// sequence's state, in ONE fixed order of operations per token and head, whatever the call holds
// (one sequence or many, a whole prompt, a chunk of one, a decode row, a verify step's rows): so a
// position's numbers, and the state a sequence carries past it, are the same bits however its
// prompt was chunked or batched. Threads take whole (sequence, channel block) and (sequence,
// value head) pieces, each one thread's fixed arithmetic.
//
// The conv, per channel c and token t (K taps, tap K - 1 the token itself, the earlier ones from
// the step's rows or the K - 1 inputs the state keeps): acc = in[t - K + 1] w[0], then
// acc = fma(in[t - K + 1 + k], w[k], acc) for k = 1..K-1; then silu(acc) = acc / (1 + exp(-acc))
// (simd.h's vexp, as ps_silu_mul). Elementwise over channels: the vector width never changes a bit.
//
// The rule, per token and value head h (key head h / (nv / nk)), in float32 but for the scalars:
// q and k l2-normed in float64 (x / sqrt(sum x^2 + 1e-6), q also / sqrt(dk), the sums in index
// order), beta = sigmoid(b), g = rate softplus(a + dt_bias) (softplus(x) = x past 20) and
// exp(g) in float64, each rounded to float32 once; then, per column j of the state S [dk, dv],
// independently of every other column (the vector lanes):
//     S[i, j] *= exp(g), mem = sum_i S[i, j] k[i]        (i in order, one FMA a step)
//     d = (v[j] - mem) beta
//     S[i, j] = fma(k[i], d, S[i, j]), o[j] = sum_i S[i, j] q[i]   (i in order, one FMA a step)
#include <cmath>
#include <cstdint>
#include <cstring>

#include "probserve.h"
#include "simd.h"

namespace {

constexpr int64_t CONV_BLOCK = 256;  // channels a conv piece takes
constexpr double L2_EPS = 1e-6;      // the l2 norm's (transformers' and FLA's)
constexpr int RULE_BLOCKS = 4;       // column vectors the rule walks together (rule_columns)

struct Dims {
    int64_t C, K, nk, nv, dk, dv;
};

// a span's fields (ps_gated_delta's `spans` rows)
struct Span {
    int64_t start, end;
    float* conv;   // [K - 1, C]: the last K - 1 inputs, oldest first
    float* delta;  // [nv, dk, dv]
    int64_t first, count;  // its saves: rows [first, first + count) of `saves`
};

inline Span span_at(const int64_t* spans, int64_t s) {
    const int64_t* f = spans + s * 6;
    return {f[0], f[1], reinterpret_cast<float*>(f[2]), reinterpret_cast<float*>(f[3]), f[4], f[5]};
}

inline vf silu(vf x) { return vdiv(x, vadd(vset1(1.0f), vexp(vsub(vzero(), x)))); }

// the conv + SiLU of one span's rows over channels [c0, c1), its state (and saves) updated
void conv_piece(const float* proj, int64_t ld, const Dims& d, const float* w, const Span& sp,
                const int64_t* saves, float* mixed, int64_t c0, int64_t c1) {
    const int64_t n = sp.end - sp.start, K = d.K, C = d.C;
    // the input at concatenated index j: the state's K - 1 columns, then the span's rows
    auto in = [&](int64_t j) -> const float* {
        return j < K - 1 ? sp.conv + j * C : proj + (sp.start + j - (K - 1)) * ld;
    };
    for (int64_t t = 0; t < n; ++t) {
        float* o = mixed + (sp.start + t) * C;
        for (int64_t c = c0; c < c1; c += W) {
            const int64_t m = std::min<int64_t>(W, c1 - c);
            vf acc = vmul(vload_n(in(t) + c, m, 0.0f), vload_n(w + c, m, 0.0f));
            for (int64_t k = 1; k < K; ++k)
                acc = vfma(vload_n(in(t + k) + c, m, 0.0f), vload_n(w + k * C + c, m, 0.0f), acc);
            vstore_n(o + c, silu(acc), m);
        }
    }
    const int64_t bytes = (c1 - c0) * static_cast<int64_t>(sizeof(float));
    for (int64_t s = sp.first; s < sp.first + sp.count; ++s) {  // the inputs up to row r
        const int64_t r = saves[s * 3];
        float* dest = reinterpret_cast<float*>(saves[s * 3 + 1]);
        for (int64_t i = 0; i < K - 1; ++i) std::memcpy(dest + i * C + c0, in(r + 1 + i) + c0, bytes);
    }
    // the last K - 1 inputs (row i reads index n + i >= i: not yet overwritten)
    for (int64_t i = 0; i < K - 1; ++i) std::memmove(sp.conv + i * C + c0, in(n + i) + c0, bytes);
}

// x [n] normed: x / sqrt(sum x^2 + eps) * scale, in float64, each rounded once
inline void l2_normed(const float* x, int64_t n, double scale, float* out) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
    const double f = scale / std::sqrt(sum + L2_EPS);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i] * f);
}

// the rule's two passes over the state's columns [j, j + B W) (B = 1: the last m < W too):
// each column's operations as the header states them, in order; the B vectors' chains are
// independent, so their FMAs' latency overlaps (one vector alone waits on each FMA)
template <int B>
inline void rule_columns(float* S, int64_t dv, int64_t dk, int64_t j, const float* k,
                         const float* q, const float* v, vf decay, vf beta, float* o,
                         int64_t m = W) {
    auto load = [m](const float* p) { return B > 1 ? vload(p) : vload_n(p, m, 0.0f); };
    auto store = [m](float* p, vf x) {
        if (B > 1)
            vstore(p, x);
        else
            vstore_n(p, x, m);
    };
    vf mem[B], acc[B], delta[B];
    for (int b = 0; b < B; ++b) mem[b] = acc[b] = vzero();
    for (int64_t i = 0; i < dk; ++i) {
        float* s = S + i * dv + j;
        const vf ki = vset1(k[i]);
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) {
            const vf si = vmul(load(s + b * W), decay);
            store(s + b * W, si);
            mem[b] = vfma(si, ki, mem[b]);
        }
    }
    for (int b = 0; b < B; ++b) delta[b] = vmul(vsub(load(v + j + b * W), mem[b]), beta);
    for (int64_t i = 0; i < dk; ++i) {
        float* s = S + i * dv + j;
        const vf ki = vset1(k[i]), qi = vset1(q[i]);
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) {
            const vf si = vfma(ki, delta[b], load(s + b * W));
            store(s + b * W, si);
            acc[b] = vfma(si, qi, acc[b]);
        }
    }
    for (int b = 0; b < B; ++b) store(o + j + b * W, acc[b]);
}

// the rule over one span's rows for value head h
void rule_piece(const float* proj, int64_t ld, const Dims& d, const float* rate,
                const float* dt_bias, const Span& sp, const int64_t* saves, const float* mixed,
                float* out, int64_t h, float* q, float* k) {
    const int64_t kh = h / (d.nv / d.nk), dk = d.dk, dv = d.dv, C = d.C;
    const int64_t vd = d.nv * dv, b_col = C + vd, a_col = C + vd + d.nv;
    const double q_scale = 1.0 / std::sqrt(static_cast<double>(dk));
    float* S = sp.delta + h * dk * dv;
    int64_t next = sp.first;  // the next save
    for (int64_t t = 0; t < sp.end - sp.start; ++t) {
        const int64_t row = sp.start + t;
        const float* x = mixed + row * C;
        l2_normed(x + kh * dk, dk, q_scale, q);
        l2_normed(x + d.nk * dk + kh * dk, dk, 1.0, k);
        const float* v = x + 2 * d.nk * dk + h * dv;
        const double b = proj[row * ld + b_col + h];
        const double a = static_cast<double>(proj[row * ld + a_col + h]) + dt_bias[h];
        const vf beta = vset1(static_cast<float>(1.0 / (1.0 + std::exp(-b))));
        const double softplus = a > 20.0 ? a : std::log1p(std::exp(a));
        const vf decay = vset1(static_cast<float>(std::exp(rate[h] * softplus)));
        float* o = out + row * vd + h * dv;
        int64_t j = 0;
        for (; j + RULE_BLOCKS * W <= dv; j += RULE_BLOCKS * W)
            rule_columns<RULE_BLOCKS>(S, dv, dk, j, k, q, v, decay, beta, o);
        for (; j < dv; j += W)
            rule_columns<1>(S, dv, dk, j, k, q, v, decay, beta, o, std::min<int64_t>(W, dv - j));
        if (next < sp.first + sp.count && saves[next * 3] == t) {
            float* dest = reinterpret_cast<float*>(saves[next * 3 + 2]);
            std::memcpy(dest + h * dk * dv, S, static_cast<size_t>(dk * dv) * sizeof(float));
            ++next;
        }
    }
}

}  // namespace

extern "C" {

void ps_gated_delta(const float* proj, int64_t T, int64_t ld, const int64_t* dims,
                    const float* conv_w, const float* rate, const float* dt_bias,
                    const int64_t* spans, int64_t nspans, const int64_t* saves, float* mixed,
                    float* out) {
    const Dims d{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]};
    const int64_t blocks = (d.C + CONV_BLOCK - 1) / CONV_BLOCK;
    on_team(T * d.nv * d.dk * d.dv > (1 << 16), [&] {
#pragma omp for schedule(dynamic, 1)
        for (int64_t piece = 0; piece < nspans * blocks; ++piece) {
            const Span sp = span_at(spans, piece / blocks);
            const int64_t c0 = (piece % blocks) * CONV_BLOCK;
            conv_piece(proj, ld, d, conv_w, sp, saves, mixed, c0, std::min(d.C, c0 + CONV_BLOCK));
        }
        std::vector<float> qk(static_cast<size_t>(2 * d.dk));
#pragma omp for schedule(dynamic, 1)
        for (int64_t piece = 0; piece < nspans * d.nv; ++piece) {
            const Span sp = span_at(spans, piece / d.nv);
            rule_piece(proj, ld, d, rate, dt_bias, sp, saves, mixed, out, piece % d.nv, qk.data(),
                       qk.data() + d.dk);
        }
    });
}

}  // extern "C"
