// Activation-sparse convolution (and Linear as a 1x1 conv) for training, sparsa adaptive runtime.
//
// The sparse operand is the compacted input activation A (see adaptive_compact.cpp: per pixel q
// and channel slice s, a list of (channel, value)). Weights are given transposed as
// Wt[KH, KW, C, O] (rows contiguous over output channels), gradients/outputs are NHWC
// [N, Ho, Wo, O]. All three training GEMMs read the same compacted operand:
//   forward  Y[p, :]      = bias + sum_{off, (c,a) in A[q(p,off)]} a * Wt[off, c, :]   (gather)
//   weight   dWt[off,c,:] = sum_{p, (c,a) in A[q(p,off)]} a * dY[p, :]                (scatter)
//   input    dA[q, c]     = sum_{off} dY[p(q,off), :] . Wt[off, c, :]  only where A[q,c] != 0
// Work is proportional to the number of nonzeros; every inner loop is an AVX2 FMA over 8 output
// channels, NV (1..8) vectors at a time (O must be a multiple of 8); the forward also has AVX-512
// lists (16 channels per vector), picked at run time.
//
// Geometry g[]: N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

#include "adaptive_geo.h"
#include "adaptive_transpose.h"
#include "cpu_isa.h"

namespace {

using sparsa_adaptive::Geo;
using sparsa_adaptive::pick_ob;

// ---------------------------------------------------------------- forward
// yp[0 : 8*NV] += sum_j vv[j] * wb[ii[j] * O : ... + 8*NV]. Up to 4 vectors two accumulator sets
// (two nonzeros in flight), above that one set (NV independent chains; no register spills).
template <int NV>
inline void fwd_list(float* yp, const float* wb, int64_t O, const int32_t* ii, const float* vv, int len) {
    constexpr int A2 = NV <= 4 ? 2 : 1;
    __m256 acc[A2][NV];
    for (int v = 0; v < NV; ++v) {
        acc[0][v] = _mm256_loadu_ps(yp + 8 * v);
        if (A2 == 2) acc[A2 - 1][v] = _mm256_setzero_ps();
    }
    int j = 0;
    for (; j + 2 <= len; j += 2) {
        const __m256 a0 = _mm256_broadcast_ss(vv + j), a1 = _mm256_broadcast_ss(vv + j + 1);
        const float* w0 = wb + (int64_t)ii[j] * O;
        const float* w1 = wb + (int64_t)ii[j + 1] * O;
        for (int v = 0; v < NV; ++v) acc[0][v] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(w0 + 8 * v), acc[0][v]);
        for (int v = 0; v < NV; ++v)
            acc[A2 - 1][v] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(w1 + 8 * v), acc[A2 - 1][v]);
    }
    if (j < len) {
        const __m256 a0 = _mm256_broadcast_ss(vv + j);
        const float* w0 = wb + (int64_t)ii[j] * O;
        for (int v = 0; v < NV; ++v) acc[0][v] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(w0 + 8 * v), acc[0][v]);
    }
    for (int v = 0; v < NV; ++v)
        _mm256_storeu_ps(yp + 8 * v, A2 == 2 ? _mm256_add_ps(acc[0][v], acc[A2 - 1][v]) : acc[0][v]);
}

