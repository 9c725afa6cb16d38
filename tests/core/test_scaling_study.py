"""`amp-harness study scaling`: the width override (what it scales, what it keeps, the spec hash), the sequence
length, and the study's runs: one cell per size, ordinary records tied by a study id, sizes that cannot run here
skipped with a line each."""
from __future__ import annotations

import json

import pytest

from harness.errors import SpecError
from harness.model.graph import infer
from harness.run.plan import resolve
from tests.core.test_runner import amp


def test_width_scales_every_layer_but_the_output_and_its_hash_only_when_set():
    spec, _ = resolve("tiny_gpt")
    old = spec.spec_hash()
    assert spec.with_overrides(width=1).spec_hash() == old  # the file's own network
    assert spec.with_overrides(batch_size=spec.batch_size).spec_hash() == old
    wide = spec.with_overrides(width=2)
    assert wide.width == 2.0 and wide.spec_hash() != old
    dims = [layer.dim for layer in wide.layers if layer.type == "embedding"]
    assert dims == [128]
    mlp = wide.layers[3].layers
    assert [layer.units for layer in mlp if layer.type == "dense"] == [512, 128]
    assert wide.layers[-1].units == 256  # the output layer: the vocabulary
    infer(wide, wide.name)  # shapes fit: the residual stream follows the embedding's dim
    conv, _ = resolve("resnet8")
    half = conv.with_overrides(width=0.5)
    assert half.layers[0].filters == 8 and half.layers[-1].units == 10
    infer(half, half.name)


def test_hashes_of_specs_without_width_are_unchanged():
    # the hashes these specs had before width existed (harness.model.spec.spec_hash leaves None out)
    spec, _ = resolve("mnist_mlp")
    assert "width" not in json.dumps(spec.model_dump(exclude={"description"}, exclude_none=True))
    assert spec.spec_hash() == spec.model_copy(update={"width": None}).spec_hash()
    import hashlib

    data = spec.model_dump(exclude={"description", "width"})
    for part, key in (("input", "vocab"), ("dataset", "task"), ("dataset", "corpus_hash"),
                      ("optimizer", "clip_norm"), ("optimizer", "schedule")):
        if data[part][key] is None:
            del data[part][key]
    assert spec.spec_hash() == hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def test_heads_that_do_not_divide_the_scaled_dim_and_seq_lens_of_an_image_model_are_refused():
    spec, _ = resolve("tiny_gpt")
    with pytest.raises(SpecError, match="width 0.3 makes the model dimension 19, which 4 attention heads do not"):
        spec.with_overrides(width=0.3)
    assert spec.with_overrides(seq_len=128).input.shape == [128]
    with pytest.raises(SpecError, match="--seq-lens applies to models of token ids only"):
        resolve("mnist_mlp")[0].with_overrides(seq_len=16)


def test_the_study_runs_each_size_skips_what_cannot_run_and_records_the_sizes(tmp_path):
    out = amp("study", "scaling", "--framework", "fake", "--model", "mnist_mlp", "--batch-sizes", "8,4096",
              "--widths", "1,2", "--precision", "amp_bf16,fp32", "--repeats", "1", "--steps", "2", "--warmup", "0",
              "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    skipped = [line for line in out.stdout.splitlines() if line.startswith("skipped")]
    assert skipped == [
        "skipped mnist_mlp at batch 4096: mnist_mlp: batch_size 4096 exceeds the 1438 training samples (1797 "
        "samples, 359 of them for evaluation)",
        "skipped mnist_mlp at batch 4096, width 2: mnist_mlp: batch_size 4096 exceeds the 1438 training samples "
        "(1797 samples, 359 of them for evaluation)"]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {(r["batch_size"], r["width"], r["precision"]) for r in records} == {
        (8, None, "fp32"), (8, None, "amp_bf16"), (8, 2.0, "fp32"), (8, 2.0, "amp_bf16")}
    assert len({r["study"] for r in records}) == 1 and records[0]["study"].startswith("scaling-")
    assert records[0]["precision"] == "fp32"  # the baseline first
    wide = [r for r in records if r["width"]]
    assert wide[0]["flops_per_step"] > [r for r in records if not r["width"]][0]["flops_per_step"]
    bad = amp("study", "scaling", "--framework", "fake", "--model", "mnist_mlp", "--seq-lens", "16",
              "--out", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--seq-lens applies to models of token ids" \
        in bad.stderr
    bad = amp("study", "scaling", "--framework", "fake", "--model", "tiny_gpt", "--widths", "0.3",
              "--out", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "attention heads do not divide" in bad.stderr
