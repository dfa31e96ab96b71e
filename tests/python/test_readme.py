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
