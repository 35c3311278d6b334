// Y[T, R] = X[T, K] W^T (+ bias) for an fp32 W in the Bitmask layout and many fp32 tokens (prefill), with
// AVX-512 FMAs: a dense GEMM whose weight operand is expanded from the bitmask into L1-sized blocks inside
// the kernel. Expanding W to dense rows for a BLAS GEMM writes and rereads the whole dense weight on every
// call; here the only weight traffic is the compressed bytes, and each expanded value feeds T FMA lanes.
//
// X is transposed once per call by all threads into token panels xt[p][c][32] (zero lanes past T). Each
// thread takes one contiguous run of rows, in blocks of BLOCK_ROWS rows, and fetches the next block's
// packed values and bits into L2 while it multiplies the current one. For every chunk of KC columns it
// expands the block's rows into wb[row][KC] (one masked expand-load per 16 columns; each row's packed
// values are read in order, so a pointer per row walks them), then for every panel multiplies MR = 12 rows
// at a time: 24 sums of 16 tokens in registers, per column two panel loads and 12 broadcasts for 24 FMAs.
// The sums of a block live in part[panel][row][32] between chunks, and the epilogue adds the bias, applies
// GELU and transposes them into Y (panel_store.h).
//
// Zeros are multiplied like any weight, so a NaN or Inf of X reaches every output, as in F.linear.
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <omp.h>
#include "cpu_isa.h"
#include "panel_pack.h"
#include "panel_store.h"
#include "thread_scratch.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_FUSED_F32 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
#include <immintrin.h>
namespace {

constexpr int TB = 32;               // tokens per panel: two 16-float vectors
constexpr int MR = 12;               // rows per register tile: 24 accumulators
constexpr int64_t KC = 128;          // columns per chunk: the block's rows (24 KiB) and a panel's chunk fit L1
constexpr int BLOCK_ROWS = 4 * MR;   // rows that share each panel chunk while it is in L1

// columns [c0, c0 + n) of one row into o[0:n): n a multiple of 16 except in the last chunk, where the bits
// past K are cleared (the expand then reads no value for them). *vp advances past the values read.
inline void expand_row(const uint8_t* bits, int64_t K, int64_t c0, int64_t n, const float*& vp, float* o) {
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        uint16_t m;
        std::memcpy(&m, bits + (c0 + c) / 8, 2);
        _mm512_store_ps(o + c, _mm512_maskz_expandloadu_ps((__mmask16)m, vp));
        vp += __builtin_popcount(m);
    }
    if (c < n) {  // the last 1-15 columns of the row
        const int64_t left = n - c, col = c0 + c;
        uint32_t m = bits[col / 8];
        if (left > 8) m |= (uint32_t)bits[col / 8 + 1] << 8;
        m &= (1u << left) - 1u;
        (void)K;
        _mm512_store_ps(o + c, _mm512_maskz_expandloadu_ps((__mmask16)m, vp));
        vp += __builtin_popcount(m);
    }
}

// part[r][0:32] += sum over k < n of w[r * KC + k] * xt[k][0:32] for the tile's 12 rows
inline void tile12(const float* __restrict w, const float* __restrict xt, int64_t n, float* __restrict part,
                   bool first) {
    __m512 a[MR][2];
    for (int r = 0; r < MR; ++r) {
        a[r][0] = first ? _mm512_setzero_ps() : _mm512_load_ps(part + r * TB);
        a[r][1] = first ? _mm512_setzero_ps() : _mm512_load_ps(part + r * TB + 16);
    }
    for (int64_t k = 0; k < n; ++k) {
        const __m512 x0 = _mm512_load_ps(xt + k * TB), x1 = _mm512_load_ps(xt + k * TB + 16);
#pragma GCC unroll 12
        for (int r = 0; r < MR; ++r) {
            const __m512 wv = _mm512_set1_ps(w[r * KC + k]);
            a[r][0] = _mm512_fmadd_ps(wv, x0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(wv, x1, a[r][1]);
        }
    }
    for (int r = 0; r < MR; ++r) {
        _mm512_store_ps(part + r * TB, a[r][0]);
        _mm512_store_ps(part + r * TB + 16, a[r][1]);
    }
}

// the same for g < 12 rows (a block's last tile)
inline void tile_n(int g, const float* __restrict w, const float* __restrict xt, int64_t n, float* __restrict part,
                   bool first) {
    for (int r = 0; r < g; ++r) {
        __m512 a0 = first ? _mm512_setzero_ps() : _mm512_load_ps(part + r * TB);
        __m512 a1 = first ? _mm512_setzero_ps() : _mm512_load_ps(part + r * TB + 16);
        for (int64_t k = 0; k < n; ++k) {
            const __m512 wv = _mm512_set1_ps(w[r * KC + k]);
            a0 = _mm512_fmadd_ps(wv, _mm512_load_ps(xt + k * TB), a0);
            a1 = _mm512_fmadd_ps(wv, _mm512_load_ps(xt + k * TB + 16), a1);
        }
        _mm512_store_ps(part + r * TB, a0);
        _mm512_store_ps(part + r * TB + 16, a1);
    }
}

// Software prefetch of a byte range into L2, a few lines at a time between register tiles: the next
// block's packed values and bits are 48 streams a few KiB apart, more than the hardware prefetcher tracks,
// and a burst of prefetches at a block's start would stall on the line fill buffers.
struct Prefetcher {
    const char* p = nullptr;
    const char* end = nullptr;
    int64_t per_step = 0;
    void start(const void* lo, const void* hi, int64_t steps) {
        p = static_cast<const char*>(lo);
        end = static_cast<const char*>(hi);
        per_step = std::max<int64_t>(1, ((end - p) / 64 + steps - 1) / std::max<int64_t>(1, steps));
    }
    void step() {
        for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
    }
};

struct Weight {
    const uint8_t* bits;
    int64_t kb;
    const int64_t* row_ptr;
    const float* values;
    int64_t R, K;
};

void run(const float* x, int64_t T, const Weight& W, const float* bias, bool act, float* y, int nthreads) {
    const int64_t K = W.K, R = W.R, npan = (T + TB - 1) / TB;
    float* panels = sparsa_thread_scratch<float, 0>((size_t)(npan * K * TB));
    // each thread takes one contiguous run of 12-row tiles (within one tile of the others'), in blocks
    const int64_t ntiles = (R + MR - 1) / MR;
    const int nth = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, std::max(ntiles, npan)));
