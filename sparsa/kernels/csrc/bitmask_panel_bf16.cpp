// Y[T, R] = X[T, K] W^T (+ bias) for a bf16 W in the Bitmask layout (per-row mask bits, packed values) and
// many bf16 tokens (prefill), on CPUs with AVX512-BF16 and VBMI2: sparse compute instead of expanding W to
// dense rows for a BLAS GEMM, whose expansion from memory cost more than the GEMM saved at these sparsities.
//
// X is packed once into bf16 panels of 32 tokens (sparsa_dp::pack, with a zero row at column K), or, for a
// call of at most 16 tokens (batched decoding), one panel of 16 whose pairs take 256-bit VDPBF16PS: half
// the work of a 32-token panel. Each thread takes a range of row pairs and walks it in blocks of
// BLOCK_ROWS rows: it lists each row's kept columns from its mask bytes (one VBMI2 word compress per 32
// columns) into a small buffer, then, for every panel, multiplies pairs of consecutive kept columns,
// (x[t][a], x[t][b]) from a word unpack of the two panel rows, with the two adjacent packed values
// (w[a], w[b]) in one VDPBF16PS per 16 (or 8) tokens. So the weight is read from memory once per call
// and no plan is stored beside it. Two rows, each with even and odd pairs in their own sums, keep 8
// VDPBF16PS chains in flight; wide rows are walked in column chunks of CHUNK_COLS so that the panel's
// rows being read stay in L1 (pairs never straddle a chunk). A row's odd last column pairs with the
// zero row.
//
// Only kept columns are multiplied, so a NaN or Inf of X at a dropped column would not reach the output as
// it does in F.linear: the entry point checks X first and returns 1 (the caller then expands W instead).
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <omp.h>
#include "bf16.h"
#include "bf16_finite.h"
#include "cpu_isa.h"
#include "dp_pack.h"
#include "panel_store.h"
#include "thread_scratch.h"

namespace {

constexpr int64_t MAX_K = 65535;  // columns are 16-bit, and the zero row's column K too
constexpr int64_t CHUNK_COLS = 512;  // 32 KiB of a panel
constexpr int BLOCK_SLICES = 32;  // row pairs per block: their column lists stay in L2 across panels
constexpr int BLOCK_ROWS = 2 * BLOCK_SLICES;

// Chunks pay when the panel falls out of L1 often enough to outweigh reloading each row's sums per chunk
// (the same rule as the sliced_ell plan's chunks).
int64_t n_chunks(int64_t K, double density) {
    const bool chunk = K >= 2048 || (K > CHUNK_COLS && density >= 0.4);
    return chunk ? (K + CHUNK_COLS - 1) / CHUNK_COLS : 1;
}

}  // namespace

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_PANEL_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx512vbmi2,avx2,fma")
namespace {

// One row's kept columns (16-bit) into cols, and where each chunk's columns start in it: start[k] for
// chunk k, start[nch] = the row's count. cols needs 32 slots of slack past the count.
void list_columns(const uint8_t* bits, int64_t K, int64_t nch, uint16_t* cols, int32_t* start) {
    const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                          13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i step = _mm512_set1_epi16(32);
    int32_t n = 0;
    for (int64_t k = 0; k < nch; ++k) {
        start[k] = n;
        const int64_t c1 = std::min(K, (k + 1) * (nch > 1 ? CHUNK_COLS : K));
        int64_t c = k * CHUNK_COLS;
        __m512i idx = _mm512_add_epi16(iota, _mm512_set1_epi16((short)c));
        for (; c + 64 <= c1; c += 64) {  // fixed-size mask loads: a variable memcpy would be a call
            uint64_t m;
            std::memcpy(&m, bits + c / 8, 8);
            const uint32_t lo = (uint32_t)m, hi = (uint32_t)(m >> 32);
            _mm512_storeu_si512(cols + n, _mm512_maskz_compress_epi16((__mmask32)lo, idx));
            n += __builtin_popcount(lo);
            idx = _mm512_add_epi16(idx, step);
            _mm512_storeu_si512(cols + n, _mm512_maskz_compress_epi16((__mmask32)hi, idx));
            n += __builtin_popcount(hi);
            idx = _mm512_add_epi16(idx, step);
        }
        for (; c < c1; c += 32) {
            uint32_t m = 0;
            const int64_t left = c1 - c;
            std::memcpy(&m, bits + c / 8, (size_t)std::min<int64_t>(4, (left + 7) / 8));
            if (left < 32) m &= (1u << left) - 1u;  // bits past K are not columns
            _mm512_storeu_si512(cols + n, _mm512_maskz_compress_epi16((__mmask32)m, idx));
            n += __builtin_popcount(m);
            idx = _mm512_add_epi16(idx, step);
        }
    }
    start[nch] = n;
}

// The two panel widths, as the vector type one VDPBF16PS fills and its operations. Per pair of kept
// columns (a, b), the word unpacks of their two panel runs give the bf16 pairs (x[t][a], x[t][b]) of the
// panel's tokens in two vectors, lo and hi.
struct Panel32 {  // 32 tokens (sparsa_dp::pack order): lo holds tokens 0-15, hi 16-31
    using V = __m512;
    static constexpr int TBW = 32;
    static V zero() { return _mm512_setzero_ps(); }
    static V load_sum(const float* p) { return _mm512_load_ps(p); }
    static void store_sum(float* p, V v) { _mm512_store_ps(p, v); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static void pair(const char* xt, uint16_t c0, uint16_t c1, uint32_t w2, V& lo, V& hi) {
        const __m512i a = _mm512_loadu_si512(xt + ((size_t)c0 << 6)), b = _mm512_loadu_si512(xt + ((size_t)c1 << 6));
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)w2);
        lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(a, b), w);
        hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(a, b), w);
    }
    // the panel's 32 token sums of one row, in token order
    static void store_tokens(float* out, V lo, V hi) {
        _mm512_store_ps(out, lo);
        _mm512_store_ps(out + 16, hi);
    }
};

