// A mixture-of-experts router's choice for each token: the k experts of highest probability and
// their weights, from the token's row of router logits alone (so a token's experts and weights
// are the same bits whatever else the step holds).
//
// Per row, scalar code in index order: p_e = exp(l_e - max) / sum_e exp(l_e - max), the exps and
// the sum in float64 (transformers' float32 softmax within float32 rounding); the k largest by
// p descending, ties by expert id ascending (one total order: documented in docs/logprobs.md);
// with `norm`, the chosen p's divided by their sum (in the order chosen, float64), as
// Qwen3-MoE's norm_topk_prob and Mixtral do; each weight then rounded to float32 once.
#include <cmath>
#include <cstdint>
#include <vector>

#include "probserve.h"

extern "C" {

void ps_route(const float* logits, int64_t M, int64_t E, int64_t k, int norm, int64_t* ids, float* weights) {
    std::vector<double> p(static_cast<size_t>(E));
    for (int64_t m = 0; m < M; ++m) {
        const float* row = logits + m * E;
        float top = row[0];
        for (int64_t e = 1; e < E; ++e) top = std::fmax(top, row[e]);
        double total = 0.0;
        for (int64_t e = 0; e < E; ++e) {
            p[e] = std::exp(static_cast<double>(row[e]) - static_cast<double>(top));
            total += p[e];
        }
        int64_t* id = ids + m * k;
        float* w = weights + m * k;
        std::vector<double> chosen(static_cast<size_t>(k));
        double sum = 0.0;
        for (int64_t j = 0; j < k; ++j) {  // selection: the largest not yet taken, lowest id first
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e) {
                bool taken = false;
                for (int64_t i = 0; i < j && !taken; ++i) taken = id[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            id[j] = best;
            chosen[j] = p[best] / total;
            sum += chosen[j];
        }
        for (int64_t j = 0; j < k; ++j) w[j] = static_cast<float>(norm ? chosen[j] / sum : chosen[j]);
    }
}

}  // extern "C"
