// probserve's kernels as the library exports them: every function's prototype and every struct
// the Python side builds, declared once. Each .cpp includes this file, so a definition that
// differs from its prototype does not compile; kernels/build.py reads the prototypes below to
// give ctypes their signatures, and kernels/native_structs.py the structs' sizes (ps_struct_sizes),
// checked against its ctypes mirrors when the library loads.
//
// Types the reader of build.py knows: void, int, int64_t, float, and pointers (any).
#pragma once
#include <cstdint>

#define PS_MAX_PARTS 4  // the parts of one projection (PsProj), kernels/native_structs.py reads it
#define PS_LIMBS 32     // added to a format id: the weight is in limbs.cpp's layout, its product
                        // in integer limbs (ps_qlinear and ps_qrows hand it to limbs.cpp)

extern "C" {

// One weight [n, k] of a layer's projection: float32 panels (fmt < 0, ps_linear) or GGUF blocks
// in quantized.cpp's format `fmt` (ps_qlinear); bias padded to whole panels, or null.
struct PsPart {
    int64_t fmt;
    const void* data;
    const float* bias;
    int64_t n;
    int64_t k;
};

// A projection: its parts' output columns side by side (one part: a plain weight).
struct PsProj {
    int64_t nparts;
    PsPart parts[PS_MAX_PARTS];
    int64_t n;  // the sum of the parts' n
};

// A mixture of experts' feed-forward: the router, each expert's [gate | up] and down, and where
// the routing is kept (its column among the model's MoE layers, PsStep's routed arrays).
struct PsMoE {
    PsProj router;
    int64_t experts, top_k, norm;  // norm: the chosen weights renormalised to sum to 1
    int64_t inter;                 // an expert's width
    const PsProj* gate_up;         // [experts]: rows [gate | up] of 2 inter
    const PsProj* down;            // [experts]
    int64_t index;
};

// A layer's experts alone (ps_experts: a forward that runs its layers one call at a time, the
// hybrid families' and Gemma 4's): each expert's [gate | up] and down, and their activation.
struct PsExperts {
    int64_t experts, inter, hidden;
    const PsProj* gate_up;  // [experts]: rows [gate | up] of 2 inter
    const PsProj* down;     // [experts]
    float alpha, limit;     // limit > 0: gpt-oss's clamped SwiGLU; else GeGLU (gelu) or SwiGLU
    int64_t gelu;
};

struct PsLayer {
    const float* ln1;      // input norm
    const float* ln2;      // Llama: the norm before the MLP; sandwich: of the attention's output
    const float* pre_ff;   // sandwich only: the norms around the MLP
    const float* post_ff;
    const float* q_norm;   // per-head q/k norms, or null
    const float* k_norm;
    PsProj qkv, o, gate_up, down;
    int64_t window;        // sliding window (0: none)
    int64_t rope;          // which RoPE table (PsStep's cos/sin arrays)
    const PsMoE* moe;      // a mixture of experts instead of gate_up/down, or null
    const float* sinks;    // each query head's sink logit (gpt-oss), or null
};

struct PsModel {
    int64_t layers, hidden, nq, nkv, d, inter;  // inter: the widest feed-forward (dense or expert)
    float eps, scale, softcap;  // softcap 0: none
    float alpha, limit;         // the experts' clamped SwiGLU (gpt-oss); limit 0: the activation
    int64_t sandwich, gelu;     // flags
    int64_t qk_full;            // q/k norms over whole projections (OLMoE), not each head
    const PsLayer* layer;
};

// One step's tokens and cache: as ps_rope_cache and ps_attention take them; kc, vc the whole
// cache [layers, slots, nkv, d] (layer li at li * slots * nkv * d).
struct PsStep {
    int64_t tokens;
    const int64_t* pos;
    const int64_t* slots;
    const int64_t* tables;
    int64_t width, block_size;
    const int64_t* seq;
    const int64_t* len;
    float* kc;
    float* vc;
    int64_t cache_slots;
    const float* const* cos;  // per RoPE table [positions, d]
    const float* const* sin;
    int16_t* routed;          // the routing kept per slot: experts [slots, moe_layers, top_k]
    float* routed_w;          // and their weights; both null without MoE layers
    int64_t moe_layers, top_k;
};

// ---- invariant.cpp: the row-invariant float32 kernels -------------------------------------
int ps_lanes();
int ps_panel_width();
void ps_linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t N,
               const float* bias, float* out);
void ps_packed_rows(const float* packed, int64_t K, const int64_t* ids, int64_t T, float* out);
void ps_rms_norm(const float* x, int64_t M, int64_t H, const float* w, float eps, float* out);
void ps_head_norms(float* qkv, int64_t T, int64_t nq, int64_t nkv, int64_t d, const float* qw,
                   const float* kw, float eps);
