"""The parity check: are the frameworks' networks the same network? Compares fingerprints (outputs on a fixed
batch before and after K training steps, every step's loss, and which steps the loss scaler skipped) of one
spec across frameworks.

A row passes when all three errors are within the precision's tolerance. Training amplifies rounding: in
a convnet with batchnorm, PyTorch against *itself* with 1 instead of 2 threads drifts by 3e-3 over 20 SGD
steps, so a trajectory can exceed its tolerance without any difference in the math. Such a row still passes,
marked "within noise", if the reference framework's float64 fingerprint is there and the other framework is
no further from it than 3x the reference's own distance plus a tenth of the tolerance (TorchBench's accuracy
rule). The float64 rows themselves must meet strict tolerances with no excuse: in float64, rounding cannot
hide a difference in the math (an epsilon in the wrong place, a float32 constant). Initial outputs are never
excused.

The gate: a row is "pass", "FAIL", or "n/a" only when a framework reported the precision `unsupported` on
this device. Anything else that prevents a comparison (a failed or diverged run, a precision only one framework
fingerprinted, loss scalers that skipped different steps) is a FAIL, so an adapter cannot pass by not training.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# (initial outputs, loss trajectory, outputs after K steps): max error relative to the reference's scale.
# fp32 must agree to rounding. Mixed precisions differ by design (each framework picks which ops run in
# 16 bits), so they get looser bounds, set from the spread seen between PyTorch, Keras and MXNet here.
TOLERANCES = {
    "fp32": (1e-5, 1e-4, 1e-3),
    "tf32": (1e-2, 2e-2, 5e-2),
    "amp_bf16": (5e-2, 5e-2, 2e-1),
    "amp_fp16": (1e-2, 2e-2, 5e-2),
    "bf16": (5e-2, 1e-1, 3e-1),
    "fp16": (1e-2, 5e-2, 2e-1),
    # every adapter computes fp64 runs entirely in float64, constants included: 20 steps of training keep
    # agreeing frameworks within ~1e-12 here, so these bounds leave room for summation order only
    "fp64": (1e-10, 1e-9, 1e-8),
}
# the first step's weight gradients (a norm and random projections per weight, where the adapter can capture
# them): like initial outputs, nothing has been trained yet to amplify rounding
GRADIENT_TOLERANCES = {"fp64": 1e-9, "fp32": 1e-4}
NOISE_FACTOR = 3
REFERENCE_ORDER = ("torch", "tensorflow", "mxnet")  # the first present is the reference


@dataclass
class Comparison:
    model: str
    spec_hash: str
    precision: str
    reference: str
    framework: str
    steps: int
    logits_error: float | None
    loss_error: float | None
    final_error: float | None
    verdict: str
    gradient_error: float | None = None  # None: not captured by both  # "pass...", "FAIL...", or "n/a: ... unsupported ..." (see the module docstring)

    @property
    def failed(self) -> bool:
        return self.verdict.startswith("FAIL")

    @property
    def compared(self) -> bool:
        return not self.verdict.startswith("n/a")

    def row(self) -> list[str]:
        fmt = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
        return [self.model, self.precision, f"{self.framework} vs {self.reference}", str(self.steps),
                fmt(self.logits_error), fmt(self.gradient_error), fmt(self.loss_error), fmt(self.final_error),
                self.verdict]


def _relative(a, b) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        return float("inf")
    scale = np.nanmax(np.abs(b)) if b.size else 0.0
    return float(np.max(np.abs(a - b)) / max(scale, 1e-12)) if b.size else 0.0


def _loss_error(a: list, b: list) -> float:
    if len(a) != len(b) or None in a or None in b:
        return float("inf")
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def latest(records: list[dict]) -> dict[tuple, dict]:
    """The last fingerprint per (model, spec_hash, precision, framework): later runs replace earlier ones."""
    out = {}
    for r in records:
        out[(r.get("model"), r.get("spec_hash"), r.get("precision"), r.get("framework"))] = r
    return out


def _errors(a: dict, b: dict) -> tuple[float, float, float]:
    fa, fb = a["fingerprint"], b["fingerprint"]
    return (_relative(fa["initial_outputs"], fb["initial_outputs"]), _loss_error(a["loss"], b["loss"]),
            _relative(fa["final_outputs"], fb["final_outputs"]))


def gradient_error(a: dict, b: dict) -> float | None:
    """Max over weights of the gradient fingerprints' difference relative to b's gradient norm."""
    ga, gb = a["fingerprint"].get("gradients"), b["fingerprint"].get("gradients")
    if not ga or not gb:
        return None
    if sorted(ga) != sorted(gb):
        return float("inf")
    return max(float(np.max(np.abs(np.subtract(ga[k], gb[k]))) / max(gb[k][0], 1e-300)) for k in gb)


def _verdict(precision: str, ref: dict, other: dict, errors, ref64: dict | None, grad_error: float | None) -> str:
    tol = TOLERANCES.get(precision, TOLERANCES["fp16"])
    if errors[0] > tol[0]:
        return "FAIL"
    if grad_error is not None and grad_error > GRADIENT_TOLERANCES.get(precision, tol[1]):
        return "FAIL: first-step gradients differ"
    if errors[1] <= tol[1] and errors[2] <= tol[2]:
        return "pass"
    if ref64 is None or precision == "fp64" or ref64.get("status") != "ok":
        return "FAIL"
    floor, mine = _errors(ref, ref64), _errors(other, ref64)
    if all(mine[i] <= NOISE_FACTOR * floor[i] + tol[i] / 10 for i in (1, 2)):
        return f"pass (within noise: {ref['framework']} is {floor[1]:.0e} from its fp64 losses)"
    return "FAIL"


def compare(records: list[dict]) -> list[Comparison]:
    from harness.results import usable

    records, _ = usable(records)
    records = [r for r in records if r.get("fingerprint") or r.get("status") != "ok"]  # not plain run records
    groups: dict[tuple, dict[str, dict]] = {}
    for (model, spec_hash, precision, framework), r in latest(records).items():
        groups.setdefault((model, spec_hash, precision), {})[framework] = r
    comparisons = []
    for (model, spec_hash, precision), by_fw in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        order = sorted(by_fw, key=lambda f: (REFERENCE_ORDER.index(f) if f in REFERENCE_ORDER else 99, f))
        ref_name = order[0]
        ref = by_fw[ref_name]
        if len(order) == 1:
            verdict = (f"n/a: {ref_name} only: {ref.get('reason')}" if ref.get("status") == "unsupported" else
                       f"FAIL: only {ref_name} has a {precision} fingerprint")
            comparisons.append(Comparison(model, spec_hash, precision, ref_name, ref_name, 0, None, None, None,
                                          verdict))
            continue
        for name in order[1:]:
            other = by_fw[name]
            pair = (ref, other)
            if any(r.get("status") != "ok" for r in pair):
                why = "; ".join(f"{r['framework']} {r['status']}" + (f" ({r.get('reason')})" if r.get("reason") else "")
                                for r in pair if r.get("status") != "ok")
                legit = all(r.get("status") in ("ok", "unsupported") for r in pair)
                comparisons.append(Comparison(model, spec_hash, precision, ref_name, name, 0, None, None, None,
                                              ("n/a: " if legit else "FAIL: ") + why))
                continue
            skips = [r["fingerprint"].get("skipped_steps") or [] for r in pair]
            errors, grad_error = _errors(other, ref), gradient_error(other, ref)
            if skips[0] != skips[1]:
                verdict = f"FAIL: the loss scalers skipped different steps ({ref_name} {skips[0]}, {name} {skips[1]})"
            else:
                ref64 = groups.get((model, spec_hash, "fp64"), {}).get(ref_name)
                verdict = _verdict(precision, ref, other, errors, ref64, grad_error)
            comparisons.append(Comparison(model, spec_hash, precision, ref_name, name, len(ref["loss"]), *errors,
                                          verdict, grad_error))
    return comparisons


def table(comparisons: list[Comparison]) -> str:
    header = ["model", "precision", "frameworks", "steps", "logits", "gradients", "losses", "after K", "verdict"]
    rows = [header] + [c.row() for c in comparisons]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    tol = "; ".join(f"{p} {a:g}/{b:g}/{c:g}" for p, (a, b, c) in TOLERANCES.items())
    lines.append(f"max relative errors; tolerances (logits/losses/after K): {tol}; first-step gradients: "
                 + "; ".join(f"{p} {t:g}" for p, t in GRADIENT_TOLERANCES.items()))
    return "\n".join(lines)
