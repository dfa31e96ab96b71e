"""CPU tests of `qmoe bench moe` (python/qmoe/bench/moe.py, common.py): argument parsing (with
--quant-mode), the floor arithmetic of every quant mode on hand-computed examples, the per-mode
unsupported rules and file names, weight shapes vs qmoe.testing, the vLLM peer file, table
formatting, the dry run end to end per mode (files written) and the `qmoe bench moe` CLI, the
fail-soft paths (a mode that raises, an unusable CUDA context). With torch installed (CPU build is
enough) the random data of every mode goes through qmoe's CPU engine, the torch peers are shown to
run once per (model, T) whatever the modes, and the plain PyTorch MoE peer is checked against a
per-token loop. No CUDA needed: the GPU timing itself is exercised only on the device machine.
"""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from qmoe import cli, ops, testing
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
    assert a.quant_mode == ["w4a8_int4"]
    assert moe._parse_args(["--dry-run"]).tokens == list(moe.DRY_RUN_TOKENS)


def test_model_names_are_normalised_and_tokens_parsed():
    a = moe._parse_args(["--models", "DeepSeek-V3, Qwen3-30B-A3B", "--tokens", "3,17", "--finalize", "fused"])
    assert a.models == ["deepseek_v3", "qwen3_30b_a3b"]
    assert a.tokens == [3, 17] and a.finalize == ["fused"]


def test_quant_modes_parsed_in_run_order():
    assert moe._parse_args(["--quant-mode", "w4a4, w4a8_int4,w4a4"]).quant_mode == ["w4a8_int4", "w4a4"]
    assert moe._parse_args(["--quant-mode", "all"]).quant_mode == list(moe.MODES)
    assert moe.MODES[0] == "w4a8_int4" and set(moe.MODES) == {"w4a8_int4", "w4a16_int4", "w4a16", "w4a8", "w4a4"}
    assert set(moe.MODES) == set(ops.QUANT_MODES)  # every mode qmoe.fused_moe takes


def test_pdl_choice_reaches_fused_moe_only_when_given():
    """--pdl default leaves enable_pdl to the library (on); on / off pass it to every qmoe call."""
    assert moe._parse_args([]).pdl == "default" and moe._pdl_kwargs(moe._parse_args([])) == {}
    assert moe._pdl_kwargs(moe._parse_args(["--pdl", "on"])) == {"enable_pdl": True}
    assert moe._pdl_kwargs(moe._parse_args(["--pdl", "off"])) == {"enable_pdl": False}
    assert moe._pdl_kwargs(moe._parse_args(["--tactic", "decode_m64_n8_k512_s4"])) == {"tactic": "decode_m64_n8_k512_s4"}


@pytest.mark.parametrize("argv", [["--models", "llama"], ["--tokens", "1,x"], ["--tokens", "0"],
                                  ["--finalize", "atomic"], ["--iters", "0"], ["--quant-mode", "w4a2"],
                                  ["--quant-mode", "w4a4,all"], ["--quant-mode", ","], ["--pdl", "yes"]])
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


# Same routing and shape as above, every mode (M = 4 rows, 2 experts hit, H = 256, I = 128):
#   weights GEMM1 (N=256, K=256) codes 65536 + scales: int4 2*256*2*2 = 2048, NVFP4 2*256*16 = 8192,
#           MXFP4 2*256*8 = 4096;  GEMM2 (N=256, K=128) codes 32768 + int4 1024, NVFP4 4096, MXFP4 2048
#   activations [4, K]: e4m3 4K; bf16 8K; MXFP8 4K + 4K/32; NVFP4 2K + 4K/16;  output 4*256*2 = 2048 both
FLOOR_BYTES = {"w4a8_int4": (65536 + 2048 + 1024 + 2048, 32768 + 1024 + 512 + 2048),
               "w4a16_int4": (65536 + 2048 + 2048 + 2048, 32768 + 1024 + 1024 + 2048),
               "w4a16": (65536 + 8192 + 2048 + 2048, 32768 + 4096 + 1024 + 2048),
               "w4a8": (65536 + 4096 + 1024 + 32 + 2048, 32768 + 2048 + 512 + 16 + 2048),
               "w4a4": (65536 + 8192 + 512 + 64 + 2048, 32768 + 4096 + 256 + 32 + 2048)}


