// Pixel groups and mask words shared by the union kernels (adaptive_union.cpp, adaptive_union_bf16.cpp).
#pragma once
#include <algorithm>
#include <cstdint>

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
