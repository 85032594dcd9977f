// limbs.cpp's K-quants (Q4_K, Q5_K, Q6_K) on AVX-512 VNNI: one join a super-block. Included by
// limbs.cpp inside its namespace, after the vpdpbusd path's helpers (half_quants, half_pd,
// i32_pd); limbs_amx.h's tile path and limbs_avx2.h's end in the same join, so every path gives
// the same bits.
//
// A K-quant's weight is w = d sc u - dmin mn (Q4_K, Q5_K) or d sc (u - 32) (Q6_K): d and dmin one
// float16 a column per super-block of 256 k's, sc and mn small integers per sub-block (32 k's;
// Q6_K's sc per 16). The row's limbs share one exponent e over the whole super-block
// (row_limbs' span of 256), so the super-block's product is 2^e (d T - dmin Mn) with two
// integers:
//   T  = sum_k X[k] sc u[k]  (Q6_K: sc (u[k] - 32)), exact: below 2^52
//   Mn = sum_j mn_j S_j      (S_j the sub-block's sum of X; Q4_K and Q5_K only), below 2^46
// Here each limb's dot product with a group's quants (vpdpbusd, exact in int32) is multiplied by
// the group's sc in int32 and summed over the super-block (|sum| < 2^28: exact); Q6_K's offset
// is T = sum sc u X - 32 sum_g sc_g S_g, both exact. The four limbs' sums are joined into T in
// float64 (every partial sum an integer below 2^53: exact in any order), and then, per column,
//   q = dmin * Mn            (rounded once; exact for Q6_K: none)
//   u = d * T - q            (one fused rounding)
//   y = y + u * 2^e          (one rounding; the scale by 2^e exact)
// So a super-block costs three roundings of y's float64 sum where a group of 32 k's cost two or
// three before (the limbs' error bound is the span's: max|x| / XMAX of the super-block's).

template <int F>
struct SuperScales {
    using L = LimbLayout<F>;
    static constexpr int NV = L::kmin ? L::subs : L::subs * L::groups;  // mn_j; Q6_K's sc_g
    __m512d d[2], dmin[2];
    __m512d v[NV][2];
};

// a half's (16 columns) float16 fields of one super-block, and (V) its mn (Q4_K, Q5_K) or sc
// (Q6_K) per sub-block or group, as doubles (exact)
template <int F, bool V>
inline void super_scales(const uint8_t* blk, int64_t h, SuperScales<F>& ss) {
    using L = LimbLayout<F>;
    const __m256i* h16 = reinterpret_cast<const __m256i*>(blk);
    const __m256i dh = _mm256_loadu_si256(h16 + h);
    ss.d[0] = half_pd<0>(dh);
    ss.d[1] = half_pd<1>(dh);
    if constexpr (L::kmin) {
        const __m256i mh = _mm256_loadu_si256(h16 + 2 + h);
        ss.dmin[0] = half_pd<0>(mh);
        ss.dmin[1] = half_pd<1>(mh);
    }
    if constexpr (V) {
        for (int64_t j = 0; j < L::subs; ++j) {
            const uint8_t* sb = blk + L::head + j * L::sub;
            for (int g = 0; g < (L::kmin ? 1 : L::groups); ++g) {
                // Q4_K, Q5_K: mn after the sub-block's 32 sc; Q6_K: group g's int8 sc
                const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                    sb + (L::kmin ? LP : g * LP) + 16 * h));
                const int at = L::kmin ? static_cast<int>(j) : static_cast<int>(j) * L::groups + g;
                i32_pd(L::kmin ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes), ss.v[at][0], ss.v[at][1]);
            }
        }
    }
}

// NL int32 sums (16 columns), sum c[s] 2^(8 s), as two vectors of eight doubles: exact (every
// partial sum an integer below 2^53)
template <int NL>
inline void join_limbs(const __m512i* c, __m512d& lo, __m512d& hi) {
    const __m512d base = _mm512_set1_pd(256.0);
    i32_pd(c[NL - 1], lo, hi);
    for (int s = NL - 2; s >= 0; --s) {
        __m512d l, h;
        i32_pd(c[s], l, h);
        lo = _mm512_fmadd_pd(lo, base, l);
        hi = _mm512_fmadd_pd(hi, base, h);
    }
}

