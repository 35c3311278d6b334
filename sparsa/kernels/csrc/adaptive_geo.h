// Convolution geometry shared by the adaptive (activation-sparse training) kernels.
#pragma once
#include <cstdint>
#include <vector>

// Geometry g[]: N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS (CS: channel slice of the
// list operand; S = number of slices). The same fields in the same order as Python's ConvGeometry and
// ConvGeoC (sparsa/kernels/geometry.py); code reads g[] through these names, never by number.
enum GeoField : int {
    kGeoN = 0, kGeoC, kGeoH, kGeoW, kGeoO, kGeoKH, kGeoKW, kGeoHo, kGeoWo,
    kGeoSh, kGeoSw, kGeoPh, kGeoPw, kGeoDh, kGeoDw, kGeoCS, kGeoFields
};

namespace sparsa_adaptive {

struct Geo {
    int64_t N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS, S;
    explicit Geo(const int64_t* g)
        : N(g[kGeoN]), C(g[kGeoC]), H(g[kGeoH]), W(g[kGeoW]), O(g[kGeoO]), KH(g[kGeoKH]), KW(g[kGeoKW]),
          Ho(g[kGeoHo]), Wo(g[kGeoWo]), sh(g[kGeoSh]), sw(g[kGeoSw]), ph(g[kGeoPh]), pw(g[kGeoPw]),
          dh(g[kGeoDh]), dw(g[kGeoDw]), CS(g[kGeoCS]), S((g[kGeoC] + g[kGeoCS] - 1) / g[kGeoCS]) {}
};

// Output-channel block: the largest multiple of 8 up to 64 that divides O (O % 8 == 0).
inline int64_t pick_ob(int64_t O) {
    for (int64_t b = 64; b > 8; b -= 8)
        if (O % b == 0) return b;
    return 8;
}

// tab[pos * KH*KW + k]: the output pixel (within the image) that input pixel pos = h * W + w meets at kernel
// offset k, or -1 (any stride, padding and dilation).
inline std::vector<int32_t> output_pixel_table(const Geo& G) {
    const int64_t HW = G.H * G.W, K2 = G.KH * G.KW;
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
    return tab;
}

}  // namespace sparsa_adaptive
