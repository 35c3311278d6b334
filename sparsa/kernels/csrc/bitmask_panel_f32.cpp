// Y[T, R] = X[T, K] W^T (+ bias) for an fp32 W in the Bitmask layout (per-row mask bits, packed values) and
// many fp32 tokens (prefill, batched decoding), with AVX2 + FMA: sparse compute instead of expanding W to
// dense rows for a BLAS GEMM, which can only add the expansion to the dense GEMM's time.
//
// X is transposed once into fp32 panels (xt[c][TB], plus a zero row at column K): panels of 32 tokens, the
// last one 8, 16 or 32 wide (the fewest that hold its tokens), so a call of 9-16 tokens multiplies 16
// lanes per kept weight, not 32. Each thread takes blocks of BLOCK_ROWS rows: it lists each row's kept
// columns from its mask bits (one compress per 16 columns where AVX-512 is enabled, else an 8-column
// table lookup per byte) into a small buffer, then, for every
// panel, multiplies each kept column's tokens (TB / 8 loads) by the row's next packed value, broadcast: one
// FMA per 8 tokens and kept weight; 64 / TB rows run together (8 FMA chains). The weight's values are read
// in place (a row's packed values are in column order, as its list); nothing is stored beside the bitmask.
// Wide rows are walked in chunks of CHUNK_COLS columns so that the panel's rows being read stay in L1.
//
// Where AVX-512 is enabled (cpu_isa.h), panels of 16 and 32 tokens run 16 lanes a step (one FMA per 16
// tokens and kept weight, half the FMAs of the 8-lane loop); each lane does the same FMAs in the same
// order, so the results are the same bits either way.
//
// Only kept columns are multiplied, so a NaN or Inf of X at a dropped column would not reach the output as
// it does in F.linear: the entry point checks X first and returns 1 (the caller then expands W instead).
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <omp.h>
#include "cpu_isa.h"
#include "panel_pack.h"
#include "panel_store.h"
#include "thread_scratch.h"
#include "transpose8.h"

namespace {

constexpr int TB_MAX = 32;           // tokens per full panel: four 8-float vectors
constexpr int64_t CHUNK_COLS = 256;  // 32 KiB of a full panel
constexpr int BLOCK_ROWS = 64;       // rows whose column lists stay in L2 across panels
constexpr int64_t MAX_K = (int64_t)1 << 30;

// Chunks pay when the panel falls out of L1 often enough to outweigh reloading each row's sums per chunk.
// A call of at most 16 tokens (one narrow panel, from L2) walks K whole: chunks would read each row's
// values in pieces, one block of rows after another, which streams the weight from memory slower.
int64_t n_chunks(int64_t K, int64_t T) {
    return K > 2 * CHUNK_COLS && T > 16 ? (K + CHUNK_COLS - 1) / CHUNK_COLS : 1;
}

}  // namespace

#ifdef __AVX2__
namespace {

// for each mask byte: its set bits' positions, in order (unused slots 0)
struct ByteLists {
    alignas(8) uint8_t pos[256][8];
    ByteLists() {
        for (int b = 0; b < 256; ++b) {
            int n = 0;
            for (int i = 0; i < 8; ++i) pos[b][i] = 0;
            for (int i = 0; i < 8; ++i)
                if (b >> i & 1) pos[b][n++] = (uint8_t)i;
        }
    }
};
const ByteLists BYTE_LISTS;

bool x_finite(const float* x, int64_t n) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), e);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(v, e));
    }
    bool ok = _mm256_testz_si256(bad, bad);
    for (; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, x + i, 4);
        ok = ok && (u & 0x7f800000u) != 0x7f800000u;
    }
    return ok;
}

// xt[c * TB + i] = x[i * K + c] for i < nt, zero for nt <= i < TB and for the zero row c = K
template <int TB>
void pack(const float* __restrict x, int64_t K, int nt, float* __restrict xt) {
    std::memset(xt + K * TB, 0, sizeof(float) * TB);
    sparsa_pack_panel_f32<TB>(x, K, nt, xt);
}

