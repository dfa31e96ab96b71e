// How many streaming multiprocessors qmoe's persistent GEMM kernels may fill, per host thread.
//
// The grouped GEMMs launch persistent grids sized to fill every SM (SMs x CTAs per SM). A kernel that
// another stream launches meanwhile (NCCL's send/receive kernels when expert parallelism overlaps an
// exchange with the experts' GEMMs) then finds no SM with room and waits until the GEMM ends. A limit
// of n SMs sizes those grids to n x CTAs per SM, so the rest of the GPU stays free for the other work.
// The result does not change (the grid only changes which CTA computes which tile), and launches
// captured in a CUDA graph keep the limit that held at capture. Same idea as DeepGEMM's
// set_num_sms, but per host thread, so two threads driving two streams do not see each other's value.
//
// 0 (the default) means no limit; a limit above the device's SM count means all of them.
#pragma once

namespace qmoe {

// This thread's launches from now on; sms >= 0 (else qmoe::Error naming "sms").
void set_sm_limit(int sms);
int sm_limit();

// Sets a limit for a scope and restores the previous one.
class ScopedSmLimit {
 public:
  explicit ScopedSmLimit(int sms) : previous_(sm_limit()) { set_sm_limit(sms); }
  ~ScopedSmLimit() { set_sm_limit(previous_); }
  ScopedSmLimit(const ScopedSmLimit&) = delete;
  ScopedSmLimit& operator=(const ScopedSmLimit&) = delete;

 private:
  int previous_;
};

}  // namespace qmoe
