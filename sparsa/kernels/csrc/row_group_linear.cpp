// Y[T, R] = X[T, K] * W^T + b with W stored in the RowGroup layout:
//   columns[g][j]      int32, the k kept input columns shared by the G rows of group g (sorted)
//   values[g][j][r]    float, W[perm[g*G + r]][columns[g][j]] (rows padded to a multiple of G with zeros)
//   perm[s]            int32, the output row held by slot s (null or the identity: consecutive rows;
//                      values >= R are padding slots, never written)
//
// Permuted rows (run_permuted): tiles accumulate in slot order in a small scratch panel (NT tokens x a
// chunk's slots, so the column-block partial sums stay vectorised); once a panel is complete each slot
// is stored to its output row (one scalar store per output, into y rows kept in L2). The scatter weighs
// most when K is small (little work per output to hide it); identity permutations take the plain path.
//
// Register tile: NT tokens x G outputs; per kept column j: load G weights, broadcast X[t][c] for each
// of the NT tokens and accumulate with FMAs. AVX2: G/8 ymm x 6 tokens (G=16). AVX-512 (chosen at run
// time when the CPU has it; SPARSA_NO_AVX512=1 forces AVX2): G/16 zmm x 8 tokens, the broadcasts folded
// into the FMAs as {1to16} memory operands, so a column costs one load plus NT FMAs.
// Blocking (identity rows): column blocks of about 24 KiB of NT token rows are the outer loop; inside
// one, a chunk of groups whose weights for that block fill about 384 KiB (L2) passes over every token
// panel. Each panel's block of X rows is first copied to a small buffer (contiguous rows, strided so
// they start in different L1 sets) that stays in L1 while all the chunk's groups gather from it, and
// the next panel's rows are prefetched into L2 meanwhile. Sizing the chunk by the block's weights
// (not a whole group's) keeps X reuse high for large K, where a panel-major order reloads the X panel
// from L3 every few groups. Column blocks after the
// first add to the partial sums already stored in y. OpenMP over (group chunk, token block).
// With few tokens (GEMV) each tile keeps S independent partial sums to hide the FMA latency.
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#include "cpu_isa.h"
#endif
#include "bf16.h"
#include "gelu.h"
#include "transpose8.h"

namespace {

#ifdef __AVX2__
struct V8 {
    using T = __m256;
    static constexpr int W = 8;
    static inline T zero() { return _mm256_setzero_ps(); }
    static inline T load(const float* p) { return _mm256_loadu_ps(p); }
    static inline T load(const uint16_t* p) { return sparsa_load8_bf16(p); }
    static inline T bcast(const float* p) { return _mm256_broadcast_ss(p); }
    static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
    static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
    static inline void store(float* p, T v) { _mm256_storeu_ps(p, v); }
};
struct V4 {
    using T = __m128;
    static constexpr int W = 4;
    static inline T zero() { return _mm_setzero_ps(); }
    static inline T load(const float* p) { return _mm_loadu_ps(p); }
    static inline T load(const uint16_t* p) {
        const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
        return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    }
    static inline T bcast(const float* p) { return _mm_broadcast_ss(p); }
    static inline T fma(T a, T b, T c) { return _mm_fmadd_ps(a, b, c); }
    static inline T add(T a, T b) { return _mm_add_ps(a, b); }
    static inline void store(float* p, T v) { _mm_storeu_ps(p, v); }
};
#else
template <int WW>
struct VS {  // portable scalar "vector" of WW lanes
    struct T { float v[WW]; };
    static constexpr int W = WW;
    static inline T zero() { T r; for (int i = 0; i < WW; ++i) r.v[i] = 0.f; return r; }
    static inline T load(const float* p) { T r; for (int i = 0; i < WW; ++i) r.v[i] = p[i]; return r; }
    static inline T load(const uint16_t* p) { T r; for (int i = 0; i < WW; ++i) r.v[i] = sparsa_bf16_to_f32(p[i]); return r; }
    static inline T bcast(const float* p) { T r; for (int i = 0; i < WW; ++i) r.v[i] = *p; return r; }
    static inline T fma(T a, T b, T c) { for (int i = 0; i < WW; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
    static inline T add(T a, T b) { for (int i = 0; i < WW; ++i) a.v[i] += b.v[i]; return a; }
    static inline void store(float* p, T v) { for (int i = 0; i < WW; ++i) p[i] = v.v[i]; }
};
using V8 = VS<8>;
using V4 = VS<4>;
#endif

// number of independent partial sums so that at least 8 accumulators are in flight
constexpr int splits(int nt, int nv) { return nt * nv >= 8 ? 1 : (8 + nt * nv - 1) / (nt * nv); }

// One tile: NT token rows (x, stride ldx) times one group of G = V::W * NV outputs. Weights are float or
// bf16 (WT = uint16_t, widened in registers); act applies GELU to the finished outputs.
template <class V, int NV, int NT, class WT>
inline void tile(const float* __restrict x, int64_t ldx, const int32_t* __restrict cols,
                 const WT* __restrict vals, int64_t k, const float* __restrict bias,
                 float* __restrict y, int64_t ldy, int nout, bool accumulate, bool act) {
    constexpr int G = V::W * NV;
    constexpr int S = splits(NT, NV);
    typename V::T acc[S][NT][NV];
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 12
        for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[s][t][v] = V::zero();
    const float* xr[NT];
#pragma GCC unroll 12
    for (int t = 0; t < NT; ++t) {
        const float* p = x + t * ldx;
        // keep one base register per token row: saves an address add per broadcast
        asm("" : "+r"(p));
        xr[t] = p;
    }
    int64_t j = 0;
#pragma GCC unroll 2
    for (; j + S <= k; j += S) {
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) {
            const int64_t c = cols[j + s];
            const WT* w = vals + (j + s) * G;
            typename V::T wv[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) wv[v] = V::load(w + v * V::W);
#pragma GCC unroll 12
            for (int t = 0; t < NT; ++t) {
                typename V::T xb = V::bcast(xr[t] + c);
#pragma GCC unroll 4
                for (int v = 0; v < NV; ++v) acc[s][t][v] = V::fma(xb, wv[v], acc[s][t][v]);
            }
        }
    }
    for (; j < k; ++j) {
        const int64_t c = cols[j];
        const WT* w = vals + j * G;
#pragma GCC unroll 12
        for (int t = 0; t < NT; ++t) {
            typename V::T xb = V::bcast(xr[t] + c);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[0][t][v] = V::fma(xb, V::load(w + v * V::W), acc[0][t][v]);
        }
    }
#pragma GCC unroll 8
    for (int s = 1; s < S; ++s)
#pragma GCC unroll 12
        for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[0][t][v] = V::add(acc[0][t][v], acc[s][t][v]);
    if (accumulate) {  // add the partial sums of earlier column blocks, already in y
        alignas(64) float tmp[G] = {};
#pragma GCC unroll 12
        for (int t = 0; t < NT; ++t) {
            const float* src = y + t * ldy;
            if (nout != G) {
                std::memcpy(tmp, src, sizeof(float) * nout);
                src = tmp;
            }
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[0][t][v] = V::add(acc[0][t][v], V::load(src + v * V::W));
        }
    }
    if (bias) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            typename V::T b = V::load(bias + v * V::W);
#pragma GCC unroll 12
            for (int t = 0; t < NT; ++t) acc[0][t][v] = V::add(acc[0][t][v], b);
        }
    }
    if (nout == G) {
#pragma GCC unroll 12
        for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) V::store(y + t * ldy + v * V::W, acc[0][t][v]);
    } else {
        alignas(64) float tmp[G];
#pragma GCC unroll 12
        for (int t = 0; t < NT; ++t) {
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) V::store(tmp + v * V::W, acc[0][t][v]);
            std::memcpy(y + t * ldy, tmp, sizeof(float) * nout);
        }
    }
    if (act) {  // the outputs were just stored: still in L1
#pragma GCC unroll 1
        for (int t = 0; t < NT; ++t) sparsa_gelu_inplace(y + t * ldy, nout);
    }
}

