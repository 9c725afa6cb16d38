"""The conformance kit fails each deliberately broken adapter (broken_adapters.py) and its message names the
bug. Runs where torch is installed (the torch tox env): the broken adapters are torch's with one bug each."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("amp_harness_torch")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# adapter -> (the kit's tests to run, words the failure must contain: the spec that isolates the bug and
# what that spec says it checks, or the rule broken)
CASES = {
    "broken_flatten": ("numpy_reference and fp32", ["pitfall_flatten_dense", "H, W, C order"]),
    "broken_padding": ("numpy_reference and fp32", ["pitfall_same_padding", "pads the odd pixel bottom/right"]),
    "broken_adam": ("golden and pitfall_dropout_adam", ["pitfall_dropout_adam", "trained with Adam",
                                                        "relative errors against the golden fingerprint"]),
    "broken_lr32": ("golden and pitfall_dropout_adam", ["pitfall_dropout_adam", "trained with Adam",
                                                        "relative errors against the golden fingerprint"]),
    "broken_scaler": ("fixed_scale", ["every step must be skipped"]),
    "broken_causal": ("numpy_reference and fp32", ["pitfall_causal_mask", "layers[1] (attention)"]),
    "broken_softmax_scale": ("numpy_reference and fp32", ["pitfall_causal_mask", "layers[1] (attention)"]),
    "broken_clip": ("clipping", ["pitfall_clip_scaled", "clipping: under a fixed loss scale of 1024",
                                 "clip_norm must act on the unscaled gradients"]),
}


@pytest.mark.parametrize("name", CASES)
def test_the_kit_fails_a_broken_adapter_and_names_the_bug(name):
    selection, words = CASES[name]
    # this tree's torch adapter, which the broken ones are built on, before any installed copy of it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), str(ROOT / "adapters" / "torch")]))
    out = subprocess.run([sys.executable, "-m", "harness", "conformance", "--framework", name, "--",
                          "-k", selection, "-q"], capture_output=True, text=True, env=env,
                         timeout=900, cwd=ROOT)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 1, text[-3000:]
    assert "Traceback" not in text and "Error:" not in text.replace("AssertionError:", ""), text[-3000:]
    assert f"conformance of {name}: FAILED" in text
    for word in words:
        assert word in text, f"{word!r} not in the kit's output: {text[-3000:]}"
