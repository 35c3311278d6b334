// Kernels for the grouped N:M layout (sparsa/layouts/grouped_nm.py), forward and backward.
//
// Both products are written as one generic "grouped ELL on token panels" operation:
//
//   out[row(g, i)][t] += sum_e vals[g][e][i] * in[idx[g][e]][t]      (g < G, e < L, i < n)
//
// A *group* g is a list of L entries (input row idx, n values) feeding n output rows. For the
// forward pass, g = (row block b, pattern p): its n rows are b*m + pattern[p], its entries are the
// C*g columns that use p (ordered by chunk). Reordering the layout pattern-major means only the n
// rows of one pattern need accumulators, whatever m is. For grad_x = grad_y W, g = input column k
// (n = 1), its entries the B*n (row, value) pairs of W's column k, ordered by row block.
//
// Tokens are vectorised: a panel of X is transposed to feature-major (`panel[k][t]`, S floats a
// row) so one ymm holds 8 tokens of one input row; a group keeps NR x V accumulators in registers
// (NR output rows x 8V tokens), loads the V token vectors of each entry once and FMAs them into the
// NR rows with broadcast weights. With n = 1 every x vector feeds one FMA per row block, so the
// forward and grad_x plans are *interleaved*: a group holds Q rows (Q patterns of a block, or Q
// columns of W), entry e feeding row e % Q only, which keeps Q x V accumulators live across Q times
// more entries. Entries are ordered by input row and cut into *units* (a chunk of the forward, a row
// block of grad_x); all groups run over one tile of units before the next, so the panel rows of a
// tile (about L1-sized) are reused by every row block while in cache.
// Block-pair plans (n = 1 with AVX-512): the interleaved pieces load one x vector per FMA, which makes
// them load-bound. Pairing row blocks 2j and 2j+1, a group is (pattern p in block 2j, pattern q in block
// 2j+1) and its entries the columns with exactly that pair, each carrying its two values: every x vector
// loaded then feeds two rows (piece512<2, V>, 2 x V/2 zmm accumulators, up to 96+ tokens a panel). The
// m*m groups of a pair have varying entry counts, so these plans carry per-(group, unit) offsets.
// OpenMP over token panels (many tokens) or over blocks of groups that own disjoint output rows.
//
// grad_W on the pattern (a sampled dense-dense product): gv[g][e][i] = sum_t gy[t][row(g,i)] *
// x[t][idx[g][e]], with X and grad_Y transposed to feature-major once; OpenMP over groups.
//
// bfloat16 spmm (sparsa_gnm_spmm_bf16): bf16 X, plan values and Y, the fp32 machinery otherwise. X is widened
// to fp32 while packed into the panel, each bf16 value is widened as it is broadcast (the plan's value bytes
// halve), the panel accumulates in fp32 and the output (+ bias, fp32 or bf16) is rounded to bf16 once
// (nearest even) as it is unpacked. bf16 always runs the AVX2 pieces, also on AVX-512 CPUs: the AVX-512
// pieces are fp32-only (an untested bf16 variant was left out; Python builds no block-pair plans for bf16).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <type_traits>
#include <omp.h>
#include <immintrin.h>
#include "bf16.h"
#include "cpu_isa.h"
#include "transpose8.h"

#ifndef __AVX2__
#error "grouped_nm_linear.cpp needs AVX2/FMA (-mavx2 -mfma)"
#endif

namespace {

constexpr int MAXNR = 4;
constexpr int64_t SPMM_TILE_BYTES = 24 << 10;   // panel rows a tile reads: L1
constexpr int64_t SDDMM_TILE_BYTES = 24 << 10;
constexpr int64_t MIN_PIECE_ENTRIES = 64;       // default tiles of interleaved plans: entries per piece call

// register blocking: V token vectors per output row, by the number of rows sharing an entry
constexpr int vmax_for(int nr) { return nr <= 1 ? 12 : nr == 2 ? 4 : nr == 3 ? 3 : 2; }
// independent partial sums, so that at least 8 FMA chains are in flight
constexpr int splits_for(int nr, int v) { return nr * v >= 8 ? 1 : (8 + nr * v - 1) / (nr * v); }

struct Buf {  // 64-byte aligned float buffer
    float* p = nullptr;
    size_t n = 0;
    void ensure(size_t want) {
        if (want <= n) return;
        std::free(p);
        n = want;
        p = static_cast<float*>(std::aligned_alloc(64, ((want * sizeof(float) + 63) / 64) * 64));
    }
    ~Buf() { std::free(p); }
};

// element access: float as is, bf16 (raw uint16_t bits) widened to / rounded from fp32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return sparsa_load8_bf16(p); }
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return sparsa_bf16_to_f32(v); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), sparsa_cvt8_f32_bf16(v)); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = sparsa_f32_to_bf16(v); }
inline __m256 bcast(const float* w) { return _mm256_broadcast_ss(w); }
inline __m256 bcast(const uint16_t* w) { return _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)((uint32_t)*w << 16))); }
// wb[i] = broadcast w[i] for i < NR; bf16 values two at a time: one 32-bit broadcast, split by shift / mask
template <int NR>
inline void bcast_n(const float* w, __m256* wb) {
    for (int i = 0; i < NR; ++i) wb[i] = _mm256_broadcast_ss(w + i);
}
template <int NR>
inline void bcast_n(const uint16_t* w, __m256* wb) {
    int i = 0;
    for (; i + 2 <= NR; i += 2) {
        int32_t u;
        std::memcpy(&u, w + i, 4);  // w[i] in the low half, w[i+1] in the high half (little endian)
        const __m256i b = _mm256_set1_epi32(u);
        wb[i] = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
        wb[i + 1] = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int32_t)0xffff0000u)));
    }
    if (i < NR) wb[i] = bcast(w + i);
}


