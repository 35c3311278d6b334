// Whether bf16 operands hold no NaN or Inf: the sparse-compute kernels multiply only kept columns, so a
// non-finite value of X at a dropped column would not reach the output as it does in the dense product.
#pragma once
#include <cstdint>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx512f,avx512bw"))) static inline bool sparsa_bf16_finite(const uint16_t* x, int64_t n) {
    const __m512i e = _mm512_set1_epi16(0x7f80);
    __mmask32 bad = 0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(_mm512_loadu_si512(x + i), e), e);
    if (i < n) {
        const __mmask32 tail = (__mmask32)((1u << (n - i)) - 1u);
        bad |= _mm512_mask_cmpeq_epi16_mask(tail, _mm512_and_si512(_mm512_maskz_loadu_epi16(tail, x + i), e), e);
    }
    return bad == 0;
}
#endif
