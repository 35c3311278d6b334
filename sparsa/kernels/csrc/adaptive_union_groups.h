// Pixel groups and mask words shared by the union kernels (adaptive_union.cpp, adaptive_union_bf16.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

#include "adaptive_geo.h"

namespace sparsa_adaptive {

constexpr int kUnionPixels = 4;  // output pixels per group

inline int64_t mask_words(int64_t C) { return (C + 63) / 64; }

// The groups of P = 4 output pixels of one image: runs of 4 along the flattened rows, or, when the caller
// allows it and the image is even-sized and at least 16x16, 2x2 tiles. Neighbours in both directions
// share more of relu(x)'s zeros (a tile's union is smaller than a row run's), which pays at 16x16 and
// larger, but not on small images (rows skip whole kernel offsets at the border, tiles only half of them)
// and not on dY's masks (max-pool backward leaves one nonzero per 2x2 window).
struct Groups {
    int64_t Ho, Wo, HW, tw, per_image, pg;
    bool tiles;
    // pg: pixels per group, 4 (2x2 tiles when allowed and the image fits, else row runs), 2 or 1 (row runs)
    Groups(const Geo& G, bool allow_tiles, int64_t pixels = kUnionPixels)
        : Ho(G.Ho), Wo(G.Wo), HW(G.Ho * G.Wo), tw(G.Wo / 2), per_image(0), pg(pixels),
          tiles(pixels == 4 && allow_tiles && G.Ho % 2 == 0 && G.Wo % 2 == 0 && G.Ho >= 16 && G.Wo >= 16) {
        per_image = tiles ? HW / 4 : (HW + pg - 1) / pg;
    }
    // (ho, wo) of member i of group g; false when the member lies past the image (row runs only)
    bool member(int64_t g, int i, int64_t& ho, int64_t& wo) const {
        if (tiles) {
            const int64_t th = g / tw, t = g - th * tw;
            ho = 2 * th + (i >> 1);
            wo = 2 * t + (i & 1);
            return true;
        }
        const int64_t pp = g * pg + i;
        if (pp >= HW) return false;
        ho = pp / Wo;
        wo = pp - ho * Wo;
        return true;
    }
};

// The operand rows the PP members of a group meet at kernel offset (kh, kw) of image n: xr[i] / mr[i] point at
// the input pixel's values and mask words, or at the zero row / zero mask when member i (ok[i] false) or its
// input pixel lies outside the image. Returns whether any member meets a pixel inside. T: float or bf16 bits.
template <typename T, int PP>
inline bool offset_rows(const Geo& G, const int64_t* ho, const int64_t* wo, const bool* ok, int64_t n, int64_t kh,
                        int64_t kw, const T* xa, const uint64_t* bm, const T* zero, const uint64_t* zm, const T** xr,
                        const uint64_t** mr) {
    const int64_t NW = mask_words(G.C);
    bool any = false;
    for (int i = 0; i < PP; ++i) {
        const int64_t hi = ho[i] * G.sh - G.ph + kh * G.dh, wi = wo[i] * G.sw - G.pw + kw * G.dw;
        if (!ok[i] || hi < 0 || hi >= G.H || wi < 0 || wi >= G.W) {
            xr[i] = zero;
            mr[i] = zm;
        } else {
            const int64_t q = (n * G.H + hi) * G.W + wi;
            xr[i] = xa + q * G.C;
            mr[i] = bm + q * NW;
            any = true;
        }
    }
    return any;
}

// The weight-gradient driver of the union kernels: for every (c, kh, kw) the row
// S[(rs[3] + c*rs[0] + kh*rs[1] + kw*rs[2]) * ldS + o], o < O, is overwritten with sum_p x[q(p, kh, kw), c] *
// dy[p, o]. Work is cut into blocks (kernel offset, mask word j, output block of OB = pick_ob(O) channels), and
// the pixel groups into `split` ranges when there are too few blocks for the threads (partial sums added at the
// end). block(GR, zero, blk, kh, kw, j, ob, g0, g1) fills blk[c - 64 j][0..OB) over groups [g0, g1); zero is a
// zero row of T (the operand's element type) as long as an operand row or an output block, plus 32.
template <typename T, typename Block>
void wgrad_run(const Geo& G, float* S, const int64_t* rs, int64_t ldS, int tiles, int nthreads, Block block) {
    const Groups GR(G, tiles != 0);
    const int64_t OB = pick_ob(G.O), nob = G.O / OB, NW = mask_words(G.C), K2 = G.KH * G.KW, GT = G.N * GR.per_image;
    const int64_t base = K2 * NW * nob;  // blocks: (kernel offset, mask word, output block)
    int64_t split = 1;
    if (base < 8 * nthreads) split = std::min<int64_t>((8 * nthreads + base - 1) / base, std::max<int64_t>(1, GT / 16));
    const int64_t chunk = (GT + split - 1) / split;
    std::vector<float> part(split > 1 ? (size_t)split * base * 64 * OB : 0);
    std::vector<T> zero((size_t)std::max<int64_t>(G.C, 64) + 32, T(0));
    auto row = [&](int64_t c, int64_t k) { return S + (rs[3] + c * rs[0] + (k / G.KW) * rs[1] + (k % G.KW) * rs[2]) * ldS; };
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> own((size_t)64 * OB);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < base * split; ++t) {
            const int64_t sp = t / base, b = t % base;
            const int64_t obi = b % nob, j = (b / nob) % NW, k = b / (nob * NW);
            float* blk = split > 1 ? part.data() + (sp * base + b) * 64 * OB : own.data();
            const int64_t g0 = sp * chunk, g1 = std::min(GT, g0 + chunk), cw = std::min<int64_t>(64, G.C - j * 64);
            if (g0 >= g1) std::memset(blk, 0, sizeof(float) * 64 * OB);
            else block(GR, zero.data(), blk, k / G.KW, k % G.KW, j, obi * OB, g0, g1);
            if (split == 1)
                for (int64_t c = 0; c < cw; ++c) std::memcpy(row(j * 64 + c, k) + obi * OB, blk + c * OB, sizeof(float) * OB);
        }
        if (split > 1) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < base; ++b) {
                const int64_t obi = b % nob, j = (b / nob) % NW, k = b / (nob * NW), cw = std::min<int64_t>(64, G.C - j * 64);
                for (int64_t c = 0; c < cw; ++c) {
                    float* dst = row(j * 64 + c, k) + obi * OB;
                    const float* src = part.data() + b * 64 * OB + c * OB;
                    for (int64_t o = 0; o < OB; ++o) {
                        float s = src[o];
                        for (int64_t q = 1; q < split; ++q) s += src[q * base * 64 * OB + o];
                        dst[o] = s;
                    }
                }
            }
        }
    }
}

// Part of the operand's union4 count (see sparsa_union_compact_f32) over this thread's share of the runs of
// 4 consecutive pixels of each image (rows flattened); call inside an OpenMP parallel region and sum.
inline int64_t union4_share(const uint64_t* bm, int64_t N, int64_t HW, int64_t NW) {
    const int64_t runs = (HW + 3) / 4;
    int64_t uni = 0;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N * runs; ++t) {
        const int64_t q0 = (t / runs) * HW + (t % runs) * 4, q1 = std::min(q0 + 4, (t / runs) * HW + HW);
        for (int64_t j = 0; j < NW; ++j) {
            uint64_t m = 0;
            for (int64_t q = q0; q < q1; ++q) m |= bm[q * NW + j];
            uni += __builtin_popcountll(m);
        }
    }
    return uni;
}

}  // namespace sparsa_adaptive