// pack_in with column blocks outside, token blocks inside: the 8 panel rows of a column block
// are written whole while in L1 (token blocks outside wrote every panel line in two halves, far apart).
template <typename XT>
void pack_in_cols(const XT* src, int64_t ld, int nt, int64_t ncols, int64_t nrows, float* dst, int64_t S, int width) {
    const int tfull = std::min(width, nt / 8 * 8);
    int64_t c = 0;
    for (; c + 8 <= ncols; c += 8)
        for (int t0 = 0; t0 < tfull; t0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i) r[i] = load8(src + (t0 + i) * ld + c);
            transpose8(r);
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (c + j) * S + t0, r[j]);
        }
    for (; c < ncols; ++c)
        for (int t = 0; t < tfull; ++t) dst[c * S + t] = to_f32(src[t * ld + c]);
    for (c = ncols; c < nrows; ++c)
        for (int t0 = 0; t0 < tfull; t0 += 8) _mm256_storeu_ps(dst + c * S + t0, _mm256_setzero_ps());
    for (int t0 = tfull; t0 < width; t0 += 8) {  // the partial (or empty) token blocks
        const int tn = std::max(0, std::min(8, nt - t0));
        for (c = 0; c < ncols; ++c) {
            float* d = dst + c * S + t0;
            int i = 0;
            for (; i < tn; ++i) d[i] = to_f32(src[(t0 + i) * ld + c]);
            for (; i < 8; ++i) d[i] = 0.f;
        }
        for (; c < nrows; ++c) _mm256_storeu_ps(dst + c * S + t0, _mm256_setzero_ps());
    }
}

// pack_in with token blocks outside (8 source rows streamed at a time: better when source rows are long)
template <typename XT>
void pack_in_tokens(const XT* src, int64_t ld, int nt, int64_t ncols, int64_t nrows, float* dst, int64_t S, int width) {
    for (int t0 = 0; t0 < width; t0 += 8) {
        const int tn = std::max(0, std::min(8, nt - t0));
        int64_t c = 0;
        if (tn == 8) {
            for (; c + 8 <= ncols; c += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; ++i) r[i] = load8(src + (t0 + i) * ld + c);
                transpose8(r);
                for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (c + j) * S + t0, r[j]);
            }
        }
        for (; c < ncols; ++c) {
            float* d = dst + c * S + t0;
            int i = 0;
            for (; i < tn; ++i) d[i] = to_f32(src[(t0 + i) * ld + c]);
            for (; i < 8; ++i) d[i] = 0.f;
        }
        for (; c < nrows; ++c) _mm256_storeu_ps(dst + c * S + t0, _mm256_setzero_ps());
    }
}

// dst[c*S + t] = src[t*ld + c] for t < nt, c < ncols; zero for nt <= t < width (width % 8 == 0) and for
// ncols <= c < nrows. Column blocks outside is faster while the panel's source rows span <= 256 KB, token
// blocks outside beyond (figures in docs/benchmarks.md).
template <typename XT>
void pack_in(const XT* src, int64_t ld, int nt, int64_t ncols, int64_t nrows, float* dst, int64_t S, int width) {
    if (ld * (int64_t)width <= (64 << 10)) pack_in_cols(src, ld, nt, ncols, nrows, dst, S, width);
    else pack_in_tokens(src, ld, nt, ncols, nrows, dst, S, width);
}

// y[t*ldy + r] = src[r*S + t] (+ bias[r]) for r0 <= r < r1, t < nt.
template <typename YT>
void unpack_out(const float* src, int64_t S, int64_t r0, int64_t r1, int nt, const float* bias, YT* y, int64_t ldy) {
    int t0 = 0;
    for (; t0 + 8 <= nt; t0 += 8) {
        int64_t r = r0;
        for (; r + 8 <= r1; r += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(src + (r + i) * S + t0);
            transpose8(v);
            const __m256 b = bias ? _mm256_loadu_ps(bias + r) : _mm256_setzero_ps();
            for (int j = 0; j < 8; ++j) store8(y + (t0 + j) * ldy + r, _mm256_add_ps(v[j], b));
        }
        for (; r < r1; ++r) {
            const float b = bias ? bias[r] : 0.f;
            for (int j = 0; j < 8; ++j) store1(y + (t0 + j) * ldy + r, src[r * S + t0 + j] + b);
        }
    }
    for (; t0 < nt; ++t0)
        for (int64_t r = r0; r < r1; ++r) store1(y + t0 * ldy + r, src[r * S + t0] + (bias ? bias[r] : 0.f));
}

// ------------------------------------------------------------------------------------ forward piece
// NR output rows x V token vectors; `cnt` entries; values of entry e at vals[e*vstride + i] (WT: float or bf16).
template <int NR, int V, typename WT>
void piece(const float* __restrict panel, int64_t S, const int32_t* __restrict idx, const WT* __restrict vals,
           int64_t vstride, int64_t cnt, float* const* outp) {
    constexpr int SP = splits_for(NR, V);
    __m256 acc[SP][NR][V];
    for (int s = 0; s < SP; ++s)
        for (int i = 0; i < NR; ++i)
            for (int v = 0; v < V; ++v) acc[s][i][v] = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + SP <= cnt; e += SP) {
#pragma GCC unroll 8
        for (int s = 0; s < SP; ++s) {
            const float* xp = panel + (int64_t)idx[e + s] * S;
            const WT* w = vals + (e + s) * vstride;
            if constexpr (NR == 1) {
                const __m256 wb = bcast(w);
#pragma GCC unroll 12
                for (int v = 0; v < V; ++v) acc[s][0][v] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(xp + 8 * v), acc[s][0][v]);
            } else {
                __m256 xv[V];
#pragma GCC unroll 12
                for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(xp + 8 * v);
                __m256 wb[NR];
                bcast_n<NR>(w, wb);
#pragma GCC unroll 4
                for (int i = 0; i < NR; ++i) {
#pragma GCC unroll 12
                    for (int v = 0; v < V; ++v) acc[s][i][v] = _mm256_fmadd_ps(wb[i], xv[v], acc[s][i][v]);
                }
            }
        }
    }
    for (; e < cnt; ++e) {
        const float* xp = panel + (int64_t)idx[e] * S;
        const WT* w = vals + e * vstride;
        for (int i = 0; i < NR; ++i) {
            const __m256 wb = bcast(w + i);
            for (int v = 0; v < V; ++v) acc[0][i][v] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(xp + 8 * v), acc[0][i][v]);
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int v = 0; v < V; ++v) {
            __m256 a = acc[0][i][v];
            for (int s = 1; s < SP; ++s) a = _mm256_add_ps(a, acc[s][i][v]);
            float* o = outp[i] + 8 * v;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), a));
        }
}

