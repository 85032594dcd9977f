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
// formats (Q4_K_M's Q4_K q/k beside a Q6_K v).
//
// One OpenMP team runs the whole step: ps_layers opens one parallel region and every thread walks
// the layers together, each kernel's loop shared out over the team (simd.h's on_team), so a
// step forks once instead of ~150 times, and a barrier ends each kernel.
//
// Work buffers come from the caller (`scratch`, sized by ps_layers_scratch for a token count):
// the Python side keeps one per power-of-two bucket of token counts, so nothing is allocated
// per layer or per step.
#include "probserve.h"
#include "simd.h"

namespace {

int64_t widest_part(const PsModel* m) {
    int64_t w = 0;
    for (int64_t li = 0; li < m->layers; ++li) {
        const PsLayer& l = m->layer[li];
        for (const PsProj* p : {&l.qkv, &l.o, &l.gate_up, &l.down})
            if (p->nparts > 1)
                for (int64_t i = 0; i < p->nparts; ++i) w = std::max(w, p->parts[i].n);
    }
    return w;
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

struct Buffers {
    float *x, *qkv, *q, *attn, *o, *gu, *act, *tmp;
};

// the step's buffers carved from `scratch` (64-byte steps); returns the floats they take, so
// with a null `scratch` it only counts (ps_layers_scratch)
int64_t carve(const PsModel* m, int64_t T, float* scratch, Buffers& b) {
    const int64_t qkv = (m->nq + 2 * m->nkv) * m->d, qd = m->nq * m->d;
    int64_t at = 0;
    auto take = [&](float*& p, int64_t n) {
        p = scratch ? scratch + at : nullptr;
        at += (n + 15) / 16 * 16;
    };
    take(b.x, T * m->hidden);
    take(b.qkv, T * qkv);
    take(b.q, T * qd);
    take(b.attn, T * qd);
    take(b.o, T * std::max(m->hidden, m->layer[0].o.n));
    take(b.gu, T * 2 * m->inter);
    take(b.act, T * m->inter);
    take(b.tmp, T * widest_part(m));
    return at;
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
        if (l.q_norm && l.k_norm) ps_head_norms(b.qkv, T, nq, nkv, d, l.q_norm, l.k_norm, m->eps);
        ps_rope_cache(b.qkv, T, nq, nkv, d, s->cos[l.rope], s->sin[l.rope], s->pos, s->slots, b.q,
                      kc, vc);
        ps_attention(b.q, kc, vc, b.attn, T, nq, nkv, d, m->scale, s->tables, s->width,
                     s->block_size, s->seq, s->len, l.window, m->softcap, nullptr);
        project(l.o, b.attn, T, b.o, b.tmp);
        if (m->sandwich) {
            ps_rms_norm(b.o, T, H, l.ln2, m->eps, b.o);
            add_into(h, b.o, T * H);
            ps_rms_norm(h, T, H, l.pre_ff, m->eps, b.x);
        } else {
            add_into(h, b.o, T * H);
            ps_rms_norm(h, T, H, l.ln2, m->eps, b.x);
        }
        project(l.gate_up, b.x, T, b.gu, b.tmp);
        if (m->gelu)
            ps_gelu_tanh_mul(b.gu, T, m->inter, b.act);
        else
            ps_silu_mul(b.gu, T, m->inter, b.act);
        project(l.down, b.act, T, b.o, b.tmp);
        if (m->sandwich) ps_rms_norm(b.o, T, H, l.post_ff, m->eps, b.o);
        add_into(h, b.o, T * H);
    }
}

void ps_struct_sizes(int64_t* out) {
    out[0] = sizeof(PsPart);
    out[1] = sizeof(PsProj);
    out[2] = sizeof(PsLayer);
    out[3] = sizeof(PsModel);
    out[4] = sizeof(PsStep);
}

}  // extern "C"
