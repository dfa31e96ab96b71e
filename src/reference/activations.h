// MoE activations (DESIGN.md section 4), shared by the CPU reference and, later, the CUDA epilogues
// (QMOE_HD). g = gate half, u = up half of GEMM1's output, both after alpha1. Templates on the
// arithmetic type: kernels use float; the CPU reference evaluates in double and rounds the result
// once to fp32, as the numpy twin (python/qmoe/reference.py) does, so the two agree to the bit in
// practice. Products are evaluated left to right exactly as written:
//
//   sigmoid(x)            = 1 / (1 + exp(-x))
//   swiglu(g, u; a, b, L) = g' * sigmoid(a * g') * (u' + b),  g' = min(g, L), u' = clamp(u, -L, L)
//                           (a, b, L) = (1, 0, FLT_MAX) is plain silu(g) * u; gpt-oss uses (1.702, 1, 7)
//   geglu_tanh(g, u)      = 0.5 * g * (1 + tanh(0.7978845608 * (g + 0.044715 * g * g * g))) * u
//   relu2(a)              = max(a, 0) * max(a, 0)            (not gated: one input)
//   situ(g, u; b, lb)     = b * tanh(g / b) * sigmoid(g) * u',  u' = lb * tanh(u / lb) if lb given else u
//
// Clamps are written as comparisons, not fmin/fmax, so a NaN input stays NaN (DESIGN.md 3b:
// a NaN is never hidden).
#pragma once

#include <cmath>

#include "qmoe/formats.h"  // QMOE_HD

namespace qmoe::activation {

// exp / tanh overloads that resolve to the float or double device builtins under nvcc.
QMOE_HD float exp_of(float x) { return expf(x); }
QMOE_HD double exp_of(double x) { return exp(x); }
QMOE_HD float tanh_of(float x) { return tanhf(x); }
QMOE_HD double tanh_of(double x) { return tanh(x); }

template <class T>
QMOE_HD T sigmoid(T x) {
  return T(1) / (T(1) + exp_of(-x));
}

template <class T>
QMOE_HD T swiglu(T g, T u, T alpha, T beta, T limit) {
  const T gc = g > limit ? limit : g;                          // upper clamp only
  const T uc = u > limit ? limit : (u < -limit ? -limit : u);  // both sides
  return gc * sigmoid(alpha * gc) * (uc + beta);
}

template <class T>
QMOE_HD T geglu_tanh(T g, T u) {
  return T(0.5) * g * (T(1) + tanh_of(T(0.7978845608) * (g + T(0.044715) * g * g * g))) * u;
}

template <class T>
QMOE_HD T relu2(T a) {
  const T r = a < T(0) ? T(0) : a;  // NaN fails the comparison and passes through
  return r * r;
}

// has_linear_beta selects u' = linear_beta * tanh(u / linear_beta); otherwise u' = u.
template <class T>
QMOE_HD T situ(T g, T u, T beta, bool has_linear_beta, T linear_beta) {
  const T up = has_linear_beta ? linear_beta * tanh_of(u / linear_beta) : u;
  return beta * tanh_of(g / beta) * sigmoid(g) * up;
}

}  // namespace qmoe::activation
