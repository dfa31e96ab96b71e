// bf16_act_supported (src/cuda/gemm/bf16_act_requant.h): which GEMM1 calls of the bf16 x 4-bit pipeline take
// the fused activation epilogue. Pure host logic; the epilogue's results are checked on the GPU
// (tests/python/test_gpu_fused_epilogue_fp4.py).
#include <gtest/gtest.h>

#include "cuda/gemm/bf16_act_requant.h"

namespace {

using qmoe::Activation;
using qmoe::GateUpLayout;
using qmoe::Tactic;
using qmoe::cuda::bf16_act_supported;
using qmoe::cuda::fused::ActivationArgs;
using qmoe::cuda::fused::Bf16Requant;

ActivationArgs act(Activation a, GateUpLayout layout = GateUpLayout::kUpGateInterleaved64) {
  ActivationArgs args{};
  args.activation = a;
  args.layout = layout;
  return args;
}

Tactic decode(int tile_m, int tile_n, int tile_k) {
  Tactic t;
  t.family = Tactic::Family::kDecode;
  t.tile_m = tile_m, t.tile_n = tile_n, t.tile_k = tile_k;
  return t;
}

TEST(Bf16ActSupported, TheTwo128RowDecodeTilesOnly) {
  const ActivationArgs swiglu = act(Activation::kSwiglu);
  EXPECT_TRUE(bf16_act_supported(decode(128, 8, 256), 4096, 2048, swiglu, Bf16Requant::kNvfp4));
  EXPECT_TRUE(bf16_act_supported(decode(128, 16, 256), 4096, 2048, swiglu, Bf16Requant::kMxfp8));
  for (const Tactic& t : {decode(128, 24, 256), decode(128, 32, 256), decode(64, 8, 256)})
    EXPECT_FALSE(bf16_act_supported(t, 4096, 2048, swiglu, Bf16Requant::kBf16)) << t.name();
  Tactic prefill = decode(128, 64, 128);
  prefill.family = Tactic::Family::kPrefill;
  EXPECT_FALSE(bf16_act_supported(prefill, 4096, 2048, swiglu, Bf16Requant::kBf16));
  Tactic split = decode(128, 8, 256);
  split.split_k = 2;
  EXPECT_FALSE(bf16_act_supported(split, 4096, 2048, swiglu, Bf16Requant::kBf16));
}

TEST(Bf16ActSupported, GatedNeedsTheInterleavedLayoutAndWhole64Groups) {
  for (Activation a : {Activation::kSwiglu, Activation::kGegluTanh, Activation::kSitu}) {
    EXPECT_TRUE(bf16_act_supported(decode(128, 8, 256), 2 * 2880, 2880, act(a), Bf16Requant::kBf16));
    EXPECT_FALSE(bf16_act_supported(decode(128, 8, 256), 2 * 2880, 2880, act(a, GateUpLayout::kGateUp),
                                    Bf16Requant::kBf16));
    EXPECT_FALSE(bf16_act_supported(decode(128, 8, 256), 2 * 160, 160, act(a), Bf16Requant::kBf16));  // 160 % 64
    EXPECT_FALSE(bf16_act_supported(decode(128, 8, 256), 2880, 2880, act(a), Bf16Requant::kBf16));  // n != 2I
  }
}

TEST(Bf16ActSupported, Relu2NeedsNEqualToIAndWhole32Blocks) {
  const ActivationArgs relu2 = act(Activation::kRelu2, GateUpLayout::kGateUp);
  EXPECT_TRUE(bf16_act_supported(decode(128, 8, 256), 160, 160, relu2, Bf16Requant::kMxfp8));
  EXPECT_FALSE(bf16_act_supported(decode(128, 8, 256), 320, 160, relu2, Bf16Requant::kBf16));
  EXPECT_FALSE(bf16_act_supported(decode(128, 8, 256), 144, 144, relu2, Bf16Requant::kBf16));  // 144 % 32
}

TEST(Bf16ActSupported, NotThePerTokenNvfp4Mode) {
  EXPECT_FALSE(bf16_act_supported(decode(128, 8, 256), 4096, 2048, act(Activation::kSwiglu),
                                  Bf16Requant::kNvfp4PerToken));
  EXPECT_FALSE(bf16_act_supported(decode(128, 8, 256), 0, 0, act(Activation::kSwiglu), Bf16Requant::kBf16));
}

}  // namespace
