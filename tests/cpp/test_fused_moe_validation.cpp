// Validation of the fused MoE entry (src/api/fused_moe.cpp): one test per rule. Each checks that
// the qmoe::Error names the argument (and has the right kind) and that the output, filled with
// 0xAA before the call, is untouched.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "fused_moe_case.h"
#include "cuda/fused/fused_moe_workspace.h"
#include "cuda/launch.h"
#include "qmoe/fused_moe.h"

namespace {

using namespace fused_moe_test;

// ---------------------------------------------------------------------------------------------
// Validation: one test per rule; the error names the argument, the output keeps its 0xAA poison.
// ---------------------------------------------------------------------------------------------

class FusedMoeValidation : public ::testing::Test {
 protected:
  Case make(QuantMode mode, Activation act = Activation::kSwiglu) {
    Config c;
    c.mode = mode;
    c.act = act;
    c.H = 128;
    c.I = 128;
    c.T = 2;
    Case cs = make_case(c, 99);
    return cs;
  }
  // p's output must point into cs.out (or not, for the aliasing test: pass check_output = false).
  void expect_error(Case& cs, const FusedMoeParams& p, const std::string& argument,
                    qmoe::ErrorKind kind = qmoe::ErrorKind::kValue, bool check_output = true) {
    std::fill(cs.out.begin(), cs.out.end(), 0xAA);
    try {
      qmoe::fused_moe(p);
      ADD_FAILURE() << "no error for argument '" << argument << "'";
    } catch (const qmoe::Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      EXPECT_NE(std::string(e.what()).find("'" + argument + "'"), std::string::npos) << e.what();
      EXPECT_EQ(e.kind(), kind) << e.what();
    }
    if (check_output)
      for (uint8_t b : cs.out) ASSERT_EQ(b, 0xAA) << "output written despite the error";
  }
};

TEST_F(FusedMoeValidation, ValidCasePasses) {
  for (QuantMode m : {QuantMode::kW4A4, QuantMode::kW4A8Mx, QuantMode::kW4A16, QuantMode::kW4A8Int4,
                      QuantMode::kW4A16Int4}) {
    Case cs = make(m);
    EXPECT_NO_THROW(qmoe::validate_fused_moe(cs.params())) << qmoe::quant_mode_name(m);
    EXPECT_EQ(qmoe::fused_moe_workspace_size(cs.params()), 0);
  }
}
TEST_F(FusedMoeValidation, TopkIdsDtype) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.topk_ids.dtype = DType::kInt64;
  expect_error(cs, p, "topk_ids", qmoe::ErrorKind::kType);
}
TEST_F(FusedMoeValidation, TopkIdsRank) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.topk_ids = qmoe::make_tensor(cs.ids.data(), DType::kInt32, {4});
  expect_error(cs, p, "topk_ids");
}
TEST_F(FusedMoeValidation, TopkAtMost16) {
  Case cs = make(QuantMode::kW4A4);
  std::vector<int32_t> ids(2 * 17, 0);
  std::vector<float> w(2 * 17, 1.0f);
  auto p = cs.params();
  p.topk_ids = qmoe::make_tensor(ids.data(), DType::kInt32, {2, 17});
  p.topk_weights = qmoe::make_tensor(w.data(), DType::kFloat32, {2, 17});
  expect_error(cs, p, "topk_ids");
}
TEST_F(FusedMoeValidation, TopkWeightsDtype) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.topk_weights.dtype = DType::kBFloat16;
  expect_error(cs, p, "topk_weights", qmoe::ErrorKind::kType);
}
TEST_F(FusedMoeValidation, TopkWeightsShape) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.topk_weights = qmoe::make_tensor(cs.wts.data(), DType::kFloat32, {1, 2});
  expect_error(cs, p, "topk_weights");
}
TEST_F(FusedMoeValidation, NumExpertsPositive) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.num_experts = 0;
  expect_error(cs, p, "num_experts");
}
TEST_F(FusedMoeValidation, LocalRangeInsideExperts) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.local_expert_offset = 1;  // 1 + 4 local > 4 experts
  expect_error(cs, p, "num_local_experts");
}
TEST_F(FusedMoeValidation, LocalOffsetNonNegative) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.local_expert_offset = -1;
  expect_error(cs, p, "local_expert_offset");
}
TEST_F(FusedMoeValidation, WeightsCountLocalExperts) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.num_experts = 8;
  p.num_local_experts = 2;  // weights hold 4 experts
  expect_error(cs, p, "w2");
}
TEST_F(FusedMoeValidation, WeightDtype) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.w1.dtype = DType::kInt4x2;  // NVFP4 weights expected
  expect_error(cs, p, "w1", qmoe::ErrorKind::kType);
}
TEST_F(FusedMoeValidation, Relu2TakesIRows) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.activation = Activation::kRelu2;  // W1 still has 2I rows
  expect_error(cs, p, "w1");
}
TEST_F(FusedMoeValidation, Int4HiddenMultipleOf128) {
  Case cs = make(QuantMode::kW4A8Int4);
  auto p = cs.params();
  p.w2 = qmoe::make_tensor(cs.w2.packed.data(), DType::kInt4x2, {4, 64, 64});  // H = 64
  expect_error(cs, p, "w2");
}
TEST_F(FusedMoeValidation, MxIntermediateMultipleOf32) {
  Case cs = make(QuantMode::kW4A8Mx);
  auto p = cs.params();
  p.w2 = qmoe::make_tensor(cs.w2.packed.data(), DType::kFloat4E2M1x2, {4, 128, 24});  // I = 48
  expect_error(cs, p, "w2");
}
TEST_F(FusedMoeValidation, SwizzledScaleShape) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.w1_scale = qmoe::make_tensor(cs.w1.stored8.data(), DType::kFloat8E4M3, {4, 256, 8});  // unpadded cols 8: ok
  EXPECT_NO_THROW(qmoe::validate_fused_moe(p));
  p.w2_scale = qmoe::make_tensor(cs.w2.stored8.data(), DType::kFloat8E4M3, {4, 128, 8});  // I/16 = 8 ok
  EXPECT_NO_THROW(qmoe::validate_fused_moe(p));
  p.w2_scale = qmoe::make_tensor(cs.w2.stored8.data(), DType::kFloat8E4M3, {4, 120, 8});  // rows not padded
  expect_error(cs, p, "w2_scale");
}
TEST_F(FusedMoeValidation, WeightScaleDtype) {
  Case cs = make(QuantMode::kW4A8Mx);
  auto p = cs.params();
  p.w2_scale.dtype = DType::kFloat8E4M3;  // MX needs ue8m0
  expect_error(cs, p, "w2_scale", qmoe::ErrorKind::kType);
}
TEST_F(FusedMoeValidation, Int4ScaleLayoutFollowsK) {
  Config c;
  c.mode = QuantMode::kW4A8Int4;
  c.H = 512;
  c.T = 2;
  Case cs = make_case(c, 98);
  auto p = cs.params();
  p.w1_scale = qmoe::make_tensor(cs.w1.stored16.data(), DType::kBFloat16, {4, 4, 256});  // [E, K/128, N]
  expect_error(cs, p, "w1_scale");
}
TEST_F(FusedMoeValidation, XDtypePerMode) {
  Case cs = make(QuantMode::kW4A16);
  auto p = cs.params();
  p.x.dtype = DType::kFloat16;
  expect_error(cs, p, "x", qmoe::ErrorKind::kType);
}
TEST_F(FusedMoeValidation, XShape) {
  Case cs = make(QuantMode::kW4A8Mx);
  auto p = cs.params();
  p.x = qmoe::make_tensor(cs.x8.data(), DType::kFloat8E4M3, {2, 64});
  expect_error(cs, p, "x");
}
TEST_F(FusedMoeValidation, XScaleRequiredForW4A4) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.x_scale.reset();
  expect_error(cs, p, "x_scale");
}
TEST_F(FusedMoeValidation, XScaleForbiddenForW4A16) {
  Case cs = make(QuantMode::kW4A16);
  std::vector<float> s = {1.0f};
  auto p = cs.params();
  p.x_scale = qmoe::make_tensor(s.data(), DType::kFloat32, {1});
  expect_error(cs, p, "x_scale");
}
TEST_F(FusedMoeValidation, XScaleRequiredForPrequantizedX) {
  Case cs = make(QuantMode::kW4A8Int4);
  std::vector<uint8_t> x8(2 * 128, 0x38);
  auto p = cs.params();
  p.x = qmoe::make_tensor(x8.data(), DType::kFloat8E4M3, {2, 128});
  p.x_scale.reset();  // dynamic is only possible for a bf16 x
  expect_error(cs, p, "x_scale");
}
TEST_F(FusedMoeValidation, XScaleLength) {
  Case cs = make(QuantMode::kW4A8Int4);
  std::vector<float> s(3, 0.01f);
  auto p = cs.params();
  p.x_scale = qmoe::make_tensor(s.data(), DType::kFloat32, {3});  // neither [1] nor [T = 2]
  expect_error(cs, p, "x_scale");
}
TEST_F(FusedMoeValidation, XScaleDtypeForMx) {
  Case cs = make(QuantMode::kW4A8Mx);
  auto p = cs.params();
  p.x_scale->dtype = DType::kFloat8E4M3;
  expect_error(cs, p, "x_scale", qmoe::ErrorKind::kType);
}
TEST_F(FusedMoeValidation, Fc2InputScaleRequiredForW4A4) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.fc2_input_scale.reset();
  expect_error(cs, p, "fc2_input_scale");
}
TEST_F(FusedMoeValidation, Fc2InputScaleForbiddenForW4A8) {
  Case cs = make(QuantMode::kW4A8Mx);
  std::vector<float> s = {1.0f};
  auto p = cs.params();
  p.fc2_input_scale = qmoe::make_tensor(s.data(), DType::kFloat32, {1});
  expect_error(cs, p, "fc2_input_scale");
}
TEST_F(FusedMoeValidation, Fc2InputScaleForbiddenForW4A16) {
  Case cs = make(QuantMode::kW4A16Int4);
  std::vector<float> s = {1.0f};
  auto p = cs.params();
  p.fc2_input_scale = qmoe::make_tensor(s.data(), DType::kFloat32, {1});
  expect_error(cs, p, "fc2_input_scale");
}
TEST_F(FusedMoeValidation, Fc2InputScaleShape) {
  Case cs = make(QuantMode::kW4A8Int4);
  std::vector<float> s = {1.0f, 1.0f};
  auto p = cs.params();
  p.fc2_input_scale = qmoe::make_tensor(s.data(), DType::kFloat32, {2});
  expect_error(cs, p, "fc2_input_scale");
}
TEST_F(FusedMoeValidation, PerTokenScaleOnlyForW4A4) {
  Case cs = make(QuantMode::kW4A8Int4);
  std::vector<float> s = {1.0f, 1.0f};
  auto p = cs.params();
  p.per_token_scale = qmoe::make_tensor(s.data(), DType::kFloat32, {2});
  expect_error(cs, p, "per_token_scale");
}
TEST_F(FusedMoeValidation, PerTokenScaleShape) {
  Case cs = make(QuantMode::kW4A4);
  std::vector<float> s = {1.0f};
  auto p = cs.params();
  p.per_token_scale = qmoe::make_tensor(s.data(), DType::kFloat32, {1});
  expect_error(cs, p, "per_token_scale");
}
TEST_F(FusedMoeValidation, AlphasRequiredForNvfp4Weights) {
  Case cs = make(QuantMode::kW4A16);
  auto p = cs.params();
  p.w1_alpha.reset();
  expect_error(cs, p, "w1_alpha");
}
TEST_F(FusedMoeValidation, AlphaShape) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.w2_alpha = qmoe::make_tensor(cs.w2a.data(), DType::kFloat32, {3});
  expect_error(cs, p, "w2_alpha");
}
TEST_F(FusedMoeValidation, SituLinearBetaOnlyWithSitu) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.situ_linear_beta = 1.5f;
  expect_error(cs, p, "situ_linear_beta");
}
TEST_F(FusedMoeValidation, SituBetaPositive) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.activation = Activation::kSitu;
  p.situ_beta = 0.0f;
  expect_error(cs, p, "situ_beta");
}
TEST_F(FusedMoeValidation, SituLinearBetaPositive) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.activation = Activation::kSitu;
  p.situ_linear_beta = -1.0f;
  expect_error(cs, p, "situ_linear_beta");
}
TEST_F(FusedMoeValidation, SwigluParamsOnlyWithSwiglu) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.activation = Activation::kGegluTanh;
  p.swiglu_alpha = 1.702f;
  expect_error(cs, p, "swiglu_alpha");
}
TEST_F(FusedMoeValidation, SwigluLimitPositive) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.swiglu_limit = 0.0f;
  expect_error(cs, p, "swiglu_limit");
}
TEST_F(FusedMoeValidation, InterleavedLayoutNeedsI64) {
  Config c;
  c.mode = QuantMode::kW4A4;
  c.H = 128;
  c.I = 48;
  c.T = 2;
  Case cs = make_case(c, 97);
  auto p = cs.params();
  p.gate_up_layout = GateUpLayout::kUpGateInterleaved64;
  expect_error(cs, p, "gate_up_layout");
}
TEST_F(FusedMoeValidation, Relu2IgnoresLayout) {
  Config c;
  c.mode = QuantMode::kW4A4;
  c.act = Activation::kRelu2;
  c.H = 128;
  c.I = 48;
  c.T = 2;
  Case a = make_case(c, 96);
  Case b = a;
  b.c.layout = GateUpLayout::kUpGateInterleaved64;
  qmoe::fused_moe(a.params());
  qmoe::fused_moe(b.params());
  EXPECT_EQ(a.out, b.out);
}
TEST_F(FusedMoeValidation, RoutedScalingFactorFinite) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.routed_scaling_factor = std::numeric_limits<float>::quiet_NaN();
  expect_error(cs, p, "routed_scaling_factor");
}
TEST_F(FusedMoeValidation, OutputDtype) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.output.dtype = DType::kInt32;
  expect_error(cs, p, "output", qmoe::ErrorKind::kType);
}
TEST_F(FusedMoeValidation, OutputShape) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.output = qmoe::make_tensor(cs.out.data(), DType::kFloat32, {2, 64});
  expect_error(cs, p, "output");
}
TEST_F(FusedMoeValidation, OutputMustNotAlias) {
  Case cs = make(QuantMode::kW4A16);
  auto p = cs.params();
  p.output = qmoe::make_tensor(cs.x16.data(), DType::kBFloat16, {2, 128});
  const std::vector<uint16_t> before = cs.x16;
  expect_error(cs, p, "output", qmoe::ErrorKind::kValue, false);
  EXPECT_EQ(before, cs.x16);
}
TEST_F(FusedMoeValidation, Contiguous) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  std::swap(p.w2.strides[1], p.w2.strides[2]);
  expect_error(cs, p, "w2");
}
TEST_F(FusedMoeValidation, NullData) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.w2_scale.data = nullptr;
  expect_error(cs, p, "w2_scale");
}
TEST_F(FusedMoeValidation, SameDevice) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.w1.device = Device::kCUDA;
  expect_error(cs, p, "w1");
}
TEST_F(FusedMoeValidation, EnumRange) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.quant_mode = static_cast<QuantMode>(9);
  expect_error(cs, p, "quant_mode");
}
TEST_F(FusedMoeValidation, TacticOnCpu) {
  Case cs = make(QuantMode::kW4A4);
  auto p = cs.params();
  p.tactic = "decode_m64_n16_k128";
  expect_error(cs, p, "tactic");
}
// CUDA tensors: every quant mode has a GPU pipeline (w4a8_int4 its own, the others the bf16 x
// 4-bit one), which needs its workspace; the GPU-only limits are refused by name before anything.
void move_to_cuda(FusedMoeParams& p) {
  for (TensorRef* t : {&p.x, &p.topk_ids, &p.topk_weights, &p.w1, &p.w1_scale, &p.w2, &p.w2_scale, &p.output})
    t->device = Device::kCUDA;
  for (auto* t : {&p.x_scale, &p.fc2_input_scale, &p.w1_alpha, &p.w2_alpha, &p.per_token_scale})
    if (t->has_value()) (*t)->device = Device::kCUDA;
}

