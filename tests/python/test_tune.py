"""The autotuner (qmoe/tune.py) on the CPU, with a fake timer: token buckets at every boundary, key
stability, choose() picking and caching the fastest tactic, the JSON cache file and its metadata
check, concurrent fills from several threads, the graph-capture guard, forced tactics and CPU
tensors bypassing the tuner, and the wiring of cutlass_w4a8_moe_mm (with its tensors faked as CUDA
ones, running on the CPU reference)."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import numpy as np
import pytest

import qmoe
from qmoe import _C, tune
from qmoe import reference as ref
from qmoe import testing
from qmoe.compat import flashinfer, sgl_kernel

TACTICS = list(_C.valid_tactics(256, 256, 64, 8))
BF16_TACTICS = list(_C.valid_tactics(256, 256, 64, 8, 8, True))  # the bf16 x 4-bit GEMM's
META = {"library": "qmoe", "qmoe_version": qmoe.__version__, "format": 1, "gpu": "Fake GPU H999",
        "cuda_runtime": "99.9", "tactics": TACTICS}


class FakeTimer:
    """Times a run by the tactic it ran: `cost[tactic]`; counts timings per (key, tactic)."""

    def __init__(self, cost, delay=0.0):
        self.cost, self.delay = dict(cost), delay
        self.lock = threading.Lock()
        self.calls = []  # tactic names timed, in order
        self.last = threading.local()

    def run_for(self, key="k"):
        def run(tactic):
            self.last.tactic = (key, tactic)
        return run

    def __call__(self, fn):
        fn()
        if self.delay:
            time.sleep(self.delay)  # let other threads run into the same key meanwhile
        key, tactic = self.last.tactic
        with self.lock:
            self.calls.append((key, tactic))
        return self.cost[tactic]


def make_tuner(timer, capturing=lambda: False, metadata=lambda: dict(META)):
    return tune.Tuner(timer=timer, capturing=capturing, metadata=metadata)


def never_timed(fn):
    raise AssertionError("the tuner timed a run where it must not")


# ------------------------------------------------------------------------------------------------
# buckets

@pytest.mark.parametrize("tokens,want", [
    (0, 1), (1, 1), (2, 2), (3, 4), (5, 8), (129, 256), (255, 256), (256, 256),  # powers of 2 to 256
    (257, 512), (511, 512), (512, 512), (513, 768), (1025, 1280), (2047, 2048), (2048, 2048),  # steps of 256
    (2049, 2560), (2560, 2560), (2561, 3072), (3585, 4096), (4096, 4096),  # steps of 512
    (4097, 8192), (8192, 8192), (8193, 16384), (100000, 131072)])  # then powers of 2
def test_bucket_maps_up_to_the_next_bucket(tokens, want):
    assert tune.bucket(tokens) == want


def test_bucket_list_and_invariants():
    assert tune.token_buckets(4096) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048,
                                        2560, 3072, 3584, 4096]
    buckets = tune.token_buckets(1 << 15)
    assert buckets[-1] == 1 << 15 and buckets == sorted(set(buckets))
    previous = 1
    for t in range(1, 20000):
        b = tune.bucket(t)
        assert b >= t and b >= previous and b in buckets  # the smallest bucket >= t, monotonic
        assert buckets.index(b) == 0 or buckets[buckets.index(b) - 1] < t
        previous = b


# ------------------------------------------------------------------------------------------------
# keys

FUSED = dict(quant_mode="w4a8_int4", hidden=7168, inter=2048, num_experts=256, num_local_experts=32, topk=8,
             activation="swiglu", gate_up_layout="gate_up", deterministic=False, x_dtype="bfloat16",
             out_dtype="bfloat16")


def test_key_is_stable_and_readable():
    # The exact text is what cache files hold: changing it orphans every saved file.
    assert tune.fused_moe_key(100, **FUSED) == (
        "bucket=128,activation=swiglu,experts=256,finalize=fused,gate_up_layout=gate_up,hidden=7168,inter=2048,"
        "local_experts=32,out_dtype=bfloat16,quant_mode=w4a8_int4,topk=8,x_dtype=bfloat16")
    assert tune.moe_mm_key(40, 4096, 7168, 32, 8, False) == "bucket=64,a_scales=scalar,experts=32,k=7168,n=4096,topk=8"
    assert tune.problem_key(5, b=1, a="x") == tune.problem_key(7, a="x", b=1) == "bucket=8,a=x,b=1"


def test_key_same_bucket_same_key_other_bucket_other_key():
    assert tune.fused_moe_key(129, **FUSED) == tune.fused_moe_key(256, **FUSED)
    assert tune.fused_moe_key(256, **FUSED) != tune.fused_moe_key(257, **FUSED)
    assert tune.moe_mm_key(600, 64, 128, 4, 8, True) == tune.moe_mm_key(768, 64, 128, 4, 8, True)


@pytest.mark.parametrize("field,other", [
    ("quant_mode", "w4a4"), ("hidden", 4096), ("inter", 1536), ("num_experts", 128), ("num_local_experts", 256),
    ("topk", 4), ("activation", "relu2"), ("gate_up_layout", "up_gate_interleaved64"), ("deterministic", True),
    ("x_dtype", "float8_e4m3fn"), ("out_dtype", "float16")])
def test_every_key_field_changes_the_key(field, other):
    assert tune.fused_moe_key(64, **dict(FUSED, **{field: other})) != tune.fused_moe_key(64, **FUSED)


def test_packed_fp4_weights_get_their_own_key_and_plain_keys_keep_their_text():
    plain = tune.fused_moe_key(64, **dict(FUSED, quant_mode="w4a4"))
    assert tune.fused_moe_key(64, **dict(FUSED, quant_mode="w4a4"), fp4_weights_packed=False) == plain
    packed = tune.fused_moe_key(64, **dict(FUSED, quant_mode="w4a4"), fp4_weights_packed=True)
    assert packed != plain and ",weights=fp4_packed," in packed


def test_key_rejects_float_fields():
    with pytest.raises(TypeError, match="'alpha'"):
        tune.problem_key(4, alpha=1.5)


# ------------------------------------------------------------------------------------------------
# choose()

COST = {t: 10.0 + i for i, t in enumerate(TACTICS)}
COST[TACTICS[2]] = 3.0  # the fastest is neither the first nor the last candidate


def test_outside_autotune_nothing_is_timed_and_the_heuristic_is_used():
    tuner = make_tuner(never_timed)
    assert tuner.choose("op", "k", TACTICS, lambda t: None) is None
    assert tuner.entries() == {}


def test_choose_picks_the_fastest_and_caches_it():
    timer = FakeTimer(COST)
    tuner = make_tuner(timer)
    with tune.autotune(True):
        assert tuner.choose("op", "k", TACTICS, timer.run_for()) == TACTICS[2]
        assert sorted(t for _, t in timer.calls) == sorted(TACTICS)  # every candidate timed once
        # Second call (same key): cached, not timed again.
        assert tuner.choose("op", "k", TACTICS, timer.run_for()) == TACTICS[2]
        assert len(timer.calls) == len(TACTICS)
    # After the block (tuning off) the winner is still used; another key falls back to the heuristic.
    assert tuner.choose("op", "k", TACTICS, timer.run_for()) == TACTICS[2]
    assert tuner.choose("op", "other", TACTICS, timer.run_for()) is None
    assert tuner.choose("other_op", "k", TACTICS, timer.run_for()) is None  # the op name is part of the key
    entry = tuner.entries()["op::k"]
    assert entry["tactic"] == TACTICS[2] and entry["times_ms"] == {t: COST[t] for t in TACTICS}
    assert len(timer.calls) == len(TACTICS)


def test_ties_go_to_the_earlier_candidate_and_one_candidate_is_not_timed():
    timer = FakeTimer({t: 1.0 for t in TACTICS})
    tuner = make_tuner(timer)
    with tune.autotune(True):
        assert tuner.choose("op", "k", TACTICS[::-1], timer.run_for()) == TACTICS[-1]
        assert tuner.choose("op", "one", TACTICS[:1], timer.run_for()) is None  # the heuristic picks it anyway
        assert tuner.choose("op", "none", [], timer.run_for()) is None
    assert len(timer.calls) == len(TACTICS)


def test_a_cached_tactic_that_is_no_longer_a_candidate_is_not_used():
    timer = FakeTimer(COST)
    tuner = make_tuner(timer)
    with tune.autotune(True):
        assert tuner.choose("op", "k", TACTICS, timer.run_for()) == TACTICS[2]
    others = [t for t in TACTICS if t != TACTICS[2]]
    assert tuner.choose("op", "k", others, timer.run_for()) is None
    with tune.autotune(True):
        assert tuner.choose("op", "k", others, timer.run_for()) == min(others, key=COST.get)


def test_an_error_in_a_profiled_run_propagates_and_stores_nothing():
    timer = FakeTimer(COST)
    tuner = make_tuner(timer)

    def failing(tactic):
        raise ValueError("qmoe: argument 'd': bad")

    with tune.autotune(True):
        with pytest.raises(ValueError, match="'d'"):
            tuner.choose("op", "k", TACTICS, failing)
        assert tuner.entries() == {}
        assert tuner.choose("op", "k", TACTICS, timer.run_for()) == TACTICS[2]  # the key is not left locked


def test_tuning_flag_is_per_thread_and_restored():
    timer = FakeTimer(COST)
    tuner = make_tuner(timer)
    seen = []
    with tune.autotune(True):
        with tune.autotune(False):
            assert not tune.tuning_enabled()
            assert tuner.choose("op", "k", TACTICS, timer.run_for()) is None
        assert tune.tuning_enabled()
        worker = threading.Thread(target=lambda: seen.append(
            (tune.tuning_enabled(), tuner.choose("op", "k", TACTICS, timer.run_for()))))
        worker.start()
        worker.join()
    assert seen == [(False, None)] and timer.calls == [] and not tune.tuning_enabled()


def test_graph_capture_is_never_profiled():
    capturing = [True]
    timer = FakeTimer(COST)
    tuner = make_tuner(timer, capturing=lambda: capturing[0])
    with tune.autotune(True):
        assert tuner.choose("op", "k", TACTICS, timer.run_for()) is None  # capture: heuristic, no timing
        assert timer.calls == [] and tuner.entries() == {}
        capturing[0] = False
        assert tuner.choose("op", "k", TACTICS, timer.run_for()) == TACTICS[2]
        capturing[0] = True
        assert tuner.choose("op", "k", TACTICS, timer.run_for()) == TACTICS[2]  # capture: the cached winner
    assert len(timer.calls) == len(TACTICS)


def test_concurrent_fill_times_each_key_once_and_agrees():
    """Eight threads, each inside its own autotune(), ask for three keys at once (the timer is slow
    so that they collide): each (key, tactic) is timed exactly once, and every thread gets the
    same winner per key."""
    keys = ["a", "b", "c"]
    costs = {t: float(i) for i, t in enumerate(TACTICS)}
    costs[TACTICS[0]] = 100.0
    timer = FakeTimer(costs, delay=0.002)
    tuner = make_tuner(timer)
    barrier = threading.Barrier(8)
    results, errors = [], []

    def worker(index):
        try:
            with tune.autotune(True):
                barrier.wait()
                for key in keys[index % 3:] + keys[:index % 3]:
                    results.append((key, tuner.choose("op", key, TACTICS, timer.run_for(key))))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 24 and set(results) == {(k, TACTICS[1]) for k in keys}
    assert sorted(timer.calls) == sorted((k, t) for k in keys for t in TACTICS)


def test_profiling_of_different_keys_does_not_overlap():
    active, overlaps = [0], []
    lock = threading.Lock()

    def timer(fn):
        with lock:
            active[0] += 1
            overlaps.append(active[0])
        fn()
        time.sleep(0.001)
        with lock:
            active[0] -= 1
        return 1.0

    tuner = make_tuner(timer)

    def worker(key):
        with tune.autotune(True):
            tuner.choose("op", key, TACTICS, lambda t: None)

    threads = [threading.Thread(target=worker, args=(k,)) for k in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(overlaps) == 4 * len(TACTICS) and max(overlaps) == 1


# ------------------------------------------------------------------------------------------------
# cache file

def test_json_round_trip(tmp_path):
    timer = FakeTimer(COST)
    tuner = make_tuner(timer)
    with tune.autotune(True):
        tuner.choose("fused_moe", "k1", TACTICS, timer.run_for())
        tuner.choose("w4a8_moe_mm", "k2", TACTICS[3:], timer.run_for())
    path = tmp_path / "tactics.json"
    tuner.save(str(path))
    data = json.loads(path.read_text())
    assert data["_metadata"] == META
    assert data["entries"]["fused_moe::k1"]["tactic"] == TACTICS[2]
    assert data["entries"]["w4a8_moe_mm::k2"]["tactic"] == min(TACTICS[3:], key=COST.get)
    fresh = make_tuner(never_timed)
    assert fresh.load(str(path)) == 2
    assert fresh.entries() == tuner.entries()
    with tune.autotune(True):  # loaded winners are used without timing
        assert fresh.choose("fused_moe", "k1", TACTICS, lambda t: None) == TACTICS[2]


def test_load_keeps_entries_measured_in_this_process(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"_metadata": META, "entries": {
        "op::k": {"tactic": TACTICS[0]}, "op::new": {"tactic": TACTICS[4]}, "op::junk": 7}}))
    timer = FakeTimer(COST)
    tuner = make_tuner(timer)
    with tune.autotune(True):
        tuner.choose("op", "k", TACTICS, timer.run_for())
    assert tuner.load(str(path)) == 1  # "op::k" measured here wins; "op::junk" is not an entry
    assert tuner.lookup("op", "k") == TACTICS[2] and tuner.lookup("op", "new") == TACTICS[4]
    assert tuner.lookup("op", "junk") is None


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA H100 80GB HBM3"), ("qmoe_version", "0.0.1"),
                                         ("cuda_runtime", "12.1"), ("tactics", TACTICS[:2]), ("format", 0)])
def test_mismatched_metadata_is_ignored_with_a_warning(tmp_path, field, value):
    path = tmp_path / "t.json"
    entries = {"op::k": {"tactic": TACTICS[1]}}
    path.write_text(json.dumps({"_metadata": dict(META, **{field: value}), "entries": entries}))
    tuner = make_tuner(never_timed)
    with pytest.warns(RuntimeWarning, match=f"another setup.*{field}"):
        assert tuner.load(str(path)) == 0
    assert tuner.entries() == {}


def test_missing_and_corrupt_files(tmp_path):
    tuner = make_tuner(never_timed)
    assert tuner.load(str(tmp_path / "absent.json")) == 0
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="not readable JSON"):
        assert tuner.load(str(bad)) == 0
    no_meta = tmp_path / "no_meta.json"
    no_meta.write_text(json.dumps({"entries": {"op::k": {"tactic": TACTICS[1]}}}))
    with pytest.warns(RuntimeWarning, match="another setup"):
        assert tuner.load(str(no_meta)) == 0


def test_autotune_context_loads_and_saves_the_file(tmp_path, monkeypatch):
    path = str(tmp_path / "cache.json")
    timer = FakeTimer(COST)
    monkeypatch.setattr(tune, "_default", make_tuner(timer))
    with tune.autotune(True, cache=path):
        assert tune.choose("op", "k", TACTICS, timer.run_for()) == TACTICS[2]
    assert json.loads(open(path).read())["entries"]["op::k"]["tactic"] == TACTICS[2]
    # A new process (fresh tuner): autotune(False, cache) loads the winners and times nothing.
    monkeypatch.setattr(tune, "_default", make_tuner(never_timed))
    with flashinfer.autotune(False, cache=path):
        assert tune.choose("op", "k", TACTICS, lambda t: None) == TACTICS[2]
        assert tune.choose("op", "unseen", TACTICS, lambda t: None) is None


def test_autotune_writes_no_file_when_nothing_was_tuned(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "_default", make_tuner(never_timed))
    path = tmp_path / "cache.json"
    with tune.autotune(True, cache=str(path)):
        pass
    assert not path.exists()


def test_flashinfer_autotune_is_the_tuner():
    assert flashinfer.autotune is tune.autotune


# ------------------------------------------------------------------------------------------------
# wiring: CPU tensors, forced tactics, the GEMM's key and candidates

def _gemm_case(seed=3, experts=4, n=64, k=256, tokens=12, topk=2):
    ids, _ = testing.make_routing(tokens, topk, experts, seed=seed, distinct=True)
    rows = ids.size
    o = np.empty(experts + 1, np.int32)
    p1, p2 = np.empty((experts, 3), np.int32), np.empty((experts, 3), np.int32)
    ip, op = np.empty(rows, np.int32), np.empty(rows, np.int32)
    sgl_kernel.get_cutlass_w4a8_moe_mm_data(ids, o, p1, p2, ip, op, experts, n // 2, k)  # p1 = (n, cnt, k)
    rng = np.random.default_rng(seed)
    a = ref.round_e4m3(rng.standard_normal((rows, k)).astype(np.float32))
    w = testing.make_w4a8_int4_weights(experts, n, k, seed=seed)
    return dict(a=a, b=w.q, a_scales=np.array([0.5], np.float32), b_scales=w.scale, experts_offsets=o[:-1],
                problem_sizes=p1, rows=rows, n=n, k=k, experts=experts, topk=topk)


def _gemm(case, **kw):
    d = testing.poison((case["rows"], case["n"]), ref.BF16)
    sgl_kernel.cutlass_w4a8_moe_mm(d, case["a"], case["b"], case["a_scales"], case["b_scales"],
                                   case["experts_offsets"], case["problem_sizes"], None, None, None, None,
                                   topk=case["topk"], **kw)
    assert not testing.poisoned_mask(d).any()
    return d.view(np.uint16).copy()


def test_cpu_tensors_are_never_tuned(monkeypatch):
    monkeypatch.setattr(tune, "_default", make_tuner(never_timed))
    case = _gemm_case()
    fused = testing.make_fused_moe_case("w4a8_int4", 5, 256, 128, 8, 2, seed=2)
    with tune.autotune(True):
        _gemm(case)
        out = qmoe.fused_moe(**{k: v for k, v in fused.items() if v is not None})
    testing.assert_close(out, ref.fused_moe(**fused), "w4a8_int4")
    assert tune.default_tuner().entries() == {}


class _FakeCuda:
    """Makes the GEMM's numpy tensors count as CUDA tensors for the tuner (the op still runs the
    CPU reference, which honours and checks forced tactics like the GPU path)."""

    def __init__(self, monkeypatch, timer):
        monkeypatch.setattr(tune, "is_cuda", lambda t: True)
        monkeypatch.setattr(tune, "_on_device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(_C, "kernels_built", lambda: True)
        self.ran = []
        real = _C.w4a8_moe_mm

        def recording(*args, **kwargs):  # (kwargs: the wrapper's a_slots scratch)
            self.ran.append(args[-1])
            timer.last.tactic = ("gemm", args[-1])
            return real(*args, **kwargs)

        monkeypatch.setattr(_C, "w4a8_moe_mm", recording)
        monkeypatch.setattr(tune, "_default", make_tuner(timer))


def test_gemm_wiring_tunes_with_the_shape_key(monkeypatch):
    timer = FakeTimer(COST)
    fake = _FakeCuda(monkeypatch, timer)
    case = _gemm_case()
    want = _gemm(case, tactic=TACTICS[0])
    fake.ran.clear()
    with tune.autotune(True):
        got = _gemm(case)
    np.testing.assert_array_equal(got, want)
    assert fake.ran == TACTICS + [TACTICS[2]]  # each candidate once, then the call with the winner
    key = tune.moe_mm_key(case["rows"], case["n"], case["k"], case["experts"], case["topk"], False)
    assert tune.default_tuner().entries()[f"w4a8_moe_mm::{key}"]["tactic"] == TACTICS[2]
    fake.ran.clear()
    _gemm(case)  # tuning off: the cached winner, no timing
    assert fake.ran == [TACTICS[2]] and len(timer.calls) == len(TACTICS)


def test_forced_tactic_bypasses_the_tuner(monkeypatch):
    timer = FakeTimer(COST)
    fake = _FakeCuda(monkeypatch, timer)
    monkeypatch.setattr(tune, "_default", make_tuner(never_timed))
    case = _gemm_case()
    with tune.autotune(True):
        _gemm(case, tactic=TACTICS[4])
    assert fake.ran == [TACTICS[4]] and tune.default_tuner().entries() == {}
    with pytest.raises(ValueError, match="tactic"):  # an impossible forced tactic is an error, not a fallback
        _gemm(case, tactic="decode_m1_n1_k1")


def test_fused_moe_hook_candidates_and_key():
    timer = FakeTimer(COST)
    args = dict(quant_mode="w4a8_int4", hidden=256, inter=128, gated=True, num_experts=8, num_local_experts=8,
                topk=2, activation="swiglu", gate_up_layout="gate_up", deterministic=True, x_dtype="bfloat16",
                out_dtype="bfloat16")
    tuner = make_tuner(timer)
    original = tune._default
    tune._default = tuner
    try:
        with tune.autotune(True):
            assert tune.fused_moe_tactic(9, run=timer.run_for(), **args) == TACTICS[2]
    finally:
        tune._default = original
    key = tune.fused_moe_key(9, **{k: v for k, v in args.items() if k != "gated"})
    assert list(tuner.entries()) == [f"fused_moe::{key}"]
    assert tune.fused_moe_candidates(9, 256, 128, True, 8, 2) == TACTICS
    assert tune.fused_moe_candidates(9, 256, 100, True, 8, 2) == []  # GEMM2's K = 100 is not a multiple of 128
    # The FP4 / w4a16 modes run the bf16 x 4-bit GEMM: its own list, K % 32 == 0 suffices.
    assert tune.fused_moe_candidates(9, 256, 96, True, 8, 2, "w4a4") == BF16_TACTICS
    assert tune.fused_moe_candidates(9, 256, 96, True, 8, 2) == []
    assert tune.fused_moe_candidates(9, 256, 100, True, 8, 2, "w4a16") == []


def test_deterministic_tuning_keeps_the_heuristics_mma_family():
    """A WGMMA tile timed fastest is taken for the fused finalize but not for the deterministic one at a
    size where the heuristic runs mma.sync tiles (their bits differ); at prefill sizes, where the
    heuristic runs WGMMA, the deterministic call tunes among the WGMMA tiles."""
    wgmma = sorted(tune.WGMMA_TACTICS)
    cost = {t: (1.0 if t == wgmma[0] else 10.0 + i) for i, t in enumerate(TACTICS)}
    args = dict(quant_mode="w4a8_int4", hidden=256, inter=128, gated=True, num_experts=8, num_local_experts=8,
                topk=2, activation="swiglu", gate_up_layout="gate_up", x_dtype="bfloat16", out_dtype="bfloat16")
    original = tune._default
    try:
        for deterministic, tokens, family in ((False, 9, "wgmma"), (True, 9, "mma.sync"), (True, 4096, "wgmma")):
            timer = FakeTimer(cost)
            tune._default = make_tuner(timer)
            with tune.autotune(True):
                got = tune.fused_moe_tactic(tokens, run=timer.run_for(), deterministic=deterministic, **args)
            assert tune.mma_family(got, "w4a8_int4") == family, (deterministic, tokens, got)
            timed = {tactic for _, tactic in timer.calls}
            assert len(timed) > 1 and (not deterministic or {tune.mma_family(t, "w4a8_int4") for t in timed} == {family})
    finally:
        tune._default = original
    assert tune.mma_family("decode_m128_n32_k256", "w4a4") == "mma.sync"  # the bf16 kernel's mma.sync tiles
    assert tune.mma_family("prefill_m128_n64_k128", "w4a4") == "wgmma"  # ... and its WGMMA tiles
    assert tune.mma_family("prefill_m128_n32_k128", "w4a8_int4") == "wgmma.biased"  # W4A8's biased 32- and 48-token
    assert tune.mma_family("prefill_m128_n48_k128", "w4a8_int4") == "wgmma.biased"  # tiles
    assert tune.mma_family("prefill_m128_n32_k128", "w4a4") == "mma.sync"  # (not a tile of the bf16 kernel)
    assert tune.WGMMA_TACTICS <= set(TACTICS)


def test_wrapper_get_valid_tactics():
    cuda = flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, quant_mode="w4a8_int4", device="cuda")
    assert cuda.get_valid_tactics() == TACTICS
    assert flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, quant_mode="w4a8_int4", device="cpu").get_valid_tactics() \
        == ["reference"]
    assert flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, quant_mode="w4a4").get_valid_tactics() == BF16_TACTICS
    assert flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, quant_mode="w4a4", device="cpu").get_valid_tactics() \
        == ["reference"]


def test_bf16_kernel_tactics_are_their_own_list():
    assert BF16_TACTICS == ["decode_m128_n8_k256", "decode_m128_n16_k256", "prefill_m128_n64_k128", "decode_m128_n32_k256",
                            "decode_m128_n24_k256", "prefill_m128_n128_k128", "prefill_m128_n160_k128",
                            "decode_m64_n8_k256"]
    assert qmoe.select_tactic(4096, 7168, 8, 256, bf16_activations=True) == "decode_m128_n8_k256"
    assert qmoe.select_tactic(4096, 7168, 4096 * 8, 256, bf16_activations=True) == "prefill_m128_n160_k128"  # 128 rows
    # 256 rows per expert (Qwen3-30B T = 4096): the 160-token tile with FP4 weights only (its cost 1.12 vs 1.25)
    assert qmoe.select_tactic(2048, 768, 4096 * 8, 128, bf16_activations=True) == "prefill_m128_n128_k128"
    assert qmoe.select_tactic(2048, 768, 4096 * 8, 128, bf16_activations=True,
                              fp4_weights=True) == "prefill_m128_n160_k128"
    assert qmoe.valid_tactics(4096, 2880, 8, 128, bf16_activations=True) == BF16_TACTICS  # K % 32 == 0
    assert qmoe.valid_tactics(4096, 2880, 8, 128) == []  # the W4A8 GEMM needs K % 128 == 0


def test_idle_tuner_fast_path(monkeypatch):
    """Nothing cached and not tuning: the hooks return the heuristic without listing tactics."""
    monkeypatch.setattr(tune, "_default", make_tuner(never_timed))
    monkeypatch.setattr(_C, "valid_tactics", lambda *a: pytest.fail("listed tactics on the idle path"))
    assert tune.default_tuner().idle()
    assert tune.moe_mm_tactic(16, 64, 256, 4, 2, False, lambda t: None) is None
    with tune.autotune(True):
        assert not tune.default_tuner().idle()


def test_cuda_event_timer_protocol(monkeypatch):
    """The default timer against a fake torch.cuda: warm-up runs untimed, the L2 flushed before each
    timed run, events recorded around the run on the current stream, the median returned."""
    log, elapsed = [], iter([5.0, 1.0, 3.0, 9.0, 2.0])

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self, stream):
            log.append(("record", stream.name))

        def synchronize(self):
            log.append("sync")

        def elapsed_time(self, end):
            return next(elapsed)

    class Buffer:
        def zero_(self):
            log.append("flush")

    class Stream:
        name, device = "s", "cuda:0"

    class FakeCuda:
        @staticmethod
        def current_stream():
            return Stream()

    class FakeTorch:
        cuda = FakeCuda

    FakeCuda.Event = Event

    monkeypatch.setattr(tune, "torch", FakeTorch)
    monkeypatch.setattr(tune, "_l2_flush_buffer", lambda device: Buffer())
    got = tune.cuda_event_timer(lambda: log.append("run"), warmup=2, repeats=5)
    assert got == 3.0
    timed = ["flush", ("record", "s"), "run", ("record", "s"), "sync"]
    assert log == ["run", "run"] + timed * 5


def test_mma_family_covers_every_compiled_tile():
    """tune.mma_family's sets name every WGMMA tile of both GEMM kernels (the k128 prefill tiles; the W4A8 kernel's
    prefill_m128_n64_k256 is mma.sync): a tile added to the C++ list without them fails here, on the CPU."""
    for bf16, mode in ((False, "w4a8_int4"), (True, "w4a4")):
        names = qmoe.valid_tactics(4096, 7168, 64, 256, 8, bf16_activations=bf16)
        assert names
        for name in names:
            wgmma = name.startswith("prefill_") and name.endswith("_k128")
            biased = mode == "w4a8_int4" and name in ("prefill_m128_n32_k128", "prefill_m128_n48_k128")
            want = "wgmma.biased" if biased else "wgmma" if wgmma else "mma.sync"
            assert tune.mma_family(name, mode) == want, (mode, name)