struct Panel16 {  // 16 tokens in order (sparsa_dp::pack16): lo holds tokens 0-3 and 8-11, hi 4-7 and 12-15
    using V = __m256;
    static constexpr int TBW = 16;
    static V zero() { return _mm256_setzero_ps(); }
    static V load_sum(const float* p) { return _mm256_load_ps(p); }
    static void store_sum(float* p, V v) { _mm256_store_ps(p, v); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static void pair(const char* xt, uint16_t c0, uint16_t c1, uint32_t w2, V& lo, V& hi) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + ((size_t)c0 << 5)));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + ((size_t)c1 << 5)));
        const __m256bh w = (__m256bh)_mm256_set1_epi32((int)w2);
        lo = _mm256_dpbf16_ps(lo, (__m256bh)_mm256_unpacklo_epi16(a, b), w);
        hi = _mm256_dpbf16_ps(hi, (__m256bh)_mm256_unpackhi_epi16(a, b), w);
    }
    static void store_tokens(float* out, V lo, V hi) {
        _mm256_store_ps(out, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_store_ps(out + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
};

// one pair of kept columns with its two packed weights: lo, hi += x w
template <class P>
inline void pair_step(const char* __restrict xt, const uint16_t* __restrict c, const uint16_t* __restrict v,
                      typename P::V& lo, typename P::V& hi) {
    uint32_t w2;
    std::memcpy(&w2, v, 4);
    P::pair(xt, c[0], c[1], w2, lo, hi);
}

// the odd last column of a row's chunk: its weight with zero, against the panel's zero row (column K)
template <class P>
inline void single_step(const char* __restrict xt, uint16_t c, uint16_t v, int64_t K, typename P::V& lo,
                        typename P::V& hi) {
    P::pair(xt, c, (uint16_t)K, (uint32_t)v, lo, hi);
}

// One row's pairs in one chunk into its even / odd sums (both token halves).
template <class P>
inline void row_pairs(const char* xt, const uint16_t* c, const uint16_t* v, int64_t n, int64_t K, typename P::V& el,
                      typename P::V& eh, typename P::V& ol, typename P::V& oh) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        pair_step<P>(xt, c + j, v + j, el, eh);
        pair_step<P>(xt, c + j + 2, v + j + 2, ol, oh);
    }
    if (j + 2 <= n) pair_step<P>(xt, c + j, v + j, el, eh), j += 2;
    if (j < n) single_step<P>(xt, c[j], v[j], K, ol, oh);
}

struct Weight {
    const uint8_t* bits;
    int64_t kb;
    const int64_t* row_ptr;
    const uint16_t* values;
    int64_t R, K, nch;
};

