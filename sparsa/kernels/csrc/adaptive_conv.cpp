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
// channels, NV (1..8) vectors at a time (O must be a multiple of 8).
//
// Geometry g[]: N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

namespace {

struct Geo {
    int64_t N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS, S;
    explicit Geo(const int64_t* g)
        : N(g[0]), C(g[1]), H(g[2]), W(g[3]), O(g[4]), KH(g[5]), KW(g[6]), Ho(g[7]), Wo(g[8]),
          sh(g[9]), sw(g[10]), ph(g[11]), pw(g[12]), dh(g[13]), dw(g[14]), CS(g[15]),
          S((g[1] + g[15] - 1) / g[15]) {}
};

// Output-channel block: the largest multiple of 8 up to 64 that divides O (O % 8 == 0).
inline int64_t pick_ob(int64_t O) {
    for (int64_t b = 64; b > 8; b -= 8)
        if (O % b == 0) return b;
    return 8;
}

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

int sparsa_adaptive_conv_fwd_f32(const int64_t* g, const int32_t* cnt, const int32_t* idx,
                                 const float* val, const float* wt, const float* bias, float* y,
                                 int nthreads) {
    const Geo G(g);
    if (G.O % 8) return 1;
    const int64_t OB = pick_ob(G.O), nob = (G.O + OB - 1) / OB;
    const int64_t R = rows_per_task(G.Wo), nrb = (G.Ho + R - 1) / R;
    const int64_t ntask = G.N * nrb * nob;
    // Weight blocks packed [ob block][KH][KW][C][OB]: a (slice, offset) block is contiguous, so it
    // stays in L1 without cache-set conflicts (rows of the unpacked Wt sit O*4 bytes apart).
    std::vector<float> pack;
    const float* wp = wt;
    if (nob > 1) {
        const int64_t rows = G.KH * G.KW * G.C;
        pack.resize((size_t)rows * G.O);
#pragma omp parallel for num_threads(nthreads)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t b = 0; b < nob; ++b)
                std::memcpy(pack.data() + (b * rows + r) * OB, wt + r * G.O + b * OB, sizeof(float) * OB);
        wp = pack.data();
    }
    const int64_t ldw = nob > 1 ? OB : G.O;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < ntask; ++t) {
        const int64_t obi = t % nob, rb = (t / nob) % nrb, n = t / (nob * nrb);
        const int64_t ob = obi * OB, nv = std::min<int64_t>(OB, G.O - ob) / 8;
        const int64_t r0 = rb * R, r1 = std::min(r0 + R, G.Ho);
        const float* wb = nob > 1 ? wp + obi * G.KH * G.KW * G.C * OB : wp + ob;
        SPARSA_NV_SWITCH(nv, (fwd_task<NV>(G, cnt, idx, val, wb, ldw, bias, y, n, r0, r1, ob)))
    }
    return 0;
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
