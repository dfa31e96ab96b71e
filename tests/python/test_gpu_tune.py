"""GPU tests of the autotuner (qmoe/tune.py) with the real CUDA-event timer: one fused w4a8_int4
shape (Qwen3-30B-A3B, T=100 -> bucket 128) tuned into a JSON file (printed with -s), the winner
reused from the file by a fresh tuner without timing, correctness of the tuned call against the
numpy twin, graph capture inside autotune(True) (no profiling, replayable), two host threads on
two streams filling the cache at once (bitwise equal to single-thread calls with the same cached
tactics), and the SGLang GEMM tuned per row bucket (bitwise equal to a forced run of its winner).
Each test has its own Tuner (tune._default replaced), so the order of tests does not matter."""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import fresh_tuner as new_tuner, require_hopper, to_dev, to_np  # noqa: E402

torch = require_hopper()

import qmoe  # noqa: E402
from qmoe import reference as ref  # noqa: E402
from qmoe import testing, tune  # noqa: E402
from qmoe.compat import flashinfer, sgl_kernel  # noqa: E402

# Qwen3-30B-A3B; under compute-sanitizer (QMOE_SANITIZER, scripts/gpu_tests.sh) a smaller layer with
# the same tuner behaviour (the heuristic in the mma.sync family, several tactics in it), so that an
# instrumented run ends within one device call: every tactic is profiled, and each costs minutes there.
SANITIZER = bool(os.environ.get("QMOE_SANITIZER"))
HIDDEN, INTER, EXPERTS, TOPK = (512, 256, 64, 8) if SANITIZER else (2048, 768, 128, 8)


@pytest.fixture(autouse=True)
def fresh_tuner(monkeypatch):
    monkeypatch.setattr(tune, "_default", new_tuner(tune))


def _case(tokens, seed):
    case = testing.make_fused_moe_case("w4a8_int4", tokens, HIDDEN, INTER, EXPERTS, TOPK, seed=seed)
    return case, {k: to_dev(v) for k, v in case.items() if v is not None}


def _fused_entries():
    return {k: v for k, v in tune.default_tuner().entries().items() if k.startswith("fused_moe::")}


def test_tune_one_shape_into_a_file_and_reuse_it(tmp_path):
    path = str(tmp_path / "qmoe_tactics.json")
    case, kw = _case(100, 1)
    heuristic = qmoe.fused_moe(**kw, deterministic=True)  # nothing tuned: the heuristic
    assert tune.default_tuner().entries() == {}
    with flashinfer.autotune(True, cache=path):
        tuned = qmoe.fused_moe(**kw, deterministic=True)  # times every valid tactic, runs the winner
    torch.cuda.synchronize()
    print("\n" + open(path).read())
    print("heuristic:", qmoe.select_tactic(2 * INTER, HIDDEN, 100 * TOPK, EXPERTS, TOPK))
    data = json.load(open(path))
    assert data["_metadata"]["gpu"] == torch.cuda.get_device_name() and len(data["entries"]) == 1
    (entry,) = data["entries"].values()
    # A deterministic call times only the tactics of the heuristic's MMA family (tune.py: tuning must
    # not change the bits it returns).
    family = tune.mma_family(qmoe.select_tactic(2 * INTER, HIDDEN, 800, EXPERTS, TOPK), "w4a8_int4")
    same_family = {t for t in qmoe.valid_tactics(2 * INTER, HIDDEN, 800, EXPERTS, TOPK)
                   if tune.mma_family(t, "w4a8_int4") == family}
    assert set(entry["times_ms"]) == same_family and len(same_family) >= 2
    assert all(t > 0 for t in entry["times_ms"].values())
    assert entry["tactic"] == min(entry["times_ms"], key=entry["times_ms"].get)
    want = ref.fused_moe(**case, deterministic=True)
    testing.assert_close(to_np(tuned), want, "w4a8_int4")
    testing.assert_close(to_np(heuristic), want, "w4a8_int4")
    # A fresh tuner (a new process) loads the file without tuning: the same tactic, nothing timed.
    fresh = tune.Tuner(timer=lambda fn: pytest.fail("timed while loading a cache file"))
    tune._default = fresh
    with flashinfer.autotune(False, cache=path):
        again = qmoe.fused_moe(**kw, deterministic=True)
    assert torch.equal(again, tuned) and list(fresh.entries()) == list(data["entries"])


def test_graph_capture_inside_autotune_does_not_profile():
    case, kw = _case(300, 3)  # bucket 512, not cached
    qmoe.fused_moe(**kw, deterministic=True)  # eager warm-up, tuning off
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with tune.autotune(True):
        with torch.cuda.graph(graph):
            out = qmoe.fused_moe(**kw, deterministic=True)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert tune.default_tuner().entries() == {}
    testing.assert_close(to_np(out), ref.fused_moe(**case, deterministic=True), "w4a8_int4")


def test_two_threads_on_two_streams_fill_the_cache():
    jobs = [_case(t, 10 + t)[1] for t in (16, 2000, 100)]  # buckets 16 and 2048, and 128 shared
    torch.cuda.synchronize()
    results, errors = {}, []

    def worker(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), tune.autotune(True):
                results[i] = [qmoe.fused_moe(**jobs[j], deterministic=True) for j in (i, 2)]
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    entries = _fused_entries()
    print("\n", {k.split(",")[0]: v["tactic"] for k, v in entries.items()})
    assert sorted(k.split(",")[0] for k in entries) == ["fused_moe::bucket=128", "fused_moe::bucket=16",
                                                       "fused_moe::bucket=2048"]
    serial = [qmoe.fused_moe(**kw, deterministic=True) for kw in jobs]  # same cached tactics, one thread
    for i in (0, 1):
        assert torch.equal(results[i][0], serial[i]) and torch.equal(results[i][1], serial[2])


def test_sglang_gemm_is_tuned_per_row_bucket(tmp_path):
    experts, n, k = (64, 512, 1024) if SANITIZER else (64, 4096, 7168)
    ids, _ = testing.make_routing(64, 8, experts, seed=5)
    o = np.empty(experts + 1, np.int32)
    p1, p2 = np.empty((experts, 3), np.int32), np.empty((experts, 3), np.int32)
    ip, op = np.empty(ids.size, np.int32), np.empty(ids.size, np.int32)
    sgl_kernel.get_cutlass_w4a8_moe_mm_data(ids, o, p1, p2, ip, op, experts, n // 2, k)  # p1 = (n, cnt, k)
    w = testing.make_w4a8_int4_weights(experts, n, k, seed=5)
    a = ref.round_e4m3(np.random.default_rng(5).standard_normal((ids.size, k)).astype(np.float32))
    dev = [to_dev(x) for x in (a, w.q, np.array([0.5], np.float32), w.scale, o[:-1], p1)]
    d = torch.full((ids.size, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    path = str(tmp_path / "gemm.json")
    with tune.autotune(True, cache=path):
        sgl_kernel.cutlass_w4a8_moe_mm(d, *dev, None, None, None, None)
    (key, entry), = json.load(open(path))["entries"].items()
    print("\n", key, entry)
    assert key == "w4a8_moe_mm::" + tune.moe_mm_key(ids.size, n, k, experts, 8, False)
    forced = torch.full_like(d, float("nan"))
    sgl_kernel.cutlass_w4a8_moe_mm(forced, *dev, None, None, None, None, tactic=entry["tactic"])
    assert not torch.isnan(d).any() and torch.equal(d, forced)
