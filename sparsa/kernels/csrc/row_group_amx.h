// AMX tiles for bf16 RowGroup weights (included by row_group_linear.cpp after its dp namespace, whose
// panel packing, pair loads and driver they reuse).
//
// A tile computes Y^T for RT = 16 H output rows x 32 tokens: C[h][v] (16 rows x 16 tokens, fp32) +=
// A_h (16 rows x 32 kept columns of the group's weights, packed per call) . B_v (the same 32 kept
// columns x 16 tokens in AMX's pair layout). B is built per 32 kept columns from the fp32 token panel
// with the dp path's pair loads, one 64-byte row per column pair, and shared by the H weight tiles
// (groups of 32 rows read it twice). Tile registers: C 0-3, A 4-5, B 6-7.
#pragma once
#include "amx_tiles.h"
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx2,fma")
namespace amx {

// A tiles: wa[vg][kb][r][32] = W rows r of the virtual group, kept columns kb*32.. (zero past k)
inline int64_t wsize(int64_t k, int RT) { return (k + 31) / 32 * RT * 32; }

// (a group of fewer rows than RT fills the first G rows of its tiles, the rest zero: see dp::run's vrows)
inline void repack(const uint16_t* vals, int64_t ng, int64_t k, int64_t G, int RT, uint16_t* wa, int nthreads) {
    const int64_t vrows = std::min<int64_t>(G, RT), parts = G / vrows, nkb = (k + 31) / 32, nvg = ng * parts;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t vg = 0; vg < nvg; ++vg) {
        const int64_t g = vg / parts, r0 = (vg % parts) * vrows;
        const uint16_t* v = vals + g * k * G + r0;
        uint16_t* o = wa + vg * nkb * RT * 32;
        for (int64_t kb = 0; kb < nkb; ++kb)
            for (int r = 0; r < RT; ++r)
                for (int j = 0; j < 32; ++j) {
                    const int64_t c = kb * 32 + j;
                    o[(kb * RT + r) * 32 + j] = c < k && r < vrows ? v[c * G + r] : (uint16_t)0;
                }
    }
}

alignas(64) static const uint16_t kZeros[32] = {};

// B rows (pairs p of kept columns kb*32 + 2p, +1) for the two 16-token halves of a 32-token panel: two
// 64-byte loads (a column each), then a word unpack per half: the panel's token order (dp::amx_panel_pos)
// makes the in-lane unpacks yield tokens 0-15 and 16-31 in order, at half the shuffle-port cost of a
// two-source word permutation
template <bool Tail>
inline void build_b(const uint16_t* xb, const int32_t* cols, int64_t j0, int64_t k, uint32_t* b0, uint32_t* b1) {
    for (int p = 0; p < 16; ++p) {
        const int64_t ja = j0 + 2 * p, jb = ja + 1;
        const uint16_t* a = (!Tail || ja < k) ? xb + (int64_t)cols[ja] * 32 : kZeros;
        const uint16_t* b = (!Tail || jb < k) ? xb + (int64_t)cols[jb] * 32 : kZeros;
        const __m512i va = _mm512_load_si512(a), vb = _mm512_load_si512(b);
        _mm512_store_si512(b0 + 16 * p, _mm512_unpacklo_epi16(va, vb));
        _mm512_store_si512(b1 + 16 * p, _mm512_unpackhi_epi16(va, vb));
    }
}

// The B tiles of a run of groups over one panel, as one stream: block i of a group is built two blocks
// ahead of its tile loads, because a tile load does not take data forwarded from stores still in flight and
// would wait for them. The last blocks of a group build the first ones of the next group of the same panel,
// so a group of few blocks (very sparse weights) does not start with that wait.
struct BRing {
    alignas(64) uint32_t bb[3][2][16 * 16];  // [slot][token half][pair row][token]
    int64_t head = 0;                        // slot of the current group's block 0
    int64_t built = 0;                       // blocks of the current group built already (0, 1 or 2)
};