const QuantMode kBf16PipelineModes[] = {QuantMode::kW4A16, QuantMode::kW4A16Int4, QuantMode::kW4A4,
                                        QuantMode::kW4A8Mx};

TEST_F(FusedMoeValidation, CudaBf16W4ModesNeedTheirWorkspace) {
  for (QuantMode m : kBf16PipelineModes) {
    for (Activation act : {Activation::kSwiglu, Activation::kRelu2}) {
      Case cs = make(m, act);
      auto p = cs.params();
      move_to_cuda(p);
      // The exact size of the bf16 x 4-bit layout (S = T * k slots, R1 = 2I gated / I).
      const int64_t slots = cs.c.T * cs.c.k, rows1 = cs.rows1();
      const int64_t expected =
          qmoe::cuda::fused_moe_bf16_w4_workspace_layout(slots, cs.El, cs.c.H, cs.c.I, rows1).total;
      EXPECT_EQ(qmoe::fused_moe_workspace_size(p), expected) << qmoe::quant_mode_name(m);
      EXPECT_GE(expected, 2 * slots * (cs.c.H + cs.c.I) + 4 * slots * rows1);
      if (qmoe::cuda::kernels_built()) {
        expect_error(cs, p, "workspace", qmoe::ErrorKind::kValue);
      } else {
        expect_error(cs, p, "fused_moe", qmoe::ErrorKind::kRuntime);
      }
    }
  }
}

