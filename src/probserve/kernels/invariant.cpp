// Row-invariant float32 kernels: probserve's --deterministic mode (see kernels/__init__.py).
//
// Every output element is computed by one thread with one fixed sequence of floating-point
// operations that depends only on that element's own inputs and on sizes the caller fixes for it
// (K, the hidden size, a row's key count, the vocabulary size), never on how many rows the call
// holds, where they sit in the batch, or how many threads run. So a token's numbers are the same
// bits whether it is alone or among 63 others, in a prompt chunk of any size, cached or not.
//   - linear: y[m, n] accumulates x[m, k] * w[n, k] for k = 0, 1, ..., K-1 in order, one fused
//     multiply-add per step, in chains of KB = 64 k's from zero whose sums are added in order
//     (simd.h's micro: outer-product micro-kernels; a row's result does not depend on the
//     micro-kernel height or the panel a thread takes);
//   - reductions along a row (RMSNorm's sum of squares, softmax's sum, a dot product over the
//     head dimension): W lanes accumulated in order, then one fixed lane tree (the vocabulary
//     normalizer's sum and entropy's two sums in float64 lanes, then the lanes in order);
//   - exp: one vector routine for every element (tails are masked vector operations, never a
//     scalar path that rounds differently).
// Built with -march=native for the machine it runs on (kernels/build.py).
#include "probserve.h"
#include "simd.h"

namespace {

// Attention's inner loops with the sizes known at compile time (head_dim = FAST_NV vectors),
// so the accumulators live in registers. The operations and their order are those of the
// generic loops in ps_attention, so either path gives the same bits.
// The P.V pass takes a tile's (token, head) pairs in groups of up to PG, the columns NV vectors
// at a time, its NV PG accumulators in registers (pv_shape chooses NV and PG per tile); the
// scores take a head of 64, 128 or 256 floats whole (scores_fast<NV>, q in registers where it
// fits, else two heads a key: scores_fast2).
constexpr int FAST_NV = 64 / W;

// scores of n <= W keys for one query head: lane i = q . k_i (W lanes in order, then the lane
// network), times scale
template <int NV>
inline vf scores_fast(const float* qh, const float* kc, const int64_t* offs, int64_t n, float scale) {
    vf qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = vload(qh + c * W);
    vf acc[W];
    for (int i = 0; i < W; ++i) acc[i] = vzero();
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {  // four keys' chains side by side (each key's order unchanged)
        const float *k0 = kc + offs[i], *k1 = kc + offs[i + 1], *k2 = kc + offs[i + 2], *k3 = kc + offs[i + 3];
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        for (int c = 0; c < NV; ++c) {
            a0 = vfma(qv[c], vload(k0 + c * W), a0);
            a1 = vfma(qv[c], vload(k1 + c * W), a1);
            a2 = vfma(qv[c], vload(k2 + c * W), a2);
            a3 = vfma(qv[c], vload(k3 + c * W), a3);
        }
        acc[i] = a0, acc[i + 1] = a1, acc[i + 2] = a2, acc[i + 3] = a3;
    }
    for (; i < n; ++i) {
        const float* kp = kc + offs[i];
        vf a = vzero();
        for (int c = 0; c < NV; ++c) a = vfma(qv[c], vload(kp + c * W), a);
        acc[i] = a;
    }
    return vmul(sum_lanes(acc), vset1(scale));
}

// Whether a head's q (NV vectors) stays in registers beside scores_fast's four keys' chains and
// a key's vector; where it does not (heads of 128 and 256 floats on AVX2's 16 registers), two
// heads take each key (scores_fast2), which reads a key once for both and q from the cache.
template <int NV>
constexpr bool Q_IN_REGISTERS = NV + 5 <= (W == 16 ? 32 : 16);

// scores_fast<NV> for two query heads (q0, q1) over the same n <= W keys, into s0 and s1: each
// (head, key) chain is scores_fast's (its FMAs over c in order from zero, the same lane
// network, the same bits); four keys a pass, each of their vectors read once for both heads
template <int NV>
inline void scores_fast2(const float* q0, const float* q1, const float* kc, const int64_t* offs, int64_t n,
                         float scale, vf& s0, vf& s1) {
    vf acc0[W], acc1[W];
    for (int i = 0; i < W; ++i) acc0[i] = acc1[i] = vzero();
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *k0 = kc + offs[i], *k1 = kc + offs[i + 1], *k2 = kc + offs[i + 2], *k3 = kc + offs[i + 3];
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        vf b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
        for (int c = 0; c < NV; ++c) {  // 6 loads for 8 FMAs (in_register: not 16)
            vf qa = vload(q0 + c * W), qb = vload(q1 + c * W);
            in_register(qa), in_register(qb);
            vf k = vload(k0 + c * W);
            in_register(k);
            a0 = vfma(qa, k, a0), b0 = vfma(qb, k, b0);
            k = vload(k1 + c * W);
            in_register(k);
            a1 = vfma(qa, k, a1), b1 = vfma(qb, k, b1);
            k = vload(k2 + c * W);
            in_register(k);
            a2 = vfma(qa, k, a2), b2 = vfma(qb, k, b2);
            k = vload(k3 + c * W);
            in_register(k);
            a3 = vfma(qa, k, a3), b3 = vfma(qb, k, b3);
        }
        acc0[i] = a0, acc0[i + 1] = a1, acc0[i + 2] = a2, acc0[i + 3] = a3;
        acc1[i] = b0, acc1[i + 1] = b1, acc1[i + 2] = b2, acc1[i + 3] = b3;
    }
    for (; i < n; ++i) {
        const float* kp = kc + offs[i];
        vf a = vzero(), b = vzero();
        for (int c = 0; c < NV; ++c) {
            const vf k = vload(kp + c * W);
            a = vfma(vload(q0 + c * W), k, a);
            b = vfma(vload(q1 + c * W), k, b);
        }
        acc0[i] = a, acc1[i] = b;
    }
    s0 = vmul(sum_lanes(acc0), vset1(scale));
    s1 = vmul(sum_lanes(acc1), vset1(scale));
}

