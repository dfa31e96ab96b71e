// The NCCL transport of expert parallelism (docs/expert-parallel.md): grouped point-to-point
// exchanges on the caller's communicator and stream. libnccl is loaded with dlopen at first use,
// so qmoe links, imports and runs its single-GPU and CPU paths on machines without NCCL.
//
// Library search (first hit wins): the QMOE_NCCL_LIBRARY environment variable (a path); then
// "libnccl.so.2" through the dynamic loader's default search (LD_LIBRARY_PATH, the CUDA toolkit's
// ldconfig entry, a library torch already loaded); then <dir>/libnccl.so.2 for the directory given
// to set_nccl_search_dir (Python passes the nvidia-nccl wheel's lib directory). If none loads, every
// entry below throws a kRuntime qmoe::Error that lists what was tried.
//
// Communicators are opaque pointers (ncclComm_t); streams are cudaStream_t. Nothing here allocates
// device memory or synchronizes the host: nccl_all_to_all_v only enqueues work on `stream`, so it
// can be captured in a CUDA graph when the communicator allows it.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "qmoe/error.h"  // every entry throws qmoe::Error

namespace qmoe::ep {

constexpr int kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES of the public API
using NcclUniqueId = std::array<char, kNcclUniqueIdBytes>;

void set_nccl_search_dir(const std::string& dir);
// True when libnccl loads (never throws); nccl_library() then names the file that loaded.
bool nccl_available();
std::string nccl_library();
int nccl_version();  // e.g. 22809 for 2.28.9

NcclUniqueId nccl_get_unique_id();
// ncclCommInitRank; returns the ncclComm_t as an opaque pointer.
void* nccl_comm_init_rank(int world_size, const NcclUniqueId& id, int rank);
void nccl_comm_destroy(void* comm);

// One peer's part of an exchange: `send_bytes` bytes from `send` go to the peer, `recv_bytes` bytes
// from the peer land in `recv`. Device pointers. Zero sizes are skipped (no NCCL call).
struct PeerTransfer {
  const void* send = nullptr;
  int64_t send_bytes = 0;
  void* recv = nullptr;
  int64_t recv_bytes = 0;
};

// peers[p] for p in [0, world_size): ncclGroupStart; ncclSend / ncclRecv (ncclUint8) per peer, this
// rank included (NCCL copies a self send/recv pair); ncclGroupEnd. Both sides must agree on sizes.
void nccl_all_to_all_v(void* comm, const std::vector<PeerTransfer>& peers, cudaStream_t stream);

}  // namespace qmoe::ep
