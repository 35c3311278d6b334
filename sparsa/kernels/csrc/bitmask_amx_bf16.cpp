// Y[T, R] = X[T, K] W^T (+ bias) for a bf16 W in the Bitmask layout and many bf16 tokens, on AMX tiles.
//
// The tiles compute Y^T = W X^T, so the weight is read from the layout's own rows and nothing is kept
// beside it: W's rows are A tiles, each row expanded from its bits and packed values with one VBMI2
// expand-load per 32 columns, and X^T is the B operand, packed into AMX's pair layout (per 16 tokens and
// 32 columns, row i holds each token's column pair 2i, 2i + 1) once per token chunk (see run()). A work
// item is 32 outputs over a chunk of tokens and a K panel: it expands its 32 rows over the panel's columns
// once, then for every 32 tokens runs four TDPBF16PS per 32 columns into four C tiles (outputs x tokens),
// and after the last panel transposes them in registers and rounds the sums (plus bias) to bf16 rows of
// Y. So the work is dense, at AMX's rate, while
// the weight is read in its compressed form; dropped weights are zeros multiplied by X, so a NaN or Inf of
// X reaches the output as it does in F.linear. Tile registers: C 0-3, A 4-5, B 6-7.
//
// A call of several blocks splits K into panels of at most 2048 columns (partial sums kept in fp32 between
// them) and the tokens into chunks of at most ~1 MiB of a panel's packed X (chunks of equal size), chunk
// and panel in the outer order, so the tiles the items reread stay in L2. Where a chunk has at most four
// blocks (where the expansion's cost is spread over few tokens) and two items' A tiles fit in L2 beside
// the packed X, the next item's rows are expanded between the current item's tile products, so the
// expand-loads run while the tiles multiply. Threads take items one at a time as they finish, because the
// two threads of the VMs measured often ran at different speeds, except in a call of one 32-token block
// (batched decoding), which keeps its sums in the tiles over all of K and gives each thread a contiguous
// run of items, so that its reads of the packed values, prefetched a page ahead, form one stream.
//
// SPARSA_AMX_EMULATE (bitmask_amx_bf16_emu.cpp) builds the same driver on software tiles with scalar
// expand, pack and epilogue, for the tests on any CPU.
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <vector>
#include <omp.h>
#include "amx_tiles.h"
#include "bf16.h"
#include "cpu_isa.h"
#include "gelu.h"
#include "thread_scratch.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_BITMASK_AMX 1
#endif