// scores_fast2<NV> for heads of nv = NV vectors where q does not fit the registers: true and
// both heads' scores, or false (then scores_fast_nv, a head at a time)
inline bool scores_fast2_nv(int64_t nv, const float* q0, const float* q1, const float* kc, const int64_t* offs,
                            int64_t n, float scale, vf& s0, vf& s1) {
    if constexpr (!Q_IN_REGISTERS<4 * FAST_NV>) {
        if (nv == 4 * FAST_NV) return scores_fast2<4 * FAST_NV>(q0, q1, kc, offs, n, scale, s0, s1), true;
    }
    if constexpr (!Q_IN_REGISTERS<2 * FAST_NV>) {
        if (nv == 2 * FAST_NV) return scores_fast2<2 * FAST_NV>(q0, q1, kc, offs, n, scale, s0, s1), true;
    }
    return false;
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

// pv_fast<NV, pg> for 1 <= pg <= PG pairs (a switch: the pair count is known only at run time,
// the accumulators' count must be known at compile time)
template <int NV, int PG>
inline void pv_fast_pairs(int64_t pg, vf* acc, const float* vc, const int64_t* offs, int64_t j0, int64_t j1,
                          const float* const* probs) {
    if (pg == PG) pv_fast<NV, PG>(acc, vc, offs, j0, j1, probs);
    else if constexpr (PG > 1) pv_fast_pairs<NV, PG - 1>(pg, acc, vc, offs, j0, j1, probs);
}

// The P.V pass's register shapes, (NV columns, PG pairs): NV PG accumulators, NV of a key's
// values and a probability in registers (AVX-512: 29 of 32; AVX2: 2 x 6 takes 15 of 16 and
// 4 x 2 13, since one more spills an accumulator, which then goes through memory every key; a
// lone pair's 8 x 1 uses each value once, so its values need not stay: 9). Many pairs (a prefill
// tile) take few columns each, few pairs (a decode step's heads of one token) more columns, so
// a group always has 8 or more independent chains.
struct PvShape {
    int64_t nv, pg;
};
inline PvShape pv_shape(int64_t np, int64_t nv) {
    if constexpr (W == 16) return {4, 6};
    if (np >= 6 || (np >= 2 && nv % 4 != 0)) return {2, 6};
    if (np >= 2) return {4, 2};
    return {nv % 8 == 0 ? 8 : nv % 4 == 0 ? 4 : 2, 1};
}

// pv_fast_pairs for a shape pv_shape gives
inline void pv_fast_shape(PvShape sh, int64_t pg, vf* acc, const float* vc, const int64_t* offs, int64_t j0,
                          int64_t j1, const float* const* probs) {
    if constexpr (W == 16) {
        pv_fast_pairs<4, 6>(pg, acc, vc, offs, j0, j1, probs);
    } else {
        if (sh.nv == 2) pv_fast_pairs<2, 6>(pg, acc, vc, offs, j0, j1, probs);
        else if (sh.nv == 4) pv_fast_pairs<4, 2>(pg, acc, vc, offs, j0, j1, probs);
        else pv_fast<8, 1>(acc, vc, offs, j0, j1, probs);
    }
}

// scores_fast<NV> for a head of nv = NV vectors, NV in {FAST_NV, 2 FAST_NV, 4 FAST_NV}
inline vf scores_fast_nv(int64_t nv, const float* qh, const float* kc, const int64_t* offs, int64_t n,
                         float scale) {
    if (nv == 4 * FAST_NV) return scores_fast<4 * FAST_NV>(qh, kc, offs, n, scale);
    if (nv == 2 * FAST_NV) return scores_fast<2 * FAST_NV>(qh, kc, offs, n, scale);
    return scores_fast<FAST_NV>(qh, kc, offs, n, scale);
}

// the k best so far (n of them, best first, ordered by value then id) meet entry `id` of value
// v, offered in id order: it goes in where it beats the k-th (ties keep the lower id)
inline void offer(float* bv, int64_t* bi, int64_t k, int64_t& n, float v, int64_t id) {
    if (n == k && !(v > bv[k - 1])) return;
    int64_t p = n < k ? n++ : k - 1;
    while (p > 0 && v > bv[p - 1]) {
        bv[p] = bv[p - 1];
        bi[p] = bi[p - 1];
        --p;
    }
    bv[p] = v;
    bi[p] = id;
}

// one row of RMSNorm: o = x / sqrt(mean(x^2) + eps) * w (o may be x)
inline void rms_row(const float* xr, int64_t H, const float* w, float eps, float* o) {
    const float inv = 1.0f / std::sqrt(dot(xr, xr, H) / static_cast<float>(H) + eps);
    const vf vi = vset1(inv);
    int64_t i = 0;
    for (; i + W <= H; i += W) vstore(o + i, vmul(vload(w + i), vmul(vload(xr + i), vi)));
    if (i < H)
        vstore_n(o + i, vmul(vload_n(w + i, H - i, 0.0f), vmul(vload_n(xr + i, H - i, 0.0f), vi)),
                 H - i);
}

// out[m, i] = f(gu[m, i], gu[m, I + i]), rows of 2I in ([gate | up]), rows of I out (a gated
// MLP: f(g, u) = act(g) * u, or gpt-oss's clamped form)
template <class F>
inline void glu2(const float* gu, int64_t M, int64_t I, float* out, F f) {
    on_team(M * I > (1 << 15), [&] {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            const float* g = gu + m * 2 * I;
            const float* u = g + I;
            float* o = out + m * I;
            for (int64_t i = 0; i < I; i += W) {
                const int64_t n = std::min<int64_t>(W, I - i);
                vstore_n(o + i, f(vload_n(g + i, n, 0.0f), vload_n(u + i, n, 0.0f)), n);
            }
        }
    });
}

