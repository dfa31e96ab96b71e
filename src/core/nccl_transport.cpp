// dlopen-based NCCL transport (include/qmoe/nccl_transport.h). The few C entry points used are
// declared below from the public NCCL API (nccl.h), so this file compiles without NCCL installed;
// src/core/nccl_abi_check.cpp checks the declarations against the real header when one is present.
// NOTE: the loaded library is never dlclose'd: communicators may outlive any owner we could name.
#include "qmoe/nccl_transport.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "core/nccl_abi.h"
#include "qmoe/error.h"

namespace qmoe::ep {

namespace {

using namespace nccl_abi;

struct NcclApi {
  void* handle = nullptr;
  std::string path;
  GetVersionFn get_version = nullptr;
  GetUniqueIdFn get_unique_id = nullptr;
  CommInitRankFn comm_init_rank = nullptr;
  CommDestroyFn comm_destroy = nullptr;
  GetErrorStringFn get_error_string = nullptr;
  GroupFn group_start = nullptr;
  GroupFn group_end = nullptr;
  SendFn send = nullptr;
  RecvFn recv = nullptr;
};

std::mutex g_mutex;
NcclApi g_api;  // filled once a load succeeds; a failed load is retried on the next call
std::string g_search_dir;

template <class Fn>
bool bind_symbol(void* handle, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*out == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *out != nullptr;
}

// Tries one candidate; on success fills g_api. `tried` collects the reasons of failures.
bool try_load(const std::string& candidate, std::string* tried) {
  void* h = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* why = dlerror();
    *tried += "\n  " + candidate + ": " + (why ? why : "dlopen failed");
    return false;
  }
  NcclApi api;
  std::string missing;
  bool ok = bind_symbol(h, "ncclGetVersion", &api.get_version, &missing);
  ok &= bind_symbol(h, "ncclGetUniqueId", &api.get_unique_id, &missing);
  ok &= bind_symbol(h, "ncclCommInitRank", &api.comm_init_rank, &missing);
  ok &= bind_symbol(h, "ncclCommDestroy", &api.comm_destroy, &missing);
  ok &= bind_symbol(h, "ncclGetErrorString", &api.get_error_string, &missing);
  ok &= bind_symbol(h, "ncclGroupStart", &api.group_start, &missing);
  ok &= bind_symbol(h, "ncclGroupEnd", &api.group_end, &missing);
  ok &= bind_symbol(h, "ncclSend", &api.send, &missing);
  ok &= bind_symbol(h, "ncclRecv", &api.recv, &missing);
  if (!ok) {
    *tried += "\n  " + candidate + ": loaded, but lacks " + missing + " (NCCL >= 2.7 is needed for send/recv)";
    dlclose(h);
    return false;
  }
  api.handle = h;
  api.path = candidate;
  g_api = api;
  return true;
}

// Loads libnccl if needed; returns nullptr (and the reasons in *tried) when it cannot.
const NcclApi* load(std::string* tried) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_api.handle != nullptr) return &g_api;
  if (const char* env = std::getenv("QMOE_NCCL_LIBRARY"); env != nullptr && *env != '\0') {
    // An explicit choice is honoured or reported, never silently replaced by another library.
    return try_load(env, tried) ? &g_api : nullptr;
  }
  if (try_load("libnccl.so.2", tried)) return &g_api;
  if (!g_search_dir.empty() && try_load(g_search_dir + "/libnccl.so.2", tried)) return &g_api;
  return nullptr;
}

const NcclApi& api() {
  std::string tried;
  const NcclApi* a = load(&tried);
  if (a == nullptr) {
    throw Error("nccl",
                "a loadable libnccl.so.2 (set QMOE_NCCL_LIBRARY to its path, add its directory to "
                "LD_LIBRARY_PATH, or pip install nvidia-nccl-cu12)",
                "no library; tried:" + tried, ErrorKind::kRuntime);
  }
  return *a;
}

