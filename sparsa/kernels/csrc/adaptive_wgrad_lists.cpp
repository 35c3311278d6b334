// Weight gradient of conv2d(relu(x), W) over per-channel pixel lists of relu(x) (AVX-512, run-time check).
//
//   dW[o, c, kh, kw] = sum_{q : x[q, c] != 0} x[q, c] * dy[p(q, kh, kw), o]
//
// The union operand (adaptive_union.cpp: relu(x) dense in NHWC plus one bit per element) is turned into one
// list per (image, channel) of the channel's nonzero pixels (position, value). For one channel c, a run of
// kernel offsets (KC <= 9) and a block of 16 V output channels, the KC x V accumulators of dW[ob.., c, k]
// stay in registers while the kernel walks c's lists: every nonzero costs one broadcast and KC x V
// (load dy row, FMA) pairs, so the work follows nnz(relu(x)) exactly. The union kernels instead pay for
// every channel set in any of 4 pixels (well above nnz on very sparse activations) and the list
// kernels of adaptive_bwd_s1.cpp load and store a dW row per nonzero.
//
// Threads own disjoint channel ranges (balanced by nnz, cut at multiples of 16 channels), so no reduction is
// needed. Images are walked in chunks whose dy slice (the block's 16 V columns) fits in L2; the accumulators
// are stored to a per-thread staging block [channel][offset][16 V] after each chunk (and reloaded for the
// next). Once a block of output channels is done, the staging block (L2-resident: 295 KB for 256 channels x
// 9 offsets x 32 outputs) is transposed straight into dW's own layout with 8x8 tiles, so no [C*KH*KW, O]
// intermediate is written and transposed again (512x512x3x3: 9.4 MB less written and read per call).
//
// The bf16 entry (sparsa_union_conv_wgrad_lists_bf16) takes bf16 values and dy rows, widened as they are read
// (entries at list building, dy rows per load), so bf16 operands need no fp32 copies; it accumulates in fp32.
// The same kernel computes dW over per-channel lists of dY's nonzeros: called on the flipped conv (dY in the
// place of relu(x), relu(x) in the place of dy; conv_union.py) with output strides that transpose and flip.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <memory>
#include <omp.h>
#include <vector>

#include "adaptive_geo.h"
#include "adaptive_transpose.h"
#include "bf16.h"
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

// 16 dy values as floats: fp32 rows are loaded, bf16 rows widened (a 16-bit shift)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline float value_of(float v) { return v; }
inline float value_of(uint16_t v) { return sparsa_bf16_to_f32(v); }