// Interleaved (one value per entry): entry e feeds output row e % Q only (n = 1 layouts, Q patterns of
// a block at once, so Q rows x V token vectors stay in registers across all of them).
template <int Q, int V, typename WT>
void ipiece(const float* __restrict panel, int64_t S, const int32_t* __restrict idx, const WT* __restrict vals,
            int64_t, int64_t cnt, float* const* outp) {
    __m256 acc[Q][V];
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q)
#pragma GCC unroll 12
        for (int v = 0; v < V; ++v) acc[q][v] = _mm256_setzero_ps();
    for (int64_t e = 0; e < cnt; e += Q) {
#pragma GCC unroll 8
        for (int q = 0; q < Q; ++q) {
            const float* xp = panel + (int64_t)idx[e + q] * S;
            const __m256 wb = bcast(vals + e + q);
#pragma GCC unroll 12
            for (int v = 0; v < V; ++v) acc[q][v] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(xp + 8 * v), acc[q][v]);
        }
    }
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q)
#pragma GCC unroll 12
        for (int v = 0; v < V; ++v) {
            float* o = outp[q] + 8 * v;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[q][v]));
        }
}

template <typename WT>
using PieceFnT = void (*)(const float*, int64_t, const int32_t*, const WT*, int64_t, int64_t, float* const*);
using PieceFn = PieceFnT<float>;

template <int NR, int V, typename WT = float>
struct PieceTable {
    static void fill(PieceFnT<WT>* tab) {
        tab[V] = &piece<NR, V, WT>;
        PieceTable<NR, V - 1, WT>::fill(tab);
    }
};
template <int NR, typename WT>
struct PieceTable<NR, 0, WT> {
    static void fill(PieceFnT<WT>*) {}
};
template <int Q, int V, typename WT = float>
struct IPieceTable {
    static void fill(PieceFnT<WT>* tab) {
        tab[V] = &ipiece<Q, V, WT>;
        IPieceTable<Q, V - 1, WT>::fill(tab);
    }
};
template <int Q, typename WT>
struct IPieceTable<Q, 0, WT> {
    static void fill(PieceFnT<WT>*) {}
};

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define GNM_AVX512 1
// AVX-512 build of ipiece, chosen at run time when the CPU has AVX-512 (SPARSA_NO_AVX512=1 forces AVX2):
// same panels (8V tokens), pairs of token vectors as one zmm: half the FMA and load instructions per entry
// (wider 96-token panels were slower).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
// V8 vectors of 8 tokens as V8/2 zmm (+ one ymm when V8 is odd)
template <int Q, int V8>
void ipiece512(const float* __restrict panel, int64_t S, const int32_t* __restrict idx, const float* __restrict vals,
               int64_t, int64_t cnt, float* const* outp) {
    constexpr int VZ = V8 / 2, VY = V8 % 2;
    __m512 acc[Q][VZ > 0 ? VZ : 1];
    __m256 accy[Q];
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) {
#pragma GCC unroll 12
        for (int v = 0; v < VZ; ++v) acc[q][v] = _mm512_setzero_ps();
        accy[q] = _mm256_setzero_ps();
    }
    for (int64_t e = 0; e < cnt; e += Q) {
#pragma GCC unroll 8
        for (int q = 0; q < Q; ++q) {
            const float* xp = panel + (int64_t)idx[e + q] * S;
            const __m512 wb = _mm512_set1_ps(vals[e + q]);
#pragma GCC unroll 12
            for (int v = 0; v < VZ; ++v) acc[q][v] = _mm512_fmadd_ps(wb, _mm512_loadu_ps(xp + 16 * v), acc[q][v]);
            if (VY) accy[q] = _mm256_fmadd_ps(_mm256_set1_ps(vals[e + q]), _mm256_loadu_ps(xp + 16 * VZ), accy[q]);
        }
    }
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) {
#pragma GCC unroll 12
        for (int v = 0; v < VZ; ++v) {
            float* o = outp[q] + 16 * v;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[q][v]));
        }
        if (VY) {
            float* o = outp[q] + 16 * VZ;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), accy[q]));
        }
    }
}
// AVX-512 build of piece (NR rows share every entry; used by the block-pair plans, NR = 2): V8 vectors of
// 8 tokens as V8/2 zmm (+ one ymm when V8 is odd); one x load feeds NR FMAs.
template <int NR, int V8>
void piece512(const float* __restrict panel, int64_t S, const int32_t* __restrict idx, const float* __restrict vals,
              int64_t vstride, int64_t cnt, float* const* outp) {
    constexpr int VZ = V8 / 2, VY = V8 % 2;
    __m512 acc[NR][VZ > 0 ? VZ : 1];
    __m256 accy[NR];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
#pragma GCC unroll 8
        for (int v = 0; v < VZ; ++v) acc[i][v] = _mm512_setzero_ps();
        accy[i] = _mm256_setzero_ps();
    }
