// Bitmask-operand ("union") kernels of the activation-sparse training runtime (AVX-512, run-time check).
//
// Operand: the activation kept dense in NHWC (relu(x) for the forward operand, dY itself for the
// output gradient) plus one bit per (pixel, channel) saying whether it is nonzero:
//   xa[q * C + c]                 value (zero where the bit is clear)
//   bm[q * NW + c / 64] bit c%64  nonzero flag, NW = ceil(C / 64), bits past C clear
// q = (n * H + h) * W + w.
//
// Every kernel works on groups of P = 4 output pixels at once (2x2 tiles, see Groups): for each kernel offset it ORs the four
// input pixels' masks and runs over the channels set in that union, so each weight row it loads feeds
// 4 pixels x OB/16 FMAs from registers (the per-nonzero list kernels of adaptive_conv.cpp load one
// weight row per pixel). Zeros inside the union cost a wasted FMA, but neighbouring pixels' ReLU
// zeros are correlated, so even at moderate sparsity the 4-pixel union skips a useful share of channels.
//
//   forward  y[p, ob..ob+OB) = bias + sum_{off, c in U} Wf[off, c, ob..] * x[q_i(p, off), c]
//   weight   S[row(c, off), ob..] = sum_{groups, c in U} sum_i x[q_i, c] * dy[p_i, ob..]
// The input gradient of a stride-1 conv is the forward of the flipped conv over dY's mask, stored
// through the ReLU mask of x (``omask``). OB = pick_ob(O) must be a multiple of 16.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <memory>
#include <omp.h>
#include <vector>

#include "adaptive_geo.h"
#include "adaptive_transpose.h"
#include "adaptive_union_groups.h"
#include "cpu_isa.h"

