"""The report's FP8 section (harness/report/fp8.py): fp32, amp_bf16 and each FP8 precision per model, their figures
computed from the records, and whether the FP8 matmuls were emulated, as the records say."""
from __future__ import annotations

import html as markup
import itertools
import re

import numpy as np

from harness.report import build_view, render
from harness.report.render import render_markdown
from harness.report.view import FP8_ELSEWHERE
from harness.results import empty_record

_ids = itertools.count()
EMULATED = {"fp8": {"scaling": "current", "matmuls": "emulated (the core's rule, float32 products)"}}
NATIVE = {"fp8": {"scaling": "current", "matmuls": "native (torch._scaled_mm)"}}


def record(precision: str, repeat: int, loss: float, accuracy: float, ms: float = 10.0, options=None,
           model: str = "mlp") -> dict:
    """One ok run of a 10-class classifier from seed 7 + repeat; its steps all take `ms`, a repeat 1% apart."""
    return empty_record(
        run_id=f"fp8-{next(_ids)}", framework="torch", framework_version="1.0", model=model, spec_hash=model,
        num_classes=10, task="classification", precision=precision, device="cpu", status="ok", batch_size=16,
        steps=20, warmup_steps=2, repeat=repeat, seed=7 + repeat, step_times_ms=[ms * (1 + 0.01 * repeat)] * 20,
        first_step_ms=ms, samples_per_s=1.0, peak_memory_mb=100.0, memory_kind="rss", loss=[2.3, 1.0, loss],
        final_train_loss=loss, eval_loss=loss, eval_accuracy=accuracy, options=options,
        env={"threads": 2, "device": {"name": "cpu", "kind": "cpu", "description": "test cpu", "details": {}}})


def cell(precision, losses, accuracies, **kw) -> list[dict]:
    return [record(precision, i, loss, acc, **kw) for i, (loss, acc) in enumerate(zip(losses, accuracies))]


FP32_LOSS, FP32_ACC = (0.30, 0.31, 0.32), (0.931, 0.933, 0.935)  # over seeds: sd 0.01 nats, 0.2 pt
# the margins: the larger of fp32's sd and the floor: 0.01 nats (sd and floor alike), 0.5 pt (the floor)
# fp8_e4m3 minus fp32, by seed: +0.012, +0.009, +0.011 nats: mean 0.010667, sd 0.0015275, t(0.975, 2) = 4.3027,
# half-width 4.3027 x 0.0015275 / sqrt(3) = 0.003795: 95% CI +0.0069 to +0.0145: above 0 and past the 0.01 margin
# (within fp32's 0.02 nats range, which once called it unchanged)
# its accuracy minus fp32's: -0.1, 0, -0.1 pt: CI -0.067 +- 4.3027 x 0.0577 / sqrt(3) pt = -0.21 to +0.08 pt
E4M3_LOSS, E4M3_ACC = (0.312, 0.319, 0.331), (0.930, 0.933, 0.934)
# fp8_hybrid:delayed:16 minus fp32: +0.10, +0.10, +0.11 nats: CI 0.1033 +- 4.3027 x 0.005774 / sqrt(3), above 0.02
HYBRID_LOSS = (0.40, 0.41, 0.43)


def fp8_runs(options=EMULATED, fp8_ms: float = 25.0) -> list[dict]:
    return (cell("fp32", FP32_LOSS, FP32_ACC) + cell("amp_bf16", FP32_LOSS, FP32_ACC, ms=8.0)
            + cell("fp8_e4m3", E4M3_LOSS, E4M3_ACC, ms=fp8_ms, options=options)
            + cell("fp8_hybrid:delayed:16", HYBRID_LOSS, (0.92, 0.92, 0.92), ms=fp8_ms, options=options))


def section_html(page: str) -> str:
    """The page's FP8 section, its text unescaped (autoescape writes "matmul's" as "matmul&#39;s")."""
    found = re.search(r'<section id="fp8">.*?</section>', page, re.S)
    assert found, "no FP8 section on the page"
    return markup.unescape(found.group(0))


