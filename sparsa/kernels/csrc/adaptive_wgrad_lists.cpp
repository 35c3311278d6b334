// Weight gradient of conv2d(relu(x), W) over per-channel pixel lists of relu(x) (AVX-512, run-time check).
//
//   dW[o, c, kh, kw] = sum_{q : x[q, c] != 0} x[q, c] * dy[p(q, kh, kw), o]
//
// The union operand (adaptive_union.cpp: relu(x) dense in NHWC plus one bit per element) is turned into one
// list per (image, channel) of the channel's nonzero pixels (position, value). For one channel c, a run of
// kernel offsets (KC <= 9) and a block of 16 V output channels, the KC x V accumulators of dW[ob.., c, k]
// stay in registers while the kernel walks c's lists: every nonzero costs one broadcast and KC x V
// (load dy row, FMA) pairs, so the work follows nnz(relu(x)) exactly. The union kernels instead pay for
// every channel set in any of 4 pixels (about 2.4x nnz at 90% zeros on VGG-16 activations) and the list
// kernels of adaptive_bwd_s1.cpp load and store a dW row per nonzero.
//
// Threads own disjoint channel ranges (balanced by nnz), so no reduction is needed. Images are walked in
// chunks whose dy slice (the block's 16 V columns) fits in L2; the accumulators are stored back to S after
// each chunk and reloaded for the next.
//
// Output rows as sparsa_union_conv_wgrad_f32: S[(rs[3] + c*rs[0] + kh*rs[1] + kw*rs[2]) * ldS + o].
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <memory>
#include <omp.h>
#include <vector>

#include "adaptive_geo.h"
#include "cpu_isa.h"

