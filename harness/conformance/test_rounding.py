"""The pure-16-bit precisions' weight writing (harness.rounding): every adapter that runs them rounds by the
core's rule bit for bit when given the core's bits, and its own on-device noise is unbiased."""
from __future__ import annotations

import numpy as np
import pytest

from harness.precision import PRECISIONS
from harness.rounding import (
    NOISE_RANGE,
    biased,
    round_stochastic,
    sample_values,
    unbiasedness,
    write,
)

ROUNDING = [name for name, p in PRECISIONS.items() if p.rounding is not None and p.rounding.mode != "kahan"]
STOCHASTIC = [name for name in ROUNDING if PRECISIONS[name].rounding.stochastic]
DRAWS = 100_000


def _supported(adapter, unsupported, name):
    if unsupported(name):
        pytest.skip(f"{name} unsupported here: {unsupported(name)}")
    return PRECISIONS[name], adapter.device("cpu")


def _written(adapter, precision, x, bits, device):
    got = adapter.write_weights(precision, x, bits, device)
    assert got is not None, (f"{precision.name} runs here, so write_weights must expose the rounding the optimizer "
                             f"uses (harness.adapter.Adapter.write_weights)")
    assert got.shape == np.shape(x), f"write_weights returned shape {got.shape} for {np.shape(x)}"
    return np.asarray(got, dtype=np.float32)


@pytest.mark.parametrize("name", ROUNDING)
def test_rounding_follows_the_core_rule_bit_for_bit(adapter, unsupported, name):
    """With the core's bits (a fingerprint run's), the adapter writes exactly what harness.rounding does: values
    over the whole range, subnormals, next to powers of two, zeros of both signs and non-finite values."""
    precision, device = _supported(adapter, unsupported, name)
    rng = np.random.default_rng(7)
    base = sample_values(precision.rounding)
    scales = np.ldexp(1.0, rng.integers(-30, 12, 2000)) if precision.rounding.format != "fixed16" else 1.0
    x = np.concatenate([base, rng.standard_normal(2000) * scales, [0.0, -0.0, np.inf, -np.inf, np.nan]])
    x = x.astype(np.float32)
    bits = rng.integers(0, NOISE_RANGE, x.shape, dtype=np.int32)
    expected = write(x, precision.rounding, bits)
    got = _written(adapter, precision, x, bits, device)
    differ = ~((got == expected) | (np.isnan(got) & np.isnan(expected)))
    first = np.argmax(differ)
    assert not differ.any(), (
        f"{name}: {int(differ.sum())} of {x.size} values are written differently from harness.rounding's rule, "
        f"e.g. {x[first]!r} with bits {bits[first]} -> {got[first]!r}, the rule gives {expected[first]!r} (read "
        f"the rule in harness/rounding.py's docstring)")


@pytest.mark.parametrize("name", STOCHASTIC)
def test_stochastic_rounding_with_the_devices_noise_is_unbiased(adapter, unsupported, name):
    """Over 10^5 draws of the adapter's own on-device bits (a timed run's), each value's mean rounding is the
    value within 3 standard errors, every draw one of its two neighbours: values spread over the format's
    range, subnormals and values next to powers of two (harness.rounding.sample_values)."""
    precision, device = _supported(adapter, unsupported, name)
    values = sample_values(precision.rounding)
    x = np.ascontiguousarray(np.broadcast_to(values, (DRAWS, values.size)))
    got = _written(adapter, precision, x, None, device)
    failures = biased(values, got, precision.rounding)
    if failures:
        # 3 standard errors over ~30 values: a correct rounding misses on one of them in ~8% of draws by chance,
        # so the values that missed get a second, independent 10^5 draws and fail only if they miss again
        # (a false failure then has odds ~30 * 0.0027^2, about 2e-4; a real bias misses both times)
        missed = values[[i for i, _ in failures]]
        again = _written(adapter, precision, np.ascontiguousarray(np.broadcast_to(missed, (DRAWS, missed.size))),
                         None, device)
        failures = unbiasedness(missed, again, precision.rounding)
    assert not failures, f"{name}: the adapter's stochastic rounding is biased: " + "; ".join(failures[:5])
    # and the bits are random: with the core's rule and constant bits every draw would round alike
    assert (got != round_stochastic(x[:1], np.zeros((1, values.size), np.int32), precision.rounding)).any()


def test_fingerprint_steps_round_with_the_cores_bits(adapter, unsupported):
    """Given the core's bits (Trainer.set_rounding_noise, as fingerprint runs do), a bf16_sr step of plain SGD
    writes exactly round_stochastic(w - lr * g, bits) in float32: the same in every framework, so the parity
    check can compare stochastically rounded runs."""
    from harness.conformance.specs import SPECS
    from harness.conformance.test_contract import batch, build
    from harness.model.data import Data
    from harness.rounding import RoundingNoise

    precision, _ = _supported(adapter, unsupported, "bf16_sr")
    spec = SPECS["swamped_mlp"]  # plain SGD: the update is -lr * g
    trainer, graph, _ = build(adapter, spec, "bf16_sr")
    noise, data = RoundingNoise(graph.trainable_shapes(), spec.seed), Data(spec)
    for step in range(3):
        before = trainer.get_weights()
        bits = noise.for_step(step)
        trainer.set_rounding_noise(bits)
        captured = trainer.captured_step(batch(trainer, spec, data, step))
        assert captured is not None, "captured_step is needed to check the update against its gradients"
        after = trainer.get_weights()
        for name, g in captured[1].items():
            update = np.float32(spec.optimizer.learning_rate) * g.astype(np.float32)
            expected = round_stochastic(before[name] - update, bits[name], precision.rounding)
            moved = np.mean(expected != before[name])
            np.testing.assert_array_equal(after[name], expected, err_msg=(
                f"step {step}, {name}: the weights written with the core's bits differ from "
                f"round_stochastic(w - lr*g, bits) (set_rounding_noise must make the next step use these bits)"))
            assert step or moved > 0.01, f"{name}: stochastic rounding moved only {moved:.1%} of the weights"