def test_the_section_shows_fp32_bf16_and_each_fp8_precision_with_figures_from_the_records():
    view = build_view(fp8_runs())
    (entry,) = view.fp8.entries
    assert (entry.model, entry.framework) == ("mlp", "torch")
    assert [a.precision for a in entry.arms] == ["fp32", "amp_bf16", "fp8_e4m3", "fp8_hybrid:delayed:16"]
    fp32, bf16, e4m3, hybrid = entry.arms
    assert abs(e4m3.loss - np.mean(E4M3_LOSS)) < 1e-12 and e4m3.loss_seeds == (0.312, 0.331)
    assert (e4m3.loss_check.verdict, round(e4m3.loss_check.low, 4), round(e4m3.loss_check.high, 4)) == \
        ("higher", 0.0069, 0.0145)
    assert hybrid.loss_check.verdict == "higher" and bf16.loss_check.verdict == "unchanged"
    assert fp32.loss_check is None and e4m3.accuracy_check.verdict == "unchanged"
    rows = {row[0]: row for row in entry.rows}
    assert entry.header[:6] == ("precision", "ok runs", "FP8 matmuls", "eval loss", "over seeds",
                                "loss vs fp32 (paired by seed)")
    assert rows["fp8_e4m3"][:9] == ["fp8_e4m3", "3/3", "emulated", "0.3207", "0.3120-0.3310",
                                    "+0.0107 nats, 95% CI +0.0069 to +0.0145 over 3 seeds; margin ±0.0100 nats "
                                    "(higher)", "93.2%", "93.0-93.4%",
                                    "-0.1 pt, 95% CI -0.2 to +0.1 over 3 seeds; margin ±0.5 pt (unchanged)"]
    assert rows["fp32"][3:8] == ["0.3100", "0.3000-0.3200", "-", "93.3%", "93.1-93.5%"]
    assert rows["fp8_hybrid:delayed:16"][5].endswith("(higher)")
    html = section_html(render(view))
    change = "+0.0107 nats, 95% CI +0.0069 to +0.0145 over 3 seeds; margin ±0.0100 nats (higher)"
    assert change in html and "fp8_hybrid:delayed:16" in html and change in render_markdown(view)
    assert rows["amp_bf16"][5].endswith("(unchanged)")


def test_emulated_fp8_says_so_and_shows_no_speed_ratio():
    older = [{**r, "options": None} for r in fp8_runs()]  # before options["fp8"]: emulated
    for records, evidence in ((fp8_runs(), "emulated (the core's rule, float32 products)"),
                              (older, "emulated (not recorded")):
        view = build_view(records)
        (entry,) = view.fp8.entries
        assert entry.emulated == ["fp8_e4m3", "fp8_hybrid:delayed:16"] and not entry.native
        assert all(a.speed is None for a in entry.arms) and "step time vs fp32" not in entry.header
        html = section_html(render(view))
        assert "FP8 is emulated here (fake-quantized float32 matmuls" in html and evidence in html
        assert "not a measure of FP8 speed" in html and "about loss and accuracy only" in html
        # the emulated runs take 2.5x fp32's time: no ratio of it, nor of amp_bf16's, in the section
        assert not re.search(r"x\d\.\d\d|faster|slower", html), html
        assert "FP8 is emulated here" in render_markdown(view)


def test_native_fp8_says_native_and_shows_its_step_time_ratio_against_fp32():
    records = (cell("fp32", FP32_LOSS, FP32_ACC)
               + cell("fp8_e4m3:native", E4M3_LOSS, E4M3_ACC, ms=5.0, options=NATIVE)
               + cell("fp8_hybrid", E4M3_LOSS, E4M3_ACC, ms=25.0, options=EMULATED))
    view = build_view(records)
    (entry,) = view.fp8.entries
    assert entry.native == ["fp8_e4m3:native"] and entry.emulated == ["fp8_hybrid"]
    rows = {row[0]: row for row in entry.rows}
    assert entry.header[-1] == "step time vs fp32" and rows["fp8_e4m3:native"][2] == "native"
    # 5 ms against fp32's 10 (each repeat 1% slower than the one before, in both): twice as fast
    assert re.fullmatch(r"x2\.00 \(95% CI 1\.9\d-2\.0\d\): 2\.00x faster", rows["fp8_e4m3:native"][-1])
    assert rows["fp8_hybrid"][-1] == "emulated: not a speed" and rows["fp32"][-1] == "-"
    html = section_html(render(view))
    assert "fp8_e4m3:native: native FP8 matmuls (the records say: native (torch._scaled_mm))" in html
    assert "fp8_hybrid: FP8 is emulated here" in html and "<td>native</td>" in html