template <class WT>
using TileFnT = void (*)(const float*, int64_t, const int32_t*, const WT*, int64_t, const float*, float*,
                         int64_t, int, bool, bool);

template <class V, int NV, int NT, class WT>
struct TileTable {
    static void fill(TileFnT<WT>* tab) {
        tab[NT] = &tile<V, NV, NT, WT>;
        TileTable<V, NV, NT - 1, WT>::fill(tab);
    }
};
template <class V, int NV, class WT>
struct TileTable<V, NV, 0, WT> {
    static void fill(TileFnT<WT>*) {}
};

#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_AVX512_PATH 1
// AVX-512 tiles (built with a target attribute, chosen at run time when the CPU has AVX-512F):
// NT tokens x NV zmm of outputs; the X broadcasts fold into the FMAs ({1to16} memory operands).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int NV, int NT, class WT>
void tile512(const float* __restrict x, int64_t ldx, const int32_t* __restrict cols,
             const WT* __restrict vals, int64_t k, const float* __restrict bias,
             float* __restrict y, int64_t ldy, int nout, bool accumulate, bool act) {
    constexpr int G = 16 * NV;
    constexpr int S = splits(NT, NV);
    __m512 acc[S][NT][NV];
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[s][t][v] = _mm512_setzero_ps();
    const float* xr[NT];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
        const float* p = x + t * ldx;
        asm("" : "+r"(p));
        xr[t] = p;
    }
    int64_t j = 0;
#pragma GCC unroll 2
    for (; j + S <= k; j += S) {
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) {
            const int64_t c = cols[j + s];
            const WT* w = vals + (j + s) * G;
            __m512 wv[NV];
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) wv[v] = load16(w + v * 16);
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) {
                const __m512 xb = _mm512_set1_ps(xr[t][c]);  // folds into the FMA as a {1to16} operand
#pragma GCC unroll 4
                for (int v = 0; v < NV; ++v) acc[s][t][v] = _mm512_fmadd_ps(xb, wv[v], acc[s][t][v]);
            }
        }
    }
    for (; j < k; ++j) {
        const int64_t c = cols[j];
        const WT* w = vals + j * G;
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) {
            const __m512 xb = _mm512_set1_ps(xr[t][c]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[0][t][v] = _mm512_fmadd_ps(xb, load16(w + v * 16), acc[0][t][v]);
        }
    }
#pragma GCC unroll 8
    for (int s = 1; s < S; ++s)
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[0][t][v] = _mm512_add_ps(acc[0][t][v], acc[s][t][v]);
    __mmask16 m[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
        const int n = std::min(16, std::max(0, nout - 16 * v));
        m[v] = (__mmask16)((1u << n) - 1u);
    }
    if (accumulate) {
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v)
                acc[0][t][v] = _mm512_add_ps(acc[0][t][v], _mm512_maskz_loadu_ps(m[v], y + t * ldy + v * 16));
    }
    if (bias) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            const __m512 b = _mm512_loadu_ps(bias + v * 16);
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) acc[0][t][v] = _mm512_add_ps(acc[0][t][v], b);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(y + t * ldy + v * 16, m[v], acc[0][t][v]);
    if (act) {
#pragma GCC unroll 1
        for (int t = 0; t < NT; ++t) sparsa_gelu_inplace(y + t * ldy, nout);
    }
}
#pragma GCC pop_options

template <int NV, int NT, class WT>
struct TileTable512 {
    static void fill(TileFnT<WT>* tab) {
        tab[NT] = &tile512<NV, NT, WT>;
        TileTable512<NV, NT - 1, WT>::fill(tab);
    }
};
template <int NV, class WT>
struct TileTable512<NV, 0, WT> {
    static void fill(TileFnT<WT>*) {}
};
#endif

