// Y[T, R] = X[T, K] W^T (+ bias) for a bf16 W in the Bitmask layout and many bf16 tokens, on AMX tiles.
//
// W comes in a tile-ordered copy (sparsa/kernels/bitmask_tiles.py makes it once per weight): for every 16
// output rows x 32 columns, one 32-bit mask per row of AMX's pair layout (row i holds the pairs of columns
// 2i, 2i + 1 for the 16 outputs) and the kept values in that order. A work item is 32 outputs over a run of
// tokens: it expands its outputs' tiles into dense B tiles (one VBMI2 expand-load per tile row, once per
// item), then for every 32 tokens multiplies two A tiles loaded straight from X's rows with them into four
// C tiles, and rounds the sums (plus bias) to bf16 rows of Y. So the work is dense, at AMX's rate, while the
// weight is read from its compressed copy; and dropped weights are zeros multiplied by X, so a NaN or Inf of
// X reaches the output as it does in F.linear. Tile registers: C 0-3, A 4-5, B 6-7.
//
// Items run token chunks of at most ~1 MiB of X (chunks of equal size) in the outer order, so the rows the
// items reread stay in L2; threads take items one at a time as they finish, because the two threads of
// the VMs measured often ran at different speeds. X rows are read 64 bytes per 32 columns: a K that is not a multiple of 32 would read into
// the next row, so such an X is copied into rows of whole 32-column chunks first; a token block past T
// reads a zero-padded copy of the last rows.
//
// SPARSA_AMX_EMULATE (bitmask_amx_bf16_emu.cpp) builds the same driver on software tiles with scalar
// expand and epilogue, for the tests on any CPU.
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <omp.h>
#include "amx_tiles.h"
#include "bf16.h"
#include "cpu_isa.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_BITMASK_AMX 1
#endif