// buf[r][t] (r < RT, t < 32) = sum over the k kept columns of x[t][cols[j]] * w[j][r]. next_cols: the kept
// columns of the group the next call takes on the same panel (same k), or null.
template <int H>
void accumulate(const uint16_t* __restrict xt, const int32_t* __restrict cols, const uint16_t* __restrict wa,
                int64_t k, float (&buf)[16 * H][32], BRing& ring, const int32_t* next_cols) {
    constexpr int RT = 16 * H, NT = 32;
    SPARSA_TILE_ZERO(0);
    SPARSA_TILE_ZERO(1);
    if constexpr (H == 2) {
        SPARSA_TILE_ZERO(2);
        SPARSA_TILE_ZERO(3);
    }
    const int64_t nkb = (k + 31) / 32;
    // stream item i: block i of this group, or block i - nkb of the next one
    const int64_t items = nkb + (next_cols ? std::min<int64_t>(2, nkb) : 0);
    auto build = [&](int64_t i) {
        const int32_t* c = i < nkb ? cols : next_cols;
        const int64_t kb = i < nkb ? i : i - nkb;
        uint32_t* b0 = ring.bb[(ring.head + i) % 3][0];
        uint32_t* b1 = ring.bb[(ring.head + i) % 3][1];
        if ((kb + 1) * 32 <= k)
            build_b<false>(xt, c, kb * 32, k, b0, b1);
        else
            build_b<true>(xt, c, kb * 32, k, b0, b1);
    };
    int64_t built = ring.built;
    for (; built < std::min<int64_t>(2, items); ++built) build(built);
    for (int64_t kb = 0; kb < nkb; ++kb) {
        const uint16_t* a = wa + kb * RT * 32;
        const int64_t slot = (ring.head + kb) % 3;
        SPARSA_TILE_LOAD(4, a, 64);
        SPARSA_TILE_LOAD(6, ring.bb[slot][0], 64);
        SPARSA_TILE_LOAD(7, ring.bb[slot][1], 64);
        SPARSA_TILE_DP(0, 4, 6);
        SPARSA_TILE_DP(1, 4, 7);
        if constexpr (H == 2) {
            SPARSA_TILE_LOAD(5, a + 16 * 32, 64);
            SPARSA_TILE_DP(2, 5, 6);
            SPARSA_TILE_DP(3, 5, 7);
        }
        if (built < items && built < kb + 3) build(built++);
    }
    ring.head = (ring.head + nkb) % 3;
    ring.built = built - nkb;  // the next group's blocks built here
    SPARSA_TILE_STORE(0, &buf[0][0], NT * 4);
    SPARSA_TILE_STORE(1, &buf[0][16], NT * 4);
    if constexpr (H == 2) {
        SPARSA_TILE_STORE(2, &buf[16][0], NT * 4);
        SPARSA_TILE_STORE(3, &buf[16][16], NT * 4);
    }
}

// out[t * RT + r] (t < 32, r < RT): the tile's sums, token by token
template <int H>
void tile(const uint16_t* __restrict xt, const int32_t* __restrict cols, const uint16_t* __restrict wa, int64_t k,
          float* __restrict out) {
    alignas(64) float buf[16 * H][32];  // [row][token]
    BRing ring;
    accumulate<H>(xt, cols, wa, k, buf, ring, nullptr);
    dp::rows_to_tokens<16 * H, 32>(buf, out);
}

// Word permutations for a 16 x 16 transpose of bf16 held as 8 registers of two rows each (row 2i in words
// 0-15 of register i, row 2i + 1 in words 16-31) into 8 registers of two tokens each (token 2j in words 0-15,
// 2j + 1 in 16-31). Three stages each exchange one bit of the register index (r1, r2, r3 of the row) with
// one bit of the word position (t1, t2, t3 of the token): [stage][b][word] picks, for the output register
// whose exchanged token bit is b, each word from the pair of registers that differ in the row bit.
struct Transpose16Words {
    alignas(64) uint16_t idx[3][2][32];
    Transpose16Words() {
        for (int b = 0; b < 2; ++b)
            for (int P = 0; P < 32; ++P) {
                const int p4 = P >> 4 & 1, p3 = P >> 3 & 1, p2 = P >> 2 & 1, p1 = P >> 1 & 1, p0 = P & 1;
                // stage 1: words (r0 t3 t2 r1 t0) from (r0 t3 t2 t1 t0), t1 = b, r1 picks the register
                idx[0][b][P] = (uint16_t)(p1 * 32 + p4 * 16 + p3 * 8 + p2 * 4 + b * 2 + p0);
                // stage 2: words (r0 t3 r2 r1 t0) from (r0 t3 t2 r1 t0), t2 = b
                idx[1][b][P] = (uint16_t)(p2 * 32 + p4 * 16 + p3 * 8 + b * 4 + p1 * 2 + p0);
                // stage 3: words (t0 r3 r2 r1 r0), tokens' rows in order, from (r0 t3 r2 r1 t0), t3 = b
                idx[2][b][P] = (uint16_t)(p3 * 32 + p0 * 16 + b * 8 + p2 * 4 + p1 * 2 + p4);
            }
    }
};

