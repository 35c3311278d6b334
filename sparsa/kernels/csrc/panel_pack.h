// Transposing token rows of X into a float32 token panel (xt[c][TB]), shared by the bitmask kernels that
// multiply whole panels: the fp32 panel kernel and the fused kernel.
#pragma once
#include <cstdint>
#include "transpose8.h"

#ifdef __AVX2__
// xt[c * TB + i] = x[i * K + c] for c < K and the panel's nt tokens, zero for nt <= i < TB (one 8x8 transpose
// per 8 columns and 8 tokens)
template <int TB>
static inline void sparsa_pack_panel_f32(const float* __restrict x, int64_t K, int nt, float* __restrict xt) {
    int64_t c = 0;
    for (; c + 8 <= K; c += 8)
        for (int i0 = 0; i0 < TB; i0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i)
                r[i] = i0 + i < nt ? _mm256_loadu_ps(x + (int64_t)(i0 + i) * K + c) : _mm256_setzero_ps();
            transpose8(r);
            for (int k = 0; k < 8; ++k) _mm256_store_ps(xt + (c + k) * TB + i0, r[k]);
        }
    for (; c < K; ++c)
        for (int i = 0; i < TB; ++i) xt[c * TB + i] = i < nt ? x[(int64_t)i * K + c] : 0.f;
}
#endif
