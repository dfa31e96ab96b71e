// Compile-time check of src/core/nccl_abi.h against the real nccl.h, when the build sees one (the
// CUDA toolkit ships it in recent versions). Declares nothing; without nccl.h it is an empty file.
#if __has_include(<nccl.h>)
#include <nccl.h>

#include <type_traits>

#include "core/nccl_abi.h"

namespace abi = qmoe::ep::nccl_abi;

static_assert(NCCL_UNIQUE_ID_BYTES == sizeof(abi::UniqueId::internal), "NCCL unique id size");
static_assert(sizeof(ncclUniqueId) == sizeof(abi::UniqueId), "ncclUniqueId is passed by value");
static_assert(static_cast<int>(ncclSuccess) == abi::kSuccess, "ncclSuccess");
static_assert(static_cast<int>(ncclUint8) == abi::kUint8, "ncclUint8");
static_assert(sizeof(ncclResult_t) == sizeof(abi::Result), "ncclResult_t is returned by value");
static_assert(sizeof(ncclDataType_t) == sizeof(abi::DataType), "ncclDataType_t is passed by value");
static_assert(sizeof(ncclComm_t) == sizeof(abi::Comm), "ncclComm_t is a pointer");
// Signatures: the function types of the real declarations, with our types substituted.
static_assert(std::is_same_v<decltype(&ncclGetVersion), ncclResult_t (*)(int*)>, "ncclGetVersion");
static_assert(std::is_same_v<decltype(&ncclGetUniqueId), ncclResult_t (*)(ncclUniqueId*)>, "ncclGetUniqueId");
static_assert(std::is_same_v<decltype(&ncclCommInitRank), ncclResult_t (*)(ncclComm_t*, int, ncclUniqueId, int)>,
              "ncclCommInitRank");
static_assert(std::is_same_v<decltype(&ncclCommDestroy), ncclResult_t (*)(ncclComm_t)>, "ncclCommDestroy");
static_assert(std::is_same_v<decltype(&ncclGetErrorString), const char* (*)(ncclResult_t)>, "ncclGetErrorString");
static_assert(std::is_same_v<decltype(&ncclGroupStart), ncclResult_t (*)()>, "ncclGroupStart");
static_assert(std::is_same_v<decltype(&ncclGroupEnd), ncclResult_t (*)()>, "ncclGroupEnd");
static_assert(std::is_same_v<decltype(&ncclSend), ncclResult_t (*)(const void*, size_t, ncclDataType_t, int, ncclComm_t,
                                                                   cudaStream_t)>,
              "ncclSend");
static_assert(std::is_same_v<decltype(&ncclRecv),
                             ncclResult_t (*)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t)>,
              "ncclRecv");
#endif
