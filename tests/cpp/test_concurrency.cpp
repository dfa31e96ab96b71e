// Concurrency (reliability issue, parts 5 and 6), CPU backend: several host threads calling the ops
// at once, each on its own data, give bit for bit the results of serial calls, including threads
// whose calls fail validation in between. Calls come from hostile_calls.h.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "hostile_calls.h"

using namespace hostile;  // NOLINT: the call builders of hostile_calls.h

TEST(Concurrency, ThreadsMatchSerialResults) {
  constexpr int kThreads = 6, kRounds = 30;
  struct Job {
    std::function<std::vector<std::vector<uint8_t>>(bool)> run;  // bool: make it fail validation
  };
  std::vector<Job> jobs;
  for (int i = 0; i < kThreads; ++i) {
    const uint64_t seed = 500 + static_cast<uint64_t>(i);
    if (i % 3 == 0) {
      jobs.push_back({[seed](bool fail) {
        FusedCall c(seed);
        Target t = c.target();
        if (fail) c.p.routed_scaling_factor = std::numeric_limits<float>::quiet_NaN();
        try {
          t.run();
        } catch (const qmoe::Error&) {
          if (!fail) throw;
        }
        return snapshot(t);
      }});
    } else if (i % 3 == 1) {
      jobs.push_back({[seed](bool fail) {
        GemmCall c(seed);
        Target t = c.target();
        if (fail) c.args.chunk_size = 64;
        try {
          t.run();
        } catch (const qmoe::Error&) {
          if (!fail) throw;
        }
        return snapshot(t);
      }});
    } else {
      jobs.push_back({[seed](bool fail) {
        RoutingCall c(seed);
        Target t = c.target();
        if (fail) c.num_experts = 0;
        try {
          t.run();
        } catch (const qmoe::Error&) {
          if (!fail) throw;
        }
        return snapshot(t);
      }});
    }
  }
  std::vector<std::vector<std::vector<uint8_t>>> serial, serial_fail;
  for (auto& j : jobs) serial.push_back(j.run(false)), serial_fail.push_back(j.run(true));
  std::atomic<int> mismatches{0}, exceptions{0};
  std::vector<std::thread> pool;
  for (int i = 0; i < kThreads; ++i) {
    pool.emplace_back([&, i] {
      try {
        for (int r = 0; r < kRounds; ++r) {
          const bool fail = (r + i) % 3 == 0;
          if (jobs[static_cast<size_t>(i)].run(fail) != (fail ? serial_fail : serial)[static_cast<size_t>(i)]) ++mismatches;
        }
      } catch (...) {
        ++exceptions;
      }
    });
  }
  for (auto& th : pool) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(exceptions.load(), 0);
}

