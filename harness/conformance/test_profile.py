"""Profiles (Trainer.profile, optional): the framework's own profiler, mapped to the spec's layers by the core.

What a profile claims is checked on what the adapter's profiler saw: every layer with weights ran forward and
backward ops under its own scope, the loss and the update ran under theirs, mixed precision's convolutions and
dense layers computed in the precision's 16-bit dtype (the cast map is read from what ran), and the ops account
for the profiled step.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import results
from harness.conformance.plugin import THREADS
from harness.conformance.specs import spec_file
from harness.precision import parse_precision
from harness.run.profile import COVERAGE_TOLERANCE

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
COMPUTE_LAYERS = ("conv2d", "dense")  # the layers mixed precision exists for


def _profiles(tmp_path, framework, unsupported, model, precisions, *sizes) -> list[dict]:
    """The profile records of the precisions that ran; one unsupported must be so by the capability probe."""
    out = subprocess.run([sys.executable, "-m", "harness", "profile", "--framework", framework, "--model",
                          spec_file(tmp_path, model), "--precision", ",".join(precisions), "--steps", "2", *sizes,
                          "--out", str(tmp_path), "--no-progress", "--threads", str(THREADS)],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    records = results.read_records([tmp_path], results.PROFILES_FILE)
    if all(r["status"] == "unsupported" and "cannot profile" in (r.get("reason") or "") for r in records):
        pytest.skip(f"{framework} cannot profile (Trainer.profile is optional)")
    for r in records:
        if r["status"] == "unsupported":
            assert r["reason"] == unsupported(r["precision"]), (
                f"{r['precision']} is unsupported in the profile record ({r['reason']}), but the capability probe "
                f"says {unsupported(r['precision']) or 'it runs'}")
    return [r for r in records if r["status"] != "unsupported"]


def test_profiles_map_every_layer_and_read_compute_dtypes(framework, unsupported, tmp_path):
    """resnet8 (nested residual blocks, projections, batchnorm) in fp32 and both mixed precisions."""
    records = _profiles(tmp_path, framework, unsupported, "resnet8", PRECISIONS)
    assert records, "every precision was unsupported"
    for r in records:
        assert r["status"] == "ok", f"{r['precision']}: {r.get('reason')}"
        p, want = r["profile"], parse_precision(r["precision"]).compute_dtype
        for layer in p["layers"]:
            where = f"{r['precision']} layer {layer['label']}"
            if layer["type"] in ("conv2d", "dense", "batchnorm"):
                assert layer["forward_ms"] > 0 and layer["backward_ms"] > 0, (
                    f"{where}: no forward or backward op ran in its scope (harness.adapter.layer_scope): name a "
                    f"scope per layer and give backward ops their forward op's scope")
            if layer["type"] in COMPUTE_LAYERS:
                # a compiler may compute a 16-bit layer in float32 after all (XLA on a CPU converts bfloat16
                # convolutions back): the profile must then show the casts it ran for that layer
                upcast = r["precision"] != "fp32" and layer.get("compute") == "float32" and layer["cast_ms"] > 0
                assert layer.get("compute") == want or upcast, (
                    f"{where}: its compute op ({layer.get('op')}) computed in {layer.get('compute')}, "
                    f"{r['precision']} computes in {want} (or in float32 after casts the profile shows): read "
                    f"dtypes from what ran (OpTime.inputs)")
        assert p["parts"]["loss"] > 0 and p["parts"]["update"] > 0, (
            f"{r['precision']}: no op ran in LOSS_SCOPE or UPDATE_SCOPE ({p['parts']})")
        if r["precision"] == "amp_fp16":
            assert p["parts"]["loss_scale"] > 0, "amp_fp16 scales its loss: that work runs in LOSS_SCALE_SCOPE"
        if r["precision"] != "fp32":
            assert p["parts"]["casts"] > 0, f"{r['precision']}: mixed precision casts, yet no op was a cast"


def test_profile_accounts_for_the_step(framework, unsupported, tmp_path):
    """small_convnet at a CPU-sized input: layers and parts add up to the profiled step (the rest is "other")."""
    (r,) = _profiles(tmp_path, framework, unsupported, "small_convnet", ("fp32",), "--batch-size", "4", "--input-size", "64x96")
    coverage = r["profile"]["coverage"]
    assert abs(coverage - 1) <= COVERAGE_TOLERANCE, (
        f"ops account for {coverage:.0%} of the profiled step ({r['profile']['parts']}): time outside every op "
        f"(a framework's per-step overhead) or ops counted twice (self times, not totals)")
