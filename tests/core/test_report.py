"""The HTML report, from records that the runner really wrote (through the fake adapter) and hand-edited ones."""
from __future__ import annotations

import os
import re
import shutil

import pytest

from harness.report import build_view, render, write_report
from harness.results import read_records
from tests.conftest import ROOT
from tests.core.test_runner import amp

SPEC = "tests/specs/pitfall_rmsprop_epsilon.yaml"


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    ok = amp("run", "--framework", "fake", "--model", SPEC, "--precision", "fp32,amp_bf16,amp_fp16",
             "--repeats", "2", "--steps", "8", "--warmup", "1", "--loss-scale", "dynamic", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    faults = amp("run", "--repeats", "1", "--framework", "fake", "--model", SPEC, "--precision", "fp16,bf16,tf32,fp64",
                 "--steps", "5", "--timeout", "6", "--out", str(out),
                 faults="fp16=nan,bf16=hang,fp64=abort")
    assert faults.returncode == 1, faults.stderr  # a hang and an abort: 2 runs gave no result
    assert "2 of 4 runs failed or timed out" in faults.stderr
    return out


def test_report_covers_every_status_and_section(results_dir, tmp_path):
    records = read_records([results_dir])
    html, csv = write_report(records, tmp_path / "index.html")
    page = html.read_text()
    for anchor in ("matrix", "summary-table", "fastest-table", "speed-table", "memory-table", "accuracy-table",
                   "scaling-table", "not-run-table", "environment-table", "hash-table"):
        assert f'id="{anchor}"' in page, anchor
    for status in ("diverged", "timeout", "failed", "unsupported"):
        assert f"<td>{status}</td>" in page, status
    # a step-time chart and the loss scale's (the fake adapter skips a step); the fake's losses are the same in
    # every precision, so a sentence stands in for the loss chart
    assert page.count("<svg") == 2 and 'data-chart="loss"' not in page and 'class="loss-note"' in page
    assert html.with_suffix(".md").read_text().startswith("# amp-harness")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "<link" not in page  # offline
    assert len(csv.read_text().splitlines()) == len(records) + 1
    view = build_view(records)
    assert {(s.framework, s.precision) for s in view.summary} == {("fake", "amp_bf16"), ("fake", "amp_fp16")}
    # no figure from a failed run: only ok runs feed the speed table
    assert {r.precision for r in view.speed} == {"fp32", "amp_bf16", "amp_fp16"}


def test_speedup_is_computed_from_raw_step_times(results_dir):
    records = read_records([results_dir])
    fp32 = [r for r in records if r["precision"] == "fp32"]
    bf16 = [r for r in records if r["precision"] == "amp_bf16"]
    import numpy as np

    def geometric_mean(rs):
        return np.exp(np.mean([np.log(np.median(r["step_times_ms"])) for r in rs]))

    expected = geometric_mean(fp32) / geometric_mean(bf16)
    (row,) = [s for s in build_view(records).summary if s.precision == "amp_bf16"]
    assert row.ratio == pytest.approx(expected) and row.lo <= row.ratio <= row.hi
    # two repeats: too few for an interval, and the page must not call the range one
    assert not row.interval and row.ci.startswith("range of 2 repeats")


def test_names_are_escaped(results_dir, tmp_path):
    records = read_records([results_dir])
    evil = [{**r, "model": "<script>alert(1)</script>", "reason": "<img src=x onerror=alert(2)>"} for r in records]
    page = render(build_view(evil))
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_duplicate_and_foreign_records_are_skipped_and_said(results_dir):
    records = read_records([results_dir, results_dir])  # the same file twice
    foreign = {**records[0], "run_id": "foreign", "loss_scale": {"settings": {"mode": "fixed"}}}  # no initial scale
    view = build_view(records + [foreign])
    assert view.n_records == len(records) // 2
    assert set(view.skipped) == {f"{len(records) // 2} records skipped: duplicate run_id",
                                    "1 record skipped: loss_scale.settings is not what a record holds there"}
    assert "records skipped: duplicate run_id" in render(view)


def test_no_ok_runs_and_single_framework_still_render(results_dir):
    failed = [r for r in read_records([results_dir]) if r["status"] != "ok"]
    page = render(build_view(failed))
    assert 'id="no-ok-runs"' in page and 'id="not-run-table"' in page


def test_report_cli_and_bad_input(results_dir, tmp_path):
    out = amp("report", str(results_dir), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 0 and (tmp_path / "r.html").exists() and (tmp_path / "r.csv").exists()
    missing = amp("report", str(tmp_path / "nothing"), "-o", str(tmp_path / "x.html"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def _browser(javascript: bool = True, width: int = 1280, height: int = 800):
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and chromium-driver (see .ci/run)")
        pytest.skip("chromium / chromedriver not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(arg)
    if not javascript:
        options.add_experimental_option("prefs", {"profile.managed_default_content_settings.javascript": 2})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)


def test_report_in_a_real_browser(results_dir, tmp_path):
    """Headless Chromium at 1280 px: no console errors, the answer on the first screen, no horizontal scrolling,
    a caption on every table and chart, sortable tables, and the same content with JavaScript off."""
    from selenium.webdriver.common.by import By

    html, _ = write_report(read_records([results_dir]), tmp_path / "index.html")
    driver = _browser()
    try:
        driver.get(html.as_uri())
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        matrix = driver.find_element(By.ID, "matrix")
        assert matrix.is_displayed()
        inner = driver.execute_script("return window.innerHeight")
        assert matrix.rect["y"] + matrix.rect["height"] <= inner, "the matrix must be within the first screen"
        assert driver.find_element(By.CSS_SELECTOR, "ul.recommendations li").rect["y"] < inner
        for opened in (False, True):  # closed, then with every <details> open
            if opened:
                driver.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
            assert driver.execute_script(
                "return document.documentElement.scrollWidth <= document.documentElement.clientWidth"), \
                "the page scrolls horizontally at 1280 px"
        tables = driver.find_elements(By.TAG_NAME, "table")
        assert tables and all(t.find_elements(By.TAG_NAME, "caption") for t in tables)
        assert all(c.text.strip() for t in tables for c in t.find_elements(By.TAG_NAME, "caption"))
        charts = driver.find_elements(By.CSS_SELECTOR, "figure.chart svg")
        assert len(charts) == len(driver.find_elements(By.CSS_SELECTOR, "figure.chart")) >= 2
        assert all(c.size["width"] > 100 for c in charts)
        assert all(f.find_element(By.TAG_NAME, "figcaption").text.strip()
                   for f in driver.find_elements(By.CSS_SELECTOR, "figure.chart"))
        # sorting: a click on "repeat" orders the loss-scale table by it, a second click reverses it
        table = driver.find_element(By.ID, "scaling-table")
        header = table.find_elements(By.CSS_SELECTOR, "thead th")[3]
        column = "return Array.from(arguments[0].tBodies[0].rows).map(r => Number(r.cells[3].textContent))"
        header.click()
        ascending = driver.execute_script(column, table)
        header.click()
        assert ascending == sorted(ascending) and driver.execute_script(column, table) == sorted(ascending)[::-1]
        artifacts = ROOT / "reports" / "test-artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        driver.execute_script("window.scrollTo(0, 0); "
                              "document.querySelectorAll('details').forEach(d => d.open = false)")
        assert driver.save_screenshot(str(artifacts / "report.png"))
    finally:
        driver.quit()
    driver = _browser(javascript=False)
    try:
        driver.get(html.as_uri())
        assert driver.find_element(By.ID, "matrix").is_displayed()
        details = driver.find_elements(By.TAG_NAME, "details")
        assert details
        details[0].find_element(By.TAG_NAME, "summary").click()  # folding needs no script
        assert details[0].get_attribute("open") is not None
        assert driver.find_element(By.ID, "summary-table").is_displayed()
        assert len(driver.find_elements(By.CSS_SELECTOR, "figure.chart svg")) >= 2
        assert not driver.find_elements(By.CSS_SELECTOR, "th[aria-sort], th[tabindex]")  # the script never ran
    finally:
        driver.quit()


def test_runs_under_different_settings_are_never_pooled(tmp_path):
    for threads in ("1", "2"):
        out = amp("run", "--repeats", "1", "--framework", "fake", "--model", SPEC, "--precision", "fp32,amp_bf16", "--steps", "3",
                  "--warmup", "0", "--threads", threads, "--out", str(tmp_path / threads))
        assert out.returncode == 0, out.stderr
    view = build_view(read_records([tmp_path / "1", tmp_path / "2"]))
    assert sorted({(r.framework, r.precision) for r in view.speed}) == [
        ("fake [threads 1]", "amp_bf16"), ("fake [threads 1]", "fp32"),
        ("fake [threads 2]", "amp_bf16"), ("fake [threads 2]", "fp32")]
    assert sorted(s.framework for s in view.summary) == ["fake [threads 1]", "fake [threads 2]"]
    assert all(r.repeats == 1 for r in view.speed)


def test_numerics_section_from_diagnoses_and_a_study(tmp_path):
    import numpy as np

    from harness import numerics

    gradients = np.concatenate([np.full(90, 1.5 * 2.0**-28), np.full(10, 0.5)])
    counts = numerics.update_counts(np.ones(100), np.full(100, 1e-3), gradients)
    diagnosis = {"groups": {"gradients": {"0": numerics.histogram(gradients)}, "activation_gradients": {},
                            "weights": {}, "updates": {}, "activations": {}},
                 "updates": {"0": counts}, "optimizer": "adam", "captured_steps": [0, 10], "available": True}
    diagnosis.update(verdicts=numerics.verdicts(diagnosis), outcomes=numerics.outcomes(diagnosis),
                     loss_scale_window=list(numerics.loss_scale_window(numerics.histogram(gradients))))
    diagnosed = {"run_id": "d", "framework": "fake", "model": "m", "precision": "fp32", "status": "ok",
                 "diagnosis": diagnosis}
    unavailable = {**diagnosed, "run_id": "u", "framework": "other", "diagnosis": {"available": False}}
    study = [{"run_id": f"s{i}", "framework": "fake", "model": "m", "precision": "amp_fp16", "status": status,
              "study": "loss-scale-1", "batch_size": 4, "eval_accuracy": acc, "eval_loss": 1.0,
              "loss_scale": {"settings": settings, "skipped_steps": skipped}}
             for i, (settings, status, acc, skipped) in enumerate([
                 ({"mode": "none"}, "ok", 0.5, 0), ({"mode": "fixed", "initial": 16.0}, "ok", 0.9, 0),
                 ({"mode": "fixed", "initial": 2.0**32}, "ok", 0.1, 20),
                 ({"mode": "dynamic", "initial": 65536.0, "growth_interval": 2000}, "ok", 0.9, 1)])]
    view = build_view(study, None, [diagnosed, unavailable])
    assert view.sixteen_bit_safe == [
        "m (fake diagnosis): amp_fp16 safe with a loss scale in 2^3..2^16 (layer outputs not checked); fp16 the "
        "optimizer's second moment underflows; fp16_sr the optimizer's second moment underflows; bf16 stalls: 100.0% "
        "of layer 0's updates vanish in bfloat16 (fix: bf16_sr or bf16_kahan); bf16_sr safe; bf16_kahan safe; "
        "amp_bf16 safe (layer outputs not checked)"]
    assert [n.note for n in view.numerics] == [None, "not available: this adapter cannot capture tensors"]
    (s,) = view.studies
    assert [(p.label, p.skipped) for p in s.rows] == [("none", 0), ("2^4", 0), ("2^32", 20), ("dynamic", 1)]
    assert not view.speed  # study runs are not cells of the comparison
    page = render(view)
    assert 'data-chart="numerics"' in page and 'data-chart="study"' in page and "16-bit safe?" in page
    # the window's exponent is an int in the record: read as a model, it prints as one (not 2^3.0)
    assert "weight gradients x 2^3<" in page