@pytest.mark.parametrize("mode", list(FLOOR_BYTES))
def test_floor_hand_computed_every_mode(mode):
    g1, g2 = FLOOR_BYTES[mode]
    f = moe.moe_floor([3, 0, 1, 0], 2, 256, 128, copy_tbps=1e-3, fp8_tflops=1.0, mode=mode, bf16_tflops=1.0)
    assert (f["gemm1"]["bytes"], f["gemm2"]["bytes"]) == (g1, g2)
    assert f["floor_us"] == pytest.approx((g1 + g2) / 1000)
    assert f["flops"] == 524288 + 262144
    # compute bound: the fp8 rate for w4a8_int4, w4a8, w4a4; the (here twice as fast) bf16 rate for the bf16 modes
    f = moe.moe_floor([3, 0, 1, 0], 2, 256, 128, copy_tbps=1.0, fp8_tflops=1e-6, mode=mode, bf16_tflops=2e-6)
    bf16 = mode in ("w4a16", "w4a16_int4")
    assert f["rate"] == ("bf16" if bf16 else "fp8")
    assert f["floor_us"] == pytest.approx((524288 + 262144) / (2 if bf16 else 1))


def test_floor_of_w4a8_int4_is_unchanged_and_bf16_modes_need_the_bf16_rate():
    old = moe.moe_floor([5, 1, 0, 2], 2, 512, 256, 4.2, 1550.0)
    new = moe.moe_floor([5, 1, 0, 2], 2, 512, 256, 4.2, 1550.0, mode="w4a8_int4", bf16_tflops=1.0)
    assert old == new
    with pytest.raises(ValueError, match="bf16"):
        moe.moe_floor([1, 1], 1, 256, 128, 4.2, 1550.0, mode="w4a16")
    assert moe.moe_floor([1, 1], 1, 256, 128, 4.2, 1550.0, mode="w4a4")["floor_us"] > 0  # fp8 rate only


def test_byte_counts_per_format():
    assert common.weight_bytes("int4_g128", 3, 256, 512) == common.int4_weight_bytes(3, 256, 512)
    assert common.weight_bytes("nvfp4", 3, 256, 512) == 3 * 256 * 256 + 3 * 256 * 32
    assert common.weight_bytes("mxfp4", 3, 256, 512) == 3 * 256 * 256 + 3 * 256 * 16
    assert common.activation_bytes("e4m3", 5, 512) == 2560
    assert common.activation_bytes("bf16", 5, 512) == 5120
    assert common.activation_bytes("mxfp8", 5, 512) == 2560 + 5 * 16
    assert common.activation_bytes("nvfp4", 5, 512) == 1280 + 5 * 32


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
    for mode in moe.MODES:
        int4 = mode.endswith("int4")
        assert moe.qmoe_unsupported(2880, 2880, mode) == ("K % 128 != 0" if int4 else None), mode  # gpt-oss
        assert moe.qmoe_unsupported(4096, 1536, mode) is None
        assert moe.qmoe_unsupported(2880, 2896, mode) == ("K % 128 != 0" if int4 else "K % 32 != 0")
        assert moe.qmoe_unsupported(2896, 2880, mode) == ("K % 128 != 0" if int4 else "K % 32 != 0")
    assert moe._shrink_dim(7168, 16) == 512
    assert moe._shrink_dim(768, 16) == 128
    assert moe._shrink_dim(2880, 16) % 128 == 64  # stays unsupported
    assert moe._shrink_dim(7168, 1) == 7168


def test_shrink_keeps_every_mode_valid():
    """Shrunk model dims stay multiples of 64 (FP4 modes and their 64-row gate/up interleave run);
    a model the int4 modes cannot run stays unsupported, the others stay supported."""
    args = moe._parse_args(["--dry-run"])
    for model, (_, _, hidden, inter) in testing.MODEL_SHAPES.items():
        _, _, h, i = moe.model_dims(model, args)
        assert h % 64 == 0 and i % 64 == 0 and h < hidden, model
        for mode in moe.MODES:
            assert (moe.qmoe_unsupported(h, i, mode) is None) == (moe.qmoe_unsupported(hidden, inter, mode) is None)