def test_the_section_is_absent_without_fp8_runs_and_diagnose_s_fp8_verdicts_stay_in_numerics():
    diagnosed = diagnosis()
    view = build_view(cell("fp32", FP32_LOSS, FP32_ACC) + cell("amp_bf16", FP32_LOSS, FP32_ACC), None, [diagnosed])
    assert not view.fp8.shown and not view.fp8.diagnoses
    page = render(view)
    assert 'id="fp8"' not in page and 'href="#fp8"' not in page and "## FP8 training" not in render_markdown(view)
    (numerics,) = view.numerics
    assert UNSAFE in numerics.verdicts and FP8_ELSEWHERE not in numerics.verdicts


def test_with_fp8_runs_diagnose_s_fp8_verdicts_move_to_the_section():
    view = build_view(fp8_runs(), None, [diagnosis()])
    (d,) = view.fp8.diagnoses
    assert (d.model, d.framework) == ("mlp", "torch") and UNSAFE in d.verdicts
    assert d.verdicts[1].startswith("fp8_hybrid:current: safe")
    (numerics,) = view.numerics
    assert UNSAFE not in numerics.verdicts and FP8_ELSEWHERE in numerics.verdicts  # one place
    page = render(view)
    assert markup.unescape(page).count(UNSAFE) == 1 and UNSAFE in section_html(page)


UNSAFE = "fp8_e4m3:current: not safe: layer 0's output gradient (e4m3) underflows in 40.0%"


def diagnosis() -> dict:
    """A diagnose record whose FP8 cast counts (harness.fp8.CastStatistics) make fp8_e4m3 unsafe, fp8_hybrid safe."""
    from harness import numerics

    gradients = np.concatenate([np.full(90, 1.5 * 2.0**-10), np.full(10, 0.5)])

    def counts(underflow):
        return {"0": {"input": {"format": "e4m3", "values": 100, "underflow": 0, "subnormal": 0, "saturate": 0},
                      "output_gradient": {"format": "e4m3", "values": 100, "underflow": underflow, "subnormal": 0,
                                          "saturate": 0}}}

    found = {"groups": {"gradients": {"0": numerics.histogram(gradients)}, "activation_gradients": {},
                        "weights": {}, "updates": {}, "activations": {}},
             "updates": {}, "optimizer": "adam", "captured_steps": [0, 10], "available": True,
             "fp8": {"fp8_e4m3:current": counts(40), "fp8_hybrid:current": counts(0)}}
    return {"run_id": "d", "framework": "torch", "model": "mlp", "precision": "fp32", "status": "ok",
            "diagnosis": found}


def test_the_first_screen_weighs_emulated_fp8_s_speed_nowhere_and_native_fp8_s_as_any_precision():
    """An emulated FP8 run's step times measure the emulation: however fast they look, the first screen's matrix
    and headline neither name it nor compare it; a native one is a contender like any other precision."""
    def named(view) -> set[str]:
        return {e.precision for block in view.answer for row in block.rows for e in row.cells if e} | \
            {line.split(": ")[1].split(" against")[0] for line in view.headline}

    fast = cell("fp32", FP32_LOSS, FP32_ACC) + cell("fp8_e4m3", E4M3_LOSS, E4M3_ACC, ms=2.0, options=EMULATED)
    assert "fp8_e4m3" not in named(build_view(fast))
    native = cell("fp32", FP32_LOSS, FP32_ACC) + cell("fp8_e4m3", E4M3_LOSS, E4M3_ACC, ms=2.0, options=NATIVE)
    assert "fp8_e4m3" in named(build_view(native))


BLOCKS = {"blocks": {"recipe": "mxfp4", "formats": "mxfp4 blocks",
                     "matmuls": "emulated: operands quantized by harness.microscaling's rule"}}


def _with_weights(records: list[dict], graph) -> list[dict]:
    from harness.microscaling import matmul_weights

    return [{**r, "matmul_weights": matmul_weights(graph)} for r in records]


