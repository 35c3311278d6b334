// GELU, erf form (torch.nn.GELU() / approximate="none"), applied in place to a kernel's finished
// outputs. erf(z) = z P(z^2) / Q(z^2) on |z| <= 3.92 (erf rounds to +-1 in float beyond), a rational
// least-squares fit (absolute error below 4e-7 evaluated in float), so the fused epilogue matches torch's
// GELU to a few float ulps: half the operations of an exp-based erf, which is what a GELU epilogue costs.
#pragma once
#include <cmath>
#include <cstdint>
#ifdef __AVX2__
#include <immintrin.h>
#endif

// Coefficients shared by the 8- and 16-lane versions, highest power of z^2 first (Horner order).
static constexpr float kSparsaErfP[6] = {2.063297188e-06f, 2.861266548e-04f, 3.772654105e-03f,
                                         5.276882276e-02f, 1.904251128e-01f, 1.128379107e+00f};
static constexpr float kSparsaErfQ[6] = {3.829560228e-05f, 1.166385133e-03f, 1.498043817e-02f,
                                         1.141335815e-01f, 5.020920634e-01f, 1.000000000e+00f};
static constexpr float kSparsaErfClamp = 3.92f;

// One float with the vector versions' operations in their order (fma where they fuse), so the same bits: for
// the software-tile test builds.
static inline float sparsa_gelu1(float x) {
    const float z = std::fmin(std::fmax(x * 0.70710678118654752f, -kSparsaErfClamp), kSparsaErfClamp);
    const float u = z * z;
    float p = kSparsaErfP[0], q = kSparsaErfQ[0];
    for (int i = 1; i < 6; ++i) {
        p = std::fma(p, u, kSparsaErfP[i]);
        q = std::fma(q, u, kSparsaErfQ[i]);
    }
    const float half_x = x * 0.5f;
    return std::fma(half_x, (z * p) / q, half_x);
}

#ifdef __AVX2__
static inline __m256 sparsa_gelu8(__m256 x) {
    const __m256 c = _mm256_set1_ps(kSparsaErfClamp);
    __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f));  // x / sqrt(2)
    z = _mm256_min_ps(_mm256_max_ps(z, _mm256_sub_ps(_mm256_setzero_ps(), c)), c);
    const __m256 u = _mm256_mul_ps(z, z);
    __m256 p = _mm256_set1_ps(kSparsaErfP[0]), q = _mm256_set1_ps(kSparsaErfQ[0]);
    for (int i = 1; i < 6; ++i) {
        p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(kSparsaErfP[i]));
        q = _mm256_fmadd_ps(q, u, _mm256_set1_ps(kSparsaErfQ[i]));
    }
    const __m256 erf = _mm256_div_ps(_mm256_mul_ps(z, p), q);
    const __m256 half_x = _mm256_mul_ps(x, _mm256_set1_ps(0.5f));
    return _mm256_fmadd_ps(half_x, erf, half_x);
}
#endif

#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_GELU16 1
// The same GELU on 16 lanes, for kernels that run AVX-512 tiles (only call it where the CPU has AVX-512F),
// with the same operations in the same order as the 8-lane one, so both give the same bits. (rcp14 plus a
// Newton step ran no faster than the divide, and in the far negative tail, where 1 + erf is a few float
// ulps, its last-bit differences showed up in 6% of bf16 outputs.)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
static inline __m512 sparsa_gelu16(__m512 x) {
    const __m512 c = _mm512_set1_ps(kSparsaErfClamp);
    __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));  // x / sqrt(2)
    z = _mm512_min_ps(_mm512_max_ps(z, _mm512_sub_ps(_mm512_setzero_ps(), c)), c);
    const __m512 u = _mm512_mul_ps(z, z);
    __m512 p = _mm512_set1_ps(kSparsaErfP[0]), q = _mm512_set1_ps(kSparsaErfQ[0]);
    for (int i = 1; i < 6; ++i) {
        p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(kSparsaErfP[i]));
        q = _mm512_fmadd_ps(q, u, _mm512_set1_ps(kSparsaErfQ[i]));
    }
    const __m512 erf = _mm512_div_ps(_mm512_mul_ps(z, p), q);
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
