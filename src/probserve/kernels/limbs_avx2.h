// limbs.cpp's AVX2 path (a CPU without AVX-512 VNNI, or PROBSERVE_KERNEL_ISA=avx2): the same
// limbs, layout, groups and float64 sums, the same error bound, its own integer dot products.
// Included by limbs.cpp inside its namespace, after RowLimbs and LimbLayout.
//
// AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned bytes (the quants) by signed ones (a limb)
// and adds pairs into int16 lanes, saturating; vpmaddwd by ones then adds pairs of those into
// int32. A pair is at most 2 * 128 * umax (umax the largest quant: 15, 31 or 63), so runs of 8,
// 4 or 2 chunks (4 k's each) sum exactly in int16 (at most 30720, 31744, 32256) before one
// widening. Q8_0's quants (0..255) would saturate a pair: each is split into its two nibbles,
// two 4-bit runs, joined in int32 as lo + 16 hi. Every sum is exact, so a row's T and S, and from
// there its outputs, are those of the AVX-512 path's arithmetic (the same bits, tests check).
// A pass is one row and 8 columns (a quarter of a panel: 16 ymm registers), over all of K.

// row m's limbs (scalar: O(K), beside the O(N K) product), the k's in spans of `span` sharing
// one exponent (the AVX-512 path's row_limbs); nearbyint rounds to nearest even, as the AVX-512
// path's conversion
void row_limbs(const float* x, int64_t m, RowLimbs& r, int64_t span) {
    const int64_t K = r.K, per = span / 32;
    for (int64_t b0 = 0; b0 < r.nb; b0 += per) {
        float top = 0.0f;
        bool finite = true;
        for (int64_t k = 0; k < span; ++k) {
            const float v = x[m * K + b0 * 32 + k];
            finite = finite && std::isfinite(v);
            top = std::max(top, std::fabs(v));
        }
        const int e = finite && top > 0.0f ? block_exponent(top) : 0;
        const double inv = finite ? std::ldexp(1.0, -e) : 0.0;
        for (int64_t b = b0; b < b0 + per; ++b) {
            const float* xb = x + m * K + b * 32;
            const int64_t at = m * r.nb + b;
            r.scale[at] = finite ? std::ldexp(1.0, e) : std::numeric_limits<double>::quiet_NaN();
            double half[2] = {0.0, 0.0};
            for (int k = 0; k < 32; ++k) {
                const double v = finite ? static_cast<double>(xb[k]) * inv : 0.0;  // (NaN: no int)
                const int32_t X = static_cast<int32_t>(std::nearbyint(v));
                int32_t rest = X;
                for (int i = 0; i < LIMBS; ++i) {
                    const int32_t a = i == LIMBS - 1 ? rest : ((rest + 128) & 255) - 128;
                    r.l[i][m * K + b * 32 + k] = static_cast<int8_t>(a);
                    rest = (rest - a) >> 8;
                }
                half[k / 16] += static_cast<double>(X);
            }
            r.sum16[2 * at] = half[0];
            r.sum16[2 * at + 1] = half[1];
            r.sum[at] = half[0] + half[1];
        }
    }
}

// chunk C's high bits (5- and 6-bit formats) at bits 4 (and 5) of each byte, the rest zero
template <int F, int C>
inline __m256i high_bits8(const __m256i* h) {
    using L = LimbLayout<F>;
    constexpr int at = L::bits == 5 ? C : 2 * (C % 4);
    const __m256i v = h[L::bits == 5 ? 0 : C / 4];
    const __m256i mask = _mm256_set1_epi8(L::bits == 5 ? 16 : 48);
    if constexpr (at < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - at), mask);
    else if constexpr (at == 4) return _mm256_and_si256(v, mask);
    else return _mm256_and_si256(_mm256_srli_epi16(v, at - 4), mask);
}

template <int F, int C>
inline void add_high8(__m256i* w, const __m256i* h) {
    if constexpr (C < 8) {
        w[C] = _mm256_or_si256(w[C], high_bits8<F, C>(h));
        add_high8<F, C + 1>(w, h);
    }
}

// a quarter's quants of one sub-block (q: the chunks' bytes of its 8 columns), unsigned bytes:
// w[c] holds k's 4c..4c+3 (Q8_0: its int8 + 128, split later)
template <int F>
inline void quarter_quants(const uint8_t* q, __m256i* w) {
    using L = LimbLayout<F>;
    if constexpr (F == L8_0) {
        for (int c = 0; c < 8; ++c) w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c));
    } else {
        const __m256i lo4 = _mm256_set1_epi8(15);
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c));
            w[2 * c] = _mm256_and_si256(v, lo4);
            w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        }
        if constexpr (L::bits > 4) {
            __m256i h[2];
            for (int t = 0; t < L::bits - 4; ++t)
                h[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * (4 + t)));
            add_high8<F, 0>(w, h);
        }
    }
}

// eight float16s (at p) as two vectors of four doubles
inline void f16_pd(const uint16_t* p, __m256d& lo, __m256d& hi) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
}

