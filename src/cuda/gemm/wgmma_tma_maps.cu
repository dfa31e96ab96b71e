// Host side of the WGMMA kernels' TMA stages (wgmma_tma.cuh): the tensor maps of A, B and the scales,
// encoded per call with cuTensorMapEncodeTiled, which is looked up through the runtime.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda/gemm/wgmma_tma.cuh"
#include "cuda/launch.h"  // check_cuda
#include "qmoe/error.h"

namespace qmoe::cuda {
namespace {

// cuTensorMapEncodeTiled from the driver, looked up once (the library links only the CUDA runtime).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found),
               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    QMOE_CHECK_ARG(found == cudaDriverEntryPointSuccess && f != nullptr, "driver",
                   "a CUDA driver with cuTensorMapEncodeTiled (CUDA 12+)", "none");
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

}  // namespace

CUtensorMap tma_matrix_map(const void* base, CUtensorMapDataType type, int elem_bytes, int64_t rows, int64_t cols,
                       int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * elem_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  QMOE_CHECK_ARG(r == CUDA_SUCCESS, "tensor map", "cuTensorMapEncodeTiled to accept the operand",
                 "error " + std::to_string(static_cast<int>(r)));
  return map;
}

// Packed-4 scales: one weight row's 4 bf16 in 8 bytes (an int64 element).
template <class Base>
WithTmaMaps<Base> tma_params(const Base& params, int64_t rows, int tile_n) {
  using wgmma::kGroup;
  constexpr int kBoxRows = wgmma::kWeightBoxRows<Base>;
  WithTmaMaps<Base> tp;
  static_cast<Base&>(tp) = params;
  const int64_t experts = params.num_experts;
  tp.act_map = tma_matrix_map(params.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, rows, params.k, tile_n, kGroup,
                              CU_TENSOR_MAP_SWIZZLE_128B);
  tp.weight_map = tma_matrix_map(params.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, experts * params.n, params.k / 2, kBoxRows,
                                 kGroup / 2, CU_TENSOR_MAP_SWIZZLE_64B);
  tp.scale_map = params.scales_packed4
                     ? tma_matrix_map(params.b_scales, CU_TENSOR_MAP_DATA_TYPE_INT64, 8, experts * (params.k / 512),
                                      params.n, 1, kBoxRows, CU_TENSOR_MAP_SWIZZLE_NONE)
                     : tma_matrix_map(params.b_scales, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2,
                                      experts * (params.k / kGroup), params.n, 1, kBoxRows, CU_TENSOR_MAP_SWIZZLE_NONE);
  return tp;
}

template WithTmaMaps<WgmmaGemmParams> tma_params(const WgmmaGemmParams&, int64_t, int);
template WithTmaMaps<WgmmaActGemmParams> tma_params(const WgmmaActGemmParams&, int64_t, int);

}  // namespace qmoe::cuda
