"""The device's matmul curve (harness.run.peak.matmul_curve): measured with a fake matmul on a fake clock, so its
rates are known; kept in a scaling study's run records only; and read in the scaling section (harness.report.scaling)
from constructed curves: the sentence comparing each 16-bit dtype with float32, the model against the curve, the
chart."""
from __future__ import annotations

import pytest

from harness.precision import PRECISIONS
from harness.records import MatmulCurve, RunRecord
from harness.report import build_view, render
from harness.report.scaling import curve_sentence
from harness.run import peak, train
from tests.core.test_report_scaling import STUDY, size
from tests.fake_adapter.fake_adapter import FakeAdapter


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class RateAdapter(FakeAdapter):
    """Its m x k by k x n product of a dtype "takes" 2mkn / rate seconds on a fake clock (a dtype without a rate has no
    kernel); the first product of each size also pays a 10 s compilation, which the curve must not count."""

    def __init__(self, clock: Clock, rates: dict[str, float]):
        self.clock, self.rates, self.asked, self.products = clock, rates, [], {}

    def matmul(self, shape, dtype, device):
        m, k, n = shape
        self.asked.append((dtype, n) if m == k == n else (dtype, shape))
        if dtype not in self.rates:
            return None
        compiled = []

        def run():
            self.clock.now += 2 * m * k * n / self.rates[dtype] + (0 if compiled else 10.0)
            compiled.append(True)
            key = n if m == k == n else shape
            self.products[(dtype, key)] = self.products.get((dtype, key), 0) + 1

        return run


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(peak.time, "perf_counter", c)
    return c


def test_the_curve_is_each_size_s_rate_without_its_warm_up_and_stops_past_the_time_cap(clock):
    adapter = RateAdapter(clock, {"float32": 1e12, "bfloat16": 2e12, "float16": 0.3e9})
    device = adapter.device("cpu")
    fp32 = peak.matmul_curve(adapter, device, "float32")
    assert fp32["n"] == [64, 128, 256, 512, 1024, 2048, 4096] and fp32["stopped"] is None
    assert fp32["gflops"] == pytest.approx([1000.0] * 7), "the warm-up's compilation was counted, or a loop miscounted"
    assert peak.matmul_curve(adapter, device, "bfloat16")["gflops"] == pytest.approx([2000.0] * 7)
    # emulated float16: 0.11 s a product at n=256 (under the cap), 0.89 s at 512 (over it): 512 is the last size
    fp16 = peak.matmul_curve(adapter, device, "float16")
    assert fp16["n"] == [64, 128, 256, 512] and fp16["gflops"] == pytest.approx([0.3] * 4)
    assert fp16["stopped"] == "one product took 0.89 s, over the 0.25 s cap", fp16["stopped"]
    assert ("float16", 1024) not in adapter.asked
    assert adapter.products[("float16", 512)] == 2, "a product over the cap is timed once, after its warm-up"
    assert adapter.products[("float16", 256)] > 2, "a size under the cap is timed as the median of a few products"
    assert peak.matmul_curve(adapter, device, "float64") is None  # no kernel at all
    # over the cap at the last size planned: kept from one product, and the curve is whole (nothing stopped)
    adapter.rates["float32"], adapter.products = 0.5e12, {}  # 4096: 0.27 s a product
    fp32 = peak.matmul_curve(adapter, device, "float32")
    assert fp32["n"][-1] == 4096 and fp32["stopped"] is None and adapter.products[("float32", 4096)] == 2


def test_a_scaling_study_s_run_holds_the_curve_measured_once_per_machine_an_ordinary_run_not(clock, monkeypatch):
    monkeypatch.setattr(peak, "MIN_PRODUCT_S", 0.0)  # the peak: one size
    adapter = RateAdapter(clock, {"float32": 1e12, "bfloat16": 2e12})
    device, fp32 = adapter.device("cpu"), PRECISIONS["fp32"]
    ordinary = {"achieved_gflops": 1.0, "study": None}
    train.efficiency(adapter, device, fp32, 1, ordinary)
    assert "matmul_curve" not in ordinary and not any(n == 64 for _, n in adapter.asked)
    study = {"achieved_gflops": 1.0, "study": STUDY}
    train.efficiency(adapter, device, fp32, 1, study)
    curve = study["matmul_curve"]
    assert curve["float16"] is None and curve["bfloat16"]["gflops"] == pytest.approx([2000.0] * 7)
    RunRecord.model_validate({"run_id": "r", "framework": "fake", "precision": "fp32", "status": "failed",
                              "matmul_curve": curve})  # what the record holds reads back
    asked = len(adapter.asked)
    again = {"achieved_gflops": 1.0, "study": STUDY}
    train.efficiency(adapter, device, fp32, 1, again)  # another run of the study, the same machine
    assert again["matmul_curve"] == curve and len(adapter.asked) == asked, "the cached curve was measured again"


