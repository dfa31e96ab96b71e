// Per-thread SM limit of the persistent GEMM grids (include/qmoe/sm_limit.h): default, scope,
// thread locality, validation. Its effect on the grids (same bits, fewer SMs) is a GPU test
// (tests/python/test_gpu_sm_limit.py).
#include <gtest/gtest.h>

#include <thread>

#include "qmoe/error.h"
#include "qmoe/sm_limit.h"

TEST(SmLimit, DefaultIsNoLimitAndScopesRestore) {
  EXPECT_EQ(qmoe::sm_limit(), 0);
  {
    qmoe::ScopedSmLimit outer(100);
    EXPECT_EQ(qmoe::sm_limit(), 100);
    {
      qmoe::ScopedSmLimit inner(7);
      EXPECT_EQ(qmoe::sm_limit(), 7);
    }
    EXPECT_EQ(qmoe::sm_limit(), 100);
  }
  EXPECT_EQ(qmoe::sm_limit(), 0);
}

TEST(SmLimit, IsPerThread) {
  qmoe::ScopedSmLimit mine(9);
  int seen_there = -1, set_there = -1;
  std::thread other([&] {
    seen_there = qmoe::sm_limit();  // a new thread starts without a limit
    qmoe::set_sm_limit(3);
    set_there = qmoe::sm_limit();
  });
  other.join();
  EXPECT_EQ(seen_there, 0);
  EXPECT_EQ(set_there, 3);
  EXPECT_EQ(qmoe::sm_limit(), 9);  // untouched by the other thread
}

TEST(SmLimit, NegativeIsRefusedByName) {
  qmoe::ScopedSmLimit mine(5);
  try {
    qmoe::set_sm_limit(-1);
    FAIL() << "expected qmoe::Error";
  } catch (const qmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sms"), std::string::npos) << e.what();
  }
  EXPECT_EQ(qmoe::sm_limit(), 5);  // unchanged by the refused call
}
