// The bf16 token panels of the dot-product kernels (sliced_ell and bitmask with AVX512-BF16): 32 tokens per
// input column, in the order that makes a word unpack of two columns give tokens 0-15 and 16-31; and
// (bitmask) 16 tokens in order, for calls of at most 16 tokens.
#pragma once
#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace sparsa_dp {

constexpr int TB = 32;

// The 8x8 word transpose behind both packs: tokens tok[0..7] (rows of x, stride K; tok[i] >= nt reads as
// zeros) go to words lane_off..lane_off+7 of every column's run of TBW words in xt.
template <int TBW>
inline void pack_lane(const uint16_t* __restrict x, int64_t K, int nt, const int tok[8], int lane_off,
                      uint16_t* __restrict xt) {
    int64_t c = 0;
    for (; c + 8 <= K; c += 8) {
        __m128i a[8];
        for (int i = 0; i < 8; ++i)
            a[i] = tok[i] < nt ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + (int64_t)tok[i] * K + c))
                               : _mm_setzero_si128();
        __m128i t[8], u[8];
        for (int i = 0; i < 4; ++i) {
            t[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
            t[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
        }
        for (int h = 0; h < 2; ++h)  // tokens tok[0..3] (h = 0) and tok[4..7]
            for (int i = 0; i < 2; ++i) {
                u[4 * h + 2 * i] = _mm_unpacklo_epi32(t[4 * h + i], t[4 * h + i + 2]);
                u[4 * h + 2 * i + 1] = _mm_unpackhi_epi32(t[4 * h + i], t[4 * h + i + 2]);
            }
        for (int j = 0; j < 4; ++j) {  // columns 2j and 2j + 1
            _mm_storeu_si128(reinterpret_cast<__m128i*>(xt + (c + 2 * j) * TBW + lane_off),
                             _mm_unpacklo_epi64(u[j], u[j + 4]));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(xt + (c + 2 * j + 1) * TBW + lane_off),
                             _mm_unpackhi_epi64(u[j], u[j + 4]));
        }
    }
    for (; c < K; ++c)
        for (int i = 0; i < 8; ++i) xt[c * TBW + lane_off + i] = tok[i] < nt ? x[(int64_t)tok[i] * K + c] : 0;
}

// xt[c * 32 + pos(t)] = x[t][c] (row stride K) for t < nt, zero for the other tokens and for the zero row
// c = K; pos puts tokens 4L..4L+3 at words 8L..8L+3 of 128-bit lane L and tokens 16+4L..16+4L+3 at words
// 8L+4..8L+7. So the 8 tokens of lane L fill words 8L..8L+7 of every column: one 8x8 word transpose of
// their rows per 8 columns gives 8 column runs (scalar copies were a few percent of a wide layer).
inline void pack(const uint16_t* __restrict x, int64_t K, int nt, uint16_t* __restrict xt) {
    std::memset(xt + K * TB, 0, sizeof(uint16_t) * TB);
    for (int L = 0; L < 4; ++L) {
        int tok[8];
        for (int i = 0; i < 8; ++i) tok[i] = (i < 4 ? 4 * L : 16 + 4 * L - 4) + i;
        pack_lane<TB>(x, K, nt, tok, 8 * L, xt);
    }
}

// The 16-token panel: xt[c * 16 + t] = x[t][c] for t < nt (tokens in order), zero for the other tokens and
// for the zero row c = K. A word unpack of two columns (256 bits) gives tokens 0-3 and 8-11 in one vector,
// 4-7 and 12-15 in the other: the kernel restores the order once per row.
inline void pack16(const uint16_t* __restrict x, int64_t K, int nt, uint16_t* __restrict xt) {
    std::memset(xt + K * 16, 0, sizeof(uint16_t) * 16);
    for (int L = 0; L < 2; ++L) {
        int tok[8];
        for (int i = 0; i < 8; ++i) tok[i] = 8 * L + i;
        pack_lane<16>(x, K, nt, tok, 8 * L, xt);
    }
}

}  // namespace sparsa_dp