def sentence(framework: str, curves: dict[str, dict | None]) -> str:
    """curve_sentence of these curves as a record holds them, read as the report reads them."""
    return curve_sentence(framework, {d: c and MatmulCurve.model_validate(c) for d, c in curves.items()})


def curve(rates: list[float], start: int = 64, stopped: str | None = None) -> dict:
    return {"n": [start * 2**k for k in range(len(rates))], "gflops": rates, "stopped": stopped}


FP32 = curve([1, 5, 20, 50, 80, 100, 100])


def test_the_sentence_says_from_which_n_on_16_bit_matmuls_pay_and_where_they_are_emulated():
    line = sentence("torch", {"float32": FP32,
                                    "bfloat16": curve([0.5, 2.5, 10, 90, 128, 200, 250]),
                                    "float16": curve([0.05, 0.3, 0.3, 0.3], stopped="one product took 0.89 s, "
                                                                                   "over the 0.25 s cap")})
    assert line.startswith("On this device (torch's square n x n matmuls), bfloat16 matmuls reach at least x1.60 "
                           "float32's rate from n=512 on (x2.50 at n=4096), x0.50 at n=256; "), line
    assert ("float16's reach at most 6.0% of float32's rate at any size measured (n=64 to 512): likely emulated, "
            "with no native float16 matmul here (measured up to n=512: one product took 0.89 s, over the 0.25 s "
            "cap).") in line, line
    # a size in between that is not faster breaks the run: "from n on" holds for every larger size
    line = sentence("jax", {"float32": FP32, "bfloat16": curve([2, 10, 40, 100, 84, 200, 200])})
    assert "from n=2048 on" in line and "x1.05 at n=1024" in line, line
    line = sentence("tensorflow", {"float32": FP32, "bfloat16": curve([0.6, 3, 15, 40, 70, 90, 95])})
    assert "bfloat16's are no faster than float32's at any size measured (n=64 to 4096: x0.60 to x0.95" in line
    line = sentence("mxnet", {"float32": FP32, "bfloat16": curve([1, 5, 20, 70, 80, 100, 90]),
                                    "float16": None})
    assert "bfloat16's are faster than float32's only at n=512 (up to x1.40), not at n=4096 (x0.90)" in line
    assert "mxnet has no float16 matmul kernel here" in line
    assert sentence("torch", {"float32": FP32}) == ""  # no 16-bit curve: nothing to say


def with_curve(records: list[dict], curves: dict) -> list[dict]:
    return [{**r, "matmul_curve": curves} for r in records]


def test_the_section_shows_the_curve_beside_the_model_s_steps():
    curves = {"float32": FP32, "bfloat16": curve([0.5, 2.5, 10, 90, 128, 200, 250]), "float16": None}
    # fp32: 32 MFLOP in 4 ms (8 GFLOP/s) at batch 16, 512 MFLOP in 40 ms (12.8) at batch 256
    records = with_curve(size(16, 4.0, 0.8) + size(256, 40.0, 1.5), curves)
    view = build_view(records)
    (entry,) = view.crossover.entries
    assert entry.curve_lines[0].startswith("On this device (torch's square n x n matmuls), bfloat16 matmuls reach at "
                                           "least x1.60 float32's rate from n=512 on"), entry.curve_lines
    assert entry.curve_lines[1] == ("The model's steps against the curve: fp32 at 8-13 GFLOP/s, what float32 "
                                    "matmuls reach at n=256; amp_bf16 at 6.4-19 GFLOP/s, what bfloat16 "
                                    "matmuls reach at n=256 to 512."), entry.curve_lines
    svg = str(entry.curve_chart)
    assert svg.startswith("<svg") and "float32 matmul (n x n)" in svg and "amp_bf16 step" in svg
    assert ">bfloat16 matmul (n x n)<" in svg and ">float16 matmul" not in svg  # no kernel: no line
    page = render(view)
    assert 'data-chart="matmul-curve"' in page and "x1.60 float32&#39;s rate from n=512 on" in page
    # a study whose runs hold no curve (older records): no curve, the rest of the section as before
    (entry,) = build_view(size(16, 4.0, 0.8) + size(256, 40.0, 1.5)).crossover.entries
    assert entry.curve_lines == [] and entry.curve_chart is None and entry.sentences


def test_a_record_s_curve_must_pair_each_size_with_a_rate():
    bad = {"run_id": "r", "framework": "fake", "precision": "fp32", "status": "failed",
           "matmul_curve": {"float32": {"n": [64, 128], "gflops": [1.0], "stopped": None}}}
    with pytest.raises(ValueError, match="2 sizes but 1 rates"):
        RunRecord.model_validate(bad)


