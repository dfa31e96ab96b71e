// The bridge between DLPack arrays and TensorRef. Python passes every tensor as
// _C.Arg(array, logical_dtype): the array is the storage (possibly a same-size integer view,
// for dtypes a framework cannot export), the name is its logical dtype. The pair is checked
// here (storage item size == logical element size); nothing is guessed.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>
#include <string>

#include "qmoe/tensor.h"

namespace qmoe::python {

namespace nb = nanobind;

struct Arg {
  nb::ndarray<nb::ro> array;  // keeps the storage alive for the call
  TensorRef ref;
  Arg(nb::ndarray<nb::ro> a, const std::string& dtype);
};

inline std::optional<TensorRef> opt_ref(const std::optional<Arg*>& a) {
  if (a.has_value() && *a != nullptr) return (*a)->ref;
  return std::nullopt;
}

void bind_formats(nb::module_& m);
void bind_ops(nb::module_& m);

}  // namespace qmoe::python