#ifdef SPARSA_HAVE_BITMASK_AMX
#ifndef SPARSA_AMX_EMULATE
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx512vbmi2,avx2,fma")
#endif
namespace {

constexpr int64_t CHUNK_X_BYTES = 1 << 20;     // a panel's packed X per token chunk: well inside a 2 MiB L2
constexpr int TILE_WORDS = 16 * 32;            // bf16 elements of one tile
constexpr int64_t PANEL_CHUNKS = 64;           // 32-column chunks of a K panel, at most (2048 columns)
constexpr int64_t OVERLAP_L2_BYTES = 1 << 20;  // two items' A tiles and a panel's packed X, for the overlap
constexpr int64_t OVERLAP_MAX_BLOCKS = 4;      // 32-token blocks of a chunk, at most, for the overlap
constexpr int64_t PACK_AHEAD = 8;              // 32-column chunks the X pack fetches ahead

struct Weight {
    const uint8_t* bits;     // [R][kb]
    const int64_t* row_ptr;  // [R + 1]
    const uint16_t* vals;
    int64_t R, kb, nkc;  // rows, bytes per bit row, 32-column chunks
};

// The 32 bits of a bit row for columns 32c..32c + 31 (bytes past the row's kb read as zero)
inline uint32_t chunk_bits(const uint8_t* row, int64_t kb, int64_t c) {
    uint32_t m = 0;
    const int64_t b0 = 4 * c;
    if (b0 + 4 <= kb)
        std::memcpy(&m, row + b0, 4);  // x86 is little-endian
    else
        for (int64_t i = b0; i < kb; ++i) m |= (uint32_t)row[i] << (8 * (i - b0));
    return m;
}

// The A tiles of one item: rows r0..r0 + 31 of W over the 32-column chunks c0..c1 - 1, expanded to dense
// bf16 (zeros where not kept, and for rows past R), tile (h, c - c0) of rows r0 + 16h.. at
// a + (h (c1 - c0) + c - c0) TILE_WORDS. Whole tiles, not whole rows, are contiguous: rows a weight's width
// apart would put a tile's 16 lines in one L1 set. The expansion runs a few 32-column pieces at a time in
// the order the packed values lie (row by row), so that the next item's runs between the tile products of
// the current one (one stream of values a thread, as the hardware prefetcher and the page-ahead prefetch
// below want it).
struct Expansion {
    const Weight* w;
    const uint16_t** resume;  // per row: its next value after the chunks expanded (K panels), or null
    uint16_t* a = nullptr;
    const uint16_t* v = nullptr;
    int64_t r0 = 0, c0 = 0, c1 = 0, c = 0;
    int i = 32;
    Expansion(const Weight& weight, const uint16_t** row_resume) : w(&weight), resume(row_resume) {}
    void start(int64_t first_row, int64_t first_chunk, int64_t end_chunk, uint16_t* tiles) {
        a = tiles, r0 = first_row, c0 = first_chunk, c1 = end_chunk, c = c0, i = 0;
    }
    void finish() { step(32 * (c1 - c0)); }
    // n more pieces (or what is left). The loop works on local copies: its vector stores may alias the
    // members, which would otherwise be stored and reloaded around every piece.
    inline void step(int64_t n) {
        if (n <= 0 || i >= 32) return;
        const Weight& W = *w;
        const int64_t nc = c1 - c0, kb = W.kb;
        const uint16_t* vp = v;
        int64_t k = c;
        int row_i = i;
        while (n > 0 && row_i < 32) {
            const int64_t end = std::min<int64_t>(c1, k + n);
            uint16_t* dst = a + ((row_i / 16) * nc - c0) * TILE_WORDS + 32 * (row_i % 16);
            const int64_t r = r0 + row_i;
            n -= end - k;
            if (r >= W.R) {
                for (; k < end; ++k) std::memset(dst + k * TILE_WORDS, 0, 64);
            } else {
                const uint8_t* row = W.bits + r * kb;
                if (k == c0) {
                    // the row's first value in the chunks: where the previous panel's expansion of it ended
                    vp = c0 == 0 ? W.vals + W.row_ptr[r] : resume[r];
#ifndef SPARSA_AMX_EMULATE
                    _mm_prefetch((const char*)(row + 4 * kb), _MM_HINT_T0);
#endif
                }
                for (; k < end; ++k) {
                    const uint32_t m = chunk_bits(row, kb, k);
#ifdef SPARSA_AMX_EMULATE
                    for (int j = 0; j < 32; ++j) dst[k * TILE_WORDS + j] = (m >> j & 1u) ? *vp++ : (uint16_t)0;
#else
                    // the values a page ahead: an item starts a new stretch of them, which the hardware
                    // prefetcher picks up only after several misses
                    _mm_prefetch((const char*)vp + 4096, _MM_HINT_T0);
                    _mm512_storeu_si512(dst + k * TILE_WORDS, _mm512_maskz_expandloadu_epi16((__mmask32)m, vp));
                    vp += __builtin_popcount(m);
#endif
                }
            }
            if (k == c1) {
                if (resume && r < W.R) resume[r] = vp;
                k = c0, ++row_i;
            }
        }
        v = vp, c = k, i = row_i;
    }
};

#ifndef SPARSA_AMX_EMULATE
// r[i][j] <- r[j][i] for 16 rows of 16 32-bit elements
inline void transpose16(__m512* r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    // each 128-bit lane L of u[4g + j] holds column 4L + j of rows 4g..4g + 3
    __m512 u[16];
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; ++j) {
        const __m512 e0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), e1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
        const __m512 f0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        const __m512 f1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_shuffle_f32x4(e0, f0, 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(e0, f0, 0xDD);
        r[4 + j] = _mm512_shuffle_f32x4(e1, f1, 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(e1, f1, 0xDD);
    }
}
#endif

// The B tiles of tokens 16g..16g + 15 (past T: zeros), one per 32-column chunk c at xp + c * TILE_WORDS:
// row i, pair n holds x[16g + n][32c + 2i], x[16g + n][32c + 2i + 1] (columns past K: zeros)
void pack_tokens(const uint16_t* x, int64_t T, int64_t K, int64_t nkc, int64_t g, uint16_t* xp) {
    for (int64_t c = 0; c < nkc; ++c) {
        uint16_t* tile = xp + c * TILE_WORDS;
        const int64_t k0 = 32 * c;
#ifdef SPARSA_AMX_EMULATE
        for (int n = 0; n < 16; ++n)
            for (int i = 0; i < 32; ++i) {
                const int64_t t = 16 * g + n, k = k0 + i;
                tile[32 * (i / 2) + 2 * n + (i & 1)] = (t < T && k < K) ? x[t * K + k] : (uint16_t)0;
            }
#else
        const int64_t cols = std::min<int64_t>(32, K - k0);
        const __mmask32 m = cols >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << cols) - 1u);
        __m512 r[16];
        for (int n = 0; n < 16; ++n) {
            const int64_t t = 16 * g + n;
            if (t >= T) {
                r[n] = _mm512_setzero_ps();
                continue;
            }
            // 16 rows a row apart are more streams than the hardware prefetchers follow
            if (k0 + 32 * PACK_AHEAD < K) _mm_prefetch((const char*)(x + t * K + k0 + 32 * PACK_AHEAD), _MM_HINT_T0);
            r[n] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, x + t * K + k0));
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(tile + 32 * i, r[i]);
#endif
    }
}