// Accumulate the lists of channel c over images [n0, n1) into the KC x V block whose rows are rows[k]
// (already offset to the block's first output channel); first: start from zero instead of the rows. List
// l = n * C + c holds len[l] entries from ent + l * HW.
template <typename T, int V, int KC>
void channel_block(const T* dy, int64_t O, int64_t HWo, const int32_t* tab, int64_t K2, int64_t k0,
                   const Entry* ent, int64_t HW, const int32_t* len, int64_t C, int64_t c, int64_t n0,
                   int64_t n1, int64_t ob, const T* zero, float* const* rows, bool first) {
    __m512 acc[KC][V];
    for (int k = 0; k < KC; ++k)
        for (int v = 0; v < V; ++v) acc[k][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(rows[k] + 16 * v);
    for (int64_t n = n0; n < n1; ++n) {
        const int64_t l = n * C + c;
        const Entry* e = ent + l * HW;
        const Entry* end = e + len[l];
        const T* dyn = dy + n * HWo * O + ob;
        for (; e < end; ++e) {
            const __m512 b = _mm512_set1_ps(e->v);
            const int32_t* t = tab + (int64_t)e->pos * K2 + k0;
            for (int k = 0; k < KC; ++k) {
                const int32_t p = t[k];
                const T* r = p >= 0 ? dyn + (int64_t)p * O : zero;
                for (int v = 0; v < V; ++v) acc[k][v] = _mm512_fmadd_ps(b, load16(r + 16 * v), acc[k][v]);
            }
        }
    }
    for (int k = 0; k < KC; ++k)
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(rows[k] + 16 * v, acc[k][v]);
}

template <typename T>
using BlockFn = void (*)(const T*, int64_t, int64_t, const int32_t*, int64_t, int64_t, const Entry*, int64_t,
                         const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const T*, float* const*, bool);

template <typename T, int V>
BlockFn<T> pick_kc(int kc) {
    switch (kc) {
        case 1: return channel_block<T, V, 1>;
        case 2: return channel_block<T, V, 2>;
        case 3: return channel_block<T, V, 3>;
        case 4: return channel_block<T, V, 4>;
        case 5: return channel_block<T, V, 5>;
        case 6: return channel_block<T, V, 6>;
        case 7: return channel_block<T, V, 7>;
        case 8: return channel_block<T, V, 8>;
        default: return channel_block<T, V, 9>;
    }
}

template <typename T>
BlockFn<T> pick(int v, int kc) {
    switch (v) {
        case 1: return pick_kc<T, 1>(kc);
        case 2: return pick_kc<T, 2>(kc);
        case 3: return pick_kc<T, 3>(kc);
        default: return pick_kc<T, 4>(kc);
    }
}

// 3x3 kernels, stride 1, padding 1, dilation 1 (VGG / ResNet): input pixels fall in 9 classes (top / middle /
// bottom row x left / middle / right column) that fix which kernel offsets meet an output pixel, so the lists
// are kept per class and each class runs a loop without the table, the zero rows or their wasted FMAs (30% of
// them on 4x4 images, 55% on 2x2).
constexpr int edge_mask(int e) { return e == 0 ? 3 : (e == 2 ? 6 : 7); }  // valid kh (kw) of a top/mid/bottom row
constexpr int class_mask(int cls) {
    int m = 0;
    for (int kh = 0; kh < 3; ++kh)
        for (int kw = 0; kw < 3; ++kw)
            if (((edge_mask(cls / 3) >> kh) & 1) && ((edge_mask(cls % 3) >> kw) & 1)) m |= 1 << (kh * 3 + kw);
    return m;
}

template <typename T, int V, int MASK>
__attribute__((always_inline)) inline void class_run(__m512 (&acc)[9][V], const Entry* e, const Entry* end,
                                                     const T* base, const int64_t* kO) {
    for (; e < end; ++e) {
        const __m512 b = _mm512_set1_ps(e->v);
        const T* r0 = base + (int64_t)e->pos * kO[9];
#pragma GCC unroll 9
        for (int k = 0; k < 9; ++k) {
            if (!((MASK >> k) & 1)) continue;
            const T* r = r0 - kO[k];
            for (int v = 0; v < V; ++v) acc[k][v] = _mm512_fmadd_ps(b, load16(r + 16 * v), acc[k][v]);
        }
    }
}

// As channel_block for the 3x3 class lists of one chunk of images: class q's entries are ent[st[q * nck] ..
// st[q * nck] + cnt[q * nck]) (pos = the global pixel index); kO[k] = (kh * W + kw) * O, kO[9] = O, and the dy
// row of output pixel pos + W + 1 - (kh * W + kw) is base + pos * O - kO[k].
template <typename T, int V>
void channel_block3(const T* dy, int64_t O, int64_t W, const int64_t* kO, const Entry* ent, const int64_t* st,
                    const int32_t* cnt, int64_t nck, int64_t ob, float* const* rows, bool first) {
    __m512 acc[9][V];
    for (int k = 0; k < 9; ++k)
        for (int v = 0; v < V; ++v) acc[k][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(rows[k] + 16 * v);
    const T* base = dy + ob + (W + 1) * O;
#define SPARSA_CLS(q) class_run<T, V, class_mask(q)>(acc, ent + st[q * nck], ent + st[q * nck] + cnt[q * nck], base, kO)
    SPARSA_CLS(0); SPARSA_CLS(1); SPARSA_CLS(2); SPARSA_CLS(3); SPARSA_CLS(4);
    SPARSA_CLS(5); SPARSA_CLS(6); SPARSA_CLS(7); SPARSA_CLS(8);
#undef SPARSA_CLS
    for (int k = 0; k < 9; ++k)
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(rows[k] + 16 * v, acc[k][v]);
}

// The 3x3 class lists of mask word j's channels over the pixels [q0, q1) (whole images) of chunk ck, in two
// passes. count3: cnt[(c * 9 + cls) * nck + ck] += the channel's nonzeros of each position class, with one byte
// counter per channel (vpmovm2b of the mask word, subtracted) per class, flushed every 255 pixels of a class;
// fill3: entries (global pixel, value) from the offsets st[(c * 9 + cls) * nck + ck]. The class comes from the
// pixel's row and column without divisions.
inline int row_class(int64_t h, int64_t H) { return h == 0 ? 0 : (h == H - 1 ? 2 : 1); }

// f(p, cls) for every pixel p of [q0, q1) (whole H x W images) with its position class
template <typename F>
inline void walk3(int64_t H, int64_t W, int64_t q0, int64_t q1, F&& f) {
    for (int64_t q = q0; q < q1; q += H * W)
        for (int64_t h = 0; h < H; ++h) {
            const int rc = 3 * row_class(h, H);
            for (int64_t w = 0; w < W; ++w) f(q + h * W + w, rc + row_class(w, W));
        }
}

void count3(const uint64_t* bm, int64_t NW, int64_t j, int64_t C, int64_t H, int64_t W, int64_t q0, int64_t q1,
            int32_t* cnt, int64_t nck, int64_t ck) {
    __m512i acc[9];
    int npx[9];
    for (int k = 0; k < 9; ++k) acc[k] = _mm512_setzero_si512(), npx[k] = 0;
    const int64_t cn = std::min<int64_t>(64, C - j * 64);
    auto flush = [&](int cls) {
        alignas(64) uint8_t b[64];
        _mm512_store_si512(reinterpret_cast<__m512i*>(b), acc[cls]);
        for (int64_t t = 0; t < cn; ++t) cnt[((j * 64 + t) * 9 + cls) * nck + ck] += b[t];
        acc[cls] = _mm512_setzero_si512();
        npx[cls] = 0;
    };
    walk3(H, W, q0, q1, [&](int64_t p, int cls) {
        acc[cls] = _mm512_sub_epi8(acc[cls], _mm512_movm_epi8(_cvtu64_mask64(bm[p * NW + j])));
        if (++npx[cls] == 255) flush(cls);
    });
    for (int k = 0; k < 9; ++k)
        if (npx[k]) flush(k);
}

template <typename T>
void fill3(const T* xa, const uint64_t* bm, int64_t NW, int64_t j, int64_t C, int64_t H, int64_t W, int64_t q0,
           int64_t q1, const int64_t* st, int64_t nck, int64_t ck, Entry* ent) {
    int64_t cur[64 * 9];
    const int64_t cn = std::min<int64_t>(64, C - j * 64);
    for (int64_t t = 0; t < cn; ++t)
        for (int k = 0; k < 9; ++k) cur[t * 9 + k] = st[((j * 64 + t) * 9 + k) * nck + ck];
    walk3(H, W, q0, q1, [&](int64_t p, int cls) {
        const T* xv = xa + p * C + j * 64;
        for (uint64_t m = bm[p * NW + j]; m; m &= m - 1) {
            const int t = __builtin_ctzll(m);
            ent[cur[t * 9 + cls]++] = Entry{(int32_t)p, value_of(xv[t])};
        }
    });
}

// dW[ob + o, c0 + c, kh, kw] (element strides ws) = stage[(c * kc + k) * Vw + o] for the kernel offsets
// k0 + k = kh * KW + kw of one run, c < nc, o < Vw (a multiple of 16): 8x8 transposes when dW's channels
// (channels-last) or its (channel, offset) rows (OIHW, one run) are contiguous, row copies when its output
// channels are (ws[0] == 1), scalar stores otherwise.
void store_block(const float* stage, int64_t nc, int kc, int64_t Vw, float* dw, const int64_t* ws, int64_t KW,
                 int64_t K2, int64_t c0, int64_t k0, int64_t ob) {
    float* base = dw + ob * ws[0] + c0 * ws[1];
    if (ws[0] == 1) {  // dW's output channels contiguous (the dY-driven call: dW's input channels, flipped)
        for (int64_t c = 0; c < nc; ++c)
            for (int k = 0; k < kc; ++k) {
                const int64_t kk = k0 + k;
                std::memcpy(base + c * ws[1] + (kk / KW) * ws[2] + (kk % KW) * ws[3], stage + (c * kc + k) * Vw,
                            sizeof(float) * Vw);
            }
    } else if (ws[1] == 1) {
        const int64_t nc8 = nc / 8 * 8, nc16 = nc / 16 * 16;
        for (int k = 0; k < kc; ++k) {
            const int64_t kk = k0 + k;
            float* bk = base + (kk / KW) * ws[2] + (kk % KW) * ws[3];
            // 8 dW rows at a time, each written along its channels in whole 64-byte runs (two tiles)
            for (int64_t o = 0; o < Vw; o += 8) {
                int64_t c = 0;
                for (; c < nc16; c += 16) {
                    sparsa_adaptive::tr8x8(stage + (c * kc + k) * Vw + o, kc * Vw, bk + o * ws[0] + c, ws[0]);
                    sparsa_adaptive::tr8x8(stage + ((c + 8) * kc + k) * Vw + o, kc * Vw, bk + o * ws[0] + c + 8, ws[0]);
                }
                for (; c < nc8; c += 8)
                    sparsa_adaptive::tr8x8(stage + (c * kc + k) * Vw + o, kc * Vw, bk + o * ws[0] + c, ws[0]);
            }
            for (int64_t c = nc8; c < nc; ++c)
                for (int64_t o = 0; o < Vw; ++o) bk[o * ws[0] + c] = stage[(c * kc + k) * Vw + o];
        }
    } else if (ws[3] == 1 && ws[2] == KW && ws[1] == K2 && kc == K2) {
        const int64_t R = nc * K2, R8 = R / 8 * 8;  // rows (c, k), contiguous in dW for one output channel
        for (int64_t o = 0; o < Vw; o += 8)
            for (int64_t r = 0; r < R8; r += 8) sparsa_adaptive::tr8x8(stage + r * Vw + o, Vw, base + o * ws[0] + r, ws[0]);
        for (int64_t r = R8; r < R; ++r)
            for (int64_t o = 0; o < Vw; ++o) base[o * ws[0] + r] = stage[r * Vw + o];
    } else {
        for (int64_t c = 0; c < nc; ++c)
            for (int k = 0; k < kc; ++k) {
                const int64_t kk = k0 + k;
                float* bk = base + c * ws[1] + (kk / KW) * ws[2] + (kk % KW) * ws[3];
                for (int64_t o = 0; o < Vw; ++o) bk[o * ws[0]] = stage[(c * kc + k) * Vw + o];
            }
    }
}

// The list kernel for T = float or bf16 (uint16_t) values and dy rows (sparsa_union_conv_wgrad_lists_*).
template <typename T>
int wgrad_lists(const int64_t* g, const T* xa, const uint64_t* bm, const T* dy, float* dw, const int64_t* ws,
                int nthreads) {
    const Geo G(g);
    const int64_t N = G.N, C = G.C, HW = G.H * G.W, HWo = G.Ho * G.Wo, K2 = G.KH * G.KW, NW = (C + 63) / 64;
    const int64_t nv = G.O / 16;
    // images per chunk: the dy columns of an output block (16 V wide) of the chunk within ~256 KB
    auto images_per_chunk = [&](int64_t V) {
        return std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, HWo * V * 64));
    };
    // 3x3, stride 1, padding 1, dilation 1, same-size output: lists per (channel, position class, chunk)
    const bool fast3 = G.KH == 3 && G.KW == 3 && G.sh == 1 && G.sw == 1 && G.ph == 1 && G.pw == 1 && G.dh == 1 &&
                       G.dw == 1 && G.Ho == G.H && G.Wo == G.W && G.H >= 2 && G.W >= 2;
    std::vector<int32_t> tab;
    std::unique_ptr<Entry[]> ent;
    std::vector<int64_t> st3;
    std::vector<int32_t> len, cnt3;
    std::vector<int64_t> cw((size_t)C, 0);  // nonzeros per channel (thread balance)
    const int64_t per3 = images_per_chunk(std::min<int64_t>(2, nv)), nck = (N + per3 - 1) / per3;
    if (fast3) {
        // count per (channel, class, chunk), then offsets, then fill (pos made global); tasks (chunk, mask word)
        cnt3.assign((size_t)C * 9 * nck, 0);
        const int64_t ntask = nck * NW;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t t = 0; t < ntask; ++t) {
            const int64_t ck = t / NW;
            count3(bm, NW, t % NW, C, G.H, G.W, ck * per3 * HW, std::min(N, (ck + 1) * per3) * HW, cnt3.data(), nck, ck);
        }
        st3.resize((size_t)C * 9 * nck);
        int64_t off = 0;
        for (int64_t c = 0; c < C; ++c) {
            const int64_t o0 = off;
            for (int64_t l = c * 9 * nck; l < (c + 1) * 9 * nck; ++l) st3[l] = off, off += cnt3[l];
            cw[c] = off - o0;
        }
        ent.reset(new Entry[(size_t)std::max<int64_t>(1, off)]);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t t = 0; t < ntask; ++t) {
            const int64_t ck = t / NW;
            fill3<T>(xa, bm, NW, t % NW, C, G.H, G.W, ck * per3 * HW, std::min(N, (ck + 1) * per3) * HW, st3.data(), nck,
                  ck, ent.get());
        }
    } else {
        tab = sparsa_adaptive::output_pixel_table(G);
        // lists per (image, channel): room for HW entries each (no counting pass); len filled below
        ent.reset(new Entry[(size_t)N * C * HW]);
        len.assign((size_t)N * C, 0);
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t n = 0; n < N; ++n) {
            int32_t* ln = len.data() + n * C;
            Entry* en = ent.get() + n * C * HW;
            for (int64_t pos = 0; pos < HW; ++pos) {
                const int64_t q = n * HW + pos;
                const T* xv = xa + q * C;
                for (int64_t j = 0; j < NW; ++j)
                    for (uint64_t m = bm[q * NW + j]; m; m &= m - 1) {
                        const int64_t c = j * 64 + __builtin_ctzll(m);
                        en[c * HW + ln[c]++] = Entry{(int32_t)pos, value_of(xv[c])};
                    }
            }
        }
        for (int64_t n = 0; n < N; ++n)
            for (int64_t c = 0; c < C; ++c) cw[c] += len[n * C + c];
    }
    // channel ranges per thread, balanced by nonzeros (plus a little per channel for the block overheads)
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
        // whole 16-channel runs per thread when there are enough (full 64-byte lines of a channels-last dW each)
        if (C >= 16 * nt)
            for (int t2 = 1; t2 < nt; ++t2) cut[t2] = std::max(cut[t2 - 1], std::min(C, (cut[t2] + 8) / 16 * 16));
    }
    std::vector<T> zero(64, T(0));
    int64_t kO[10];
    for (int k = 0; k < 9; ++k) kO[k] = ((k / 3) * G.W + k % 3) * G.O;
    kO[9] = G.O;
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num();
        const int64_t c0 = cut[tid], c1 = cut[tid + 1], nc = c1 - c0;
        // staging [c - c0][k][16 V] for one run of offsets and one block of output channels
        std::unique_ptr<float[]> stage(new float[(size_t)std::max<int64_t>(1, nc * std::min<int64_t>(9, K2) * 64)]);
        float* rows[9];
        for (int64_t k0 = 0; k0 < K2; k0 += 9) {
            const int kc = (int)std::min<int64_t>(9, K2 - k0);
            const int vmax = kc <= 6 ? 4 : 2;  // at most 24 accumulators
            for (int64_t v0 = 0; v0 < nv && nc > 0; v0 += vmax) {
                const int V = (int)std::min<int64_t>(vmax, nv - v0);
                const int64_t Vw = 16 * V;
                const BlockFn<T> fn = pick<T>(V, kc);
                const int64_t ob = v0 * 16;
                const int64_t per = fast3 ? per3 : images_per_chunk(V);
                for (int64_t n0 = 0, ck = 0; n0 < N; n0 += per, ++ck) {
                    const int64_t n1 = std::min(N, n0 + per);
                    for (int64_t c = c0; c < c1; ++c) {
                        for (int k = 0; k < kc; ++k) rows[k] = stage.get() + ((c - c0) * kc + k) * Vw;
                        if (fast3) {
                            const int64_t l = c * 9 * nck + ck;
                            if (V == 2)
                                channel_block3<T, 2>(dy, G.O, G.W, kO, ent.get(), st3.data() + l, cnt3.data() + l, nck, ob,
                                                  rows, n0 == 0);
                            else
                                channel_block3<T, 1>(dy, G.O, G.W, kO, ent.get(), st3.data() + l, cnt3.data() + l, nck, ob,
                                                  rows, n0 == 0);
                        } else {
                            fn(dy, G.O, HWo, tab.data(), K2, k0, ent.get(), HW, len.data(), C, c, n0, n1, ob,
                               zero.data(), rows, n0 == 0);
                        }
                    }
                }
                store_block(stage.get(), nc, kc, Vw, dw, ws, G.KW, K2, c0, k0, ob);
            }
        }
    }
    return 0;
}