#if defined(SPARSA_HAVE_AVX512_PATH)
// bf16 dot-product path (CPUs with AVX512-BF16), bf16 X and weights with 16 tokens or more. The tile is
// transposed against the fp32 one: each accumulator holds one output row for 16 tokens, so a weight
// pair broadcasts from memory into VDPBF16PS (two MACs per lane and instruction, twice the fp32 FMA).
// A panel of NT = 16 TV tokens is stored column-major as fp32 bit patterns, xt[c][t]; the bf16 pair of
// two kept columns for 16 tokens is then (xt[c0] >> 16) | xt[c1]: two loads and two integer ops per
// pair, shared by the RT output rows of a tile. Groups of 16 and 32 take tiles of 16 rows x 16 tokens,
// groups of 8 (4) 8 rows x 32 tokens (4 x 64), so every tile keeps 16 accumulators. Weights are repacked
// per call into pairs, wp[vg][p][r][2] for virtual groups of RT rows (a group of 32 is two of 16), with
// a zero partner for an odd last column.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx2,fma")
namespace dp {

// xt[c * NT + t] = float(x[t][c]) (row stride K) for c < K and t < nt; lanes t >= nt are zero
template <int NT>
void pack_panel(const uint16_t* x, int64_t K, int nt, float* xt) {
    int64_t c = 0;
    for (; c + 8 <= K; c += 8) {
        for (int h = 0; h < NT / 8; ++h) {
            if (8 * h >= nt) {
                for (int i = 0; i < 8; ++i) _mm256_storeu_ps(xt + (c + i) * NT + 8 * h, _mm256_setzero_ps());
                continue;
            }
            __m256 r[8];
            for (int i = 0; i < 8; ++i) {
                const int t = 8 * h + i;
                r[i] = t < nt ? sparsa_load8_bf16(x + t * K + c) : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(xt + (c + i) * NT + 8 * h, r[i]);
        }
    }
    for (; c < K; ++c)
        for (int t = 0; t < NT; ++t) xt[c * NT + t] = t < nt ? sparsa_bf16_to_f32(x[t * K + c]) : 0.f;
}

// where token t of a 32-token panel sits in a column's line when the panel is packed in the AMX tiles'
// order: runs of 4 tokens alternate between the two 16-token halves (0-3, 16-19, 4-7, 20-23, ...), so a
// 128-bit-lane unpack of two columns yields one half's pairs in token order (see amx::build_b)
constexpr int amx_panel_pos(int t) { return (t & 16 ? 4 : 0) + 8 * ((t & 15) >> 2) + (t & 3); }

// xb[c * NT + amx_panel_pos(t)] = x[t][c] in bf16 (the AMX tiles' panel: one 64-byte line per column of 32
// tokens); lanes t >= nt are zero. 16-bit transposes of 8 tokens x 16 columns: two 8 x 8 blocks, one per
// 128-bit lane.
inline void pack_panel_amx(const uint16_t* x, int64_t K, int nt, uint16_t* xb) {
    constexpr int NT = 32;
    int64_t c = 0;
    for (; c + 16 <= K; c += 16) {
        for (int h = 0; h < NT / 8; ++h) {
            __m256i r[8];
            for (int i = 0; i < 8; ++i) {
                const int t = 8 * h + i;
                r[i] = t < nt ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t * K + c))
                              : _mm256_setzero_si256();
            }
            __m256i a[8], b[8];
            for (int i = 0; i < 4; ++i) {  // a[2i], a[2i+1]: tokens 2i, 2i+1 interleaved, elements 0-3 / 4-7
                a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
                a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
            }
            for (int i = 0; i < 2; ++i) {  // b[4i + e]: tokens 4i .. 4i+3, elements 2e, 2e+1
                b[4 * i + 0] = _mm256_unpacklo_epi32(a[4 * i], a[4 * i + 2]);
                b[4 * i + 1] = _mm256_unpackhi_epi32(a[4 * i], a[4 * i + 2]);
                b[4 * i + 2] = _mm256_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);
                b[4 * i + 3] = _mm256_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);
            }
            for (int e = 0; e < 4; ++e) {  // tokens 0-7 of elements 2e, 2e+1 (low lane: column c + ., high: c + 8 + .)
                const __m256i lo = _mm256_unpacklo_epi64(b[e], b[4 + e]), hi = _mm256_unpackhi_epi64(b[e], b[4 + e]);
                uint16_t* o = xb + (c + 2 * e) * NT;
                const __m128i v[4] = {_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi),
                                      _mm256_extracti128_si256(lo, 1), _mm256_extracti128_si256(hi, 1)};
                const int64_t off[4] = {0, NT, 8 * NT, 9 * NT};
                for (int i = 0; i < 4; ++i) {  // tokens 8h..8h+3 and 8h+4..8h+7 go to two 4-token runs
                    _mm_storel_epi64(reinterpret_cast<__m128i*>(o + off[i] + amx_panel_pos(8 * h)), v[i]);
                    _mm_storeh_pd(reinterpret_cast<double*>(o + off[i] + amx_panel_pos(8 * h + 4)), _mm_castsi128_pd(v[i]));
                }
            }
        }
    }
    for (; c < K; ++c)
        for (int t = 0; t < NT; ++t) xb[c * NT + amx_panel_pos(t)] = t < nt ? x[t * K + c] : (uint16_t)0;
}

// acc += xp . {w pair broadcast}: GCC 12 does not fold the broadcast into VDPBF16PS itself, and a
// separate vpbroadcastd per MAC instruction costs a pipe slot
static inline __m512 dot_bcast(__m512 acc, __m512i xp, const uint32_t* w) {
    asm("vdpbf16ps %[w]%{1to16%}, %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(xp), [w] "m"(*w));
    return acc;
}

// the bf16 pairs (x[t][c0], x[t][c1]) of 16 tokens from the fp32 panel rows at a and b
static inline __m512i pair_of(const float* a, const float* b) {
    const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(a)), 16);
    return _mm512_or_si512(lo, _mm512_castps_si512(_mm512_loadu_ps(b)));
}

// out[t * RT + r] = buf[r][t]: per-row sums to token rows, by 8x8 transposes
template <int RT, int NT>
inline void rows_to_tokens(const float (&buf)[RT][NT], float* __restrict out) {
    static_assert(RT % 8 == 0 && NT % 8 == 0, "8x8 blocks");
    for (int t0 = 0; t0 < NT; t0 += 8)
        for (int q = 0; q < RT; q += 8) {
            __m256 b[8];
            for (int i = 0; i < 8; ++i) b[i] = _mm256_load_ps(&buf[q + i][t0]);
            transpose8(b);
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + (t0 + i) * RT + q, b[i]);
        }
}

// out[t * RT + r] (t < 16 TV, r < RT) = sum over the k kept columns of x[t][cols[j]] * w[j][r]
template <int RT, int TV>
void tile(const float* __restrict xt, const int32_t* __restrict cols, const uint16_t* __restrict wp, int64_t k,
          float* __restrict out) {
    constexpr int NT = 16 * TV;
    __m512 acc[TV][RT];
    for (int v = 0; v < TV; ++v)
        for (int r = 0; r < RT; ++r) acc[v][r] = _mm512_setzero_ps();
    const uint32_t* w = reinterpret_cast<const uint32_t*>(wp);
    const int64_t np = k / 2;
    for (int64_t p = 0; p < np; ++p, w += RT) {
        const float* a = xt + cols[2 * p] * NT;
        const float* b = xt + cols[2 * p + 1] * NT;
#pragma GCC unroll 4
        for (int v = 0; v < TV; ++v) {
            const __m512i xp = pair_of(a + 16 * v, b + 16 * v);
#pragma GCC unroll 16
            for (int r = 0; r < RT; ++r) acc[v][r] = dot_bcast(acc[v][r], xp, w + r);
        }
    }
    if (k & 1) {  // the odd last column: its partner lane is zero in x and w alike
        const float* a = xt + cols[k - 1] * NT;
        for (int v = 0; v < TV; ++v) {
            const __m512i xp = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(a + 16 * v)), 16);
            for (int r = 0; r < RT; ++r) acc[v][r] = dot_bcast(acc[v][r], xp, w + r);
        }
    }
    // row vectors to token rows through memory (indexing acc here made GCC spill it inside the loop)
    alignas(64) float buf[RT][NT];
    for (int v = 0; v < TV; ++v)
        for (int r = 0; r < RT; ++r) _mm512_store_ps(&buf[r][16 * v], acc[v][r]);
    if constexpr (RT % 8 == 0) {
        rows_to_tokens<RT, NT>(buf, out);
    } else {
        for (int t = 0; t < NT; ++t)
            for (int r = 0; r < RT; ++r) out[t * RT + r] = buf[r][t];
    }
}