// y[t][c0 + j] = bf16(GELU?(sum + bias[c0 + j])) for t < rows, j < cols, where the sums of token t and output
// j are sum[2 (t / 16) + j / 16][j % 16][t % 16] (C tiles of 16 outputs x 16 tokens)
inline void store_rows(const float (*sum)[16][16], int rows, const float* bias, bool act, int64_t c0, int cols,
                       uint16_t* y, int64_t R) {
#ifdef SPARSA_AMX_EMULATE
    for (int t = 0; t < rows; ++t)
        for (int j = 0; j < cols; ++j) {
            const float v = sum[2 * (t / 16) + j / 16][j % 16][t % 16] + (bias ? bias[c0 + j] : 0.0f);
            y[t * R + c0 + j] = sparsa_f32_to_bf16(act ? sparsa_gelu1(v) : v);
        }
#else
    const __mmask32 m = cols >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << cols) - 1u);
    const __mmask16 m0 = (__mmask16)m, m1 = (__mmask16)(m >> 16);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + c0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + c0 + 16) : _mm512_setzero_ps();
    for (int u = 0; 16 * u < rows; ++u) {
        __m512 lo[16], hi[16];
        for (int i = 0; i < 16; ++i) {
            lo[i] = _mm512_load_ps(sum[2 * u][i]);
            hi[i] = _mm512_load_ps(sum[2 * u + 1][i]);
        }
        transpose16(lo);
        transpose16(hi);
        const int n_end = std::min(16, rows - 16 * u);
        for (int n = 0; n < n_end; ++n) {
            __m512 v0 = _mm512_add_ps(lo[n], b0), v1 = _mm512_add_ps(hi[n], b1);
            if (act) v0 = sparsa_gelu16(v0), v1 = sparsa_gelu16(v1);
            // VCVTNE2PS2BF16 rounds to nearest even like the other paths' rounding, but flushes denormals
            _mm512_mask_storeu_epi16(y + (16 * u + n) * R + c0, m, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
        }
    }
#endif
}