namespace {

using sparsa_adaptive::Geo;
using sparsa_adaptive::pick_ob;

using sparsa_adaptive::Groups;
constexpr int P = sparsa_adaptive::kUnionPixels;

inline int64_t words(int64_t C) { return sparsa_adaptive::mask_words(C); }

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_UNION_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi,popcnt")

// One pixel's C contiguous channels -> (optional) masked copy dst and mask words m; returns its nnz.
// RELU keeps x > 0 (NaN dropped, as relu's zero derivative), else x != 0 (NaN and +-inf kept).
template <bool RELU>
int64_t mask_pixel(const float* src, float* dst, uint64_t* m, int64_t C) {
    int64_t nnz = 0;
    const __m512 z = _mm512_setzero_ps();
    for (int64_t j = 0; j * 64 < C; ++j) {
        uint64_t word = 0;
        for (int k = 0; k < 4; ++k) {
            const int64_t c0 = j * 64 + 16 * k;
            if (c0 >= C) break;
            const __mmask16 lm = C - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (C - c0)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(lm, src + c0);
            const __mmask16 nz = (RELU ? _mm512_cmp_ps_mask(v, z, _CMP_GT_OQ) : _mm512_cmp_ps_mask(v, z, _CMP_NEQ_UQ)) & lm;
            if (dst) _mm512_mask_storeu_ps(dst + c0, lm, _mm512_maskz_mov_ps(nz, v));
            word |= (uint64_t)nz << (16 * k);
        }
        m[j] = word;
        nnz += __builtin_popcountll(word);
    }
    return nnz;
}

// y at the PP pixels of group g of image n, output channels [ob, ob + 16 V).
// Weight rows: wb + koff[kernel offset] + c * rs holds the 16 V output channels of input channel c (the
// forward pack: koff[k] = k * C * OB, rs = OB; or a channels-last weight read in place, see
// sparsa_union_conv_igrad_w_f32).
template <int V, int PP>
void fwd_group(const Geo& G, const Groups& GR, const float* xa, const uint64_t* bm, const float* zero,
               const uint64_t* zm, const float* wb, const int64_t* koff, int64_t rs, const float* bias, float* y,
               int64_t n, int64_t g, int64_t ob, const uint64_t* omask) {
    const int64_t NW = words(G.C), HW = G.Ho * G.Wo;
    __m512 acc[PP][V];
    for (int i = 0; i < PP; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = bias ? _mm512_loadu_ps(bias + ob + 16 * v) : _mm512_setzero_ps();
    int64_t ho[PP], wo[PP];
    bool ok[PP];
    for (int i = 0; i < PP; ++i) ok[i] = GR.member(g, i, ho[i], wo[i]);
    for (int64_t kh = 0; kh < G.KH; ++kh)
        for (int64_t kw = 0; kw < G.KW; ++kw) {
            const float* xr[PP];
            const uint64_t* mr[PP];
            if (!sparsa_adaptive::offset_rows<float, PP>(G, ho, wo, ok, n, kh, kw, xa, bm, zero, zm, xr, mr)) continue;
            const float* w0 = wb + koff[kh * G.KW + kw];
            for (int64_t j = 0; j < NW; ++j) {
                uint64_t m = 0;
                for (int i = 0; i < PP; ++i) m |= mr[i][j];
                while (m) {
                    const int64_t c = j * 64 + __builtin_ctzll(m);
                    m &= m - 1;
                    const float* wr = w0 + c * rs;
                    __m512 w[V];
                    for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_ps(wr + 16 * v);
                    for (int i = 0; i < PP; ++i) {
                        const __m512 b = _mm512_set1_ps(xr[i][c]);
                        for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(b, w[v], acc[i][v]);
                    }
                }
            }
        }
    const int64_t NWo = words(G.O);
    for (int i = 0; i < PP; ++i) {
        if (!ok[i]) continue;
        const int64_t p = n * HW + ho[i] * G.Wo + wo[i];
        float* yp = y + p * G.O + ob;
        for (int v = 0; v < V; ++v) {
            if (omask) {
                const int64_t c = ob + 16 * v;
                const __mmask16 k = (__mmask16)(omask[p * NWo + c / 64] >> (c % 64));
                _mm512_storeu_ps(yp + 16 * v, _mm512_maskz_mov_ps(k, acc[i][v]));
            } else {
                _mm512_storeu_ps(yp + 16 * v, acc[i][v]);
            }
        }
    }
}

template <int PP>
void fwd_group_v(int64_t V, const Geo& G, const Groups& GR, const float* xa, const uint64_t* bm, const float* zero,
                 const uint64_t* zm, const float* wb, const int64_t* koff, int64_t rs, const float* bias, float* y,
                 int64_t n, int64_t g, int64_t ob, const uint64_t* omask) {
    switch (V) {
        case 1: fwd_group<1, PP>(G, GR, xa, bm, zero, zm, wb, koff, rs, bias, y, n, g, ob, omask); break;
        case 2: fwd_group<2, PP>(G, GR, xa, bm, zero, zm, wb, koff, rs, bias, y, n, g, ob, omask); break;
        case 3: fwd_group<3, PP>(G, GR, xa, bm, zero, zm, wb, koff, rs, bias, y, n, g, ob, omask); break;
        default: fwd_group<4, PP>(G, GR, xa, bm, zero, zm, wb, koff, rs, bias, y, n, g, ob, omask); break;
    }
}

void fwd_group_any(int64_t V, const Geo& G, const Groups& GR, const float* xa, const uint64_t* bm, const float* zero,
                   const uint64_t* zm, const float* wb, const int64_t* koff, int64_t rs, const float* bias, float* y,
                   int64_t n, int64_t g, int64_t ob, const uint64_t* omask) {
    switch (GR.pg) {
        case 1: fwd_group_v<1>(V, G, GR, xa, bm, zero, zm, wb, koff, rs, bias, y, n, g, ob, omask); break;
        case 2: fwd_group_v<2>(V, G, GR, xa, bm, zero, zm, wb, koff, rs, bias, y, n, g, ob, omask); break;
        default: fwd_group_v<4>(V, G, GR, xa, bm, zero, zm, wb, koff, rs, bias, y, n, g, ob, omask); break;
    }
}

// Block blk[c - 64 j][0..OB) (channels of mask word j, output channels ob..) of the weight gradient at
// kernel offset (kh, kw), summed over the pixel groups [g0, g1) (numbered image by image).
template <int V>
void wgrad_block(const Geo& G, const Groups& GR, const float* xa, const uint64_t* bm, const float* zero,
                 const float* dy, float* blk, int64_t OB, int64_t kh, int64_t kw, int64_t j, int64_t ob, int64_t g0,
                 int64_t g1) {
    const int64_t NW = words(G.C), HW = G.Ho * G.Wo;
    std::memset(blk, 0, sizeof(float) * std::min<int64_t>(64, G.C - j * 64) * OB);
    float* b0 = blk - j * 64 * OB;  // indexed by absolute channel
    int64_t n = g0 / GR.per_image, g = g0 - n * GR.per_image;
    for (int64_t gg = g0; gg < g1; ++gg) {
        __m512 d[P][V];
        const float* xr[P];
        uint64_t m = 0;
        for (int i = 0; i < P; ++i) {
            xr[i] = zero;
            int64_t ho, wo;
            if (!GR.member(g, i, ho, wo)) {
                for (int v = 0; v < V; ++v) d[i][v] = _mm512_setzero_ps();
                continue;
            }
            const float* dr = dy + (n * HW + ho * G.Wo + wo) * G.O + ob;
            for (int v = 0; v < V; ++v) d[i][v] = _mm512_loadu_ps(dr + 16 * v);
            const int64_t hi = ho * G.sh - G.ph + kh * G.dh, wi = wo * G.sw - G.pw + kw * G.dw;
            if (hi >= 0 && hi < G.H && wi >= 0 && wi < G.W) {
                const int64_t q = (n * G.H + hi) * G.W + wi;
                xr[i] = xa + q * G.C;
                m |= bm[q * NW + j];
            }
        }
        if (++g == GR.per_image) g = 0, ++n;
        while (m) {
            const int64_t c = j * 64 + __builtin_ctzll(m);
            m &= m - 1;
            __m512 b[P];
            for (int i = 0; i < P; ++i) b[i] = _mm512_set1_ps(xr[i][c]);
            float* r = b0 + c * OB;
            for (int v = 0; v < V; ++v) {
                __m512 a = _mm512_loadu_ps(r + 16 * v);
                for (int i = 0; i < P; ++i) a = _mm512_fmadd_ps(b[i], d[i][v], a);
                _mm512_storeu_ps(r + 16 * v, a);
            }
        }
    }
}

void wgrad_block_any(int64_t V, const Geo& G, const Groups& GR, const float* xa, const uint64_t* bm, const float* zero,
                     const float* dy, float* blk, int64_t OB, int64_t kh, int64_t kw, int64_t j, int64_t ob, int64_t g0,
                     int64_t g1) {
    switch (V) {
        case 1: wgrad_block<1>(G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1); break;
        case 2: wgrad_block<2>(G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1); break;
        case 3: wgrad_block<3>(G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1); break;
        default: wgrad_block<4>(G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1); break;
    }
}

// y = the union forward over (xa, bm) with weight rows wp + obi * bstride + koff[k] + c * rs (output block obi).
int fwd_run(const Geo& G, const float* xa, const uint64_t* bm, const float* wp, int64_t bstride, const int64_t* koff,
            int64_t rs, const float* bias, float* y, const uint64_t* omask, int tiles, int group, int nthreads) {
    const int64_t OB = pick_ob(G.O);
    const Groups GR(G, tiles != 0, group);
    const int64_t nob = G.O / OB, ng = GR.per_image;
    // about 32 pixels a task, fewer when that leaves under 8 tasks a thread
    const int64_t most = 32 / group;
    int64_t gpt = std::max<int64_t>(1, std::min<int64_t>(most, G.N * ng * nob / (8 * nthreads)));
    const int64_t ngt = (ng + gpt - 1) / gpt, ntask = nob * G.N * ngt;
    std::vector<float> zero((size_t)G.C + 16, 0.f);
    std::vector<uint64_t> zm((size_t)words(G.C), 0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < ntask; ++t) {
        // output-channel block outermost: a thread keeps one weight block hot in L2
        const int64_t obi = t / (G.N * ngt), n = (t / ngt) % G.N, gt = t % ngt;
        const float* wb = wp + obi * bstride;
        for (int64_t gi = gt * gpt; gi < std::min(ng, gt * gpt + gpt); ++gi)
            fwd_group_any(OB / 16, G, GR, xa, bm, zero.data(), zm.data(), wb, koff, rs, bias, y, n, gi, obi * OB, omask);
    }
    return 0;
}

#pragma GCC pop_options
#endif

}  // namespace

extern "C" {

// 1 when this CPU runs the union kernels (AVX-512 F/VL/DQ/BW and SPARSA_NO_AVX512 unset).
int sparsa_union_supported() {
#ifdef SPARSA_UNION_AVX512
    return sparsa_cpu_avx512_enabled() ? 1 : 0;
#else
    return 0;
#endif
}

// The operand of x (logical [N, C, H, W], element strides sn, sc, sh, sw): relu != 0 keeps x > 0
// (xa = relu(x)), relu == 0 keeps x != 0. xa (NHWC, or null for the masks alone) receives the kept
// values; bm the masks. union4 (may be null) receives how
// clustered the zeros are: the sum over runs of 4 consecutive pixels of each image (rows flattened, the
// last run shorter) of the number of channels nonzero in any of them -- the work of the 4-pixel kernels
// in units of one FMA row. Returns the number of nonzeros, or -1 when the CPU lacks AVX-512.
int64_t sparsa_union_compact_f32(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t sn,
                                 int64_t sc, int64_t sh, int64_t sw, int relu, float* xa, uint64_t* bm,
                                 int64_t* union4, int nthreads) {
    if (!sparsa_union_supported()) return -1;
#ifdef SPARSA_UNION_AVX512
    const int64_t NW = words(C), rows = N * H;
    int64_t total = 0, uni = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total, uni)
    {
        std::vector<float> buf(sc == 1 ? 0 : (size_t)W * C);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = r / H, h = r % H;
            const float* base = x + n * sn + h * sh;
            if (sc != 1) {  // gather the row to NHWC first (8x8 transposes where the pixels are contiguous)
                int64_t w0 = 0;
                if (sw == 1)
                    for (; w0 + 8 <= W; w0 += 8) {
                        int64_t c = 0;
                        for (; c + 8 <= C; c += 8) sparsa_adaptive::tr8x8(base + c * sc + w0, sc, buf.data() + w0 * C + c, C);
                        for (; c < C; ++c)
                            for (int64_t w = w0; w < w0 + 8; ++w) buf[w * C + c] = base[c * sc + w];
                    }
                for (int64_t w = w0; w < W; ++w)
                    for (int64_t c = 0; c < C; ++c) buf[w * C + c] = base[c * sc + w * sw];
            }
            for (int64_t w = 0; w < W; ++w) {
                const int64_t q = r * W + w;
                const float* src = sc == 1 ? base + w * sw : buf.data() + w * C;
                float* dst = xa ? xa + q * C : nullptr;
                total += relu ? mask_pixel<true>(src, dst, bm + q * NW, C) : mask_pixel<false>(src, dst, bm + q * NW, C);
            }
        }
        if (union4) uni += sparsa_adaptive::union4_share(bm, N, H * W, NW);
    }
    if (union4) *union4 = uni;
    return total;
#else
    return -1;
#endif
}