#ifdef SPARSA_HAVE_BITMASK_AMX
#ifndef SPARSA_AMX_EMULATE
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx512vbmi2,avx2,fma")
#endif
namespace {

constexpr int64_t CHUNK_X_BYTES = 1 << 20;  // X rows per token chunk: well inside a 2 MiB L2
constexpr int TILE_WORDS = 16 * 32;         // bf16 elements of one tile

struct alignas(64) TileBuf {
    uint16_t w[TILE_WORDS];
};

// Tile (b, c) of the tile-ordered weight, expanded to 16 pair rows of 32 bf16 (zeros where not kept)
inline void expand_tile(const uint32_t* mask, const uint16_t* vals, uint16_t* dst) {
    for (int i = 0; i < 16; ++i) {
        const uint32_t m = mask[i];
#ifdef SPARSA_AMX_EMULATE
        for (int j = 0; j < 32; ++j) dst[32 * i + j] = (m >> j & 1u) ? *vals++ : (uint16_t)0;
#else
        _mm512_store_si512(dst + 32 * i, _mm512_maskz_expandloadu_epi16((__mmask32)m, vals));
        vals += __builtin_popcount(m);
#endif
    }
}

// y[t][c0 + j] = bf16(sum[t][j] + bias[c0 + j]) for t < rows, j < cols (sum rows of 32 floats)
inline void store_rows(const float (*sum)[32], int rows, const float* bias, int64_t c0, int cols, uint16_t* y,
                       int64_t R) {
#ifdef SPARSA_AMX_EMULATE
    for (int t = 0; t < rows; ++t)
        for (int j = 0; j < cols; ++j)
            y[t * R + c0 + j] = sparsa_f32_to_bf16(sum[t][j] + (bias ? bias[c0 + j] : 0.0f));
#else
    const __mmask32 m = cols >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << cols) - 1u);
    const __mmask16 m0 = (__mmask16)m, m1 = (__mmask16)(m >> 16);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + c0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + c0 + 16) : _mm512_setzero_ps();
    for (int t = 0; t < rows; ++t) {
        const __m512 v0 = _mm512_add_ps(_mm512_load_ps(sum[t]), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_load_ps(sum[t] + 16), b1);
        // VCVTNE2PS2BF16 rounds to nearest even like the other paths' rounding, but flushes denormals
        _mm512_mask_storeu_epi16(y + t * R + c0, m, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
#endif
}

struct Weight {
    const uint32_t* masks;  // [tile][16]
    const int64_t* offs;    // [tile + 1] into vals
    const uint16_t* vals;
    int64_t nkc, n16;  // 32-column chunks, 16-row blocks
};

// The B tiles of 16-row blocks 2 jn and 2 jn + 1 (a block past the weight expands to zeros): b[c][s]
void expand_item(const Weight& w, int64_t jn, TileBuf* b) {
    for (int s = 0; s < 2; ++s) {
        const int64_t blk = 2 * jn + s;
        for (int64_t c = 0; c < w.nkc; ++c) {
            uint16_t* dst = b[2 * c + s].w;
            if (blk >= w.n16) {
                std::memset(dst, 0, sizeof(TileBuf));
                continue;
            }
            const int64_t t = blk * w.nkc + c;
            expand_tile(w.masks + 16 * t, w.vals + w.offs[t], dst);
        }
    }
}

// The sums of 32 tokens x 32 outputs into sum: a is the first token's X row (rows ld elements apart), b the
// item's B tiles. ynext: the first of the 32 Y rows (R elements apart) the next block writes, or null; their
// lines are fetched for writing during the products, so the epilogue's stores do not wait for them.
// Half: a block of at most 16 tokens (a batched-decoding call, or the last block), one A tile and half the
// products.
template <bool Half>
void multiply_block(const uint16_t* a, int64_t ld, const TileBuf* b, int64_t nkc, float (*sum)[32],
                    const uint16_t* ynext, int64_t R) {
    SPARSA_TILE_ZERO(0);
    SPARSA_TILE_ZERO(1);
    if constexpr (!Half) {
        SPARSA_TILE_ZERO(2);
        SPARSA_TILE_ZERO(3);
    }
    const long stride = (long)(ld * 2);
    for (int64_t c = 0; c < nkc; ++c) {
#ifndef SPARSA_AMX_EMULATE
        if (ynext)
            for (int64_t r = c * 32 / nkc; r < (c + 1) * 32 / nkc; ++r)
                _m_prefetchw(const_cast<uint16_t*>(ynext + r * R));
#endif
        SPARSA_TILE_LOAD(4, a + 32 * c, stride);
        if constexpr (!Half) SPARSA_TILE_LOAD(5, a + 16 * ld + 32 * c, stride);
        SPARSA_TILE_LOAD(6, b[2 * c].w, 64);
        SPARSA_TILE_LOAD(7, b[2 * c + 1].w, 64);
        SPARSA_TILE_DP(0, 4, 6);
        SPARSA_TILE_DP(1, 4, 7);
        if constexpr (!Half) {
            SPARSA_TILE_DP(2, 5, 6);
            SPARSA_TILE_DP(3, 5, 7);
        }
    }
    SPARSA_TILE_STORE(0, &sum[0][0], 128);
    SPARSA_TILE_STORE(1, &sum[0][16], 128);
    if constexpr (!Half) {
        SPARSA_TILE_STORE(2, &sum[16][0], 128);
        SPARSA_TILE_STORE(3, &sum[16][16], 128);
    }
}

void run(const uint16_t* x, int64_t T, int64_t K, const Weight& w, int64_t R, const float* bias, uint16_t* y,
         int nthreads) {
    const int64_t nkc = w.nkc, Kp = 32 * nkc;
    std::vector<uint16_t> xpad;
    const uint16_t* xa = x;
    int64_t ld = K;
    if (K != Kp) {
        xpad.assign((size_t)(T * Kp), 0);
        for (int64_t t = 0; t < T; ++t) std::memcpy(&xpad[(size_t)(t * Kp)], x + t * K, (size_t)K * 2);
        xa = xpad.data();
        ld = Kp;
    }
    const int64_t nblk = (T + 31) / 32;                                          // 32-token blocks
    const int64_t most = std::max<int64_t>(1, CHUNK_X_BYTES / (32 * Kp * 2));  // blocks a chunk may hold
    // chunks of equal size (not full ones and a remainder): a thread's items then cover as many blocks
    const int64_t nchunk = (nblk + most - 1) / most;
    const int64_t ncol = (R + 31) / 32;  // 32-output items per chunk
    const int64_t items = nchunk * ncol;
    // the last block's rows past T read zeros: one padded copy of it, shared by every item
    const int64_t tlast = 32 * (nblk - 1);
    std::vector<uint16_t> tail;
    if (T - tlast < 32) {
        tail.assign((size_t)(32 * ld), 0);
        std::memcpy(tail.data(), xa + tlast * ld, (size_t)((T - tlast) * ld) * 2);
    }
#pragma omp parallel num_threads(nthreads)
    {
        static const amx::Config cfg;
        SPARSA_TILE_CONFIG(&cfg);
        std::vector<TileBuf> b((size_t)(2 * nkc));
        alignas(64) float sum[32][32];
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t ch = it / ncol, jn = it % ncol;
            expand_item(w, jn, b.data());
            const int64_t c0 = 32 * jn;
            const int cols = (int)std::min<int64_t>(32, R - c0);
            const int64_t blk0 = ch * nblk / nchunk, blk1 = (ch + 1) * nblk / nchunk;
            for (int64_t blk = blk0; blk < blk1; ++blk) {
                const int64_t t0 = 32 * blk;
                const int rows = (int)std::min<int64_t>(32, T - t0);
                const uint16_t* a = rows < 32 ? tail.data() : xa + t0 * ld;
                const bool half = rows <= 16;
                const uint16_t* ynext = blk + 1 < blk1 ? y + (t0 + 32) * R + c0 : nullptr;
                if (half)
                    multiply_block<true>(a, ld, b.data(), nkc, sum, ynext, R);
                else
                    multiply_block<false>(a, ld, b.data(), nkc, sum, ynext, R);
                store_rows(sum, rows, bias, c0, cols, y + t0 * R, R);
            }
        }
        SPARSA_TILE_RELEASE();
    }
}

}  // namespace
#ifndef SPARSA_AMX_EMULATE
#pragma GCC pop_options
#endif