// The sums of 32 outputs (the item's A tiles a, nc chunks) x 32 tokens (xg: token group g's B tile of the
// first chunk, chunks TILE_WORDS apart, group g + 1 gstride further) into the C tiles, which start from zero
// or, for a later K panel, from the partial sums in; then they go to out. After each chunk's products ex
// expands `pieces` pieces of the next item. ynext: the first of the 32 Y rows (R elements apart) the next
// block writes, or null; their lines are fetched for writing during the products, so the epilogue's stores
// do not wait for them. Half: a block of at most 16 tokens (a batched-decoding call, or the last block), one
// B tile and half the products.
template <bool Half>
void multiply_block(const uint16_t* a, int64_t nc, const uint16_t* xg, int64_t gstride, const float (*in)[16][16],
                    float (*out)[16][16], const uint16_t* ynext, int64_t R, Expansion& ex, int64_t pieces) {
    if (in) {
        SPARSA_TILE_LOAD(0, &in[0][0][0], 64);
        SPARSA_TILE_LOAD(1, &in[1][0][0], 64);
        if constexpr (!Half) {
            SPARSA_TILE_LOAD(2, &in[2][0][0], 64);
            SPARSA_TILE_LOAD(3, &in[3][0][0], 64);
        }
    } else {
        SPARSA_TILE_ZERO(0);
        SPARSA_TILE_ZERO(1);
        if constexpr (!Half) {
            SPARSA_TILE_ZERO(2);
            SPARSA_TILE_ZERO(3);
        }
    }
    const uint16_t *xg1 = xg + gstride, *a1 = a + nc * TILE_WORDS;
    for (int64_t c = 0; c < nc; ++c) {
#ifndef SPARSA_AMX_EMULATE
        if (ynext)
            for (int64_t r = c * 32 / nc; r < (c + 1) * 32 / nc; ++r)
                _m_prefetchw(const_cast<uint16_t*>(ynext + r * R));
#endif
        SPARSA_TILE_LOAD(4, a + c * TILE_WORDS, 64);
        SPARSA_TILE_LOAD(5, a1 + c * TILE_WORDS, 64);
        SPARSA_TILE_LOAD(6, xg + c * TILE_WORDS, 64);
        if constexpr (!Half) SPARSA_TILE_LOAD(7, xg1 + c * TILE_WORDS, 64);
        SPARSA_TILE_DP(0, 4, 6);
        if constexpr (!Half) SPARSA_TILE_DP(2, 4, 7);
        SPARSA_TILE_DP(1, 5, 6);
        if constexpr (!Half) SPARSA_TILE_DP(3, 5, 7);
        ex.step(pieces);
    }
    SPARSA_TILE_STORE(0, &out[0][0][0], 64);
    SPARSA_TILE_STORE(1, &out[1][0][0], 64);
    if constexpr (!Half) {
        SPARSA_TILE_STORE(2, &out[2][0][0], 64);
        SPARSA_TILE_STORE(3, &out[3][0][0], 64);
    }
}

