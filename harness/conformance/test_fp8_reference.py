"""FP8 training held to the core's numpy reference directly (harness.fp8: quantize, scale_for, scaled_quantize,
AmaxHistory), not only to the other frameworks through parity: an adapter whose casts agree with the others' but
not with the rule (the same wrong format, a missing cast, the bias on the wrong side of the gradient's cast) would
pass parity and fail here.

- Forward (fp8_e4m3): a dense network and a conv one predict what numpy computes in float64 from each matmul's
  input and kernel cast to e4m3 at their own amax's scale, the bias added after the product.
- Training (fp8_e4m3, fp8_hybrid, fp8_hybrid:delayed:2, and its :native variant where the adapter has FP8
  matmuls of its own): three SGD steps of one dense classifier move its weights
  as numpy does: the forward's casts, the logits' gradient cast to the backward format (e5m2 in the hybrid) at its
  own scale, the kernel's gradient Q(x)^T Q(G), the bias's from G uncast (the bias is added after the cast
  product, so its gradient does not pass the cast), each scaled by the precision's recipe (AmaxHistory: the
  current recipe's own amax, or the delayed one's last N training steps at that place); and predict() after each
  step casts as an evaluation does (a delayed history read, not recorded into).

FP8 makes the reference brittle where float32 rounding meets a cast: a value that float32 leaves an ulp from a
rounding boundary of the FP8 grid moves by a whole FP8 step (12.5% in e4m3, 25% in e5m2) when the framework sums in
another order. So every cast of a value the framework computes is either exact by construction (the forward: see
_exact_in_float32) or checked in the reference to lie clear of every boundary (the training: see _Casts), and only
a network's last, uncast output meets float32 accumulation-order tolerances.
"""
from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from harness.errors import HarnessError
from harness.fp8 import E4M3, AmaxHistory, Fp8Format, Fp8Policy, Recipe, scale_for, scaled_quantize
from harness.model import reference
from harness.model.graph import infer
from harness.model.spec import validate
from harness.precision import LossScale, parse_precision

FORWARD_BOUND = 1e-5  # of the output's largest magnitude: the last layer's float32 accumulation order, no more
WEIGHT_BOUND = 1e-6  # of each weight's largest magnitude after a step
MARGIN = 1e-5  # relative: how far float32 may move a computed value without tipping its cast (~170 float32 ulps)
LEARNING_RATE = 0.1

_CLASSIFIER = {
    "dataset": {"name": "synthetic", "num_classes": 10, "size": 64},  # not read: the tests give their own batches
    "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
    "optimizer": {"type": "sgd", "learning_rate": LEARNING_RATE, "momentum": 0.0, "nesterov": False},
    "batch_size": 8,
    "steps": 3,
    "seed": 0,
}
MLP = {**_CLASSIFIER, "name": "fp8_reference_mlp",
       "description": "FP8 forward: dense 16->32 with bias, relu, dense 32->10 against numpy's casts",
       "input": {"shape": [16]},
       "layers": [{"type": "dense", "units": 32}, {"type": "relu"}, {"type": "dense", "units": 10}]}
CONVNET = {**_CLASSIFIER, "name": "fp8_reference_convnet",
           "description": "FP8 forward: conv2d 3x3 with bias on a 6x6x2 image, flatten, dense against numpy's casts",
           "input": {"shape": [6, 6, 2]},
           "layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3}, {"type": "flatten"},
                      {"type": "dense", "units": 10}]}
DENSE = {**_CLASSIFIER, "name": "fp8_reference_dense",
         "description": "FP8 training: one dense layer 8->4, sparse cross-entropy from logits, SGD at 0.1",
         "dataset": {"name": "synthetic", "num_classes": 4, "size": 64},
         "input": {"shape": [8]},
         "layers": [{"type": "dense", "units": 4}]}


