// The NCCL transport's argument checks (include/qmoe/nccl_transport.h). They run before libnccl is
// loaded and before any NCCL call, so they are testable without NCCL or a GPU; the transport itself
// runs on the GPU machine (docs/expert-parallel.md). Each rule names its argument.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "qmoe/nccl_transport.h"

namespace {

namespace ep = qmoe::ep;

template <class F>
void expect_arg(F&& fn, const std::string& argument) {
  try {
    fn();
    ADD_FAILURE() << "no error for " << argument;
  } catch (const qmoe::Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_EQ(e.kind(), qmoe::ErrorKind::kValue) << e.what();
  }
}

TEST(NcclTransport, AllToAllChecksEveryPeerBeforeAnyCall) {
  int fake_comm = 0, buffer = 0;
  std::vector<ep::PeerTransfer> peers(2);
  expect_arg([&] { ep::nccl_all_to_all_v(nullptr, peers, nullptr); }, "comm");
  peers[1].send_bytes = -4;
  expect_arg([&] { ep::nccl_all_to_all_v(&fake_comm, peers, nullptr); }, "peers");
  peers[1] = {};
  peers[1].send_bytes = 4;  // no send buffer
  expect_arg([&] { ep::nccl_all_to_all_v(&fake_comm, peers, nullptr); }, "peers");
  peers[1] = {};
  peers[0].recv_bytes = 4;  // no receive buffer
  peers[1].send = &buffer;
  expect_arg([&] { ep::nccl_all_to_all_v(&fake_comm, peers, nullptr); }, "peers");
}

TEST(NcclTransport, CommInitChecksRankAndWorldSize) {
  const ep::NcclUniqueId id{};
  expect_arg([&] { ep::nccl_comm_init_rank(0, id, 0); }, "world_size");
  expect_arg([&] { ep::nccl_comm_init_rank(2, id, 2); }, "rank");
  expect_arg([&] { ep::nccl_comm_init_rank(2, id, -1); }, "rank");
  expect_arg([&] { ep::nccl_comm_destroy(nullptr); }, "comm");
}

}  // namespace