void run(const uint16_t* x, int64_t T, int64_t K, const Weight& w, const float* bias, bool act, uint16_t* y,
         int nthreads) {
    const int64_t nkc = w.nkc, R = w.R;
    const int64_t ngroup = (T + 15) / 16;  // 16-token groups
    const int64_t nblk = (T + 31) / 32;    // 32-token blocks
    // K panels of equal width, at most PANEL_CHUNKS chunks, for calls of several blocks: a panel's packed
    // X stays in L2 across the items, and two items' A tiles fit beside it. A call of one block (batched
    // decoding) keeps its sums in the tiles over all of K: its X is small.
    const int64_t npanel = nblk == 1 ? 1 : (nkc + PANEL_CHUNKS - 1) / PANEL_CHUNKS;
    const int64_t pc = (nkc + npanel - 1) / npanel;  // chunks per panel (the last: what is left)
    const int64_t most = std::max<int64_t>(1, CHUNK_X_BYTES / (32 * 32 * pc * 2));  // blocks a chunk may hold
    // token chunks of equal size (not full ones and a remainder): a thread's items then cover as many blocks
    const int64_t nchunk = (nblk + most - 1) / most;
    const int64_t chunk_blocks = (nblk + nchunk - 1) / nchunk;
    const int64_t ncol = (R + 31) / 32;  // 32-output items per chunk and panel
    const size_t pack_words = (size_t)(2 * chunk_blocks * nkc * TILE_WORDS);
    // One chunk: the threads pack it together into the calling thread's buffer. More: every thread packs
    // each chunk into its own buffer before taking the chunk's items, because a shared pack rewritten
    // chunk after chunk moved its lines between the cores' caches, and a pack of all of a large X went
    // out to memory and back. Buffers are kept between calls: fresh pages per call would fault.
    const bool shared = nchunk == 1;
    static thread_local std::vector<uint16_t> caller_pack;
    if (shared && caller_pack.size() < pack_words) caller_pack.resize(pack_words);
    uint16_t* const shared_xp = caller_pack.data();
    // the sums of every item and block of a chunk between K panels (items move between threads)
    static thread_local std::vector<float> caller_partial;
    const size_t partial_floats = npanel > 1 ? (size_t)(ncol * chunk_blocks * 4 * 256) : 0;
    if (caller_partial.size() < partial_floats) caller_partial.resize(partial_floats);
    auto* const partial = reinterpret_cast<float (*)[16][16]>(caller_partial.data());
    // and where each row's values go on in the next panel
    static thread_local std::vector<const uint16_t*> caller_resume;
    if (npanel > 1 && caller_resume.size() < (size_t)R) caller_resume.resize(R);
    const uint16_t** const resume = npanel > 1 ? caller_resume.data() : nullptr;
    std::vector<std::atomic<int64_t>> counters(nchunk * npanel);  // the next item of each chunk and panel
    for (auto& n : counters) n.store(0, std::memory_order_relaxed);
    // the next item's expansion runs between the current one's products where both items' A tiles fit
    // beside the packed X; past that (a one-block call of wide rows) it runs after them, into the same tiles
    const bool overlap = chunk_blocks <= OVERLAP_MAX_BLOCKS &&
                         (2 * 32 + 32 * chunk_blocks) * (32 * pc) * 2 <= OVERLAP_L2_BYTES;
#pragma omp parallel num_threads(nthreads)
    {
        static const amx::Config cfg;
        SPARSA_TILE_CONFIG(&cfg);
        static thread_local std::vector<uint16_t> own_pack;
        if (!shared && own_pack.size() < pack_words) own_pack.resize(pack_words);
        uint16_t* const xp = shared ? shared_xp : own_pack.data();
        if (shared) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < ngroup; ++g) pack_tokens(x, T, K, nkc, g, xp + g * nkc * TILE_WORDS);
        }
        // two items' A tiles: the one multiplied and the next one, expanded meanwhile
        const size_t a_words = (size_t)(32 * 32 * pc);
        uint16_t* const abuf[2] = {sparsa_thread_scratch<uint16_t, 0>(a_words),
                                   sparsa_thread_scratch<uint16_t, 1>(overlap ? a_words : 0)};
        Expansion ex(w, resume);
        alignas(64) float sum[4][16][16];
        const int64_t nt = omp_get_num_threads(), th = omp_get_thread_num();
        for (int64_t ch = 0; ch < nchunk; ++ch) {
            const int64_t blk0 = ch * nblk / nchunk, blk1 = (ch + 1) * nblk / nchunk;
            const int64_t g0 = 2 * blk0, g1 = std::min(ngroup, 2 * blk1);
            if (!shared)
                for (int64_t g = g0; g < g1; ++g) pack_tokens(x, T, K, nkc, g, xp + (g - g0) * nkc * TILE_WORDS);
            const int64_t pieces = overlap ? (32 + (blk1 - blk0) - 1) / (blk1 - blk0) : 0;  // per chunk product
            for (int64_t p = 0; p < npanel; ++p) {
                // the partial sums pass between threads from panel to panel, and are rewritten chunk after chunk
                if (npanel > 1 && (p > 0 || ch > 0)) {
#pragma omp barrier
                }
                const int64_t c0 = p * pc, c1 = std::min(nkc, c0 + pc), nc = c1 - c0;
                const bool last = p == npanel - 1;
                // the items this thread takes: one at a time as it finishes (the two vCPUs measured often ran
                // at different speeds), or, in a call of one 32-token block (batched decoding, memory-bound),
                // one contiguous run, so the values stream runs on from one item into the next
                int64_t run_next = ncol * th / nt;
                const int64_t run_end = ncol * (th + 1) / nt;
                std::atomic<int64_t>& counter = counters[ch * npanel + p];
                auto take = [&]() -> int64_t {
                    if (nblk == 1) return run_next < run_end ? run_next++ : -1;
                    const int64_t j = counter.fetch_add(1, std::memory_order_relaxed);
                    return j < ncol ? j : -1;
                };
                int64_t jn = take();
                if (jn >= 0) {
                    ex.start(32 * jn, c0, c1, abuf[0]);
                    ex.finish();
                }
                int cur = 0;
                while (jn >= 0) {
                    const int64_t jnext = take();
                    if (jnext >= 0) ex.start(32 * jnext, c0, c1, abuf[overlap ? cur ^ 1 : cur]);
                    const uint16_t* a = abuf[cur];
                    const int64_t y0 = 32 * jn;
                    const int cols = (int)std::min<int64_t>(32, R - y0);
                    for (int64_t blk = blk0; blk < blk1; ++blk) {
                        const int64_t t0 = 32 * blk;
                        const int rows = (int)std::min<int64_t>(32, T - t0);
                        const uint16_t* xg = xp + (2 * (blk - blk0) * nkc + c0) * TILE_WORDS;
                        float (*part)[16][16] = partial + 4 * (jn * chunk_blocks + blk - blk0);
                        const float(*in)[16][16] = p > 0 ? part : nullptr;
                        float (*out)[16][16] = last ? sum : part;
                        const uint16_t* ynext = last && blk + 1 < blk1 ? y + (t0 + 32) * R + y0 : nullptr;
                        if (rows <= 16)
                            multiply_block<true>(a, nc, xg, nkc * TILE_WORDS, in, out, ynext, R, ex, pieces);
                        else
                            multiply_block<false>(a, nc, xg, nkc * TILE_WORDS, in, out, ynext, R, ex, pieces);
                        if (last) store_rows(sum, rows, bias, act, y0, cols, y + t0 * R, R);
                    }
                    ex.finish();  // what the products left (all of it without the overlap)
                    jn = jnext, cur ^= overlap ? 1 : 0;
                }
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
// partial one), 41 columns (a partial chunk and a partial byte of bits), 20 outputs (a partial item), with
// a bias. Guards against a CPU, hypervisor or assembler that runs the tiles differently from what the
// layouts assume.
bool selfcheck() {
    constexpr int64_t T = 40, K = 41, R = 20, kb = (K + 7) / 8;
    auto bf = [](int v) { return sparsa_f32_to_bf16((float)v); };
    auto wv = [](int64_t r, int64_t k) { return (r + 2 * k) % 3 == 0 ? 0 : (int)((r * 5 + k) % 7) - 3; };
    std::vector<uint16_t> x(T * K), vals;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t k = 0; k < K; ++k) x[t * K + k] = bf((int)((t * 7 + k * 3) % 9) - 4);
    std::vector<uint8_t> bits(R * kb, 0);
    std::vector<int64_t> row_ptr(1, 0);
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t k = 0; k < K; ++k)
            if (wv(r, k) != 0) {
                bits[r * kb + k / 8] |= (uint8_t)(1u << (k % 8));
                vals.push_back(bf(wv(r, k)));
            }
        row_ptr.push_back((int64_t)vals.size());
    }
    std::vector<float> bias(R);
    for (int64_t r = 0; r < R; ++r) bias[r] = (float)(r % 5) - 2.0f;
    std::vector<uint16_t> y(T * R);
    const Weight w{bits.data(), row_ptr.data(), vals.data(), R, kb, (K + 31) / 32};
    run(x.data(), T, K, w, bias.data(), false, y.data(), 1);
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

// y (T x R, bf16) = GELU?(x (T x K, bf16, contiguous) W^T + bias (fp32, or null)) for W given by the bf16
// Bitmask components bits (R x ceil(K / 8) bytes), row_ptr (R + 1) and values; act = 1: GELU (erf form).
// Returns 0, or -1 where the tiles do not run here (nothing written).
int sparsa_bitmask_amx_bf16(const uint16_t* x, int64_t T, int64_t K, const uint8_t* bits, const int64_t* row_ptr,
                            const uint16_t* values, int64_t R, const float* bias, uint16_t* y, int nthreads,
                            int act) {
#ifdef SPARSA_HAVE_BITMASK_AMX
    if (!enabled() || T <= 0 || K <= 0 || R <= 0) return -1;
    const Weight w{bits, row_ptr, values, R, (K + 7) / 8, (K + 31) / 32};
    run(x, T, K, w, bias, act != 0, y, std::max(1, nthreads));
    return 0;
#else
    (void)x, (void)T, (void)K, (void)bits, (void)row_ptr, (void)values, (void)R, (void)bias, (void)y, (void)nthreads;
    (void)act;
    return -1;
#endif
}

}  // extern "C"