def _build(adapter, unsupported, spec_dict: dict, name: str, weights: dict[str, np.ndarray]):
    """The adapter's trainer for `spec_dict` in precision `name`, from the given weights; a skip where the core does
    not parse the precision yet or the adapter cannot run it here (Capabilities.no_fp8: MXNet)."""
    try:
        precision = parse_precision(name)
    except HarnessError as exc:
        pytest.skip(f"{name}: the core does not parse this precision yet ({exc})")
    reason = unsupported(name)
    if reason:
        pytest.skip(f"{name} unsupported here: {reason}")
    spec = validate(spec_dict, spec_dict["name"])
    graph = infer(spec)
    assert {k: v.shape for k, v in weights.items()} == graph.param_shapes(), "the test's weights must fit its spec"
    trainer = adapter.build(spec, graph, weights, precision, LossScale(), adapter.device("cpu"),
                            next(iter(adapter.variants)))
    return trainer, spec, precision


def _cast(values, fmt: Fp8Format) -> np.ndarray:
    """The current recipe's cast: values at the scale of their own amax, cast to fmt and back (float32)."""
    return scaled_quantize(values, fmt, scale_for(float(np.abs(values).max()), fmt))


# ---- forward ------------------------------------------------------------------------------------------------
def _coarse(rng, shape, exponents, zeros=0.1) -> np.ndarray:
    """Values of 7 significant bits in the binades [2^e, 2^(e+1)) of `exponents`, random signs, a share `zeros` of
    exact zeros. The e4m3 cast keeps 4 of the 7 bits (some values exactly halfway: ties to even), and whatever the
    cast gives is a multiple of 2^(min(exponents) - 3) below 2^(max(exponents) + 1)."""
    k = rng.integers(64, 128, shape).astype(np.float64)
    values = np.ldexp(k, rng.choice(exponents, shape) - 6) * rng.choice([-1.0, 1.0], shape)
    return np.where(rng.random(shape) < zeros, 0.0, values).astype(np.float32)


def _forward_case(spec_dict: dict, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Weights and a batch for the forward check. Only the first matmul's output is cast again (by the second
    matmul), so only it must be exact: its input and kernel (and so their casts) come from _coarse, its bias is
    coarse too; the last layer's kernel and bias are plain random values, cast where the framework casts them."""
    rng = np.random.default_rng(seed)
    graph = infer(validate(spec_dict, spec_dict["name"]))
    shapes = graph.param_shapes()
    first = min(shapes, key=lambda name: int(name.split(".")[0])).split(".")[0]
    weights = {}
    for name, shape in shapes.items():
        if name == f"{first}.kernel":
            weights[name] = _coarse(rng, shape, [-4, -3, -2])
        elif name == f"{first}.bias":
            weights[name] = (rng.integers(-512, 512, shape) / 2.0**10).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * (0.3 if name.endswith("kernel") else 0.1)).astype(np.float32)
    x = _coarse(rng, (spec_dict["batch_size"], *spec_dict["input"]["shape"]), [-2, -1, 0])
    return weights, x


def _grain(values) -> float:
    """The largest power of two of which every value is a multiple (inf for none or only zeros)."""
    v = np.asarray(values, np.float64).ravel()
    v = v[v != 0]
    if not v.size:
        return np.inf
    mantissa, exponent = np.frexp(np.abs(v))  # |v| = m 2^e, m in [0.5, 1), m 2^53 an integer
    ints = (mantissa * 2.0**53).astype(np.int64)
    return float(np.ldexp((ints & -ints).astype(np.float64), exponent - 53).min())


def _exact_in_float32(a, b, bias) -> bool:
    """a @ b + bias is exact in float32 in any summation order: every product and the bias are multiples of one
    power of two g, and the sum of their magnitudes stays below 2^24 g, so every partial sum is a float32."""
    grain = min(_grain(a) * _grain(b), _grain(bias))
    return float((np.abs(a).astype(np.float64) @ np.abs(b) + np.abs(bias)).max()) < 2.0**24 * grain


