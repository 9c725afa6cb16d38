"""The report for sequence models (issue 27): tokens/s beside ms/step where records carry tokens_per_sample, and
next-token models judged by eval loss, with perplexity exp(loss), where token accuracy means little. Records are
built here (schema 5, harness.results.empty_record) for a byte-level LM (tiny_gpt: T 64, vocabulary 256) and a
classifier, with outcomes known in advance."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from harness.report import build_view, render, write_report
from harness.report import format as f
from harness.report.pure16 import pure16_view
from tests.core.read_as import read_as
from harness.report.render import render_markdown
from harness.results import empty_record

_ids = itertools.count()
T, VOCAB, BATCH = 64, 256, 16


def record(model: str, precision: str, ms: float, repeat: int, loss: float, accuracy: float, lm: bool = True,
           flops: int | None = None, **known) -> dict:
    """One timed ok run: a next-token model (lm) or a 10-class classifier (no tokens); repeat r from seed 7 + r."""
    rng = np.random.default_rng(next(_ids))
    steps = list(ms * (1 + 0.02 * (repeat - 1)) * np.exp(rng.normal(0, 0.01, 20)))
    return empty_record(
        run_id=f"seq{next(_ids)}", framework="torch", framework_version="1.0", model=model, spec_hash=model,
        num_classes=VOCAB if lm else 10, task="next_token" if lm else "classification",
        tokens_per_sample=T if lm else None, precision=precision, device="cpu", status="ok", batch_size=BATCH,
        steps=20, warmup_steps=2, repeat=repeat, seed=7 + repeat, step_times_ms=steps, first_step_ms=10 * ms,
        samples_per_s=BATCH / (float(np.median(steps)) / 1e3),
        peak_memory_mb=100.0, memory_kind="rss", loss=[5.5, 3.0, loss], final_train_loss=loss, eval_loss=loss,
        eval_accuracy=accuracy, flops_per_step=flops,
        env={"threads": 2, "device": {"name": "cpu", "kind": "cpu", "description": "test cpu", "details": {}}},
        **known)


def cell(model, precision, ms, losses, accuracies, **kw):
    return [record(model, precision, ms, i, loss, acc, **kw) for i, (loss, acc) in enumerate(zip(losses, accuracies))]


FP32_LOSS = (2.10, 2.11, 2.12)  # fp32's seed-to-seed spread: 0.02 nats


def lm_and_classifier() -> list[dict]:
    """tiny_gpt: amp_bf16 twice as fast, its loss 0.3 nats higher at every seed while its token accuracy is the
    same; vit: amp_bf16 twice as fast, accuracy unchanged."""
    return (cell("tiny_gpt", "fp32", 20.0, FP32_LOSS, (0.40, 0.40, 0.40))
            + cell("tiny_gpt", "amp_bf16", 10.0, [x + 0.3 for x in FP32_LOSS], (0.40, 0.40, 0.40))
            + cell("vit", "fp32", 20.0, (0.5,) * 3, (0.900, 0.902, 0.904), lm=False)
            + cell("vit", "amp_bf16", 10.0, (0.5,) * 3, (0.900, 0.902, 0.904), lm=False))


def tokens_per_s(records, model, precision) -> float:
    """From the raw step times, as samples/s is: batch x T over the geometric mean of the repeats' medians."""
    medians = [np.median(r["step_times_ms"]) for r in records if (r["model"], r["precision"]) == (model, precision)]
    return BATCH * T / (math.exp(np.mean(np.log(medians))) / 1e3)


def test_tokens_per_second_beside_ms_per_step_for_the_sequence_model_only():
    records = lm_and_classifier()
    view = build_view(records)
    rows = {(r.model, r.precision): r for r in view.speed}
    expected = f.number(tokens_per_s(records, "tiny_gpt", "fp32"), 0)
    assert rows[("tiny_gpt", "fp32")].tokens == expected and int(expected.replace(",", "")) > 50_000
    assert rows[("tiny_gpt", "fp32")].samples == f.number(tokens_per_s(records, "tiny_gpt", "fp32") / T, 0)
    assert rows[("vit", "fp32")].tokens == rows[("vit", "amp_bf16")].tokens == "-"
    page, md = render(view), render_markdown(view)
    speed = page[page.index('id="speed-table"'):page.index("</table>", page.index('id="speed-table"'))]
    assert "<th>ms/step</th><th>tokens/s</th>" in speed and f'<td class="num">{expected}</td>' in speed
    fastest = {(r.model, r.precision): r for r in view.fastest}
    assert fastest[("tiny_gpt", "fp32")].tokens == expected and fastest[("vit", "fp32")].tokens == "-"
    bf16 = f.number(tokens_per_s(records, "tiny_gpt", "amp_bf16"), 0)
    lines = dict(zip(["tiny_gpt", "vit"], view.answer[0].recommendations))
    assert lines["tiny_gpt"].endswith(f"torch amp_bf16 {rows[('tiny_gpt', 'amp_bf16')].median} ms/step, {bf16} "
                                      f"tokens/s.")
    assert "tokens/s" not in lines["vit"]
    assert f"ms/step, {bf16} tokens/s" in md and f"ms/step, {bf16} tokens/s" in page  # the matrix cell and the line
    classifier_only = build_view([r for r in records if r["model"] == "vit"])
    assert "tokens/s" not in render(classifier_only) + render_markdown(classifier_only)