#pragma omp parallel num_threads(nth)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npan; ++p)
            sparsa_pack_panel_f32<TB>(x + p * TB * K, K, (int)std::min<int64_t>(TB, T - p * TB), panels + p * K * TB);
        float* wb = sparsa_thread_scratch<float, 1>((size_t)(BLOCK_ROWS * KC));
        float* part = sparsa_thread_scratch<float, 2>((size_t)(npan * BLOCK_ROWS * TB));
        const float* vp[BLOCK_ROWS];
        const int64_t th = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t t0 = ntiles * th / nt, t1 = ntiles * (th + 1) / nt;
        const int64_t nchunks = (K + KC - 1) / KC;
        Prefetcher values_ahead, bits_ahead;
        for (int64_t tb = t0; tb < t1; tb += BLOCK_ROWS / MR) {
            const int64_t r0 = tb * MR;
            const int nr = (int)std::min<int64_t>({(int64_t)BLOCK_ROWS, R - r0, (t1 - tb) * MR});
            {  // the next block's rows, fetched into L2 over this block's register tiles
                const int64_t n0 = r0 + nr, n1 = std::min<int64_t>({R, n0 + BLOCK_ROWS, t1 * MR});
                const int64_t steps = nchunks * npan * ((nr + MR - 1) / MR);
                values_ahead.start(W.values + W.row_ptr[n0], W.values + W.row_ptr[n1], steps);
                bits_ahead.start(W.bits + n0 * W.kb, W.bits + n1 * W.kb, steps);
            }
            for (int r = 0; r < nr; ++r) vp[r] = W.values + W.row_ptr[r0 + r];
            for (int64_t c0 = 0; c0 < K; c0 += KC) {
                const int64_t n = std::min<int64_t>(KC, K - c0);
                for (int r = 0; r < nr; ++r) {
                    expand_row(W.bits + (r0 + r) * W.kb, K, c0, n, vp[r], wb + r * KC);
                    // the next chunk's values and bits into L1 while this chunk's products run
                    for (int64_t i = 0; i < KC; i += 16) _mm_prefetch(reinterpret_cast<const char*>(vp[r] + i), _MM_HINT_T0);
                    _mm_prefetch(reinterpret_cast<const char*>(W.bits + (r0 + r) * W.kb + (c0 + KC) / 8), _MM_HINT_T0);
                }
                for (int64_t p = 0; p < npan; ++p) {
                    const float* xt = panels + p * K * TB + c0 * TB;
                    float* pp = part + p * BLOCK_ROWS * TB;
                    int r = 0;
                    for (; r + MR <= nr; r += MR) {
                        tile12(wb + r * KC, xt, n, pp + r * TB, c0 == 0);
                        values_ahead.step();
                        bits_ahead.step();
                    }
                    if (r < nr) tile_n(nr - r, wb + r * KC, xt, n, pp + r * TB, c0 == 0);
                }
            }
            for (int64_t p = 0; p < npan; ++p)
                sparsa_panel::store_block(part + p * BLOCK_ROWS * TB, TB, (int)std::min<int64_t>(TB, T - p * TB), r0,
                                          nr, R, bias, y + p * TB * R, act);
        }
    }
}

}  // namespace
#pragma GCC pop_options
#endif

extern "C" {

// 1 when sparsa_bitmask_fused_f32 runs here: this build has it, the CPU has AVX-512 and SPARSA_ISA allows it
int sparsa_bitmask_has_fused_f32() {
#ifdef SPARSA_HAVE_FUSED_F32
    return sparsa_cpu_avx512_enabled() ? 1 : 0;
#else
    return 0;
#endif
}

// x: fp32 [T, K]; bits: [R, ceil(K / 8)]; row_ptr: [R + 1]; values: fp32 [row_ptr[R]]; bias: fp32 [R] or
// null; y: fp32 [T, R]; act = 1: GELU (erf form) on the sums. Returns 0 when done; -1 when it does not run
// here (sparsa_bitmask_has_fused_f32), y untouched.
int sparsa_bitmask_fused_f32(const float* x, int64_t T, int64_t K, const uint8_t* bits, const int64_t* row_ptr,
                             const float* values, int64_t R, const float* bias, float* y, int nthreads, int act) {
#ifdef SPARSA_HAVE_FUSED_F32
    if (!sparsa_cpu_avx512_enabled()) return -1;
    if (T <= 0 || R <= 0) return 0;
    const Weight W{bits, (K + 7) / 8, row_ptr, values, R, K};
    run(x, T, W, bias, act != 0, y, nthreads);
    return 0;
#else
    (void)x, (void)T, (void)K, (void)bits, (void)row_ptr, (void)values, (void)R, (void)bias, (void)y, (void)nthreads;
    (void)act;
    return -1;
#endif
}

}  // extern "C"
