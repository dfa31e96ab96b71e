"""qmoe's packed FP4 weight words (qmoe.quant.pack_fp4_weights, docs/design.md 3.4) on the CPU: the packing against
an independent numpy model of the documented bit map, the GEMM decode formulas on packed words against the
e2m1 codes, and fused_moe / cute_dsl_fused_moe / CuteDslMoEWrapper with fp4_weights_packed=True against the
same call on plain weights (the CPU engine unpacks: bit-identical). GPU cases: test_gpu_fused_moe_fp4.py."""
import numpy as np
import pytest

import qmoe
from qmoe import quant as Q
from qmoe import testing
from qmoe.compat import flashinfer

S = (6, 7, 8, 15)  # the low bf16's magnitude bits 8..6 and sign bit 15 (the high bf16: + 16)


def model_position(code: int, bit: int) -> int:
    """docs/design.md 3.4: code c (K = c of an 8-code word) of byte m = c // 2, half c % 2 (odd K: high bf16)."""
    m, half = divmod(code, 2)
    if m < 3:
        return (S[bit] + 16 * half + 3 * m) % 32  # S rotated left by 3 m
    return (3, 4, 0, 1)[bit] + 16 * half


def model_pack(words: np.ndarray) -> np.ndarray:
    out = np.zeros_like(words)
    for c in range(8):
        for j in range(4):
            out |= ((words >> np.uint32(4 * c + j)) & np.uint32(1)) << np.uint32(model_position(c, j))
    return out


def decode_byte(v: np.ndarray, m: int) -> np.ndarray:
    """The GEMMs' decode of byte m of packed words (sm90_grouped_gemm_bf16_w4*.cu) in uint32 arithmetic."""
    mask = np.uint32(0x81C081C0)
    if m < 3:
        r = np.uint32(3 * m)
        rot = v if m == 0 else (v >> r) | (v << np.uint32(32 - 3 * m))
        return rot & mask
    return ((v & np.uint32(0x001B001B)) * np.uint32(0x4108)) & mask


def test_pack_matches_the_documented_bit_map():
    rng = np.random.default_rng(1)
    w = rng.integers(0, 256, (4, 6, 32), dtype=np.uint8)
    packed = Q.pack_fp4_weights(w)
    assert packed.dtype == np.uint8 and packed.shape == w.shape
    np.testing.assert_array_equal(packed.view("<u4"), model_pack(w.view("<u4")))
    np.testing.assert_array_equal(Q.unpack_fp4_weights(packed), w)


def test_decode_of_packed_words_gives_every_e2m1_code():
    rng = np.random.default_rng(2)
    words = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    packed = Q.pack_fp4_weights(words.view(np.uint8).reshape(64, 256)).reshape(-1).view("<u4")
    for m in range(4):
        got = decode_byte(packed, m)
        for half in range(2):
            code = (words >> np.uint32(8 * m + 4 * half)) & np.uint32(0xF)
            want = ((code >> np.uint32(3)) << np.uint32(15)) | ((code & np.uint32(7)) << np.uint32(6))
            np.testing.assert_array_equal((got >> np.uint32(16 * half)) & np.uint32(0xFFFF), want)


@pytest.mark.parametrize("mode", ["w4a4", "w4a8", "w4a16"])
def test_fused_moe_with_packed_weights_equals_plain(mode):
    case = testing.make_fused_moe_case(mode, 11, 256, 128, 8, 2, seed=5)
    plain = qmoe.fused_moe(**case, deterministic=True)
    packed = dict(case, w1=Q.pack_fp4_weights(case["w1"]), w2=Q.pack_fp4_weights(case["w2"]))
    got = qmoe.fused_moe(**packed, deterministic=True, fp4_weights_packed=True)
    np.testing.assert_array_equal(got.view(np.uint16), plain.view(np.uint16))
    # The flag matters: packed weights read as plain ones are other weights.
    assert not np.array_equal(qmoe.fused_moe(**packed, deterministic=True).view(np.uint16), plain.view(np.uint16))


def test_compat_with_packed_weights_equals_plain():
    case = testing.make_fused_moe_case("w4a16", 4, 256, 128, 8, 2, seed=6)
    args = lambda w1, w2: (case["x"], None, case["topk_ids"], case["topk_weights"], w1, case["w1_scale"],  # noqa: E731
                           case["w1_alpha"], None, w2, case["w2_scale"], case["w2_alpha"])
    plain = flashinfer.cute_dsl_fused_moe(*args(case["w1"], case["w2"]), 8, 2, quant_mode="w4a16",
                                          use_fused_finalize=False)
    pw1, pw2 = Q.pack_fp4_weights(case["w1"]), Q.pack_fp4_weights(case["w2"])
    got = flashinfer.cute_dsl_fused_moe(*args(pw1, pw2), 8, 2, quant_mode="w4a16", use_fused_finalize=False,
                                        fp4_weights_packed=True)
    np.testing.assert_array_equal(got.view(np.uint16), plain.view(np.uint16))
    wrapper = flashinfer.CuteDslMoEWrapper(8, 2, 256, 128, quant_mode="w4a16", use_fused_finalize=False,
                                           fp4_weights_packed=True)
    np.testing.assert_array_equal(wrapper.run(*args(pw1, pw2)).view(np.uint16), plain.view(np.uint16))


def test_packed_flag_refused_for_int4_weights():
    case = testing.make_fused_moe_case("w4a8_int4", 3, 256, 128, 8, 2, seed=7)
    with pytest.raises(ValueError, match="fp4_weights_packed"):
        qmoe.fused_moe(**case, fp4_weights_packed=True)


def test_pack_rejects_partial_words():
    with pytest.raises(ValueError, match="'w'"):
        Q.pack_fp4_weights(np.zeros((2, 6), np.uint8))
    with pytest.raises(ValueError, match="'packed'"):
        Q.unpack_fp4_weights(np.zeros((2, 6), np.uint8))
