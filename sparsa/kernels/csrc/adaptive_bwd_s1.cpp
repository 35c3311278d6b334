// Activation-sparse conv backward for stride-1 convolutions (any padding / dilation; Linear is the
// 1x1 case), sparsa adaptive runtime.
//
// Both gradients are driven by a per-channel ("CSC") view of the compacted activation A, built here
// from the per-pixel operand of adaptive_compact.cpp in two O(nnz) passes. Pixels are grouped into
// tiles of R input rows of one image; for every (tile, channel) the entries are the nonzeros of A:
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
// Geometry g[]: N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS (sh = sw = 1 here).
// pads[]: pt, pl, Hp, Wp.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

namespace {

struct Csc {
    int64_t R = 1, T = 0;
    std::vector<int64_t> start;  // T*C + 1
    std::vector<int32_t> pos;    // padded-dY pixel of the input pixel (offset (kh, kw) = (0, 0) base)
    std::vector<int64_t> dofs;   // element offset n*s0 + hi*s2 + wi*s3 in dA (igrad only)
    std::vector<float> val;
};

// Rows per tile (rows of all images in a row, n*H + h): about 256 input pixels, so the dY rows a
// tile reads stay in L2 and each (tile, channel) column is long enough to amortise its dWt update.
inline int64_t tile_rows(int64_t H, int64_t W) {
    (void)H;
    return std::max<int64_t>(1, (256 + W - 1) / W);
}

void build_csc(const int64_t* g, const int32_t* cnt, const int32_t* idx, const float* val,
               const int64_t* pads, const int64_t* das, int nthreads, Csc& cs) {
    const int64_t N = g[0], C = g[1], H = g[2], W = g[3], ph = g[11], pw = g[12], CS = g[15];
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
// acc[k][v] = sum_e v[e] * dy[(pos[e] + sh0 + k*kws) * O + 8v]; then dst[k*dks + 8v] (+)= acc.
template <int NV, int KWG>
inline void wg_col(const float* dy, int64_t O, const int32_t* pos, const float* v, int64_t len,
                   int64_t sh0, int64_t kws, float* dst, int64_t dks, bool first) {
    __m256 acc[KWG][NV];
    for (int k = 0; k < KWG; ++k)
        for (int u = 0; u < NV; ++u) acc[k][u] = _mm256_setzero_ps();
    for (int64_t e = 0; e < len; ++e) {
        const __m256 a = _mm256_broadcast_ss(v + e);
        const float* p = dy + (pos[e] + sh0) * O;
        for (int k = 0; k < KWG; ++k)
            for (int u = 0; u < NV; ++u)
                acc[k][u] = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + k * kws * O + 8 * u), acc[k][u]);
    }
    for (int k = 0; k < KWG; ++k)
        for (int u = 0; u < NV; ++u) {
            float* d = dst + k * dks + 8 * u;
            _mm256_storeu_ps(d, first ? acc[k][u] : _mm256_add_ps(acc[k][u], _mm256_loadu_ps(d)));
        }
}

