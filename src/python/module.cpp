// qmoe._C: the nanobind extension. Only argument marshalling lives here; every check and all
// the work happen in the C++ library.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "python/tensor_arg.h"
#include "qmoe/error.h"
#include "qmoe/sm_limit.h"

namespace qmoe::python {

Arg::Arg(nb::ndarray<nb::ro> a, const std::string& dtype) : array(a) {
  DType d;
  check_arg(dtype_from_name(dtype, &d), "dtype", "a qmoe dtype name", "'" + dtype + "'", ErrorKind::kType);
  const int64_t itemsize = static_cast<int64_t>(a.itemsize());
  check_arg(itemsize == dtype_size(d), "dtype",
            std::to_string(dtype_size(d)) + "-byte storage for logical dtype " + dtype,
            std::to_string(itemsize) + "-byte storage", ErrorKind::kType);
  check_arg(static_cast<int>(a.ndim()) <= kMaxDims, "tensor", "at most 8 dimensions", std::to_string(a.ndim()));
  // Read-only arrays are accepted (inputs); the Python layer refuses a read-only output.
  ref.data = const_cast<void*>(a.data());
  ref.dtype = d;
  ref.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < ref.ndim; ++i) {
    ref.shape[i] = static_cast<int64_t>(a.shape(i));
    ref.strides[i] = static_cast<int64_t>(a.stride(i));
  }
  const int device_type = a.device_type();
  if (device_type == nb::device::cpu::value) {
    ref.device = Device::kCPU;
  } else if (device_type == nb::device::cuda::value) {
    ref.device = Device::kCUDA;
  } else {
    throw Error("tensor", "a CPU or CUDA tensor", "DLPack device type " + std::to_string(device_type));
  }
  ref.device_index = a.device_id();
}

}  // namespace qmoe::python

NB_MODULE(_C, m) {
  using namespace qmoe::python;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const qmoe::Error& e) {
      PyObject* type = e.kind() == qmoe::ErrorKind::kType    ? PyExc_TypeError
                       : e.kind() == qmoe::ErrorKind::kValue ? PyExc_ValueError
                                                             : PyExc_RuntimeError;
      PyErr_SetString(type, e.what());
    }
  });
  nb::class_<Arg>(m, "Arg")
      .def(nb::init<nb::ndarray<nb::ro>, const std::string&>(), nb::arg("array"), nb::arg("dtype"))
      .def_prop_ro("dtype", [](const Arg& a) { return std::string(qmoe::dtype_name(a.ref.dtype)); })
      .def_prop_ro("shape", [](const Arg& a) {
        nb::list l;
        for (int i = 0; i < a.ref.ndim; ++i) l.append(a.ref.shape[i]);
        return nb::tuple(l);
      });
  m.attr("__version__") = "0.1.0";
  bind_formats(m);
  bind_ops(m);
  // include/qmoe/sm_limit.h: per host thread (nanobind calls run in the calling Python thread).
  m.def("set_sm_limit", &qmoe::set_sm_limit, nb::arg("sms"));
  m.def("sm_limit", &qmoe::sm_limit);
}
