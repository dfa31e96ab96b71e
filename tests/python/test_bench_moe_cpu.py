"""CPU tests of `qmoe bench moe` (python/qmoe/bench/moe.py, common.py): argument parsing, the floor
arithmetic on hand-computed examples, weight shapes vs qmoe.testing, the vLLM peer file, table
formatting, the dry run end to end (files written) and the `qmoe bench moe` CLI. With torch
installed (CPU build is enough) the plain PyTorch MoE peer is checked against a per-token loop.
No CUDA needed: the GPU timing itself is exercised only on the device machine.
"""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from qmoe import cli, testing
from qmoe.bench import common, moe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_COPY = os.path.join(REPO, "bench", "peers", moe.PEER_FILE)


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------
def test_defaults():
    a = moe._parse_args([])
    assert a.models == ["deepseek_v3", "qwen3_30b_a3b", "mixtral_8x7b", "qwen3_235b_a22b", "gpt_oss_120b"]
    assert a.tokens == [1, 8, 64, 512, 4096]
    assert a.finalize == ["det", "fused"] and not a.dry_run
    assert moe._parse_args(["--dry-run"]).tokens == list(moe.DRY_RUN_TOKENS)


def test_model_names_are_normalised_and_tokens_parsed():
    a = moe._parse_args(["--models", "DeepSeek-V3, Qwen3-30B-A3B", "--tokens", "3,17", "--finalize", "fused"])
    assert a.models == ["deepseek_v3", "qwen3_30b_a3b"]
    assert a.tokens == [3, 17] and a.finalize == ["fused"]


