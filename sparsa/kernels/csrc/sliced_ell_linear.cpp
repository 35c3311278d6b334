// Y[T, R] = X[T, K] * W^T + b with W stored in the SlicedELL layout (slices of 2 rows):
//   slice s holds rows 2s and 2s+1, padded to a common length L_s; entries are interleaved
//   (slot j of row 2s at slice_ptr[s] + 2j, of row 2s+1 at slice_ptr[s] + 2j + 1);
//   padding entries have value 0 and a valid column.
//
// Tokens are vectorised: a panel of up to 32 tokens of X (64 for the AVX-512 rows) is transposed into
// xt[K][TB] (8x8 AVX transposes), so one kept weight w[r][c] multiplies the contiguous vector xt[c][0:TB].
// Two rows are processed together (2 x TB/8 accumulators) for instruction-level parallelism, over K in
// chunks that keep the panel's rows being read in L1 when the caller passes chunk bounds
// (sparsa_sliced_ell_chunk_bounds, computed once per weight). OpenMP over token panels, or, with few
// panels, over the panels or over ranges of slices (split_panels).
// A single token (decode) takes a scalar path instead (one_token): same products, each row summed in two
// interleaved partial sums, so its rounding differs slightly from the panel path's.
//
// bfloat16 (sparsa_sliced_ell_linear_bf16): the same kernel with bf16 X, weight values and Y. X is widened
// to fp32 while its panel is transposed into xt, each weight is widened (a shift) as it is broadcast,
// products accumulate in fp32 exactly as in the fp32 kernel (same order),
// and the output (+ bias, fp32 or bf16) is rounded to bf16 once (nearest even). Where the CPU has
// AVX512-BF16, panels of two tokens or more take the dot-product rows instead (namespace dp), which read a
// per-weight plan (DpPair) with their own column chunks (DP_CHUNK) instead of cols / vals and the bounds.
#include <cstdint>
#include <cstring>
#include <algorithm>
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
#include "panel_store.h"
#include "dp_pack.h"
#include "thread_scratch.h"

namespace {

using sparsa_panel::store_block;
using sparsa_panel::store_y;

constexpr int TBMAX = 32;
// tokens per panel of the 16-float rows for weights with at least ZMM64_MIN_SLOTS slots per row: a weight's
// broadcast and column index serve four 16-token FMAs. Sparser rows keep 32-token panels, half the bytes of
// panel their scattered columns are read from (figures in docs/benchmarks.md).
constexpr int TBMAX_ZMM = 64;
constexpr int64_t ZMM64_MIN_SLOTS = 128;

// element access of X / weights as fp32 (float: as is; bf16 stored as uint16_t: widened)
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return sparsa_bf16_to_f32(v); }
#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return sparsa_load8_bf16(p); }
#endif

// xt[c * TB + i] = x[i * K + c] for i < nt, zero for nt <= i < TB (widened to fp32)
template <typename XT>
void transpose_panel(const XT* __restrict x, int64_t K, int nt, int TB, float* __restrict xt) {
    int64_t c = 0;
#ifdef __AVX2__
    if (TB % 8 == 0) {
        for (; c + 8 <= K; c += 8) {
            for (int i0 = 0; i0 < TB; i0 += 8) {
                __m256 r[8];
                if (i0 + 8 <= nt) {
                    for (int i = 0; i < 8; ++i) r[i] = load8(x + (int64_t)(i0 + i) * K + c);
                } else {
                    for (int i = 0; i < 8; ++i)
                        r[i] = (i0 + i < nt) ? load8(x + (int64_t)(i0 + i) * K + c) : _mm256_setzero_ps();
                }
                transpose8(r);
                float* o = xt + c * TB + i0;
                for (int k = 0; k < 8; ++k) _mm256_storeu_ps(o + k * TB, r[k]);
            }
        }
    }
#endif
    for (; c < K; ++c)
        for (int i = 0; i < TB; ++i) xt[c * TB + i] = i < nt ? to_f32(x[(int64_t)i * K + c]) : 0.f;
}

// Columns per chunk: a 32-token panel's chunk (KCHUNK x 128 B) stays in L1 while every row of a block
// reads its kept columns from it; from L2, the one 32-byte load per FMA is bandwidth-bound. (A 64-token
// panel's chunk is twice that: the chunks are made once per weight, whatever the panel.)
constexpr int KCHUNK = 256;
// Chunking pays only when each row has enough entries per chunk to hide its per-chunk cost (reloading
// the accumulators, the loop exits); below this many slots per row and chunk, one pass reads from L2.
constexpr int64_t MIN_SLOTS_PER_CHUNK = 40;
// Slices per block: the block's partial sums (SBLOCK x 2 x TB floats) stay in L1 between chunks, and its
// outputs are stored as runs of 2 * SBLOCK contiguous values per token.
constexpr int SBLOCK = 64;