// wp[vg][p][r][2] from vals[g][j][G] (vg = g * G / RT + part)
void repack(const uint16_t* vals, int64_t ng, int64_t k, int64_t G, int RT, uint16_t* wp, int nthreads) {
    const int64_t parts = G / RT, np = (k + 1) / 2, nvg = ng * parts;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t vg = 0; vg < nvg; ++vg) {
        const int64_t g = vg / parts, r0 = (vg % parts) * RT;
        const uint16_t* v = vals + g * k * G + r0;
        uint16_t* o = wp + vg * np * 2 * RT;
        for (int64_t p = 0; p < np; ++p)
            for (int r = 0; r < RT; ++r) {
                o[(p * RT + r) * 2] = v[(2 * p) * G + r];
                o[(p * RT + r) * 2 + 1] = 2 * p + 1 < k ? v[(2 * p + 1) * G + r] : (uint16_t)0;
            }
    }
}

// The VDPBF16PS tiles as the driver below takes them: RT output rows x NT tokens per tile, a weight
// pack of wsize(k) bf16 per virtual group, and no per-thread state.
template <int RT_, int TV>
struct DpTiles {
    static constexpr int RT = RT_, NT = 16 * TV;
    using Panel = float;
    static void pack(const uint16_t* x, int64_t K, int nt, float* xt) { pack_panel<NT>(x, K, nt, xt); }
    static constexpr bool kStoresBf16 = false;
    static constexpr int64_t kChunkBytes = 384 * 1024;  // weights a task reuses across its panels (L2)
    struct Stream {};                                    // nothing kept between groups
    static int64_t wsize(int64_t k) { return (k + 1) / 2 * 2 * RT; }
    static void repack(const uint16_t* vals, int64_t ng, int64_t k, int64_t G, uint16_t* wp, int nthreads) {
        dp::repack(vals, ng, k, G, RT, wp, nthreads);
    }
    static void tile(const float* xt, const int32_t* cols, const uint16_t* wp, int64_t k, float* out) {
        dp::tile<RT, TV>(xt, cols, wp, k, out);
    }
    static void begin() {}
    static void end() {}
};

template <class T>
using AlignedBuf = std::unique_ptr<T, decltype(&std::free)>;

// n elements at a 64-byte boundary (the size rounded up to whole cache lines, as aligned_alloc wants)
template <class T>
AlignedBuf<T> aligned_buf(int64_t n) {
    AlignedBuf<T> p(static_cast<T*>(std::aligned_alloc(64, ((size_t)n * sizeof(T) + 63) / 64 * 64)), &std::free);
    if (!p) throw std::bad_alloc();
    return p;
}

// ybf (T x R bf16) = x W^T + bias (+ GELU); y (T x R floats) is scratch for permuted rows only. Tiles:
// DpTiles or amx::Tiles (the per-tile product; this driver packs panels, blocks and stores).
template <class Tiles>
void run(const uint16_t* x, int64_t T, int64_t K, const int32_t* cols, const uint16_t* vals, int64_t ng, int64_t k,
         int64_t G, const float* bias, float* y, uint16_t* ybf, int64_t R, const int32_t* perm, int nthreads,
         bool act, const uint16_t* packed = nullptr) {
    constexpr int NT = Tiles::NT, RT = Tiles::RT;
    // a virtual group: the rows of one tile; a group smaller than the tile (AMX tiles of 16 rows, groups of
    // 4 or 8) fills its first vrows rows and the rest are zero weights (Tiles::repack), never stored
    const int64_t vrows = std::min<int64_t>(G, RT), parts = G / vrows, nvg = ng * parts, ws = Tiles::wsize(k);
    // the weights in tile order: the caller's pack (Tiles::repack of these vals, made once per weight), or
    // made here, 64-byte aligned (a tile row that straddles two cache lines loads at a fraction of the speed)
    AlignedBuf<uint16_t> wp_buf(nullptr, &std::free);
    if (!packed) {
        wp_buf = aligned_buf<uint16_t>(nvg * ws);
        Tiles::repack(vals, ng, k, G, wp_buf.get(), nthreads);
    }
    const uint16_t* const wp = packed ? packed : wp_buf.get();
    // a chunk of virtual groups holds about Tiles::kChunkBytes of weights (L2), reused by every panel of its
    // tasks; each chunk packs the panels again, so fewer chunks pack less
    int64_t vchunk = std::max<int64_t>(1, Tiles::kChunkBytes / std::max<int64_t>(1, ws * 2));
    const int64_t npan = (T + NT - 1) / NT;
    if (nthreads > 1 && npan < 2 * nthreads) vchunk = std::min<int64_t>(vchunk, std::max<int64_t>(1, nvg / (4 * nthreads)));
    vchunk = std::max<int64_t>(1, std::min<int64_t>(vchunk, nvg));
    const int64_t nchunks = (nvg + vchunk - 1) / vchunk;
    int64_t nblocks = 1;
    if (nthreads > 1 && nchunks < 4 * nthreads) nblocks = std::min<int64_t>(npan, (4 * nthreads + nchunks - 1) / nchunks);
    const int64_t pan_per_block = (npan + nblocks - 1) / nblocks;
    const int64_t ntasks = nchunks * nblocks;
    auto task = [&](int64_t id) {
        const int64_t ch = id / nblocks, bl = id % nblocks;
        const int64_t v0 = ch * vchunk, v1 = std::min(nvg, v0 + vchunk);
        const int64_t p0 = bl * pan_per_block, p1 = std::min(npan, p0 + pan_per_block);
        // aligned like the weight pack: each column's NT values start a cache line
        const AlignedBuf<typename Tiles::Panel> xt = aligned_buf<typename Tiles::Panel>(K * NT);
        alignas(64) float out[NT * RT + 16] = {};  // [t][r]; 16 spare floats: 16-wide loads of the last row
        typename Tiles::Stream stream;              // state the tiles keep from one group to the next
        Tiles::begin();
        for (int64_t pa = p0; pa < p1; ++pa) {
            const int64_t t0 = pa * NT;
            const int nt = (int)std::min<int64_t>(NT, T - t0);
            Tiles::pack(x + t0 * K, K, nt, xt.get());
            for (int64_t vg = v0; vg < v1; ++vg) {
                const int64_t g = vg / parts;
                if constexpr (Tiles::kStoresBf16) {
                    if (!perm) {  // the tiles round and store their rows themselves
                        const int64_t s0 = vg * vrows;
                        const int nout = (int)std::min<int64_t>(vrows, R - s0);
                        // the group stored next on this panel, whose first B tiles this one builds
                        const bool next = vg + 1 < v1 && (vg + 1) * vrows < R;
                        if (nout > 0)
                            Tiles::tile_store(xt.get(), cols + g * k, wp + vg * ws, k, bias ? bias + s0 : nullptr, act,
                                              nt, nout, ybf + t0 * R + s0, R, stream,
                                              next ? cols + (vg + 1) / parts * k : nullptr);
                        continue;
                    }
                }
                Tiles::tile(xt.get(), cols + g * k, wp + vg * ws, k, out);
                const int64_t s0 = vg * vrows;  // first slot
                if (perm) {
                    for (int t = 0; t < nt; ++t) {
                        float* yr = y + (t0 + t) * R;
                        for (int r = 0; r < vrows; ++r) {
                            const int32_t o = perm[s0 + r];
                            if (o < R) yr[o] = out[t * RT + r] + (bias ? bias[o] : 0.f);
                        }
                    }
                    continue;
                }
                // rounded to bf16 here: no float copy of y goes through memory
                const int nout = (int)std::min<int64_t>(vrows, R - s0);
                if (nout <= 0) continue;
                // 16 outputs at a time (AMX tiles of 32 rows hold two such column blocks)
                if (bias) {
                    for (int q = 0; q < nout; q += 16) {
                        const __mmask16 m = (__mmask16)((1u << std::min(16, nout - q)) - 1u);
                        const __m512 b = _mm512_maskz_loadu_ps(m, bias + s0 + q);
                        for (int t = 0; t < nt; ++t) {
                            float* o = out + t * RT + q;
                            _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), b));
                        }
                    }
                }
                if (act) sparsa_gelu_inplace16(out, nt * RT);  // one call for the tile (rows past nout: ignored)
                for (int q = 0; q < nout; q += 16) {
                    const __mmask16 m = (__mmask16)((1u << std::min(16, nout - q)) - 1u);
                    for (int t = 0; t < nt; ++t) {
                        const __m512 v = _mm512_maskz_loadu_ps(m, out + t * RT + q);
                        const __m128i lo = sparsa_cvt8_f32_bf16(_mm512_castps512_ps256(v));
                        const __m128i hi = sparsa_cvt8_f32_bf16(_mm512_extractf32x8_ps(v, 1));
                        _mm256_mask_storeu_epi16(ybf + (t0 + t) * R + s0 + q, m, _mm256_set_m128i(hi, lo));
                    }
                }
            }
        }
        Tiles::end();
    };
    if (nthreads <= 1 || ntasks == 1) {
        for (int64_t id = 0; id < ntasks; ++id) task(id);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t id = 0; id < ntasks; ++id) task(id);
    }
    if (perm) {  // permuted slots land anywhere in a row: GELU and rounding once every row is complete
        if (act)
#pragma omp parallel for num_threads(nthreads) schedule(static)
            for (int64_t t = 0; t < T; ++t) sparsa_gelu_inplace(y + t * R, (int)R);
        sparsa_f32_to_bf16_n(y, ybf, T * R, nthreads);
    }
}

