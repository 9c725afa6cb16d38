"""The optimizer rules the core owns (harness.model.optimizer): the learning rate of every step under a schedule,
which weights AdamW decays, the spec syntax of adamw, clip_norm and schedule with its one-line refusals, and that
specs written before them keep their hashes."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import yaml

from harness.cli import main
from harness.model.optimizer import learning_rate, scheduled, weight_decay
from harness.model.spec import MODELS_DIR, validate

GPT = yaml.safe_load((MODELS_DIR / "tiny_gpt.yaml").read_text())
ADAMW = {"type": "adamw", "learning_rate": 3.0e-4, "beta_1": 0.9, "beta_2": 0.95, "epsilon": 1.0e-8,
         "weight_decay": 0.1, "clip_norm": 1.0,
         "schedule": {"type": "warmup_cosine", "warmup_steps": 10, "min_learning_rate": 3.0e-5}}


def spec(**optimizer):
    doc = copy.deepcopy(GPT)
    doc["optimizer"] = {**ADAMW, **optimizer}
    return validate(doc, "tiny_gpt")


def test_the_issues_syntax_is_accepted_with_its_defaults():
    o = spec().optimizer
    assert (o.type, o.weight_decay, o.clip_norm, o.no_decay) == ("adamw", 0.1, 1.0, ["biases", "norm_scales"])
    assert o.schedule.decay_steps is None and scheduled(o)
    assert not scheduled(spec(schedule={"type": "constant"}).optimizer) and not scheduled(spec(schedule=None).optimizer)


def test_warmup_is_linear_then_cosine_to_the_floor():
    o = spec().optimizer  # 300 steps: warm-up 0..9, cosine 10..299, the floor from 300 on
    peak, floor = 3.0e-4, 3.0e-5
    assert [learning_rate(o, t, 300) for t in (0, 4, 9)] == pytest.approx([peak / 10, peak / 2, peak], rel=1e-12)
    assert learning_rate(o, 10, 300) == pytest.approx(peak, rel=1e-12)  # the cosine starts at the peak
    assert learning_rate(o, 155, 300) == pytest.approx((peak + floor) / 2, rel=1e-12)  # halfway down
    assert learning_rate(o, 299, 300) == pytest.approx(floor + (peak - floor) * (1 + math.cos(math.pi * 289 / 290)) / 2)
    assert learning_rate(o, 300, 300) == learning_rate(o, 5000, 300) == floor
    rates = [learning_rate(o, t, 300) for t in range(10, 300)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # never rises after the warm-up


def test_decay_steps_set_where_the_floor_begins_and_a_constant_schedule_is_constant():
    o = spec(schedule={"type": "warmup_cosine", "warmup_steps": 2, "min_learning_rate": 0.0, "decay_steps": 6}).optimizer
    assert [round(learning_rate(o, t, 300) / 3.0e-4, 12) for t in range(8)] == [0.5, 1.0, 1.0, round((1 + math.cos(math.pi / 4)) / 2, 12), 0.5, round((1 + math.cos(3 * math.pi / 4)) / 2, 12), 0.0, 0.0]
    constant = spec(schedule=None).optimizer
    assert {learning_rate(constant, t, 300) for t in range(400)} == {3.0e-4}


def test_adamw_decays_kernels_and_what_no_decay_leaves_out():
    names = {"0.embeddings": "embeddings", "2.layers.0.gamma": "norm scale", "2.layers.0.beta": "norm beta",
             "2.layers.1.query_kernel": "kernel", "2.layers.1.query_bias": "bias", "7.kernel": "kernel",
             "7.bias": "bias"}
    default = {n: weight_decay(spec().optimizer, n) for n in names}
    assert default == {"0.embeddings": 0.1, "2.layers.0.gamma": 0.0, "2.layers.0.beta": 0.0,
                       "2.layers.1.query_kernel": 0.1, "2.layers.1.query_bias": 0.0, "7.kernel": 0.1, "7.bias": 0.0}
    only_biases = spec(no_decay=["biases"]).optimizer
    assert weight_decay(only_biases, "2.layers.0.gamma") == 0.1 and weight_decay(only_biases, "7.bias") == 0.0
    assert weight_decay(spec(no_decay=["biases", "norm_scales", "embeddings"]).optimizer, "0.embeddings") == 0.0
    adam = validate(GPT, "tiny_gpt").optimizer
    assert {weight_decay(adam, n) for n in names} == {0.0}


@pytest.mark.parametrize("change, expected", [
    ({"schedule": {"type": "cosine"}}, "optimizer.schedule: unknown type 'cosine' (valid: constant, warmup_cosine)"),
    ({"schedule": {"type": "warmup_cosine", "warmup_steps": 10, "min_learning_rate": 0.01}},
     "optimizer: schedule.min_learning_rate: 0.01 is above learning_rate 0.0003"),
    ({"schedule": {"type": "warmup_cosine", "warmup_steps": 10, "decay_steps": 10}},
     "optimizer: schedule.decay_steps: 10 must be above warmup_steps 10"),
    ({"clip_norm": 0}, "optimizer.clip_norm: Input should be greater than 0"),
    ({"no_decay": ["gammas"]}, "optimizer.no_decay[0]: Input should be 'biases', 'norm_scales' or 'embeddings'"),
    ({"weight_decay": -0.1}, "optimizer.weight_decay: Input should be greater than or equal to 0"),
    ({"type": "adamx"}, "optimizer: unknown type 'adamx' (valid: sgd, adam, adamw, rmsprop)"),
    ({"schedule": {"type": "warmup_cosine"}}, "optimizer.schedule.warmup_steps: Field required"),
])
def test_bad_optimizer_specs_are_one_line_exit_2(tmp_path, capsys, change, expected):
    doc = copy.deepcopy(GPT)
    doc["optimizer"] = {**ADAMW, **change}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: {path}: {expected}" in err, err


def test_clip_norm_and_schedule_are_allowed_on_every_optimizer_and_old_hashes_hold():
    doc = copy.deepcopy(GPT)
    before = validate(doc, "tiny_gpt").spec_hash()
    assert before == "14231550f7abfd71"  # tiny_gpt's hash before clip_norm and schedule existed
    for optimizer in ({"type": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": False},
                      {"type": "rmsprop", "learning_rate": 0.01, "rho": 0.9, "epsilon": 1e-7, "epsilon_placement": "inside"},
                      GPT["optimizer"]):
        doc["optimizer"] = {**optimizer, "clip_norm": 0.5, "schedule": {"type": "warmup_cosine", "warmup_steps": 3}}
        assert validate(doc, "x").optimizer.clip_norm == 0.5
    doc["optimizer"] = {**GPT["optimizer"], "clip_norm": 0.5}
    assert validate(doc, "x").spec_hash() != before  # a spec that clips hashes apart


def test_check_prints_the_optimizer_its_schedule_decay_and_clipping(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**GPT, "optimizer": ADAMW}))
    assert main(["check", str(path)]) == 0
    assert ("  optimizer adamw, learning rate 0.0003: warm-up over 10 steps, cosine to 3e-05 at step 300; weight "
            "decay 0.1 (not on biases, norm scales); gradients clipped to a global norm of 1\n"
            in capsys.readouterr().out)
    assert main(["check", "tiny_gpt"]) == 0
    assert "  optimizer adam, learning rate 0.002\n" in capsys.readouterr().out


def _spec_step(o, w, g, state, lr, t, decay):
    """The spec's optimizer step in float64, written out plainly (harness.model.spec's docstring)."""
    if o.type == "sgd":
        state["momentum"] = o.momentum * state.get("momentum", 0) + g
        direction = g + o.momentum * state["momentum"] if o.nesterov else state["momentum"]
        return w - lr * direction
    if o.type == "rmsprop":
        state["square_avg"] = o.rho * state.get("square_avg", 0) + (1 - o.rho) * g * g
        v = state["square_avg"]
        return w - lr * g / (np.sqrt(v + o.epsilon) if o.epsilon_placement == "inside" else np.sqrt(v) + o.epsilon)
    state["m"] = o.beta_1 * state.get("m", 0) + (1 - o.beta_1) * g
    state["v"] = o.beta_2 * state.get("v", 0) + (1 - o.beta_2) * g * g
    m_hat, v_hat = state["m"] / (1 - o.beta_1 ** t), state["v"] / (1 - o.beta_2 ** t)
    return w * (1 - lr * decay) - lr * m_hat / (np.sqrt(v_hat) + o.epsilon)


@pytest.mark.parametrize("optimizer", [
    {"type": "sgd", "learning_rate": 0.05, "momentum": 0.9, "nesterov": True},
    {"type": "sgd", "learning_rate": 0.05, "momentum": 0.0, "nesterov": False},
    {"type": "adam", "learning_rate": 0.05, "beta_1": 0.9, "beta_2": 0.99, "epsilon": 0.1},
    {"type": "adamw", "learning_rate": 0.05, "beta_1": 0.9, "beta_2": 0.99, "epsilon": 0.1, "weight_decay": 0.5},
    {"type": "rmsprop", "learning_rate": 0.05, "rho": 0.9, "epsilon": 0.1, "epsilon_placement": "inside"},
    {"type": "rmsprop", "learning_rate": 0.05, "rho": 0.9, "epsilon": 0.1, "epsilon_placement": "outside"},
])
def test_the_rounded_update_is_the_specs_optimizer_in_float32_written_by_the_rounding(optimizer):
    """harness.rounding.rounded_update, the rule every adapter's rounded optimizer runs on its primitives, here on
    numpy's: three steps of each optimizer stay within float16's nearest rounding of the float64 spec math."""
    from harness.rounding import NUMPY_OPS, Rounding, gap, rounded_slots, rounded_update

    o = validate({**copy.deepcopy(GPT), "optimizer": optimizer}, "tiny_gpt").optimizer
    rounding = Rounding("nearest", "float16")
    rng = np.random.default_rng(0)
    w = rng.uniform(0.5, 1.0, 64).astype(np.float16)
    slots = {slot: np.zeros(64, np.float16) for slot in rounded_slots(o, rounding)}
    reference, state = w.astype(np.float64), {}
    decay = weight_decay(o, "0.kernel")
    for t in (1, 2, 3):
        g = rng.standard_normal(64).astype(np.float32)
        new, kept = rounded_update(NUMPY_OPS, o, rounding, w.astype(np.float32), g, slots, o.learning_rate, t, decay)
        assert set(kept) == set(slots) and new.dtype == np.float16
        slots = {slot: value.astype(np.float16) for slot, value in kept.items()}
        reference = _spec_step(o, w.astype(np.float64), g.astype(np.float64), state, o.learning_rate, t, decay)
        # state rounded to float16 each step on one side only: a few float16 gaps apart at most
        assert np.all(np.abs(new.astype(np.float64) - reference) <= 4 * gap(reference.astype(np.float32), rounding))
        assert np.any(new != w)  # the update is many gaps: the test sees its math
        w = new