template <class Act>
inline void glu(const float* gu, int64_t M, int64_t I, float* out, Act act) {
    glu2(gu, M, I, out, [&](vf g, vf u) { return vmul(act(g), u); });
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
    on_team(M * N * K > (1 << 18), [&] {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const float* panel = packed + p * K * NR;
            const float* b = bias ? bias + p * NR : nullptr;
            const int64_t ncols = std::min<int64_t>(NR, N - p * NR);
            for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
                const int64_t mr = std::min<int64_t>(MR_MAX, M - m0);
                table[mr - 1](x + m0 * K, K, panel, K, b, out + m0 * N + p * NR, N, ncols);
            }
        }
    });
}

// rows of a packed [N, K] weight: out[t] = w[ids[t]] (a tied embedding read from the head's
// panels, so the weight is held once)
void ps_packed_rows(const float* packed, int64_t K, const int64_t* ids, int64_t T, float* out) {
    on_team(T * K > (1 << 16), [&] {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const float* src = packed + (ids[t] / NR) * K * NR + ids[t] % NR;
            float* o = out + t * K;
            for (int64_t k = 0; k < K; ++k) o[k] = src[k * NR];
        }
    });
}

// out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, per row of H
void ps_rms_norm(const float* x, int64_t M, int64_t H, const float* w, float eps, float* out) {
    on_team(M * H > (1 << 16), [&] {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) rms_row(x + m * H, H, w, eps, out + m * H);
    });
}

// the per-head norms of q and k (Qwen3, Gemma 3), in place: each of the T rows of qkv [T, (nq
// + 2 nkv) d] holds nq q heads (weight qw) then nkv k heads (weight kw) of d; each head is one
// of ps_rms_norm's rows
void ps_head_norms(float* qkv, int64_t T, int64_t nq, int64_t nkv, int64_t d, const float* qw,
                   const float* kw, float eps) {
    const int64_t heads = nq + nkv, row = (nq + 2 * nkv) * d;
    on_team(T * heads * d > (1 << 16), [&] {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < T * heads; ++u) {
            float* r = qkv + (u / heads) * row + (u % heads) * d;
            rms_row(r, d, u % heads < nq ? qw : kw, eps, r);
        }
    });
}

// OLMoE's q/k norms: each token's whole query and whole key projection RMS-normed in place (the
// rows ps_rms_norm would norm over [T, nq d] and [T, nkv d] copies: the same bits)
void ps_proj_norms(float* qkv, int64_t T, int64_t nq, int64_t nkv, int64_t d, const float* qw,
                   const float* kw, float eps) {
    const int64_t row = (nq + 2 * nkv) * d;
    on_team(T * (nq + nkv) * d > (1 << 16), [&] {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < 2 * T; ++u) {
            float* r = qkv + (u / 2) * row + (u % 2 ? nq * d : 0);
            rms_row(r, (u % 2 ? nkv : nq) * d, u % 2 ? kw : qw, eps, r);
        }
    });
}

