// qmoe's packed FP4 weight word (src/core/fp4_weight_pack.h), checked on the host:
//   - pack_word / unpack_word are inverse bit permutations;
//   - the GEMMs' decode of byte m of a packed word (decode_byte, the same instructions as the kernels) is the
//     bf16x2 e2m1 * 2^-126 of the byte's two codes (low half: even K), whatever the other bytes hold;
//   - pack_fp4_weights / unpack_fp4_weights over tensors (CPU), and their argument checks.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/fp4_weight_pack.h"
#include "qmoe/error.h"
#include "qmoe/formats.h"
#include "qmoe/tensor.h"

namespace {

using qmoe::fp4pack::decode_byte;
using qmoe::fp4pack::pack_word;
using qmoe::fp4pack::unpack_word;

// bf16 bits of e2m1 code c times 2^-126: sign to bit 15, the 3 magnitude bits to 8..6.
uint32_t e2m1_bf16_bits(uint32_t c) { return ((c >> 3) << 15) | ((c & 7u) << 6); }

TEST(Fp4WeightPack, PackedBitsPartitionTheWord) {
  uint32_t seen = 0;
  for (int c = 0; c < 8; ++c)
    for (int j = 0; j < 4; ++j) {
      const uint32_t bit = 1u << qmoe::fp4pack::packed_bit(c, j);
      EXPECT_EQ(seen & bit, 0u) << "code " << c << " bit " << j;
      seen |= bit;
    }
  EXPECT_EQ(seen, 0xFFFFFFFFu);
}

TEST(Fp4WeightPack, PackUnpackAreInverse) {
  uint32_t x = 12345u;
  for (int i = 0; i < 200000; ++i) {
    x = x * 1664525u + 1013904223u;
    EXPECT_EQ(unpack_word(pack_word(x)), x);
    EXPECT_EQ(pack_word(unpack_word(x)), x);
    if (HasFailure()) return;
  }
}

TEST(Fp4WeightPack, DecodeEveryByteValueInEveryPosition) {
  uint32_t filler = 0x9E3779B9u;
  for (int m = 0; m < 4; ++m)
    for (uint32_t byte = 0; byte < 256; ++byte)
      for (int rep = 0; rep < 8; ++rep) {
        filler = filler * 1664525u + 1013904223u;
        const uint32_t w = (filler & ~(0xFFu << (8 * m))) | (byte << (8 * m));
        const uint32_t want = e2m1_bf16_bits(byte & 0xFu) | (e2m1_bf16_bits(byte >> 4) << 16);
        ASSERT_EQ(decode_byte(pack_word(w), m), want) << "byte " << m << " value " << byte;
      }
}

TEST(Fp4WeightPack, TensorRoundTripOnCpu) {
  const int64_t E = 3, N = 5, K = 64;
  std::vector<uint8_t> w(E * N * K / 2), packed(w.size()), back(w.size());
  uint32_t x = 7;
  for (auto& b : w) b = static_cast<uint8_t>((x = x * 1664525u + 1013904223u) >> 24);
  qmoe::pack_fp4_weights(qmoe::make_tensor(w.data(), qmoe::DType::kUInt8, {E, N, K / 2}),
                         qmoe::make_tensor(packed.data(), qmoe::DType::kUInt8, {E, N, K / 2}));
  for (size_t i = 0; i < w.size(); i += 4) {
    uint32_t a, b;
    std::memcpy(&a, &w[i], 4);
    std::memcpy(&b, &packed[i], 4);
    ASSERT_EQ(b, pack_word(a)) << "word " << i / 4;
  }
  qmoe::unpack_fp4_weights(qmoe::make_tensor(packed.data(), qmoe::DType::kUInt8, {E, N, K / 2}),
                           qmoe::make_tensor(back.data(), qmoe::DType::kUInt8, {E, N, K / 2}));
  EXPECT_EQ(back, w);
}

TEST(Fp4WeightPack, RejectsRowsThatAreNotWholeWords) {
  std::vector<uint8_t> w(2 * 6), out(w.size());
  // 6 bytes per row: K = 12
  try {
    qmoe::pack_fp4_weights(qmoe::make_tensor(w.data(), qmoe::DType::kUInt8, {2, 6}),
                           qmoe::make_tensor(out.data(), qmoe::DType::kUInt8, {2, 6}));
    FAIL() << "expected an error";
  } catch (const qmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
}

}  // namespace