// One row's kept columns into cols (8 slots of slack past the count; 16 for list_columns16), and where
// each chunk's columns start: start[k] for chunk k, start[nch] = the row's count.
void list_columns(const uint8_t* bits, int64_t K, int64_t nch, int32_t* cols, int32_t* start) {
    int32_t n = 0;
    const int64_t kb = (K + 7) / 8;
    for (int64_t k = 0; k < nch; ++k) {
        start[k] = n;
        const int64_t b0 = k * CHUNK_COLS / 8, b1 = nch > 1 ? std::min(kb, (k + 1) * CHUNK_COLS / 8) : kb;
        for (int64_t b = b0; b < b1; ++b) {
            uint32_t m = bits[b];
            if (b == kb - 1 && (K & 7)) m &= (1u << (K & 7)) - 1u;  // bits past K are not columns
            // no skip of an empty byte: at 90% sparsity 43% of bytes are empty, and the branch mispredicted
            // often enough to cost more than the store it saved
            const __m128i p = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(BYTE_LISTS.pos[m]));
            const __m256i c8 = _mm256_add_epi32(_mm256_cvtepu8_epi32(p), _mm256_set1_epi32((int)(8 * b)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(cols + n), c8);
            n += __builtin_popcount(m);
        }
    }
    start[nch] = n;
}

// one kept weight w of column c times the panel's TB tokens, into the NV = TB / 8 sums a
template <int NV>
inline void step(const float* __restrict xt, int32_t c, float w, __m256* a) {
    const __m256 wv = _mm256_set1_ps(w);
    const float* p = xt + (int64_t)c * (8 * NV);
    for (int v = 0; v < NV; ++v) a[v] = _mm256_fmadd_ps(wv, _mm256_load_ps(p + 8 * v), a[v]);
}

struct Weight {
    const uint8_t* bits;
    int64_t kb;
    const int64_t* row_ptr;
    const float* values;
    int64_t R, K, nch;
};

