// limbs.cpp's AVX-512 path on a CPU without AVX-512 (PROBSERVE_KERNEL_ISA=avx512-emulated, for
// tests): the same source, its _mm512 intrinsics from SIMDe (github.com/simd-everywhere/simde,
// Debian's libsimde-dev: header-only, each intrinsic's exact lane semantics on the CPU's AVX2), so
// the vpdpbusd path and the AMX kernels' code (limbs_amx.h, on tiles.h's emulation) run and are
// tested on every x86-64 CPU, an AMD EPYC with AVX2 alone included. The intrinsics limbs.cpp uses
// that SIMDe 0.7.4 does not have are below, each as Intel's guide states it, on two 256-bit
// halves: conversions (exact, or rounding as the instruction does: cvtpd_epi32 and cvtpd_ps in
// the current mode, nearest even), a masked store, an arithmetic shift, and two reductions in the
// order GCC's avx512fintrin.h takes (halves, then quarters, then the pair: the limbs' sums there
// are integers below 2^35, exact in any order). Where the CPU has AVX-512 F, SIMDe maps every name
// to the instruction itself and nothing here is defined.
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#if !defined(SIMDE_X86_AVX512F_NATIVE)
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "the AVX-512 path's emulation needs AVX2, FMA and F16C"
#endif

namespace ps_emulated {

inline simde__m512i from_halves(__m256i lo, __m256i hi) {
    simde__m512i_private p;
    p.m256i[0] = lo;
    p.m256i[1] = hi;
    return simde__m512i_from_private(p);
}
inline simde__m512d from_halves(__m256d lo, __m256d hi) {
    simde__m512d_private p;
    p.m256d[0] = lo;
    p.m256d[1] = hi;
    return simde__m512d_from_private(p);
}
inline simde__m512 from_halves(__m256 lo, __m256 hi) {
    simde__m512_private p;
    p.m256[0] = lo;
    p.m256[1] = hi;
    return simde__m512_from_private(p);
}

// vpmovdb: each int32's low byte
inline __m128i cvtepi32_epi8(simde__m512i v) {
    const simde__m512i_private p = simde__m512i_to_private(v);
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i order = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
    const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(p.m256i[0], pick), order);
    const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(p.m256i[1], pick), order);
    return _mm_unpacklo_epi64(_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi));
}

inline simde__m512d cvtepi32_pd(__m256i v) {
    return from_halves(_mm256_cvtepi32_pd(_mm256_castsi256_si128(v)), _mm256_cvtepi32_pd(_mm256_extracti128_si256(v, 1)));
}

inline simde__m512i cvtepi8_epi32(__m128i v) {
    return from_halves(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
}

inline simde__m512i cvtepu8_epi32(__m128i v) {
    return from_halves(_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)));
}

inline __m256i cvtpd_epi32(simde__m512d v) {
    const simde__m512d_private p = simde__m512d_to_private(v);
    return _mm256_set_m128i(_mm256_cvtpd_epi32(p.m256d[1]), _mm256_cvtpd_epi32(p.m256d[0]));
}

inline __m256 cvtpd_ps(simde__m512d v) {
    const simde__m512d_private p = simde__m512d_to_private(v);
    return _mm256_set_m128(_mm256_cvtpd_ps(p.m256d[1]), _mm256_cvtpd_ps(p.m256d[0]));
}

inline simde__m512 cvtph_ps(__m256i v) {
    return from_halves(_mm256_cvtph_ps(_mm256_castsi256_si128(v)), _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)));
}

inline simde__m512d cvtps_pd(__m256 v) {
    return from_halves(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

inline void mask_storeu_ps(void* at, uint16_t mask, simde__m512 v) {
    const simde__m512_private p = simde__m512_to_private(v);
    float* out = static_cast<float*>(at);
    for (int i = 0; i < 16; ++i)
        if ((mask >> i) & 1u) out[i] = p.f32[i];
}

inline simde__m512i srai_epi32(simde__m512i v, int n) {
    const simde__m512i_private p = simde__m512i_to_private(v);
    const __m128i count = _mm_cvtsi32_si128(n);
    return from_halves(_mm256_sra_epi32(p.m256i[0], count), _mm256_sra_epi32(p.m256i[1], count));
}

inline double reduce_add_pd(simde__m512d v) {
    const simde__m512d_private p = simde__m512d_to_private(v);
    const __m256d h = _mm256_add_pd(p.m256d[1], p.m256d[0]);
    const __m128d q = _mm_add_pd(_mm256_extractf128_pd(h, 1), _mm256_castpd256_pd128(h));
    return _mm_cvtsd_f64(q) + _mm_cvtsd_f64(_mm_unpackhi_pd(q, q));
}

inline float reduce_max_ps(simde__m512 v) {
    const simde__m512_private p = simde__m512_to_private(v);
    const __m256 h = _mm256_max_ps(p.m256[1], p.m256[0]);
    __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    return std::max(_mm_cvtss_f32(q), _mm_cvtss_f32(_mm_shuffle_ps(q, q, 1)));
}

}  // namespace ps_emulated

#define _mm512_cvtepi32_epi8(v) ps_emulated::cvtepi32_epi8(v)
#define _mm512_cvtepi32_pd(v) ps_emulated::cvtepi32_pd(v)
#define _mm512_cvtepi8_epi32(v) ps_emulated::cvtepi8_epi32(v)
#define _mm512_cvtepu8_epi32(v) ps_emulated::cvtepu8_epi32(v)
#define _mm512_cvtpd_epi32(v) ps_emulated::cvtpd_epi32(v)
#define _mm512_cvtpd_ps(v) ps_emulated::cvtpd_ps(v)
#define _mm512_cvtph_ps(v) ps_emulated::cvtph_ps(v)
#define _mm512_cvtps_pd(v) ps_emulated::cvtps_pd(v)
#define _mm512_mask_storeu_ps(at, mask, v) ps_emulated::mask_storeu_ps(at, mask, v)
#define _mm512_srai_epi32(v, n) ps_emulated::srai_epi32(v, n)
#define _mm512_reduce_add_pd(v) ps_emulated::reduce_add_pd(v)
#define _mm512_reduce_max_ps(v) ps_emulated::reduce_max_ps(v)
#endif  // !SIMDE_X86_AVX512F_NATIVE