// the tile shape for a group size: RT rows x 16 TV tokens, 16 accumulators where the panel (K x 16 TV
// floats) stays within about 384 KiB of L2, else fewer tokens (at least 8 accumulators)
void run_any(const uint16_t* x, int64_t T, int64_t K, const int32_t* cols, const uint16_t* vals, int64_t ng,
             int64_t k, int64_t G, const float* bias, float* y, uint16_t* ybf, int64_t R, const int32_t* perm,
             int nthreads, bool act) {
    const int64_t panel_bytes_per_16 = K * 16 * (int64_t)sizeof(float);
    const bool wide_ok = 4 * panel_bytes_per_16 <= 384 * 1024, pair_ok = 2 * panel_bytes_per_16 <= 384 * 1024;
    if (G == 4) {
        if (wide_ok) return run<DpTiles<4, 4>>(x, T, K, cols, vals, ng, k, G, bias, y, ybf, R, perm, nthreads, act);
        return run<DpTiles<4, 2>>(x, T, K, cols, vals, ng, k, G, bias, y, ybf, R, perm, nthreads, act);
    }
    if (G == 8) {
        if (pair_ok) return run<DpTiles<8, 2>>(x, T, K, cols, vals, ng, k, G, bias, y, ybf, R, perm, nthreads, act);
        return run<DpTiles<8, 1>>(x, T, K, cols, vals, ng, k, G, bias, y, ybf, R, perm, nthreads, act);
    }
    return run<DpTiles<16, 1>>(x, T, K, cols, vals, ng, k, G, bias, y, ybf, R, perm, nthreads, act);
}

}  // namespace dp
#pragma GCC pop_options
#include "row_group_amx.h"
#include "row_group_mlp_amx.h"
#endif

// Permuted rows. Each slot's output row is somewhere in y, so a weight chunk scatters into whole rows
// of y: the token panels are taken in blocks whose y rows (about 512 KiB) stay in L2 while every
// weight chunk passes over them (the chunk itself is reused across the block's panels).
template <int G, int NTMAX, class WT>
void run_permuted(const TileFnT<WT>* tab, const float* x, int64_t T, int64_t K, const int32_t* cols, const WT* vals,
                  int64_t ng, int64_t k, const float* bias, float* y, int64_t R, const int32_t* perm, int nthreads,
                  int64_t gchunk, int64_t nkb, const std::vector<int64_t>& starts, bool act) {
    std::vector<float> slot_bias;  // the bias in slot order (padding slots get 0)
    if (bias) {
        slot_bias.resize((size_t)(ng * G));
        for (int64_t s = 0; s < ng * G; ++s) slot_bias[s] = perm[s] < R ? bias[perm[s]] : 0.f;
        bias = slot_bias.data();
    }
    const int64_t npan = (T + NTMAX - 1) / NTMAX;
    const int64_t nchunks = (ng + gchunk - 1) / gchunk;
    const int64_t pan_bytes = NTMAX * R * (int64_t)sizeof(float);
    const int64_t P = std::min<int64_t>(npan, std::max<int64_t>(1, (512 * 1024) / pan_bytes));
    const int64_t nblk = (npan + P - 1) / P;
    int64_t nsplit = 1;  // few token blocks: parallelism must come from the weight chunks
    if (nthreads > 1 && nblk < 2 * nthreads) nsplit = std::min<int64_t>(nchunks, (2 * nthreads + nblk - 1) / nblk);
    const int64_t ntasks = nblk * nsplit;

    auto task = [&](int64_t id) {
        const int64_t blk = id / nsplit, sp = id % nsplit;
        const int64_t c0 = sp * nchunks / nsplit, c1 = (sp + 1) * nchunks / nsplit;
        const int64_t p0 = blk * P, p1 = std::min(npan, p0 + P);
        std::vector<float> scratch((size_t)(NTMAX * gchunk * G));
        for (int64_t ch = c0; ch < c1; ++ch) {
            const int64_t g0 = ch * gchunk, g1 = std::min(ng, g0 + gchunk);
            const int64_t width = (g1 - g0) * G;
            const int32_t* pp = perm + g0 * G;
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t t0 = p * NTMAX;
                const int nt = (int)std::min<int64_t>(NTMAX, T - t0);
                TileFnT<WT> fn = tab[nt];
                const float* xp = x + t0 * K;
                for (int64_t b = 0; b < nkb; ++b) {
                    for (int64_t g = g0; g < g1; ++g) {
                        const int64_t s0 = starts[g * (nkb + 1) + b], s1 = starts[g * (nkb + 1) + b + 1];
                        fn(xp, K, cols + g * k + s0, vals + (g * k + s0) * G, s1 - s0,
                           (bias && b == 0) ? bias + g * G : nullptr, scratch.data() + (g - g0) * G, width, G, b > 0,
                           act && b == nkb - 1);
                    }
                }
                for (int t = 0; t < nt; ++t) {  // store each slot to its output row
                    const float* src = scratch.data() + t * width;
                    float* dst = y + (t0 + t) * R;
                    for (int64_t s = 0; s < width; ++s) {
                        const int32_t r = pp[s];
                        if (r < R) dst[r] = src[s];
                    }
                }
            }
        }
    };
    if (nthreads <= 1 || ntasks == 1) {
        for (int64_t id = 0; id < ntasks; ++id) task(id);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t id = 0; id < ntasks; ++id) task(id);
    }
}

