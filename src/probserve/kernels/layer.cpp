// The decoder layers of one step in one call: the deterministic forward's per-layer chain
// (models/llama.py) run here instead of ~15 Python-dispatched kernel calls a layer.
//
// It calls the very kernels the op-by-op path calls (ps_rms_norm, ps_linear / ps_qlinear,
// ps_rope_cache, ps_attention, ps_silu_mul / ps_gelu_tanh_mul; the q/k head norms as
// ps_head_norms, each head one of ps_rms_norm's rows) on the same inputs, and the
// residual adds are one rounded float32 addition per element as torch's, so the hidden states
// are the same bits as the op-by-op path's (tests/native_util.py holds it to that for
// every family). The per-family differences are fields of PsModel and PsLayer: q/k norms
// (Qwen3, Gemma 3), sandwich norms (Gemma 2/3), GeGLU, sliding windows, soft-capped scores,
// one RoPE table per layer type, biases (Qwen2), weights joined from parts in different block
// formats (Q4_K_M's Q4_K q/k beside a Q6_K v), attention sinks (gpt-oss), and a mixture of
// experts in place of the MLP (PsMoE: the router, ps_route's choice, each chosen expert once on
// the tokens routed to it, the weighted sums in ascending expert id, as models/moe.py).
//
// One OpenMP team runs the whole step: ps_layers opens one parallel region and every thread walks
// the layers together, each kernel's loop shared out over the team (simd.h's on_team), so a
// step forks once instead of ~150 times, and a barrier ends each kernel.
//
// A forward that calls its layers one at a time (the hybrid families', Gemma 4's) runs a layer's
// experts the same way, in one call (ps_experts: the routing given, the same walk as ps_layers'
// mixture, so the same bits as kernels/experts.py's loop, without the ~190 us an expert that
// loop spends in Python and OpenMP's forks at 16 streams).
//
// Work buffers come from the caller (`scratch`, sized by ps_layers_scratch for a token count):
// the Python side keeps one per power-of-two bucket of token counts, so nothing is allocated
// per layer or per step.
#include <vector>

#include "probserve.h"
#include "simd.h"

namespace {

// the widest of a projection's parts where it has several (their outputs pass through `tmp`)
int64_t widest(const PsProj& p) {
    int64_t w = 0;
    if (p.nparts > 1)
        for (int64_t i = 0; i < p.nparts; ++i) w = std::max(w, p.parts[i].n);
    return w;
}

int64_t widest_experts(const PsProj* gate_up, const PsProj* down, int64_t experts) {
    int64_t w = 0;
    for (int64_t e = 0; e < experts; ++e) w = std::max({w, widest(gate_up[e]), widest(down[e])});
    return w;
}

int64_t widest_part(const PsModel* m) {
    int64_t w = 0;
    for (int64_t li = 0; li < m->layers; ++li) {
        const PsLayer& l = m->layer[li];
        w = std::max({w, widest(l.qkv), widest(l.o)});
        if (l.moe)
            w = std::max({w, widest(l.moe->router),
                          widest_experts(l.moe->gate_up, l.moe->down, l.moe->experts)});
        else
            w = std::max({w, widest(l.gate_up), widest(l.down)});
    }
    return w;
}

int64_t most_experts(const PsModel* m) {
    int64_t e = 0;
    for (int64_t li = 0; li < m->layers; ++li)
        if (m->layer[li].moe) e = std::max(e, m->layer[li].moe->experts);
    return e;
}

void part_product(const PsPart& p, const float* x, int64_t T, float* out) {
    if (p.fmt < 0)
        ps_linear(x, T, p.k, static_cast<const float*>(p.data), p.n, p.bias, out);
    else
        ps_qlinear(static_cast<int>(p.fmt), x, T, p.k, static_cast<const uint8_t*>(p.data), p.n,
                   p.bias, out);
}

// out [T, proj.n] = x [T, K] times the projection; `tmp` holds a part's output where there are
// several (each output column is its own row's product: the same bits as one joined weight)
void project(const PsProj& proj, const float* x, int64_t T, float* out, float* tmp) {
    if (proj.nparts == 1) return part_product(proj.parts[0], x, T, out);
    int64_t col = 0;
    for (int64_t i = 0; i < proj.nparts; ++i) {
        const PsPart& p = proj.parts[i];
        part_product(p, x, T, tmp);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) std::copy(tmp + t * p.n, tmp + (t + 1) * p.n, out + t * proj.n + col);
        col += p.n;
    }
}