TEST_F(FusedMoeValidation, CudaW4A4PerTokenNeedsItsWorkspace) {
  Config c;
  c.mode = QuantMode::kW4A4;
  c.per_token = true;
  c.H = 128;
  c.I = 128;
  c.T = 2;
  Case cs = make_case(c, 5);
  auto p = cs.params();
  ASSERT_TRUE(p.per_token_scale.has_value());
  move_to_cuda(p);
  EXPECT_GT(qmoe::fused_moe_workspace_size(p), 0);
  expect_error(cs, p, qmoe::cuda::kernels_built() ? "workspace" : "fused_moe",
               qmoe::cuda::kernels_built() ? qmoe::ErrorKind::kValue : qmoe::ErrorKind::kRuntime);
}

// fused_moe_workspace_bound(max T) covers the exact size of every call with T <= max tokens, in every
// mode and both W1 shapes, and equals it at T = max (what a graph-ready wrapper allocates once).
TEST_F(FusedMoeValidation, WorkspaceBoundCoversEverySmallerCall) {
  for (QuantMode m : {QuantMode::kW4A8Int4, QuantMode::kW4A16, QuantMode::kW4A16Int4, QuantMode::kW4A4,
                      QuantMode::kW4A8Mx}) {
    for (Activation act : {Activation::kSwiglu, Activation::kRelu2}) {
      for (int64_t tokens : {1, 3, 8}) {
        Config c;
        c.mode = m;
        c.act = act;
        c.T = tokens;
        Case cs = make_case(c, 7);
        auto p = cs.params();
        move_to_cuda(p);
        const int64_t exact = qmoe::fused_moe_workspace_size(p);
        const int64_t at_t = qmoe::fused_moe_workspace_bound(m, tokens, cs.c.k, cs.El, cs.c.H, cs.c.I, act);
        const int64_t at_max = qmoe::fused_moe_workspace_bound(m, 8, cs.c.k, cs.El, cs.c.H, cs.c.I, act);
        EXPECT_EQ(at_t, exact) << qmoe::quant_mode_name(m) << " T=" << tokens;
        EXPECT_GE(at_max, exact) << qmoe::quant_mode_name(m) << " T=" << tokens;
      }
    }
  }
  EXPECT_THROW(qmoe::fused_moe_workspace_bound(QuantMode::kW4A4, -1, 8, 8, 256, 128, Activation::kSwiglu),
               qmoe::Error);
  try {
    qmoe::fused_moe_workspace_bound(QuantMode::kW4A4, 4, 8, 2000, 256, 128, Activation::kSwiglu);
    ADD_FAILURE() << "no error for 2000 local experts";
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), "num_local_experts");
  }
}