// XT: float, or bf16 (uint16_t: every panel is widened into the L1 buffer). y holds float results; with
// ybf each task also rounds its finished block of y to bf16 there (while it is still in L2).
template <int G, int NTMAX, class XT, class WT>
void run(const TileFnT<WT>* tab, const XT* x, int64_t T, int64_t K, const int32_t* cols, const WT* vals, int64_t ng,
         int64_t k, const float* bias, float* y, int64_t R, const int32_t* perm, int nthreads, bool act,
         uint16_t* ybf) {
    constexpr bool kWideX = std::is_same<XT, float>::value;
    // column blocks: the NTMAX rows of X touched by one block stay in L1 (about 24 KiB)
    const int64_t KB = std::max<int64_t>(64, (24 * 1024) / (NTMAX * (int64_t)sizeof(float)));
    const int64_t nkb = K > (3 * KB) / 2 ? (K + KB - 1) / KB : 1;
    // group chunk: about 384 KiB of one column block's weights (L2), reused across the token panels
    const int64_t bytes_per_group = std::max<int64_t>(1, ((k + nkb - 1) / nkb) * G * (int64_t)sizeof(float));
    int64_t gchunk = std::max<int64_t>(1, (384 * 1024) / bytes_per_group);
    const int64_t npan = (T + NTMAX - 1) / NTMAX;
    if (nthreads > 1 && npan < 2 * nthreads) {  // few tokens: parallelism must come from groups
        gchunk = std::min<int64_t>(gchunk, std::max<int64_t>(1, ng / (4 * nthreads)));
    }
    gchunk = std::max<int64_t>(1, std::min<int64_t>(gchunk, ng));
    gchunk = std::max<int64_t>(1, (ng + (ng + gchunk - 1) / gchunk - 1) / ((ng + gchunk - 1) / gchunk));  // equal chunks
    const int64_t nchunks = (ng + gchunk - 1) / gchunk;
    int64_t nblocks = 1;  // token blocks
    if (nthreads > 1 && nchunks < 4 * nthreads) nblocks = std::min<int64_t>(npan, (4 * nthreads + nchunks - 1) / nchunks);
    const int64_t pan_per_block = (npan + nblocks - 1) / nblocks;
    const int64_t ntasks = nchunks * nblocks;
    std::vector<int64_t> starts((size_t)(ng * (nkb + 1)));
    for (int64_t g = 0; g < ng; ++g) {
        const int32_t* c = cols + g * k;
        for (int64_t b = 0; b < nkb; ++b) starts[g * (nkb + 1) + b] = std::lower_bound(c, c + k, (int32_t)(b * KB)) - c;
        starts[g * (nkb + 1) + nkb] = k;
    }
    if (perm) {  // its panels take every column block in turn: the chunk holds whole groups (all k columns)
        int64_t pchunk = std::max<int64_t>(1, (384 * 1024) / std::max<int64_t>(1, k * G * (int64_t)sizeof(float)));
        if (nthreads > 1 && npan < 2 * nthreads) pchunk = std::min<int64_t>(pchunk, std::max<int64_t>(1, ng / (4 * nthreads)));
        pchunk = std::max<int64_t>(1, std::min<int64_t>(pchunk, ng));
        if constexpr (kWideX) {
            run_permuted<G, NTMAX, WT>(tab, x, T, K, cols, vals, ng, k, bias, y, R, perm, nthreads, pchunk, nkb,
                                       starts, act);
        }
        return;  // the bf16 entry point widens X itself before a permuted run
    }
    const int64_t bw = nkb == 1 ? K : KB;                 // widest column block
    const int64_t ldb = ((bw + 15) / 16) * 16 + 16;        // packed row stride: rows start in different L1 sets
    auto task = [&](int64_t id) {
        const int64_t ch = id / nblocks, bl = id % nblocks;
        const int64_t g0 = ch * gchunk, g1 = std::min(ng, g0 + gchunk);
        const int64_t p0 = bl * pan_per_block, p1 = std::min(npan, p0 + pan_per_block);
        std::unique_ptr<float[]> xbuf;  // uninitialised; only panels of several tokens are packed (bf16: all)
        if (!kWideX || T >= (NTMAX + 1) / 2) xbuf.reset(new float[(size_t)(NTMAX * ldb)]);
        for (int64_t b = 0; b < nkb; ++b) {
            const int64_t kb0 = nkb == 1 ? 0 : b * KB, kb1 = nkb == 1 ? K : std::min(K, kb0 + KB);
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t t0 = p * NTMAX;
                const int nt = (int)std::min<int64_t>(NTMAX, T - t0);
                TileFnT<WT> fn = tab[nt];
                const float* xp = reinterpret_cast<const float*>(x + t0 * K);  // used only when XT is float
                int64_t ldx = K;
                if (xbuf && (!kWideX || 2 * nt >= NTMAX)) {
                    for (int t = 0; t < nt; ++t) {
                        if constexpr (kWideX)
                            std::memcpy(xbuf.get() + t * ldb, x + (t0 + t) * K + kb0, sizeof(float) * (kb1 - kb0));
                        else
                            sparsa_bf16_row_to_f32(x + (t0 + t) * K + kb0, xbuf.get() + t * ldb, kb1 - kb0);
                    }
                    // the tiles index X by absolute column: shift the buffer's origin back by kb0 columns
                    xp = reinterpret_cast<const float*>(reinterpret_cast<uintptr_t>(xbuf.get()) -
                                                        (uintptr_t)kb0 * sizeof(float));
                    ldx = ldb;
                }
                // prefetch the next panel's rows of this column block, spread over the group loop
                const int64_t tn = t0 + NTMAX;
                const int ntn = (int)std::max<int64_t>(0, std::min<int64_t>(NTMAX, T - tn));
                const int64_t lpr = (kb1 - kb0 + 15) / 16;  // lines per row
                const int64_t nlines = ntn * lpr, ngc = g1 - g0;
                int64_t done = 0;
                float* yp = y + t0 * R;
                for (int64_t g = g0; g < g1; ++g) {
                    const int64_t upto = nlines * (g - g0 + 1) / ngc;
                    for (; done < upto; ++done) {
                        const int64_t r = done / lpr, l = done % lpr;
                        __builtin_prefetch(x + (tn + r) * K + kb0 + l * 16, 0, 2);
                    }
                    const int nout = (int)std::min<int64_t>(G, R - g * G);
                    const int64_t s0 = starts[g * (nkb + 1) + b], s1 = starts[g * (nkb + 1) + b + 1];
                    fn(xp, ldx, cols + g * k + s0, vals + (g * k + s0) * G, s1 - s0,
                       (bias && b == 0) ? bias + g * G : nullptr, yp + g * G, R, nout, b > 0, act && b == nkb - 1);
                }
            }
        }
        if (ybf) {  // this task's block of outputs is final
            const int64_t r0 = p0 * NTMAX, r1 = std::min(T, p1 * NTMAX);
            const int64_t c0 = g0 * G, c1 = std::min(R, g1 * G);
            for (int64_t r = r0; r < r1 && c1 > c0; ++r) sparsa_f32_row_to_bf16(y + r * R + c0, ybf + r * R + c0, c1 - c0);
        }
    };
    if (nthreads <= 1 || ntasks == 1) {
        for (int64_t id = 0; id < ntasks; ++id) task(id);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t id = 0; id < ntasks; ++id) task(id);
    }
}