@pytest.mark.parametrize("mode", ["w4a8_int4", "w4a16_int4", "w4a16", "w4a8", "w4a4"])
@pytest.mark.parametrize("hidden,inter", [(512, 256), (256, 640)])
def test_weight_shapes_match_testing_cases(mode, hidden, inter):
    case = testing.make_fused_moe_case(mode, 3, hidden, inter, 8, 2, seed=1)
    shapes = moe.qmoe_weight_shapes(8, hidden, inter, mode)
    assert set(shapes) == {"w1", "w1_scale", "w2", "w2_scale"}
    for name, (shape, dtype) in shapes.items():
        assert case[name].shape == shape, name
        if mode.endswith("int4"):
            assert case[name].dtype.name == dtype, name
        else:  # uint8 storage of fp4x2 / e4m3 / ue8m0 bytes
            assert dtype == "uint8" and case[name].dtype.itemsize == 1, name
    assert moe.qmoe_weight_shapes(8, hidden, inter) == moe.qmoe_weight_shapes(8, hidden, inter, "w4a8_int4")


def test_swizzled_scale_shape_pads_rows_and_columns():
    assert common.swizzled_scale_shape(3, 2880 * 2, 2880, 16) == (3, 5760, 180)
    assert common.swizzled_scale_shape(3, 2880, 2880, 32) == (3, 2944, 92)   # 90 -> 92, 2880 -> 2944
    assert common.swizzled_scale_shape(1, 100, 64, 16) == (1, 128, 4)


def test_scale_codes_hold_no_nan_and_the_asked_range():
    assert [common.e4m3_value(c) for c in (0x20, 0x38, 0x50, 0x7E, 0xB8)] == [0.125, 1.0, 8.0, 448.0, -1.0]
    lo, hi = common.SCALE_CODES["e4m3"]
    assert 0x7F not in range(lo, hi + 1)
    assert all(2.0 ** -3 <= common.e4m3_value(c) <= 2.0 ** 3 for c in range(lo, hi + 1))
    lo, hi = common.SCALE_CODES["ue8m0"]
    assert (lo, hi) == (119, 127) and 0xFF not in range(lo, hi + 1)  # 2^-8 .. 2^0
    assert common.E2M1_RMS == pytest.approx(np.sqrt(68.5 / 8))


def test_mode_alphas_and_layouts():
    assert common.mode_alphas("w4a8_int4", 512, 256) is None and common.mode_alphas("w4a16_int4", 512, 256) is None
    a16, a4 = common.mode_alphas("w4a16", 512, 256), common.mode_alphas("w4a4", 512, 256)
    assert all(a > 0 for a in a16 + a4 + common.mode_alphas("w4a8", 512, 256))
    w_rms = common.E2M1_RMS * common.SCALE_RMS["e4m3"]
    assert a16 == pytest.approx((1 / (w_rms * np.sqrt(512)), 1 / (w_rms * np.sqrt(256))))
    assert a4[1] == pytest.approx(a16[1] / common.W4A4_FC2_INPUT_SCALE)  # GEMM2 sees the encoded intermediate
    assert common.mode_gate_up_layout("w4a8_int4", 256) == "gate_up"
    assert common.mode_gate_up_layout("w4a4", 256) == "up_gate_interleaved64"
    assert common.mode_gate_up_layout("w4a8", 2880 + 32) == "gate_up"


def test_output_file_names():
    assert moe.output_stem("2026-12-01", "NVIDIA H200", "w4a8_int4") == "2026-12-01_nvidia_h200_moe"
    assert moe.output_stem("2026-12-01", "NVIDIA H200", "w4a4") == "2026-12-01_nvidia_h200_moe_w4a4"
    assert moe.output_stem("2026-12-01", "cpu dry run", "w4a16_int4") == "2026-12-01_cpu_dry_run_moe_w4a16_int4"


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