// eight int32 lanes as two vectors of four doubles
inline void i32_pd8(__m256i v, __m256d& lo, __m256d& hi) {
    lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(v));
    hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256(v, 1));
}

// a quarter's y (8 columns from c0) rounded to float32, the bias added, into the row's columns
inline void store_quarter(__m256d y0, __m256d y1, const float* bias, float* out, int64_t c0, int64_t ncols) {
    if (c0 >= ncols) return;
    __m256 v = _mm256_set_m128(_mm256_cvtpd_ps(y1), _mm256_cvtpd_ps(y0));
    alignas(32) float tmp[8];
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c0));
    _mm256_store_ps(tmp, v);
    const int64_t n = std::min<int64_t>(8, ncols - c0);
    for (int64_t i = 0; i < n; ++i) out[c0 + i] = tmp[i];
}

// the exact dot products of one limb (broadcast words p[c], chunks c0..c1-1) with the quants,
// int32 per column
template <int F>
inline __m256i limb_dot(const __m256i* w, const int32_t* p, int c0, int c1) {
    using L = LimbLayout<F>;
    constexpr int RUN = L::bits == 5 ? 4 : L::bits == 6 ? 2 : 8;  // chunks a run (int16-exact)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    for (int r0 = c0; r0 < c1; r0 += RUN) {
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        for (int c = r0; c < std::min(r0 + RUN, c1); ++c) {
            const __m256i a = _mm256_set1_epi32(p[c]);
            if constexpr (F == L8_0) {
                const __m256i lo4 = _mm256_set1_epi8(15);
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(w[c], lo4), a));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w[c], 4), lo4), a));
            } else {
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[c], a));
            }
        }
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(lo, ones));
        if constexpr (F == L8_0) acc = _mm256_add_epi32(acc, _mm256_slli_epi32(_mm256_madd_epi16(hi, ones), 4));
    }
    return acc;
}

// row m of the limbs times quarter q (8 columns) of one panel, over all of K
template <int F>
void limb_quarter(const RowLimbs& R, int64_t m, const uint8_t* panel, int q, const float* bias, float* out,
                  int64_t ncols) {
    using L = LimbLayout<F>;
    static_assert(!L::kquant, "the K-quants: limb_quarter_k");
    const int64_t K = R.K, nb = R.nb, h = q / 2;
    __m256d y0 = _mm256_setzero_pd(), y1 = _mm256_setzero_pd();
    for (int64_t b = 0; b < K / L::QK; ++b) {
        const uint8_t* blk = panel + b * L::block;
        const uint16_t* h16 = reinterpret_cast<const uint16_t*>(blk);
        __m256d d0, d1, o0 = _mm256_setzero_pd(), o1 = _mm256_setzero_pd();
        f16_pd(h16 + 8 * q, d0, d1);
        if constexpr (L::plus_m) f16_pd(h16 + LP + 8 * q, o0, o1);  // o: m
        for (int64_t j = 0; j < L::subs; ++j) {
            const uint8_t* sb = blk + L::head + j * L::sub;
            const int64_t kb = b * L::subs + j, at = m * nb + kb;
            __m256i w[8];
            quarter_quants<F>(sb + L::scale_bytes + h * L::chunks * 64 + (q % 2) * 32, w);
            const __m256d e = _mm256_set1_pd(R.scale[at]);
            const int32_t* p[LIMBS];
            for (int i = 0; i < LIMBS; ++i) p[i] = reinterpret_cast<const int32_t*>(R.l[i].data() + m * K + kb * 32);
            __m256i a[LIMBS];
            for (int i = 0; i < LIMBS; ++i) a[i] = limb_dot<F>(w, p[i], 0, 8);
            const __m256i a01 = _mm256_add_epi32(a[0], _mm256_slli_epi32(a[1], 8));
            const __m256i a23 = _mm256_add_epi32(a[2], _mm256_slli_epi32(a[3], 8));
            __m256d l01, h01, l23, h23;
            i32_pd8(a01, l01, h01);
            i32_pd8(a23, l23, h23);
            const __m256d big = _mm256_set1_pd(65536.0);
            const __m256d t0 = _mm256_fmadd_pd(l23, big, l01), t1 = _mm256_fmadd_pd(h23, big, h01);
            const double S = R.sum[at];
            __m256d u0, u1;
            if constexpr (L::offset != 0) {
                const __m256d os = _mm256_set1_pd(S * L::offset);
                u0 = _mm256_mul_pd(_mm256_add_pd(t0, os), d0);
                u1 = _mm256_mul_pd(_mm256_add_pd(t1, os), d1);
            } else {
                const __m256d Sv = _mm256_set1_pd(S);
                u0 = _mm256_fmadd_pd(Sv, o0, _mm256_mul_pd(t0, d0));
                u1 = _mm256_fmadd_pd(Sv, o1, _mm256_mul_pd(t1, d1));
            }
            y0 = _mm256_fmadd_pd(u0, e, y0);
            y1 = _mm256_fmadd_pd(u1, e, y1);
        }
    }
    store_quarter(y0, y1, bias, out, 8 * q, ncols);
}

