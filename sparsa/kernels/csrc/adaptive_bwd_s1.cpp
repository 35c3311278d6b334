// Activation-sparse conv backward for stride-1 convolutions (any padding / dilation; Linear is the
// 1x1 case), sparsa adaptive runtime.
//
// Both gradients are driven by a per-channel ("CSC") view of the compacted activation A, built here
// from the per-pixel operand of adaptive_compact.cpp in two O(nnz) passes. Pixels are grouped into
// tiles of R input rows (of all images in a row); for every (tile, channel) the entries are the nonzeros of A:
// (padded-dY pixel index of the input pixel, element offset of the pixel in dA, value).
//
// dY arrives zero-padded (NHWC, [N, Hp, Wp, O], the real rows/columns at [pt, pt+Ho) x [pl, pl+Wo)),
// so every kernel offset of every input pixel reads a valid dY pixel without bounds checks:
//   input pixel (n, hi, wi) and offset (kh, kw)  ->  dY pixel (n, hi + ph - kh*dh, wi + pw - kw*dw).
//
//   weight  dWt[kh,kw,c,:] = sum_{(q,a) in col c} a * dY[q shifted by (kh,kw), :]
//           per (tile, ob block, kh, c): NV x KWG accumulators stay in registers over the column.
//   input   dA[q,c]        = sum_{kh,kw} dY[q shifted, :] . Wt[kh,kw,c,:], only for the nonzeros
//           per (tile, c): E entries at a time, each Wt vector load is reused E times.
//
// The training-step entry (sparsa_adaptive_conv_bwd_s1_v2_f32) pads dY itself into per-thread
// scratch, the weight gradient reading an output-block-major copy [O/OB][N*Hp*Wp][OB] (contiguous
// per block: L1-friendly), takes the weights packed once per step ([C][KH][KW][O]) and writes the
// weight gradient into nn.Conv2d's [O, C, KH, KW] layout: for a contiguous weight every task
// transposes its (channel chunk, output block) slice from a small per-thread buffer straight into
// the result (no full-size scratch pass through memory), else through a [KH, KW, C, O] scratch and a
// blocked transpose. When a tile's dY
// rows of one 32-wide output block fit in L1 the input gradient also runs block by block over the
// block-major copy (partial sums per CSC entry, then scattered into dA; no plain padded copy).
//
// Geometry g[]: N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS (sh = sw = 1 here).
// pads[]: pt, pl, Hp, Wp.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

#include "adaptive_geo.h"
#include "adaptive_transpose.h"

namespace {

struct Csc {
    int64_t R = 1, T = 0;
    std::vector<int64_t> start;  // T*C + 1
    std::vector<int32_t> pos;    // padded-dY pixel of the input pixel (offset (kh, kw) = (0, 0) base)
    std::vector<int64_t> dofs;   // element offset n*s0 + hi*s2 + wi*s3 in dA (igrad only)
    std::vector<float> val;
};

// Rows per tile (rows of all images in a row, n*H + h): about 256 input pixels, so the dY rows a
// tile reads stay in L2 and each (tile, channel) column is long enough to amortise its dWt update
// (128 helps the weight gradient a little but slows the input gradient more).
inline int64_t tile_rows(int64_t H, int64_t W) {
    (void)H;
    return std::max<int64_t>(1, (256 + W - 1) / W);
}

void build_csc(const int64_t* g, const int32_t* cnt, const int32_t* idx, const float* val,
               const int64_t* pads, const int64_t* das, int nthreads, Csc& cs) {
    const int64_t N = g[kGeoN], C = g[kGeoC], H = g[kGeoH], W = g[kGeoW], ph = g[kGeoPh], pw = g[kGeoPw], CS = g[kGeoCS];
    const int64_t S = (C + CS - 1) / CS;
    const int64_t pt = pads[0], pl = pads[1], Hp = pads[2], Wp = pads[3];
    cs.R = tile_rows(H, W);
    cs.T = (N * H + cs.R - 1) / cs.R;
    const int64_t T = cs.T;
    cs.start.assign(T * C + 1, 0);
    int64_t* st = cs.start.data() + 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t r0 = t * cs.R, r1 = std::min(N * H, r0 + cs.R);
        int64_t* ct = st + t * C;
        for (int64_t q = r0 * W; q < r1 * W; ++q)
            for (int64_t s = 0; s < S; ++s) {
                const int len = cnt[q * S + s];
                const int32_t* ii = idx + q * C + s * CS;
                for (int j = 0; j < len; ++j) ++ct[ii[j]];
            }
    }
    for (int64_t i = 1; i <= T * C; ++i) cs.start[i] += cs.start[i - 1];
    const int64_t nnz = cs.start[T * C];
    cs.pos.resize(nnz);
    cs.val.resize(nnz);
    if (das) cs.dofs.resize(nnz);
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<int64_t> fill(C);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < T; ++t) {
            const int64_t r0 = t * cs.R, r1 = std::min(N * H, r0 + cs.R);
            std::memcpy(fill.data(), cs.start.data() + t * C, sizeof(int64_t) * C);
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t wi = 0, n = r / H, hi = r % H; wi < W; ++wi) {
                    const int64_t q = (n * H + hi) * W + wi;
                    const int32_t p = (int32_t)((n * Hp + hi + ph + pt) * Wp + wi + pw + pl);
                    const int64_t d = das ? n * das[0] + hi * das[2] + wi * das[3] : 0;
                    for (int64_t s = 0; s < S; ++s) {
                        const int len = cnt[q * S + s];
                        const int32_t* ii = idx + q * C + s * CS;
                        const float* vv = val + q * C + s * CS;
                        for (int j = 0; j < len; ++j) {
                            const int64_t k = fill[ii[j]]++;
                            cs.pos[k] = p;
                            cs.val[k] = vv[j];
                            if (das) cs.dofs[k] = d;
                        }
                    }
                }
        }
    }
}