@pytest.mark.parametrize("mode", ["w4a8_int4", "w4a16_int4", "w4a16", "w4a8", "w4a4"])
def test_dry_run_per_mode(mode, tmp_path, capsys):
    out = tmp_path / "results"
    rc = moe.main(["--dry-run", "--quant-mode", mode, "--models", "qwen3_30b_a3b,gpt_oss_120b", "--tokens", "1,3",
                   "--out-dir", str(out), "--peers", PEER_COPY, "--no-torch-peers"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"# qmoe fused MoE layer ({mode})" in printed
    suffix = "" if mode == "w4a8_int4" else "_" + mode
    names = sorted(os.listdir(out))
    assert [n.split("_", 1)[1] for n in names] == [f"cpu_dry_run_moe{suffix}.json", f"cpu_dry_run_moe{suffix}.md"]
    data = json.load(open(next(out.glob("*.json"))))
    assert data["quant_mode"] == mode and data["dry_run"] and len(data["rows"]) == 4
    args = moe._parse_args(["--dry-run"])
    for r in data["rows"]:
        assert r["quant_mode"] == mode and r["M"] == r["T"] * r["topk"]
        _, _, h, i = moe.model_dims(r["model"], args)
        assert (r["H"], r["I"]) == (h, i)
        # the floor is the mode's: recomputed from the row's experts hit it agrees (bytes depend on M and hit)
        g1 = common.gemm_floor(r["experts_hit"], r["M"], 2 * i, h, 4.2, 1.0, mode)["bytes"]
        assert r["gemm1"]["bytes"] == g1
        assert r["rate"] == common.QUANT_MODES[mode][2]
    oss = [r for r in data["rows"] if r["model"] == "gpt_oss_120b"]
    if mode.endswith("int4"):
        assert all(r["errors"]["qmoe_det_eager_us"] == "K % 128 != 0" for r in oss)
    elif importlib.util.find_spec("torch") is None:
        assert all(r["errors"]["qmoe_det_eager_us"] == "no torch" for r in oss)
    else:  # the FP4 modes run gpt-oss (shrunk H = I = 320) on the CPU engine
        assert all(r["qmoe_finite"] and r["qmoe_det_eager_us"] > 0 for r in oss)
    if importlib.util.find_spec("torch") is not None:
        q = [r for r in data["rows"] if r["model"] == "qwen3_30b_a3b"]
        assert all(r["qmoe_finite"] and r["qmoe_det_vs_fused_rel_rms"] < 2e-2 for r in q)
        assert any(f"Check: qmoe {mode} on cpu vs the CPU engine" in line and "rel_rms 0.0e+00" in line
                   for line in printed.splitlines())


def test_dry_run_two_modes_share_the_torch_columns(tmp_path, capsys):
    out = tmp_path / "r"
    rc = moe.main(["--dry-run", "--quant-mode", "w4a4,w4a8_int4", "--models", "mixtral_8x7b", "--tokens", "2",
                   "--out-dir", str(out), "--peers", ""])
    assert rc == 0
    names = sorted(os.listdir(out))
    assert len(names) == 4 and names[0].endswith("_moe.json") and names[2].endswith("_moe_w4a4.json")
    printed = capsys.readouterr().out
    assert printed.index("(w4a8_int4)") < printed.index("(w4a4)")  # run order: w4a8_int4 first
    int4, fp4 = (json.load(open(out / n))["rows"][0] for n in (names[0], names[2]))
    assert int4["floor_us"] != fp4["floor_us"]
    torch_keys = {k: v for k, v in int4.items() if k.startswith("torch_")}
    assert torch_keys == {k: v for k, v in fp4.items() if k.startswith("torch_")}
    assert moe.torch_columns(int4) == moe.torch_columns(fp4)


def test_mode_header_names_the_formats_and_rate():
    args = moe._parse_args(["--dry-run"])
    head = "\n".join(moe.mode_header("w4a8_int4", "gpu", "day", "ceilings", args, {}, None, ["ok"]))
    assert ("floor us = sum over GEMM1 and GEMM2 of max(bytes / copy, FLOPs / fp8 rate); bytes = int4 weights + bf16 "
            "scales of the experts hit + e4m3 activations + bf16 output.") in head
    assert "static a1 = amax(x)/448, a2 = 8/448" in head and "Check: ok" in head
    head = "\n".join(moe.mode_header("w4a16", "gpu", "day", "ceilings", args, {}, None, []))
    assert "(w4a16)" in head and "FLOPs / bf16 rate" in head and "NVFP4 weights + e4m3 scales per 16" in head
    head = "\n".join(moe.mode_header("w4a4", "gpu", "day", "ceilings", args, {}, None, []))
    assert "FLOPs / fp8 rate" in head and "NVFP4 activations" in head and "interleaved" in head


# ------------------------------------------------------------------------------------------------
# fail soft: a mode that raises, an unusable CUDA context (no torch needed: fakes)
# ------------------------------------------------------------------------------------------------
class _Timer:
    def __init__(self, broken=None):
        self.reason, self.freed = broken, 0

    def broken(self):
        return self.reason

    def free(self):
        self.freed += 1


def test_a_mode_that_raises_shows_na_and_the_run_goes_on(monkeypatch, capsys):
    args = moe._parse_args(["--dry-run", "--models", "qwen3_30b_a3b,gpt_oss_120b", "--tokens", "1,4"])
    seen = []

    def bench_model(torch, model, args, ceilings, peers, timer, device, mode, torch_cache):
        seen.append(model)
        raise RuntimeError("qmoe: w4a16 pipeline not built")

    monkeypatch.setattr(moe, "bench_model", bench_model)
    cache = {("qwen3_30b_a3b", 1): {"torch_bf16_graph_us": 12.5, "errors": {"torch_fp8_graph_us": "OOM"}}}
    timer = _Timer()
    rows = moe.run_mode(object(), "w4a16", args, dict(moe.NOMINAL_CEILINGS), {}, timer, "cpu", cache,
                        dict(broken=None))
    assert seen == ["qwen3_30b_a3b", "gpt_oss_120b"] and timer.freed == 2 and len(rows) == 4
    for r in rows:
        assert r["errors"]["qmoe_fused_graph_us"] == "RuntimeError: qmoe: w4a16 pipeline not built"
        assert r["floor_us"] > 0 and r["quant_mode"] == "w4a16"
    assert rows[0]["torch_bf16_graph_us"] == 12.5 and rows[0]["errors"]["torch_fp8_graph_us"] == "OOM"  # cached
    assert rows[1]["errors"]["torch_bf16_graph_us"].startswith("RuntimeError")                         # not cached
    assert "failed (RuntimeError: qmoe: w4a16 pipeline not built)" in capsys.readouterr().out
    text = moe.markdown(rows, [])
    assert "n/a: qmoe: w4a16 pipeline not built" in text


def test_an_unusable_cuda_context_stops_further_work(monkeypatch):
    args = moe._parse_args(["--dry-run", "--models", "qwen3_30b_a3b,gpt_oss_120b", "--tokens", "2"])
    monkeypatch.setattr(moe, "bench_model", lambda *a, **k: pytest.fail("must not run after CUDA broke"))
    state = dict(broken=None)
    rows = moe.run_mode(object(), "w4a8", args, dict(moe.NOMINAL_CEILINGS), {}, _Timer("RuntimeError: illegal address"),
                        "cuda", {}, state)
    assert state["broken"] == "RuntimeError: illegal address"
    unusable = "CUDA unusable after an earlier error: RuntimeError: illegal address"
    assert all(r["errors"]["qmoe_det_eager_us"] == unusable for r in rows)
    # the int4 modes keep their own reason for gpt-oss
    rows = moe.run_mode(object(), "w4a16_int4", args, dict(moe.NOMINAL_CEILINGS), {}, _Timer(), "cuda", {}, state)
    assert rows[1]["errors"]["qmoe_det_eager_us"] == "K % 128 != 0"
    assert rows[0]["errors"]["torch_fp8_graph_us"].startswith("CUDA unusable")


def test_torch_columns_round_trip():
    row = dict(T=3, floor_us=2.0, torch_bf16_graph_us=4.0, torch_bf16_weight_sets=3, torch_fp8_finite=True)
    moe.set_error(row, "torch_fp8_graph_us", "boom")
    moe.set_error(row, "qmoe_det_graph_us", "other")
    cols = moe.torch_columns(row)
    assert cols == dict(torch_bf16_graph_us=4.0, torch_bf16_weight_sets=3, torch_fp8_finite=True,
                        errors={"torch_fp8_graph_us": "boom"})
    other = dict(T=3, errors={"qmoe_det_graph_us": "x"})
    moe.merge_torch_columns(other, cols)
    assert other["torch_bf16_graph_us"] == 4.0 and other["errors"] == {"qmoe_det_graph_us": "x",
                                                                      "torch_fp8_graph_us": "boom"}


# ------------------------------------------------------------------------------------------------
# every mode's random data through qmoe's CPU engine; the torch peers once per (model, T) (torch on the CPU)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["w4a8_int4", "w4a16_int4", "w4a16", "w4a8", "w4a4"])
def test_mode_data_runs_on_the_cpu_engine(mode):
    torch = pytest.importorskip("torch")
    import qmoe

    gen = torch.Generator().manual_seed(7)
    experts, topk, hidden, inter, tokens = 6, 2, 512, 256, 9
    w = moe.make_qmoe_weights(torch, experts, hidden, inter, gen, "cpu", mode)
    act = common.make_mode_activations(torch, mode, tokens, hidden, gen, "cpu")
    for name, (shape, dtype) in moe.qmoe_weight_shapes(experts, hidden, inter, mode).items():
        assert tuple(w[name].shape) == shape and str(w[name].dtype) == "torch." + dtype, name
    if not mode.endswith("int4"):
        code = "e4m3" if mode in ("w4a16", "w4a4") else "ue8m0"
        lo, hi = common.SCALE_CODES[code]
        for name in ("w1_scale", "w2_scale"):
            assert int(w[name].min()) >= lo and int(w[name].max()) <= hi, name
        assert w["w1_alpha"].shape == (experts,) and w["w1_alpha"].dtype == torch.float32
    expect_x = {"w4a4": (torch.uint8, (tokens, hidden // 2)), "w4a8": (torch.float8_e4m3fn, (tokens, hidden))}
    dtype, shape = expect_x.get(mode, (torch.bfloat16, (tokens, hidden)))
    assert act["x"].dtype == dtype and tuple(act["x"].shape) == shape
    ids = common.routing(torch, tokens, topk, experts, gen, device="cpu")
    wts = moe._routing_weights(torch, tokens, topk, gen, "cpu")
    out = qmoe.fused_moe(**w, **act, topk_ids=ids, topk_weights=wts, quant_mode=mode, num_experts=experts,
                         gate_up_layout=common.mode_gate_up_layout(mode, inter), deterministic=True).float()
    rms = float(out.pow(2).mean().sqrt())
    assert bool(torch.isfinite(out).all()) and 0.05 < rms < 20, rms  # O(1): the alphas / scales are sane


def test_torch_peers_measured_once_per_model_and_tokens(monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []

    def fake_torch_bench(torch, ctx, rows, routes, args, timer, kind):
        calls.append((ctx[0], kind, tuple(r["T"] for r in rows)))
        for r in rows:
            r[f"torch_{kind}_graph_us"] = 100.0 + r["T"]

    monkeypatch.setattr(moe, "_bench_torch", fake_torch_bench)
    monkeypatch.setattr(moe, "_bench_qmoe", lambda *a, **k: None)
    args = moe._parse_args(["--dry-run", "--models", "mixtral_8x7b", "--tokens", "1,3", "--quant-mode", "all"])
    cache = {}
    for mode in args.quant_mode:
        rows = moe.bench_model(torch, "mixtral_8x7b", args, dict(moe.NOMINAL_CEILINGS), {}, moe.HostTimer(), "cpu",
                               mode, cache)
        assert [r["torch_fp8_graph_us"] for r in rows] == [101.0, 103.0]
    assert calls == [(8, "bf16", (1, 3)), (8, "fp8", (1, 3))]


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


# ------------------------------------------------------------------------------------------------
# issue #4 / #5 targets under the table
# ------------------------------------------------------------------------------------------------
def test_targets_use_the_faster_finalize_and_the_decode_window():
    row = dict(model="m", T=64, floor_us=100.0, qmoe_det_graph_us=140.0, qmoe_fused_graph_us=129.0,
               vllm_fp8_graph_us=129.0, vllm_bf16_graph_us=200.0)
    checks = {name: ok for name, ok, _ in moe.target_checks(row)}
    assert checks["decode (T <= 64) <= 1.3 x floor"] is True            # 129 <= 130 (the fused finalize)
    assert checks["faster than vLLM fp8"] is False                      # a tie is not faster
    assert checks["faster than vLLM bf16"] is True
    assert "faster than vLLM int4" not in checks                        # no peer time: no check
    assert {n for n, _, _ in moe.target_checks(row, finalizes=("det",))} >= {"decode (T <= 64) <= 1.3 x floor"}
    assert not dict((n, ok) for n, ok, _ in moe.target_checks(row, finalizes=("det",)))["decode (T <= 64) <= 1.3 x floor"]
    assert "decode (T <= 64) <= 1.3 x floor" not in {n for n, _, _ in moe.target_checks(dict(row, T=65))}


def test_targets_summary_under_the_table():
    rows = _rows()  # qwen3 T=8: 55.5 us (fused) vs floor 30 (1.85x), vLLM bf16 157.9; gpt-oss: no qmoe time
    text = moe.markdown(rows, [])
    assert "- decode (T <= 64) <= 1.3 x floor: 0 / 1; missed at qwen3_30b_a3b T=8 (1.85x floor)" in text
    assert "- faster than vLLM bf16: 1 / 1" in text
    assert "gpt_oss_120b T=8 (" not in text.split("Targets")[1]
    assert moe.targets_summary([rows[1]]) == []
