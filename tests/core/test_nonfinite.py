"""Locating a diverged run's first non-finite value (harness.run.nonfinite) on captured tensors: forward before
backward, a residual block after its inner layers, the backward pass from the output end, the input's range;
and the line the report shows beside the diverged status."""
from __future__ import annotations

import numpy as np

from harness.model.graph import infer
from harness.model.spec import validate
from harness.report.explain import explain
from harness.run.nonfinite import describe, first_nonfinite, locate, lost_epsilon
from tests.core.read_as import read_as

SPEC = validate({"name": "n", "input": {"shape": [4]}, "dataset": {"name": "synthetic", "num_classes": 2},
                 "layers": [{"type": "dense", "units": 4},
                            {"type": "residual", "layers": [{"type": "dense", "units": 4}, {"type": "relu"}]},
                            {"type": "dense", "units": 2}],
                 "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
                 "optimizer": {"type": "sgd", "learning_rate": 0.1, "momentum": 0.0, "nesterov": False},
                 "batch_size": 2, "steps": 1}, "n")
GRAPH = infer(SPEC)
X = np.array([[1.0, -2.0, 3.0, 0.5], [0.0, 1.0, 2.0, -4.0]])


def captured(bad_output=(), bad_gradient=()):
    paths = [info.path for info in GRAPH.layers]  # 0, 1, 1.layers.0, 1.layers.1, 2
    out = {p: (np.full((2, 4), float(i + 1)), np.ones((2, 4))) for i, p in enumerate(paths)}
    for p in bad_output:
        out[p][0][0, 1] = np.inf
    for p in bad_gradient:
        out[p][1][1, 0] = np.nan
    return out


def test_the_forward_pass_comes_first_and_a_block_after_its_inner_layers():
    found = first_nonfinite(GRAPH, X, captured(bad_output=("1", "1.layers.1", "2"), bad_gradient=("0",)))
    assert found == {"layer": "1.layers.1", "layer_type": "relu", "pass": "forward", "tensor": "output",
                     "values": "inf", "input_range": [3.0, 3.0]}  # its input: 1.layers.0's output, all 3s
    assert first_nonfinite(GRAPH, X, captured(bad_output=("0",)))["input_range"] == [-4.0, 3.0]  # the network's input


def test_the_backward_pass_is_searched_from_the_output_end():
    found = first_nonfinite(GRAPH, X, captured(bad_gradient=("0", "1.layers.0")))
    assert (found["layer"], found["pass"], found["tensor"], found["values"]) == \
        ("1.layers.0", "backward", "output gradient", "nan")
    assert first_nonfinite(GRAPH, X, captured()) is None


def test_the_report_shows_it_beside_the_diverged_status():
    located = {"found": True, "step": 3, "layer": "25", "layer_type": "attention", "pass": "forward",
               "tensor": "output", "values": "nan", "input_range": [-512.0, 498.25]}
    line = describe(located)
    assert line == ("first non-finite value at step 3: layer 25 (attention) output, forward pass, nan; its input in "
                    "[-512, 498.2]")
    record = {"status": "diverged", "reason": "loss became nan at step 3", "precision": "fp16", "framework": "torch",
              "model": "m", "nonfinite": located}
    (why,) = [w for w in explain(read_as([record]), {}, []) if "diverged" in w.title]
    assert line in why.text


def test_a_skipped_steps_gradients_are_judged_scaled_in_the_compute_dtype():
    """The capture differentiates the unscaled loss; a skipped step's gradients are held times its loss scale in
    the compute dtype: 2 x 2^15 passes float16's largest value, 1 x 2^15 does not."""
    out = captured()
    out["1.layers.0"][1][0, 0] = 2.0
    found = first_nonfinite(GRAPH, X, out, scale=2.0 ** 15, compute_dtype="float16")
    assert (found["layer"], found["pass"], found["tensor"], found["values"]) == \
        ("1.layers.0", "backward", "output gradient", "inf")
    assert first_nonfinite(GRAPH, X, out, scale=2.0 ** 15, compute_dtype="bfloat16") is None  # bf16's range holds it
    assert first_nonfinite(GRAPH, X, out) is None  # unscaled
    assert "output gradient, backward pass at loss scale 2^15, inf" in describe({"found": True, "step": 0, **found,
                                                                                  "loss_scale": 2.0 ** 15})


class _Trainer:
    """Replays `updates` (per step: {weight: new value}); where an update makes a NaN, its gradient is 1e-4, whose
    square is 0 in float16 (not in float64)."""

    def __init__(self, updates):
        self.updates, self.step = updates, 0
        self.weights = {"0.kernel": np.ones((4, 4)), "1.layers.0.kernel": np.ones((4, 4))}

    def to_device(self, x, y, masks):
        return x

    def captured_step(self, batch):
        gradients = {name: np.where(np.isnan(w), 1e-4, 0.5) for name, w in self.updates[self.step].items()}
        self.weights.update(self.updates[self.step])
        self.step += 1
        return 1.0, {**{n: np.full_like(w, 0.5) for n, w in self.weights.items()}, **gradients}

    def get_weights(self):
        return self.weights

    def layer_outputs(self, x, y):
        return captured()