template <int NV>
void fwd_task(const Geo& G, const int32_t* cnt, const int32_t* idx, const float* val,
              const float* wp, int64_t ldw, const float* bias, float* y, int64_t n, int64_t r0, int64_t r1,
              int64_t ob) {
    for (int64_t ho = r0; ho < r1; ++ho)
        for (int64_t wo = 0; wo < G.Wo; ++wo) {
            float* yp = y + ((n * G.Ho + ho) * G.Wo + wo) * G.O + ob;
            for (int v = 0; v < NV; ++v)
                _mm256_storeu_ps(yp + 8 * v, bias ? _mm256_loadu_ps(bias + ob + 8 * v) : _mm256_setzero_ps());
        }
    for (int64_t s = 0; s < G.S; ++s)
        for (int64_t kh = 0; kh < G.KH; ++kh)
            for (int64_t kw = 0; kw < G.KW; ++kw) {
                const float* wb = wp + (kh * G.KW + kw) * G.C * ldw;
                for (int64_t ho = r0; ho < r1; ++ho) {
                    const int64_t hi = ho * G.sh - G.ph + kh * G.dh;
                    if (hi < 0 || hi >= G.H) continue;
                    for (int64_t wo = 0; wo < G.Wo; ++wo) {
                        const int64_t wi = wo * G.sw - G.pw + kw * G.dw;
                        if (wi < 0 || wi >= G.W) continue;
                        const int64_t q = (n * G.H + hi) * G.W + wi;
                        const int len = cnt[q * G.S + s];
                        if (!len) continue;
                        const int32_t* ii = idx + q * G.C + s * G.CS;
                        const float* vv = val + q * G.C + s * G.CS;
                        float* yp = y + ((n * G.Ho + ho) * G.Wo + wo) * G.O + ob;
                        fwd_list<NV>(yp, wb, ldw, ii, vv, len);
                    }
                }
            }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_ADAPTIVE_AVX512 1
// AVX-512 forward (chosen at run time, see cpu_isa.h): the same loop nest, NV zmm accumulators of 16
// output channels, and while a list still has >= 32 entries two accumulator sets (two nonzeros in
// flight). Faster than the AVX2 lists above at every sparsity, most at high sparsity (docs/benchmarks.md).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
template <int NV>
inline void fwd_list512(float* yp, const float* wb, int64_t O, const int32_t* ii, const float* vv, int len) {
    __m512 acc[NV], acc2[NV];
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_loadu_ps(yp + 16 * v);
    int j = 0;
    if (len >= 32) {
        for (int v = 0; v < NV; ++v) acc2[v] = _mm512_setzero_ps();
        for (; j + 2 <= len; j += 2) {
            const __m512 a0 = _mm512_set1_ps(vv[j]), a1 = _mm512_set1_ps(vv[j + 1]);
            const float* w0 = wb + (int64_t)ii[j] * O;
            const float* w1 = wb + (int64_t)ii[j + 1] * O;
            for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(a0, _mm512_loadu_ps(w0 + 16 * v), acc[v]);
            for (int v = 0; v < NV; ++v) acc2[v] = _mm512_fmadd_ps(a1, _mm512_loadu_ps(w1 + 16 * v), acc2[v]);
        }
        for (int v = 0; v < NV; ++v) acc[v] = _mm512_add_ps(acc[v], acc2[v]);
    }
    for (; j < len; ++j) {
        const __m512 a = _mm512_set1_ps(vv[j]);
        const float* w = wb + (int64_t)ii[j] * O;
        for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(a, _mm512_loadu_ps(w + 16 * v), acc[v]);
    }
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(yp + 16 * v, acc[v]);
}

template <int NV>
void fwd_task512(const Geo& G, const int32_t* cnt, const int32_t* idx, const float* val,
                 const float* wp, int64_t ldw, const float* bias, float* y, int64_t n, int64_t r0, int64_t r1,
                 int64_t ob) {
    for (int64_t ho = r0; ho < r1; ++ho)
        for (int64_t wo = 0; wo < G.Wo; ++wo) {
            float* yp = y + ((n * G.Ho + ho) * G.Wo + wo) * G.O + ob;
            for (int v = 0; v < NV; ++v)
                _mm512_storeu_ps(yp + 16 * v, bias ? _mm512_loadu_ps(bias + ob + 16 * v) : _mm512_setzero_ps());
        }
    for (int64_t s = 0; s < G.S; ++s)
        for (int64_t kh = 0; kh < G.KH; ++kh)
            for (int64_t kw = 0; kw < G.KW; ++kw) {
                const float* wb = wp + (kh * G.KW + kw) * G.C * ldw;
                for (int64_t ho = r0; ho < r1; ++ho) {
                    const int64_t hi = ho * G.sh - G.ph + kh * G.dh;
                    if (hi < 0 || hi >= G.H) continue;
                    for (int64_t wo = 0; wo < G.Wo; ++wo) {
                        const int64_t wi = wo * G.sw - G.pw + kw * G.dw;
                        if (wi < 0 || wi >= G.W) continue;
                        const int64_t q = (n * G.H + hi) * G.W + wi;
                        const int len = cnt[q * G.S + s];
                        if (!len) continue;
                        fwd_list512<NV>(y + ((n * G.Ho + ho) * G.Wo + wo) * G.O + ob, wb, ldw,
                                        idx + q * G.C + s * G.CS, val + q * G.C + s * G.CS, len);
                    }
                }
            }
}
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------- weight gradient
// Accumulates into dwb (layout [KH, KW, C, O]) the contribution of output pixels [p0, p1) for
// channel slice s and output block ob.
template <int NV>
void wgrad_task(const Geo& G, const int32_t* cnt, const int32_t* idx, const float* val,
                const float* dy, float* dwt, int64_t s, int64_t ob, int64_t p0, int64_t p1) {
    const int64_t PANEL = 128;
    for (int64_t pp = p0; pp < p1; pp += PANEL) {
        const int64_t pe = std::min(pp + PANEL, p1);
        for (int64_t kh = 0; kh < G.KH; ++kh)
            for (int64_t kw = 0; kw < G.KW; ++kw) {
                float* db = dwt + (kh * G.KW + kw) * G.C * G.O + ob;
                for (int64_t p = pp; p < pe; ++p) {
                    const int64_t wo = p % G.Wo, t = p / G.Wo, ho = t % G.Ho, n = t / G.Ho;
                    const int64_t hi = ho * G.sh - G.ph + kh * G.dh;
                    const int64_t wi = wo * G.sw - G.pw + kw * G.dw;
                    if (hi < 0 || hi >= G.H || wi < 0 || wi >= G.W) continue;
                    const int64_t q = (n * G.H + hi) * G.W + wi;
                    const int len = cnt[q * G.S + s];
                    if (!len) continue;
                    const int32_t* ii = idx + q * G.C + s * G.CS;
                    const float* vv = val + q * G.C + s * G.CS;
                    const float* gp = dy + p * G.O + ob;
                    __m256 g[NV];
                    for (int v = 0; v < NV; ++v) g[v] = _mm256_loadu_ps(gp + 8 * v);
                    for (int j = 0; j < len; ++j) {
                        const __m256 a = _mm256_broadcast_ss(vv + j);
                        float* d = db + (int64_t)ii[j] * G.O;
                        for (int v = 0; v < NV; ++v)
                            _mm256_storeu_ps(d + 8 * v, _mm256_fmadd_ps(a, g[v], _mm256_loadu_ps(d + 8 * v)));
                    }
                }
            }
    }
}

// ---------------------------------------------------------------- input gradient
// For input pixels of rows [r0, r1) of image n: dA at the nonzeros of A, written into da through
// its element strides (da must be zero-filled by the caller).
template <int NV>
void igrad_task(const Geo& G, const int32_t* cnt, const int32_t* idx, const float* dy,
                const float* wt, float* da, const int64_t* das, int64_t n, int64_t r0, int64_t r1,
                std::vector<float>& buf, std::vector<int64_t>& off) {
    const int64_t q0 = (n * G.H + r0) * G.W, q1 = (n * G.H + r1) * G.W;
    const int64_t nq = q1 - q0;
    off.resize(nq + 1);
    for (int64_t s = 0; s < G.S; ++s) {
        off[0] = 0;
        for (int64_t i = 0; i < nq; ++i) off[i + 1] = off[i] + cnt[(q0 + i) * G.S + s];
        const int64_t tot = off[nq];
        if (!tot) continue;
        if ((int64_t)buf.size() < tot * 8) buf.resize(tot * 8);
        float* acc = buf.data();
        std::memset(acc, 0, sizeof(float) * tot * 8);
        for (int64_t ob = 0; ob < G.O; ob += 8 * NV)
            for (int64_t kh = 0; kh < G.KH; ++kh)
                for (int64_t kw = 0; kw < G.KW; ++kw) {
                    const float* wb = wt + (kh * G.KW + kw) * G.C * G.O + ob;
                    for (int64_t i = 0; i < nq; ++i) {
                        const int len = (int)(off[i + 1] - off[i]);
                        if (!len) continue;
                        const int64_t q = q0 + i, wi = q % G.W, hi = (q / G.W) % G.H;
                        const int64_t th = hi + G.ph - kh * G.dh, tw = wi + G.pw - kw * G.dw;
                        if (th < 0 || tw < 0 || th % G.sh || tw % G.sw) continue;
                        const int64_t ho = th / G.sh, wo = tw / G.sw;
                        if (ho >= G.Ho || wo >= G.Wo) continue;
                        const float* gp = dy + ((n * G.Ho + ho) * G.Wo + wo) * G.O + ob;
                        __m256 g[NV];
                        for (int v = 0; v < NV; ++v) g[v] = _mm256_loadu_ps(gp + 8 * v);
                        const int32_t* ii = idx + q * G.C + s * G.CS;
                        float* ap = acc + off[i] * 8;
                        for (int j = 0; j < len; ++j) {
                            const float* w = wb + (int64_t)ii[j] * G.O;
                            __m256 t0 = _mm256_loadu_ps(ap + 8 * j), t1 = _mm256_setzero_ps();
                            int v = 0;
                            for (; v + 2 <= NV; v += 2) {
                                t0 = _mm256_fmadd_ps(g[v], _mm256_loadu_ps(w + 8 * v), t0);
                                t1 = _mm256_fmadd_ps(g[v + 1], _mm256_loadu_ps(w + 8 * v + 8), t1);
                            }
                            if (v < NV) t0 = _mm256_fmadd_ps(g[v], _mm256_loadu_ps(w + 8 * v), t0);
                            _mm256_storeu_ps(ap + 8 * j, _mm256_add_ps(t0, t1));
                        }
                    }
                }
        for (int64_t i = 0; i < nq; ++i) {
            const int64_t q = q0 + i, wi = q % G.W, hi = (q / G.W) % G.H;
            const int32_t* ii = idx + q * G.C + s * G.CS;
            float* base = da + n * das[0] + hi * das[2] + wi * das[3];
            for (int64_t j = off[i]; j < off[i + 1]; ++j) {
                const float* a = acc + 8 * j;
                __m128 lo = _mm_add_ps(_mm_loadu_ps(a), _mm_loadu_ps(a + 4));
                lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
                lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
                base[(int64_t)ii[j - off[i]] * das[1]] = _mm_cvtss_f32(lo);
            }
        }
    }
}

#define SPARSA_NV_SWITCH(NVV, CALL)                 \
    switch (NVV) {                                  \
        case 1: { constexpr int NV = 1; CALL; } break; \
        case 2: { constexpr int NV = 2; CALL; } break; \
        case 3: { constexpr int NV = 3; CALL; } break; \
        case 4: { constexpr int NV = 4; CALL; } break; \
        case 5: { constexpr int NV = 5; CALL; } break; \
        case 6: { constexpr int NV = 6; CALL; } break; \
        case 7: { constexpr int NV = 7; CALL; } break; \
        default: { constexpr int NV = 8; CALL; } break; \
    }

inline int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, (32 + width - 1) / width); }

}  // namespace

