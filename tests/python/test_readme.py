"""The README's CPU quick start runs as written (its first Python block), so the front page cannot rot."""
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_cpu_quick_start_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README.md has no ```python block"
    scope: dict = {}
    exec(compile(blocks[0], "README.md (Python quick start)", "exec"), scope)  # noqa: S102
    out, case = scope["out"], scope["case"]
    assert out.shape == case["x"].shape and out.dtype == case["x"].dtype
    assert np.isfinite(out.astype(np.float32)).all()


def test_readme_packed_weights_snippet_runs():
    """The packed-FP4-weights snippet (the block that calls pack_fp4_weights), on a CPU w4a4 case: same output."""
    import qmoe
    from qmoe import testing

    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if "pack_fp4_weights" in b]
    assert len(blocks) == 1
    case = testing.make_fused_moe_case("w4a4", 5, 256, 128, 8, 2, seed=1)
    plain = qmoe.fused_moe(**case, deterministic=True)
    scope = {"qmoe": qmoe, "case": dict(case)}
    exec(compile(blocks[0], "README.md (packed weights)", "exec"), scope)  # noqa: S102
    np.testing.assert_allclose(scope["out"].astype(np.float32), plain.astype(np.float32), rtol=2e-2, atol=2e-2)