// one super-block (b) of row m into its y: T (lo, hi) the joined sums, FOLDED where they hold
// Q6_K's offset already (the tiles' signed quants), else it is added here from the rows' sums
template <int F, bool FOLDED>
inline void add_super(__m512d T0, __m512d T1, const RowLimbs& R, int64_t m, int64_t b, const SuperScales<F>& ss,
                      __m512d* y) {
    using L = LimbLayout<F>;
    const int64_t at = m * R.nb + b * L::subs;  // the super-block's first block of 32
    const __m512d e = _mm512_set1_pd(R.scale[at]);
    __m512d u0, u1;
    if constexpr (L::kmin) {
        __m512d n0 = _mm512_setzero_pd(), n1 = _mm512_setzero_pd();
        for (int64_t j = 0; j < L::subs; ++j) {
            const __m512d S = _mm512_set1_pd(R.sum[at + j]);
            n0 = _mm512_fmadd_pd(S, ss.v[j][0], n0);
            n1 = _mm512_fmadd_pd(S, ss.v[j][1], n1);
        }
        u0 = _mm512_fmsub_pd(ss.d[0], T0, _mm512_mul_pd(ss.dmin[0], n0));
        u1 = _mm512_fmsub_pd(ss.d[1], T1, _mm512_mul_pd(ss.dmin[1], n1));
    } else {
        if constexpr (!FOLDED) {  // T + offset sum_g sc_g S_g: integers, exact
            __m512d o0 = _mm512_setzero_pd(), o1 = _mm512_setzero_pd();
            for (int64_t g = 0; g < L::subs * L::groups; ++g) {
                const __m512d S = _mm512_set1_pd(R.sum16[2 * at + g]);
                o0 = _mm512_fmadd_pd(S, ss.v[g][0], o0);
                o1 = _mm512_fmadd_pd(S, ss.v[g][1], o1);
            }
            const __m512d off = _mm512_set1_pd(L::offset);
            T0 = _mm512_fmadd_pd(off, o0, T0);
            T1 = _mm512_fmadd_pd(off, o1, T1);
        }
        u0 = _mm512_mul_pd(ss.d[0], T0);
        u1 = _mm512_mul_pd(ss.d[1], T1);
    }
    y[0] = _mm512_fmadd_pd(u0, e, y[0]);
    y[1] = _mm512_fmadd_pd(u1, e, y[1]);
}

// y's two vectors (16 columns) rounded to float32, the bias added, into row m's columns from c0
inline void store_half(const __m512d* y, const float* bias, float* out, int64_t c0, int64_t ncols) {
    if (c0 >= ncols) return;
    const __m256 lo = _mm512_cvtpd_ps(y[0]), hi = _mm512_cvtpd_ps(y[1]);
    __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c0));
    const int64_t n = std::min<int64_t>(16, ncols - c0);
    _mm512_mask_storeu_ps(out + c0, static_cast<__mmask16>((1u << n) - 1u), v);
}

// MR rows (from m0) of the limbs times one packed panel of a K-quant, HS halves a pass from h0:
// per super-block the limbs' int32 sums (acc) times each group's sc, then add_super
template <int F, int MR, int HS>
void limb_micro_k(const RowLimbs& R, int64_t m0, const uint8_t* panel, int64_t h0, const float* bias, float* out,
                  int64_t ldo, int64_t ncols) {
    using L = LimbLayout<F>;
    static_assert(L::kquant, "the K-quants' join");
    constexpr int G = L::groups, CG = 8 / G;
    constexpr int64_t stride = L::block / L::subs;
    const int64_t K = R.K;
    __m512d y[MR][HS][2];
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < HS; ++h) y[r][h][0] = y[r][h][1] = _mm512_setzero_pd();
    for (int64_t b = 0; b < K / L::QK; ++b) {
        const uint8_t* blk = panel + b * L::block;
        __m512i acc[MR][HS][LIMBS];
        for (int r = 0; r < MR; ++r)
            for (int h = 0; h < HS; ++h)
                for (int i = 0; i < LIMBS; ++i) acc[r][h][i] = _mm512_setzero_si512();
        for (int64_t j = 0; j < L::subs; ++j) {
            const uint8_t* sb = blk + L::head + j * L::sub;
            for (int64_t i = 0; i < stride; i += 64)
                _mm_prefetch(reinterpret_cast<const char*>(sb + 8 * stride + i), _MM_HINT_T0);
            const int64_t kb = b * L::subs + j;
#pragma GCC unroll 2
            for (int h = 0; h < HS; ++h) {
                const int64_t hh = h0 + h;
                __m512i sc[G];
                for (int g = 0; g < G; ++g) {
                    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * LP + 16 * hh));
                    sc[g] = F == L6_K ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
                }
                __m512i w[8];
                half_quants<F>(sb + L::scale_bytes + hh * L::chunks * 64, w);
#pragma GCC unroll 4
                for (int r = 0; r < MR; ++r) {
                    const int32_t* p[LIMBS];
#pragma GCC unroll 4
                    for (int i = 0; i < LIMBS; ++i)
                        p[i] = reinterpret_cast<const int32_t*>(R.l[i].data() + (m0 + r) * K + kb * 32);
#pragma GCC unroll 2
                    for (int g = 0; g < G; ++g) {
                        __m512i a[LIMBS];
                        group_sums<CG>(w + g * CG, p, g * CG, a);
#pragma GCC unroll 4
                        for (int i = 0; i < LIMBS; ++i)
                            acc[r][h][i] = _mm512_add_epi32(acc[r][h][i], _mm512_mullo_epi32(a[i], sc[g]));
                    }
                }
            }
        }
        for (int h = 0; h < HS; ++h) {
            SuperScales<F> ss;
            super_scales<F, true>(blk, h0 + h, ss);
            for (int r = 0; r < MR; ++r) {
                __m512d T0, T1;
                join_limbs<LIMBS>(acc[r][h], T0, T1);
                add_super<F, false>(T0, T1, R, m0 + r, b, ss, y[r][h]);
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < HS; ++h) store_half(y[r][h], bias, out + (m0 + r) * ldo, (h0 + h) * 16, ncols);
}