// Rows r, r + 1 (two: both) of one panel in chunk k, into their sums s[row][even lo, even hi, odd lo, odd hi].
template <class P>
inline void pair_of_rows(const Weight& W, const char* xt, const uint16_t* cols, int64_t stride, const int32_t* start,
                         int64_t r0, int64_t r, bool two, int64_t k, typename P::V (&s)[2][4]) {
    const uint16_t *c[2], *v[2];
    int64_t n[2] = {0, 0};
    for (int i = 0; i < (two ? 2 : 1); ++i) {
        const int32_t* st = start + (r + i) * (W.nch + 1);
        c[i] = cols + (r + i) * stride + st[k];
        v[i] = W.values + W.row_ptr[r0 + r + i] + st[k];
        n[i] = st[k + 1] - st[k];
    }
    // both rows together while both have pairs left: 8 independent chains
    const int64_t both = two ? std::min(n[0], n[1]) & ~int64_t(3) : 0;
    for (int64_t j = 0; j < both; j += 4) {
        pair_step<P>(xt, c[0] + j, v[0] + j, s[0][0], s[0][1]);
        pair_step<P>(xt, c[1] + j, v[1] + j, s[1][0], s[1][1]);
        pair_step<P>(xt, c[0] + j + 2, v[0] + j + 2, s[0][2], s[0][3]);
        pair_step<P>(xt, c[1] + j + 2, v[1] + j + 2, s[1][2], s[1][3]);
    }
    for (int i = 0; i < (two ? 2 : 1); ++i)
        row_pairs<P>(xt, c[i] + both, v[i] + both, n[i] - both, W.K, s[i][0], s[i][1], s[i][2], s[i][3]);
}

// Rows [r0, r0 + nr) (nr <= BLOCK_ROWS) of one panel from their column lists; part[row][P::TBW tokens].
// A 32-token panel walks chunk by chunk (rows inside, sums kept between chunks), so the chunk of the panel
// stays in L1. A 16-token panel (the whole call, read from L2) walks row pair by row pair (chunks inside):
// chunk by chunk would read each row's values in pieces, one block of rows after another, which streams
// the weight from memory slower. Both take the same pairs into the same sums, so a token's result does not
// depend on the width.
template <class P>
void block_panel(const Weight& W, const char* xt, const uint16_t* cols, int64_t stride, const int32_t* start,
                 int64_t r0, int64_t nr, float* part) {
    using V = typename P::V;
    if constexpr (P::TBW == 16) {
        for (int64_t r = 0; r < nr; r += 2) {
            const bool two = r + 1 < nr;
            V s[2][4];
            for (int i = 0; i < 2; ++i)
                for (int q = 0; q < 4; ++q) s[i][q] = P::zero();
            for (int64_t k = 0; k < W.nch; ++k) pair_of_rows<P>(W, xt, cols, stride, start, r0, r, two, k, s);
            for (int i = 0; i < (two ? 2 : 1); ++i)
                P::store_tokens(part + (r + i) * P::TBW, P::add(s[i][0], s[i][2]), P::add(s[i][1], s[i][3]));
        }
        return;
    }
    alignas(64) float sums[BLOCK_ROWS][4][16];  // [row][even lo, even hi, odd lo, odd hi], kept between chunks
    for (int64_t k = 0; k < W.nch; ++k) {
        for (int64_t r = 0; r < nr; r += 2) {
            const bool two = r + 1 < nr;
            V s[2][4];
            for (int i = 0; i < 2; ++i)
                for (int q = 0; q < 4; ++q) s[i][q] = k == 0 ? P::zero() : P::load_sum(sums[r + i][q]);
            pair_of_rows<P>(W, xt, cols, stride, start, r0, r, two, k, s);
            for (int i = 0; i < (two ? 2 : 1); ++i) {
                if (k + 1 < W.nch) {
                    for (int q = 0; q < 4; ++q) P::store_sum(sums[r + i][q], s[i][q]);
                } else {
                    P::store_tokens(part + (r + i) * P::TBW, P::add(s[i][0], s[i][2]), P::add(s[i][1], s[i][3]));
                }
            }
        }
    }
}