void check_result(const NcclApi& a, Result r, const char* call) {
  if (r != kSuccess) {
    const char* text = a.get_error_string ? a.get_error_string(r) : "unknown";
    throw Error("nccl", std::string("ncclSuccess from ") + call,
                "error " + std::to_string(static_cast<int>(r)) + " (" + (text ? text : "") + ")",
                ErrorKind::kRuntime);
  }
}

}  // namespace

void set_nccl_search_dir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_search_dir = dir;
}

bool nccl_available() {
  std::string tried;
  return load(&tried) != nullptr;
}

std::string nccl_library() { return api().path; }

int nccl_version() {
  const NcclApi& a = api();
  int v = 0;
  check_result(a, a.get_version(&v), "ncclGetVersion");
  return v;
}

NcclUniqueId nccl_get_unique_id() {
  const NcclApi& a = api();
  UniqueId id;
  check_result(a, a.get_unique_id(&id), "ncclGetUniqueId");
  NcclUniqueId out;
  for (int i = 0; i < kNcclUniqueIdBytes; ++i) out[static_cast<size_t>(i)] = id.internal[i];
  return out;
}

void* nccl_comm_init_rank(int world_size, const NcclUniqueId& id, int rank) {
  QMOE_CHECK_ARG(world_size >= 1, "world_size", "a value >= 1", std::to_string(world_size));
  QMOE_CHECK_ARG(rank >= 0 && rank < world_size, "rank", "a value in [0, world_size = " + std::to_string(world_size) + ")",
            std::to_string(rank));
  const NcclApi& a = api();
  UniqueId uid;
  for (int i = 0; i < kNcclUniqueIdBytes; ++i) uid.internal[i] = id[static_cast<size_t>(i)];
  Comm comm = nullptr;
  check_result(a, a.comm_init_rank(&comm, world_size, uid, rank), "ncclCommInitRank");
  return comm;
}

void nccl_comm_destroy(void* comm) {
  QMOE_CHECK_ARG(comm != nullptr, "comm", "an ncclComm_t from nccl_comm_init_rank", "nullptr");
  const NcclApi& a = api();
  check_result(a, a.comm_destroy(static_cast<Comm>(comm)), "ncclCommDestroy");
}

void nccl_all_to_all_v(void* comm, const std::vector<PeerTransfer>& peers, cudaStream_t stream) {
  // Validate everything before enqueueing anything (a half-issued group would hang the peers).
  QMOE_CHECK_ARG(comm != nullptr, "comm", "an ncclComm_t", "nullptr");
  for (size_t p = 0; p < peers.size(); ++p) {
    const PeerTransfer& t = peers[p];
    const std::string at = " for peer " + std::to_string(p);
    QMOE_CHECK_ARG(t.send_bytes >= 0 && t.recv_bytes >= 0, "peers", "byte counts >= 0",
              std::to_string(t.send_bytes) + " / " + std::to_string(t.recv_bytes) + at);
    QMOE_CHECK_ARG(t.send_bytes == 0 || t.send != nullptr, "peers", "a send buffer for a non-zero send", "nullptr" + at);
    QMOE_CHECK_ARG(t.recv_bytes == 0 || t.recv != nullptr, "peers", "a receive buffer for a non-zero receive",
              "nullptr" + at);
  }
  const NcclApi& a = api();
  const Comm c = static_cast<Comm>(comm);
  check_result(a, a.group_start(), "ncclGroupStart");
  Result first = kSuccess;
  const char* first_call = "";
  for (size_t p = 0; p < peers.size() && first == kSuccess; ++p) {
    const PeerTransfer& t = peers[p];
    const int peer = static_cast<int>(p);
    if (t.send_bytes > 0) {
      first = a.send(t.send, static_cast<size_t>(t.send_bytes), kUint8, peer, c, stream);
      first_call = "ncclSend";
    }
    if (first == kSuccess && t.recv_bytes > 0) {
      first = a.recv(t.recv, static_cast<size_t>(t.recv_bytes), kUint8, peer, c, stream);
      first_call = "ncclRecv";
    }
  }
  // The group is always closed, even after a failed call, so NCCL's group state stays consistent.
  const Result end = a.group_end();
  check_result(a, first, first_call);
  check_result(a, end, "ncclGroupEnd");
}

}  // namespace qmoe::ep