// Thread-local scratch that keeps its capacity between calls (no page faults on every call).
float* scratch_f32(int which, size_t n) {
    thread_local std::unique_ptr<float[]> buf[2];
    thread_local size_t cap[2] = {0, 0};
    if (cap[which] < n) {
        buf[which].reset(new float[n]);
        cap[which] = n;
    }
    return buf[which].get();
}

template <int G, int NTMAX, class WT>
int dispatch(void (*fill)(TileFnT<WT>*), const void* x, bool x_bf16, int64_t T, int64_t K, const int32_t* cols,
             const WT* vals, int64_t ng, int64_t k, const float* bias, void* y, bool y_bf16, int64_t R,
             const int32_t* perm, int nthreads, bool act) {
    TileFnT<WT> tab[NTMAX + 1];
    fill(tab);
    float* yf = y_bf16 ? scratch_f32(0, (size_t)(T * R)) : static_cast<float*>(y);
    uint16_t* yb = y_bf16 ? static_cast<uint16_t*>(y) : nullptr;
    if (!x_bf16) {
        run<G, NTMAX, float, WT>(tab, static_cast<const float*>(x), T, K, cols, vals, ng, k, bias, yf, R, perm,
                                 nthreads, act, perm ? nullptr : yb);
    } else if (!perm) {
        run<G, NTMAX, uint16_t, WT>(tab, static_cast<const uint16_t*>(x), T, K, cols, vals, ng, k, bias, yf, R,
                                    perm, nthreads, act, yb);
    } else {  // permuted rows read X in place: widen it once
        float* xf = scratch_f32(1, (size_t)(T * K));
        sparsa_bf16_to_f32_n(static_cast<const uint16_t*>(x), xf, T * K, nthreads);
        run<G, NTMAX, float, WT>(tab, xf, T, K, cols, vals, ng, k, bias, yf, R, perm, nthreads, act, nullptr);
    }
    if (yb && perm) sparsa_f32_to_bf16_n(yf, yb, T * R, nthreads);
    return 0;
}

bool use_avx512() {
#ifdef SPARSA_HAVE_AVX512_PATH
    return sparsa_cpu_avx512_enabled();
#else
    return false;
#endif
}

// the bf16 dot-product tiles run: AVX512-BF16 on this CPU and SPARSA_ISA >= avx512
bool use_dpbf16() {
#ifdef SPARSA_HAVE_AVX512_PATH
    return sparsa_cpu_dpbf16_enabled();
#else
    return false;
#endif
}

// the bf16 AMX tiles run: AMX-BF16 usable here and SPARSA_ISA is amx (or unset)
bool use_amx() {
#ifdef SPARSA_HAVE_AVX512_PATH
    return sparsa_isa_cap() >= 3 && sparsa_cpu_avx512_enabled() && sparsa_amx_status() == 0;
#else
    return false;
#endif
}

// fewest tokens for the bf16 dot-product tiles (16 token lanes each); fewer run the widening tiles
constexpr int64_t kDpMinTokens = 16;

bool is_identity(const int32_t* perm, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (perm[i] != i) return false;
    return true;
}

template <class WT>
int linear(const void* x, bool x_bf16, int64_t T, int64_t K, const int32_t* cols, const WT* vals, int64_t ng,
           int64_t k, int64_t G, const float* bias, void* y, bool y_bf16, int64_t R, const int32_t* perm,
           int nthreads, bool act, const uint16_t* amx_packed = nullptr) {
    if (perm && is_identity(perm, ng * G)) perm = nullptr;
#ifdef SPARSA_HAVE_AVX512_PATH
    if constexpr (std::is_same<WT, uint16_t>::value) {
        if (x_bf16 && y_bf16 && amx::takes(G) && T >= kDpMinTokens && use_amx()) {
            amx::run_any(static_cast<const uint16_t*>(x), T, K, cols, vals, ng, k, G, bias,
                         perm ? scratch_f32(0, (size_t)(T * R)) : nullptr, static_cast<uint16_t*>(y), R, perm,
                         nthreads, act, amx_packed);
            return 0;
        }
        if (x_bf16 && y_bf16 && (G == 4 || G == 8 || G == 16 || G == 32) && T >= kDpMinTokens && use_dpbf16()) {
            dp::run_any(static_cast<const uint16_t*>(x), T, K, cols, vals, ng, k, G, bias,
                    perm ? scratch_f32(0, (size_t)(T * R)) : nullptr, static_cast<uint16_t*>(y), R, perm, nthreads,
                    act);
            return 0;
        }
    }
    if (use_avx512()) {
        switch (G) {
            case 16: return dispatch<16, 8, WT>(TileTable512<1, 8, WT>::fill, x, x_bf16, T, K, cols, vals, ng, k, bias,
                                                y, y_bf16, R, perm, nthreads, act);
            case 32: return dispatch<32, 8, WT>(TileTable512<2, 8, WT>::fill, x, x_bf16, T, K, cols, vals, ng, k, bias,
                                                y, y_bf16, R, perm, nthreads, act);
            default: break;
        }
    }
#endif
    switch (G) {
        case 4: return dispatch<4, 12, WT>(TileTable<V4, 1, 12, WT>::fill, x, x_bf16, T, K, cols, vals, ng, k, bias, y,
                                           y_bf16, R, perm, nthreads, act);
        case 8: return dispatch<8, 12, WT>(TileTable<V8, 1, 12, WT>::fill, x, x_bf16, T, K, cols, vals, ng, k, bias, y,
                                           y_bf16, R, perm, nthreads, act);
        case 16: return dispatch<16, 6, WT>(TileTable<V8, 2, 6, WT>::fill, x, x_bf16, T, K, cols, vals, ng, k, bias, y,
                                            y_bf16, R, perm, nthreads, act);
        case 32: return dispatch<32, 3, WT>(TileTable<V8, 4, 3, WT>::fill, x, x_bf16, T, K, cols, vals, ng, k, bias, y,
                                            y_bf16, R, perm, nthreads, act);
        default: return -1;
    }
}

}  // namespace

