// MoE activations on fp32 scalars (DESIGN.md section 4), shared by the CPU reference and, later,
// the CUDA epilogues (QMOE_HD). g = gate half, u = up half of GEMM1's output, both after alpha1.
// Products are evaluated left to right exactly as written below, so a twin (numpy) can mirror them:
//
//   sigmoid(x)            = 1 / (1 + exp(-x))
//   swiglu(g, u; a, b, L) = g' * sigmoid(a * g') * (u' + b),  g' = min(g, L), u' = clamp(u, -L, L)
//                           (a, b, L) = (1, 0, FLT_MAX) is plain silu(g) * u; gpt-oss uses (1.702, 1, 7)
//   geglu_tanh(g, u)      = 0.5 * g * (1 + tanh(0.7978845608 * (g + 0.044715 * g * g * g))) * u
//   relu2(a)              = max(a, 0) * max(a, 0)            (not gated: one input)
//   situ(g, u; b, lb)     = b * tanh(g / b) * sigmoid(g) * u',  u' = lb * tanh(u / lb) if lb given else u
//
// Clamps are written as comparisons, not fminf/fmaxf, so a NaN input stays NaN (DESIGN.md 3b:
// a NaN is never hidden).
#pragma once

#include <cmath>

#include "qmoe/formats.h"  // QMOE_HD

namespace qmoe::activation {

QMOE_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

QMOE_HD float swiglu(float g, float u, float alpha, float beta, float limit) {
  const float gc = g > limit ? limit : g;                              // upper clamp only
  const float uc = u > limit ? limit : (u < -limit ? -limit : u);      // both sides
  return gc * sigmoid(alpha * gc) * (uc + beta);
}

QMOE_HD float geglu_tanh(float g, float u) {
  return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g))) * u;
}

QMOE_HD float relu2(float a) {
  const float r = a < 0.0f ? 0.0f : a;  // NaN fails the comparison and passes through
  return r * r;
}

// has_linear_beta selects u' = linear_beta * tanh(u / linear_beta); otherwise u' = u.
QMOE_HD float situ(float g, float u, float beta, bool has_linear_beta, float linear_beta) {
  const float up = has_linear_beta ? linear_beta * tanhf(u / linear_beta) : u;
  return beta * tanhf(g / beta) * sigmoid(g) * up;
}

}  // namespace qmoe::activation
