// Per-thread SM limit of the persistent GEMM grids (include/qmoe/sm_limit.h).
#include "qmoe/sm_limit.h"

#include <string>

#include "qmoe/error.h"

namespace qmoe {

namespace {
thread_local int t_sm_limit = 0;  // per host thread: no lock, no cross-thread effect
}  // namespace

void set_sm_limit(int sms) {
  QMOE_CHECK_ARG(sms >= 0, "sms", "a number of SMs >= 0 (0: no limit)", std::to_string(sms));
  t_sm_limit = sms;
}

int sm_limit() { return t_sm_limit; }

}  // namespace qmoe
