"""torch's native FP8 (the :native precisions: torch._scaled_mm multiplies the casts): its casts are the core's
rule bit for bit (torch's own float8 dtypes against harness.fp8.quantize, after the saturating clamp), and training
through it is the emulation's up to float32 summation order, with the record saying which products ran natively."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from amp_harness_torch.network import FP8_DTYPES, NATIVE_FP8
from harness import fp8
from harness.adapter import load_adapter
from harness.precision import parse_precision
from harness.run import capability, worker

CLASSIFIER = {
    "name": "fp8_native_mlp",
    "description": "two dense layers, the second 5 wide: _scaled_mm's sizes padded to 16",
    "input": {"shape": [12]},
    "dataset": {"name": "synthetic", "num_classes": 5, "size": 64},
    "layers": [{"type": "dense", "units": 20}, {"type": "relu"}, {"type": "dense", "units": 5}],
    "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
    "optimizer": {"type": "adam", "learning_rate": 0.01, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1.0e-7},
    "batch_size": 8,
    "steps": 6,
    "seed": 3,
}
CONVNET = {**CLASSIFIER, "name": "fp8_native_convnet", "description": "a conv2d (emulated) before a dense layer",
           "input": {"shape": [6, 6, 2]},
           "layers": [{"type": "conv2d", "filters": 3, "kernel_size": 3}, {"type": "flatten"},
                      {"type": "dense", "units": 5}]}


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=lambda f: f.name)
def test_torch_float8_casts_are_the_core_rule(fmt):
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(100_000) * np.exp2(rng.integers(-22, 18, 100_000)),
                        [fmt.max, fmt.max * 1.03, fmt.max * 1.2, 2.0 ** fmt.min_subnormal_exp,
                         2.0 ** (fmt.min_subnormal_exp - 1), 1.0 + 2.0 ** -(fmt.mantissa + 1),
                         0.0, -0.0, np.inf, -np.inf, np.nan]]).astype(np.float32)
    x = np.concatenate([x, -x])
    got = torch.from_numpy(x).clamp(-fmt.max, fmt.max).to(FP8_DTYPES[fmt.name]).float().numpy()
    want = fp8.quantize(x, fmt)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (f"{int((~same).sum())} differ, e.g. {x[~same][:3]} -> {got[~same][:3]}, the rule "
                        f"{want[~same][:3]}")


def _fingerprint(spec: dict, precision: str) -> dict:
    record = worker.run(worker.RunRequest(framework="torch", model=spec["name"], spec=spec, precision=precision,
                                          run_id=f"native-{precision}", warmup=0, mode="fingerprint", threads=2,
                                          device="cpu"))
    if record["status"] == "unsupported":  # torch._scaled_mm may not run on every CPU: the probe says why
        pytest.skip(f"{precision}: {record['reason']}")
    assert record["status"] == "ok", record.get("reason")
    return record


def _probed(*precisions: str) -> None:
    """Prove each precision here first: the capability probe takes FP8 steps of its own, which must not be counted
    as the run's (with an empty cache the probe runs inside the run's process)."""
    adapter = load_adapter("torch")
    for name in precisions:
        capability.unsupported(adapter, parse_precision(name), adapter.device("cpu"), in_process=True)


@pytest.mark.parametrize("recipe", ["", ":delayed:2"])
def test_native_training_is_the_emulation_s_and_the_record_says_which_ran(recipe, monkeypatch):
    _probed(f"fp8_hybrid{recipe}", f"fp8_hybrid{recipe}:native")
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].dtype) or scaled_mm(*a, **k))
    emulated = _fingerprint(CLASSIFIER, f"fp8_hybrid{recipe}")
    assert not calls
    native = _fingerprint(CLASSIFIER, f"fp8_hybrid{recipe}:native")
    # each step: two products forward (e4m3 inputs), and back an e5m2 gradient times each saved cast, twice each
    assert calls.count(torch.float8_e5m2) == 4 * CLASSIFIER["steps"], calls
    assert native["options"]["fp8"]["matmuls"] == NATIVE_FP8
    assert emulated["options"]["fp8"]["matmuls"].startswith("emulated")
    losses = np.array(emulated["loss"]), np.array(native["loss"])
    assert np.max(np.abs(losses[0] - losses[1]) / losses[0]) < 1e-6, losses
    final = [np.array(r["fingerprint"]["final_outputs"]) for r in (emulated, native)]
    assert np.max(np.abs(final[0] - final[1])) <= 1e-6 * np.max(np.abs(final[0])), final


def test_a_convolution_stays_emulated_and_the_record_says_so():
    record = _fingerprint(CONVNET, "fp8_e4m3:native")
    assert record["options"]["fp8"]["matmuls"] == f"{NATIVE_FP8}; conv2d emulated (torch has no FP8 convolution)"