// row m of the limbs times quarter q (8 columns) of a K-quant's panel: limbs_super.h's join, one
// a super-block, operation for operation (the limbs' int32 sums times each group's sc, T joined
// exactly in float64, then dmin Mn, d T - q fused, y + u 2^e), so the AVX-512 path's bits
template <int F>
void limb_quarter_k(const RowLimbs& R, int64_t m, const uint8_t* panel, int q, const float* bias, float* out,
                    int64_t ncols) {
    using L = LimbLayout<F>;
    constexpr int G = L::groups, CG = 8 / G;
    const int64_t K = R.K, h = q / 2;
    const __m256d base = _mm256_set1_pd(256.0);
    __m256d y0 = _mm256_setzero_pd(), y1 = _mm256_setzero_pd();
    for (int64_t b = 0; b < K / L::QK; ++b) {
        const uint8_t* blk = panel + b * L::block;
        const uint16_t* h16 = reinterpret_cast<const uint16_t*>(blk);
        __m256i acc[LIMBS];
        for (int i = 0; i < LIMBS; ++i) acc[i] = _mm256_setzero_si256();
        for (int64_t j = 0; j < L::subs; ++j) {
            const uint8_t* sb = blk + L::head + j * L::sub;
            const int64_t kb = b * L::subs + j;
            __m256i w[8];
            quarter_quants<F>(sb + L::scale_bytes + h * L::chunks * 64 + (q % 2) * 32, w);
            const int32_t* p[LIMBS];
            for (int i = 0; i < LIMBS; ++i) p[i] = reinterpret_cast<const int32_t*>(R.l[i].data() + m * K + kb * 32);
            for (int g = 0; g < G; ++g) {
                const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + g * LP + 8 * q));
                const __m256i sc = F == L6_K ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
                for (int i = 0; i < LIMBS; ++i)
                    acc[i] = _mm256_add_epi32(acc[i], _mm256_mullo_epi32(limb_dot<F>(w, p[i], g * CG, (g + 1) * CG), sc));
            }
        }
        __m256d T0, T1;  // sum acc[i] 256^i, exact
        i32_pd8(acc[LIMBS - 1], T0, T1);
        for (int i = LIMBS - 2; i >= 0; --i) {
            __m256d lo, hi;
            i32_pd8(acc[i], lo, hi);
            T0 = _mm256_fmadd_pd(T0, base, lo);
            T1 = _mm256_fmadd_pd(T1, base, hi);
        }
        const int64_t at = m * R.nb + b * L::subs;
        __m256d d0, d1, u0, u1;
        f16_pd(h16 + 8 * q, d0, d1);
        // Q4_K, Q5_K: sum_j mn_j S_j; Q6_K: sum_g sc_g S_g (its offset's); exact
        __m256d n0 = _mm256_setzero_pd(), n1 = _mm256_setzero_pd();
        for (int64_t j = 0; j < L::subs; ++j) {
            const uint8_t* sb = blk + L::head + j * L::sub;
            for (int g = 0; g < (L::kmin ? 1 : G); ++g) {
                const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + (L::kmin ? LP : g * LP) + 8 * q));
                __m256d lo, hi;
                i32_pd8(L::kmin ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes), lo, hi);
                const __m256d S = _mm256_set1_pd(L::kmin ? R.sum[at + j] : R.sum16[2 * at + j * G + g]);
                n0 = _mm256_fmadd_pd(S, lo, n0);
                n1 = _mm256_fmadd_pd(S, hi, n1);
            }
        }
        if constexpr (L::kmin) {
            __m256d dm0, dm1;
            f16_pd(h16 + LP + 8 * q, dm0, dm1);
            u0 = _mm256_fmsub_pd(d0, T0, _mm256_mul_pd(dm0, n0));
            u1 = _mm256_fmsub_pd(d1, T1, _mm256_mul_pd(dm1, n1));
        } else {
            const __m256d off = _mm256_set1_pd(L::offset);
            u0 = _mm256_mul_pd(d0, _mm256_fmadd_pd(off, n0, T0));
            u1 = _mm256_mul_pd(d1, _mm256_fmadd_pd(off, n1, T1));
        }
        const __m256d e = _mm256_set1_pd(R.scale[at]);
        y0 = _mm256_fmadd_pd(u0, e, y0);
        y1 = _mm256_fmadd_pd(u1, e, y1);
    }
    store_quarter(y0, y1, bias, out, 8 * q, ncols);
}

// rows 0..M-1 of the limbs times one panel, a row and a quarter at a time
template <int F>
void panel_rows(const RowLimbs& R, int64_t M, const uint8_t* panel, const float* b, float* o, int64_t N,
                int64_t ncols) {
    for (int64_t m = 0; m < M; ++m)
        for (int q = 0; q < 4; ++q) {
            if constexpr (LimbLayout<F>::kquant) limb_quarter_k<F>(R, m, panel, q, b, o + m * N, ncols);
            else limb_quarter<F>(R, m, panel, q, b, o + m * N, ncols);
        }
}