// The number of K chunks for a weight of P slots over ns slices (1: no chunking).
inline int64_t n_chunks(int64_t K, int64_t P, int64_t ns) {
    if (K <= KCHUNK || ns == 0) return 1;
    const int64_t nch = (K + KCHUNK - 1) / KCHUNK;
    return P / (2 * ns) >= MIN_SLOTS_PER_CHUNK * nch ? nch : 1;
}

// The first j in [lo, lo + n) where before(j) is false (lo + n if none), before() being true on a prefix
// of the range: a branch-free binary search.
template <typename Before>
inline int64_t first_not(int64_t lo, int64_t n, Before before) {
    while (n > 1) {
        const int64_t half = n / 2;
        lo = before(lo + half) ? lo + half : lo;
        n -= half;
    }
    return n == 1 ? lo + before(lo) : lo;
}

// bounds[(s * (nch - 1) + k - 1) * 2 + i], k = 1 .. nch - 1: the first slot of row i of slice s whose column
// is in chunk k or later (chunk k: columns [k * KCHUNK, (k + 1) * KCHUNK)). Found by binary search over the
// row's kept slots, exact when they are sorted (as from_dense stores them); unsorted columns only put
// slots in another chunk. A row's padding (column 0 after its kept slots, which have increasing columns,
// so only its first slot may be column 0) is found by a binary search for that run of zeros.
void chunk_bounds(const int64_t* __restrict sptr, const int32_t* __restrict cols, int64_t ns, int64_t nch,
                  int32_t* __restrict bounds) {
    for (int64_t s = 0; s < ns; ++s) {
        const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
        for (int i = 0; i < 2; ++i) {
            const int32_t* c = cols + p0 + i;  // slot j of row i: c[2 * j]
            // kept slots: up to the first j >= 1 with column 0 (L if none)
            const auto nonzero = [&](int64_t j) { return c[2 * j] != 0; };
            const int64_t kept = L > 1 && c[2 * (L - 1)] == 0 ? first_not(1, L - 1, nonzero) : L;
            for (int64_t k = 1; k < nch; ++k) {
                const int32_t bound = (int32_t)(k * KCHUNK);
                const auto below = [&](int64_t j) { return c[2 * j] < bound; };
                bounds[(s * (nch - 1) + k - 1) * 2 + i] = (int32_t)first_not(0, kept, below);
            }
        }
    }
}

// Slice s's slots in chunk k: row i takes [start[i], end[i]) = [pos[i], its bound for the chunk), the last
// chunk the rest, and pos[i] advances to the end. Clamped, so any bounds partition the slots in order.
inline void chunk_slots(const int32_t* bounds, int64_t s, int64_t nch, int64_t k, int64_t L, int64_t pos[2],
                        int64_t start[2], int64_t end[2]) {
    for (int i = 0; i < 2; ++i) {
        start[i] = pos[i];
        const int64_t bound = k + 1 < nch ? bounds[(s * (nch - 1) + k) * 2 + i] : L;
        end[i] = std::min<int64_t>(L, std::max<int64_t>(pos[i], bound));
        pos[i] = end[i];
    }
}

