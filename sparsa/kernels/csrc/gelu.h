// GELU, erf form (torch.nn.GELU() / approximate="none"), applied in place to a kernel's finished
// outputs. erf follows Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7) with a Cephes-style
// exp, so the fused epilogue matches torch's GELU to float rounding.
#pragma once
#include <cmath>
#include <cstdint>
#ifdef __AVX2__
#include <immintrin.h>
#endif

// Coefficients shared by the 8- and 16-lane versions: the exp polynomial (highest power first) and
// A&S 7.1.26's p and a1..a5 (a5 first, Horner order).
static constexpr float kSparsaExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
static constexpr float kSparsaErfP = 0.3275911f;
static constexpr float kSparsaErfA[5] = {1.061405429f, -1.453152027f, 1.421413741f, -0.284496736f, 0.254829592f};

#ifdef __AVX2__
static inline __m256 sparsa_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(kSparsaExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(kSparsaExpPoly[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 sparsa_gelu8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f));  // x / sqrt(2)
    const __m256 az = _mm256_andnot_ps(sign, z);
    const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_set1_ps(kSparsaErfP), az,
                                                                       _mm256_set1_ps(1.0f)));
    __m256 p = _mm256_set1_ps(kSparsaErfA[0]);
    for (int i = 1; i < 5; ++i) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kSparsaErfA[i]));
    p = _mm256_mul_ps(p, t);
    const __m256 e = sparsa_exp8(_mm256_xor_ps(_mm256_mul_ps(az, az), sign));  // exp(-z^2)
    __m256 erf = _mm256_fnmadd_ps(p, e, _mm256_set1_ps(1.0f));                   // erf(|z|)
    erf = _mm256_or_ps(erf, _mm256_and_ps(z, sign));                             // odd function
    const __m256 half_x = _mm256_mul_ps(x, _mm256_set1_ps(0.5f));
    return _mm256_fmadd_ps(half_x, erf, half_x);
}
#endif

#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_GELU16 1
// The same GELU on 16 lanes, for kernels that run AVX-512 tiles (only call it where the CPU has AVX-512F).
// The division becomes rcp14 plus one Newton step (about 1 ulp): the divide bounded the AVX2 version.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
static inline __m512 sparsa_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 p = _mm512_set1_ps(kSparsaExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(kSparsaExpPoly[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 sparsa_gelu16(__m512 x) {
    const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));  // x / sqrt(2)
    const __m512 az = _mm512_abs_ps(z);
    const __m512 d = _mm512_fmadd_ps(_mm512_set1_ps(kSparsaErfP), az, _mm512_set1_ps(1.0f));
    __m512 t = _mm512_rcp14_ps(d);
    t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));  // Newton: t (2 - d t)
    __m512 p = _mm512_set1_ps(kSparsaErfA[0]);
    for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kSparsaErfA[i]));
    p = _mm512_mul_ps(p, t);
    const __m512 e = sparsa_exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(az, az)));  // exp(-z^2)
    __m512 erf = _mm512_fnmadd_ps(p, e, _mm512_set1_ps(1.0f));                                  // erf(|z|)
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000u));
    erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(erf), sign));  // odd function
    const __m512 half_x = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
    return _mm512_fmadd_ps(half_x, erf, half_x);
}

static inline void sparsa_gelu_inplace16(float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, sparsa_gelu16(_mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, sparsa_gelu16(_mm512_maskz_loadu_ps(m, y + i)));
    }
}
#pragma GCC pop_options
#endif

static inline void sparsa_gelu_inplace(float* y, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, sparsa_gelu8(_mm256_loadu_ps(y + i)));
#endif
    for (; i < n; ++i) y[i] = 0.5f * y[i] * (1.0f + std::erf(y[i] * 0.70710678118654752f));
}