// y [N, Ho, Wo, O] (NHWC) = conv(xa, W) + bias from the forward pack wp [O / OB][KH][KW][C][OB]
// (sparsa_adaptive_pack_weight_f32). omask (may be null): output masks [N*Ho*Wo, ceil(O/64)]; outputs
// whose bit is clear are stored as zero. tiles: allow 2x2 pixel groups (see Groups; pass 1 for relu(x)'s
// operand, 0 for dY's). group: pixels per group, 4, 2 or 1 (fewer pixels: less work on channels that are
// zero in some of them, fewer FMAs per weight row loaded). Returns 1 if OB = pick_ob(O) is not a multiple
// of 16 or group is not 1, 2 or 4, 2 without AVX-512.
int sparsa_union_conv_fwd_f32(const int64_t* g, const float* xa, const uint64_t* bm, const float* wp,
                              const float* bias, float* y, const uint64_t* omask, int tiles, int group, int nthreads) {
    const Geo G(g);
    const int64_t OB = pick_ob(G.O), K2 = G.KH * G.KW;
    if (G.O % 8 || OB % 16 || (group != 1 && group != 2 && group != 4)) return 1;
    if (!sparsa_union_supported()) return 2;
    std::vector<int64_t> koff((size_t)K2);
    for (int64_t k = 0; k < K2; ++k) koff[k] = k * G.C * OB;
#ifdef SPARSA_UNION_AVX512
    return fwd_run(G, xa, bm, wp, K2 * G.C * OB, koff.data(), OB, bias, y, omask, tiles, group, nthreads);
#else
    return 2;
#endif
}