#pragma GCC unroll 2
    for (int64_t e = 0; e < cnt; ++e) {
        const float* xp = panel + (int64_t)idx[e] * S;
        const float* w = vals + e * vstride;
        __m512 xv[VZ > 0 ? VZ : 1];
#pragma GCC unroll 8
        for (int v = 0; v < VZ; ++v) xv[v] = _mm512_loadu_ps(xp + 16 * v);
        __m256 xy = VY ? _mm256_loadu_ps(xp + 16 * VZ) : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) {
            const __m512 wb = _mm512_set1_ps(w[i]);
#pragma GCC unroll 8
            for (int v = 0; v < VZ; ++v) acc[i][v] = _mm512_fmadd_ps(wb, xv[v], acc[i][v]);
            if (VY) accy[i] = _mm256_fmadd_ps(_mm512_castps512_ps256(wb), xy, accy[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
#pragma GCC unroll 8
        for (int v = 0; v < VZ; ++v) {
            float* o = outp[i] + 16 * v;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[i][v]));
        }
        if (VY) {
            float* o = outp[i] + 16 * VZ;
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), accy[i]));
        }
    }
}
// One row of a block pair against all its partners: groups (p, 0..Q-1) of a block-pair plan in unit u share
// row a = out_rows of (p, *), so its V8/2 (+1) accumulators stay in registers across the Q groups and only
// row b's are loaded and stored per group.
template <int V8>
void pairrow512(const float* __restrict panel, int64_t S, const int32_t* __restrict idx, const float* __restrict vals,
                const int64_t* off, int64_t ostride, int Q, float* outa, float* const* outb) {
    constexpr int VZ = V8 / 2, VY = V8 % 2;
    __m512 acca[VZ > 0 ? VZ : 1];
    __m256 accay = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int v = 0; v < VZ; ++v) acca[v] = _mm512_setzero_ps();
    for (int q = 0; q < Q; ++q) {
        const int64_t o0 = off[q * ostride], o1 = off[q * ostride + 1];
        if (o1 <= o0) continue;
        float* ob = outb[q];
        __m512 accb[VZ > 0 ? VZ : 1];
        __m256 accby = VY ? _mm256_loadu_ps(ob + 16 * VZ) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int v = 0; v < VZ; ++v) accb[v] = _mm512_loadu_ps(ob + 16 * v);
#pragma GCC unroll 2
        for (int64_t e = o0; e < o1; ++e) {
            const float* xp = panel + (int64_t)idx[e] * S;
            const __m512 wa = _mm512_set1_ps(vals[2 * e]), wb = _mm512_set1_ps(vals[2 * e + 1]);
#pragma GCC unroll 8
            for (int v = 0; v < VZ; ++v) {
                const __m512 xv = _mm512_loadu_ps(xp + 16 * v);
                acca[v] = _mm512_fmadd_ps(wa, xv, acca[v]);
                accb[v] = _mm512_fmadd_ps(wb, xv, accb[v]);
            }
            if (VY) {
                const __m256 xy = _mm256_loadu_ps(xp + 16 * VZ);
                accay = _mm256_fmadd_ps(_mm512_castps512_ps256(wa), xy, accay);
                accby = _mm256_fmadd_ps(_mm512_castps512_ps256(wb), xy, accby);
            }
        }
#pragma GCC unroll 8
        for (int v = 0; v < VZ; ++v) _mm512_storeu_ps(ob + 16 * v, accb[v]);
        if (VY) _mm256_storeu_ps(ob + 16 * VZ, accby);
    }
#pragma GCC unroll 8
    for (int v = 0; v < VZ; ++v) _mm512_storeu_ps(outa + 16 * v, _mm512_add_ps(_mm512_loadu_ps(outa + 16 * v), acca[v]));
    if (VY) _mm256_storeu_ps(outa + 16 * VZ, _mm256_add_ps(_mm256_loadu_ps(outa + 16 * VZ), accay));
}
#pragma GCC pop_options
template <int Q, int V>
struct IPieceTable512 {
    static void fill(PieceFn* tab) {
        tab[V] = &ipiece512<Q, V>;
        IPieceTable512<Q, V - 1>::fill(tab);
    }
};
template <int Q>
struct IPieceTable512<Q, 0> {
    static void fill(PieceFn*) {}
};
using PairRowFn = void (*)(const float*, int64_t, const int32_t*, const float*, const int64_t*, int64_t, int, float*,
                          float* const*);
template <int V>
struct PairRowTable512 {
    static void fill(PairRowFn* tab) {
        tab[V] = &pairrow512<V>;
        PairRowTable512<V - 1>::fill(tab);
    }
};
template <>
struct PairRowTable512<0> {
    static void fill(PairRowFn*) {}
};
template <int NR, int V>
struct PieceTable512 {
    static void fill(PieceFn* tab) {
        tab[V] = &piece512<NR, V>;
        PieceTable512<NR, V - 1>::fill(tab);
    }
};
template <int NR>
struct PieceTable512<NR, 0> {
    static void fill(PieceFn*) {}
};
bool use_avx512() { return sparsa_cpu_avx512_enabled(); }
#else
bool use_avx512() { return false; }
#endif

constexpr int MAXQ = 6;
constexpr int ivmax_for(int q) { return q <= 1 ? 12 : 12 / q; }

constexpr int PAIR_VMAX512 = 12;  // block-pair plans: token vectors per panel with AVX-512 (AVX2: vmax_for(2))

