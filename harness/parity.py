"""The parity check: are the frameworks' networks the same network? Compares fingerprints (outputs on a fixed
batch before and after K training steps, every step's loss, and which steps the loss scaler skipped) of one
spec across frameworks.

Every variant a framework fingerprinted (`fingerprint --variant all`: eager or compiled steps, memory layouts) is
held to the same reference as the framework's default: a variant is the same network run another way, or it
fails. A row passes when all three errors are within the precision's tolerance. Training amplifies rounding: in
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

from harness.identity import fingerprint_group

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
    # the pure-16-bit precisions that write float32 updates back by harness.rounding: in fingerprint runs every
    # framework rounds with the core's bits, so they differ only where 16-bit compute differs (as bf16 and fp16)
    # or where a float32 rounding difference tips one stochastic decision
    "bf16_sr": (5e-2, 1e-1, 3e-1),
    "bf16_kahan": (5e-2, 1e-1, 3e-1),
    "fp16_sr": (1e-2, 5e-2, 2e-1),
    # float32 compute on a 2^-14 grid: a tipped decision moves a weight by a grid step, and a convnet with
    # batchnorm amplifies it (resnet8 after 20 steps: losses 2e-2, outputs 5e-2 apart between torch, TensorFlow
    # and JAX here; the MLPs and pitfall specs stay within 2e-3)
    "fixed16_sr": (1e-5, 5e-2, 1e-1),
    "fixed16_rn": (1e-5, 5e-2, 1e-1),
    # FP8 (harness.fp8), emulated by the core's rule: the first forward agrees to float32 rounding (torch,
    # TensorFlow and JAX within 1.5e-8 here), but a float32 rounding difference tips an FP8 cast now and then, a
    # tipped value moves by up to an FP8 step (6% in e4m3, 12% in e5m2), and training amplifies it: resnet8's
    # losses drift 5e-2 apart over 20 steps, the MLPs' and tiny_gpt's 7e-3
    "fp8_e4m3": (1e-5, 1e-1, 3e-1),
    "fp8_hybrid": (1e-5, 1e-1, 3e-1),
    # the block-scaled precisions (harness.microscaling), emulated by the core's rule: the quantized operands are
    # the same bits everywhere (the kit's test_block_training), but a float32 summation order tips a cast now and
    # then, and a tipped value moves by a whole step of its element's grid: 6% in e4m3, up to 50% in e2m1. Where the
    # scales are powers of two (MX) the first forward agrees to float32 rounding; NVFP4's and block FP8's float32
    # scales tip it already (first outputs 4.3e-2 apart in fp8_block on tiny_gpt, 5.7e-2 in nvfp4:rht on vit_tiny).
    # Over 20 steps resnet8's batchnorm amplifies the 4-bit formats' tips: losses 1.5e-1 apart (nvfp4:rht),
    # outputs after training 3.7e-1. Measured by benchmarks/block_parity.yaml (every recipe on mnist_mlp, resnet8 and
    # tiny_gpt at two batch sizes, tensorflow and jax against torch; benchmarks/RESULTS.md), these bounds with room
    **dict.fromkeys(("mxfp8", "mxfp6"), (5e-2, 1e-1, 3e-1)),
    "fp8_block": (1e-1, 1e-1, 3e-1),
    **dict.fromkeys(("mxfp4", "nvfp4"), (1e-1, 2e-1, 5e-1)),
    # every adapter computes fp64 runs entirely in float64, constants included: 20 steps of training keep
    # agreeing frameworks within ~1e-12 here, so these bounds leave room for summation order only
    "fp64": (1e-10, 1e-9, 1e-8),
}
# the first step's weight gradients (a norm and random projections per weight, where the adapter can capture
# them), in float64 only: batchnorm's backward subtracts batch means, and in float32 that cancellation alone
# moves resnet8's first-layer gradients by 1e-3 between frameworks whose trajectories agree
GRADIENT_TOLERANCES = {"fp64": 1e-9}
GRADIENT_FLOOR = 1e-3
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


def _reference_first(names) -> list[str]:
    """Frameworks (and their variants, "torch [compile]") in REFERENCE_ORDER, others after them by name, each
    framework's default variant first: the first is the reference."""
    def key(name):
        framework = name.partition(" [")[0]
        return REFERENCE_ORDER.index(framework) if framework in REFERENCE_ORDER else 99, framework, name != framework, name
    return sorted(names, key=key)