// w[i] (rows 2i, 2i + 1) := w[j] (tokens 2j, 2j + 1), as Transpose16Words describes
inline void transpose16_words(__m512i (&w)[8]) {
    static const Transpose16Words T;
    for (int st = 0; st < 3; ++st) {
        const __m512i i0 = _mm512_load_si512(T.idx[st][0]), i1 = _mm512_load_si512(T.idx[st][1]);
        const int bit = 1 << st;  // the register-index bit this stage exchanges
        __m512i o[8];
        for (int a = 0; a < 8; ++a) {
            if (a & bit) continue;
            o[a] = _mm512_permutex2var_epi16(w[a], i0, w[a | bit]);
            o[a | bit] = _mm512_permutex2var_epi16(w[a], i1, w[a | bit]);
        }
        for (int a = 0; a < 8; ++a) w[a] = o[a];
    }
}

// y[t * R + r] = bf16(GELU?(sum + bias[r])) for t < nt, r < nout: the sums stay in row order, are rounded to
// bf16 two rows to a register, then one 16 x 16 word transpose per block gives each token's row run
template <int H>
void tile_store(const uint16_t* __restrict xt, const int32_t* __restrict cols, const uint16_t* __restrict wa,
                int64_t k, const float* bias, bool act, int nt, int nout, uint16_t* __restrict y, int64_t R,
                BRing& ring, const int32_t* next_cols) {
    alignas(64) float buf[16 * H][32];  // [row][token]
    accumulate<H>(xt, cols, wa, k, buf, ring, next_cols);
    for (int q = 0; q < H; ++q) {
        const int rows = std::min(16, nout - 16 * q);
        if (rows <= 0) break;
        const __mmask16 m = (__mmask16)((1u << rows) - 1u);
        for (int h = 0; h < 2 && 16 * h < nt; ++h) {
            __m512i w[8];
            for (int i = 0; i < 8; ++i) {
                if (2 * i >= rows) {  // padding rows of a group smaller than the tile: never stored, so no GELU
                    w[i] = _mm512_setzero_si512();
                    continue;
                }
                __m512 v[2];
                for (int e = 0; e < 2; ++e) {
                    const int r = 2 * i + e;
                    v[e] = _mm512_load_ps(&buf[16 * q + r][16 * h]);
                    if (bias && r < rows) v[e] = _mm512_add_ps(v[e], _mm512_set1_ps(bias[16 * q + r]));
                    if (act) v[e] = sparsa_gelu16(v[e]);
                }
                // VCVTNE2PS2BF16 rounds to nearest even like the other paths' rounding, but flushes denormals
                w[i] = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
            }
            transpose16_words(w);
            const int toks = std::min(16, nt - 16 * h);
            for (int t = 0; t < toks; ++t) {
                const __m512i& u = w[t >> 1];
                const __m256i run = (t & 1) ? _mm512_extracti64x4_epi64(u, 1) : _mm512_castsi512_si256(u);
                _mm256_mask_storeu_epi16(y + (int64_t)(16 * h + t) * R + 16 * q, m, run);
            }
        }
    }
}

// The Tiles interface of dp::run. Tile state is per thread: each task loads the configuration (oneDNN
// may have loaded its own on this thread) and releases the tiles at its end.
template <int H>
struct Tiles {
    static constexpr int RT = 16 * H, NT = 32;
    using Panel = uint16_t;
    static void pack(const uint16_t* x, int64_t K, int nt, uint16_t* xb) { dp::pack_panel_amx(x, K, nt, xb); }
    static int64_t wsize(int64_t k) { return amx::wsize(k, RT); }
    static void repack(const uint16_t* vals, int64_t ng, int64_t k, int64_t G, uint16_t* wp, int nthreads) {
        amx::repack(vals, ng, k, G, RT, wp, nthreads);
    }
    static void tile(const uint16_t* xb, const int32_t* cols, const uint16_t* wp, int64_t k, float* out) {
        amx::tile<H>(xb, cols, wp, k, out);
    }
    static constexpr bool kStoresBf16 = true;
    // AMX CPUs have 2 MiB of L2 per core: one chunk holds the weights of most BERT-sized layers at 75%+
    static constexpr int64_t kChunkBytes = 1024 * 1024;
    // the B-tile stream of the calling thread's run of groups over one panel (see BRing)
    using Stream = BRing;
    static void tile_store(const uint16_t* xb, const int32_t* cols, const uint16_t* wp, int64_t k, const float* bias,
                           bool act, int nt, int nout, uint16_t* y, int64_t R, BRing& ring, const int32_t* next_cols) {
        amx::tile_store<H>(xb, cols, wp, k, bias, act, nt, nout, y, R, ring, next_cols);
    }
    static void begin() {
        static const Config cfg;
        SPARSA_TILE_CONFIG(&cfg);
    }
    static void end() { SPARSA_TILE_RELEASE(); }
};