// ---------------------------------------------------------------- weight gradient
// Up to three groups of up to 4 accumulator vectors: group g reads dy at p + lo_g and adds into
// dst + so_g. Accumulators are named (not arrays): with arrays of vectors GCC keeps them in registers
// but also re-stores all of them to the stack on every iteration, which halved the kernel's speed.
#define SPARSA_WG_FMA(R, P) R = _mm256_fmadd_ps(a, _mm256_loadu_ps(P), R)
#define SPARSA_WG_OUT(R, D) _mm256_storeu_ps(D, first ? R : _mm256_add_ps(R, _mm256_loadu_ps(D)))
template <int NA, int NB, int NC>
inline void wg_col3(const float* dy, int64_t O, const int32_t* pos, const float* v, int64_t len, int64_t sh0,
                    int64_t lo1, int64_t lo2, float* dst, int64_t so1, int64_t so2, bool first) {
    static_assert(NA >= 1 && NA <= 4 && NB >= 0 && NB <= 4 && NC >= 0 && NC <= 4, "wg_col3: 1..4 vectors");
    __m256 r00 = _mm256_setzero_ps(), r01 = r00, r02 = r00, r03 = r00, r10 = r00, r11 = r00, r12 = r00,
           r13 = r00, r20 = r00, r21 = r00, r22 = r00, r23 = r00;
    // three base pointers per entry, constant displacements (with the offsets folded into index
    // registers GCC runs out of registers and reloads them from the stack every iteration)
    const float* d0 = dy + sh0 * O;
    const float* d1 = d0 + lo1;
    const float* d2 = d0 + lo2;
    for (int64_t e = 0; e < len; ++e) {
        const __m256 a = _mm256_broadcast_ss(v + e);
        const int64_t off = (int64_t)pos[e] * O;
        const float* p = d0 + off;
        SPARSA_WG_FMA(r00, p);
        if (NA > 1) SPARSA_WG_FMA(r01, p + 8);
        if (NA > 2) SPARSA_WG_FMA(r02, p + 16);
        if (NA > 3) SPARSA_WG_FMA(r03, p + 24);
        if (NB > 0) {
            const float* p1 = d1 + off;
            SPARSA_WG_FMA(r10, p1);
            if (NB > 1) SPARSA_WG_FMA(r11, p1 + 8);
            if (NB > 2) SPARSA_WG_FMA(r12, p1 + 16);
            if (NB > 3) SPARSA_WG_FMA(r13, p1 + 24);
        }
        if (NC > 0) {
            const float* p2 = d2 + off;
            SPARSA_WG_FMA(r20, p2);
            if (NC > 1) SPARSA_WG_FMA(r21, p2 + 8);
            if (NC > 2) SPARSA_WG_FMA(r22, p2 + 16);
            if (NC > 3) SPARSA_WG_FMA(r23, p2 + 24);
        }
    }
    SPARSA_WG_OUT(r00, dst);
    if (NA > 1) SPARSA_WG_OUT(r01, dst + 8);
    if (NA > 2) SPARSA_WG_OUT(r02, dst + 16);
    if (NA > 3) SPARSA_WG_OUT(r03, dst + 24);
    if (NB > 0) SPARSA_WG_OUT(r10, dst + so1);
    if (NB > 1) SPARSA_WG_OUT(r11, dst + so1 + 8);
    if (NB > 2) SPARSA_WG_OUT(r12, dst + so1 + 16);
    if (NB > 3) SPARSA_WG_OUT(r13, dst + so1 + 24);
    if (NC > 0) SPARSA_WG_OUT(r20, dst + so2);
    if (NC > 1) SPARSA_WG_OUT(r21, dst + so2 + 8);
    if (NC > 2) SPARSA_WG_OUT(r22, dst + so2 + 16);
    if (NC > 3) SPARSA_WG_OUT(r23, dst + so2 + 24);
}
#undef SPARSA_WG_FMA
#undef SPARSA_WG_OUT