// The pieces for weight values of type WT (float: the AVX-512 ones when use512; bf16: AVX2 only).
template <typename WT>
struct TablesT {
    PieceFnT<WT> f[MAXNR + 1][vmax_for(1) + 1] = {};
    PieceFnT<WT> fi[MAXQ + 1][ivmax_for(1) + 1] = {};
    PieceFnT<WT> fp[PAIR_VMAX512 + 1] = {};  // block-pair plans (2 rows share every entry)
#ifdef GNM_AVX512
    PairRowFn fr[PAIR_VMAX512 + 1] = {};  // block-pair plans, one row against its Q partners (AVX-512 only)
#endif
    int pair_vmax = vmax_for(2);
    bool avx512 = false;
    explicit TablesT(bool use512) {
        PieceTable<1, vmax_for(1), WT>::fill(f[1]);
        PieceTable<2, vmax_for(2), WT>::fill(f[2]);
        PieceTable<3, vmax_for(3), WT>::fill(f[3]);
        PieceTable<4, vmax_for(4), WT>::fill(f[4]);
        PieceTable<2, vmax_for(2), WT>::fill(fp);
#ifdef GNM_AVX512
        if constexpr (std::is_same_v<WT, float>) if (use512) {
            avx512 = true;
            PieceTable512<2, PAIR_VMAX512>::fill(fp);
            PairRowTable512<PAIR_VMAX512>::fill(fr);
            pair_vmax = PAIR_VMAX512;
            IPieceTable512<1, ivmax_for(1)>::fill(fi[1]);
            IPieceTable512<2, ivmax_for(2)>::fill(fi[2]);
            IPieceTable512<3, ivmax_for(3)>::fill(fi[3]);
            IPieceTable512<4, ivmax_for(4)>::fill(fi[4]);
            IPieceTable512<5, ivmax_for(5)>::fill(fi[5]);
            IPieceTable512<6, ivmax_for(6)>::fill(fi[6]);
            return;
        }
#else
        (void)use512;
#endif
        IPieceTable<1, ivmax_for(1), WT>::fill(fi[1]);
        IPieceTable<2, ivmax_for(2), WT>::fill(fi[2]);
        IPieceTable<3, ivmax_for(3), WT>::fill(fi[3]);
        IPieceTable<4, ivmax_for(4), WT>::fill(fi[4]);
        IPieceTable<5, ivmax_for(5), WT>::fill(fi[5]);
        IPieceTable<6, ivmax_for(6), WT>::fill(fi[6]);
    }
};
using Tables = TablesT<float>;
template <typename WT = float>
const TablesT<WT>& tables() {
    if constexpr (std::is_same_v<WT, float>) {
        static const Tables avx2(false), avx512(true);
        return use_avx512() ? avx512 : avx2;
    } else {
        static const TablesT<WT> avx2(false);  // bf16: the AVX2 pieces on every CPU
        return avx2;
    }
}

struct Problem {
    const int32_t* idx;       // [G][L]
    const void* vals;         // [G][L][n], float or bf16 (the spmm's WT)
    const int32_t* out_rows;  // [G][n]
    int64_t G, n, L;
    int64_t units, unit_entries, unit_span;
    int64_t gpb, rpb;  // groups per block, output rows per block (blocks own disjoint rows)
    int64_t in_pad, out_pad;
    bool ilv;  // interleaved: one value per entry, entry e feeds row e % n of its group
    // block-pair plans (n = 2, rows of two row blocks): entries of group g in unit u are the flat entries
    // [off[g*(units+1)+u], off[g*(units+1)+u+1]) of idx/vals (variable counts; null for the other plans)
    const int64_t* off = nullptr;
    int64_t pq = 0;  // block-pair plans: patterns per block when gpb = pq*pq and groups (p, q) are p-major, else 0
};

// out panel rows of the groups [g0, g1) += products, for V token vectors (panel row stride S)
template <typename WT>
void run_groups(const Problem& P, const float* panel, int64_t S, int V, int64_t upt, int64_t g0, int64_t g1,
                float* opanel) {
    const TablesT<WT>& tab = tables<WT>();
    const WT* vals = static_cast<const WT*>(P.vals);
    float* outp[MAXQ > MAXNR ? MAXQ : MAXNR];
    if (P.off) {  // unit by unit (a unit is sized at plan time), each group its run of entries in the unit
        const PieceFnT<WT> fn = tab.fp[V];
#ifdef GNM_AVX512
        if constexpr (std::is_same_v<WT, float>) if (tab.avx512 && P.pq > 0 && g0 % P.gpb == 0 && g1 % P.gpb == 0) {
            const int Q = (int)P.pq;
            float* outb[64];
            for (int64_t u = 0; u < P.units; ++u)
                for (int64_t g = g0; g < g1; g += Q) {  // groups (p, 0..Q-1) of one pair: row a fixed
                    for (int q = 0; q < Q; ++q) outb[q] = opanel + (int64_t)P.out_rows[2 * (g + q) + 1] * S;
                    tab.fr[V](panel, S, P.idx, vals, P.off + g * (P.units + 1) + u, P.units + 1, Q,
                              opanel + (int64_t)P.out_rows[2 * g] * S, outb);
                }
            return;
        }
#endif
        for (int64_t u = 0; u < P.units; ++u)
            for (int64_t g = g0; g < g1; ++g) {
                const int64_t o0 = P.off[g * (P.units + 1) + u], o1 = P.off[g * (P.units + 1) + u + 1];
                if (o1 <= o0) continue;
                outp[0] = opanel + (int64_t)P.out_rows[2 * g] * S;
                outp[1] = opanel + (int64_t)P.out_rows[2 * g + 1] * S;
                fn(panel, S, P.idx + o0, vals + 2 * o0, 2, o1 - o0, outp);
            }
        return;
    }
    for (int64_t u0 = 0; u0 < P.units; u0 += upt) {
        const int64_t e0 = u0 * P.unit_entries, e1 = std::min(P.units, u0 + upt) * P.unit_entries;
        for (int64_t g = g0; g < g1; ++g) {
            if (P.ilv) {
                for (int i = 0; i < P.n; ++i) outp[i] = opanel + (int64_t)P.out_rows[g * P.n + i] * S;
                tab.fi[P.n][V](panel, S, P.idx + g * P.L + e0, vals + g * P.L + e0, 1, e1 - e0, outp);
                continue;
            }
            for (int64_t i0 = 0; i0 < P.n; i0 += MAXNR) {
                const int nr = (int)std::min<int64_t>(MAXNR, P.n - i0);
                for (int i = 0; i < nr; ++i) outp[i] = opanel + (int64_t)P.out_rows[g * P.n + i0 + i] * S;
                tab.f[nr][V](panel, S, P.idx + g * P.L + e0, vals + (g * P.L + e0) * P.n + i0, P.n, e1 - e0, outp);
            }
        }
    }
}