// the group sizes the tiles run: 16 and 32 rows fill them; 4 and 8 rows fill 16-row tiles partly (the tile
// products are not what bounds this kernel, the data movement around them is, which a group pays once)
inline bool takes(int64_t G) { return G == 4 || G == 8 || G == 16 || G == 32; }

// groups of takes(G) rows (the caller checks)
inline void run_any(const uint16_t* x, int64_t T, int64_t K, const int32_t* cols, const uint16_t* vals, int64_t ng,
                    int64_t k, int64_t G, const float* bias, float* y, uint16_t* ybf, int64_t R, const int32_t* perm,
                    int nthreads, bool act, const uint16_t* packed) {
    if (G == 32) return dp::run<Tiles<2>>(x, T, K, cols, vals, ng, k, G, bias, y, ybf, R, perm, nthreads, act, packed);
    dp::run<Tiles<1>>(x, T, K, cols, vals, ng, k, G, bias, y, ybf, R, perm, nthreads, act, packed);
}

// The weights in the tile order run_any reads (one virtual group per group, in tiles of tile_rows(G) rows),
// for run_any's packed.
inline int tile_rows(int64_t G) { return G == 32 ? 32 : 16; }
inline int64_t pack_size(int64_t ng, int64_t k, int64_t G) { return takes(G) ? ng * wsize(k, tile_rows(G)) : 0; }
inline void pack(const uint16_t* vals, int64_t ng, int64_t k, int64_t G, uint16_t* out, int nthreads) {
    repack(vals, ng, k, G, tile_rows(G), out, nthreads);
}

}  // namespace amx
#pragma GCC pop_options

namespace amx {

// One tile product of small integers (exact in bf16 and fp32) against scalar sums: 16 rows, 40 kept
// columns of 48 (a full block of 32 and a partial one), 32 tokens. Guards against a CPU, hypervisor or
// assembler that runs the instructions differently from what the packing assumes.
inline bool selfcheck() {
    constexpr int64_t K = 48, k = 40, G = 16, NT = 32;
    std::vector<uint16_t> x(NT * K), vals(k * G), wa((size_t)wsize(k, G));
    std::vector<int32_t> cols(k);
    auto bf = [](int v) {
        const float f = (float)v;
        uint32_t u;
        std::memcpy(&u, &f, 4);
        return (uint16_t)(u >> 16);
    };
    for (int64_t t = 0; t < NT; ++t)
        for (int64_t c = 0; c < K; ++c) x[t * K + c] = bf((int)((t * 7 + c * 3) % 9) - 4);
    for (int64_t j = 0; j < k; ++j) {
        cols[j] = (int32_t)(j + j / 5);  // skips every sixth column
        for (int64_t r = 0; r < G; ++r) vals[j * G + r] = bf((int)((r * 5 + j) % 7) - 3);
    }
    std::vector<float> out(NT * G);
    alignas(64) uint16_t xt[K * NT];
    dp::pack_panel_amx(x.data(), K, (int)NT, xt);
    repack(vals.data(), 1, k, G, G, wa.data(), 1);
    Tiles<1>::begin();
    tile<1>(xt, cols.data(), wa.data(), k, out.data());
    Tiles<1>::end();
    for (int64_t t = 0; t < NT; ++t)
        for (int64_t r = 0; r < G; ++r) {
            int64_t want = 0;
            for (int64_t j = 0; j < k; ++j)
                want += ((t * 7 + cols[j] * 3) % 9 - 4) * ((r * 5 + j) % 7 - 3);
            if (out[t * G + r] != (float)want) return false;
        }
    return true;
}

}  // namespace amx

// Whether the AMX tiles can run here: sparsa_amx_permitted's 0, 1 or 2; 3 the self-check's product was
// wrong. Software tiles: 0.
static inline int sparsa_amx_status() {
    static const int status = [] {
        const int permitted = sparsa_amx_permitted();
        if (permitted != 0) return permitted;
        return amx::selfcheck() ? 0 : 3;
    }();
    return status;
}
