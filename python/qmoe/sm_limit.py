"""How many SMs qmoe's persistent GEMM kernels may fill, per host thread (include/qmoe/sm_limit.h).

The grouped GEMMs size their grids to fill every SM. Work another stream launches meanwhile (NCCL's
kernels while expert parallelism overlaps an exchange with the experts) then waits for the GEMM to
end. Inside ``with qmoe.limit_sms(n):`` the GEMMs launched by this thread use at most n SMs; results
are bitwise the same (the grid only decides which CTA computes which tile). 0 means no limit.
CPU arrays ignore it. CUDA graphs keep the limit that held at capture.
"""
from __future__ import annotations

import contextlib
import numbers

from . import _C


def set_sm_limit(sms: int) -> None:
    """This thread's limit from now on (0: no limit)."""
    if isinstance(sms, bool) or not isinstance(sms, numbers.Integral):
        raise TypeError(f"qmoe: argument 'sms': expected an integer number of SMs >= 0, got {sms!r}")
    _C.set_sm_limit(int(sms))


def sm_limit() -> int:
    """This thread's limit (0: none)."""
    return int(_C.sm_limit())


@contextlib.contextmanager
def limit_sms(sms: int):
    """``with limit_sms(n):`` at most n SMs for this thread's GEMM launches; the previous limit after."""
    previous = sm_limit()
    set_sm_limit(sms)  # raises ValueError naming 'sms' for a negative value, before anything changes
    try:
        yield
    finally:
        set_sm_limit(previous)