extern "C" {

// Forward from weights already packed by sparsa_adaptive_pack_weight_f32 (layout
// [O / OB][KH][KW][C][OB], OB = pick_ob(O); for a single block this is Wt itself).
int sparsa_adaptive_conv_fwd_packed_f32(const int64_t* g, const int32_t* cnt, const int32_t* idx,
                                        const float* val, const float* wp, const float* bias, float* y,
                                        int nthreads) {
    const Geo G(g);
    if (G.O % 8) return 1;
    const int64_t OB = pick_ob(G.O), nob = (G.O + OB - 1) / OB;
    const int64_t R = rows_per_task(G.Wo), nrb = (G.Ho + R - 1) / R;
    const int64_t ntask = G.N * nrb * nob;
    const bool use512 = OB % 16 == 0 && sparsa_cpu_avx512_enabled();
    (void)use512;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < ntask; ++t) {
        const int64_t obi = t % nob, rb = (t / nob) % nrb, n = t / (nob * nrb);
        const int64_t ob = obi * OB, nv = OB / 8;
        const int64_t r0 = rb * R, r1 = std::min(r0 + R, G.Ho);
        const float* wb = wp + obi * G.KH * G.KW * G.C * OB;
#ifdef SPARSA_ADAPTIVE_AVX512
        if (use512) {
            switch (OB / 16) {
                case 1: fwd_task512<1>(G, cnt, idx, val, wb, OB, bias, y, n, r0, r1, ob); break;
                case 2: fwd_task512<2>(G, cnt, idx, val, wb, OB, bias, y, n, r0, r1, ob); break;
                case 3: fwd_task512<3>(G, cnt, idx, val, wb, OB, bias, y, n, r0, r1, ob); break;
                default: fwd_task512<4>(G, cnt, idx, val, wb, OB, bias, y, n, r0, r1, ob); break;
            }
            continue;
        }
#endif
        SPARSA_NV_SWITCH(nv, (fwd_task<NV>(G, cnt, idx, val, wb, OB, bias, y, n, r0, r1, ob)))
    }
    return 0;
}