def _fp8_forward(spec, weights: dict[str, np.ndarray], x: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """The network's output in numpy: each matmul's input and kernel cast at their own amax's scale (the current
    recipe), multiplied in float64, the bias added after. Conv2d as im2col (valid padding only); every matmul but the
    last must be exact in float32 (_exact_in_float32), else a framework's summation order could tip the next cast."""
    matmuls = [i for i, layer in enumerate(spec.layers) if layer.type in ("dense", "conv2d")]
    out = x.astype(np.float64)
    for i, layer in enumerate(spec.layers):
        if layer.type == "relu":
            out = np.maximum(out, 0.0)
        elif layer.type == "flatten":
            out = out.reshape(len(out), -1)
        elif layer.type in ("dense", "conv2d"):
            kernel, bias = weights[f"{i}.kernel"], weights.get(f"{i}.bias", np.float32(0))
            q_in, q_kernel = _cast(out.astype(np.float32), fmt), _cast(kernel, fmt)
            if layer.type == "conv2d":
                assert layer.padding == "valid" and layer.strides == 1, "the reference takes valid, stride-1 convs"
                k, (n, h, w, c) = layer.kernel_size, q_in.shape
                windows = sliding_window_view(q_in, (k, k), axis=(1, 2))  # [N, Ho, Wo, C, k, k]
                q_in = windows.reshape(-1, c * k * k)  # each row a window in (C, k, k) order
                q_kernel = q_kernel.transpose(2, 0, 1, 3).reshape(c * k * k, -1)  # HWIO -> (C, k, k) x O
                shape = (n, h - k + 1, w - k + 1, q_kernel.shape[1])
            else:
                shape = (len(q_in), q_kernel.shape[1])
            if i != matmuls[-1]:
                assert _exact_in_float32(q_in, q_kernel, bias), (
                    f"the test's own inputs: layer {i}'s cast product is not exact in float32, so a framework's "
                    f"summation order could tip the next layer's cast; choose coarser values in _forward_case")
            out = (q_in.astype(np.float64) @ q_kernel.astype(np.float64) + bias).reshape(shape)
        else:
            raise AssertionError(f"the FP8 reference forward does not take {layer.type} layers")
    return out


@pytest.mark.parametrize("spec_dict", [MLP, CONVNET], ids=["mlp", "convnet"])
def test_fp8_e4m3_forward_matches_the_numpy_casts(adapter, unsupported, spec_dict):
    """predict() at fp8_e4m3 against numpy's casts of each matmul's input and kernel (harness.fp8), to 1e-5 of the
    output's largest magnitude: the first matmul's output is exact in float32 (its inputs are coarse: see
    _forward_case), so the second layer's casts see the same values in every framework, bit for bit."""
    weights, x = _forward_case(spec_dict, seed=1)
    trainer, spec, _ = _build(adapter, unsupported, spec_dict, "fp8_e4m3", weights)
    expected = _fp8_forward(spec, weights, x, E4M3)
    got = np.asarray(trainer.predict(x), np.float64)
    assert got.shape == expected.shape, f"{spec.name}: predict returned shape {got.shape}, expected {expected.shape}"
    error = np.abs(got - expected).max() / np.abs(expected).max()
    if error < FORWARD_BOUND:
        return
    plain = reference.forward(spec, weights, x)  # float64, no casts
    why = ("; they are float32's without casts: the matmul layers do not cast their inputs"
           if np.abs(got - plain).max() / np.abs(plain).max() < FORWARD_BOUND else "")
    raise AssertionError(
        f"{spec.name} at fp8_e4m3: predict's outputs differ from numpy's FP8 forward by {error:.2e} of their largest "
        f"magnitude (bound {FORWARD_BOUND:.0e}){why}. Each dense and conv2d layer must multiply its input and kernel "
        f"each cast to e4m3 at the scale of its own amax (harness.fp8.fake_quantize_with with the tensor's amax), "
        f"accumulate in float32 and add the bias after the product")


# ---- training -------------------------------------------------------------------------------------------------
class _Casts:
    """The reference's casts at one dense layer, by place (ROLES: input, weight, output_gradient), each scaled by
    the recipe through harness.fp8.AmaxHistory (the current recipe: the tensor's own amax; delayed:N: the largest of
    the last N training steps' amaxes at that place, the first step its own), so the rule stays the core's; an
    evaluation reads the histories without recording.

    It also checks the test's own inputs: a value the framework computes (the weights after a step, the logits'
    gradient) is cast only where moving it by MARGIN either way casts it alike, and every amax lies as clear of a
    change of scale, so float32's rounding in any order cannot tip a cast the reference makes."""

    def __init__(self, policy: Fp8Policy, recipe: Recipe):
        self.histories = {"input": AmaxHistory(recipe, policy.forward), "weight": AmaxHistory(recipe, policy.forward),
                          "output_gradient": AmaxHistory(recipe, policy.backward)}
        self.brittle: list[str] = []

    def __call__(self, role: str, values: np.ndarray, where: str, computed: bool, record: bool = True) -> np.ndarray:
        history = self.histories[role]
        amax = float(np.abs(values).max())
        scale = history.scale(amax)
        if record:
            history.record(amax)
        if computed:
            up, down = (scaled_quantize(values * (1 + d), history.fmt, scale) for d in (MARGIN, -MARGIN))
            if (up != down).any() or not scale_for(amax * (1 + MARGIN), history.fmt) == \
                    scale_for(amax * (1 - MARGIN), history.fmt) == scale_for(amax, history.fmt):
                self.brittle.append(f"the {role.replace('_', ' ')} at {where}")
        return scaled_quantize(values, history.fmt, scale).astype(np.float64)


def _reference_training(policy: Fp8Policy, weights: dict[str, np.ndarray], batches, probe: np.ndarray, *,
                        recipe: Recipe | None = None, cast_gradient: bool = True, bias_from_cast: bool = False,
                        evaluation_records: bool = False):
    """After each SGD step of the dense classifier (numpy, float64 products of float32 values): the weights, and
    the logits an evaluation of `probe` gives then; and the casts too near a boundary (_Casts). The keywords give the
    variants a failure is compared against: the defaults are the rule (docs/fp8.md)."""
    casts = _Casts(policy, policy.recipe if recipe is None else recipe)
    kernel, bias = weights["0.kernel"], weights["0.bias"]
    after, evaluated = [], []
    for step, (x, y) in enumerate(batches):
        where = f"step {step}"
        q_x, q_kernel = casts("input", x, where, computed=False), casts("weight", kernel, where, computed=step > 0)
        logits = q_x @ q_kernel + bias
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        # the batch-mean cross-entropy's gradient with respect to the logits, in float32 as the framework holds it
        gradient = ((p - np.eye(p.shape[1])[y]) / len(y)).astype(np.float32)
        cast = casts("output_gradient", gradient, where, computed=True) if cast_gradient else gradient
        kernel = (kernel - LEARNING_RATE * (q_x.T @ cast)).astype(np.float32)
        bias = (bias - LEARNING_RATE * (cast if bias_from_cast else gradient).sum(0, dtype=np.float64)).astype(
            np.float32)
        after.append({"0.kernel": kernel, "0.bias": bias})
        where = f"the evaluation after step {step}"
        evaluated.append({"logits": casts("input", probe, where, computed=False, record=evaluation_records)
                          @ casts("weight", kernel, where, computed=True, record=evaluation_records) + bias})
    return after, evaluated, casts.brittle


def _training_case(seed: int):
    """Initial weights, three batches of the dense classifier and a batch to evaluate after each step. The batches'
    amaxes move (1.9, 0.6, 3.9) so that the delayed recipe's casts differ from the current one's: at step 2 the
    history's largest amax is step 0's (step 1's alone would give another scale), and the input's values beyond 3.5
    (448 at step 0's scale, 2^7) saturate. The evaluated batch's amax, 1000, is far above every training batch's:
    the delayed recipe saturates it at the history's scale, and would cast the next steps' inputs at a scale of 2^-2
    if an evaluation recorded it."""
    rng = np.random.default_rng(seed)
    weights = {"0.kernel": (rng.standard_normal((8, 4)) * 0.3).astype(np.float32),
               "0.bias": (rng.standard_normal(4) * 0.1).astype(np.float32)}

    def batch(amax):
        x = rng.standard_normal((8, 8))
        return (x * (amax / np.abs(x).max())).astype(np.float32)

    batches = [(batch(amax), rng.integers(0, 4, 8).astype(np.int64)) for amax in (1.9, 0.6, 3.9)]
    return weights, batches, batch(1000.0)


def _differs(got: dict, want: dict, bound: float) -> list[str]:
    """The arrays of `want` that `got` misses by more than `bound` of their largest magnitude."""
    return [f"{name} by {np.abs(got[name] - w).max() / np.abs(w).max():.2e}" for name, w in want.items()
            if not np.abs(got[name] - w).max() <= bound * np.abs(w).max()]


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_hybrid", "fp8_hybrid:delayed:2", "fp8_hybrid:delayed:2:native"])
def test_fp8_training_steps_match_the_numpy_casts(adapter, unsupported, name):
    """Three steps of plain SGD on one dense layer move the weights as numpy's FP8 step does (docs/fp8.md, "Training
    in FP8"), to 1e-6 of each weight's largest magnitude after every step; and predict() after each step casts as the
    recipe does in evaluation (to 1e-5 of the logits' largest magnitude), recording nothing a later step reads."""
    weights, batches, probe = _training_case(seed=3)
    trainer, _, precision = _build(adapter, unsupported, DENSE, name, weights)
    policy = precision.fp8
    expected, evaluated, brittle = _reference_training(policy, weights, batches, probe)
    assert not brittle, (f"the test's own inputs: {', '.join(brittle)} lie within {MARGIN:.0e} of a rounding boundary "
                         f"of its cast or of a change of scale, where float32's summation order could tip it; choose "
                         f"another seed in _training_case")
    variants = {"the logits' gradient not cast": {"cast_gradient": False},
                "the bias's gradient from the cast gradient": {"bias_from_cast": True}}
    if policy.recipe.history:
        variants.update({"the current recipe's scales": {"recipe": Recipe(0)},
                         "evaluations recording their amaxes": {"evaluation_records": True}})
        for what, change in list(variants.items())[2:]:
            other, other_evaluated = _reference_training(policy, weights, batches, probe, **change)[:2]
            assert _differs(other[-1], expected[-1], WEIGHT_BOUND) or _differs(
                other_evaluated[-1], evaluated[-1], FORWARD_BOUND), (
                f"the test's own inputs: {name} with {what} must end elsewhere for the test to tell them apart; "
                f"change the batches' amaxes in _training_case")
    rule = (f"The dense layer must cast its input and kernel to {policy.forward.name} and the gradient of its product "
            f"to {policy.backward.name}, each at the {policy.recipe.name} recipe's scale (harness.fp8; an evaluation "
            f"reads a delayed history without recording), multiply the kernel's gradient as Q(x)^T Q(G) and take the "
            f"bias's gradient from G uncast (the bias is added after the cast product)")

    def instead(step: int, got: dict, part: int, bound: float) -> str:
        """'; they match the reference with VARIANT instead' where a variant explains what the adapter gave."""
        matched = [what for what, change in variants.items() if not _differs(
            got, _reference_training(policy, weights, batches, probe, **change)[part][step], bound)]
        return f"; they match the reference with {' and '.join(matched)} instead" if matched else ""

    for step, (x, y) in enumerate(batches):
        trainer.train_step(trainer.to_device(x, y, {}))
        got = {k: np.asarray(v, np.float64) for k, v in trainer.get_weights().items()}
        missed = _differs(got, expected[step], WEIGHT_BOUND)
        assert not missed, (f"{name}: after step {step} the weights differ from numpy's FP8 step: "
                            f"{', '.join(missed)} of their largest magnitude (bound {WEIGHT_BOUND:.0e})"
                            f"{instead(step, got, 0, WEIGHT_BOUND)}. {rule}")
        logits = {"logits": np.asarray(trainer.predict(probe), np.float64)}
        missed = _differs(logits, evaluated[step], FORWARD_BOUND)
        assert not missed, (f"{name}: predict() after step {step} differs from numpy's FP8 evaluation: "
                            f"{missed[0]} of their largest magnitude (bound {FORWARD_BOUND:.0e})"
                            f"{instead(step, logits, 1, FORWARD_BOUND)}. {rule}")