// Rows [r0, r0 + nr) of one panel of TB = 8 NV tokens from their column lists into part[row][TB], which
// holds each row's sums between chunks (chunk outside, rows inside: the chunk of the panel stays in L1).
// G = 8 / NV rows run together, so 8 FMA chains are in flight at every panel width, while each token's
// sum takes the row's kept columns in order, one FMA each: a token's result does not depend on the panel
// width, nor so on how many tokens the call has.
template <int NV>
void block_panel(const Weight& W, const float* xt, const int32_t* cols, int64_t stride, const int32_t* start,
                 int64_t r0, int64_t nr, float* part) {
    constexpr int TB = 8 * NV, G = 8 / NV;
    for (int64_t k = 0; k < W.nch; ++k) {
        for (int64_t r = 0; r < nr; r += G) {
            const int g = (int)std::min<int64_t>(G, nr - r);
            __m256 a[G][NV];
            const int32_t* c[G];
            const float* w[G];
            int64_t n[G];
            for (int i = 0; i < g; ++i) {
                for (int v = 0; v < NV; ++v)
                    a[i][v] = k == 0 ? _mm256_setzero_ps() : _mm256_load_ps(part + (r + i) * TB + 8 * v);
                const int32_t* st = start + (r + i) * (W.nch + 1);
                c[i] = cols + (r + i) * stride + st[k];
                w[i] = W.values + W.row_ptr[r0 + r + i] + st[k];
                n[i] = st[k + 1] - st[k];
            }
            int64_t all = 0;  // kept columns every one of the G rows has in this chunk
            if (g == G) {
                all = n[0];
                for (int i = 1; i < G; ++i) all = std::min(all, n[i]);
            }
            for (int64_t j = 0; j < all; ++j)
                for (int i = 0; i < G; ++i) step<NV>(xt, c[i][j], w[i][j], a[i]);
            for (int i = 0; i < g; ++i) {
                for (int64_t j = all; j < n[i]; ++j) step<NV>(xt, c[i][j], w[i][j], a[i]);
                for (int v = 0; v < NV; ++v) _mm256_store_ps(part + (r + i) * TB + 8 * v, a[i][v]);
            }
        }
    }
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
namespace {

// list_columns 16 columns a step: one compress of the column indices per two mask bytes
void list_columns16(const uint8_t* bits, int64_t K, int64_t nch, int32_t* cols, int32_t* start) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int32_t n = 0;
    for (int64_t k = 0; k < nch; ++k) {
        start[k] = n;
        int64_t c = k * CHUNK_COLS;  // a multiple of 16
        const int64_t c1 = nch > 1 ? std::min(K, (k + 1) * CHUNK_COLS) : K;
        for (; c + 16 <= c1; c += 16) {
            uint16_t m;
            std::memcpy(&m, bits + c / 8, 2);
            _mm512_storeu_si512(cols + n, _mm512_maskz_compress_epi32((__mmask16)m,
                                                                       _mm512_add_epi32(iota, _mm512_set1_epi32((int)c))));
            n += __builtin_popcount(m);
        }
        if (c < c1) {  // the last 1-15 columns: only bits below K count
            uint32_t m = bits[c / 8];
            if (c1 - c > 8) m |= (uint32_t)bits[c / 8 + 1] << 8;
            m &= (1u << (c1 - c)) - 1u;
            _mm512_storeu_si512(cols + n, _mm512_maskz_compress_epi32((__mmask16)m,
                                                                       _mm512_add_epi32(iota, _mm512_set1_epi32((int)c))));
            n += __builtin_popcount(m);
        }
    }
    start[nch] = n;
}

// block_panel's loop 16 lanes wide, for panels of TB = 16 NV tokens: G = 8 / NV rows run together
template <int NV>
void block_panel16(const Weight& W, const float* xt, const int32_t* cols, int64_t stride, const int32_t* start,
                   int64_t r0, int64_t nr, float* part) {
    constexpr int TB = 16 * NV, G = 8 / NV;
    for (int64_t k = 0; k < W.nch; ++k) {
        for (int64_t r = 0; r < nr; r += G) {
            const int g = (int)std::min<int64_t>(G, nr - r);
            __m512 a[G][NV];
            const int32_t* c[G];
            const float* w[G];
            int64_t n[G];
            for (int i = 0; i < g; ++i) {
                for (int v = 0; v < NV; ++v)
                    a[i][v] = k == 0 ? _mm512_setzero_ps() : _mm512_load_ps(part + (r + i) * TB + 16 * v);
                const int32_t* st = start + (r + i) * (W.nch + 1);
                c[i] = cols + (r + i) * stride + st[k];
                w[i] = W.values + W.row_ptr[r0 + r + i] + st[k];
                n[i] = st[k + 1] - st[k];
            }
            auto step16 = [&](int i, int64_t j) {
                const __m512 wv = _mm512_set1_ps(w[i][j]);
                const float* p = xt + (int64_t)c[i][j] * TB;
                for (int v = 0; v < NV; ++v) a[i][v] = _mm512_fmadd_ps(wv, _mm512_load_ps(p + 16 * v), a[i][v]);
            };
            int64_t all = 0;
            if (g == G) {
                all = n[0];
                for (int i = 1; i < G; ++i) all = std::min(all, n[i]);
            }
            for (int64_t j = 0; j < all; ++j)
                for (int i = 0; i < G; ++i) step16(i, j);
            for (int i = 0; i < g; ++i) {
                for (int64_t j = all; j < n[i]; ++j) step16(i, j);
                for (int v = 0; v < NV; ++v) _mm512_store_ps(part + (r + i) * TB + 16 * v, a[i][v]);
            }
        }
    }
}

}  // namespace
#pragma GCC pop_options

namespace {

// tokens in a panel holding nt of them: 8, 16 or 32
inline int panel_width(int64_t nt) { return nt <= 8 ? 8 : nt <= 16 ? 16 : TB_MAX; }

void run(const float* x, int64_t T, const Weight& W, const float* bias, bool act, float* y,
         int nthreads) {
    const int64_t K = W.K, R = W.R, npan = (T + TB_MAX - 1) / TB_MAX;
    // panel p holds tokens [32 p, 32 p + nt_p) in width[p] lanes, from offset[p] floats of the buffer
    std::vector<int> width((size_t)npan);
    std::vector<int64_t> offset((size_t)npan + 1, 0);
    for (int64_t p = 0; p < npan; ++p) {
        width[p] = panel_width(std::min<int64_t>(TB_MAX, T - p * TB_MAX));
        offset[p + 1] = offset[p] + (K + 1) * width[p];  // K columns and the zero row
    }
    // the packs write every float, padding and zero row included: no zeroed allocation per call
    float* panels = sparsa_thread_scratch<float, 0>((size_t)offset[npan]);
    const int64_t nblk = (R + BLOCK_ROWS - 1) / BLOCK_ROWS;
    const bool wide = sparsa_cpu_avx512_enabled();
    const int nth = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, std::max(nblk, npan)));