class _Data:
    def train_batch(self, step):
        return X, np.zeros(2, np.int64)


class _Masks:
    def for_step(self, step, n):
        return {}


def test_an_update_that_makes_a_weight_nonfinite_is_named_at_its_step_before_the_loss_shows_it():
    poisoned = np.ones((4, 4))
    poisoned[0, :2] = np.nan
    updates = [{}, {"1.layers.0.kernel": poisoned}, {}, {}]
    found = locate(lambda: _Trainer(updates), GRAPH, _Data(), _Masks(), 3, weight_dtype="float16",
                   epsilon=(1e-8, "float16"))
    assert {k: found[k] for k in ("step", "layer", "layer_type", "pass", "tensor", "weight", "values", "share",
                                  "gradient_finite", "zero_square_share")} == {
        "step": 1, "layer": "1.layers.0", "layer_type": "dense", "pass": "update", "tensor": "weights",
        "weight": "1.layers.0.kernel", "values": "nan", "share": 2 / 16, "gradient_finite": True,
        "zero_square_share": 1.0}
    assert describe(found) == (
        "first non-finite value at step 1: its update made 12.5% of layer 1.layers.0 (dense)'s weight "
        "1.layers.0.kernel nan from finite gradients; where it did, the gradient's square is 0 in the weights' dtype "
        "for 100% of them; the optimizer's epsilon 1e-08 is 0 in float16, so where the second moment underflows to 0 "
        "the update divides by 0")
    clean = locate(lambda: _Trainer([{}, {}, {}]), GRAPH, _Data(), _Masks(), 2)
    assert not clean["found"] and "finite" in clean["why"]


def test_the_epsilon_is_lost_only_where_the_optimizer_steps_16_bit_weights_itself():
    from harness.precision import parse_precision

    adam = SPEC.model_copy(update={"optimizer": validate({**SPEC.model_dump(), "optimizer": {
        "type": "adam", "learning_rate": 0.1, "beta_1": 0.9, "beta_2": 0.99, "epsilon": 1e-8}}, "n").optimizer})
    assert lost_epsilon(adam.optimizer, parse_precision("fp16")) == (1e-8, "float16")
    assert lost_epsilon(adam.optimizer, parse_precision("bf16")) is None  # bfloat16 holds 1e-8
    assert lost_epsilon(adam.optimizer, parse_precision("fp16_sr")) is None  # its update is computed in float32
    assert lost_epsilon(adam.optimizer, parse_precision("amp_fp16")) is None  # float32 master weights
    assert lost_epsilon(SPEC.optimizer, parse_precision("fp16")) is None  # sgd has no epsilon


def test_diagnose_nonfinite_locates_a_skipped_step_and_a_divergence_and_needs_its_flag_for_a_precision(tmp_path):
    """`diagnose --nonfinite`: one run per precision (results.jsonl) that also replays the first step the scaler
    skipped (the fake overflows at its second step) or the divergence; the fake cannot capture, and says so."""
    from harness import results
    from tests.core.test_runner import amp

    common = ["--framework", "fake", "--model", "mnist_mlp", "--steps", "5", "--no-progress", "--out", str(tmp_path)]
    out = amp("diagnose", "--nonfinite", "--precision", "amp_fp16,fp16,fp32", *common, faults="fp16=nan")
    assert out.returncode == 0, out.stderr
    records = {r["precision"]: r for r in results.read_records([tmp_path])}
    assert records["amp_fp16"]["nonfinite"] == {"found": False, "why": "this adapter cannot capture layer outputs"}
    assert records["amp_fp16"]["loss_scale"]["first_overflow_step"] == 1 and records["amp_fp16"]["status"] == "ok"
    assert records["fp16"]["status"] == "diverged" and not records["fp16"]["nonfinite"]["found"]
    assert "nonfinite" not in records["fp32"] or records["fp32"]["nonfinite"] is None
    assert "fake mnist_mlp amp_fp16: ok: first non-finite value not located: this adapter cannot capture" in out.stdout
    assert "fake mnist_mlp fp32: ok: no non-finite value in 5 steps" in out.stdout
    refused = amp("diagnose", "--precision", "fp16", *common)
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0 and \
        "--precision goes with --nonfinite" in refused.stderr, refused.stderr


def test_a_cell_whose_repeats_all_diverged_is_one_why_entry_quoting_the_located_cause_instead_of_a_guess():
    located = {"found": True, "step": 0, "layer": "0", "layer_type": "embedding", "pass": "update",
               "tensor": "weights", "weight": "0.embeddings", "values": "nan", "share": 0.5}
    records = [{"status": "diverged", "reason": f"loss became nan at step {1 + r}", "precision": "fp16",
                "framework": "torch", "model": "m", "repeat": r, "nonfinite": located} for r in range(3)]
    (why,) = [w for w in explain(read_as(records), {}, []) if "diverged" in w.title]
    assert why.text == ("loss became nan at step 1 (repeat 0; 3 repeats diverged) (first non-finite value at step 0: "
                        "its update made 50.0% of layer 0 (embedding)'s weight 0.embeddings nan).")
