"""Hostile inputs at the two halves of the deterministic layer, CPU backend: qmoe.moe_finalize (with
and without row_index) and qmoe.moe_expert_rows. The method and the machinery of
test_hostile_inputs.py (one valid call checked against a numpy twin, then ONE mutation per call;
rejected calls name the argument and write nothing, accepted ones match).

Legal by design (include/qmoe/fused_moe.h): any expert id (outside [0, E) or the local range the
slot is skipped), any routing-weight value (NaN propagates), any row_index value (outside [0, R) the
slot is skipped), any row count R of `rows` when row_index is given.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmoe import ops
from qmoe import testing
from qmoe import reference as ref
from test_hostile_inputs import (_FUSED_ACCEPTED, BF16, CALLS, FUSED_MODES, HYPO, TENSOR_KINDS, Entry, _draw_array_arg,
                                 _maybe_recover, attempt, check_any_ids, check_any_weights, establish,
                                 mutate_tensor, random_array)

TOKENS, TOP_K, HIDDEN, EXPERTS, LOCAL, OFFSET = 5, 3, 64, 8, 4, 2
EXPERT_ARGS = {"num_experts", "num_local_experts", "local_expert_offset"}


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    mine = {k: n for k, n in CALLS.items() if k[0].startswith(("moe_finalize", "moe_expert_rows"))}
    lines = [f"  {entry:28s} {outcome:9s} {n}" for (entry, outcome), n in sorted(mine.items())]
    print(f"\n[test_hostile_finalize] {sum(mine.values())} mutated calls\n" + "\n".join(lines))


def finalize_twin(kw):
    """out[t] = round_out(rsf * sum_j fp32(w[t, j] * row(t*k + j))) in slot order, fp32 without fma,
    over the slots whose expert is valid and local (and whose row index is inside rows)."""
    rows = np.asarray(kw["rows"]).astype(np.float32)
    ids, w = np.asarray(kw["topk_ids"]), np.asarray(kw["topk_weights"], np.float32)
    tokens, top_k = ids.shape
    experts = int(kw["num_experts"])
    local = int(kw.get("num_local_experts") or experts)
    offset = int(kw.get("local_expert_offset", 0))
    index = kw.get("row_index")
    index = None if index is None else np.asarray(index).reshape(-1)
    acc = np.zeros((tokens, rows.shape[1]), np.float32)
    for t in range(tokens):
        for j in range(top_k):
            s, e = t * top_k + j, int(ids[t, j])
            r = s if index is None else int(index[s])
            if 0 <= e < experts and offset <= e < offset + local and 0 <= r < rows.shape[0]:
                acc[t] = acc[t] + np.float32(w[t, j]) * rows[r]
    out = np.float32(kw.get("routed_scaling_factor", 1.0)) * acc
    return {"out": out.astype(np.asarray(kw["out"]).dtype)}


@functools.lru_cache(maxsize=None)
def finalize_entry(with_index):
    ids, weights = testing.make_routing(TOKENS, TOP_K, EXPERTS, seed=31, distinct=True, out_of_range=1, minus_one=1)
    rng = np.random.default_rng(32)
    n_rows = 9 if with_index else TOKENS * TOP_K
    kw = dict(rows=rng.standard_normal((n_rows, HIDDEN)).astype(BF16), topk_ids=ids,
              topk_weights=weights.astype(np.float32), num_experts=EXPERTS, num_local_experts=LOCAL,
              local_expert_offset=OFFSET, routed_scaling_factor=1.5, out=np.zeros((TOKENS, HIDDEN), BF16))
    if with_index:
        index = rng.integers(0, n_rows, size=TOKENS * TOP_K).astype(np.int32)
        index[[1, 7]] = [-1, n_rows + 3]  # skipped slots
        kw["row_index"] = index

    def call(kw):
        got = ops.moe_finalize(**kw)
        assert got is kw["out"]
        return {"out": got}

    accepted = dict(rows={"bfloat16"}, topk_ids={"int32"}, topk_weights={"float32"}, row_index={"int32"},
                    out={"bfloat16", "float16", "float32"})
    names = {"out": {"output"}, **{n: EXPERT_ARGS for n in EXPERT_ARGS}}
    entry = Entry(f"moe_finalize[{'row_index' if with_index else 'slots'}]", call, kw, ("out",), finalize_twin,
                  accepted, names, tol=1e-6)
    return establish(entry)


FINALIZE_BAD_SCALARS = {
    "num_experts": [0, -1, 5],           # 5: the local range [2, 6) does not fit
    "num_local_experts": [-1, 7, 9],
    "local_expert_offset": [-1, 5, 2**40],
    "routed_scaling_factor": [np.nan, np.inf, -np.inf],
}


@settings(max_examples=1500, **HYPO)
@given(st.data())
def test_moe_finalize_hostile(data):
    with_index = data.draw(st.booleans(), label="row_index")
    entry = finalize_entry(with_index)
    kw = dict(entry.kw)
    what = data.draw(st.sampled_from(["tensor"] * 4 + ["alias", "scalar", "ids", "weights"] +
                                     (["index_values", "row_count"] if with_index else [])), label="what")
    if what in ("tensor", "alias"):
        arg = _draw_array_arg(data, entry)
        kinds = TENSOR_KINDS if what == "tensor" else ("alias",)
        if with_index and arg == "rows" and what == "tensor":
            kinds = tuple(k for k in kinds if k not in ("grow", "shrink", "empty"))  # any R is legal: row_count
        mutate_tensor(data, entry, arg, kinds)
    elif what == "scalar":
        name = data.draw(st.sampled_from(sorted(FINALIZE_BAD_SCALARS)), label="scalar")
        kw[name] = data.draw(st.sampled_from(FINALIZE_BAD_SCALARS[name]), label="value")
        attempt(entry, kw, name, legal=False)
    elif what == "ids":
        check_any_ids(data, entry, kw)
    elif what == "weights":
        check_any_weights(data, entry, kw)
    elif what == "index_values":
        index = kw["row_index"].copy()
        for _ in range(data.draw(st.integers(1, 4))):
            index[data.draw(st.integers(0, index.size - 1))] = data.draw(
                st.integers(-2, 12) | st.integers(-2**31, 2**31 - 1), label="index")
        kw["row_index"] = index
        attempt(entry, kw, "row_index", legal=True, compare="twin")
    else:  # row_count: rows [R', H] for any R' >= 0; indices past R' skip their slot
        count = data.draw(st.integers(0, 14), label="rows")
        kw["rows"] = random_array((count, HIDDEN), BF16, data.draw(st.integers(0, 2**16), label="seed"))
        kw["rows"][np.isnan(kw["rows"].astype(np.float32))] = 0  # random bytes: keep the values finite
        attempt(entry, kw, "rows", legal=True, compare="twin")
    _maybe_recover(data, entry)


def test_row_index_shapes():
    """row_index is [T*k] or [T, k] (same result); any other shape names row_index."""
    entry = finalize_entry(True)
    kw = dict(entry.kw)
    kw["row_index"] = kw["row_index"].reshape(TOKENS, TOP_K)
    attempt(entry, kw, "row_index", legal=True)
    for shape in ((TOP_K, TOKENS), (1, TOKENS * TOP_K), (TOKENS * TOP_K - 1,)):
        kw["row_index"] = np.zeros(shape, np.int32)
        attempt(entry, kw, "row_index", legal=False)


# ---- moe_expert_rows: checked through moe_finalize(rows) == the numpy fused_moe(deterministic) ----
ROWS_BAD_SCALARS = {
    "quant_mode": ["w4a8_int5", "", "nvfp4"],
    "activation": ["silu", ""],
    "gate_up_layout": ["interleaved", ""],
    "num_experts": [0, -1, 5],
    "num_local_experts": [-1, 3, 9],
    "local_expert_offset": [-1, 5],
    "tactic": ["not_a_tactic", "decode_m128_n8_k256"],  # the CPU engine has no tactics
}


@functools.lru_cache(maxsize=None)
def expert_rows_entry(mode):
    case = testing.make_fused_moe_case(mode, 5, 256, 128, 8, 2, seed=40 + FUSED_MODES.index(mode),
                                       num_local_experts=4, local_expert_offset=2, out_of_range=1, minus_one=1)
    weights = case["topk_weights"]
    kw = {k: v for k, v in case.items() if v is not None and k != "topk_weights"}
    kw["rows"] = np.zeros((case["topk_ids"].size, 256), BF16)

    def call(kw):
        rows = ops.moe_expert_rows(**kw)
        assert rows is kw["rows"]
        # Rows of dropped or non-local slots stay unwritten (poisoned): moe_finalize never reads them.
        return {"out": ops.moe_finalize(rows, kw["topk_ids"], weights, num_experts=kw["num_experts"],
                                        num_local_experts=kw["num_local_experts"],
                                        local_expert_offset=kw["local_expert_offset"])}

    def twin(kw):
        return {"out": ref.fused_moe(**{k: v for k, v in kw.items() if k != "rows"}, topk_weights=weights,
                                     deterministic=True)}

    accepted = dict(_FUSED_ACCEPTED[mode], topk_ids={"int32"}, w1_alpha={"float32"}, w2_alpha={"float32"},
                    rows={"bfloat16"})
    names = {n: EXPERT_ARGS | ({"w1", "w2", "w1_scale", "w2_scale", "w1_alpha", "w2_alpha"}
                               if n == "num_local_experts" else set()) for n in EXPERT_ARGS}
    return establish(Entry(f"moe_expert_rows[{mode}]", call, kw, ("rows",), twin, accepted, names,
                           testing.tolerance(mode)))


@settings(max_examples=1200, **HYPO)
@given(st.data())
def test_moe_expert_rows_hostile(data):
    entry = expert_rows_entry(data.draw(st.sampled_from(FUSED_MODES), label="mode"))
    kw = dict(entry.kw)
    what = data.draw(st.sampled_from(["tensor"] * 4 + ["alias", "scalar", "ids"]), label="what")
    if what in ("tensor", "alias"):
        mutate_tensor(data, entry, _draw_array_arg(data, entry), TENSOR_KINDS if what == "tensor" else ("alias",))
    elif what == "scalar":
        name = data.draw(st.sampled_from(sorted(ROWS_BAD_SCALARS)), label="scalar")
        kw[name] = data.draw(st.sampled_from(ROWS_BAD_SCALARS[name]), label="value")
        attempt(entry, kw, name, legal=False)
    else:  # any id: outside [0, E) or the local range the slot has no row
        check_any_ids(data, entry, kw)
    _maybe_recover(data, entry)