// NVFP4 weights validate with H, I % 16 == 0; the GPU's FP4 GEMM needs 32 (both names say "w2").
TEST_F(FusedMoeValidation, CudaFp4ModesNeedHAndIMultiplesOf32) {
  for (QuantMode m : {QuantMode::kW4A4, QuantMode::kW4A16}) {
    for (auto [H, I] : {std::pair<int64_t, int64_t>{144, 128}, {128, 80}}) {
      Config c;
      c.mode = m;
      c.H = H;
      c.I = I;
      c.T = 2;
      Case cs = make_case(c, 6);
      auto p = cs.params();
      EXPECT_NO_THROW(qmoe::validate_fused_moe(p));  // fine on the CPU
      move_to_cuda(p);
      expect_error(cs, p, "w2");
      try {
        qmoe::fused_moe_workspace_size(p);
        ADD_FAILURE() << "no workspace_size error for H = " << H << ", I = " << I;
      } catch (const qmoe::Error& e) {
        EXPECT_EQ(e.argument(), "w2") << e.what();
        EXPECT_NE(std::string(e.what()).find(H % 32 ? "H = 144" : "I = 80"), std::string::npos) << e.what();
      }
    }
  }
}

// The bf16 x 4-bit pipeline gathers x in 16-byte chunks; w4a8_int4 reads it bytewise.
TEST_F(FusedMoeValidation, CudaBf16W4NeedsAlignedX) {
  for (QuantMode m : kBf16PipelineModes) {
    Case cs = make(m);
    auto p = cs.params();
    move_to_cuda(p);
    p.x.data = static_cast<uint8_t*>(p.x.data) + 1;  // never dereferenced: refused before any work
    expect_error(cs, p, "x");
  }
  Case cs = make(QuantMode::kW4A8Int4);
  auto p = cs.params();
  move_to_cuda(p);
  p.x.data = static_cast<uint16_t*>(p.x.data) + 1;
  expect_error(cs, p, qmoe::cuda::kernels_built() ? "workspace" : "fused_moe",
               qmoe::cuda::kernels_built() ? qmoe::ErrorKind::kValue : qmoe::ErrorKind::kRuntime);
}

TEST_F(FusedMoeValidation, CudaMisalignedWeightScaleNamed) {
  Case cs = make(QuantMode::kW4A8Mx);
  auto p = cs.params();
  move_to_cuda(p);
  p.w2_scale.data = static_cast<uint8_t*>(p.w2_scale.data) + 4;
  expect_error(cs, p, "w2_scale");
}

TEST_F(FusedMoeValidation, CudaW4A8Int4NeedsItsWorkspace) {
  Case cs = make(QuantMode::kW4A8Int4);
  auto p = cs.params();
  move_to_cuda(p);
  if (qmoe::cuda::kernels_built()) {
    EXPECT_GT(qmoe::fused_moe_workspace_size(p), 0);
    expect_error(cs, p, "workspace", qmoe::ErrorKind::kValue);
  } else {
    expect_error(cs, p, "fused_moe", qmoe::ErrorKind::kRuntime);
  }
}

}  // namespace