// SwiGLU: silu(x) = x / (1 + exp(-x))
void ps_silu_mul(const float* gu, int64_t M, int64_t I, float* out) {
    const vf one = vset1(1.0f);
    glu(gu, M, I, out, [&](vf x) { return vdiv(x, vadd(one, vexp(vsub(vzero(), x)))); });
}

// gpt-oss's clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit),
// out = (u + 1) * g * sigmoid(alpha * g), sigmoid(y) = 1 / (1 + exp(-y))
void ps_gpt_oss_glu(const float* gu, int64_t M, int64_t I, float* out, float alpha, float limit) {
    const vf one = vset1(1.0f), a = vset1(-alpha), hi = vset1(limit), lo = vset1(-limit);
    glu2(gu, M, I, out, [&](vf g, vf u) {
        g = vmin(g, hi);
        u = vmax(vmin(u, hi), lo);
        const vf glu = vdiv(g, vadd(one, vexp(vmul(a, g))));
        return vmul(vadd(u, one), glu);
    });
}

// Gemma's GeGLU: gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
// computed as x / (1 + exp(-2u)) (the same function, without 1 + tanh's cancellation for
// negative x)
void ps_gelu_tanh_mul(const float* gu, int64_t M, int64_t I, float* out) {
    const vf one = vset1(1.0f), c = vset1(-2.0f * 0.7978845608028654f), a = vset1(0.044715f);
    glu(gu, M, I, out, [&](vf x) {
        const vf minus_2u = vmul(c, vadd(x, vmul(a, vmul(x, vmul(x, x)))));
        return vdiv(x, vadd(one, vexp(minus_2u)));
    });
}

// x = tanh(x / cap) * cap in place, per element (Gemma 2's final logit soft-capping)
void ps_softcap(float* x, int64_t N, float cap) {
    const vf c = vset1(cap);
    on_team(N > (1 << 16), [&] {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; i += W) {
            const int64_t n = std::min<int64_t>(W, N - i);
            vstore_n(x + i, vmul(vtanh(vdiv(vload_n(x + i, n, 0.0f), c)), c), n);
        }
    });
}

// One layer's RoPE and KV cache write, fused. qkv [T, (nq + 2 nkv) d] holds each token's q, k
// and v heads; token t is at position pos[t] (its rows of the cos and sin tables [P, d]) and
// goes to cache slot slots[t] (kc, vc [slots, nkv, d]). q_out[t, h] = rope(q[t, h]),
// kc[slots[t], h] = rope(k[t, h]), vc[slots[t], h] = v[t, h], with rope(x)_i = x_i cos_i +
// r_i sin_i and r = (-x[d/2:], x[:d/2]): two products and a sum, each rounded (no fused
// multiply-add: -ffp-contract=off), as torch's x * cos + rotate_half(x) * sin computes them.
void ps_rope_cache(const float* qkv, int64_t T, int64_t nq, int64_t nkv, int64_t d,
                   const float* cos, const float* sin, const int64_t* pos, const int64_t* slots,
                   float* q_out, float* kc, float* vc) {
    const int64_t row = (nq + 2 * nkv) * d, half = d / 2;
    on_team(T > 16, [&] {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const float* x = qkv + t * row;
            const float* c = cos + pos[t] * d;
            const float* s = sin + pos[t] * d;
            for (int64_t h = 0; h < nq + nkv; ++h) {
                const float* src = x + h * d;
                float* dst = h < nq ? q_out + (t * nq + h) * d : kc + (slots[t] * nkv + h - nq) * d;
                for (int64_t i = 0; i < half; ++i) dst[i] = src[i] * c[i] + (-src[i + half]) * s[i];
                for (int64_t i = half; i < d; ++i) dst[i] = src[i] * c[i] + src[i - half] * s[i];
            }
            std::copy(x + (nq + nkv) * d, x + row, vc + slots[t] * nkv * d);
        }
    });
}

// a row's max and log(sum exp(x - max)): log_softmax(x)_i = (x_i - max) - lse. The sum is
// taken in float64 lanes (each exp widened exactly; W lanes in index order, then the lanes in
// order) and its log rounded once to float32: a float32 sum of a 49152-entry vocabulary runs
// V / W adds a lane (3072 on AVX-512, 6144 on AVX2), its rounding reaching ~1e-5 of every
// logprob, and differently on each ISA.
inline void row_normalizer(const float* xr, int64_t V, float& max, float& lse) {
    vf mx = vset1(NEG_INF);
    for (int64_t i = 0; i < V; i += W) mx = vmax(mx, vload_n(xr + i, std::min<int64_t>(W, V - i), NEG_INF));
    max = hmax(mx);
    const vf vm = vset1(max);
    vd lo = vzero_d(), hi = vzero_d();
    for (int64_t i = 0; i < V; i += W)
        vadd_wide(vexp(vsub(vload_n(xr + i, std::min<int64_t>(W, V - i), NEG_INF), vm)), lo, hi);
    lse = static_cast<float>(std::log(hsum_wide(lo, hi)));
}