// acc[k][v] = sum_e v[e] * dy[(pos[e] + sh0 + k*kws) * O + 8v]; then dst[k*dks + 8v] (+)= acc.
// KWG = 3 (three kernel columns at once, NV <= 4) or 1 (NV <= 8).
template <int NV, int KWG>
inline void wg_col(const float* dy, int64_t O, const int32_t* pos, const float* v, int64_t len,
                   int64_t sh0, int64_t kws, float* dst, int64_t dks, bool first) {
    if constexpr (KWG == 3) {
        static_assert(NV <= 4, "wg_col: NV <= 4 with three kernel columns");
        wg_col3<NV, NV, NV>(dy, O, pos, v, len, sh0, kws * O, 2 * kws * O, dst, dks, 2 * dks, first);
    } else {
        static_assert(KWG == 1 && NV <= 8, "wg_col: KWG is 1 or 3");
        constexpr int NA = NV < 4 ? NV : 4, NB = NV - NA;
        wg_col3<NA, NB, 0>(dy, O, pos, v, len, sh0, 32, 0, dst, 32, 0, first);
    }
}

// dyo: the dY columns of output block ob (row stride ldy: O in the plain padded layout, the block
// width in the blocked one). The block's gradient row of (c, kh, kw) goes to
// base + c*sc + kh*skh + kw*skw.
template <int NV, int KWG>
void wg_range(const int64_t* g, const Csc& cs, const float* dyo, int64_t ldy, float* base, int64_t sc,
              int64_t skh, int64_t skw, int64_t c0, int64_t c1, const int64_t* pads) {
    const int64_t C = g[kGeoC], KH = g[kGeoKH], KW = g[kGeoKW], dh = g[kGeoDh], dw = g[kGeoDw];
    const int64_t Wp = pads[3];
    for (int64_t t = 0; t < cs.T; ++t) {
        const bool first = t == 0;
        for (int64_t kh = 0; kh < KH; ++kh)
            for (int64_t kw0 = 0; kw0 < KW; kw0 += KWG)
                for (int64_t c = c0; c < c1; ++c) {
                    const int64_t b = cs.start[t * C + c], len = cs.start[t * C + c + 1] - b;
                    if (!len && !first) continue;
                    float* dst = base + c * sc + kh * skh + kw0 * skw;
                    wg_col<NV, KWG>(dyo, ldy, cs.pos.data() + b, cs.val.data() + b, len,
                                    -(kh * dh * Wp + kw0 * dw), -dw, dst, skw, first);
                }
    }
}

// ---------------------------------------------------------------- input gradient
inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

// E entries of one channel column: dA = sum over offsets and output channels of dY . Wt[.., c, :].
template <int E>
inline void ig_group(const float* dy, const float* wtc, int64_t O, int64_t KH, int64_t KW, int64_t C,
                     int64_t dh, int64_t dw, int64_t Wp, const int32_t* pos, const int64_t* dofs,
                     int64_t cstride, float* da) {
    __m256 acc[E];
    const float* base[E];
    for (int e = 0; e < E; ++e) { acc[e] = _mm256_setzero_ps(); base[e] = dy + (int64_t)pos[e] * O; }
    for (int64_t kh = 0; kh < KH; ++kh)
        for (int64_t kw = 0; kw < KW; ++kw) {
            const int64_t sh = -(kh * dh * Wp + kw * dw) * O;
            const float* w = wtc + (kh * KW + kw) * O;
            for (int64_t o = 0; o < O; o += 8) {
                const __m256 wv = _mm256_loadu_ps(w + o);
                for (int e = 0; e < E; ++e)
                    acc[e] = _mm256_fmadd_ps(_mm256_loadu_ps(base[e] + sh + o), wv, acc[e]);
            }
        }
    for (int e = 0; e < E; ++e) da[dofs[e] + cstride] = hsum(acc[e]);
}

