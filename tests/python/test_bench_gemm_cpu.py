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


def test_sglang_check_uses_the_time_at_its_own_expert_hit_count():
    # SGLang's Mixtral T=8 run hit 5 experts, ours 8: the raw times compare different weight bytes.
    r = _row(us=136.6, sgl=123.5)
    assert _check(r)["faster than SGLang"] is False
    r.update(sglang_hit=5, qmoe_us_sglang_hit=90.0)
    assert _check(r)["faster than SGLang"] is True
    detail = {name: d for name, _, d in gemm.target_checks(r, 1000.0)}["faster than SGLang"]
    assert detail == "0.73x its time at its 5 experts hit"
    r["qmoe_us_sglang_hit"] = 124.0
    assert _check(r)["faster than SGLang"] is False
    assert "(hit 5: qmoe 124.0)" in gemm.markdown([r], ["# t"], 1000.0)


def test_routing_with_hit_covers_exactly_that_many_distinct_experts():
    import numpy as np
    from qmoe.bench.common import routing_with_hit

    for tokens, topk, experts, hit in [(8, 2, 8, 5), (8, 8, 256, 59), (1, 8, 256, 8), (3, 4, 16, 12), (64, 8, 128, 124)]:
        ids = routing_with_hit(tokens, topk, experts, hit, seed=tokens + hit)
        assert ids.shape == (tokens, topk) and ids.dtype == np.int32
        assert len(np.unique(ids)) == hit
        assert ids.min() >= 0 and ids.max() < experts
        assert all(len(set(row)) == topk for row in ids.tolist())   # distinct per token
    assert routing_with_hit(2, 2, 8, 5, seed=0) is None     # 4 slots cannot cover 5 experts
    assert routing_with_hit(8, 4, 8, 3, seed=0) is None     # top-4 distinct needs >= 4 experts