#ifdef __AVX2__
// 8-float rows (AVX2)
namespace ymm {
using vec = __m256;
constexpr int VW = 8, TWO_SLICE_NV = 2;  // 16 registers: 8 sums
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_load_ps(p); }
inline void vstore(float* p, vec v) { _mm256_store_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 bcast1(const float* w) { return _mm256_broadcast_ss(w); }
// bf16 w broadcast to every 16-bit lane, then the low halves cleared: fp32 (w << 16) in every lane
inline __m256 bcast1(const uint16_t* w) {
    const __m256i b = _mm256_broadcastw_epi16(_mm_cvtsi32_si128(*w));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int32_t)0xffff0000u)));
}
// the two rows' weights of one slot (w[0], w[1]); bf16: one 32-bit broadcast split into two (shift / mask)
inline void bcast2(const float* w, __m256& w0, __m256& w1) {
    w0 = _mm256_broadcast_ss(w);
    w1 = _mm256_broadcast_ss(w + 1);
}
inline void bcast2(const uint16_t* w, __m256& w0, __m256& w1) {
    int32_t u;
    std::memcpy(&u, w, 4);  // w[0] in the low half, w[1] in the high half (little endian)
    const __m256i b = _mm256_set1_epi32(u);
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    w1 = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int32_t)0xffff0000u)));
}
#include "sliced_ell_rows.h"
}  // namespace ymm
#else
// panel_rows (sliced_ell_rows.h) without vector instructions, for CPUs without AVX2 (TB lanes in xt). WT / YT:
// float, or uint16_t for bf16 weight values / output.
//
// With nch > 1, K is walked in chunks of KCHUNK columns for a block of SBLOCK slices at a time; each row
// takes its next slots up to its bound for the chunk (see chunk_bounds; the last chunk takes the rest).
// The two rows of a slice run together while both have slots in the chunk, then the longer one alone.
// Per row the products are added in slot order, chunked or not, so the result does not depend on nch.
template <int TB, typename WT, typename YT>
void panel_rows(const float* __restrict xt, int nt, const int64_t* __restrict sptr, const int32_t* __restrict cols,
                const WT* __restrict vals, const int32_t* __restrict bounds, int64_t nch, int64_t s0, int64_t s1,
                int64_t R, const float* __restrict bias, YT* __restrict y, bool act) {
    alignas(64) float part[SBLOCK][2][TB];
    for (int64_t sb = s0; sb < s1; sb += SBLOCK) {
        const int64_t se = std::min(s1, sb + SBLOCK);
        (void)bounds;
        (void)nch;
        for (int64_t s = sb; s < se; ++s) {
            const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
            const int32_t* c = cols + p0;
            const WT* w = vals + p0;
            float* q0 = part[s - sb][0];
            float* q1 = part[s - sb][1];
            for (int i = 0; i < TB; ++i) q0[i] = q1[i] = 0.f;
            for (int64_t j = 0; j < L; ++j) {
                const float* x0 = xt + (int64_t)c[2 * j] * TB;
                const float* x1 = xt + (int64_t)c[2 * j + 1] * TB;
                for (int i = 0; i < TB; ++i) {
                    q0[i] += to_f32(w[2 * j]) * x0[i];
                    q1[i] += to_f32(w[2 * j + 1]) * x1[i];
                }
            }
        }
        const int64_t r0 = 2 * sb, nr = std::min<int64_t>(R, 2 * se) - r0;
        store_block(&part[0][0][0], TB, nt, r0, nr, R, bias, y, act);
    }
}
#endif

#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_ZMM_ROWS 1
// 16-float rows (AVX-512): the same rows with half the instructions per slot. Where a 512-bit FMA issues
// as fast as a 256-bit one (Intel cores with two 512-bit FMA units), twice the products per cycle.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
namespace zmm {
using vec = __m512;
constexpr int VW = 16, TWO_SLICE_NV = 4;  // 32 registers: 16 sums
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_load_ps(p); }
inline void vstore(float* p, vec v) { _mm512_store_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec bcast1(const float* w) { return _mm512_set1_ps(*w); }
// bf16 w in the high half of every 32-bit lane: fp32 (w << 16)
inline vec bcast1(const uint16_t* w) { return _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)((uint32_t)*w << 16))); }
inline void bcast2(const float* w, vec& w0, vec& w1) {
    w0 = _mm512_set1_ps(w[0]);
    w1 = _mm512_set1_ps(w[1]);
}
// one 32-bit broadcast split into two (shift / mask), w[0] in the low half (little endian)
inline void bcast2(const uint16_t* w, vec& w0, vec& w1) {
    int32_t u;
    std::memcpy(&u, w, 4);
    const __m512i b = _mm512_set1_epi32(u);
    w0 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    w1 = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int32_t)0xffff0000u)));
}
#include "sliced_ell_rows.h"
}  // namespace zmm
#pragma GCC pop_options
#endif

// A plan for the bf16 dot-product rows (built once per weight, sparsa_sliced_ell_dp_plan): each row's
// slots in order, two to a pair, as {the first slot's column, the second's, the bf16 weight pair (first slot
// in the low half)}; a column's panel row is 64 bytes (32 bf16 tokens).
// With nch > 1 chunks of DP_CHUNK input columns, a row's slots are paired within each chunk (slot order
// kept), so the kernel walks one chunk of the panel for a block of rows while it stays in L1. In chunk k,
// slice s holds pairs [chunk_ptr[k (ns + 1) + s], chunk_ptr[k (ns + 1) + s + 1]), its two rows interleaved
// (pair j of row i at the start + 2 j + i) and padded to the same count: an odd last slot pairs with the
// panel's zero row (column K) and weight 0, a missing pair is zero row twice. Eight bytes a pair, two thirds
// of the slots' own bytes (a 4-byte column and a 2-byte value each): K <= 65535.
struct DpPair {
    uint16_t a, b;
    uint32_t w;
};
static_assert(sizeof(DpPair) == 8, "two 16-bit columns and a 32-bit weight pair");
constexpr int64_t DP_MAX_K = 65535;  // the zero row's column K fits 16 bits

constexpr int64_t DP_CHUNK = 512;  // 32 KiB of the panel

// Chunks pay when the whole panel falls out of L1 often enough to outweigh the per-chunk reload of each
// row's sums: wide layers, or dense enough ones (figures in docs/benchmarks.md).
int64_t dp_chunks(const int64_t* sptr, int64_t ns, int64_t K) {
    const double density = ns > 0 && K > 0 ? (double)sptr[ns] / (2.0 * (double)ns * (double)K) : 0.0;
    const bool chunk = K >= 2048 || (K > DP_CHUNK && density >= 0.4);
    return chunk ? (K + DP_CHUNK - 1) / DP_CHUNK : 1;
}

