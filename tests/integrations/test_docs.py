"""docs/guide.md's Python examples run as written, with whichever transformers is installed, and
without a FutureWarning (the deprecated `past_key_values` argument included)."""

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide.md"

# Each example in a namespace of its own, in one process (one import of torch and transformers).
RUN_EXAMPLES = """
import sys, warnings
warnings.simplefilter("error", FutureWarning)
for number, example in enumerate(sys.stdin.read().split("\\0")):
    try:
        exec(compile(example, f"guide.md example {number}", "exec"), {})
    except Exception as e:
        sys.exit(f"guide.md example {number} failed: {type(e).__name__}: {e}")
"""


def test_the_guides_examples_run_without_warnings():
    examples = [block.split("```", 1)[0] for block in GUIDE.read_text().split("```python\n")[1:]]
    assert any("generate(" in example for example in examples)
    child = subprocess.run([sys.executable, "-c", RUN_EXAMPLES], input="\0".join(examples), capture_output=True,
                           text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "Warning" not in child.stderr, child.stderr[-3000:]