// h += x, elementwise (one rounded addition each, as torch's)
void add_into(float* h, const float* x, int64_t n) {
    on_team(n > (1 << 16), [&] {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += W) {
            const int64_t c = std::min<int64_t>(W, n - i);
            vstore_n(h + i, vadd(vload_n(h + i, c, 0.0f), vload_n(x + i, c, 0.0f)), c);
        }
    });
}

// buffers carved from a caller's scratch, 64 bytes apart; with a null base it only counts
struct Carver {
    float* base;
    int64_t at = 0;
    float* take(int64_t n) {
        float* p = base ? base + at : nullptr;
        at += (n + 15) / 16 * 16;
        return p;
    }
    int64_t* take_ids(int64_t n) { return reinterpret_cast<int64_t*>(take(2 * n)); }  // 2 floats each
};

// where a layer's experts work: the rows routed to one expert gathered (xg), its [gate | up]
// (gu), activation (act) and output (y), a part's output (tmp); each expert's first routed row
// (count) and, in expert order, the rows' tokens and choices (rows, slot)
struct ExpertBuffers {
    float *xg, *gu, *act, *y, *tmp;
    int64_t *count, *rows, *slot;
};

// the experts' gathered rows, outputs and routing lists (their work buffers gu, act and tmp come
// from carve_expert_work, or from the caller's own: ps_layers gives its MLP's)
void carve_expert_rows(Carver& c, int64_t T, int64_t H, int64_t E, int64_t k, ExpertBuffers& b) {
    b.xg = c.take(T * H);
    b.y = c.take(T * H);
    b.count = c.take_ids(E + 1);
    b.rows = c.take_ids(T * k);
    b.slot = c.take_ids(T * k);
}

void carve_expert_work(Carver& c, int64_t T, int64_t I, int64_t widest, ExpertBuffers& b) {
    b.gu = c.take(T * 2 * I);
    b.act = c.take(T * I);
    b.tmp = c.take(T * widest);
}

struct Buffers {
    float *x, *qkv, *q, *attn, *o, *gu, *act, *tmp;
    float *logits, *w;  // a mixture of experts: router logits, each token's chosen weights
    int64_t* ids;       // and experts
    ExpertBuffers ex;
};

// the step's buffers carved from `scratch`; returns the floats they take, so with a null
// `scratch` it only counts (ps_layers_scratch)
int64_t carve(const PsModel* m, int64_t T, float* scratch, Buffers& b) {
    const int64_t qkv = (m->nq + 2 * m->nkv) * m->d, qd = m->nq * m->d;
    Carver c{scratch};
    b.x = c.take(T * m->hidden);
    b.qkv = c.take(T * qkv);
    b.q = c.take(T * qd);
    b.attn = c.take(T * qd);
    b.o = c.take(T * std::max(m->hidden, m->layer[0].o.n));
    b.gu = c.take(T * 2 * m->inter);
    b.act = c.take(T * m->inter);
    b.tmp = c.take(T * widest_part(m));
    const int64_t E = most_experts(m);
    int64_t K = 1;  // the most experts a token goes to
    for (int64_t li = 0; li < m->layers; ++li)
        if (m->layer[li].moe) K = std::max(K, m->layer[li].moe->top_k);
    if (E) {
        b.logits = c.take(T * E);
        b.w = c.take(T * K);
        b.ids = c.take_ids(T * K);
        carve_expert_rows(c, T, m->hidden, E, K, b.ex);
        b.ex.gu = b.gu;  // the MLP's (m->inter is the widest feed-forward, an expert's included)
        b.ex.act = b.act;
        b.ex.tmp = b.tmp;  // the router's product is done with it before the experts start
    }
    return c.at;
}