void run(const uint16_t* x, int64_t T, const Weight& W, const float* bias, bool act, uint16_t* y,
         int nthreads) {
    constexpr int TB = sparsa_dp::TB;
    const int64_t K = W.K, R = W.R, npan = (T + TB - 1) / TB;
    // a call of at most 16 tokens takes one 16-token panel: half the lanes, half the work per pair
    const bool narrow = T <= 16;
    const int64_t prow = (K + 1) * (narrow ? 16 : TB);  // one panel: K columns and the zero row
    // the packs write every word, padding and zero row included: no zeroed allocation per call
    uint16_t* panels = sparsa_thread_scratch<uint16_t, 0>((size_t)(npan * prow));
    const int64_t nblk = (R + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const int nth = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, std::max(nblk, npan)));
#pragma omp parallel num_threads(nth)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npan; ++p) {
            const int nt = (int)std::min<int64_t>(TB, T - p * TB);
            if (narrow) sparsa_dp::pack16(x, K, nt, panels);
            else sparsa_dp::pack(x + p * TB * K, K, nt, panels + p * prow);
        }
        const int64_t stride = K + 32;  // a row's column list, with the compress store's slack
        uint16_t* cols = sparsa_thread_scratch<uint16_t, 1>((size_t)(BLOCK_ROWS * stride));
        int32_t* start = sparsa_thread_scratch<int32_t, 2>((size_t)(BLOCK_ROWS * (W.nch + 1)));
        alignas(64) float part[BLOCK_ROWS * TB];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblk; ++b) {
            const int64_t r0 = b * BLOCK_ROWS, nr = std::min<int64_t>(BLOCK_ROWS, R - r0);
            for (int64_t r = 0; r < nr; ++r)
                list_columns(W.bits + (r0 + r) * W.kb, K, W.nch, cols + r * stride,
                             start + r * (W.nch + 1));
            for (int64_t p = 0; p < npan; ++p) {
                const int nt = (int)std::min<int64_t>(TB, T - p * TB);
                const char* xt = reinterpret_cast<const char*>(panels + p * prow);
                if (narrow) block_panel<Panel16>(W, xt, cols, stride, start, r0, nr, part);
                else block_panel<Panel32>(W, xt, cols, stride, start, r0, nr, part);
                sparsa_panel::store_block(part, narrow ? 16 : TB, nt, r0, nr, R, bias, y + p * TB * R, act);
            }
        }
    }
}

}  // namespace
#pragma GCC pop_options
#endif

namespace {

bool panel_available() {
#ifdef SPARSA_HAVE_PANEL_BF16
    static const bool vbmi2 = __builtin_cpu_supports("avx512vbmi2");
    return vbmi2 && sparsa_cpu_dpbf16_enabled();
#else
    return false;
#endif
}

}  // namespace

extern "C" {

// 1 when sparsa_bitmask_panel_bf16 runs on this CPU (AVX512-BF16 and VBMI2, SPARSA_ISA >= avx512)
int sparsa_bitmask_has_panel_bf16() { return panel_available() ? 1 : 0; }

// x: bf16 [T, K]; bits: [R, ceil(K / 8)]; row_ptr: [R + 1]; values: bf16 [row_ptr[R]]; bias: fp32 [R] or
// null; y: bf16 [T, R], fp32 accumulation rounded once (nearest even); act = 1: GELU (erf form) before the
// rounding. Returns 0 when done; 1 when X holds a NaN or Inf (y untouched: only the dense product
// propagates it to every row); -1 when this CPU or build has no panel kernel or K > 65535.
int sparsa_bitmask_panel_bf16(const uint16_t* x, int64_t T, int64_t K, const uint8_t* bits, const int64_t* row_ptr,
                              const uint16_t* values, int64_t R, const float* bias, uint16_t* y, int nthreads,
                              int act) {
    if (!panel_available() || K > MAX_K) return -1;
#ifdef SPARSA_HAVE_PANEL_BF16
    if (!sparsa_bf16_finite(x, T * K)) return 1;
    if (T <= 0 || R <= 0) return 0;
    const double density = K > 0 ? (double)row_ptr[R] / ((double)R * (double)K) : 0.0;
    const Weight W{bits, (K + 7) / 8, row_ptr, values, R, K, n_chunks(K, density)};
    run(x, T, W, bias, act != 0, y, nthreads);
    return 0;
#else
    (void)act;
    return -1;
#endif
}

}  // extern "C"