// The input gradient of a stride-1 conv (geometry g2 = the flipped conv's: C = the conv's O, O = its C) as
// sparsa_union_conv_fwd_f32 over dY's operand, reading the conv's weight W [O, C, KH, KW] in place instead of
// a flipped pack: with element strides ws and ws[1] == 1 (channels-last), the flipped conv's row for input
// channel o at offset (kh, kw) is W[o, c.., KH-1-kh, KW-1-kw], contiguous over c. Saves building the pack
// each step. Returns 1 for a bad geometry, group or stride, 2 without AVX-512.
int sparsa_union_conv_igrad_w_f32(const int64_t* g2, const float* xa, const uint64_t* bm, const float* w,
                                  const int64_t* ws, float* y, const uint64_t* omask, int group, int nthreads) {
    const Geo G(g2);
    const int64_t OB = pick_ob(G.O), K2 = G.KH * G.KW;
    if (G.O % 8 || OB % 16 || ws[1] != 1 || (group != 1 && group != 2 && group != 4)) return 1;
    if (!sparsa_union_supported()) return 2;
    std::vector<int64_t> koff((size_t)K2);
    for (int64_t k = 0; k < K2; ++k) koff[k] = (G.KH - 1 - k / G.KW) * ws[2] + (G.KW - 1 - k % G.KW) * ws[3];
#ifdef SPARSA_UNION_AVX512
    return fwd_run(G, xa, bm, w, OB, koff.data(), ws[0], nullptr, y, omask, 0, group, nthreads);
#else
    return 2;
#endif
}