// fills chunk_ptr [nch (ns + 1)]; pairs null: only chunk_ptr (to size the pairs)
void dp_plan(const int64_t* __restrict sptr, const int32_t* __restrict cols, const uint16_t* __restrict vals,
             int64_t ns, int64_t K, int64_t nch, int64_t* __restrict chunk_ptr, DpPair* __restrict pairs) {
    const uint16_t zero_row = (uint16_t)K;
    auto chunk_of = [&](int32_t c) { return std::min<int64_t>(nch - 1, (int64_t)c / DP_CHUNK); };
    std::vector<int64_t> sel[2];  // a row's slots (entry indices) in the current chunk
    int64_t n = 0;
    for (int64_t k = 0; k < nch; ++k) {
        for (int64_t s = 0; s < ns; ++s) {
            chunk_ptr[k * (ns + 1) + s] = n;
            const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
            for (int i = 0; i < 2; ++i) {
                sel[i].clear();
                for (int64_t j = 0; j < L; ++j)
                    if (nch == 1 || chunk_of(cols[p0 + 2 * j + i]) == k) sel[i].push_back(p0 + 2 * j + i);
            }
            const int64_t np = (int64_t)(std::max(sel[0].size(), sel[1].size()) + 1) / 2;
            if (pairs)
                for (int64_t j = 0; j < np; ++j)
                    for (int i = 0; i < 2; ++i) {
                        const int64_t m = (int64_t)sel[i].size();
                        DpPair& q = pairs[n + 2 * j + i];
                        q.a = 2 * j < m ? (uint16_t)cols[sel[i][2 * j]] : zero_row;
                        q.b = 2 * j + 1 < m ? (uint16_t)cols[sel[i][2 * j + 1]] : zero_row;
                        q.w = (2 * j < m ? (uint32_t)vals[sel[i][2 * j]] : 0u) |
                              (2 * j + 1 < m ? (uint32_t)vals[sel[i][2 * j + 1]] << 16 : 0u);
                    }
            n += 2 * np;
        }
        chunk_ptr[k * (ns + 1) + ns] = n;
    }
}

#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_DPBF16_PATH 1
// bf16 dot-product rows (CPUs with AVX512-BF16, bf16 X, values and Y, two tokens or more): a panel of 32
// tokens stays in bf16, column-major, xt[c][32], half the bytes of the fp32 panel the AVX2 path reads per
// weight. A row takes its plan's pairs: the word unpacks of the two panel rows give the bf16 pairs
// (x[t][c0], x[t][c1]) of 16 tokens each, and one VDPBF16PS per 16 tokens multiplies them with the
// broadcast weight pair. Tokens are stored in the order that makes the unpacks come out as tokens 0-15 and
// 16-31 (see pack). Rows sum their slots in pairs, so rounding differs slightly from the AVX2 path.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx2,fma")
namespace dp {

using sparsa_dp::TB;
using sparsa_dp::pack;

// lo (tokens 0-15), hi (16-31) += one plan pair (xt: the panel's bytes)
inline void pair_step(const char* __restrict xt, const DpPair& p, __m512& lo, __m512& hi) {
    const __m512i a = _mm512_loadu_si512(xt + ((size_t)p.a << 6)), b = _mm512_loadu_si512(xt + ((size_t)p.b << 6));
    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)p.w);
    lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(a, b), w);
    hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(a, b), w);
}

// Slices [s0, s1) of one panel of nt tokens, from the plan. A row's even pairs and odd pairs (within a
// chunk) go to two sums, added at the end: a VDPBF16PS waits for the one before it on its accumulator, and
// two rows times two sums times two token halves keep eight in flight. With chunks, blocks of DP_SBLOCK
// slices walk the chunks in turn, their sums kept between chunks in a small L1-resident buffer.
constexpr int DP_SBLOCK = 16;