#pragma omp parallel num_threads(nth)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < npan; ++p) {
            const float* xp = x + p * TB_MAX * K;
            const int nt = (int)std::min<int64_t>(TB_MAX, T - p * TB_MAX);
            float* xt = panels + offset[p];
            if (width[p] == 8) pack<8>(xp, K, nt, xt);
            else if (width[p] == 16) pack<16>(xp, K, nt, xt);
            else pack<TB_MAX>(xp, K, nt, xt);
        }
        const int64_t stride = K + 16;  // a row's column list, with the table's or the compress's store slack
        int32_t* cols = sparsa_thread_scratch<int32_t, 1>((size_t)(BLOCK_ROWS * stride));
        int32_t* start = sparsa_thread_scratch<int32_t, 2>((size_t)(BLOCK_ROWS * (W.nch + 1)));
        alignas(64) float part[BLOCK_ROWS * TB_MAX];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblk; ++b) {
            const int64_t r0 = b * BLOCK_ROWS, nr = std::min<int64_t>(BLOCK_ROWS, R - r0);
            for (int64_t r = 0; r < nr; ++r) {
                const uint8_t* bits = W.bits + (r0 + r) * W.kb;
                if (wide) list_columns16(bits, K, W.nch, cols + r * stride, start + r * (W.nch + 1));
                else list_columns(bits, K, W.nch, cols + r * stride, start + r * (W.nch + 1));
            }
            for (int64_t p = 0; p < npan; ++p) {
                const int nt = (int)std::min<int64_t>(TB_MAX, T - p * TB_MAX);
                const float* xt = panels + offset[p];
                if (width[p] == 8) block_panel<1>(W, xt, cols, stride, start, r0, nr, part);
                else if (wide && width[p] == 16)
                    block_panel16<1>(W, xt, cols, stride, start, r0, nr, part);
                else if (wide) block_panel16<2>(W, xt, cols, stride, start, r0, nr, part);
                else if (width[p] == 16) block_panel<2>(W, xt, cols, stride, start, r0, nr, part);
                else block_panel<4>(W, xt, cols, stride, start, r0, nr, part);
                sparsa_panel::store_block(part, width[p], nt, r0, nr, R, bias, y + p * TB_MAX * R, act);
            }
        }
    }
}

}  // namespace
#endif

extern "C" {

// 1 when sparsa_bitmask_panel_f32 runs in this build (AVX2 + FMA)
int sparsa_bitmask_has_panel_f32() {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

// x: fp32 [T, K]; bits: [R, ceil(K / 8)]; row_ptr: [R + 1]; values: fp32 [row_ptr[R]]; bias: fp32 [R] or
// null; y: fp32 [T, R]; act = 1: GELU (erf form) on the sums. Returns 0 when done; 1 when X holds a NaN or
// Inf (y untouched: only the dense product propagates it to every row); -1 when this build has no panel
// kernel or K is too large.
int sparsa_bitmask_panel_f32(const float* x, int64_t T, int64_t K, const uint8_t* bits, const int64_t* row_ptr,
                             const float* values, int64_t R, const float* bias, float* y, int nthreads, int act) {
#ifdef __AVX2__
    if (K > MAX_K) return -1;
    if (!x_finite(x, T * K)) return 1;
    if (T <= 0 || R <= 0) return 0;
    const Weight W{bits, (K + 7) / 8, row_ptr, values, R, K, n_chunks(K, T)};
    run(x, T, W, bias, act != 0, y, nthreads);
    return 0;
#else
    (void)x, (void)T, (void)K, (void)bits, (void)row_ptr, (void)values, (void)R, (void)bias, (void)y, (void)nthreads;
    (void)act;
    return -1;
#endif
}

}  // extern "C"