def test_the_csv_has_tokens_per_second_where_records_have_tokens(tmp_path):
    import pandas as pd

    records = lm_and_classifier()
    _, csv = write_report(records, tmp_path / "index.html")
    frame = pd.read_csv(csv)
    columns = list(frame.columns)
    assert columns[columns.index("samples_per_s") + 1] == "tokens_per_s"
    lm, vit = frame[frame.model == "tiny_gpt"], frame[frame.model == "vit"]
    assert np.allclose(lm.tokens_per_s, lm.samples_per_s * T) and vit.tokens_per_s.isna().all()
    _, csv = write_report([r for r in records if r["model"] == "vit"], tmp_path / "vit.html")
    assert "tokens_per_s" not in pd.read_csv(csv).columns


def test_too_small_for_precision_states_the_tokens_per_second():
    records = cell("tiny_gpt", "fp32", 5.0, FP32_LOSS, (0.4,) * 3, flops=10**7) \
        + cell("tiny_gpt", "amp_bf16", 5.0, FP32_LOSS, (0.4,) * 3, flops=10**7)
    (rule,) = [w for w in build_view(records).why if "too small" in w.title]
    assert f"ms per step ({f.number(tokens_per_s(records, 'tiny_gpt', 'amp_bf16'), 0)} tokens/s, " in rule.text


def test_perplexity_is_exp_of_the_eval_loss_and_replaces_accuracy_in_the_table():
    records = lm_and_classifier()
    view = build_view(records)
    rows = {(r.model, r.precision): r for r in view.accuracy}
    lm = rows[("tiny_gpt", "fp32")]
    assert lm.perplexity == f.number(math.exp(np.mean(FP32_LOSS)), 2) == "8.25" and lm.loss == "2.1100"
    assert lm.accuracy == "-"  # token accuracy: not the figure to judge a language model by
    assert lm.delta == "fp32 over 3 seeds: loss 2.1000-2.1200, perplexity 8.17-8.33"  # exp(2.10), exp(2.12)
    assert rows[("tiny_gpt", "amp_bf16")].perplexity == f.number(math.exp(2.41), 2)
    assert rows[("vit", "fp32")].perplexity == "-" and rows[("vit", "fp32")].accuracy == "90.2 %"
    page = render(view)
    table = page[page.index('id="accuracy-table"'):page.index("</table>", page.index('id="accuracy-table"'))]
    assert "<th>eval loss</th><th>perplexity</th>" in table and '<td class="num">8.25</td>' in table
    assert "40.0 %" not in page
    classifier_only = render(build_view([r for r in records if r["model"] == "vit"]))
    assert "perplexity" not in classifier_only


def test_a_next_token_model_is_judged_by_its_eval_loss_not_its_token_accuracy():
    """amp_bf16 is twice as fast with the same token accuracy, but its loss is 0.3 nats higher at every seed,
    far past fp32's 0.02 nats: ruled out. A precision whose token accuracy drops while its loss holds is not."""
    view = build_view(lm_and_classifier())
    (s,) = [s for s in view.summary if s.model == "tiny_gpt"]
    check = s.accuracy_check
    assert (check.verdict, check.outcome, check.acceptable) == ("higher", "worse", False)
    assert check.delta == pytest.approx(0.3) and check.fp32.low == 2.10 and check.fp32.high == 2.12
    assert s.flag and s.accuracy.startswith("loss higher (+0.3000 nats, 95% CI +0.3000 to +0.3000 over 3 seeds;")
    (e, ) = [row.cells[0] for row in view.answer[0].rows if row.model == "tiny_gpt"]
    assert e.verdict == "keep" and e.verdict_text == "faster but worse in eval loss"
    assert e.accuracy.startswith("eval loss higher (+0.3000 nats") and e.accuracy_flag
    lines = dict(zip(["tiny_gpt", "vit"], view.answer[0].recommendations))
    assert "keep fp32" in lines["tiny_gpt"] and "but eval loss higher (+0.3000 nats" in lines["tiny_gpt"]
    assert lines["vit"].startswith("vit: torch amp_bf16, 2.00x faster") and "accuracy unchanged" in lines["vit"]
    # token accuracy down 10 points, loss +0.001 nats at every seed (well within the margin): judged by the loss,
    # slightly higher and still acceptable
    held = cell("tiny_gpt", "fp32", 20.0, FP32_LOSS, (0.40,) * 3) \
        + cell("tiny_gpt", "amp_bf16", 10.0, [x + 0.001 for x in FP32_LOSS], (0.30,) * 3)
    (s,) = build_view(held).summary
    assert s.accuracy_check.verdict == "slightly higher" and s.accuracy_check.acceptable
    (e,) = build_view(held).answer[0].rows[0].cells
    assert e.verdict == "faster" and e.accuracy.startswith("eval loss slightly higher (+0.0010 nats")


