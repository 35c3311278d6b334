// Convolution geometry shared by the adaptive (activation-sparse training) kernels.
#pragma once
#include <cstdint>
#include <vector>

namespace sparsa_adaptive {

// Geometry g[]: N, C, H, W, O, KH, KW, Ho, Wo, sh, sw, ph, pw, dh, dw, CS (CS: channel slice of the
// list operand; S = number of slices).
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