def runner_names(records: list[dict]) -> dict[int, str]:
    """Per record (by id), what the parity check calls what ran it: the framework, or "framework [variant]" for
    a variant other than the framework's default. The default is the variant of the framework's first record
    (`fingerprint` runs the default unless told otherwise, and `--variant all` runs it first), so a
    framework fingerprinted in one variant only is named by the framework alone."""
    first: dict[str, object] = {}
    for r in records:
        first.setdefault(r.get("framework"), r.get("variant"))
    return {id(r): r.get("framework") if r.get("variant") == first[r.get("framework")]
            else f"{r.get('framework')} [{r.get('variant')}]" for r in records}


def _aligned(rows: list[list[str]]) -> list[str]:
    """Rows as text columns, a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


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
    """The last fingerprint per (model, spec_hash, precision: harness.identity.fingerprint_group; framework or
    variant: runner_names): later runs replace earlier ones."""
    names, out = runner_names(records), {}
    for r in records:
        out[(*fingerprint_group(r), names[id(r)])] = r
    return out


def _errors(a: dict, b: dict) -> tuple[float, float, float]:
    fa, fb = a["fingerprint"], b["fingerprint"]
    return (_relative(fa["initial_outputs"], fb["initial_outputs"]), _loss_error(a["loss"], b["loss"]),
            _relative(fa["final_outputs"], fb["final_outputs"]))


def gradient_error(a: dict, b: dict) -> float | None:
    """Max over weights of the gradient fingerprints' difference relative to b's gradient norm for that weight,
    or to GRADIENT_FLOOR of b's whole gradient where the weight's is smaller: a gradient that is zero in exact
    arithmetic (a bias before batchnorm) holds only rounding noise, which no two frameworks share."""
    ga, gb = a["fingerprint"].get("gradients"), b["fingerprint"].get("gradients")
    if not ga or not gb:
        return None
    if sorted(ga) != sorted(gb):
        return float("inf")
    floor = GRADIENT_FLOOR * float(np.sqrt(sum(v[0] ** 2 for v in gb.values())))
    return max(float(np.max(np.abs(np.subtract(ga[k], gb[k])))) / max(gb[k][0], floor, 1e-300) for k in gb)


def _verdict(precision: str, ref_name: str, ref: dict, other: dict, errors, ref64: dict | None,
             grad_error: float | None) -> str:
    tol = TOLERANCES.get(precision) or TOLERANCES.get(precision.partition(":")[0], TOLERANCES["fp16"])
    if errors[0] > tol[0]:
        return "FAIL"
    if grad_error is not None and grad_error > GRADIENT_TOLERANCES[precision]:
        return "FAIL: first-step gradients differ"
    if errors[1] <= tol[1] and errors[2] <= tol[2]:
        return "pass"
    if ref64 is None or precision == "fp64" or ref64.get("status") != "ok":
        return "FAIL"
    floor, mine = _errors(ref, ref64), _errors(other, ref64)
    if all(mine[i] <= NOISE_FACTOR * floor[i] + tol[i] / 10 for i in (1, 2)):
        return f"pass (within noise: {ref_name} is {floor[1]:.0e} from its fp64 losses)"
    return "FAIL"


def compare(records: list[dict]) -> list[Comparison]:
    from harness.results import FINGERPRINTS_FILE, usable

    records, _ = usable(records, FINGERPRINTS_FILE)
    records = [r for r in records if r.get("fingerprint") or r.get("status") != "ok"]  # not plain run records
    groups: dict[tuple, dict[str, dict]] = {}
    for (model, spec_hash, precision, framework), r in latest(records).items():
        groups.setdefault((model, spec_hash, precision), {})[framework] = r
    comparisons = []
    for (model, spec_hash, precision), by_fw in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        order = _reference_first(by_fw)
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
                why = "; ".join(f"{n} {r['status']}" + (f" ({r.get('reason')})" if r.get("reason") else "")
                                for n, r in zip((ref_name, name), pair) if r.get("status") != "ok")
                legit = all(r.get("status") in ("ok", "unsupported") for r in pair)
                comparisons.append(Comparison(model, spec_hash, precision, ref_name, name, 0, None, None, None,
                                              ("n/a: " if legit else "FAIL: ") + why))
                continue
            skips = [r["fingerprint"].get("skipped_steps") or [] for r in pair]
            errors = _errors(other, ref)
            grad_error = gradient_error(other, ref) if precision in GRADIENT_TOLERANCES else None
            if skips[0] != skips[1]:
                verdict = f"FAIL: the loss scalers skipped different steps ({ref_name} {skips[0]}, {name} {skips[1]})"
            else:
                ref64 = groups.get((model, spec_hash, "fp64"), {}).get(ref_name)
                verdict = _verdict(precision, ref_name, ref, other, errors, ref64, grad_error)
            comparisons.append(Comparison(model, spec_hash, precision, ref_name, name, len(ref["loss"]), *errors,
                                          verdict, grad_error))
    return comparisons


def table(comparisons: list[Comparison]) -> str:
    header = ["model", "precision", "frameworks", "steps", "logits", "gradients", "losses", "after K", "verdict"]
    lines = _aligned([header] + [c.row() for c in comparisons])
    tol = "; ".join(f"{p} {a:g}/{b:g}/{c:g}" for p, (a, b, c) in TOLERANCES.items())
    lines.append(f"max relative errors; tolerances (logits/losses/after K): {tol}; first-step gradients: "
                 + "; ".join(f"{p} {t:g}" for p, t in GRADIENT_TOLERANCES.items()))
    return "\n".join(lines)


# ---- diagnoses ------------------------------------------------------------------------------------------
# Two frameworks' diagnose runs of one spec capture the same tensors of the same network, so their histograms
# (log2 bins, exact zeros and non-finite values apart) must agree up to rounding. Rounding moves a value across
# a power of two only when it lies on one (the loss gradient of a normalised softmax is 1/batch exactly), and
# gives a gradient that is zero in exact arithmetic (a bias before batchnorm) noise of any small magnitude. So
# values may move by one bin for free, values NOISE_BINS below a group's largest count as zeros, FREE_VALUES
# values of a group may move anywhere, and what is left must be within DIAGNOSIS_TOLERANCE (a share of the
# group's values).
DIAGNOSIS_TOLERANCE = 0.02
FREE_VALUES = 2
NOISE_BINS = 20


def histogram_distance(a: dict, b: dict) -> float:
    """The largest share of values that two histograms place more than one bin apart (a Levy distance on
    the log2 axis, zeros below every bin and non-finite values above)."""
    top = max([int(e) for h in (a, b) for e in h["bins"]], default=0)
    floor = top - NOISE_BINS

    def cumulative(h: dict) -> np.ndarray:
        """Shares at or below each bin from floor - 1 (zeros and noise) to top, then the non-finite."""
        n = max(h["count"], 1)
        counts = np.zeros(top - floor + 3)
        counts[0] = h["zeros"]
        for e, c in h["bins"].items():
            counts[max(int(e) - floor + 1, 0)] += c
        counts[-1] = h["nonfinite"]
        return np.cumsum(counts) / n
    fa, fb = cumulative(a), cumulative(b)
    shifted = lambda f: np.concatenate([[0.0], f[:-1]])  # noqa: E731  (the share one bin lower down)
    gaps = np.concatenate([shifted(fa) - fb, shifted(fb) - fa, [abs(a["nonfinite"] - b["nonfinite"]) / max(a["count"], 1)]])
    return float(max(gaps.max(), 0.0))


def _lost_shares(diagnosis: dict) -> dict[str, float]:
    """Per format, the share of all updates lost to rounding (counted on raw tensors at capture). Over the whole
    network, not per layer: a layer of a few dozen weights flips a few percent when one update near half an ulp
    rounds the other way."""
    counts = (diagnosis.get("updates") or {}).values()
    updates = sum(c["updates"] for c in counts)
    return {fmt: sum(c[fmt] for c in counts) / updates if updates else 0.0 for fmt in ("float16", "bfloat16")}


def diagnosis_difference(a: dict, b: dict) -> tuple[float, str]:
    """(the largest difference between two diagnoses, where): histogram distance per tensor group and layer,
    and the difference in the share of updates lost to rounding. inf when they captured different layers."""
    worst, where = 0.0, ""
    for kind in sorted(set(a["groups"]) | set(b["groups"])):
        ga, gb = a["groups"].get(kind, {}), b["groups"].get(kind, {})
        if set(ga) != set(gb):
            return float("inf"), f"{kind}: layers {sorted(set(ga) ^ set(gb))} captured by one framework only"
        for layer in ga:
            # a few values may move in any group: in a batchnorm's 32 weights one is already 3%
            d = max(histogram_distance(ga[layer], gb[layer]) - FREE_VALUES / max(gb[layer]["count"], 1), 0.0)
            if d > worst:
                worst, where = d, f"{kind} of {layer}"
    la, lb = _lost_shares(a), _lost_shares(b)
    for fmt in la:
        if abs(la[fmt] - lb[fmt]) > worst:
            worst, where = abs(la[fmt] - lb[fmt]), f"the share of updates lost to rounding in {fmt}"
    return worst, where


@dataclass
class DiagnosisComparison:
    model: str
    reference: str
    framework: str
    difference: float | None  # diagnosis_difference; None when one side has no diagnosis to compare
    verdict: str

    @property
    def failed(self) -> bool:
        return self.verdict.startswith("FAIL")


def compare_diagnoses(records: list[dict]) -> list[DiagnosisComparison]:
    """Each framework's latest diagnosis of a spec against the reference framework's: "pass" within
    DIAGNOSIS_TOLERANCE; FAIL otherwise, or when a run failed or could not capture."""
    from harness.results import DIAGNOSES_FILE, usable

    records, _ = usable(records, DIAGNOSES_FILE)
    groups: dict[tuple, dict[str, dict]] = {}
    for (model, spec_hash, _, framework), r in latest(records).items():
        groups.setdefault((model, spec_hash), {})[framework] = r
    comparisons = []
    for (model, _), by_fw in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        order = _reference_first(by_fw)
        ref = by_fw[order[0]]
        for name in order[1:]:
            other = by_fw[name]
            broken = [r for r in (ref, other)
                      if r.get("status") != "ok" or not (r.get("diagnosis") or {}).get("available")]
            difference = None
            if broken:
                verdict = "FAIL: " + "; ".join(f"{r['framework']} {r['status']}: {r.get('reason') or 'no capture'}"
                                               for r in broken)
            else:
                difference, where = diagnosis_difference(other["diagnosis"], ref["diagnosis"])
                verdict = "pass" if difference <= DIAGNOSIS_TOLERANCE else f"FAIL: {where} differs"
            comparisons.append(DiagnosisComparison(model, order[0], name, difference, verdict))
    return comparisons


def diagnosis_table(comparisons: list[DiagnosisComparison]) -> str:
    lines = _aligned([["model", "frameworks", "largest difference", "verdict"]] + [
        [c.model, f"{c.framework} vs {c.reference}", "-" if c.difference is None else f"{c.difference:.1e}",
         c.verdict] for c in comparisons])
    lines.append(f"diagnoses: histogram distance per tensor group and layer, and difference in the share of updates "
                 f"lost to rounding; tolerance {DIAGNOSIS_TOLERANCE:g}")
    return "\n".join(lines)