#pragma GCC pop_options
#endif

}  // namespace

extern "C" {

// dW [O, C, KH, KW] (element strides ws, any layout; vectorized stores for channels-last and OIHW) from relu(x)'s
// union operand (xa [N*H*W, C] values, bm [N*H*W, ceil(C/64)] masks) and dy [N*Ho*Wo, O] contiguous; any stride,
// padding and dilation. Returns 1 when O is not a multiple of 16, 2 without AVX-512.
int sparsa_union_conv_wgrad_lists_f32(const int64_t* g, const float* xa, const uint64_t* bm, const float* dy, float* dw,
                                      const int64_t* ws, int nthreads) {
    if (Geo(g).O % 16) return 1;
    if (!sparsa_cpu_avx512_enabled()) return 2;
#ifdef SPARSA_WLISTS_AVX512
    return wgrad_lists<float>(g, xa, bm, dy, dw, ws, nthreads);
#else
    return 2;
#endif
}

// As sparsa_union_conv_wgrad_lists_f32 for bf16 xa and dy (fp32 accumulation, fp32 dW).
int sparsa_union_conv_wgrad_lists_bf16(const int64_t* g, const uint16_t* xa, const uint64_t* bm, const uint16_t* dy,
                                       float* dw, const int64_t* ws, int nthreads) {
    if (Geo(g).O % 16) return 1;
    if (!sparsa_cpu_avx512_enabled()) return 2;
#ifdef SPARSA_WLISTS_AVX512
    return wgrad_lists<uint16_t>(g, xa, bm, dy, dw, ws, nthreads);
#else
    return 2;
#endif
}

}  // extern "C"