void ps_proj_norms(float* qkv, int64_t T, int64_t nq, int64_t nkv, int64_t d, const float* qw,
                   const float* kw, float eps);
void ps_silu_mul(const float* gu, int64_t M, int64_t I, float* out);
void ps_gelu_tanh_mul(const float* gu, int64_t M, int64_t I, float* out);
void ps_gpt_oss_glu(const float* gu, int64_t M, int64_t I, float* out, float alpha, float limit);
void ps_softcap(float* x, int64_t N, float cap);
void ps_rope_cache(const float* qkv, int64_t T, int64_t nq, int64_t nkv, int64_t d,
                   const float* cos, const float* sin, const int64_t* pos, const int64_t* slots,
                   float* q_out, float* kc, float* vc);
void ps_log_softmax(const float* x, int64_t M, int64_t V, float* out);
void ps_score(const float* x, int64_t M, int64_t V, const int64_t* target, int64_t k, float* lp,
              int64_t* rank, float* vals, int64_t* ids);
void ps_entropy(const float* lp, int64_t M, int64_t V, float* out);
void ps_topk(const float* x, int64_t M, int64_t V, int64_t k, float* vals, int64_t* ids);
void ps_attention(const float* q, const float* kc, const float* vc, float* out, int64_t T,
                  int64_t nq, int64_t nkv, int64_t d, float scale, const int64_t* tables,
                  int64_t width, int64_t block_size, const int64_t* seq, const int64_t* len,
                  int64_t window, float softcap, const float* sinks);

// ---- route.cpp: a mixture-of-experts router's k experts and weights per token ----------------
void ps_route(const float* logits, int64_t M, int64_t E, int64_t k, int norm, int64_t* ids, float* weights);

// ---- quantized.cpp: the linear layers on GGUF blocks ----------------------------------------
int64_t ps_qblock_bytes(int fmt);
int64_t ps_qblock_len(int fmt);
void ps_qlinear(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                const float* bias, float* out);
int ps_block_sums_flag();
void ps_qrows(int fmt, const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T,
              float* out);

// ---- limbs.cpp: the linear layers on GGUF blocks in integer limbs (AMX, AVX-512 VNNI or AVX2) 
int ps_limbs_isa();
int ps_limbs_emulated();
int ps_limb_tiles();
int64_t ps_limb_tile_rows(int fmt);
int64_t ps_limb_block_bytes(int fmt);
void ps_limb_linear(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N,
                    const float* bias, float* out);
int ps_limb_linear_on(int tiles, int fmt, const float* x, int64_t M, int64_t K, const uint8_t* packed,
                      int64_t N, const float* bias, float* out);
void ps_limb_rows(int fmt, const uint8_t* packed, int64_t K, const int64_t* ids, int64_t T,
                  float* out);

// ---- deltanet.cpp: Gated DeltaNet's conv + SiLU and gated delta rule, one order per token --
// proj [T, ld]: the rows [q k v (C) | z (nv dv) | b (nv) | a (nv)]; dims: C K nk nv dk dv;
// conv_w [K, C]; rate (-exp(A_log)) and dt_bias [nv]; spans [nspans, 6]: start, end, the
// addresses of its conv state [K - 1, C] and delta state [nv, dk, dv] (updated in place), its
// first save and their count; saves [*, 3]: the row (relative to its span's start) and the
// addresses the conv and delta states past it are copied to; mixed [T, C] scratch (the conv's
// output after SiLU); out [T, nv dv] the rule's output.
void ps_gated_delta(const float* proj, int64_t T, int64_t ld, const int64_t* dims,
                    const float* conv_w, const float* rate, const float* dt_bias,
                    const int64_t* spans, int64_t nspans, const int64_t* saves, float* mixed,
                    float* out);

// ---- layer.cpp: a step's decoder layers in one call -------------------------------------------
int64_t ps_layers_scratch(const PsModel* m, int64_t T);
void ps_layers(const PsModel* m, const PsStep* s, float* h, float* scratch);
// one layer's experts over x [T, hidden], token t routed to ids[t, 0..k) with weights w[t, ..]:
// out [T, hidden] = each token's weighted sum of its experts' outputs, as ps_layers' mixture
int64_t ps_experts_scratch(const PsExperts* e, int64_t T, int64_t k);
void ps_experts(const PsExperts* e, const float* x, int64_t T, const int64_t* ids, const float* w,
                int64_t k, float* out, float* scratch);
// sizeof PsPart, PsProj, PsLayer, PsModel, PsStep, PsMoE, PsExperts, in that order, into
// out[0..6]
void ps_struct_sizes(int64_t* out);

}  // extern "C"