// Packs W [O, C, KH, KW] (contiguous, as nn.Conv2d stores it) once for all three kernels:
//   wf (may be null): forward layout [O / OB][KH][KW][C][OB], OB = pick_ob(O). Each (block, offset)
//       panel is contiguous, so it stays in L1 without cache-set conflicts.
//   wc (may be null): input-gradient layout [C][KH][KW][O] (the rows of one channel contiguous).
// ws: the element strides of W (any memory format).
int sparsa_adaptive_pack_weight_f32(const float* w, const int64_t* ws, int64_t O, int64_t C, int64_t KH,
                                    int64_t KW, float* wf, float* wc, int nthreads) {
    if (O % 8) return 1;
    const int64_t K2 = KH * KW, OB = pick_ob(O), nob = O / OB;
    const bool oihw = ws[0] == C * K2 && ws[1] == K2 && ws[2] == KW && ws[3] == 1;
    const bool ohwi = ws[0] == C * K2 && ws[1] == 1 && ws[2] == KW * C && ws[3] == C;
    if (wc && wf && (oihw || ohwi)) {
        // W is a row-major [O, C*K2] (or [O, K2*C]) matrix: one vectorised transpose, then row copies
        std::vector<float> tmp;
        float* T = oihw ? wc : (nob == 1 ? wf : (tmp.resize((size_t)O * C * K2), tmp.data()));
        sparsa_adaptive::transpose(w, O, C * K2, T, nthreads);
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t c = 0; c < C; ++c)
            for (int64_t k = 0; k < K2; ++k) {
                const float* row = T + (oihw ? c * K2 + k : k * C + c) * O;
                if (!oihw) std::memcpy(wc + (c * K2 + k) * O, row, sizeof(float) * O);
                if (oihw || nob > 1)
                    for (int64_t b = 0; b < nob; ++b)
                        std::memcpy(wf + ((b * K2 + k) * C + c) * OB, row + b * OB, sizeof(float) * OB);
            }
        return 0;
    }
    // Blocks of 16 output x 16 input channels through a small contiguous buffer: the destination rows
    // sit O*4 (wc) or OB*4 (wf) bytes apart, so writing them column-wise would thrash a few L1 sets.
    const int64_t BO = 16, BC = 16, nbo = (O + BO - 1) / BO, nbc = (C + BC - 1) / BC;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> tmp((size_t)BO * BC * K2);
        int64_t fo[BO];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nbo * nbc; ++t) {
            const int64_t o0 = (t / nbc) * BO, o1 = std::min(O, o0 + BO), no = o1 - o0;
            const int64_t c0 = (t % nbc) * BC, c1 = std::min(C, c0 + BC);
            for (int64_t o = o0; o < o1; ++o) {
                const int64_t bb = o / OB;
                fo[o - o0] = bb * K2 * C * OB + (o - bb * OB);
                for (int64_t c = c0; c < c1; ++c) {
                    const float* src = w + o * ws[0] + c * ws[1];
                    float* d = tmp.data() + ((o - o0) * BC + (c - c0)) * K2;
                    for (int64_t kh = 0; kh < KH; ++kh)
                        for (int64_t kw = 0; kw < KW; ++kw) d[kh * KW + kw] = src[kh * ws[2] + kw * ws[3]];
                }
            }
            for (int64_t c = c0; c < c1; ++c)
                for (int64_t k = 0; k < K2; ++k) {
                    const float* sp = tmp.data() + (c - c0) * K2 + k;
                    if (wc) {
                        float* d = wc + (c * K2 + k) * O + o0;
                        for (int64_t i = 0; i < no; ++i) d[i] = sp[i * BC * K2];
                    }
                    if (wf) {
                        float* d = wf + (k * C + c) * OB;
                        for (int64_t i = 0; i < no; ++i) d[fo[i]] = sp[i * BC * K2];
                    }
                }
        }
    }
    return 0;
}