int vmax_of(int64_t n) { return vmax_for((int)std::min<int64_t>(n, MAXNR)); }
// tokens per panel by default: enough token vectors per entry to amortise its index and weight loads,
// few enough that a tile of panel rows reused across all row blocks stays in L1
int vdefault_of(int64_t n) { return n <= 1 ? 4 : vmax_of(n); }
template <typename WT = float>
int vmax_of(const Problem& P) {
    return P.off ? tables<WT>().pair_vmax : P.ilv ? ivmax_for((int)P.n) : vmax_of(P.n);
}
constexpr int PAIR_VDEFAULT512 = 8;
// measured: patterns sharing rows (n >= 2) do best with one token vector and a larger (L2) tile
template <typename WT = float>
int vdefault_of(const Problem& P) {
    if (P.off) return std::min(vmax_of<WT>(P), PAIR_VDEFAULT512);
    return P.ilv ? (P.n <= 1 ? 4 : ivmax_for((int)P.n)) : (P.n >= 2 ? 1 : vdefault_of(P.n));
}
int64_t tile_default_of(const Problem& P) { return (!P.ilv && P.n >= 2) ? (96 << 10) : SPMM_TILE_BYTES; }

int64_t units_per_tile(const Problem& P, int64_t S, int64_t tile_bytes) {
    const int64_t per_unit = std::max<int64_t>(1, P.unit_span * S * (int64_t)sizeof(float));
    return std::max<int64_t>(1, std::min<int64_t>(P.units, tile_bytes / per_unit));
}

// XT, WT, YT: float, or uint16_t (bf16) for x, the plan's values and y
template <typename XT, typename WT, typename YT>
void spmm(const Problem& P, const XT* x, int64_t T, int64_t K, int64_t ldx, const float* bias, YT* y,
          int64_t R, int nthreads, int64_t tile_bytes, int vmax) {
    const int VM = vmax > 0 ? std::min(vmax, vmax_of<WT>(P)) : vdefault_of<WT>(P);
    const int64_t S = 8 * VM;  // panel row stride (floats) = tokens per panel
    int64_t upt = units_per_tile(P, S, tile_bytes > 0 ? tile_bytes : tile_default_of(P));
    if (tile_bytes <= 0 && P.ilv) {
        // sparse interleaved plans (1:8, 1:10) put few entries of a group in an L1 tile; each piece call then
        // spends more on its accumulator load/store than on FMAs: take at least MIN_PIECE_ENTRIES per call
        // (tiles beyond L1 but in L2)
        const int64_t want = (MIN_PIECE_ENTRIES + P.unit_entries - 1) / std::max<int64_t>(1, P.unit_entries);
        upt = std::max<int64_t>(1, std::min<int64_t>(P.units, std::max(upt, want)));
    }
    const int64_t npan = (T + S - 1) / S;
    if (nthreads <= 1 || npan >= 2 * nthreads) {
        // one task per token panel; every thread owns its panels
#pragma omp parallel num_threads(std::max(1, nthreads)) if (nthreads > 1)
        {
            Buf in, out;
            in.ensure((size_t)(P.in_pad * S));
            out.ensure((size_t)(P.out_pad * S));
#pragma omp for schedule(dynamic, 1)
            for (int64_t p = 0; p < npan; ++p) {
                const int64_t t0 = p * S;
                const int nt = (int)std::min<int64_t>(S, T - t0);
                const int V = (nt + 7) / 8;
                pack_in(x + t0 * ldx, ldx, nt, K, P.in_pad, in.p, S, 8 * V);
                for (int64_t r = 0; r < P.out_pad; ++r) std::memset(out.p + r * S, 0, sizeof(float) * 8 * V);
                run_groups<WT>(P, in.p, S, V, upt, 0, P.G, out.p);
                unpack_out(out.p, S, 0, R, nt, bias, y + t0 * R, R);
            }
        }
        return;
    }
    // few tokens: parallel over blocks of groups, one panel at a time
    Buf in, out;
    in.ensure((size_t)(P.in_pad * S));
    out.ensure((size_t)(P.out_pad * S));
    const int64_t nblk = P.G / P.gpb;
    const int64_t ntask = std::min<int64_t>(nblk, 4 * nthreads);
    for (int64_t p = 0; p < npan; ++p) {
        const int64_t t0 = p * S;
        const int nt = (int)std::min<int64_t>(S, T - t0);
        const int V = (nt + 7) / 8;
        pack_in(x + t0 * ldx, ldx, nt, K, P.in_pad, in.p, S, 8 * V);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; ++task) {
            const int64_t b0 = nblk * task / ntask, b1 = nblk * (task + 1) / ntask;
            const int64_t r0 = b0 * P.rpb, r1 = b1 * P.rpb;
            for (int64_t r = r0; r < r1; ++r) std::memset(out.p + r * S, 0, sizeof(float) * 8 * V);
            run_groups<WT>(P, in.p, S, V, upt, b0 * P.gpb, b1 * P.gpb, out.p);
            unpack_out(out.p, S, r0, std::min(r1, R), nt, bias, y + t0 * R, R);
        }
    }
}

