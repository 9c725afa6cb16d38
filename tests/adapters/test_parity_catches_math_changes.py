"""The strict float64 rows of the parity check catch small changes in an adapter's math that fp32 rows can
miss: an adapter is changed on purpose, fingerprinted beside the unchanged one, and compared.

Runs in the torch env (the mutations are written against torch's optimizers)."""
from __future__ import annotations

import numpy as np
import pytest

from harness.parity import compare
from harness.run import worker

SPEC = "tests/specs/pitfall_dropout_adam.yaml"


@pytest.fixture(autouse=True)
def torch_only(framework):
    if framework != "torch":
        pytest.skip("the mutations patch the torch adapter")


def adam_epsilon_inside(spec, params):
    """Adam with epsilon inside the square root: lr*m_hat/sqrt(v_hat + eps) instead of (sqrt(v_hat) + eps)."""
    import torch

    class Adam(torch.optim.Optimizer):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if not state:
                        state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                    state["t"] += 1
                    b1, b2, t = spec.beta_1, spec.beta_2, state["t"]
                    state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                    state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    m_hat, v_hat = state["m"] / (1 - b1**t), state["v"] / (1 - b2**t)
                    p.sub_(spec.learning_rate * m_hat / (v_hat + spec.epsilon).sqrt())

    return Adam(params, {})


def float32_learning_rate(spec, params):
    import torch

    return torch.optim.Adam(params, lr=float(np.float32(spec.learning_rate)), betas=(spec.beta_1, spec.beta_2),
                            eps=spec.epsilon)


def fingerprints(precision: str, label: str) -> dict:
    record = worker.run(worker.RunRequest(framework="torch", model=SPEC, precision=precision, run_id=f"{label}-{precision}",
                                          steps=20, warmup=0, mode="fingerprint", threads=2))
    assert record["status"] == "ok", record["reason"]
    return {**record, "framework": label}


# whether the fp32 row alone catches it: a float32 learning rate is what an fp32 run uses anyway
@pytest.mark.parametrize("mutation, fp32_catches", [(adam_epsilon_inside, True), (float32_learning_rate, False)])
def test_strict_float64_rows_fail_a_changed_optimizer(monkeypatch, mutation, fp32_catches):
    baseline = [fingerprints(p, "torch") for p in ("fp64", "fp32")]
    import amp_harness_torch.optimizers as optimizers  # TorchTrainer imports make_optimizer from here

    monkeypatch.setattr(optimizers, "make_optimizer", mutation)
    mutant = [fingerprints(p, "torch_mutant") for p in ("fp64", "fp32")]
    verdicts = {c.precision: c for c in compare(baseline + mutant)}
    print(f"{mutation.__name__}: " + "; ".join(
        f"{p} losses {c.loss_error:.1e} after-K {c.final_error:.1e} -> {c.verdict}" for p, c in verdicts.items()))
    assert verdicts["fp64"].failed, verdicts["fp64"]
    assert verdicts["fp32"].failed == fp32_catches, verdicts["fp32"]