// The forward pack of the flipped, transposed weight W'[c, o, i, j] = W[o, c, KH-1-i, KW-1-j] (the
// weight of the forward conv that computes the input gradient from dY), from the input-gradient pack
// wc [C][KH][KW][O] of sparsa_adaptive_pack_weight_f32: wfl [C / OB'][KH][KW][O][OB'], OB' = pick_ob(C),
// i.e. for each (channel block, kernel offset) an 8x8-tiled transpose of a [OB' x O] panel of wc.
int sparsa_adaptive_pack_flipped_f32(const float* wc, int64_t O, int64_t C, int64_t KH, int64_t KW, float* wfl,
                                     int nthreads) {
    if (O % 8 || C % 8) return 1;
    const int64_t K2 = KH * KW, OB = pick_ob(C), ncb = C / OB;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < ncb * K2; ++t) {
        const int64_t cb = t / K2, k = t % K2;
        const float* src = wc + ((cb * OB) * K2 + (K2 - 1 - k)) * O;  // rows cc (stride K2 * O), columns o
        float* dst = wfl + (cb * K2 + k) * O * OB;                     // rows o (stride OB), columns cc
        for (int64_t c8 = 0; c8 < OB; c8 += 8)
            for (int64_t o8 = 0; o8 < O; o8 += 8)
                sparsa_adaptive::tr8x8(src + c8 * K2 * O + o8, K2 * O, dst + o8 * OB + c8, OB);
    }
    return 0;
}