// Weight gradient: for every (c, kh, kw) the row S[(base + c*rs[0] + kh*rs[1] + kw*rs[2]) * ldS + o],
// o < O, is overwritten with sum_p x[q(p, kh, kw), c] * dy[p, o] (dy: [N*Ho*Wo, O] contiguous), so the
// caller picks the row order (and with it the layout S, or a transpose of it, ends in).
int sparsa_union_conv_wgrad_f32(const int64_t* g, const float* xa, const uint64_t* bm, const float* dy, float* S,
                                const int64_t* rs, int64_t ldS, int tiles, int nthreads) {
    const Geo G(g);
    const int64_t OB = pick_ob(G.O);
    if (G.O % 8 || OB % 16) return 1;
    if (!sparsa_union_supported()) return 2;
#ifdef SPARSA_UNION_AVX512
    sparsa_adaptive::wgrad_run<float>(G, S, rs, ldS, tiles, nthreads,
                                      [&](const Groups& GR, const float* zero, float* blk, int64_t kh, int64_t kw,
                                          int64_t j, int64_t ob, int64_t g0, int64_t g1) {
                                          wgrad_block_any(OB / 16, G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1);
                                      });
    return 0;
#else
    return 2;
#endif
}

// The two weight packs the union path needs, straight from W [O, C, KH, KW] (element strides ws, any
// layout), once per weight version:
//   wf  [O / OB][KH][KW][C][OB], OB = pick_ob(O): the forward pack (as sparsa_adaptive_pack_weight_f32);
//   wfl [C / OB'][KH][KW][O][OB'], OB' = pick_ob(C): the forward pack of the flipped, transposed weight
//       W'[c, o, i, j] = W[o, c, KH-1-i, KW-1-j] (the input gradient's conv), as sparsa_adaptive_pack_flipped_f32.
// For channels-last weights (ws[1] == 1) wfl is made of contiguous row copies and wf of 8x8 transposes,
// and no [C][KH][KW][O] intermediate is built.
int sparsa_union_pack_f32(const float* w, const int64_t* ws, int64_t O, int64_t C, int64_t KH, int64_t KW, float* wf,
                          float* wfl, int nthreads) {
    if (O % 8 || C % 8) return 1;
    const int64_t K2 = KH * KW, OB = pick_ob(O), nob = O / OB, OB2 = pick_ob(C), ncb = C / OB2;
    const bool cl = ws[1] == 1;
    if (!cl && ws[0] == C * K2 && ws[1] == K2 && ws[2] == KW && ws[3] == 1) {
        // OIHW (nn.Conv2d's default): one tiled transpose to T [C][KH*KW][O], then wf by row copies and wfl by
        // 8x8 transposes of T's panels (cheaper than a strided gather per element)
        std::unique_ptr<float[]> T(new float[(size_t)O * C * K2]);
        sparsa_adaptive::transpose(w, O, C * K2, T.get(), nthreads);
#pragma omp parallel num_threads(nthreads)
        {
            if (wf) {
#pragma omp for schedule(static) nowait
                for (int64_t t = 0; t < nob * K2; ++t) {
                    const int64_t b = t / K2, k = t % K2;
                    float* dst = wf + (b * K2 + k) * C * OB;
                    for (int64_t c = 0; c < C; ++c) std::memcpy(dst + c * OB, T.get() + (c * K2 + k) * O + b * OB, sizeof(float) * OB);
                }
            }
            if (wfl) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < ncb * K2; ++t) {
                    const int64_t cb = t / K2, k = t % K2, kf = K2 - 1 - k;
                    const float* src = T.get() + (cb * OB2 * K2 + kf) * O;  // rows cc (stride K2 * O), columns o
                    float* dst = wfl + (cb * K2 + k) * O * OB2;              // rows o (OB2), columns cc
                    for (int64_t c8 = 0; c8 < OB2; c8 += 8)
                        for (int64_t o8 = 0; o8 < O; o8 += 8)
                            sparsa_adaptive::tr8x8(src + c8 * K2 * O + o8, K2 * O, dst + o8 * OB2 + c8, OB2);
                }
            }
        }
        return 0;
    }
