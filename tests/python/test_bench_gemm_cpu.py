"""CPU tests of `qmoe bench gemm`'s report (python/qmoe/bench/gemm.py): the issue #3 target checks on
hand-made rows (decode window, prefill rate, the two peers) and their summary under the table.
No CUDA needed: the timing itself runs on the device machine."""
from __future__ import annotations

from qmoe.bench import gemm


def _row(model="m", g="gemm1", T=1, M=8, hit=8, us=10.0, floor=9.0, tflops=1.0, fp8=None, sgl=None):
    r = dict(model=model, gemm=g, T=T, M=M, experts_hit=hit, N=256, K=128, qmoe_us=us, floor_us=floor,
             tbps=1.0, tflops=tflops, floor_fraction=floor / us, tactic="t")
    if fp8 is not None:
        r["torch_fp8_us"] = fp8
    if sgl is not None:
        r["sglang_us"] = sgl
    return r


def _check(row, fp8_rate=1000.0):
    return {name: ok for name, ok, _ in gemm.target_checks(row, fp8_rate)}


def test_decode_window_is_the_larger_of_125_percent_and_floor_plus_3us():
    name = "decode <= max(1.25 x floor, floor + 3 us)"
    assert _check(_row(us=12.0, floor=9.0))[name]        # 9 + 3 = 12 >= 1.25 * 9
    assert not _check(_row(us=12.1, floor=9.0))[name]
    assert _check(_row(us=125.0, floor=100.0))[name]     # 1.25 * 100 = 125 >= 103
    assert not _check(_row(us=125.5, floor=100.0))[name]
    assert name not in _check(_row(T=257, us=1.0))       # past T = 256 it is not a decode point


def test_prefill_rate_only_at_1024_rows_per_expert():
    name = "prefill >= 0.75 x dense fp8 rate"
    assert name not in _check(_row(T=4096, M=1023 * 8, hit=8, tflops=900.0))
    assert _check(_row(T=4096, M=1024 * 8, hit=8, tflops=750.0))[name]
    assert not _check(_row(T=4096, M=1024 * 8, hit=8, tflops=749.0))[name]
    assert name not in _check(_row(T=4096, M=1024 * 8, hit=8, tflops=900.0), fp8_rate=None)


def test_peers_must_be_beaten_strictly():
    checks = _check(_row(us=10.0, fp8=10.0, sgl=10.5))
    assert checks["faster than torch fp8"] is False
    assert checks["faster than SGLang"] is True
    assert "faster than SGLang" not in _check(_row(us=10.0))   # no peer time: no check


def test_rows_without_a_qmoe_time_are_not_counted():
    r = _row()
    del r["qmoe_us"]
    r["qmoe_error"] = "K = 2880 is not a multiple of 128"
    assert gemm.target_checks(r, 1000.0) == []


def test_summary_counts_and_names_the_misses():
    rows = [_row(model="a", T=1, us=10.0, floor=9.0, sgl=20.0),
            _row(model="b", g="gemm2", T=8, us=30.0, floor=10.0, sgl=25.0)]
    lines = gemm.targets_summary(rows, 1000.0)
    text = "\n".join(lines)
    assert "- decode <= max(1.25 x floor, floor + 3 us): 1 / 2; missed at b gemm2 T=8 (3.00x floor)" in text
    assert "- faster than SGLang: 1 / 2; missed at b gemm2 T=8 (1.20x its time)" in text
    assert gemm.targets_summary([], 1000.0) == []


def test_markdown_ends_with_the_summary():
    text = gemm.markdown([_row(us=10.0, floor=9.0, fp8=20.0)], ["# title"], fp8_tflops=1000.0)
    assert text.startswith("# title")
    assert "| m | gemm1 | 1 | 8 | 8 | 256 | 128 | 10.0 |" in text
    assert text.rstrip().endswith("- faster than torch fp8: 1 / 1")