int sparsa_adaptive_conv_fwd_f32(const int64_t* g, const int32_t* cnt, const int32_t* idx,
                                 const float* val, const float* wt, const float* bias, float* y,
                                 int nthreads) {
    const Geo G(g);
    if (G.O % 8) return 1;
    const int64_t OB = pick_ob(G.O), nob = (G.O + OB - 1) / OB;
    if (nob == 1) return sparsa_adaptive_conv_fwd_packed_f32(g, cnt, idx, val, wt, bias, y, nthreads);
    // Weight blocks packed [ob block][KH][KW][C][OB] (see sparsa_adaptive_pack_weight_f32)
    const int64_t rows = G.KH * G.KW * G.C;
    std::vector<float> pack((size_t)rows * G.O);
#pragma omp parallel for num_threads(nthreads)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nob; ++b)
            std::memcpy(pack.data() + (b * rows + r) * OB, wt + r * G.O + b * OB, sizeof(float) * OB);
    return sparsa_adaptive_conv_fwd_packed_f32(g, cnt, idx, val, pack.data(), bias, y, nthreads);
}

// dwt [KH, KW, C, O] is overwritten. scratch: nthreads * 2 * |dwt| floats may be used internally.
int sparsa_adaptive_conv_wgrad_f32(const int64_t* g, const int32_t* cnt, const int32_t* idx,
                                   const float* val, const float* dy, float* dwt, int nthreads) {
    const Geo G(g);
    if (G.O % 8) return 1;
    const int64_t OB = pick_ob(G.O), nob = (G.O + OB - 1) / OB;
    const int64_t P = G.N * G.Ho * G.Wo;
    const int64_t blocks = G.S * nob;
    const int64_t wsize = G.KH * G.KW * G.C * G.O;
    int64_t split = 1;
    if (blocks < 4 * nthreads) split = std::min<int64_t>((4 * nthreads + blocks - 1) / blocks, std::max<int64_t>(1, P / 256));
    std::vector<float> part;
    if (split > 1) part.assign((size_t)(split - 1) * wsize, 0.f);
    std::memset(dwt, 0, sizeof(float) * wsize);
    const int64_t chunk = (P + split - 1) / split;
    const int64_t ntask = blocks * split;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < ntask; ++t) {
        const int64_t sp = t / blocks, b = t % blocks, s = b / nob, ob = (b % nob) * OB;
        const int64_t nv = std::min<int64_t>(OB, G.O - ob) / 8;
        float* dst = sp == 0 ? dwt : part.data() + (sp - 1) * wsize;
        const int64_t p0 = sp * chunk, p1 = std::min(P, p0 + chunk);
        SPARSA_NV_SWITCH(nv, (wgrad_task<NV>(G, cnt, idx, val, dy, dst, s, ob, p0, p1)))
    }
    if (split > 1) {
#pragma omp parallel for num_threads(nthreads)
        for (int64_t i = 0; i < wsize; ++i) {
            float acc = dwt[i];
            for (int64_t sp = 1; sp < split; ++sp) acc += part[(sp - 1) * wsize + i];
            dwt[i] = acc;
        }
    }
    return 0;
}

// da: zero-filled output with logical shape [N, C, H, W] and element strides das[4].
int sparsa_adaptive_conv_igrad_f32(const int64_t* g, const int32_t* cnt, const int32_t* idx,
                                   const float* dy, const float* wt, float* da, const int64_t* das,
                                   int nthreads) {
    const Geo G(g);
    if (G.O % 8) return 1;
    const int64_t OB = pick_ob(G.O);
    const int64_t R = rows_per_task(G.W), nrb = (G.H + R - 1) / R;
    const int64_t ntask = G.N * nrb;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> buf;
        std::vector<int64_t> off;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntask; ++t) {
            const int64_t rb = t % nrb, n = t / nrb;
            const int64_t r0 = rb * R, r1 = std::min(r0 + R, G.H);
            const int64_t nv = OB / 8;
            SPARSA_NV_SWITCH(nv, (igrad_task<NV>(G, cnt, idx, dy, wt, da, das, n, r0, r1, buf, off)))
        }
    }
    return 0;
}

}  // extern "C"