template <int NV, int KWG>
void wg_range(const int64_t* g, const Csc& cs, const float* dy, float* dwt, int64_t c0, int64_t c1,
              int64_t ob, const int64_t* pads) {
    const int64_t C = g[1], O = g[4], KH = g[5], KW = g[6], dh = g[13], dw = g[14];
    const int64_t Wp = pads[3];
    const float* dyo = dy + ob;
    for (int64_t t = 0; t < cs.T; ++t) {
        const bool first = t == 0;
        for (int64_t kh = 0; kh < KH; ++kh)
            for (int64_t kw0 = 0; kw0 < KW; kw0 += KWG)
                for (int64_t c = c0; c < c1; ++c) {
                    const int64_t b = cs.start[t * C + c], len = cs.start[t * C + c + 1] - b;
                    if (!len && !first) continue;
                    float* dst = dwt + ((kh * KW + kw0) * C + c) * O + ob;
                    wg_col<NV, KWG>(dyo, O, cs.pos.data() + b, cs.val.data() + b, len,
                                    -(kh * dh * Wp + kw0 * dw), -dw, dst, C * O, first);
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

void ig_tile(const int64_t* g, const Csc& cs, const float* dy, const float* wt, float* da,
             const int64_t* das, int64_t t, const int64_t* pads) {
    const int64_t C = g[1], O = g[4], KH = g[5], KW = g[6], dh = g[13], dw = g[14];
    const int64_t Wp = pads[3];
    for (int64_t c = 0; c < C; ++c) {
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

}  // namespace

extern "C" {

// dwt ([KH, KW, C, O], overwritten) and/or da (zero-filled [N, C, H, W] with element strides das)
// may be null. dyp: zero-padded NHWC dY [N, Hp, Wp, O] (see the header). Returns 0, or 1 when the
// geometry is not stride 1 or O % 8 != 0.
int sparsa_adaptive_conv_bwd_s1_f32(const int64_t* g, const int32_t* cnt, const int32_t* idx,
                                    const float* val, const float* dyp, const int64_t* pads,
                                    const float* wt, float* dwt, float* da, const int64_t* das,
                                    int nthreads) {
    const int64_t C = g[1], O = g[4], KH = g[5], KW = g[6];
    if (O % 8 || g[9] != 1 || g[10] != 1) return 1;
    Csc cs;
    build_csc(g, cnt, idx, val, pads, da ? das : nullptr, nthreads, cs);
    if (dwt) {
        if (cs.T == 0) {
            std::memset(dwt, 0, sizeof(float) * KH * KW * C * O);
        } else {
            // tasks: (channel chunk, output-channel block); each owns its slice of dWt
            const bool k3 = KW % 3 == 0;
            const int64_t OB = k3 ? 32 : 64;
            const int64_t nob = (O + OB - 1) / OB;
            const int64_t CC = std::max<int64_t>(1, std::min<int64_t>(16, C / (4 * nthreads)));
            const int64_t ncc = (C + CC - 1) / CC;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
            for (int64_t task = 0; task < ncc * nob; ++task) {
                const int64_t ci = task / nob, ob = (task % nob) * OB;
                const int64_t c0 = ci * CC, c1 = std::min(C, c0 + CC);
                const int64_t nv = std::min(OB, O - ob) / 8;
                if (k3) {
                    switch (nv) {
                        case 4: wg_range<4, 3>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        case 3: wg_range<3, 3>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        case 2: wg_range<2, 3>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        default: wg_range<1, 3>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                    }
                } else {
                    switch (nv) {
                        case 8: wg_range<8, 1>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        case 7: wg_range<7, 1>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        case 6: wg_range<6, 1>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        case 5: wg_range<5, 1>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        case 4: wg_range<4, 1>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        case 3: wg_range<3, 1>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        case 2: wg_range<2, 1>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                        default: wg_range<1, 1>(g, cs, dyp, dwt, c0, c1, ob, pads); break;
                    }
                }
            }
        }
    }
    if (da) {
        // Wt repacked [C][KH][KW][O]: the rows of one channel are contiguous (in the [KH, KW, C, O]
        // layout they sit C*O*4 bytes apart and collide in the same L1 sets)
        const int64_t K2 = KH * KW;
        std::vector<float> wc((size_t)C * K2 * O);
#pragma omp parallel for num_threads(nthreads)
        for (int64_t c = 0; c < C; ++c)
            for (int64_t k = 0; k < K2; ++k)
                std::memcpy(wc.data() + (c * K2 + k) * O, wt + (k * C + c) * O, sizeof(float) * O);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t t = 0; t < cs.T; ++t) ig_tile(g, cs, dyp, wc.data(), da, das, t, pads);
    }
    return 0;
}

}  // extern "C"