// the experts' gated activation: gpt-oss's clamped SwiGLU (limit > 0), GeGLU or SwiGLU
struct ExpertAct {
    float alpha, limit;
    int64_t gelu;
};

// inside the team's parallel region: out [T, H] (zeroed first) = for each token, its experts'
// outputs (ids, w [T, k]: its choices and their weights) summed in ascending expert id. The
// tokens are listed per expert in token order (one thread), then each expert that has any runs
// its [gate | up], gated activation and down once on them, and weight * output is added into
// each token's row (a rounded product, then a rounded sum: models/moe.py's multiply and
// index_add_)
void each_expert(const PsProj* gate_up, const PsProj* down, int64_t E, int64_t I, int64_t H,
                 ExpertAct act, const float* x, int64_t T, const int64_t* ids, const float* w,
                 int64_t k, float* out, const ExpertBuffers& b) {
#pragma omp single
    {
        for (int64_t e = 0; e <= E; ++e) b.count[e] = 0;
        for (int64_t i = 0; i < T * k; ++i) ++b.count[ids[i] + 1];
        for (int64_t e = 0; e < E; ++e) b.count[e + 1] += b.count[e];  // each expert's first row
        std::vector<int64_t> fill(b.count, b.count + E);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < k; ++j) {
                const int64_t at = fill[ids[t * k + j]]++;
                b.rows[at] = t;
                b.slot[at] = j;
            }
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < T * H; ++i) out[i] = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t first = b.count[e], n = b.count[e + 1] - first;
        if (n == 0) continue;
        const int64_t* rows = b.rows + first;
        const int64_t* slot = b.slot + first;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) std::copy(x + rows[r] * H, x + (rows[r] + 1) * H, b.xg + r * H);
        project(gate_up[e], b.xg, n, b.gu, b.tmp);
        if (act.limit > 0.0f)
            ps_gpt_oss_glu(b.gu, n, I, b.act, act.alpha, act.limit);
        else if (act.gelu)
            ps_gelu_tanh_mul(b.gu, n, I, b.act);
        else
            ps_silu_mul(b.gu, n, I, b.act);
        project(down[e], b.act, n, b.y, b.tmp);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            float* o = out + rows[r] * H;
            const float* y = b.y + r * H;
            const vf wr = vset1(w[rows[r] * k + slot[r]]);
            for (int64_t i = 0; i < H; i += W) {
                const int64_t c = std::min<int64_t>(W, H - i);
                vstore_n(o + i, vadd(vload_n(o + i, c, 0.0f), vmul(vload_n(y + i, c, 0.0f), wr)), c);
            }
        }
    }
}

// the layer's mixture of experts over x [T, H] into out [T, H]: the team routes each token (one
// thread: ps_route, the routing kept at the tokens' slots), then runs the experts (each_expert)
void mixture(const PsModel* m, const PsStep* s, const PsMoE& moe, const float* x, int64_t T,
             float* out, const Buffers& b) {
    const int64_t E = moe.experts, k = moe.top_k;
    project(moe.router, x, T, b.logits, b.tmp);
#pragma omp single
    {
        ps_route(b.logits, T, E, k, static_cast<int>(moe.norm), b.ids, b.w);
        if (s->routed) {
            const int64_t row = s->moe_layers * s->top_k;
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t at = s->slots[t] * row + moe.index * s->top_k + j;
                    s->routed[at] = static_cast<int16_t>(b.ids[t * k + j]);
                    s->routed_w[at] = b.w[t * k + j];
                }
        }
    }
    each_expert(moe.gate_up, moe.down, E, moe.inter, m->hidden, {m->alpha, m->limit, m->gelu}, x,
                T, b.ids, b.w, k, out, b.ex);
}

}  // namespace