// log_softmax of each row of V: (x - max) - log(sum exp(x - max))
void ps_log_softmax(const float* x, int64_t M, int64_t V, float* out) {
    on_team(M > 1, [&] {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * V;
            float* o = out + m * V;
            float max, lse;
            row_normalizer(xr, V, max, lse);
            const vf vm = vset1(max), vl = vset1(lse);
            for (int64_t i = 0; i < V; i += W) {
                const int64_t n = std::min<int64_t>(W, V - i);
                vstore_n(o + i, vsub(vsub(vload_n(xr + i, n, 0.0f), vm), vl), n);
            }
        }
    });
}

// One token's scores straight from its row of logits, the log-softmax never written out: the
// logprob of target[m], its rank (1 + how many entries exceed it) and the k <= 64 best entries
// by value then id. Every log-probability is computed as ps_log_softmax computes it (the same
// max, lse and two subtractions), and the rank and top-k are those gather-and-compare and
// ps_topk give on ps_log_softmax's output: the same bits, from one read of the row after the
// normalizer's two instead of a write and three more.
void ps_score(const float* x, int64_t M, int64_t V, const int64_t* target, int64_t k,
              float* lp, int64_t* rank, float* vals, int64_t* ids) {
    on_team(M > 1, [&] {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            const float* xr = x + m * V;
            float max, lse;
            row_normalizer(xr, V, max, lse);
            const vf vm = vset1(max), vl = vset1(lse);
            const float chosen = (xr[target[m]] - max) - lse;
            const vf vc = vset1(chosen);
            float* bv = vals + m * k;
            int64_t* bi = ids + m * k;
            int64_t above = 0, n = 0;
            alignas(64) float row[W];
            for (int64_t i = 0; i < V; i += W) {
                const int64_t c = std::min<int64_t>(W, V - i);
                const uint32_t valid = c == W ? static_cast<uint32_t>((1ull << W) - 1) : (1u << c) - 1u;
                const vf v = vsub(vsub(vload_n(xr + i, c, 0.0f), vm), vl);
                above += __builtin_popcount(vmask_gt(v, vc) & valid);
                if (k == 0) continue;
                uint32_t candidates = n < k ? valid : vmask_gt(v, vset1(bv[k - 1])) & valid;
                if (!candidates) continue;
                vstore(row, v);
                for (; candidates; candidates &= candidates - 1) {  // in id order, as ps_topk scans
                    const int64_t j = __builtin_ctz(candidates);
                    offer(bv, bi, k, n, row[j], i + j);
                }
            }
            lp[m] = chosen;
            rank[m] = above + 1;
        }
    });
}

// entropy of each row of log-probabilities, from the row's differences to its largest entry:
// with d_i = lp_i - max, e_i = exp(d_i), n the entries equal to the max and R, D the sums of
// e_i and e_i d_i over the others,
//   H = log(n + R) - D / (n + R)   (log1p(R) when n = 1),
// the entropy of the distribution the row describes. A float32 row's own log-sum-exp error (up
// to ~1e-5, shifting every lp alike) cancels, and R is never added to 1 before the log: a
// near-certain position's entropy (1e-5 nats, or far less) keeps its digits, which -sum exp(lp)
// lp in float32 lost. exp in float32 (the one vector routine), R and D summed in float64 in W
// lanes in index order, then the lanes in order: the same bits for a row in any batch. Terms
// with lp = -inf add 0.
void ps_entropy(const float* lp, int64_t M, int64_t V, float* out) {
    on_team(M > 1, [&] {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            const float* r = lp + m * V;
            vf mx = vset1(NEG_INF);
            for (int64_t i = 0; i < V; i += W) mx = vmax(mx, vload_n(r + i, std::min<int64_t>(W, V - i), NEG_INF));
            const vf top = vset1(hmax(mx)), ninf = vset1(NEG_INF);
            double rest[W] = {}, moment[W] = {};
            int64_t tops = 0;
            alignas(64) float e[W], ed[W];
            for (int64_t i = 0; i < V; i += W) {
                const int64_t c = std::min<int64_t>(W, V - i);
                const uint32_t valid = c == W ? static_cast<uint32_t>((1ull << W) - 1) : (1u << c) - 1u;
                const vf v = vload_n(r + i, c, NEG_INF);
                tops += __builtin_popcount(valid & ~vmask_gt(top, v));
                const vf d = vsub(v, top);
                const vf ev = vselect_gt(v, ninf, vselect_gt(top, v, vexp(d), vzero()), vzero());
                vstore(e, ev);
                vstore(ed, vselect_gt(v, ninf, vmul(ev, d), vzero()));
                for (int j = 0; j < W; ++j) {
                    rest[j] += e[j];
                    moment[j] += ed[j];
                }
            }
            double sum = 0.0, dm = 0.0;
            for (int j = 0; j < W; ++j) {
                sum += rest[j];
                dm += moment[j];
            }
            const double n = static_cast<double>(tops);
            const double log_s = tops == 1 ? std::log1p(sum) : std::log(n + sum);
            out[m] = static_cast<float>(log_s - dm / (n + sum));
        }
    });
}