def test_a_step_s_matmuls_are_its_layers_products_forward_and_backward():
    from harness.model.graph import infer, step_matmul_share, step_matmuls
    from harness.model.spec import load_spec

    mlp = load_spec("mnist_mlp")  # 784-512-10
    graph = infer(mlp)
    products = [(mm.path, mm.pass_, mm.m, mm.k, mm.n) for mm in step_matmuls(graph, 32)]
    assert products[:3] == [("1", "forward", 32, 784, 512), ("1", "input gradient", 32, 512, 784),
                            ("1", "weight gradient", 784, 32, 512)], products
    assert step_matmul_share(graph, 32) == pytest.approx(1.0)  # every FLOP the step counts is a 2D product
    conv = infer(load_spec("resnet8"))  # the first conv as im2col: 32x32 positions, 3x3x3 taps, 16 filters
    first = step_matmuls(conv, 4)[0]
    assert (first.m, first.k, first.n) == (4 * 32 * 32, 27, 16)
    assert step_matmul_share(conv, 4) == pytest.approx(1.0)
    gpt = infer(load_spec("tiny_gpt"))  # attention's batched score products are not 2D ones: left out
    assert 0.5 < step_matmul_share(gpt, 4) < 1.0


def test_the_model_s_own_shapes_are_timed_once_each_and_too_big_or_too_slow_ones_are_not(clock, monkeypatch):
    from harness.model.graph import Matmul

    adapter = RateAdapter(clock, {"float32": 1e12, "float16": 0.3e9})
    device = adapter.device("cpu")
    products = [Matmul("1", "dense", "forward", 64, 784, 512), Matmul("1", "dense", "input gradient", 64, 512, 784),
                Matmul("2", "dense", "forward", 64, 784, 512)]  # the same shape twice: timed once
    rates = peak.shape_rates(adapter, device, 1, False, "float32", products, curve([1000.0] * 7))
    assert [(r["m"], r["k"], r["n"]) for r in rates] == [(64, 784, 512), (64, 512, 784)]
    assert [r["gflops"] for r in rates] == pytest.approx([1000.0, 1000.0])
    assert adapter.asked.count(("float32", (64, 784, 512))) == 1
    again = peak.shape_rates(adapter, device, 1, False, "float32", products, curve([1000.0] * 7))
    assert again == rates and adapter.asked.count(("float32", (64, 784, 512))) == 1, "the cached rate was retimed"
    # emulated float16: 0.3 GFLOP/s on its curve, so a 8192 x 784 x 512 product would take ~22 s: not timed
    slow = peak.shape_rates(adapter, device, 1, False, "float16", [Matmul("1", "dense", "forward", 8192, 784, 512)],
                            curve([0.3] * 4))
    assert slow[0]["skipped"].startswith("one product would take about 22 s at the float16 curve's rate"), slow
    assert not any(shape == (8192, 784, 512) for _, shape in adapter.asked)
    monkeypatch.setattr(peak, "MAX_SHAPE_MB", 1)  # 64x784 + 784x512 + 64x512 floats: 1.85 MB
    big = peak.shape_rates(adapter, device, 1, False, "float32", products[:1], curve([1000.0] * 7))
    assert big[0]["skipped"] == "its operands and product take 2 MB, over the 1 MB this check allows", big
    assert peak.shape_rates(adapter, device, 1, False, "bfloat16", products, None)[0]["skipped"] == \
        "no bfloat16 matmul kernel here"


def test_a_scaling_study_s_run_holds_its_step_s_matmuls_timed_alone(clock, monkeypatch):
    from harness.model.graph import infer, step_matmuls
    from harness.model.spec import load_spec

    monkeypatch.setattr(peak, "MIN_PRODUCT_S", 0.0)
    adapter = RateAdapter(clock, {"float32": 1e12, "bfloat16": 2e12})
    matmuls = step_matmuls(infer(load_spec("mnist_mlp")), 16)
    record = {"achieved_gflops": 1.0, "study": STUDY}
    train.efficiency(adapter, adapter.device("cpu"), PRECISIONS["amp_bf16"], 1, record, matmuls)
    shapes = record["matmul_shapes"]
    assert shapes["dtype"] == "bfloat16" and len(shapes["products"]) == 6
    assert shapes["products"][0] == {"layer": "1", "type": "dense", "pass": "forward", "m": 16, "k": 784, "n": 512,
                                     "gflops": pytest.approx(2000.0)}
    RunRecord.model_validate({"run_id": "r", "framework": "fake", "precision": "amp_bf16", "status": "failed",
                              "matmul_shapes": shapes})
    ordinary = {"achieved_gflops": 1.0, "study": None}
    train.efficiency(adapter, adapter.device("cpu"), PRECISIONS["amp_bf16"], 1, ordinary, matmuls)
    assert "matmul_shapes" not in ordinary