def test_block_scaled_arms_stand_beside_fp8_with_the_weights_their_formats_would_store():
    """mxfp4 and nvfp4 runs join the section (emulated, as their records say, and left out of the first screen's
    speed), and each arm's row states what the model's matmul weights take in its format, from their sizes."""
    from harness.microscaling import RECIPES, storage_bits
    from harness.model.graph import infer
    from harness.model.spec import load_spec
    from tests.conftest import SPECS

    graph = infer(load_spec(str(SPECS / "outlier_channel.yaml")))  # kernels 64x64, 64x64, 64x4
    records = _with_weights(fp8_runs() + cell("mxfp4", E4M3_LOSS, E4M3_ACC, ms=2.0, options=BLOCKS)
                            + cell("nvfp4:rht", HYBRID_LOSS, E4M3_ACC, ms=2.0,
                                   options={"blocks": {**BLOCKS["blocks"], "recipe": "nvfp4:rht"}}), graph)
    view = build_view(records)
    (entry,) = view.fp8.entries
    assert [a.precision for a in entry.arms] == ["fp32", "amp_bf16", "fp8_e4m3", "fp8_hybrid:delayed:16", "mxfp4",
                                                 "nvfp4:rht"]
    assert entry.blocks_emulated == ["mxfp4", "nvfp4:rht"] and entry.header[2] == "FP8 / block matmuls"
    assert entry.header[-1] == "matmul weights stored"
    rows = {row[0]: row for row in entry.rows}
    count = 64 * 64 * 2 + 64 * 4
    # mxfp4: 4 bits a value and an 8-bit scale per 32 along K (the 64-row kernels: 2 blocks a column)
    mxfp4 = sum(storage_bits(shape, RECIPES["mxfp4"].weight, axis=0) for shape in ((64, 64), (64, 64), (64, 4)))
    assert mxfp4 == 4 * count + 8 * (2 * 64 + 2 * 64 + 2 * 4)
    assert rows["fp32"][-1] == f"{32 * count / 8 / 1024:,.1f} KiB"
    assert rows["amp_bf16"][-1] == f"{16 * count / 8 / 1024:,.1f} KiB (0.5x fp32)"
    assert rows["fp8_e4m3"][-1] == f"{8 * count / 8 / 1024:,.1f} KiB (0.25x fp32)"
    assert rows["mxfp4"][-1] == f"{mxfp4 / 8 / 1024:,.1f} KiB ({mxfp4 / (32 * count):.2g}x fp32)"
    # nvfp4:rht stores nvfp4's 16 x 16 tiles: 4 bits, an 8-bit scale per tile and a 32-bit scale per tensor
    nvfp4 = 4 * count + 8 * (16 + 16 + 4) + 32 * 3
    assert rows["nvfp4:rht"][-1] == f"{nvfp4 / 8 / 1024:,.1f} KiB ({nvfp4 / (32 * count):.2g}x fp32)"
    assert rows["mxfp4"][2] == "emulated"
    html = section_html(render(view))
    assert "<h2>FP8 and block-scaled training</h2>" in html and "the block-scaled formats are emulated here" in html
    assert f"the {count:,} matmul kernel values" in html
    assert "## FP8 and block-scaled training" in render_markdown(view)
    # 2 ms a step against fp32's 10: an emulation's time, named nowhere on the first screen
    assert not any(e and e.precision == "mxfp4" for block in view.answer for row in block.rows for e in row.cells)
    # a record from before matmul_weights: no figure
    (older,) = build_view([{**r, "matmul_weights": None} for r in records]).fp8.entries
    assert {row[-1] for row in older.rows} == {"-"}


def test_diagnose_s_block_verdicts_join_the_section_and_leave_numerics():
    from harness import microscaling as ms

    stats = ms.BlockStatistics({"mxfp4": ms.RECIPES["mxfp4"], "mxfp8": ms.RECIPES["mxfp8"]})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    x[:, 0] *= 100  # one input channel 100x: MXFP4 flushes the rest of its block
    stats.add_product("0", x, rng.standard_normal((64, 8)).astype(np.float32))
    d = diagnosis()
    d["diagnosis"] = {**d["diagnosis"], "blocks": stats.result(), "layer_types": {"0": "dense"}}
    view = build_view(fp8_runs() + cell("mxfp4", E4M3_LOSS, E4M3_ACC, options=BLOCKS), None, [d])
    (said,) = view.fp8.diagnoses
    block_lines = [v for v in said.verdicts if v.startswith(("mxfp4", "mxfp8"))]
    assert block_lines[0].startswith("mxfp4: not safe: keep layer 0 (dense) in higher precision: layer 0's input")
    assert block_lines[1].startswith("mxfp8: safe")
    (numerics,) = view.numerics
    assert not any(v.startswith("mxfp4") for v in numerics.verdicts) and FP8_ELSEWHERE in numerics.verdicts
    assert block_lines[0] in markup.unescape(section_html(render(view)))
    # without FP8 or block runs, the block verdicts stay in the Numerics section
    (numerics,) = build_view(cell("fp32", FP32_LOSS, FP32_ACC), None, [d]).numerics
    assert block_lines[0] in numerics.verdicts