// ------------------------------------------------------------------------------------------- SDDMM
constexpr int SD_V = 8;  // token vectors per panel (64 tokens)

inline __m256 hsum8(const __m256 a[8]) {  // lane j = sum of a[j]
    __m256 h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 h01 = _mm256_hadd_ps(h0, h1), h23 = _mm256_hadd_ps(h2, h3);
    // h01 = [a0L a1L a2L a3L | a0H a1H a2H a3H], h23 likewise for a4..a7
    __m256 lo = _mm256_permute2f128_ps(h01, h23, 0x20), hi = _mm256_permute2f128_ps(h01, h23, 0x31);
    return _mm256_add_ps(lo, hi);
}

// gv[e*vstride] += sum over V token vectors of gyrow . x[idx[e]] for e < cnt
template <int V>
void sddmm_row(const float* __restrict xT, int64_t sx, const float* __restrict grow, const int32_t* __restrict idx,
               float* __restrict gv, int64_t vstride, int64_t cnt) {
    __m256 g[V];
    for (int v = 0; v < V; ++v) g[v] = _mm256_loadu_ps(grow + 8 * v);
    int64_t e = 0;
    for (; e + 8 <= cnt; e += 8) {
        __m256 acc[8];
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
            const float* xp = xT + (int64_t)idx[e + q] * sx;
            __m256 a = _mm256_mul_ps(g[0], _mm256_loadu_ps(xp));
#pragma GCC unroll 8
            for (int v = 1; v < V; ++v) a = _mm256_fmadd_ps(g[v], _mm256_loadu_ps(xp + 8 * v), a);
            acc[q] = a;
        }
        const __m256 s = hsum8(acc);
        if (vstride == 1) {
            _mm256_storeu_ps(gv + e, _mm256_add_ps(_mm256_loadu_ps(gv + e), s));
        } else {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, s);
            for (int q = 0; q < 8; ++q) gv[(e + q) * vstride] += tmp[q];
        }
    }
    for (; e < cnt; ++e) {
        const float* xp = xT + (int64_t)idx[e] * sx;
        __m256 a = _mm256_setzero_ps();
        for (int v = 0; v < V; ++v) a = _mm256_fmadd_ps(g[v], _mm256_loadu_ps(xp + 8 * v), a);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_hadd_ps(h, h);
        h = _mm_hadd_ps(h, h);
        gv[e * vstride] += _mm_cvtss_f32(h);
    }
}

using SddFn = void (*)(const float*, int64_t, const float*, const int32_t*, float*, int64_t, int64_t);

template <int V>
struct SddTable {
    static void fill(SddFn* tab) {
        tab[V] = &sddmm_row<V>;
        SddTable<V - 1>::fill(tab);
    }
};
template <>
struct SddTable<0> {
    static void fill(SddFn*) {}
};

void sddmm(const Problem& P, const float* x, int64_t ldx, const float* gy, int64_t ldg, int64_t T, int64_t K,
           int64_t R, float* gv, int nthreads, int64_t tile_bytes) {
    SddFn tab[SD_V + 1] = {};
    SddTable<SD_V>::fill(tab);
    const int64_t Tp = (T + 7) / 8 * 8;
    Buf xb, gb;
    xb.ensure((size_t)(P.in_pad * Tp));
    gb.ensure((size_t)(P.out_pad * Tp));
    const int64_t TB = 64;
    const int64_t nb = (Tp + TB - 1) / TB;
    std::memset(gv, 0, sizeof(float) * P.G * P.L * P.n);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t t0 = b * TB;
        const int w = (int)std::min<int64_t>(TB, Tp - t0);
        const int nt = (int)std::max<int64_t>(0, std::min<int64_t>(w, T - t0));
        pack_in(x + t0 * ldx, ldx, nt, K, P.in_pad, xb.p + t0, Tp, w);
        pack_in(gy + t0 * ldg, ldg, nt, R, P.out_pad, gb.p + t0, Tp, w);
    }
    const int64_t S = 8 * SD_V;
    const int64_t upt = units_per_tile(P, S, tile_bytes);
    const int64_t ntask = std::min<int64_t>(P.G, 8 * std::max(1, nthreads));
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (nthreads > 1)
    for (int64_t task = 0; task < ntask; ++task) {
        const int64_t g0 = P.G * task / ntask, g1 = P.G * (task + 1) / ntask;
        for (int64_t t0 = 0; t0 < Tp; t0 += S) {
            const int V = (int)(std::min<int64_t>(S, Tp - t0) / 8);
            for (int64_t u0 = 0; u0 < P.units; u0 += upt) {
                const int64_t e0 = u0 * P.unit_entries, e1 = std::min(P.units, u0 + upt) * P.unit_entries;
                for (int64_t g = g0; g < g1; ++g)
                    for (int64_t i = 0; i < P.n; ++i)
                        tab[V](xb.p + t0, Tp, gb.p + (int64_t)P.out_rows[g * P.n + i] * Tp + t0, P.idx + g * P.L + e0,
                               gv + (g * P.L + e0) * P.n + i, P.n, e1 - e0);
            }
        }
    }
}