void panel_rows(const uint16_t* __restrict xt16, int nt, const int64_t* __restrict chunk_ptr, int64_t nch,
                const DpPair* __restrict pairs, int64_t ns, int64_t s0, int64_t s1, int64_t R,
                const float* __restrict bias, uint16_t* __restrict y, bool act) {
    const char* xt = reinterpret_cast<const char*>(xt16);
    alignas(64) float part[SBLOCK][2][TB];
    alignas(64) float sums[DP_SBLOCK][8][16];  // [slice][row 0 even lo, hi, row 1 even lo, hi, then odd]
    for (int64_t sb = s0; sb < s1; sb += SBLOCK) {
        const int64_t se = std::min(s1, sb + SBLOCK);
        for (int64_t cb = sb; cb < se; cb += DP_SBLOCK) {
            const int64_t ce = std::min(se, cb + DP_SBLOCK);
            for (int64_t k = 0; k < nch; ++k) {
                const int64_t* cp = chunk_ptr + k * (ns + 1);
                for (int64_t s = cb; s < ce; ++s) {
                    const DpPair* q = pairs + cp[s];
                    const int64_t n = (cp[s + 1] - cp[s]) / 2;
                    float(*S)[16] = sums[s - cb];
                    __m512 e0l, e0h, e1l, e1h, o0l, o0h, o1l, o1h;  // even / odd pairs, rows 0 / 1, token halves
                    if (k == 0) {
                        e0l = e0h = e1l = e1h = o0l = o0h = o1l = o1h = _mm512_setzero_ps();
                    } else {
                        e0l = _mm512_load_ps(S[0]), e0h = _mm512_load_ps(S[1]);
                        e1l = _mm512_load_ps(S[2]), e1h = _mm512_load_ps(S[3]);
                        o0l = _mm512_load_ps(S[4]), o0h = _mm512_load_ps(S[5]);
                        o1l = _mm512_load_ps(S[6]), o1h = _mm512_load_ps(S[7]);
                    }
                    int64_t j = 0;
                    for (; j + 2 <= n; j += 2, q += 4) {
                        pair_step(xt, q[0], e0l, e0h);
                        pair_step(xt, q[1], e1l, e1h);
                        pair_step(xt, q[2], o0l, o0h);
                        pair_step(xt, q[3], o1l, o1h);
                    }
                    if (j < n) {
                        pair_step(xt, q[0], e0l, e0h);
                        pair_step(xt, q[1], e1l, e1h);
                    }
                    if (k + 1 < nch) {
                        _mm512_store_ps(S[0], e0l), _mm512_store_ps(S[1], e0h);
                        _mm512_store_ps(S[2], e1l), _mm512_store_ps(S[3], e1h);
                        _mm512_store_ps(S[4], o0l), _mm512_store_ps(S[5], o0h);
                        _mm512_store_ps(S[6], o1l), _mm512_store_ps(S[7], o1h);
                    } else {
                        float* r0 = part[s - sb][0];
                        float* r1 = part[s - sb][1];
                        _mm512_store_ps(r0, _mm512_add_ps(e0l, o0l));
                        _mm512_store_ps(r0 + 16, _mm512_add_ps(e0h, o0h));
                        _mm512_store_ps(r1, _mm512_add_ps(e1l, o1l));
                        _mm512_store_ps(r1 + 16, _mm512_add_ps(e1h, o1h));
                    }
                }
            }
        }
        const int64_t r0 = 2 * sb, nr = std::min<int64_t>(R, 2 * se) - r0;
        store_block(&part[0][0][0], TB, nt, r0, nr, R, bias, y, act);
    }
}

}  // namespace dp
#pragma GCC pop_options
#endif

// the FMA rows take 16-float vectors: AVX-512 on this CPU and SPARSA_ISA >= avx512
bool use_zmm_rows() {
#ifdef SPARSA_HAVE_ZMM_ROWS
    return sparsa_cpu_avx512_enabled();
#else
    return false;
#endif
}

// the dot-product rows can run: AVX512-BF16 on this CPU and SPARSA_ISA >= avx512
bool use_dpbf16() {
#ifdef SPARSA_HAVE_DPBF16_PATH
    return sparsa_cpu_dpbf16_enabled();
#else
    return false;
#endif
}

// One token: the panel path would spend a 32-byte load of mostly idle lanes on every kept weight. Instead
// each weight multiplies its scalar X value; each row sums its even and odd slots in two chains (latency),
// then adds them. Not auto-vectorised: gcc would turn the indexed loads into gathers, which are slower
// than scalar loads on AMD Zen.
template <typename XT, typename WT, typename YT>
__attribute__((optimize("no-tree-vectorize"))) void one_token(const XT* __restrict x, const int64_t* __restrict sptr,
                                                               const int32_t* __restrict cols,
                                                               const WT* __restrict vals, int64_t s0, int64_t s1,
                                                               int64_t R, const float* __restrict bias,
                                                               YT* __restrict y, bool act) {
    alignas(64) float out[2 * SBLOCK];
    for (int64_t sb = s0; sb < s1; sb += SBLOCK) {
        const int64_t se = std::min(s1, sb + SBLOCK);
        for (int64_t s = sb; s < se; ++s) {
            const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
            const int32_t* c = cols + p0;
            const WT* w = vals + p0;
            float e0 = 0.f, e1 = 0.f, o0 = 0.f, o1 = 0.f;
            int64_t j = 0;
            for (; j + 2 <= L; j += 2) {
                const int32_t* cj = c + 2 * j;
                const WT* wj = w + 2 * j;
                e0 += to_f32(wj[0]) * to_f32(x[cj[0]]);
                o0 += to_f32(wj[1]) * to_f32(x[cj[1]]);
                e1 += to_f32(wj[2]) * to_f32(x[cj[2]]);
                o1 += to_f32(wj[3]) * to_f32(x[cj[3]]);
            }
            if (j < L) {
                e0 += to_f32(w[2 * j]) * to_f32(x[c[2 * j]]);
                o0 += to_f32(w[2 * j + 1]) * to_f32(x[c[2 * j + 1]]);
            }
            out[2 * (s - sb)] = e0 + e1;
            out[2 * (s - sb) + 1] = o0 + o1;
        }
        const int64_t r0 = 2 * sb, nr = std::min<int64_t>(R, 2 * se) - r0;
        if (bias)
            for (int64_t r = 0; r < nr; ++r) out[r] += bias[r0 + r];
        if (act) sparsa_gelu_inplace(out, nr);
        for (int64_t r = 0; r < nr; ++r) store_y(y + r0 + r, out[r]);
    }
}