extern "C" {

int sparsa_row_group_version() { return 7; }

// 1 when the AVX-512 tiles run on this CPU
int sparsa_row_group_has_avx512() { return use_avx512() ? 1 : 0; }

// 1 when bf16 calls with 16 tokens or more run the AVX512-BF16 dot-product tiles on this CPU
int sparsa_row_group_has_dpbf16() { return use_dpbf16() ? 1 : 0; }

// 1 when bf16 calls with 16 tokens or more run the AMX tiles on this CPU (every group size: amx::takes)
int sparsa_row_group_has_amx() { return use_amx() ? 1 : 0; }

// why the AMX tiles do not run on this CPU whatever SPARSA_ISA says: 0 they can; 1 no AMX-BF16 (or no
// AVX-512 path); 2 the OS refused tile data; 3 the self-check failed
int sparsa_row_group_amx_status() {
#ifdef SPARSA_HAVE_AVX512_PATH
    return sparsa_amx_status();
#else
    return 1;
#endif
}

int sparsa_row_group_has_avx2() {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

// x: [T, K] contiguous; cols: [ng, k]; vals: [ng, k, G]; bias: [ng * G] (indexed by output row) or null;
// perm: [ng * G] slot -> output row, or null for consecutive rows; y: [T, R] contiguous; act: 0 none,
// 1 GELU (erf form) after the bias. Returns 0 on success, -1 for an unsupported group size.
int sparsa_row_group_linear_f32(const float* x, int64_t T, int64_t K, const int32_t* cols, const float* vals,
                                int64_t ng, int64_t k, int64_t G, const float* bias, float* y, int64_t R,
                                const int32_t* perm, int nthreads, int act) {
    return linear<float>(x, false, T, K, cols, vals, ng, k, G, bias, y, false, R, perm, nthreads, act == 1);
}

// The same with x, vals and y in bf16 (uint16_t bit patterns) and a float bias; products accumulate in
// float and each output is rounded to bf16 once.
int sparsa_row_group_linear_bf16(const uint16_t* x, int64_t T, int64_t K, const int32_t* cols, const uint16_t* vals,
                                 int64_t ng, int64_t k, int64_t G, const float* bias, uint16_t* y, int64_t R,
                                 const int32_t* perm, int nthreads, int act) {
    return linear<uint16_t>(x, true, T, K, cols, vals, ng, k, G, bias, y, true, R, perm, nthreads, act == 1);
}

// bf16 uint16_t elements of the AMX tile pack of a weight (0: no AMX path for this group size, or no AMX here).
int64_t sparsa_row_group_amx_pack_size(int64_t ng, int64_t k, int64_t G) {
#ifdef SPARSA_HAVE_AVX512_PATH
    return use_amx() ? amx::pack_size(ng, k, G) : 0;
#else
    return 0;
#endif
}

// Fills out (sparsa_row_group_amx_pack_size elements, 64-byte aligned) with vals in AMX tile order.
int sparsa_row_group_amx_pack(const uint16_t* vals, int64_t ng, int64_t k, int64_t G, uint16_t* out, int nthreads) {
#ifdef SPARSA_HAVE_AVX512_PATH
    if (amx::pack_size(ng, k, G) == 0 || (reinterpret_cast<uintptr_t>(out) & 63)) return -1;
    amx::pack(vals, ng, k, G, out, nthreads);
    return 0;
#else
    return -1;
#endif
}

// sparsa_row_group_linear_bf16 with the weight's AMX pack (from sparsa_row_group_amx_pack of these vals), which
// the AMX tiles read instead of repacking vals on every call; other paths ignore it. amx_pack null: repack.
int sparsa_row_group_linear_bf16_packed(const uint16_t* x, int64_t T, int64_t K, const int32_t* cols,
                                        const uint16_t* vals, int64_t ng, int64_t k, int64_t G, const float* bias,
                                        uint16_t* y, int64_t R, const int32_t* perm, int nthreads, int act,
                                        const uint16_t* amx_pack) {
    return linear<uint16_t>(x, true, T, K, cols, vals, ng, k, G, bias, y, true, R, perm, nthreads, act == 1, amx_pack);
}

// y = act(x W1^T + b1) W2^T + b2 (the hidden width R1 is W2's input width) with both weights RowGroup in
// groups of 16, no row permutation, bf16 operands and their AMX packs (sparsa_row_group_amx_pack), in one
// pass per 32-token panel. Returns 0, or -1 where this path does not run (no AMX tiles here or SPARSA_ISA below
// amx, fewer than 16 tokens, or too few panels to keep nthreads busy): then run the two products.
int sparsa_row_group_mlp_bf16(const uint16_t* x, int64_t T, int64_t K, const int32_t* cols1, const uint16_t* pack1,
                              int64_t ng1, int64_t k1, const float* bias1, int64_t R1, const int32_t* cols2,
                              const uint16_t* pack2, int64_t ng2, int64_t k2, const float* bias2, uint16_t* y,
                              int64_t R2, int nthreads, int act) {
#ifdef SPARSA_HAVE_AVX512_PATH
    if (T < kDpMinTokens || !use_amx() || !amx::mlp_balanced(T, nthreads)) return -1;
    if (ng1 * 16 < R1 || ng2 * 16 < R2 || (reinterpret_cast<uintptr_t>(pack1) & 63) ||
        (reinterpret_cast<uintptr_t>(pack2) & 63))
        return -1;
    amx::mlp16(x, T, K, cols1, pack1, ng1, k1, bias1, R1, cols2, pack2, ng2, k2, bias2, y, R2, nthreads, act == 1);
    return 0;
#else
    return -1;
#endif
}

}  // extern "C"