def test_too_short_for_a_next_token_model_is_a_loss_not_clearly_below_ln_vocabulary():
    """ln 256 = 5.545 nats; the rule: fp32's eval loss at or above 0.95 ln 256 = 5.268 learned nothing."""
    short = cell("tiny_gpt", "fp32", 20.0, (5.30, 5.31, 5.32), (0.60,) * 3) \
        + cell("tiny_gpt", "amp_bf16", 10.0, (5.50, 5.51, 5.52), (0.60,) * 3)
    view = build_view(short)
    rows = {r.precision: r for r in view.accuracy}
    assert rows["fp32"].perplexity == rows["amp_bf16"].delta == "too short to judge" and not rows["fp32"].judged
    assert view.any_too_short_loss and not view.any_too_short  # the classifiers' sentence is not said
    (e,) = view.answer[0].rows[0].cells
    assert e.accuracy == "eval loss too short to judge (fp32 at chance level)" and not e.accuracy_flag
    page = render(view)
    assert "Some next-token runs were too short to judge" in page and "Some runs were too short" not in page
    learned = cell("tiny_gpt", "fp32", 20.0, (5.20, 5.21, 5.22), (0.01,) * 3) \
        + cell("tiny_gpt", "amp_bf16", 10.0, (5.20, 5.21, 5.22), (0.01,) * 3)
    (s,) = build_view(learned).summary  # below 5.268: judged, though its token accuracy is near chance
    assert s.accuracy_check.verdict == "unchanged"
    stalled = cell("tiny_gpt", "fp32", 20.0, FP32_LOSS, (0.4,) * 3) \
        + cell("tiny_gpt", "amp_bf16", 10.0, (5.40, 5.40, 5.40), (0.4,) * 3)
    (s,) = build_view(stalled).summary
    assert s.accuracy_check.verdict == "stalls" and not s.accuracy_check.acceptable
    assert s.accuracy.startswith("loss stalls at chance level (loss 5.4000, perplexity 221.41;")


def test_pure16_judges_a_next_token_model_by_its_loss_and_shows_perplexity():
    records = (cell("tiny_gpt", "fp32", 20.0, FP32_LOSS, (0.40,) * 3)
               + cell("tiny_gpt", "bf16", 12.0, [x + 0.9 for x in FP32_LOSS], (0.45,) * 3)
               + cell("tiny_gpt", "bf16_sr", 12.0, [x + 0.001 for x in FP32_LOSS], (0.30,) * 3))
    (entry,) = pure16_view(read_as(records))
    sentence = entry.sentence
    assert ("bf16 with nearest rounding falls behind (loss 3.0100, perplexity 20.29 vs fp32 over 3 seeds: loss "
            "2.1000-2.1200, perplexity 8.17-8.33)") in sentence
    assert "stochastic rounding (bf16_sr) nearly recovers loss 2.1110, perplexity 8.26" in sentence
    view = build_view(records)
    (shown,) = view.pure16.shown
    assert shown.header[2:6] == ("eval loss (mean)", "perplexity", "over seeds", "vs fp32 (paired by seed)")
    assert shown.rows[1][:6] == ["bf16", "3/3", "3.0100", "20.29", "loss 3.0000-3.0200, perplexity 20.09-20.49",
                                    "+0.9000 nats (higher)"]
    assert "| eval loss (mean) | perplexity |" in render_markdown(view)


def test_a_loss_scale_study_of_a_next_token_model_shows_perplexity():
    fp32 = cell("tiny_gpt", "fp32", 20.0, FP32_LOSS, (0.4,) * 3)
    study = [{**r, "run_id": f"study{i}", "study": "ls", "precision": "amp_fp16", "repeat": 0, "seed": 7,
              "loss_scale": {"settings": {"mode": "fixed", "initial": 2.0 ** (8 * i)}}}
             for i, r in enumerate(cell("tiny_gpt", "amp_fp16", 10.0, (2.3, 2.2), (0.4, 0.4)))]
    view = build_view(fp32 + study)
    (s,) = view.studies
    assert s.next_token
    assert [p.perplexity for p in s.rows] == [f.number(math.exp(2.3), 2), f.number(math.exp(2.2), 2)]
    page = render(view)
    table = page[page.index('class="study-table'):page.index("</table>", page.index('class="study-table'))]
    assert "<th>perplexity</th>" in table and f.number(math.exp(2.2), 2) in table and "eval accuracy" not in table
    assert "eval loss (nats)" in s.chart
