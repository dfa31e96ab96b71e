// Bindings of expert parallelism: the dispatch/combine plan (include/qmoe/expert_parallel.h) and the
// dlopen'ed NCCL transport (include/qmoe/nccl_transport.h). Communicators and streams cross as
// integers (opaque pointers); the NCCL unique id as 128 bytes.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "python/tensor_arg.h"
#include "qmoe/expert_parallel.h"
#include "qmoe/nccl_transport.h"

namespace qmoe::python {

namespace {

nb::dict plan_dict(const ep::DispatchPlan& p) {
  nb::dict d;
  d["send_counts"] = p.send_counts;
  d["send_offsets"] = p.send_offsets;
  d["send_tokens"] = p.send_tokens;
  d["return_counts"] = p.return_counts;
  d["return_offsets"] = p.return_offsets;
  d["return_slots"] = p.return_slots;
  return d;
}

int64_t nbytes(const TensorRef& t, const char* what, size_t peer) {
  check_arg(t.is_contiguous(), what, "contiguous buffers", "a strided buffer for peer " + std::to_string(peer));
  return t.numel() * dtype_size(t.dtype);
}

}  // namespace

void bind_expert_parallel(nb::module_& m) {
  m.def(
      "ep_plan",
      [](const Arg& topk_ids, int64_t num_experts, int64_t world_size) {
        return plan_dict(ep::plan_dispatch(topk_ids.ref, num_experts, world_size));
      },
      nb::arg("topk_ids"), nb::arg("num_experts"), nb::arg("world_size"));
  m.def(
      "ep_owner_return_slots",
      [](const Arg& recv_ids, int64_t num_experts, int64_t world_size, int64_t rank) {
        return ep::owner_return_slots(recv_ids.ref, num_experts, world_size, rank);
      },
      nb::arg("recv_ids"), nb::arg("num_experts"), nb::arg("world_size"), nb::arg("rank"));
  m.def("ep_experts_per_rank", &ep::experts_per_rank, nb::arg("num_experts"), nb::arg("world_size"));
  m.def("ep_check_low_latency_capacity", &ep::check_low_latency_capacity, nb::arg("num_tokens"),
        nb::arg("max_tokens_per_rank"));

  m.def("nccl_set_search_dir", &ep::set_nccl_search_dir, nb::arg("dir"));
  m.def("nccl_available", &ep::nccl_available);
  m.def("nccl_library", &ep::nccl_library);
  m.def("nccl_version", &ep::nccl_version);
  m.def("nccl_get_unique_id", [] {
    const ep::NcclUniqueId id = ep::nccl_get_unique_id();
    return nb::bytes(id.data(), id.size());
  });
  m.def(
      "nccl_comm_init_rank",
      [](int world_size, nb::bytes unique_id, int rank) {
        check_arg(unique_id.size() == ep::kNcclUniqueIdBytes, "unique_id",
                  std::to_string(ep::kNcclUniqueIdBytes) + " bytes (from nccl_get_unique_id)",
                  std::to_string(unique_id.size()) + " bytes");
        ep::NcclUniqueId id;
        const char* src = unique_id.c_str();
        for (size_t i = 0; i < id.size(); ++i) id[i] = src[i];
        nb::gil_scoped_release release;  // blocks until every rank has joined
        return reinterpret_cast<uintptr_t>(ep::nccl_comm_init_rank(world_size, id, rank));
      },
      nb::arg("world_size"), nb::arg("unique_id"), nb::arg("rank"));
  m.def(
      "nccl_comm_destroy", [](uintptr_t comm) { ep::nccl_comm_destroy(reinterpret_cast<void*>(comm)); },
      nb::arg("comm"));
  m.def(
      "nccl_all_to_all_v",
      [](uintptr_t comm, const std::vector<const Arg*>& sends, const std::vector<Arg*>& recvs, uintptr_t stream) {
        check_arg(sends.size() == recvs.size(), "recvs", "one entry per peer (" + std::to_string(sends.size()) + ")",
                  std::to_string(recvs.size()) + " entries");
        std::vector<ep::PeerTransfer> peers(sends.size());
        for (size_t p = 0; p < sends.size(); ++p) {
          if (sends[p] != nullptr) {
            check_arg(sends[p]->ref.is_cuda(), "sends", "CUDA buffers", "a CPU buffer for peer " + std::to_string(p));
            peers[p].send = sends[p]->ref.data;
            peers[p].send_bytes = nbytes(sends[p]->ref, "sends", p);
          }
          if (recvs[p] != nullptr) {
            check_arg(recvs[p]->ref.is_cuda(), "recvs", "CUDA buffers", "a CPU buffer for peer " + std::to_string(p));
            peers[p].recv = recvs[p]->ref.data;
            peers[p].recv_bytes = nbytes(recvs[p]->ref, "recvs", p);
          }
        }
        nb::gil_scoped_release release;
        ep::nccl_all_to_all_v(reinterpret_cast<void*>(comm), peers, reinterpret_cast<cudaStream_t>(stream));
      },
      nb::arg("comm"), nb::arg("sends"), nb::arg("recvs"), nb::arg("stream"));
}

}  // namespace qmoe::python