// Q when every Q consecutive groups of the block-pair plan (gpb = Q*Q, groups (p, q) p-major) share their
// first row and none of them has it as second row (Q <= 64), else 0
int64_t pair_q(const Problem& P) {
    int64_t Q = 1;
    while (Q * Q < P.gpb) ++Q;
    if (Q * Q != P.gpb || Q > 64) return 0;
    for (int64_t g = 0; g < P.G; g += Q)
        for (int64_t q = 0; q < Q; ++q)
            if (P.out_rows[2 * (g + q)] != P.out_rows[2 * g] || P.out_rows[2 * (g + q) + 1] == P.out_rows[2 * g]) return 0;
    return Q;
}

bool valid(const Problem& P) {
    if (P.off) {
        if (P.n != 2 || P.ilv || P.units < 1 || P.gpb < 1 || P.G % P.gpb != 0) return false;
        const int64_t U = P.units;
        for (int64_t g = 0; g < P.G; ++g)
            for (int64_t u = 0; u < U; ++u)
                if (P.off[g * (U + 1) + u] > P.off[g * (U + 1) + u + 1] || P.off[g * (U + 1) + u] < 0) return false;
        if (P.G > 0 && P.off[P.G * (U + 1) - 1] > P.L) return false;  // L: total entries
        for (int64_t g = 0; g < P.G; ++g)
            for (int i = 0; i < 2; ++i)
                if (P.out_rows[2 * g + i] < 0 || P.out_rows[2 * g + i] >= P.out_pad) return false;
        return true;
    }
    if (P.ilv && (P.n > MAXQ || P.unit_entries % P.n != 0)) return false;
    return P.n >= 1 && P.G >= 0 && P.gpb >= 1 && P.rpb >= 1 && P.G % P.gpb == 0 && P.units >= 0 &&
           P.L == P.units * P.unit_entries;
}

}  // namespace

extern "C" {

int sparsa_grouped_nm_version() { return 4; }

// 1 when the AVX-512 pieces run
int sparsa_grouped_nm_has_avx512() { return tables().avx512 ? 1 : 0; }

// y[T, R] = grouped-ELL(x[T, K]) (+ bias). x rows have stride ldx (unit column stride), y is contiguous.
// Returns 0 on success, -1 for inconsistent sizes.
int sparsa_gnm_spmm_f32(const float* x, int64_t T, int64_t K, int64_t ldx, const int32_t* idx, const float* vals,
                        const int32_t* out_rows, int64_t G, int64_t n, int64_t units, int64_t unit_entries,
                        int64_t unit_span, int64_t gpb, int64_t rpb, int64_t in_pad, int64_t out_pad,
                        const float* bias, float* y, int64_t R, int nthreads, int64_t tile_bytes, int vmax,
                        int interleaved, const int64_t* offsets, int64_t entries) {
    Problem P{idx, vals, out_rows, G, n, offsets ? entries : units * unit_entries, units, unit_entries, unit_span, gpb,
              rpb, in_pad, out_pad, interleaved != 0, offsets};
    if (offsets) P.pq = pair_q(P);
    if (!valid(P) || in_pad < K || out_pad < R || in_pad < units * unit_span) return -1;
    if (T <= 0 || R <= 0) return 0;
    spmm<float, float, float>(P, x, T, K, ldx, bias, y, R, std::max(1, nthreads), tile_bytes, vmax);
    return 0;
}

// The same with bf16 (raw uint16 bits) x, vals and y; fp32 accumulation, y rounded to bf16 once (nearest
// even). bias: null, fp32 (bias_bf16 = 0) or bf16 (bias_bf16 = 1), added in fp32 before the rounding.
// The AVX2 pieces on every CPU (see the header comment).
int sparsa_gnm_spmm_bf16(const uint16_t* x, int64_t T, int64_t K, int64_t ldx, const int32_t* idx,
                         const uint16_t* vals, const int32_t* out_rows, int64_t G, int64_t n, int64_t units,
                         int64_t unit_entries, int64_t unit_span, int64_t gpb, int64_t rpb, int64_t in_pad,
                         int64_t out_pad, const void* bias, int bias_bf16, uint16_t* y, int64_t R, int nthreads,
                         int64_t tile_bytes, int vmax, int interleaved, const int64_t* offsets, int64_t entries) {
    Problem P{idx, vals, out_rows, G, n, offsets ? entries : units * unit_entries, units, unit_entries, unit_span, gpb,
              rpb, in_pad, out_pad, interleaved != 0, offsets};
    if (offsets) P.pq = pair_q(P);
    if (!valid(P) || in_pad < K || out_pad < R || in_pad < units * unit_span) return -1;
    if (T <= 0 || R <= 0) return 0;
    std::vector<float> b32;
    const float* b = sparsa_bias_f32(bias, bias_bf16, R, b32);
    spmm<uint16_t, uint16_t, uint16_t>(P, x, T, K, ldx, b, y, R, std::max(1, nthreads), tile_bytes, vmax);
    return 0;
}

// gv[G, L, n] = sum_t gy[t, out_rows[g, i]] * x[t, idx[g, e]] (the forward problem's pattern).
int sparsa_gnm_sddmm_f32(const float* x, int64_t ldx, const float* gy, int64_t ldg, int64_t T, int64_t K, int64_t R,
                         const int32_t* idx, const int32_t* out_rows, int64_t G, int64_t n, int64_t units,
                         int64_t unit_entries, int64_t unit_span, int64_t in_pad, int64_t out_pad, float* gv,
                         int nthreads, int64_t tile_bytes) {
    Problem P{idx, nullptr, out_rows, G, n, units * unit_entries, units, unit_entries, unit_span, 1, 1, in_pad, out_pad,
              false};
    if (!valid(P) || in_pad < K || out_pad < R || in_pad < units * unit_span) return -1;
    sddmm(P, x, ldx, gy, ldg, T, K, R, gv, std::max(1, nthreads), tile_bytes > 0 ? tile_bytes : SDDMM_TILE_BYTES);
    return 0;
}

}  // extern "C"
