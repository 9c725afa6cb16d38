"""The report's pure-16-bit section (harness/report/pure16.py): figures and sentences computed from records."""
from __future__ import annotations

from harness.report.pure16 import pure16_section, pure16_view, swamped_shares


def _record(precision, accuracy, repeat=0, framework="torch", model="swamped_mlp", status="ok", weights=0.02):
    return {"model": model, "framework": framework, "precision": precision, "repeat": repeat, "status": status,
            "reason": None if status == "ok" else "loss became nan at step 3", "num_classes": 10,
            "eval_accuracy": accuracy if status == "ok" else None, "final_train_loss": 1.0 - accuracy,
            "loss": [2.0, 1.5, 1.0 - accuracy], "peak_memory_mb": 10.0,
            "state_memory_mb": {"weights": weights / 2 if precision.startswith(("bf16", "fp16")) else weights,
                                **({"compensation": weights / 2} if precision == "bf16_kahan" else {})}}


def _records():
    out = []
    for repeat in range(3):
        out += [_record("fp32", 0.933, repeat), _record("bf16", 0.712, repeat),
                _record("bf16_sr", 0.93 + 0.001 * repeat, repeat), _record("bf16_kahan", 0.90, repeat),
                _record("fixed16_rn", 0.2, repeat), _record("fixed16_sr", 0.93, repeat),
                _record("amp_fp16", 0.93, repeat)]
    out.append(_record("fp32", 0.9, model="mnist_mlp"))  # no pure arm: no entry
    return out


def test_sentence_compares_each_arm_with_fp32_and_names_the_memory():
    (entry,) = pure16_view(_records())
    assert entry["model"] == "swamped_mlp" and entry["framework"] == "torch"
    assert [a["precision"] for a in entry["arms"]] == ["fp32", "bf16", "bf16_sr", "bf16_kahan", "fixed16_rn",
                                                       "fixed16_sr"]
    sentence = entry["sentence"]
    assert "bf16 with nearest rounding stalls (71.2% vs 93.3% fp32)" in sentence
    assert "stochastic rounding (bf16_sr) recovers 93.1% with half the weight memory" in sentence  # the mean
    assert "Kahan-compensated updates (bf16_kahan) reach only 90.0% with fp32's weight memory" in sentence
    assert "16-bit fixed point with nearest rounding stalls (20.0% vs 93.3% fp32)" in sentence
    assert "stochastic rounding (fixed16_sr) recovers 93.0%" in sentence


def test_swamped_share_from_diagnoses_and_failed_arms():
    diagnoses = [{"model": "swamped_mlp", "status": "ok", "diagnosis": {"updates": {
        "1": {"updates": 300, "bfloat16": 240, "float16": 30}, "3": {"updates": 100, "bfloat16": 60, "float16": 10}}}}]
    assert swamped_shares(diagnoses) == {"swamped_mlp": {"bfloat16": 0.75, "float16": 0.1}}
    records = _records() + [_record("bf16_sr", 0.0, 3, status="diverged")]
    section = pure16_section(records, diagnoses, charts=False)
    (sentence,) = section["sentences"]
    assert "75.0% of fp32's updates are swamped in bfloat16" in sentence
    assert "3/4" in section["markdown"] and "diverged: loss became nan" in section["html"]
    assert section["html"].startswith('<section id="pure16">')


def test_too_short_and_no_pure_arm():
    chance = [_record("fp32", 0.11), _record("bf16", 0.1)]
    (entry,) = pure16_view(chance)
    assert "too short to judge" in entry["sentence"]
    assert pure16_section([_record("fp32", 0.9), _record("amp_bf16", 0.9)]) == {
        "entries": [], "sentences": [], "html": "", "markdown": ""}
