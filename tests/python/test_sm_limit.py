"""qmoe.limit_sms / set_sm_limit / sm_limit (include/qmoe/sm_limit.h) on the CPU: the per-thread value,
its scope, its validation, and that CPU results ignore it. On the GPU (tests/python/test_gpu_sm_limit.py)
the GEMMs must give the same bits under any limit."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import qmoe
from qmoe import testing


def test_default_scope_and_restore():
    assert qmoe.sm_limit() == 0
    with qmoe.limit_sms(100):
        assert qmoe.sm_limit() == 100
        with qmoe.limit_sms(7):
            assert qmoe.sm_limit() == 7
        assert qmoe.sm_limit() == 100
    assert qmoe.sm_limit() == 0


def test_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="inside"):
        with qmoe.limit_sms(12):
            raise RuntimeError("inside")
    assert qmoe.sm_limit() == 0


def test_per_thread():
    seen = {}

    def other():
        seen["start"] = qmoe.sm_limit()
        qmoe.set_sm_limit(3)
        seen["set"] = qmoe.sm_limit()
        qmoe.set_sm_limit(0)

    with qmoe.limit_sms(9):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert qmoe.sm_limit() == 9
    assert seen == {"start": 0, "set": 3}


@pytest.mark.parametrize("bad", [-1, -132])
def test_negative_refused_by_name_and_nothing_changes(bad):
    with qmoe.limit_sms(5):
        with pytest.raises(ValueError, match="sms"):
            with qmoe.limit_sms(bad):
                pass
        assert qmoe.sm_limit() == 5


@pytest.mark.parametrize("bad", [2.5, "8", True, None])
def test_non_integers_refused_by_name(bad):
    with pytest.raises(TypeError, match="'sms'"):
        qmoe.set_sm_limit(bad)
    assert qmoe.sm_limit() == 0
    qmoe.set_sm_limit(np.int64(4))  # numpy integers are integers
    assert qmoe.sm_limit() == 4
    qmoe.set_sm_limit(0)


def test_cpu_results_ignore_the_limit():
    case = testing.make_fused_moe_case("w4a8_int4", 9, 256, 128, 8, 2, seed=3)
    free = qmoe.fused_moe(**case)
    with qmoe.limit_sms(1):
        limited = qmoe.fused_moe(**case)
    np.testing.assert_array_equal(np.asarray(free).view(np.uint16), np.asarray(limited).view(np.uint16))