extern "C" {

// floats of scratch ps_layers needs for T tokens (and room to align it)
int64_t ps_layers_scratch(const PsModel* m, int64_t T) {
    Buffers b{};
    return carve(m, T, nullptr, b) + 16;
}

// every layer of the model over the step's T tokens: h [T, hidden] in, the last layer's
// residual stream out (in place); writes each layer's K and V into the cache
void ps_layers(const PsModel* m, const PsStep* s, float* h, float* scratch) {
    const int64_t T = s->tokens, H = m->hidden, nq = m->nq, nkv = m->nkv, d = m->d;
    if (T == 0) return;
    const int64_t layer_stride = s->cache_slots * nkv * d;
    Buffers b{};
    carve(m, T, scratch, b);
#pragma omp parallel
    for (int64_t li = 0; li < m->layers; ++li) {
        const PsLayer& l = m->layer[li];
        float* kc = s->kc + li * layer_stride;
        float* vc = s->vc + li * layer_stride;
        ps_rms_norm(h, T, H, l.ln1, m->eps, b.x);
        project(l.qkv, b.x, T, b.qkv, b.tmp);
        if (l.q_norm && l.k_norm) {
            if (m->qk_full)
                ps_proj_norms(b.qkv, T, nq, nkv, d, l.q_norm, l.k_norm, m->eps);
            else
                ps_head_norms(b.qkv, T, nq, nkv, d, l.q_norm, l.k_norm, m->eps);
        }
        ps_rope_cache(b.qkv, T, nq, nkv, d, s->cos[l.rope], s->sin[l.rope], s->pos, s->slots, b.q,
                      kc, vc);
        ps_attention(b.q, kc, vc, b.attn, T, nq, nkv, d, m->scale, s->tables, s->width,
                     s->block_size, s->seq, s->len, l.window, m->softcap, l.sinks);
        project(l.o, b.attn, T, b.o, b.tmp);
        if (m->sandwich) {
            ps_rms_norm(b.o, T, H, l.ln2, m->eps, b.o);
            add_into(h, b.o, T * H);
            ps_rms_norm(h, T, H, l.pre_ff, m->eps, b.x);
        } else {
            add_into(h, b.o, T * H);
            ps_rms_norm(h, T, H, l.ln2, m->eps, b.x);
        }
        if (l.moe) {
            mixture(m, s, *l.moe, b.x, T, b.o, b);
        } else {
            const int64_t I = l.gate_up.n / 2;
            project(l.gate_up, b.x, T, b.gu, b.tmp);
            if (m->gelu)
                ps_gelu_tanh_mul(b.gu, T, I, b.act);
            else
                ps_silu_mul(b.gu, T, I, b.act);
            project(l.down, b.act, T, b.o, b.tmp);
        }
        if (m->sandwich) ps_rms_norm(b.o, T, H, l.post_ff, m->eps, b.o);
        add_into(h, b.o, T * H);
    }
}

int64_t ps_experts_scratch(const PsExperts* e, int64_t T, int64_t k) {
    Carver c{nullptr};
    ExpertBuffers b{};
    carve_expert_rows(c, T, e->hidden, e->experts, k, b);
    carve_expert_work(c, T, e->inter, widest_experts(e->gate_up, e->down, e->experts), b);
    return c.at + 16;
}

void ps_experts(const PsExperts* e, const float* x, int64_t T, const int64_t* ids, const float* w,
                int64_t k, float* out, float* scratch) {
    if (T == 0) return;
    Carver c{scratch};
    ExpertBuffers b{};
    carve_expert_rows(c, T, e->hidden, e->experts, k, b);
    carve_expert_work(c, T, e->inter, widest_experts(e->gate_up, e->down, e->experts), b);
#pragma omp parallel
    each_expert(e->gate_up, e->down, e->experts, e->inter, e->hidden, {e->alpha, e->limit, e->gelu},
                x, T, ids, w, k, out, b);
}

void ps_struct_sizes(int64_t* out) {
    out[0] = sizeof(PsPart);
    out[1] = sizeof(PsProj);
    out[2] = sizeof(PsLayer);
    out[3] = sizeof(PsModel);
    out[4] = sizeof(PsStep);
    out[5] = sizeof(PsMoE);
    out[6] = sizeof(PsExperts);
}

}  // extern "C"
