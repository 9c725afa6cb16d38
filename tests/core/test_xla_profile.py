"""harness.run.xla_profile on a stored XSpace that jax.profiler wrote (tests/core/data/xla_profile_fixture.py made
it): one training step of a dense layer computing in bfloat16, a relu, the loss and the update, each in its scope.
The reader is framework-free: this suite's env has no framework to read the protos with."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness.run import xla_profile

FIXTURE = Path(__file__).parent / "data" / "xla_profile.xplane.pb"
JAX_BACKWARD = "transpose("  # amp_harness_jax.profile.BACKWARD_MARK
WEIGHTS = {"0.kernel": "layer.0", "0.bias": "layer.0"}


@pytest.fixture(scope="module")
def step() -> xla_profile.Module:
    modules = xla_profile.modules(FIXTURE.read_bytes(), JAX_BACKWARD)
    (key,) = [key for key in modules if key[0] == "jit_step"]  # beside it: the small programs jnp ran eagerly
    return modules[key]


def _owner(module, name):
    return module.owner(module.by_name[name], WEIGHTS)


def test_an_op_goes_to_the_scope_its_op_name_names_forward_or_backward(step):
    assert _owner(step, "dot_general.2") == ("layer.0", False)  # the forward dot
    assert _owner(step, "dot_general.3") == ("layer.0", True)  # the kernel's gradient: transpose(jvp(layer.0))
    assert step.scope("jit(step)/transpose(jvp(layer.3))/jvp(layer.3.layers.0)/mul") == (
        "layer.3/layer.3.layers.0", True)
    # TensorFlow's name scopes: GradientTape's mark, and the "_1" of a scope entered twice
    assert xla_profile.Module(b"", "gradient_tape/").scope("gradient_tape/part.loss_scale_1/layer.2_1/Mul") == (
        "part.loss_scale_1/layer.2_1", True)


def test_a_fusion_goes_to_the_scope_most_of_its_arithmetic_carries(step):
    assert _owner(step, "reduce_multiply_fusion") == ("part.loss", False)
    assert _owner(step, "multiply_subtract_fusion") == ("part.update", False)


def test_an_instruction_xla_made_goes_to_the_layer_using_its_result(step):
    # XLA:CPU computes the bfloat16 dot in float32: the converts around it are its own, with no op_name
    made = step.by_name["convert.9"]  # inside the fusion computing the kernel's gradient
    assert step.by_id[made].op_name == "" and step.is_cast(made)
    assert step.owner(made, WEIGHTS) == ("layer.0", True)  # its user: transpose(jvp(layer.0))
    # a fusion XLA made of its own converts goes where its fused instructions' names say
    fusion = step.by_name["convert_convert_fusion.1"]
    assert step.by_id[fusion].op_name == "" and step.is_cast(fusion)
    assert step.owner(fusion, WEIGHTS) == ("layer.0", False)
    # with no use, to the nearest named operand: the step's outputs, the loss's first
    assert step.owner(step.by_name["tuple.1"], WEIGHTS) == ("part.loss", False)


def test_dtypes_and_casts_are_read_from_the_compiled_hlo(step):
    dot = step.by_name["dot_general.2"]
    assert step.inputs(dot) == ("float32", "float32") and step.by_id[dot].dtypes == ("float32",)
    assert not step.is_cast(dot)
    convert = step.by_name["convert_element_type.1"]  # the adapter's own cast, inside a fusion
    assert step.is_cast(convert) and step.by_id[convert].dtypes == ("bfloat16",)

