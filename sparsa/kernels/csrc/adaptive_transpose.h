// Cache-friendly float matrix transpose (AVX2 8x8 tiles), shared by the adaptive kernels' weight
// packing and weight-gradient layout conversion.
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

}  // namespace sparsa_adaptive