// Sums of 8 (4) accumulators, one per lane.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// E entries of one channel column, output channels [ob, ob + 8*NV) of the block-major dY (row
// stride 8*NV): part[e] (+)= sum over offsets of dY . Wt[.., c, ob:].
template <int E, int NV>
inline void ig_block(const float* dyo, const float* wtc, int64_t O, int64_t KH, int64_t KW, int64_t dh,
                     int64_t dw, int64_t Wp, const int32_t* pos, float* part, bool first) {
    constexpr int64_t OB = 8 * NV;
    __m256 acc[E];
    const float* base[E];
    for (int e = 0; e < E; ++e) { acc[e] = _mm256_setzero_ps(); base[e] = dyo + (int64_t)pos[e] * OB; }
    for (int64_t kh = 0; kh < KH; ++kh)
        for (int64_t kw = 0; kw < KW; ++kw) {
            const int64_t sh = -(kh * dh * Wp + kw * dw) * OB;
            const float* w = wtc + (kh * KW + kw) * O;
            for (int v = 0; v < NV; ++v) {
                const __m256 wv = _mm256_loadu_ps(w + 8 * v);
                for (int e = 0; e < E; ++e)
                    acc[e] = _mm256_fmadd_ps(_mm256_loadu_ps(base[e] + sh + 8 * v), wv, acc[e]);
            }
        }
    if constexpr (E == 8) {
        __m256 r = hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
        if (!first) r = _mm256_add_ps(r, _mm256_loadu_ps(part));
        _mm256_storeu_ps(part, r);
    } else if constexpr (E == 4) {
        __m128 r = hsum4(acc[0], acc[1], acc[2], acc[3]);
        if (!first) r = _mm_add_ps(r, _mm_loadu_ps(part));
        _mm_storeu_ps(part, r);
    } else {
        for (int e = 0; e < E; ++e) part[e] = first ? hsum(acc[e]) : part[e] + hsum(acc[e]);
    }
}

// Channels [c0, c1) of tile t, output channels in blocks of OB (block-major dY dyb; weights wb
// packed [C][KH][KW][O]) so that a block's dY rows of the tile stay in
// L1 over all the channels; the partial sums of the entries live in part (indexed like the CSC
// arrays) and are scattered into dA at the end.
template <int NV>
void ig_tile_blocked(const int64_t* g, const Csc& cs, const float* dyb, const float* wb, float* part, float* da,
                     const int64_t* das, int64_t t, int64_t c0, int64_t c1, const int64_t* pads) {
    constexpr int64_t OB = 8 * NV;
    const int64_t C = g[kGeoC], O = g[kGeoO], KH = g[kGeoKH], KW = g[kGeoKW], dh = g[kGeoDh], dw = g[kGeoDw];
    const int64_t Wp = pads[3], NP = g[kGeoN] * pads[2] * Wp, K2 = KH * KW;
    for (int64_t ob = 0; ob < O; ob += OB) {
        const bool first = ob == 0;
        const float* dyo = dyb + ob * NP;
        for (int64_t c = c0; c < c1; ++c) {
            const int64_t b = cs.start[t * C + c], end = cs.start[t * C + c + 1];
            const float* wtc = wb + c * K2 * O + ob;
            const int32_t* pos = cs.pos.data();
            int64_t e = b;
            for (; e + 8 <= end; e += 8) ig_block<8, NV>(dyo, wtc, O, KH, KW, dh, dw, Wp, pos + e, part + e, first);
            if (e + 4 <= end) {
                ig_block<4, NV>(dyo, wtc, O, KH, KW, dh, dw, Wp, pos + e, part + e, first);
                e += 4;
            }
            for (; e < end; ++e) ig_block<1, NV>(dyo, wtc, O, KH, KW, dh, dw, Wp, pos + e, part + e, first);
        }
    }
    for (int64_t c = c0; c < c1; ++c) {
        const int64_t b = cs.start[t * C + c], end = cs.start[t * C + c + 1];
        const int64_t cst = c * das[1];
        for (int64_t e = b; e < end; ++e) da[cs.dofs[e] + cst] = part[e];
    }
}

