// The part of NCCL's public C API that qmoe calls through dlopen (src/core/nccl_transport.cpp),
// declared here so that qmoe builds without nccl.h. Values and signatures follow the public
// nccl.h (NCCL >= 2.7, unchanged since); src/core/nccl_abi_check.cpp static_asserts them against
// the real header whenever the build can see one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace qmoe::ep::nccl_abi {

using Comm = struct ncclComm_opaque*;  // ncclComm_t: an opaque pointer
struct UniqueId {
  char internal[128];  // NCCL_UNIQUE_ID_BYTES
};
enum Result : int { kSuccess = 0 };  // ncclResult_t; other values are errors (ncclGetErrorString)
enum DataType : int { kUint8 = 1 };  // ncclDataType_t: ncclInt8 = 0, ncclUint8 = 1, ...

using GetVersionFn = Result (*)(int* version);
using GetUniqueIdFn = Result (*)(UniqueId* id);
using CommInitRankFn = Result (*)(Comm* comm, int nranks, UniqueId id, int rank);
using CommDestroyFn = Result (*)(Comm comm);
using GetErrorStringFn = const char* (*)(Result result);
using GroupFn = Result (*)();
using SendFn = Result (*)(const void* buff, size_t count, DataType type, int peer, Comm comm, cudaStream_t stream);
using RecvFn = Result (*)(void* buff, size_t count, DataType type, int peer, Comm comm, cudaStream_t stream);

}  // namespace qmoe::ep::nccl_abi