namespace {

using sparsa_adaptive::Geo;

struct Entry {
    int32_t pos;  // pixel within its image, h * W + w
    float v;      // relu(x) there
};

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_WLISTS_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,bmi,popcnt")

// Accumulate the lists of channel c over images [n0, n1) into the KC x V block whose rows are rows[k]
// (already offset to the block's first output channel); first: start from zero instead of the rows.
template <int V, int KC>
void channel_block(const float* dy, int64_t O, int64_t HWo, const int32_t* tab, int64_t K2, int64_t k0,
                   const Entry* ent, const int64_t* beg, const int32_t* len, int64_t C, int64_t c, int64_t n0,
                   int64_t n1, int64_t ob, const float* zero, float* const* rows, bool first) {
    __m512 acc[KC][V];
    for (int k = 0; k < KC; ++k)
        for (int v = 0; v < V; ++v) acc[k][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(rows[k] + 16 * v);
    for (int64_t n = n0; n < n1; ++n) {
        const int64_t l = n * C + c;
        const Entry* e = ent + beg[l];
        const Entry* end = e + len[l];
        const float* dyn = dy + n * HWo * O + ob;
        for (; e < end; ++e) {
            const __m512 b = _mm512_set1_ps(e->v);
            const int32_t* t = tab + (int64_t)e->pos * K2 + k0;
            for (int k = 0; k < KC; ++k) {
                const int32_t p = t[k];
                const float* r = p >= 0 ? dyn + (int64_t)p * O : zero;
                for (int v = 0; v < V; ++v) acc[k][v] = _mm512_fmadd_ps(b, _mm512_loadu_ps(r + 16 * v), acc[k][v]);
            }
        }
    }
    for (int k = 0; k < KC; ++k)
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(rows[k] + 16 * v, acc[k][v]);
}

using BlockFn = void (*)(const float*, int64_t, int64_t, const int32_t*, int64_t, int64_t, const Entry*,
                         const int64_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                         float* const*, bool);

template <int V>
BlockFn pick_kc(int kc) {
    switch (kc) {
        case 1: return channel_block<V, 1>;
        case 2: return channel_block<V, 2>;
        case 3: return channel_block<V, 3>;
        case 4: return channel_block<V, 4>;
        case 5: return channel_block<V, 5>;
        case 6: return channel_block<V, 6>;
        case 7: return channel_block<V, 7>;
        case 8: return channel_block<V, 8>;
        default: return channel_block<V, 9>;
    }
}

BlockFn pick(int v, int kc) {
    switch (v) {
        case 1: return pick_kc<1>(kc);
        case 2: return pick_kc<2>(kc);
        case 3: return pick_kc<3>(kc);
        default: return pick_kc<4>(kc);
    }
}

#pragma GCC pop_options
#endif

}  // namespace

extern "C" {

// dW rows S (see the header) from relu(x)'s union operand (xa [N*H*W, C] values, bm [N*H*W, ceil(C/64)]
// masks) and dy [N*Ho*Wo, O] contiguous; any stride, padding and dilation. Returns 1 when O is not a
// multiple of 16, 2 without AVX-512.
int sparsa_union_conv_wgrad_lists_f32(const int64_t* g, const float* xa, const uint64_t* bm, const float* dy, float* S,
                                      const int64_t* rs, int64_t ldS, int nthreads) {
    const Geo G(g);
    if (G.O % 16) return 1;
    if (!sparsa_cpu_avx512_enabled()) return 2;
#ifdef SPARSA_WLISTS_AVX512
    const int64_t N = G.N, C = G.C, HW = G.H * G.W, HWo = G.Ho * G.Wo, K2 = G.KH * G.KW, NW = (C + 63) / 64;
    // tab[pos * K2 + k]: the output pixel (within the image) that input pixel pos meets at kernel offset k, or -1
    std::vector<int32_t> tab((size_t)HW * K2);
    for (int64_t pos = 0; pos < HW; ++pos) {
        const int64_t hi = pos / G.W, wi = pos % G.W;
        for (int64_t k = 0; k < K2; ++k) {
            const int64_t th = hi + G.ph - (k / G.KW) * G.dh, tw = wi + G.pw - (k % G.KW) * G.dw;
            int32_t p = -1;
            if (th >= 0 && tw >= 0 && th % G.sh == 0 && tw % G.sw == 0 && th / G.sh < G.Ho && tw / G.sw < G.Wo)
                p = (int32_t)((th / G.sh) * G.Wo + tw / G.sw);
            tab[pos * K2 + k] = p;
        }
    }
    // lists per (image, channel): room for HW entries each (no counting pass); len filled below
    std::unique_ptr<Entry[]> ent(new Entry[(size_t)N * C * HW]);
    std::vector<int64_t> beg((size_t)N * C);
    std::vector<int32_t> len((size_t)N * C, 0);
    for (int64_t l = 0; l < N * C; ++l) beg[l] = l * HW;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; ++n) {
        int32_t* ln = len.data() + n * C;
        Entry* en = ent.get() + n * C * HW;
        for (int64_t pos = 0; pos < HW; ++pos) {
            const int64_t q = n * HW + pos;
            const float* xv = xa + q * C;
            for (int64_t j = 0; j < NW; ++j) {
                uint64_t m = bm[q * NW + j];
                while (m) {
                    const int64_t c = j * 64 + __builtin_ctzll(m);
                    m &= m - 1;
                    en[c * HW + ln[c]++] = Entry{(int32_t)pos, xv[c]};
                }
            }
        }
    }
    // channel ranges per thread, balanced by nonzeros (plus a little per channel for the block overheads)
    std::vector<int64_t> cw((size_t)C, 0);
    for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) cw[c] += len[n * C + c];
    int64_t total = 0;
    for (int64_t c = 0; c < C; ++c) total += (cw[c] += N);
    const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, C));
    std::vector<int64_t> cut((size_t)nt + 1, C);
    cut[0] = 0;
    {
        int64_t acc = 0, t = 1;
        for (int64_t c = 0; c < C && t < nt; ++c) {
            acc += cw[c];
            while (t < nt && acc * nt >= total * t) cut[t++] = c + 1;
        }
    }
    std::vector<float> zero(64, 0.f);
    const int64_t nv = G.O / 16;
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num();
        const int64_t c0 = cut[tid], c1 = cut[tid + 1];
        float* rows[9];
        for (int64_t k0 = 0; k0 < K2; k0 += 9) {
            const int kc = (int)std::min<int64_t>(9, K2 - k0);
            const int vmax = kc <= 6 ? 4 : 2;  // at most 24 accumulators
            for (int64_t v0 = 0; v0 < nv; v0 += vmax) {
                const int V = (int)std::min<int64_t>(vmax, nv - v0);
                const BlockFn fn = pick(V, kc);
                const int64_t ob = v0 * 16;
                // images per chunk: the block's dy columns of the chunk within ~256 KB
                const int64_t per = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, HWo * V * 64));
                for (int64_t n0 = 0; n0 < N; n0 += per) {
                    const int64_t n1 = std::min(N, n0 + per);
                    for (int64_t c = c0; c < c1; ++c) {
                        for (int k = 0; k < kc; ++k) {
                            const int64_t kk = k0 + k;
                            rows[k] = S + (rs[3] + c * rs[0] + (kk / G.KW) * rs[1] + (kk % G.KW) * rs[2]) * ldS + ob;
                        }
                        fn(dy, G.O, HWo, tab.data(), K2, k0, ent.get(), beg.data(), len.data(), C, c, n0, n1, ob,
                           zero.data(), rows, n0 == 0);
                    }
                }
            }
        }
    }
    return 0;
#else
    return 2;
#endif
}

}  // extern "C"