// Channels [c0, c1) of tile t.
void ig_tile(const int64_t* g, const Csc& cs, const float* dy, const float* wt, float* da,
             const int64_t* das, int64_t t, int64_t c0, int64_t c1, const int64_t* pads) {
    const int64_t C = g[kGeoC], O = g[kGeoO], KH = g[kGeoKH], KW = g[kGeoKW], dh = g[kGeoDh], dw = g[kGeoDw];
    const int64_t Wp = pads[3];
    for (int64_t c = c0; c < c1; ++c) {
        const int64_t b = cs.start[t * C + c], end = cs.start[t * C + c + 1];
        const float* wtc = wt + c * KH * KW * O;
        const int64_t cst = c * das[1];
        int64_t e = b;
        for (; e + 8 <= end; e += 8)
            ig_group<8>(dy, wtc, O, KH, KW, C, dh, dw, Wp, cs.pos.data() + e, cs.dofs.data() + e, cst, da);
        if (e + 4 <= end) {
            ig_group<4>(dy, wtc, O, KH, KW, C, dh, dw, Wp, cs.pos.data() + e, cs.dofs.data() + e, cst, da);
            e += 4;
        }
        for (; e < end; ++e)
            ig_group<1>(dy, wtc, O, KH, KW, C, dh, dw, Wp, cs.pos.data() + e, cs.dofs.data() + e, cst, da);
    }
}

// Grow-only per-calling-thread scratch: re-used across calls, so the large temporaries (padded dY,
// the per-channel view, the packed weights, dWt) do not page-fault on every training step.
struct Scratch {
    Csc cs;
    std::vector<float> dyp, dyb, wc, dwt, part;
};

Scratch& scratch() {
    thread_local Scratch s;
    return s;
}