#pragma omp parallel num_threads(nthreads)
    {
        if (wf) {
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < nob * K2; ++t) {
                const int64_t b = t / K2, k = t % K2, kh = k / KW, kw = k % KW;
                const float* src = w + b * OB * ws[0] + kh * ws[2] + kw * ws[3];  // rows o (ws[0]), columns c (ws[1])
                float* dst = wf + (b * K2 + k) * C * OB;                            // rows c (OB), columns o
                if (cl) {
                    for (int64_t o8 = 0; o8 < OB; o8 += 8)
                        for (int64_t c8 = 0; c8 < C; c8 += 8) sparsa_adaptive::tr8x8(src + o8 * ws[0] + c8, ws[0], dst + c8 * OB + o8, OB);
                } else {
                    for (int64_t c = 0; c < C; ++c)
                        for (int64_t o = 0; o < OB; ++o) dst[c * OB + o] = src[o * ws[0] + c * ws[1]];
                }
            }
        }
        if (wfl) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < ncb * K2; ++t) {
                const int64_t cb = t / K2, k = t % K2, kh = KH - 1 - k / KW, kw = KW - 1 - k % KW;
                const float* src = w + cb * OB2 * ws[1] + kh * ws[2] + kw * ws[3];  // rows o (ws[0]), columns c (ws[1])
                float* dst = wfl + (cb * K2 + k) * O * OB2;                          // rows o (OB2), columns c
                if (cl) {
                    for (int64_t o = 0; o < O; ++o) std::memcpy(dst + o * OB2, src + o * ws[0], sizeof(float) * OB2);
                } else if (ws[0] == 1) {
                    for (int64_t c = 0; c < OB2; ++c)
                        for (int64_t o = 0; o < O; ++o) dst[o * OB2 + c] = src[o + c * ws[1]];
                } else {
                    for (int64_t c8 = 0; c8 < OB2; c8 += 8)
                        for (int64_t o8 = 0; o8 < O; o8 += 8) {
                            // 8x8 tile: rows c (stride ws[1]) x columns o (stride ws[0]) -> rows o, columns c
                            for (int64_t o = o8; o < o8 + 8; ++o)
                                for (int64_t c = c8; c < c8 + 8; ++c) dst[o * OB2 + c] = src[o * ws[0] + c * ws[1]];
                        }
                }
            }
        }
    }
    return 0;
}

// The list kernels' input-gradient pack wc [C][KH*KW][O] (sparsa_adaptive_pack_weight_f32's) from the forward
// pack wf [O / OB][KH*KW][C][OB], OB = pick_ob(O): row copies of OB floats. Taken from the pack the forward
// used, so it holds the forward's weight even when an optimizer step came in between.
void sparsa_union_wc_from_wf_f32(const float* wf, int64_t O, int64_t C, int64_t K2, float* wc, int nthreads) {
    const int64_t OB = pick_ob(O), nob = O / OB;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < C; ++c)
        for (int64_t k = 0; k < K2; ++k)
            for (int64_t b = 0; b < nob; ++b)
                std::memcpy(wc + (c * K2 + k) * O + b * OB, wf + ((b * K2 + k) * C + c) * OB, sizeof(float) * OB);
}

// T [M x R] = A [R x M]^T (both contiguous).
void sparsa_union_transpose_f32(const float* A, int64_t R, int64_t M, float* T, int nthreads) {
    sparsa_adaptive::transpose(A, R, M, T, nthreads);
}

// B independent transposes: T[b] [M x R] = A[b] [R x M]^T (each contiguous, batches back to back).
void sparsa_union_transpose_batched_f32(const float* A, int64_t B, int64_t R, int64_t M, float* T, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < B; ++b) sparsa_adaptive::transpose_rows(A + b * R * M, R, M, T + b * R * M, 0, R);
}

}  // extern "C"