template <typename XT, typename WT, typename YT>
void run_one_token(const XT* x, const int64_t* slice_ptr, const int32_t* cols, const WT* vals, int64_t R,
                   const float* bias, YT* y, int nthreads, bool act) {
    const int64_t ns = (R + 1) / 2, nblk = (ns + SBLOCK - 1) / SBLOCK;
    // whole blocks per thread, and fewer threads when there are too few weights to pay for waking them
    const int64_t by_work = std::max<int64_t>(1, slice_ptr[ns] / (1 << 15));
    const int nth = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)nthreads, nblk, by_work}));
    if (nth == 1) {
        one_token(x, slice_ptr, cols, vals, 0, ns, R, bias, y, act);
        return;
    }
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int i = 0; i < nth; ++i) {
        const int64_t s0 = nblk * i / nth * SBLOCK, s1 = std::min(ns, nblk * (i + 1) / nth * SBLOCK);
        if (s0 < s1) one_token(x, slice_ptr, cols, vals, s0, s1, R, bias, y, act);
    }
}

// With fewer panels than 4 per thread: split the panels between the threads (each reads every weight)
// rather than the slices (each reads every panel, half of them transposed by another core, once per block
// of slices), when the weight bytes a thread reads beyond its share are at most 4x all panels' bytes.
inline bool split_panels(int64_t npan, int tb, int nthreads, int64_t K, int64_t weight_bytes) {
    if (npan < nthreads) return false;
    const int64_t extra = weight_bytes - weight_bytes / nthreads, panels = npan * K * tb * (int64_t)sizeof(float);
    return extra <= 4 * panels;
}

template <typename WT, typename YT>
using PanelFn = void (*)(const float*, int, const int64_t*, const int32_t*, const WT*, const int32_t*, int64_t,
                         int64_t, int64_t, int64_t, const float*, YT*, bool);

// the bf16 dot-product rows' plan for one weight (see DpPair); pairs null: none given
struct DpPlan {
    const int64_t* chunk_ptr = nullptr;
    const DpPair* pairs = nullptr;
    int64_t nch = 1;
};

