// Cache-friendly float matrix transpose (AVX2 8x8 tiles), shared by the adaptive kernels' weight
// packing and weight-gradient layout conversion, and a 16-bit one (16x16 tiles) for bf16 activations.
#pragma once
#include <algorithm>
#include <cstdint>
#include <immintrin.h>

namespace sparsa_adaptive {

// dst[8 x 8] (row stride ldd) = transpose of src[8 x 8] (row stride lds)
inline void tr8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + lds), r2 = _mm256_loadu_ps(src + 2 * lds),
           r3 = _mm256_loadu_ps(src + 3 * lds), r4 = _mm256_loadu_ps(src + 4 * lds),
           r5 = _mm256_loadu_ps(src + 5 * lds), r6 = _mm256_loadu_ps(src + 6 * lds),
           r7 = _mm256_loadu_ps(src + 7 * lds);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
           t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)),
           s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)),
           s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2)),
           s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(s3, s7, 0x31));
}

// T[M x R] = A[R x M]^T (both row-major, contiguous) for the rows [r0, r1) of A. Rows go in pairs
// of 8x8 tiles (16 rows) so every store pair fills whole 64-byte lines of T.
inline void transpose_rows(const float* A, int64_t R, int64_t M, float* T, int64_t r0, int64_t r1) {
    int64_t r = r0;
    for (; r + 16 <= r1; r += 16) {
        int64_t j = 0;
        for (; j + 8 <= M; j += 8) {
            tr8x8(A + r * M + j, M, T + j * R + r, R);
            tr8x8(A + (r + 8) * M + j, M, T + j * R + r + 8, R);
        }
        for (; j < M; ++j)
            for (int64_t i = r; i < r + 16; ++i) T[j * R + i] = A[i * M + j];
    }
    for (; r + 8 <= r1; r += 8) {
        int64_t j = 0;
        for (; j + 8 <= M; j += 8) tr8x8(A + r * M + j, M, T + j * R + r, R);
        for (; j < M; ++j)
            for (int64_t i = r; i < r + 8; ++i) T[j * R + i] = A[i * M + j];
    }
    for (; r < r1; ++r)
        for (int64_t j = 0; j < M; ++j) T[j * R + r] = A[r * M + j];
}

// Whole transpose, rows split over the threads in 16-row blocks.
inline void transpose(const float* A, int64_t R, int64_t M, float* T, int nthreads) {
    const int64_t nb = (R + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; ++b) transpose_rows(A, R, M, T, b * 16, std::min(R, b * 16 + 16));
}

// 16-bit (bf16) transposes, for NCHW <-> NHWC conversions of bf16 activations: 8x8 word transposes within
// each 128-bit lane of rows r[0..8), so v[j] holds column j (low lane) and column 8 + j (high lane)
inline void tr8x8_epi16_lanes(const __m256i* r, __m256i* v) {
    const __m256i t0 = _mm256_unpacklo_epi16(r[0], r[1]), t1 = _mm256_unpackhi_epi16(r[0], r[1]),
                  t2 = _mm256_unpacklo_epi16(r[2], r[3]), t3 = _mm256_unpackhi_epi16(r[2], r[3]),
                  t4 = _mm256_unpacklo_epi16(r[4], r[5]), t5 = _mm256_unpackhi_epi16(r[4], r[5]),
                  t6 = _mm256_unpacklo_epi16(r[6], r[7]), t7 = _mm256_unpackhi_epi16(r[6], r[7]);
    const __m256i u0 = _mm256_unpacklo_epi32(t0, t2), u1 = _mm256_unpackhi_epi32(t0, t2),
                  u2 = _mm256_unpacklo_epi32(t1, t3), u3 = _mm256_unpackhi_epi32(t1, t3),
                  u4 = _mm256_unpacklo_epi32(t4, t6), u5 = _mm256_unpackhi_epi32(t4, t6),
                  u6 = _mm256_unpacklo_epi32(t5, t7), u7 = _mm256_unpackhi_epi32(t5, t7);
    v[0] = _mm256_unpacklo_epi64(u0, u4), v[1] = _mm256_unpackhi_epi64(u0, u4);
    v[2] = _mm256_unpacklo_epi64(u1, u5), v[3] = _mm256_unpackhi_epi64(u1, u5);
    v[4] = _mm256_unpacklo_epi64(u2, u6), v[5] = _mm256_unpackhi_epi64(u2, u6);
    v[6] = _mm256_unpacklo_epi64(u3, u7), v[7] = _mm256_unpackhi_epi64(u3, u7);
}

// dst[16 x 16] (row stride ldd) = transpose of src[16 x 16] (row stride lds), 16-bit elements
inline void tr16x16_epi16(const uint16_t* src, int64_t lds, uint16_t* dst, int64_t ldd) {
    __m256i r[16], a[8], b[8];
    for (int i = 0; i < 16; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * lds));
    tr8x8_epi16_lanes(r, a);
    tr8x8_epi16_lanes(r + 8, b);
    for (int j = 0; j < 8; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * ldd), _mm256_permute2x128_si256(a[j], b[j], 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (8 + j) * ldd), _mm256_permute2x128_si256(a[j], b[j], 0x31));
    }
}

// T[b][M x R] = A[b][R x M]^T for B batches of 16-bit matrices (row-major, contiguous), 16x16 tiles split over the
// threads by (batch, 16-row block); the edges element by element
inline void transpose16(const uint16_t* A, int64_t B, int64_t R, int64_t M, uint16_t* T, int nthreads) {
    const int64_t nr = (R + 15) / 16, R16 = R / 16 * 16, M16 = M / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < B * nr; ++t) {
        const int64_t b = t / nr, r0 = (t % nr) * 16;
        const uint16_t* a = A + b * R * M;
        uint16_t* d = T + b * R * M;
        if (r0 < R16) {
            for (int64_t j = 0; j < M16; j += 16) tr16x16_epi16(a + r0 * M + j, M, d + j * R + r0, R);
            for (int64_t j = M16; j < M; ++j)
                for (int64_t i = r0; i < r0 + 16; ++i) d[j * R + i] = a[i * M + j];
        } else {
            for (int64_t i = r0; i < R; ++i)
                for (int64_t j = 0; j < M; ++j) d[j * R + i] = a[i * M + j];
        }
    }
}

}  // namespace sparsa_adaptive