template <class T>
T* grow(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

inline int64_t wg_block(int64_t KW) { return KW % 3 == 0 ? 32 : 64; }
inline int64_t ig_block_width(int64_t KW) { (void)KW; return 32; }

// The input gradient runs output-channel block by block over the block-major dY copy when a tile's
// block of dY rows fits in L1, else over the plain padded dY (figures in docs/benchmarks.md).
inline bool ig_use_blocked(const int64_t* g, const int64_t* pads) {
    const int64_t H = g[kGeoH], W = g[kGeoW], O = g[kGeoO], KH = g[kGeoKH], KW = g[kGeoKW], dh = g[kGeoDh];
    const int64_t OB = ig_block_width(KW);
    if (OB != wg_block(KW) || O % OB) return false;
    const int64_t R = tile_rows(H, W);
    const int64_t rows = R >= H ? (R + H - 1) / H * pads[2] : R + (KH - 1) * dh;
    return rows * pads[3] * OB * (int64_t)sizeof(float) <= 48 * 1024;
}

// wc: packed weights [C][KH][KW][O] (needed when da is set). dyb (may be null): the padded dY in the
// output-block-major layout [O / OB][N*Hp*Wp][OB] (OB = wg_block(KW), the last block may be
// narrower) for the weight gradient: a block's rows are contiguous, so a tile of them stays in L1
// (in the plain layout the OB-wide row pieces sit O*4 bytes apart and crowd a few L1 sets).
void bwd_core(const int64_t* g, const int32_t* cnt, const int32_t* idx, const float* val, const float* dyp,
              const float* dyb, const int64_t* pads, const float* wc, float* dwt, float* da, const int64_t* das,
              int nthreads, Csc& cs, std::vector<float>* part = nullptr, float* dwo = nullptr) {
    const int64_t NP = g[kGeoN] * pads[2] * pads[3];
    const int64_t C = g[kGeoC], O = g[kGeoO], KH = g[kGeoKH], KW = g[kGeoKW];
    build_csc(g, cnt, idx, val, pads, da ? das : nullptr, nthreads, cs);
    // dwo (when set, instead of dwt): the weight gradient in the dense [O, C, KH, KW] layout; each
    // task then accumulates its slice in a small per-thread buffer and transposes it into dwo while
    // it is still in cache (no full-size [KH, KW, C, O] pass through memory)
    const int64_t K2 = KH * KW;
    if (dwt || dwo) {
        if (cs.T == 0) {
            std::memset(dwt ? dwt : dwo, 0, sizeof(float) * K2 * C * O);
        } else {
            // tasks: (channel chunk, output-channel block); each owns its slice of dWt
            const bool k3 = KW % 3 == 0;
            const int64_t OB = wg_block(KW);
            const int64_t nob = (O + OB - 1) / OB;
            const int64_t CC = std::max<int64_t>(1, std::min<int64_t>(16, C / (4 * nthreads)));
            const int64_t ncc = (C + CC - 1) / CC;
#pragma omp parallel num_threads(nthreads)
            {
            std::vector<float> buf(dwo ? (size_t)CC * K2 * OB : 0);
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < ncc * nob; ++task) {
                const int64_t ci = task / nob, ob = (task % nob) * OB;
                const int64_t c0 = ci * CC, c1 = std::min(C, c0 + CC);
                const int64_t nv = std::min(OB, O - ob) / 8;
                const float* dyo = dyb ? dyb + ob * NP : dyp + ob;
                const int64_t ldy = dyb ? nv * 8 : O;
                const int64_t bw = nv * 8;  // buffer row width
                float* bp = dwo ? buf.data() - c0 * K2 * bw : dwt + ob;
                const int64_t sc = dwo ? K2 * bw : O, skh = dwo ? KW * bw : KW * C * O, skw = dwo ? bw : C * O;
                if (k3) {
                    switch (nv) {
                        case 4: wg_range<4, 3>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        case 3: wg_range<3, 3>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        case 2: wg_range<2, 3>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        default: wg_range<1, 3>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                    }
                } else {
                    switch (nv) {
                        case 8: wg_range<8, 1>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        case 7: wg_range<7, 1>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        case 6: wg_range<6, 1>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        case 5: wg_range<5, 1>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        case 4: wg_range<4, 1>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        case 3: wg_range<3, 1>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        case 2: wg_range<2, 1>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                        default: wg_range<1, 1>(g, cs, dyo, ldy, bp, sc, skh, skw, c0, c1, pads); break;
                    }
                }
                if (dwo) {
                    // buf [(c1 - c0) * K2][bw] -> dwo[ob + o][c0 * K2 + r] (row stride C * K2)
                    const int64_t rows = (c1 - c0) * K2, ldd = C * K2;
                    float* d0 = dwo + ob * ldd + c0 * K2;
                    const float* b0 = buf.data();
                    int64_t r = 0;
                    for (; r + 8 <= rows; r += 8)
                        for (int64_t o = 0; o < bw; o += 8)
                            sparsa_adaptive::tr8x8(b0 + r * bw + o, bw, d0 + o * ldd + r, ldd);
                    for (; r < rows; ++r)
                        for (int64_t o = 0; o < bw; ++o) d0[o * ldd + r] = b0[r * bw + o];
                }
            }
            }
        }
    }
    if (da) {
        // tasks: (tile, chunk of channels), so that layers with few tiles (small images) use every
        // thread; each task writes its own (pixel, channel) entries of dA
        const int64_t CC = std::max<int64_t>(1, std::min<int64_t>(32, C * cs.T / (8 * nthreads)));
        const int64_t ncc = (C + CC - 1) / CC;
        const int64_t OBI = ig_block_width(KW);
        if (dyb && part && ig_use_blocked(g, pads)) {
            float* pp = grow(*part, (size_t)cs.start[cs.T * C] + 8);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
            for (int64_t task = 0; task < cs.T * ncc; ++task) {
                const int64_t t = task / ncc, c0 = (task % ncc) * CC;
                switch (OBI) {
                    case 32: ig_tile_blocked<4>(g, cs, dyb, wc, pp, da, das, t, c0, std::min(C, c0 + CC), pads); break;
                    default: ig_tile_blocked<2>(g, cs, dyb, wc, pp, da, das, t, c0, std::min(C, c0 + CC), pads); break;
                }
            }
        } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
            for (int64_t task = 0; task < cs.T * ncc; ++task) {
                const int64_t t = task / ncc, c0 = (task % ncc) * CC;
                ig_tile(g, cs, dyp, wc, da, das, t, c0, std::min(C, c0 + CC), pads);
            }
        }
    }
}

}  // namespace

