"""Writes xla_profile.xplane.pb, the fixture of tests/core/test_xla_profile.py: one jitted training step of a tiny
dense layer computing in bfloat16, in the scopes the adapters name (harness.adapter: layer_scope, LOSS_SCOPE, UPDATE_SCOPE), run under
jax.profiler with the HLO protos on, as amp_harness_jax.profile runs it. Run in the jax env from the repository
root:  PYTHONPATH=$PWD /work/main/.tox/jax/bin/python tests/core/data/xla_profile_fixture.py
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from harness.adapter import LOSS_SCOPE, UPDATE_SCOPE, layer_scope

OUT = Path(__file__).with_name("xla_profile.xplane.pb")


def step(params, x, y):
    def loss_of(params):
        with jax.named_scope(layer_scope("0")):
            # in bfloat16, as mixed precision computes: XLA:CPU converts the dot back to float32 with converts
            # of its own (instructions with no op_name)
            out = (x.astype(jnp.bfloat16) @ params["0.kernel"].astype(jnp.bfloat16)).astype(jnp.float32)
            out = out + params["0.bias"]
        with jax.named_scope(layer_scope("1")):
            out = jax.nn.relu(out)
        with jax.named_scope(LOSS_SCOPE):
            return jnp.mean((out - y) ** 2)

    loss, grads = jax.value_and_grad(loss_of)(params)
    with jax.named_scope(UPDATE_SCOPE):
        return loss, {name: value - 0.1 * grads[name] for name, value in params.items()}


def main() -> None:
    params = {"0.kernel": jnp.ones((3, 2)), "0.bias": jnp.zeros((2,))}
    x, y = jnp.arange(12.0).reshape(4, 3), jnp.ones((4, 2))
    jitted = jax.jit(step)
    jax.block_until_ready(jitted(params, x, y))  # compiled before the trace, as after the core's warm-up
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = True
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, profiler_options=options)
        jax.block_until_ready(jitted(params, x, y))
        jax.profiler.stop_trace()
        (found,) = Path(log_dir).glob("plugins/profile/*/*.xplane.pb")
        OUT.write_bytes(found.read_bytes())
    print(f"{OUT}: {OUT.stat().st_size} bytes, jax {jax.__version__}")


if __name__ == "__main__":
    main()