@pytest.mark.parametrize("argv", [["--models", "llama"], ["--tokens", "1,x"], ["--tokens", "0"],
                                  ["--finalize", "atomic"], ["--iters", "0"]])
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        moe._parse_args(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# floors
# ------------------------------------------------------------------------------------------------
def test_floor_hand_computed_bandwidth_bound():
    # T = 2, top-k 2 -> 4 rows; experts 0 (3 rows) and 2 (1 row) hit; H = 256, I = 128.
    # GEMM1 N=256 K=256: int4 2*256*256/2 = 65536 + scales 2*256*2*2 = 2048 + act 4*256 + out 4*256*2
    #                    = 70656 B -> 70.656 us at 1 GB/s; 2*4*256*256 = 524288 FLOP -> 0.52 us at 1 TFLOP/s
    # GEMM2 N=256 K=128: 32768 + 2*256*1*2 = 1024 + 4*128 + 4*256*2 = 36352 B -> 36.352 us
    f = moe.moe_floor([3, 0, 1, 0], 2, 256, 128, copy_tbps=1e-3, fp8_tflops=1.0)
    assert (f["M"], f["experts_hit"]) == (4, 2)
    assert f["gemm1"]["bytes"] == 70656 and f["gemm2"]["bytes"] == 36352
    assert f["gemm1"]["flops"] == 524288 and f["gemm2"]["flops"] == 262144
    assert f["gemm1"]["floor_us"] == pytest.approx(70.656)
    assert f["gemm2"]["floor_us"] == pytest.approx(36.352)
    assert f["floor_us"] == pytest.approx(107.008)
    assert f["bytes"] == 70656 + 36352


def test_floor_hand_computed_compute_bound():
    # 1 TB/s and a 1e-6 TFLOP/s "GPU": FLOPs dominate: 524288 us + 262144 us
    f = moe.moe_floor([3, 0, 1, 0], 2, 256, 128, copy_tbps=1.0, fp8_tflops=1e-6)
    assert f["floor_us"] == pytest.approx(524288 + 262144)


def test_gemm_floor_matches_the_h200_gemm_run():
    """The DeepSeek-V3 GEMM1 T=1 row of bench/results/2026-11-30_nvidia_h200_gemm.json (gemm.py's
    formula before it moved to common.py)."""
    f = common.gemm_floor(8, 8, 4096, 7168, 4.196271031434762, 1550.2148875141222)
    assert f["bytes"] == 121233408 and f["flops"] == 469762048.0
    assert f["floor_us"] == pytest.approx(28.890747783407274, rel=1e-12)


def test_weight_set_count():
    mb = 2 ** 20
    assert common.weight_set_count(100 * mb, 1000 * mb, 256, 40) == 4       # ceil(2.56) + 1
    assert common.weight_set_count(6000 * mb, 6000 * mb, 256, 40) == 2      # whole set touched: 2
    assert common.weight_set_count(704 * mb, 22.5 * 2 ** 30, 256, 40) == 1  # capped by memory
    assert common.weight_set_count(0, mb, 256, 40) == 1


def test_numpy_counts_are_topk_distinct():
    counts = moe.numpy_counts(50, 8, 256, seed=3)
    assert len(counts) == 256 and sum(counts) == 400 and max(counts) <= 50


def test_unsupported_and_shrink():
    assert moe.qmoe_unsupported(2880, 2880) == "K % 128 != 0"
    assert moe.qmoe_unsupported(4096, 1536) is None
    assert moe._shrink_dim(7168, 16) == 512
    assert moe._shrink_dim(768, 16) == 128
    assert moe._shrink_dim(2880, 16) % 128 == 64  # stays unsupported
    assert moe._shrink_dim(7168, 1) == 7168


@pytest.mark.parametrize("hidden,inter", [(512, 256), (256, 640)])
def test_weight_shapes_match_testing_cases(hidden, inter):
    case = testing.make_fused_moe_case("w4a8_int4", 3, hidden, inter, 8, 2, seed=1)
    for name, (shape, dtype) in moe.qmoe_weight_shapes(8, hidden, inter).items():
        assert case[name].shape == shape, name
        assert case[name].dtype.name == dtype, name


# ------------------------------------------------------------------------------------------------
# peers
# ------------------------------------------------------------------------------------------------
def test_vllm_peer_file_parsing():
    peers, note = moe.load_vllm_peers(PEER_COPY)
    assert "vLLM" in note and "13cb3e4" in note
    assert len(peers) == 90
    row = dict(model="deepseek_v3", T=1)
    moe.add_peer_columns(row, peers, 7168, 2048)
    assert row["vllm_bf16_graph_us"] == pytest.approx(241.36000126600266)
    assert row["vllm_int4_graph_us"] == pytest.approx(656.8159759044647)
    assert row["vllm_fp8_eager_us"] > row["vllm_fp8_graph_us"] > 0
    missing = dict(model="deepseek_v3", T=512)   # no T=512 in the peer run
    moe.add_peer_columns(missing, peers, 7168, 2048)
    assert not any(k.startswith("vllm_") for k in missing)
    other = dict(model="deepseek_v3", T=1)       # another shape: not comparable
    moe.add_peer_columns(other, peers, 7168, 1024)
    assert not any(k.startswith("vllm_") for k in other)


def test_vllm_peer_file_unreadable(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    peers, note = moe.load_vllm_peers(str(bad))
    assert peers == {} and "not readable" in note
    assert moe.load_vllm_peers(str(tmp_path / "absent.json"))[0] == {}
    assert moe.load_vllm_peers("") == ({}, None)


# ------------------------------------------------------------------------------------------------
# table
# ------------------------------------------------------------------------------------------------
def _rows():
    a = dict(model="qwen3_30b_a3b", T=8, experts_hit=49, floor_us=30.0, qmoe_det_eager_us=150.0,
             qmoe_det_graph_us=60.0, qmoe_det_graph_over_floor=2.0, qmoe_fused_eager_us=140.0,
             qmoe_fused_graph_us=55.5, qmoe_fused_graph_over_floor=1.85, torch_bf16_graph_us=300.25,
             vllm_bf16_graph_us=157.9)
    moe.set_error(a, "torch_fp8_graph_us", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")
    b = dict(model="gpt_oss_120b", T=8, experts_hit=27, floor_us=20.0)
    for key in moe.QMOE_KEYS:
        moe.set_error(b, key, "K % 128 != 0")
    return [a, b]


def test_markdown_table():
    text = moe.markdown(_rows(), ["# title"])
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| model"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    assert cols[:4] == ["model", "T", "hit", "floor us"] and "vLLM int4 graph" in cols
    assert lines[head + 1].count("|") == lines[head].count("|")
    row_a = [c.strip() for c in lines[head + 2].strip("|").split("|")]
    cell = dict(zip(cols, row_a))
    assert cell["qmoe det graph"] == "60.0" and cell["fused graph/floor"] == "1.85"
    assert cell["torch bf16 graph"] == "300.2" or cell["torch bf16 graph"] == "300.3"
    assert cell["torch fp8 graph"] == "n/a: OutOfMemoryError"
    assert cell["vLLM fp8 graph"] == "-"
    cell_b = dict(zip(cols, [c.strip() for c in lines[head + 3].strip("|").split("|")]))
    assert cell_b["qmoe det eager"] == "n/a: K % 128 != 0"
    # the full reasons, grouped by column and reason, under the table
    assert any("torch_fp8_graph_us: OutOfMemoryError: CUDA out of memory" in line for line in lines)
    assert any(line.startswith("- qmoe_det_eager_us: K % 128 != 0 (gpt_oss_120b T=8)") for line in lines)


def test_markdown_one_finalize_drops_the_other_columns():
    text = moe.markdown(_rows(), [], finalizes=("fused",))
    assert "qmoe fused graph" in text and "qmoe det graph" not in text


def test_write_outputs(tmp_path):
    stem = moe.write_outputs(str(tmp_path / "r"), "2026-01-01_x_moe", "| a |", dict(rows=_rows()))
    assert open(stem + ".md").read() == "| a |\n"
    assert json.load(open(stem + ".json"))["rows"][1]["errors"]["qmoe_det_graph_us"] == "K % 128 != 0"


# ------------------------------------------------------------------------------------------------
# dry run and CLI
# ------------------------------------------------------------------------------------------------
def test_dry_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "results"
    rc = moe.main(["--dry-run", "--models", "qwen3_30b_a3b,gpt_oss_120b", "--tokens", "1,3", "--out-dir", str(out),
                   "--peers", PEER_COPY])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "DRY RUN" in printed and "n/a: K % 128 != 0" in printed
    files = sorted(os.listdir(out))
    assert len(files) == 2 and files[0].endswith("_cpu_dry_run_moe.json") and files[1].endswith("_moe.md")
    data = json.load(open(out / files[0]))
    assert data["dry_run"] and len(data["rows"]) == 4
    for r in data["rows"]:
        assert r["M"] == r["T"] * r["topk"] and r["floor_us"] > 0
        assert r["floor_us"] == pytest.approx(r["gemm1"]["floor_us"] + r["gemm2"]["floor_us"])
    q = [r for r in data["rows"] if r["model"] == "qwen3_30b_a3b"]
    assert q[0]["vllm_bf16_graph_us"] == pytest.approx(58.8, abs=0.1)  # peer of the full shape
    assert "vllm_bf16_graph_us" not in q[1]                            # T=3: not in the peer run
    if importlib.util.find_spec("torch") is None:
        assert all("no torch" in r["errors"]["qmoe_det_eager_us"] for r in q)
    else:  # the CPU engine ran qmoe once per finalize on the shrunk shape
        assert all(r["qmoe_finite"] and r["qmoe_det_eager_us"] > 0 for r in q)


def test_cli_bench_moe(tmp_path, capsys):
    rc = cli.main(["bench", "moe", "--dry-run", "--models", "mixtral_8x7b", "--tokens", "2", "--out-dir",
                   str(tmp_path), "--no-torch-peers"])
    assert rc == 0 and "mixtral_8x7b" in capsys.readouterr().out
    if not cli._gpu_available():
        assert cli.main(["bench", "moe", "--models", "mixtral_8x7b"]) == 2
        assert "--dry-run" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# the plain PyTorch MoE peer (torch on the CPU)
# ------------------------------------------------------------------------------------------------
def _naive_moe(torch, x, ids, wts, w13, w2, act_round=None):
    """out[t] = sum_j w[t,j] W2[e] (silu(g) * u), (g, u) = W13[e] x[t], in float64, token by token."""
    inter = w2.shape[2]
    out = torch.zeros((x.shape[0], w2.shape[1]), dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(wts[t, j]) * (w2[e].double() @ a)
    return out


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm())


def test_torch_peer_bf16_matches_a_token_loop():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    experts, topk, hidden, inter, tokens = 5, 2, 64, 32, 13
    ids = common.routing(torch, tokens, topk, experts, gen, device="cpu")
    wts = moe._routing_weights(torch, tokens, topk, gen, "cpu")
    x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16)
    w13, w2 = moe.make_bf16_weights(torch, experts, hidden, inter, gen, "cpu")
    want = _naive_moe(torch, x, ids, wts, w13, w2)
    loop, _ = moe.loop_grouped_mm(torch)
    assert _rel(moe.torch_moe_bf16(torch, x, ids, wts, w13, w2, grouped_mm=loop), want) < 2e-2
    try:
        got = moe.torch_moe_bf16(torch, x, ids, wts, w13, w2)  # torch._grouped_mm itself, when on the CPU
    except (RuntimeError, NotImplementedError):
        return
    assert _rel(got, want) < 2e-2


def test_torch_peer_fp8_matches_a_token_loop():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(2)
    experts, topk, hidden, inter, tokens = 4, 2, 64, 32, 11
    ids = common.routing(torch, tokens, topk, experts, gen, device="cpu")
    wts = moe._routing_weights(torch, tokens, topk, gen, "cpu")
    x = torch.randn((tokens, hidden), generator=gen).to(torch.bfloat16)
    w13, s13, w2, s2 = moe.make_fp8_weights(torch, experts, hidden, inter, gen, "cpu")
    deq13 = w13.float() * s13.unsqueeze(-1)
    deq2 = w2.float() * s2.unsqueeze(-1)
    want = _naive_moe(torch, x, ids, wts, deq13, deq2)
    _, loop_scaled = moe.loop_grouped_mm(torch)
    got = moe.torch_moe_fp8(torch, x, ids, wts, w13, s13, w2, s2, scaled_grouped_mm=loop_scaled)
    # e4m3 rounding of both activations: a few percent; a wrong gather or combine is O(1)
    assert _rel(got, want) < 0.1


def test_sort_by_expert_ends_and_order():
    torch = pytest.importorskip("torch")
    ids = torch.tensor([[2, 0], [1, 2], [2, 3]], dtype=torch.int32)
    tok, order, ends = moe._sort_by_expert(torch, ids, 5)
    assert ends.dtype == torch.int32 and ends.tolist() == [1, 2, 5, 6, 6]
    assert order.tolist() == [1, 2, 0, 3, 4, 5]   # stable by slot within an expert
    assert tok.tolist() == [0, 1, 0, 1, 2, 2]


def test_numpy_torch_round_trip():
    torch = pytest.importorskip("torch")
    case = testing.make_fused_moe_case("w4a8_int4", 3, 256, 128, 4, 2, seed=2)
    for name in ("x", "w1", "w1_scale", "topk_ids", "topk_weights", "x_scale"):
        t = common.numpy_to_torch(torch, case[name], "cpu")
        back = common.torch_to_numpy(torch, t)
        assert back.dtype == case[name].dtype and np.array_equal(back.view(np.uint8), case[name].view(np.uint8))
    e4m3 = case["x"].astype(np.float32).astype(testing.ref.E4M3)
    assert common.numpy_to_torch(torch, e4m3, "cpu").dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# the timing helpers' protocol, against a fake torch.cuda that advances a clock per call
# ------------------------------------------------------------------------------------------------
class _FakeCuda:
    """Each call of a benchmarked callable costs 1 ms of 'GPU time'; events read that clock;
    a graph replays its captured callables."""

    def __init__(self, capturable=True):
        self.clock_ms, self.capturing, self.capturable, self.captured = 0.0, None, capturable, []
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = cuda.clock_ms

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.t - self.t

        class Graph:
            def __init__(self):
                self.calls = []

            def replay(self):
                for c in self.calls:
                    c(replay=True)

        class _Ctx:
            def __init__(self, graph=None):
                self.graph = graph

            def __enter__(self):
                if self.graph is not None:
                    if not cuda.capturable:
                        raise RuntimeError("operation not permitted when stream is capturing")
                    cuda.capturing = self.graph

            def __exit__(self, *exc):
                cuda.capturing = None

        class _Stream:
            def wait_stream(self, other):
                pass

        self.Event, self.CUDAGraph = Event, Graph
        self.Stream = _Stream
        self.current_stream = lambda: _Stream()
        self.stream = lambda s: _Ctx()
        self.graph = lambda g: _Ctx(g)
        self.synchronize = lambda: None

    def callable(self):
        def call(replay=False):
            if self.capturing is not None and not replay:
                self.capturing.calls.append(call)
            else:
                self.clock_ms += 1.0
        return call


class _FakeTorch:
    def __init__(self, capturable=True):
        self.cuda = _FakeCuda(capturable)


def test_timing_helpers_protocol():
    t = _FakeTorch()
    calls = [t.cuda.callable() for _ in range(3)]
    assert common.time_graph(t, calls, iters=7, warmup=2) == pytest.approx(1000.0)  # us per call
    assert common.time_eager(t, calls, iters=7, warmup=1) == pytest.approx(1000.0)
    assert common.time_calls(t, calls, iters=7, warmup=1) == (pytest.approx(1000.0), "graph")
    bad = _FakeTorch(capturable=False)
    calls = [bad.cuda.callable() for _ in range(2)]
    assert common.time_calls(bad, calls, iters=3, warmup=0) == (pytest.approx(1000.0), "events")
    with pytest.raises(RuntimeError, match="capturing"):
        common.time_graph(bad, calls, iters=3, warmup=0)


def test_sample_budget_stops_early():
    t = _FakeTorch()
    calls = [t.cuda.callable()]
    before = t.cuda.clock_ms
    common.time_eager(t, calls, iters=1000, warmup=0, budget_s=0.010)  # 10 ms budget, 1 ms per call
    assert 5 <= t.cuda.clock_ms - before <= 12
