"""Repeats are independent draws: timed repeat r trains from the spec's seed + r (initial weights, batch order,
dropout masks), the same draw in every precision; untimed runs keep the spec's seed."""
from __future__ import annotations

import numpy as np
import pytest

from harness import results
from harness.model import reference
from harness.run import worker
from harness.run.metrics import loss_and_correct
from harness.run.plan import resolve
from tests.conftest import SPECS
from tests.core.test_runner import amp
from tests.fake_adapter.fake_adapter import FakeAdapter, FakeTrainer

SPEC = str(SPECS / "pitfall_dropout_adam.yaml")  # seed 6, two dropout layers


class ReferenceTrainer(FakeTrainer):
    """Its loss is the spec's, from the numpy reference on the weights, batch and masks it was given; it keeps
    the first step's batch and masks."""

    first = None

    def to_device(self, x, y, masks):
        return x.copy(), y.copy(), {path: m.copy() for path, m in masks.items()}

    def run_step(self, batch, capture):
        x, y, masks = batch
        self.first = self.first or batch
        outputs = reference.forward(self.spec, self.weights, x, training=True, masks=masks)
        return loss_and_correct(self.spec.loss, outputs, y)[0] / len(y)


class ReferenceAdapter(FakeAdapter):
    def __init__(self):
        self.built: list[ReferenceTrainer] = []

    def build(self, spec, graph, weights, precision, loss_scale, device, variant):
        self.built.append(ReferenceTrainer(spec, graph, weights, precision, loss_scale, device, variant))
        return self.built[-1]


def runs(monkeypatch, requests: list[tuple[str, int]], mode: str = "run"):
    """Records of (precision, repeat) runs in this process, and the trainer each was built with."""
    adapter = ReferenceAdapter()
    monkeypatch.setattr(worker, "load_adapter", lambda name: adapter)
    records, trainers = [], []
    spec = resolve(SPEC, steps=2)[0].model_dump(mode="json")
    for p, r in requests:
        records.append(worker.run(worker.RunRequest(framework="fake", model=SPEC, spec=spec, precision=p, repeat=r,
                                                    run_id=f"{p}-{r}", warmup=1, mode=mode, measure_peak=False)))
        trainers.append(adapter.built[-1])  # the run's own: a capability probe builds one before it
    assert all(r["status"] == "ok" for r in records), [r["reason"] for r in records]
    return records, trainers


def test_three_repeats_are_three_seeds_with_their_own_weights_batches_and_masks(monkeypatch):
    records, trainers = runs(monkeypatch, [("fp32", 0), ("fp32", 1), ("fp32", 2)])
    assert [r["seed"] for r in records] == [6, 7, 8]
    assert len({r["spec_hash"] for r in records}) == 1  # the report groups repeats by it
    assert len({r["loss"][0] for r in records}) == 3
    a, b, c = trainers
    for one, other in ((a, b), (b, c), (a, c)):
        assert any(not np.array_equal(one.weights[k], other.weights[k]) for k in one.weights), "initial weights"
        assert not np.array_equal(one.first[0], other.first[0]), "the first batch (data order)"
        assert any(not np.array_equal(one.first[2][k], other.first[2][k]) for k in one.first[2]), "dropout masks"


def test_repeat_r_is_the_same_draw_in_every_precision(monkeypatch):
    records, (fp32, bf16) = runs(monkeypatch, [("fp32", 1), ("amp_bf16", 1)])
    assert records[0]["seed"] == records[1]["seed"] == 7
    assert records[0]["loss"][0] == records[1]["loss"][0]  # float64 reference: same weights, batch, masks
    assert all(np.array_equal(fp32.weights[k], bf16.weights[k]) for k in fp32.weights)
    assert all(np.array_equal(fp32.first[2][k], bf16.first[2][k]) for k in fp32.first[2])


def test_untimed_runs_keep_the_specs_seed(monkeypatch):
    records, _ = runs(monkeypatch, [("fp32", 2)], mode="fingerprint")
    assert records[0]["seed"] == 6


def test_repeats_through_the_cli_record_their_seeds(tmp_path):
    out = amp("run", "--framework", "fake", "--model", SPEC, "--precision", "fp32", "--repeats", "3", "--steps", "2",
              "--warmup", "0", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    records = results.read_records([tmp_path])
    assert sorted((r["repeat"], r["seed"]) for r in records) == [(0, 6), (1, 7), (2, 8)]


def test_a_matrix_whose_last_seed_passes_2_32_is_refused_before_any_run(tmp_path):
    spec = tmp_path / "high_seed.yaml"
    spec.write_text((SPECS / "pitfall_dropout_adam.yaml").read_text().replace("seed: 6", f"seed: {2**32 - 2}"))
    out = amp("run", "--framework", "fake", "--model", str(spec), "--repeats", "3", "--steps", "2",
              "--out", str(tmp_path / "out"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "amp-harness: error: pitfall_dropout_adam: seed 4294967294 + repeat 2 = 4294967296, past 4294967295, the "
        "largest seed numpy's generators take; lower the spec's seed or the repeats"]
    assert not (tmp_path / "out").exists()
    assert amp("run", "--framework", "fake", "--model", str(spec), "--repeats", "2", "--steps", "2", "--warmup", "0",
               "--out", str(tmp_path / "out")).returncode == 0  # seed 2^32 - 1 is the last one numpy takes


@pytest.mark.parametrize("seed, kept", [(7, True), (None, True), ("7", False), (-1, False), (True, False)])
def test_a_record_s_seed_is_a_non_negative_int_or_none(seed, kept):
    record = results.empty_record(run_id="a", framework="fake", precision="fp32", status="ok", seed=seed, model="m",
                                  batch_size=4)  # what an ok record holds (harness.records: RunRecord.OK_HOLDS)
    assert bool(results.usable([record])[0]) == kept
