#pragma once
// GGUF weight blocks decoded into the packed linear layer's unit: 32 consecutive weights of one row as
// integer codes q plus float factors, such that the loader's dequantized value is
//
//   kQ8 / kQ6 formats:  w = fl(q * d_h)           (d_h: d0 for the first 16 weights, d1 for the rest)
//   kQ4 format:         w = fl(fl(q * d0) + m)
//
// bit for bit (model/loading/gguf_quants.py and gguf_reader.py compute the same roundings). K-quant
// factors are formed as ggml forms them, d*sc and dmin*m in float32, which is exact with fp16 d and
// 6- or 8-bit scales, so repacking them as fp32 keeps every dequantized value. Included by
// kernels/linear.cpp only (built with -ffp-contract=off).
#include <cstdint>
#include <cstring>

#include "kernels/linear_tiles.h"

namespace agent_infer {
namespace {

struct Block32 {
  int q[32];
  float d0, d1, m;
};

// Q4_K/Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Bytes of one row of k weights of `type`, or 0 if the type is not packed natively.
inline size_t row_bytes_of(int type, size_t k) {
  switch (type) {
    case kGgmlF32: return k * 4;
    case kGgmlF16: case kGgmlBF16: return k * 2;
    case kGgmlQ8_0: return k / 32 * 34;
    case kGgmlQ4_0: return k / 32 * 18;
    case kGgmlQ4_1: return k / 32 * 20;
    case kGgmlQ5_0: return k / 32 * 22;
    case kGgmlQ4_K: return k / 256 * 144;
    case kGgmlQ6_K: return k / 256 * 210;
    default: return 0;
  }
}

// Block b (weights 32b .. 32b+31) of a row of quantized `type` starting at `row`.
inline Block32 decode_block(int type, const uint8_t* row, size_t b) {
  Block32 o{};
  o.m = 0.0f;
  switch (type) {
    case kGgmlQ8_0: {
      const uint8_t* s = row + b * 34;
      o.d0 = half_to_float(load_u16(s));
      for (int i = 0; i < 32; ++i) o.q[i] = static_cast<int8_t>(s[2 + i]);
      break;
    }
    case kGgmlQ4_0: {
      const uint8_t* s = row + b * 18;
      o.d0 = half_to_float(load_u16(s));
      // low nibbles are elements 0..15, high nibbles 16..31 (ggml's block layout)
      for (int i = 0; i < 16; ++i) {
        o.q[i] = (s[2 + i] & 15) - 8;
        o.q[i + 16] = (s[2 + i] >> 4) - 8;
      }
      break;
    }
    case kGgmlQ4_1: {
      const uint8_t* s = row + b * 20;
      o.d0 = half_to_float(load_u16(s));
      o.m = half_to_float(load_u16(s + 2));
      for (int i = 0; i < 16; ++i) {
        o.q[i] = s[4 + i] & 15;
        o.q[i + 16] = s[4 + i] >> 4;
      }
      break;
    }
    case kGgmlQ5_0: {
      const uint8_t* s = row + b * 22;
      o.d0 = half_to_float(load_u16(s));
      uint32_t qh;
      std::memcpy(&qh, s + 2, 4);
      for (int i = 0; i < 16; ++i) {
        o.q[i] = ((s[6 + i] & 15) | (((qh >> i) & 1) << 4)) - 16;
        o.q[i + 16] = ((s[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16;
      }
      break;
    }
    case kGgmlQ4_K: {
      // 8 sub-blocks of 32 per 256: w = d*sc*q - dmin*mn, stored here as q*d0 + m with m = -(dmin*mn)
      const uint8_t* s = row + (b / 8) * 144;
      const int j = static_cast<int>(b % 8);
      int sc, mn;
      scale_min_k4(j, s + 4, sc, mn);
      o.d0 = half_to_float(load_u16(s)) * static_cast<float>(sc);
      o.m = -(half_to_float(load_u16(s + 2)) * static_cast<float>(mn));
      // each 32-byte run holds two sub-blocks: low nibbles (even j), then high nibbles (odd j)
      const uint8_t* qs = s + 16 + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int i = 0; i < 32; ++i) o.q[i] = (qs[i] >> shift) & 15;
      break;
    }
    case kGgmlQ6_K: {
      // 16 sub-blocks of 16 per 256 with int8 scales: w = (d*sc) * (q - 32). Weight e of the
      // super-block: half n = e/128, run r = (e%128)/32; its low 4 bits are nibble r/2 of
      // ql[64n + 32(r%2) + l], its high 2 bits field r of qh[32n + l] (l = e%32).
      const uint8_t* s = row + (b / 8) * 210;
      const int e0 = static_cast<int>(b % 8) * 32;
      const int n = e0 / 128, r = (e0 % 128) / 32;
      const uint8_t* ql = s + 64 * n + 32 * (r & 1);
      const uint8_t* qh = s + 128 + 32 * n;
      for (int l = 0; l < 32; ++l)
        o.q[l] = (((ql[l] >> (4 * (r >> 1))) & 15) | (((qh[l] >> (2 * r)) & 3) << 4)) - 32;
      const float d = half_to_float(load_u16(s + 208));
      o.d0 = d * static_cast<float>(static_cast<int8_t>(s[192 + e0 / 16]));
      o.d1 = d * static_cast<float>(static_cast<int8_t>(s[192 + e0 / 16 + 1]));
      return o;
    }
    default:
      break;
  }
  o.d1 = o.d0;
  return o;
}

}  // namespace
}  // namespace agent_infer