template <typename XT, typename WT, typename YT>
void run(const XT* x, int64_t T, int64_t K, const int64_t* slice_ptr, const int32_t* cols, const WT* vals,
         const int32_t* bounds, int64_t nch, int64_t R, const float* bias, YT* y, int nthreads, bool act,
         const DpPlan& plan = DpPlan()) {
    if (T == 1) return run_one_token(x, slice_ptr, cols, vals, R, bias, y, nthreads, act);
    const int64_t ns = (R + 1) / 2;
    if (!bounds || nch < 2) nch = 1;
#ifdef __AVX2__
    static const PanelFn<WT, YT> fns[5] = {nullptr, &ymm::panel_rows<1, WT, YT>, &ymm::panel_rows<2, WT, YT>,
                                           &ymm::panel_rows<3, WT, YT>, &ymm::panel_rows<4, WT, YT>};
#else
    static const PanelFn<WT, YT> fns[5] = {nullptr, &panel_rows<8, WT, YT>, &panel_rows<16, WT, YT>,
                                           &panel_rows<24, WT, YT>, &panel_rows<32, WT, YT>};
#endif
    // the dot-product rows read a bf16 panel of 32 tokens (in their own order; see dp::pack)
    bool dp_rows = false;
#ifdef SPARSA_HAVE_DPBF16_PATH
    constexpr bool all_bf16 = std::is_same<XT, uint16_t>::value && std::is_same<WT, uint16_t>::value &&
                              std::is_same<YT, uint16_t>::value;
    if constexpr (all_bf16) dp_rows = plan.pairs && use_dpbf16();
#endif
    // otherwise the FMA rows: 16-float vectors where AVX-512 is enabled (panels of 16 to 64 lanes)
    const bool zmm_rows = !dp_rows && use_zmm_rows();
    const int64_t slots_per_row = ns > 0 ? slice_ptr[ns] / (2 * ns) : 0;
    const int tb = zmm_rows && slots_per_row >= ZMM64_MIN_SLOTS ? TBMAX_ZMM : TBMAX;  // tokens per panel
    const int64_t npan = (T + tb - 1) / tb;
    auto lanes = [&](int nt) { return zmm_rows ? 16 * ((nt + 15) / 16) : 8 * ((nt + 7) / 8); };

    auto panel_tokens = [&](int64_t p) { return (int)std::min<int64_t>(tb, T - p * tb); };
    // Panels in per-thread buffers kept between calls (the transposes write every element they read, so no
    // zeroed allocation per call), 64-byte aligned: a 32-byte load that straddles two cache lines costs two.
    // ID 0 holds every panel of a call (the calling thread's), ID 1 a thread's own panels.
    auto own = [](size_t n) { return sparsa_thread_scratch<float, 1>(n); };
    // slices [s0, s1) of panel p, whose transposed tokens are in xt
    auto rows = [&](int64_t p, const float* xt, int64_t s0, int64_t s1) {
        const int nt = panel_tokens(p), nv = (nt + 7) / 8;
        if (s0 >= s1) return;
#ifdef SPARSA_HAVE_DPBF16_PATH
        if constexpr (all_bf16) {
            if (dp_rows) {
                dp::panel_rows(reinterpret_cast<const uint16_t*>(xt), nt, plan.chunk_ptr, plan.nch, plan.pairs, ns, s0,
                               s1, R, bias, y + p * tb * R, act);
                return;
            }
        }
#endif
#ifdef SPARSA_HAVE_ZMM_ROWS
        if (zmm_rows) {
            static const PanelFn<WT, YT> zfns[5] = {nullptr, &zmm::panel_rows<1, WT, YT>, &zmm::panel_rows<2, WT, YT>,
                                                    &zmm::panel_rows<3, WT, YT>, &zmm::panel_rows<4, WT, YT>};
            zfns[(nt + 15) / 16](xt, nt, slice_ptr, cols, vals, bounds, nch, s0, s1, R, bias, y + p * tb * R, act);
            return;
        }
#endif
        fns[nv](xt, nt, slice_ptr, cols, vals, bounds, nch, s0, s1, R, bias, y + p * tb * R, act);
    };
    auto transpose = [&](int64_t p, float* xt) {
        const int nt = panel_tokens(p);
#ifdef SPARSA_HAVE_DPBF16_PATH
        if constexpr (all_bf16) {
            if (dp_rows) {  // the float buffer holds the (smaller) bf16 panel
                // K + 1 rows (the zero row last) of 32 bf16 fit in the K rows of 32 floats
                static_assert(dp::TB == TBMAX, "the dot-product rows' panels are TBMAX tokens");
                dp::pack(reinterpret_cast<const uint16_t*>(x + p * tb * K), K, nt, reinterpret_cast<uint16_t*>(xt));
                return;
            }
        }
#endif
        transpose_panel(x + p * tb * K, K, nt, lanes(nt), xt);
    };
    if (nthreads <= 1 || (npan == 1 && ns < 2)) {
        float* xt = own((size_t)K * tb);
        for (int64_t p = 0; p < npan; ++p) {
            transpose(p, xt);
            rows(p, xt, 0, ns);
        }
    } else if (npan >= 4 * nthreads) {  // many panels: one task per panel, each thread transposes its own
#pragma omp parallel num_threads(nthreads)
        {
            float* xt = own((size_t)K * tb);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < npan; ++p) {
                transpose(p, xt);
                rows(p, xt, 0, ns);
            }
        }
    } else if (split_panels(npan, tb, nthreads, K, slice_ptr[ns] * (int64_t)(sizeof(int32_t) + sizeof(WT)))) {
        // Few panels, few weights: each thread transposes its own panels and walks every slice over them,
        // block by block (a block's weights are reused from L2 by the thread's panels)
#pragma omp parallel num_threads(nthreads)
        {
            const int nth = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t p0 = npan * t / nth, p1 = npan * (t + 1) / nth;
            float* mine = own((size_t)std::max<int64_t>(1, p1 - p0) * K * tb);
            for (int64_t p = p0; p < p1; ++p) transpose(p, mine + (p - p0) * K * tb);
            for (int64_t sb = 0; sb < ns; sb += SBLOCK)
                for (int64_t p = p0; p < p1; ++p)
                    rows(p, mine + (p - p0) * K * tb, sb, std::min(ns, sb + SBLOCK));
        }
    } else {
        // Few panels: every panel is transposed once; each thread takes a range of slices and walks it
        // block by block, every panel per block, so a block's weights come from memory once and are
        // reused from L2 (with one task per panel, each thread would stream all the weights per panel).
        float* all = sparsa_thread_scratch<float, 0>((size_t)npan * K * tb);
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < npan; ++p) transpose(p, all + p * K * tb);
            const int nth = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t r0 = ns * t / nth, r1 = ns * (t + 1) / nth;
            for (int64_t sb = r0; sb < r1; sb += SBLOCK)
                for (int64_t p = 0; p < npan; ++p) rows(p, all + p * K * tb, sb, std::min(r1, sb + SBLOCK));
        }
    }
}

}  // namespace