namespace {

// One product of small integers (exact in bf16 and fp32) against scalar sums: 40 tokens (a full block and a
// partial one), 40 columns (a partial chunk), 20 outputs (a partial block, and an item's second block past
// the weight), with a bias. Guards against a CPU, hypervisor or assembler that runs the tiles differently
// from what the tile order assumes.
bool selfcheck() {
    constexpr int64_t T = 40, K = 40, R = 20, nkc = 2, n16 = 2;
    auto bf = [](int v) { return sparsa_f32_to_bf16((float)v); };
    auto wv = [](int64_t r, int64_t k) { return (r + 2 * k) % 3 == 0 ? 0 : (int)((r * 5 + k) % 7) - 3; };
    std::vector<uint16_t> x(T * K), vals;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t k = 0; k < K; ++k) x[t * K + k] = bf((int)((t * 7 + k * 3) % 9) - 4);
    std::vector<uint32_t> masks(n16 * nkc * 16, 0);
    std::vector<int64_t> offs;
    for (int64_t blk = 0; blk < n16; ++blk)
        for (int64_t c = 0; c < nkc; ++c) {
            offs.push_back((int64_t)vals.size());
            for (int i = 0; i < 16; ++i)
                for (int j = 0; j < 32; ++j) {
                    const int64_t r = 16 * blk + j / 2, k = 32 * c + 2 * i + (j & 1);
                    if (r < R && k < K && wv(r, k) != 0) {
                        masks[(blk * nkc + c) * 16 + i] |= 1u << j;
                        vals.push_back(bf(wv(r, k)));
                    }
                }
        }
    offs.push_back((int64_t)vals.size());
    std::vector<float> bias(R);
    for (int64_t r = 0; r < R; ++r) bias[r] = (float)(r % 5) - 2.0f;
    std::vector<uint16_t> y(T * R);
    const Weight w{masks.data(), offs.data(), vals.data(), nkc, n16};
    run(x.data(), T, K, w, R, bias.data(), y.data(), 1);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < R; ++r) {
            int64_t want = (int64_t)bias[r];
            for (int64_t k = 0; k < K; ++k) want += ((t * 7 + k * 3) % 9 - 4) * (int64_t)wv(r, k);
            if (sparsa_bf16_to_f32(y[t * R + r]) != sparsa_bf16_to_f32(bf((int)want))) return false;
        }
    return true;
}

// 0 the tiles run here; 1 no AMX-BF16, AVX-512 or VBMI2 on this CPU; 2 Linux refused tile data; 3 the
// self-check failed. Software tiles: 0 (or 3).
int status() {
    static const int code = [] {
#ifndef SPARSA_AMX_EMULATE
        const int permitted = sparsa_amx_permitted();
        if (permitted != 0) return permitted;
        if (!__builtin_cpu_supports("avx512vbmi2") || !__builtin_cpu_supports("avx512bf16")) return 1;
#endif
        return selfcheck() ? 0 : 3;
    }();
    return code;
}

bool enabled() {
#ifdef SPARSA_AMX_EMULATE
    return status() == 0;  // a test build: SPARSA_ISA does not apply
#else
    return sparsa_isa_cap() >= 3 && sparsa_cpu_avx512_enabled() && status() == 0;
#endif
}

}  // namespace
#endif  // SPARSA_HAVE_BITMASK_AMX

extern "C" {

// Whether sparsa_bitmask_amx_bf16 runs here (CPU, build, SPARSA_ISA and the self-check).
int sparsa_bitmask_has_amx() {
#ifdef SPARSA_HAVE_BITMASK_AMX
    return enabled() ? 1 : 0;
#else
    return 0;
#endif
}

// Why the tiles do not run here: the codes of status() above (-1: a build without the kernel).
int sparsa_bitmask_amx_status() {
#ifdef SPARSA_HAVE_BITMASK_AMX
    return status();
#else
    return -1;
#endif
}

// y (T x R, bf16) = x (T x K, bf16) W^T + bias (fp32, or null) for W in the tile order of bitmask_tiles.py:
// masks (n16 * nkc * 16 words), offs (n16 * nkc + 1), vals; n16 = ceil(R / 16), nkc = ceil(K / 32).
// Returns 0, or -1 where the tiles do not run here (nothing written).
int sparsa_bitmask_amx_bf16(const uint16_t* x, int64_t T, int64_t K, const uint32_t* masks, const int64_t* offs,
                            const uint16_t* vals, int64_t R, const float* bias, uint16_t* y, int nthreads) {
#ifdef SPARSA_HAVE_BITMASK_AMX
    if (!enabled() || T <= 0 || K <= 0 || R <= 0) return -1;
    const Weight w{masks, offs, vals, (K + 31) / 32, (R + 15) / 16};
    run(x, T, K, w, R, bias, y, std::max(1, nthreads));
    return 0;
#else
    (void)x, (void)T, (void)K, (void)masks, (void)offs, (void)vals, (void)R, (void)bias, (void)y, (void)nthreads;
    return -1;
#endif
}

}  // extern "C"
