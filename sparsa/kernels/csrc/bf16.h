// bfloat16 <-> float conversions shared by the bf16 kernels (bf16 operands, fp32 accumulation).
// bf16 is the upper half of an IEEE float: widening is a 16-bit shift; narrowing rounds to nearest
// even, and keeps NaNs NaN (plain rounding could carry a NaN's low mantissa bits into Inf).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float sparsa_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t sparsa_f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef __AVX2__
// 8 bf16 -> 8 floats
static inline __m256 sparsa_load8_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats -> 8 bf16 (round to nearest even, NaN stays NaN)
static inline __m128i sparsa_cvt8_f32_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i qn = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qn, nan);
    // 32-bit lanes hold values < 65536: pack to 16 bits, then put the two 64-bit halves together
    const __m256i p = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}
#endif

// dst[i] = float(src[i]) for n values, on the calling thread
static inline void sparsa_bf16_row_to_f32(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, sparsa_load8_bf16(src + i));
#endif
    for (; i < n; ++i) dst[i] = sparsa_bf16_to_f32(src[i]);
}

// dst[i] = bf16(src[i]) for n values, on the calling thread
static inline void sparsa_f32_row_to_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), sparsa_cvt8_f32_bf16(_mm256_loadu_ps(src + i)));
#endif
    for (; i < n; ++i) dst[i] = sparsa_f32_to_bf16(src[i]);
}

// row(src + i0, dst + i0, len) over n values in chunks, on up to nthreads threads
template <class S, class D, class Row>
static inline void sparsa_convert_n(const S* src, D* dst, int64_t n, int nthreads, Row row) {
    const int64_t chunk = 1 << 14;
    const int64_t nch = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nch > 1)
    for (int64_t c = 0; c < nch; ++c) {
        const int64_t i0 = c * chunk;
        row(src + i0, dst + i0, std::min<int64_t>(n, i0 + chunk) - i0);
    }
}

// dst[i] = float(src[i]) for n values, on up to nthreads threads
static inline void sparsa_bf16_to_f32_n(const uint16_t* src, float* dst, int64_t n, int nthreads) {
    sparsa_convert_n(src, dst, n, nthreads, sparsa_bf16_row_to_f32);
}

// dst[i] = bf16(src[i]) for n values, on up to nthreads threads
static inline void sparsa_f32_to_bf16_n(const float* src, uint16_t* dst, int64_t n, int nthreads) {
    sparsa_convert_n(src, dst, n, nthreads, sparsa_f32_row_to_bf16);
}

// A kernel's bias as floats: null, a float bias as is (bias_bf16 = 0), or a bf16 one widened into tmp.
static inline const float* sparsa_bias_f32(const void* bias, int bias_bf16, int64_t n, std::vector<float>& tmp) {
    if (!bias || !bias_bf16) return static_cast<const float*>(bias);
    tmp.resize((size_t)n);
    sparsa_bf16_row_to_f32(static_cast<const uint16_t*>(bias), tmp.data(), n);
    return tmp.data();
}