extern "C" {

// dwt ([KH, KW, C, O], overwritten) and/or da (zero-filled [N, C, H, W] with element strides das)
// may be null. dyp: zero-padded NHWC dY [N, Hp, Wp, O] (see the header). Returns 0, or 1 when the
// geometry is not stride 1 or O % 8 != 0.
int sparsa_adaptive_conv_bwd_s1_f32(const int64_t* g, const int32_t* cnt, const int32_t* idx,
                                    const float* val, const float* dyp, const int64_t* pads,
                                    const float* wt, float* dwt, float* da, const int64_t* das,
                                    int nthreads) {
    const int64_t C = g[kGeoC], O = g[kGeoO], KH = g[kGeoKH], KW = g[kGeoKW];
    if (O % 8 || g[kGeoSh] != 1 || g[kGeoSw] != 1) return 1;
    Scratch& sc = scratch();
    float* wc = nullptr;
    if (da) {
        // Wt repacked [C][KH][KW][O]: the rows of one channel are contiguous (in the [KH, KW, C, O]
        // layout they sit C*O*4 bytes apart and collide in the same L1 sets)
        const int64_t K2 = KH * KW;
        wc = grow(sc.wc, (size_t)C * K2 * O);
#pragma omp parallel for num_threads(nthreads)
        for (int64_t c = 0; c < C; ++c)
            for (int64_t k = 0; k < K2; ++k)
                std::memcpy(wc + (c * K2 + k) * O, wt + (k * C + c) * O, sizeof(float) * O);
    }
    bwd_core(g, cnt, idx, val, dyp, nullptr, pads, wc, dwt, da, das, nthreads, sc.cs);
    return 0;
}

// The training-step entry: dy is the plain NHWC output gradient [N, Ho, Wo, O] (padded here, into
// scratch), wc the weights packed by sparsa_adaptive_pack_weight_f32 ([C][KH][KW][O]; needed when da
// is set), dw (may be null) receives the weight gradient directly in nn.Conv2d's [O, C, KH, KW]
// layout with element strides dws, da (may be null) as in sparsa_adaptive_conv_bwd_s1_f32.
int sparsa_adaptive_conv_bwd_s1_v2_f32(const int64_t* g, const int32_t* cnt, const int32_t* idx,
                                       const float* val, const float* dy, const float* wc, float* dw,
                                       const int64_t* dws, float* da, const int64_t* das, int nthreads) {
    const int64_t N = g[kGeoN], C = g[kGeoC], H = g[kGeoH], W = g[kGeoW], O = g[kGeoO], KH = g[kGeoKH], KW = g[kGeoKW], Ho = g[kGeoHo],
                  Wo = g[kGeoWo], ph = g[kGeoPh], pw = g[kGeoPw], dh = g[kGeoDh], dwl = g[kGeoDw];
    if (O % 8 || g[kGeoSh] != 1 || g[kGeoSw] != 1) return 1;
    Scratch& sc = scratch();
    const int64_t pt = std::max<int64_t>(0, (KH - 1) * dh - ph), pl = std::max<int64_t>(0, (KW - 1) * dwl - pw);
    const int64_t Hp = pt + std::max(Ho, H + ph), Wp = pl + std::max(Wo, W + pw);
    const int64_t pads[4] = {pt, pl, Hp, Wp};
    const int64_t NP = N * Hp * Wp;
    float* dyp = nullptr;
    // the input gradient reads the block-major copy when its block width matches (see bwd_core)
    const bool ig_blocked = ig_use_blocked(g, pads);
    if (da && !ig_blocked) {
        dyp = grow(sc.dyp, (size_t)NP * O);
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t r = 0; r < N * Hp; ++r) {
            const int64_t n = r / Hp, h = r % Hp - pt;
            float* dst = dyp + r * Wp * O;
            if (h < 0 || h >= Ho) {
                std::memset(dst, 0, sizeof(float) * Wp * O);
                continue;
            }
            std::memset(dst, 0, sizeof(float) * pl * O);
            std::memcpy(dst + pl * O, dy + (n * Ho + h) * Wo * O, sizeof(float) * Wo * O);
            std::memset(dst + (pl + Wo) * O, 0, sizeof(float) * (Wp - pl - Wo) * O);
        }
    }
    float* dyb = nullptr;
    if (dw || (da && ig_blocked)) {
        const int64_t OB = wg_block(KW), nob = (O + OB - 1) / OB;
        dyb = grow(sc.dyb, (size_t)NP * O);
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t t = 0; t < nob * N * Hp; ++t) {
            const int64_t b = t / (N * Hp), r = t % (N * Hp), n = r / Hp, h = r % Hp - pt;
            const int64_t ob = b * OB, wdt = std::min(OB, O - ob);
            float* dst = dyb + ob * NP + r * Wp * wdt;
            if (h < 0 || h >= Ho) {
                std::memset(dst, 0, sizeof(float) * Wp * wdt);
                continue;
            }
            std::memset(dst, 0, sizeof(float) * pl * wdt);
            const float* src = dy + (n * Ho + h) * Wo * O + ob;
            for (int64_t w = 0; w < Wo; ++w)
                std::memcpy(dst + (pl + w) * wdt, src + w * O, sizeof(float) * wdt);
            std::memset(dst + (pl + Wo) * wdt, 0, sizeof(float) * (Wp - pl - Wo) * wdt);
        }
    }
    const int64_t K2 = KH * KW;
    // the dense [O, C, KH, KW] weight gradient is written by the weight-gradient tasks directly
    const bool ohwi = dw && dws[0] == C * K2 && dws[1] == 1 && dws[2] == KW * C && dws[3] == C;
    const bool oihw = dw && !ohwi && dws[0] == C * K2 && dws[1] == K2 && dws[2] == KW && dws[3] == 1;
    float* dwt = dw && !oihw ? grow(sc.dwt, (size_t)K2 * C * O) : nullptr;
    bwd_core(g, cnt, idx, val, dyp, dyb, pads, wc, oihw ? nullptr : dwt, da, das, nthreads, sc.cs, &sc.part,
             oihw ? dw : nullptr);
    if (dw) {
        if (ohwi) {
            sparsa_adaptive::transpose(dwt, K2 * C, O, dw, nthreads);
            return 0;
        }
        if (oihw) return 0;
        if (dws[0] == K2 && dws[1] == O * K2 && dws[2] == -KW && dws[3] == -1) {
            // the dY-driven weight gradient (see conv_wgrad_dy): dw points at the last kernel offset of a
            // contiguous [C, O, KH, KW] array that receives this conv's gradient flipped in (kh, kw):
            // element (o, c, k) of it is dwt[k][c][o] at position (c*O + o)*K2 + K2-1-k. Streams dwt's
            // K2 planes once (no per-element scatter through the generic path below).
            float* start = dw - (K2 - 1);
            const int64_t R = C * O;
#pragma omp parallel for schedule(static) num_threads(nthreads)
            for (int64_t r0 = 0; r0 < R; r0 += 512) {
                const int64_t r1 = std::min(R, r0 + 512);
                for (int64_t r = r0; r < r1; ++r)
                    for (int64_t k = 0; k < K2; ++k) start[r * K2 + (K2 - 1 - k)] = dwt[k * R + r];
            }
            return 0;
        }
        // blocked transpose [KH, KW, C, O] -> [O, C, KH, KW] (16 x 16 channel blocks via a buffer)
        const int64_t BO = 16, BC = 16, nbo = (O + BO - 1) / BO, nbc = (C + BC - 1) / BC;
#pragma omp parallel num_threads(nthreads)
        {
            std::vector<float> tmp((size_t)BO * BC * K2);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < nbo * nbc; ++t) {
                const int64_t o0 = (t / nbc) * BO, o1 = std::min(O, o0 + BO);
                const int64_t c0 = (t % nbc) * BC, c1 = std::min(C, c0 + BC);
                for (int64_t c = c0; c < c1; ++c)
                    for (int64_t k = 0; k < K2; ++k) {
                        const float* src = dwt + (k * C + c) * O;
                        for (int64_t o = o0; o < o1; ++o) tmp[((o - o0) * BC + (c - c0)) * K2 + k] = src[o];
                    }
                for (int64_t o = o0; o < o1; ++o)
                    for (int64_t c = c0; c < c1; ++c) {
                        float* d = dw + o * dws[0] + c * dws[1];
                        const float* sp = tmp.data() + ((o - o0) * BC + (c - c0)) * K2;
                        for (int64_t kh = 0; kh < KH; ++kh)
                            for (int64_t kw = 0; kw < KW; ++kw) d[kh * dws[2] + kw * dws[3]] = sp[kh * KW + kw];
                    }
            }
        }
    }
    return 0;
}

}  // extern "C"