extern "C" {

int sparsa_sliced_ell_version() { return 11; }

// 1 when bf16 calls with two tokens or more can run the AVX512-BF16 dot-product rows on this CPU (they do
// when given a plan; sparsa.kernels.sliced_ell.bf16_rows chooses)
int sparsa_sliced_ell_has_dpbf16() { return use_dpbf16() ? 1 : 0; }


// The number of K chunks the kernel walks for this weight (1: none, and no bounds are needed).
int64_t sparsa_sliced_ell_n_chunks(int64_t K, const int64_t* slice_ptr, int64_t ns) {
    return n_chunks(K, ns > 0 ? slice_ptr[ns] : 0, ns);
}

// bounds: int32 [ns, nch - 1, 2], filled for the linear calls below (nch > 1 from sparsa_sliced_ell_n_chunks).
int sparsa_sliced_ell_chunk_bounds(const int64_t* slice_ptr, const int32_t* cols, int64_t ns, int64_t nch,
                                   int32_t* bounds) {
    if (nch > 1) chunk_bounds(slice_ptr, cols, ns, nch, bounds);
    return 0;
}

// The number of column chunks of the bf16 dot-product plan of this weight (1: none).
int64_t sparsa_sliced_ell_dp_chunks(const int64_t* slice_ptr, int64_t ns, int64_t K) {
    return dp_chunks(slice_ptr, ns, K);
}

// The bf16 dot-product plan of a weight (see DpPair): chunk_ptr int64 [nch (ns + 1)]; pairs 8 bytes each
// [chunk_ptr[last]], or null to fill chunk_ptr only (to size pairs). vals: bf16 bits. K <= 65535; nch >= 1.
int sparsa_sliced_ell_dp_plan(const int64_t* slice_ptr, const int32_t* cols, const uint16_t* vals, int64_t ns,
                              int64_t K, int64_t nch, int64_t* chunk_ptr, void* pairs) {
    if (K > DP_MAX_K || nch < 1) return -1;
    dp_plan(slice_ptr, cols, vals, ns, K, nch, chunk_ptr, static_cast<DpPair*>(pairs));
    return 0;
}

// x: [T, K]; slice_ptr: [ceil(R/2) + 1]; cols, vals: [slice_ptr[last]]; bounds: null (no chunks) or
// [ceil(R/2), nch - 1, 2] from sparsa_sliced_ell_chunk_bounds (any values are safe: they are clamped, and only
// the speed depends on them); bias: [R] or null; y: [T, R]; act: 0 none, 1 GELU (erf form) after the bias.
int sparsa_sliced_ell_linear_f32(const float* x, int64_t T, int64_t K, const int64_t* slice_ptr, const int32_t* cols,
                                 const float* vals, const int32_t* bounds, int64_t nch, int64_t R, const float* bias,
                                 float* y, int nthreads, int act) {
    run(x, T, K, slice_ptr, cols, vals, bounds, nch, R, bias, y, nthreads, act == 1);
    return 0;
}

// The same with bf16 (raw uint16 bits) x, vals and y; fp32 accumulation, y rounded to bf16 once (nearest
// even). bias: null, fp32 (bias_bf16 = 0) or bf16 (bias_bf16 = 1), added in fp32 before the rounding.
// dp_chunk_ptr, dp_pairs, dp_nch: the weight's dot-product plan (sparsa_sliced_ell_dp_plan), which the
// AVX512-BF16 rows read instead of cols / vals; dp_pairs null: the widening rows run.
int sparsa_sliced_ell_linear_bf16(const uint16_t* x, int64_t T, int64_t K, const int64_t* slice_ptr,
                                  const int32_t* cols, const uint16_t* vals, const int32_t* bounds, int64_t nch,
                                  int64_t R, const void* bias, int bias_bf16, uint16_t* y, int nthreads, int act,
                                  const int64_t* dp_chunk_ptr, const void* dp_pairs, int64_t dp_nch) {
    std::vector<float> b32;
    const float* b = sparsa_bias_f32(bias, bias_bf16, R, b32);
    DpPlan plan;
    plan.chunk_ptr = dp_chunk_ptr;
    plan.pairs = static_cast<const DpPair*>(dp_pairs);
    plan.nch = dp_nch;
    run(x, T, K, slice_ptr, cols, vals, bounds, nch, R, b, y, nthreads, act == 1, plan);
    return 0;
}

}  // extern "C"
