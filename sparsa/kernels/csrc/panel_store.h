// Storing a block of output rows held token-vector-major (part[row][token]) into Y[T, R], fp32 or bf16:
// shared by the panel kernels of sliced_ell and bitmask.
#pragma once
#include <cstdint>
#include "bf16.h"
#include "cpu_isa.h"
#include "gelu.h"
#include "transpose8.h"

namespace sparsa_panel {

// GELU over n floats in place: 16 lanes where AVX-512 is enabled (wide), 8 elsewhere (the same bits)
inline void gelu_n(float* p, int64_t n, bool wide) {
#ifdef SPARSA_HAVE_GELU16
    if (wide) {
        sparsa_gelu_inplace16(p, n);
        return;
    }
#endif
    (void)wide;
    sparsa_gelu_inplace(p, n);
}

inline void store_y(float* p, float v) { *p = v; }
inline void store_y(uint16_t* p, float v) { *p = sparsa_f32_to_bf16(v); }
#ifdef __AVX2__
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), sparsa_cvt8_f32_bf16(v)); }
#endif

// Rows [r0, r0 + nr) of one panel, held as part[row][0:TB] (token vectors, TB a multiple of 8): + bias,
// optional GELU, then stored token by token, so each token's nr outputs go to y as one contiguous run.
// Lanes past nt are computed (on zeros) but never stored.
template <typename YT>
inline void store_block(float* __restrict part, int TB, int nt, int64_t r0, int64_t nr, int64_t R,
                        const float* __restrict bias, YT* __restrict y, bool act) {
    const bool wide = act && sparsa_cpu_avx512_enabled();
    for (int64_t r = 0; r < nr; ++r) {
        float* p = part + r * TB;
        if (bias) {
            const float b = bias[r0 + r];
            for (int i = 0; i < TB; ++i) p[i] += b;
        }
        if (act) gelu_n(p, TB, wide);  // GELU after the bias
    }
    int64_t r = 0;
#ifdef __AVX2__
    // 8 rows x 8 tokens at a time: one transpose turns 8 row vectors into 8 token runs
    for (; r + 8 <= nr; r += 8) {
        int i = 0;
        for (; i + 8 <= nt; i += 8) {
            __m256 v[8];
            for (int k = 0; k < 8; ++k) v[k] = _mm256_load_ps(part + (r + k) * TB + i);
            transpose8(v);
            for (int k = 0; k < 8; ++k) store8(y + (int64_t)(i + k) * R + r0 + r, v[k]);
        }
        for (; i < nt; ++i)
            for (int k = 0; k < 8; ++k) store_y(y + (int64_t)i * R + r0 + r + k, part[(r + k) * TB + i]);
    }
#endif
    for (int i = 0; i < nt; ++i) {
        YT* yi = y + (int64_t)i * R + r0;
        for (int64_t q = r; q < nr; ++q) store_y(yi + q, part[q * TB + i]);
    }
}

}  // namespace sparsa_panel