// the k largest of each row, ordered by value (descending) then id (ascending): one total
// order, so the answer is unique and a row's top-k is a prefix of its top-(k + 1)
void ps_topk(const float* x, int64_t M, int64_t V, int64_t k, float* vals, int64_t* ids) {
    on_team(M > 1, [&] {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            const float* r = x + m * V;
            float* bv = vals + m * k;
            int64_t* bi = ids + m * k;
            if (k <= 64) {
                int64_t n = 0;
                for (int64_t i = 0; i < V; ++i) offer(bv, bi, k, n, r[i], i);
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
    });
}

// One group of ps_attention's P.V pass: columns [c0 W, (c0 + cc) W) of pairs [p0, p0 + pg), the
// keys all of them attend to ([lo_max, first)) and some of them do ([lo_min, last)), and its
// accumulators (acc[p cc + c])
struct PvGroup {
    int64_t c0, cc, p0, pg, first, last, lo_min, lo_max;
    vf* acc;
};
constexpr int64_t PV_KEYS = 32;  // keys a block of the P.V pass (their values at d = 256: 32 KB, 32 pages: an L1's)

// Causal attention of T packed query tokens over a paged KV cache, read in place.
// q [T, nq, d]; kc, vc [slots, nkv, d]; out [T, nq * d]. Token t belongs to the sequence whose
// block table is tables[seq[t]] (width entries of block ids) and attends to its first len[t]
// positions (slot = table[j / block_size] * block_size + j % block_size).
// One unit of work is a tile of up to TQ consecutive tokens of one sequence (a prefill chunk's)
// and one KV head with its group of query heads: K is read from memory once for the tile (a
// block of W keys for all its pairs), V once a block of PV_KEYS keys (then from the cache for
// each group of pairs and columns: a long row's values do not fit it, and a key's head sits a
// page from the next key's, which hardware prefetchers do not cross). The
// arithmetic of each (token, head) is the same whatever its tile: scores in key order (each a
// dot product in W lanes, the lanes of W keys summed together by one fixed network, so key j's
// tree depends on j mod W alone), their max, exp and sum in W lanes, p_j = e_j / sum, then
// sum_j p_j v_j in key order.
// A sliding window (window > 0) keeps the last `window` keys of each token (keys j >= len - window):
// the keys before it are never read; the blocks of W keys stay aligned to j mod W, and a key
// inside a block but before the window scores -inf (weight 0), so a token's numbers do not
// depend on the tile it shares. softcap > 0: each score s becomes tanh(s / softcap) * softcap
// (Gemma 2) after the scale.
void ps_attention(const float* q, const float* kc, const float* vc, float* out, int64_t T,
                  int64_t nq, int64_t nkv, int64_t d, float scale, const int64_t* tables,
                  int64_t width, int64_t block_size, const int64_t* seq, const int64_t* len,
                  int64_t window, float softcap, const float* sinks) {
    constexpr int64_t TQ = 8;   // tokens per tile
    constexpr int64_t R = 24;   // accumulators of the P.V pass off its register path
    const int64_t group = nq / nkv, nv = (d + W - 1) / W, tail = d - (nv - 1) * W;
    // the register paths: scores for heads of 64, 128 or 256 floats, P.V for whole vectors
    const bool fast = tail == W && (nv == FAST_NV || nv == 2 * FAST_NV || nv == 4 * FAST_NV);
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
    int64_t widest = 1;  // tokens in the largest tile (1 in a decode step: buffers sized to it)
    for (int64_t i = 0; i < ntiles; ++i) widest = std::max(widest, tiles[i + 1] - tiles[i]);
    const int64_t stride = longest + W, pairs_max = widest * group;
    on_team(T * nkv > 1, [&] {
        std::vector<float> s(static_cast<size_t>(pairs_max * stride));
        std::vector<int64_t> offs(static_cast<size_t>(longest + W));  // key j: its K/V offset
        std::vector<const float*> qp(static_cast<size_t>(pairs_max));
        std::vector<const float*> probs(static_cast<size_t>(pairs_max));
        std::vector<float*> op(static_cast<size_t>(pairs_max));
        std::vector<int64_t> lp(static_cast<size_t>(pairs_max));
        std::vector<int64_t> lo(static_cast<size_t>(pairs_max));  // a pair's first key
        std::vector<int64_t> hp(static_cast<size_t>(pairs_max));  // a pair's query head
        std::vector<float> mx(static_cast<size_t>(pairs_max * W));
        vf acc[R > W ? R : W];
        // the P.V pass's groups and their accumulators (a tile's pairs times the head's columns)
        std::vector<PvGroup> groups;
        std::vector<float> acc_floats(static_cast<size_t>(((nv + R) * (pairs_max + R) + 1) * W));  // whole groups
        vf* const accs = reinterpret_cast<vf*>(  // aligned to a vector
            (reinterpret_cast<uintptr_t>(acc_floats.data()) + sizeof(vf) - 1) / sizeof(vf) * sizeof(vf));
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < ntiles * nkv; ++u) {
            const int64_t tile = u / nkv, kvh = u % nkv;
            const int64_t t0 = tiles[tile], nt = tiles[tile + 1] - t0, np = nt * group;
            const int64_t Lmax = len[t0 + nt - 1];
            const int64_t first_key = window > 0 ? std::max<int64_t>(0, len[t0] - window) : 0;
            const int64_t jstart = first_key / W * W;  // the first block of W keys read
            const int64_t* table = tables + seq[t0] * width;
            for (int64_t j = first_key; j < Lmax;) {  // block by block: no division per key
                const int64_t b = j / block_size;
                for (int64_t o = j % block_size; o < block_size && j < Lmax; ++o, ++j)
                    offs[j] = ((table[b] * block_size + o) * nkv + kvh) * d;
            }
            for (int64_t i = 0; i < nt; ++i)
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t p = i * group + g, head = kvh * group + g;
                    qp[p] = q + ((t0 + i) * nq + head) * d;
                    op[p] = out + (t0 + i) * nq * d + head * d;
                    lp[p] = len[t0 + i];
                    hp[p] = head;
                    lo[p] = window > 0 ? std::max<int64_t>(0, lp[p] - window) : 0;
                    probs[p] = s.data() + p * stride;
                    vstore(mx.data() + p * W, vset1(NEG_INF));
                }
            // pair p's scores sc of keys [j0, j0 + n) (those before `skip` -inf): soft-capped,
            // stored, its running max updated
            auto finish = [&](int64_t p, int64_t j0, int64_t n, int64_t skip, vf sc) {
                if (softcap > 0.0f) sc = vmul(vtanh(vdiv(sc, vset1(softcap))), vset1(softcap));
                float* sg = s.data() + p * stride + j0;
                vstore_n(sg, sc, n);
                for (int64_t i = 0; i < skip; ++i) sg[i] = NEG_INF;
                vstore(mx.data() + p * W, vmax(vload(mx.data() + p * W), vload_n(sg, n, NEG_INF)));
            };
            // scores: each block of W keys once from memory, for every (token, head) of the tile
            for (int64_t j0 = jstart; j0 < Lmax; j0 += W) {
                for (int64_t p = 0; p < np; ++p) {
                    if (j0 >= lp[p] || j0 + W <= lo[p]) continue;
                    const int64_t n = std::min<int64_t>(W, lp[p] - j0);
                    // keys before the window (the first block of W keys it reaches into) are
                    // not read: they score -inf below
                    const int64_t skip = std::max<int64_t>(0, lo[p] - j0);
                    vf sc, sc2;
                    // the next head of the same token: its scores with this one's (scores_fast2)
                    const bool two = fast && skip == 0 && p + 1 < np && lp[p + 1] == lp[p] && lo[p + 1] == lo[p];
                    if (two && scores_fast2_nv(nv, qp[p], qp[p + 1], kc, offs.data() + j0, n, scale, sc, sc2)) {
                        finish(p, j0, n, skip, sc);
                        ++p;
                        sc = sc2;
                    } else if (fast && skip == 0) {
                        sc = scores_fast_nv(nv, qp[p], kc, offs.data() + j0, n, scale);
                    } else {
                        for (int64_t i = 0; i < W; ++i) acc[i] = vzero();
                        for (int64_t i = skip; i < n; ++i) {
                            const float* kp = kc + offs[j0 + i];
                            vf a = vzero();
                            for (int64_t c = 0; c + 1 < nv; ++c) a = vfma(vload(qp[p] + c * W), vload(kp + c * W), a);
                            const int64_t c = nv - 1;
                            acc[i] = vfma(vload_n(qp[p] + c * W, tail, 0.0f), vload_n(kp + c * W, tail, 0.0f), a);
                        }
                        sc = vmul(sum_lanes(acc), vset1(scale));
                    }
                    finish(p, j0, n, skip, sc);
                }
            }
            for (int64_t p = 0; p < np; ++p) {  // p_j = exp(s_j - max) / sum
                float* sg = s.data() + p * stride;
                const int64_t L = lp[p], j1 = lo[p] / W * W;
                // a sink (gpt-oss): one more logit per head in the softmax, with no value
                const float sink = sinks ? sinks[hp[p]] : NEG_INF;
                const float m = std::max(hmax(vload(mx.data() + p * W)), sink);
                const vf vm = vset1(m);
                vf sum = vzero();
                for (int64_t j = j1; j < L; j += W) {
                    const int64_t n = std::min<int64_t>(W, L - j);
                    const vf e = vexp(vsub(vload_n(sg + j, n, NEG_INF), vm));
                    vstore_n(sg + j, e, n);
                    sum = vadd(sum, e);
                }
                const vf l = vset1(sinks ? hsum(sum) + std::exp(sink - m) : hsum(sum));
                for (int64_t j = j1; j < L; j += W) {
                    const int64_t n = std::min<int64_t>(W, L - j);
                    vstore_n(sg + j, vdiv(vload_n(sg + j, n, 0.0f), l), n);
                }
            }
            // out = sum_j p_j v_j in key order, for groups of hg (token, head) pairs and cn
            // columns, each group's accumulators in `accs`: the keys every pair of a group attends
            // to go a block of PV_KEYS at a time through every group (a block's values read from
            // memory once, then from the cache). Every accumulator sums its keys in key order
            // whatever the grouping and blocks, so neither changes a bit
            const PvShape sh = pv_shape(np, nv);
            const bool fast_pv = tail == W && nv % sh.nv == 0;
            const int64_t cn = fast_pv ? sh.nv : std::min<int64_t>(nv, R);
            const int64_t hg = fast_pv ? sh.pg : std::max<int64_t>(1, R / cn), npg = (np + hg - 1) / hg;
            groups.clear();
            for (int64_t c0 = 0; c0 < nv; c0 += cn)
                for (int64_t p0 = 0; p0 < np; p0 += hg) {
                    PvGroup g{c0, std::min(cn, nv - c0), p0, std::min(hg, np - p0), lp[p0], 0, lo[p0], 0,
                              accs + ((c0 / cn) * npg + p0 / hg) * hg * cn};
                    // keys every pair / some pair attends to: [lo_max, first) / [lo_min, last)
                    for (int64_t p = p0; p < p0 + g.pg; ++p) {
                        g.first = std::min(g.first, lp[p]);
                        g.last = std::max(g.last, lp[p]);
                        g.lo_min = std::min(g.lo_min, lo[p]);
                        g.lo_max = std::max(g.lo_max, lo[p]);
                    }
                    for (int64_t i = 0; i < g.pg * g.cc; ++i) g.acc[i] = vzero();
                    groups.push_back(g);
                }
            // each pair sums its own keys in key order: [lo_min, lo_max) and [first, last) key by
            // key, where some pairs skip a key; [lo_max, first) on the register path where every
            // pair attends to every key
            auto some = [&](const PvGroup& g, int64_t j0, int64_t j1) {
                if (j0 >= j1) return;
                std::copy(g.acc, g.acc + g.pg * g.cc, acc);  // (a local array: no aliasing)
                for (int64_t j = j0; j < j1; ++j) {
                    const float* vp = vc + offs[j] + g.c0 * W;
                    for (int64_t c = 0; c < g.cc; ++c) {
                        const bool full = g.c0 + c + 1 < nv || tail == W;
                        const vf v = full ? vload(vp + c * W) : vload_n(vp + c * W, tail, 0.0f);
                        for (int64_t p = 0; p < g.pg; ++p)
                            if (j >= lo[g.p0 + p] && j < lp[g.p0 + p])
                                acc[p * g.cc + c] = vfma(vset1(probs[g.p0 + p][j]), v, acc[p * g.cc + c]);
                    }
                }
                std::copy(acc, acc + g.pg * g.cc, g.acc);
            };
            auto all_attend = [&](const PvGroup& g) { return fast_pv && g.lo_max < g.first; };
            int64_t from = Lmax, to = 0;  // the keys some group takes on the register path
            for (const PvGroup& g : groups) {
                some(g, g.lo_min, std::min(g.lo_max, g.first));
                if (all_attend(g)) from = std::min(from, g.lo_max), to = std::max(to, g.first);
            }
            for (int64_t b0 = from; b0 < to; b0 += PV_KEYS)
                for (const PvGroup& g : groups) {
                    const int64_t j0 = std::max(b0, g.lo_max), j1 = std::min(b0 + PV_KEYS, g.first);
                    if (all_attend(g) && j0 < j1)
                        pv_fast_shape(sh, g.pg, g.acc, vc + g.c0 * W, offs.data(), j0, j1, probs.data() + g.p0);
                }
            for (const PvGroup& g : groups) {
                some(g, all_attend(g) ? g.first : std::min(g.lo_max, g.first), g.last);
                for (int64_t p = 0; p < g.pg; ++p)
                    for (int64_t c = 0; c < g.cc; ++c) {
                        const bool full = g.c0 + c + 1 < nv || tail == W;
                        float* o = op[g.p0 + p] + (g.c0 + c) * W;
                        if (full) vstore(o, g.acc[p * g.cc + c]);
                        else vstore_n(o, g.acc[p * g.cc + c], tail);
                    }
            }
        }
    });
}

}  // extern "C"
