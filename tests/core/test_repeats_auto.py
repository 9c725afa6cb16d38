"""`run --repeats auto`: repeats added round by round until each speed-up against fp32 is decided, within a budget."""
from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from harness import results
from harness.run.process import failure_record
from harness.run.plan import DEFAULT_BUDGET_S, cells, matrix
from harness.run.runner import UntilDecided
from tests.core.test_runner import amp

SPEC = "tests/specs/pitfall_batchnorm.yaml"
SHORT = ["--framework", "fake", "--steps", "3", "--warmup", "1", "--no-progress"]


def _repeats(out_dir) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for r in results.read_records([out_dir]):
        found.setdefault(r["precision"], []).append(r["repeat"])
    return found


def test_a_clear_difference_is_decided_after_three_repeats_from_a_matrix_file(tmp_path):
    plan = tmp_path / "auto.yaml"
    plan.write_text(f"precisions: [fp32, amp_bf16]\nrepeats: auto\nbudget: 60\nwarmup: 1\nsteps: 3\n"
                    f"models:\n  - {{model: {SPEC}}}\n")
    args = ["run", "--framework", "fake", "--matrix", str(plan), "--no-progress", "--out", str(tmp_path / "out")]
    out = amp(*args, faults="amp_bf16=slow")
    assert out.returncode == 0, out.stderr
    assert re.search(r"fake pitfall_batchnorm amp_bf16 against fp32 \(variant default\): decided after 3 "
                     r"repeats: slower, speed-up \S+x, 97.5% CI \S+, look 1 of a sequential test", out.stdout), out.stdout
    assert _repeats(tmp_path / "out") == {"fp32": [0, 1, 2], "amp_bf16": [0, 1, 2]}

    again = amp(*args, "--resume", faults="amp_bf16=slow")  # the recorded repeats count: nothing more to run
    assert again.returncode == 0, again.stderr
    assert "resume: 6 of 6 runs already recorded" in again.stderr
    assert "decided after 3 repeats: slower" in again.stdout
    assert len(results.read_records([tmp_path / "out"])) == 6


def test_a_noisy_pair_repeats_until_the_budget_runs_out_and_says_too_noisy(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_FAKE_NOISE_FILE", str(tmp_path / "noise"))
    out = amp("run", *SHORT, "--model", SPEC, "--precision", "fp32,amp_bf16", "--repeats", "auto", "--budget", "20",
              "--out", str(tmp_path / "out"), faults="fp32=noisy,amp_bf16=noisy")
    assert out.returncode == 0, out.stderr
    line = re.search(r"amp_bf16 against fp32 \(variant default\): budget ran out after (\d+) repeats(?: \(fp32 "
                     r"(\d+)\))?: too noisy here to decide \(speed-up [\d.]+x, [\d.]+% CI [\d.]+-[\d.]+, look \d+ of a "
                     r"sequential test \(5% over all its looks\); spread \d+% "
                     r"fp32, \d+% amp_bf16\)", out.stdout)
    assert line, out.stdout
    n = int(line[1])
    assert n > 3  # repeats were added past the first three
    assert _repeats(tmp_path / "out") == {"fp32": list(range(int(line[2] or n))), "amp_bf16": list(range(n))}


def _plan(budget_s: float, clock) -> tuple[UntilDecided, list]:
    requests = matrix("fake", cells([("mnist_mlp", {})]), ["fp32", "amp_bf16", "amp_fp16"], 3, ["default"])
    return UntilDecided(requests, budget_s, clock=clock), requests


def _ran(q, median_ms: float, status: str = "ok", wall_s: float = 1.0) -> dict:
    record = failure_record(q, status, None, 0.0)
    record.update(step_time_ms={"median": median_ms}, wall_s=wall_s)
    return record


def _rounds(plan, times, status=lambda q: "ok", now=None) -> list:
    """Run the plan's first round and then its rounds to the end, each run 1 s (on the `now` clock)."""
    asked, batch = [], plan.first_round()
    plan.add([_ran(q, times[q.precision][0], status(q)) for q in batch])
    plan.start()  # the first round is outside the budget
    asked, batch = batch, plan.next_round()
    while batch:
        asked += batch
        if now is not None:
            now[0] += len(batch)
        plan.add([_ran(q, times[q.precision][q.repeat % len(times[q.precision])], status(q)) for q in batch])
        batch = plan.next_round()
    return asked


def test_the_budget_covers_the_matrix_and_only_undecided_cells_run_past_three_repeats():
    now = [0.0]
    plan, _ = _plan(8.5, lambda: now[0])
    times = {"fp32": [10.0, 10.1, 9.9, 10.0], "amp_bf16": [20.0, 20.2, 19.8], "amp_fp16": [5.0, 15.0, 9.0, 10.0]}
    asked = _rounds(plan, times, now=now)
    assert [(q.precision, q.repeat) for q in asked[:3]] == [("fp32", 0), ("amp_bf16", 0), ("amp_fp16", 0)]
    assert [(q.precision, q.repeat) for q in asked[9:]] == [("fp32", 3), ("amp_fp16", 3)]  # amp_bf16 is decided
    assert len({q.run_id for q in asked}) == len(asked) == 11  # then half a second left: no run fits
    lines = plan.outcomes()
    assert lines[0] == ("fake mnist_mlp amp_bf16 against fp32 (variant default): decided after 3 repeats: slower, "
                        "speed-up 0.5x, 97.5% CI 0.48-0.52, adjusted for 2 comparisons (Bonferroni), look 1 of a "
                        "sequential test (5% over all its looks)")  # final: fp32's 4th repeat (for amp_fp16) no look
    assert lines[1].startswith("fake mnist_mlp amp_fp16 against fp32 (variant default): budget ran out after 4 "
                               "repeats: too noisy here to decide (speed-up ")
    assert len(lines) == 2  # no cell was cut below three repeats


def test_a_budget_too_small_for_three_repeats_still_gives_every_cell_three_and_no_more():
    now = [0.0]
    plan, _ = _plan(4.5, lambda: now[0])
    times = {"fp32": [10.0, 10.2, 9.8, 10.0], "amp_bf16": [10.0, 10.3, 9.9], "amp_fp16": [5.0, 5.1, 4.9]}
    asked = _rounds(plan, times, now=now)
    assert sorted((q.precision, q.repeat) for q in asked) == sorted((p, r) for p in times for r in range(3))
    lines = plan.outcomes()
    assert lines[0].startswith("fake mnist_mlp amp_bf16 against fp32 (variant default): budget ran out after 3 "
                               "repeats: too noisy here to decide (speed-up ")
    assert lines[1].startswith("fake mnist_mlp amp_fp16 against fp32 (variant default): decided after 3 repeats: "
                               "faster, speed-up 2x")


def test_a_cell_whose_run_did_not_end_ok_stops_and_says_why():
    plan, _ = _plan(100, lambda: 0.0)
    asked = _rounds(plan, {"fp32": [10.0], "amp_bf16": [10.0], "amp_fp16": [5.0, 15.0, 9.0]},
                    status=lambda q: "unsupported" if q.precision == "amp_bf16" else "ok")
    assert [q.precision for q in asked].count("amp_bf16") == 1
    assert plan.outcomes()[0].startswith("fake mnist_mlp amp_bf16 against fp32 (variant default): stopped: its "
                                         "amp_bf16 run r0 ended unsupported")


@pytest.mark.parametrize("args, message", [
    (["--repeats", "auto", "--budget", "-1"], "argument --budget: '-1' is not a positive number of seconds"),
    (["--repeats", "sometimes"], "argument --repeats: 'sometimes' is not a positive integer"),
    (["--budget", "60"], "--budget: only with --repeats auto"),
    (["--repeats", "3", "--budget", "60"], "--budget: only with --repeats auto"),
])
def test_bad_values_are_one_line_and_exit_2(args, message):
    out = amp("run", *SHORT, "--model", SPEC, *args)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


@pytest.mark.parametrize("text, args, message", [
    ("repeats: 3\n", ["--repeats", "auto"], "--repeats: the matrix file"),
    ("repeats: auto\nbudget: 30\n", ["--budget", "60"], "--budget: the matrix file"),
    ("repeats: 3\nbudget: 30\n", [], "budget: only with repeats: auto"),
    ("repeats: auto\nbudget: -5\n", [], "budget: Input should be greater than 0"),
    ("repeats: often\n", [], "repeats"),
])
def test_a_matrix_file_that_sets_repeats_or_budget_is_checked(tmp_path, text, args, message):
    plan = tmp_path / "m.yaml"
    plan.write_text(f"precisions: [fp32, amp_bf16]\n{text}models:\n  - {{model: {SPEC}}}\n")
    out = amp("run", "--framework", "fake", "--matrix", str(plan), *args)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


def test_repeats_auto_beside_a_matrix_file_without_repeats_is_taken(tmp_path):
    plan = tmp_path / "m.yaml"
    plan.write_text(f"precisions: [fp32, tf32]\nwarmup: 1\nsteps: 3\nmodels:\n  - {{model: {SPEC}}}\n")
    out = amp("run", "--framework", "fake", "--matrix", str(plan), "--repeats", "auto", "--budget", "60",
              "--no-progress", "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "tf32 against fp32 (variant default): stopped: its tf32 run r0 ended unsupported (fake cannot do " \
           "TF32)" in out.stdout
    assert _repeats(tmp_path / "out") == {"fp32": [0, 1, 2], "tf32": [0]}  # unsupported: once is enough


def test_cells_with_fewest_repeats_go_first_and_a_first_runs_measurement_is_not_counted_again():
    now = [0.0]
    requests = matrix("fake", cells([("mnist_mlp", {}), ("resnet8", {})]), ["fp32", "amp_bf16"], 3, ["auto"])
    plan = UntilDecided(requests, 6.5, clock=lambda: now[0])
    first = [_ran(q, 10.0, wall_s=1.0) for q in plan.first_round()]
    first[3].update(wall_s=61.0, variant_choice={"chosen": "default", "cached": False, "measure_s": 60.0})
    plan.add(first)  # resnet8 amp_bf16's first run measured the variants for 60 s: its repeats take 1 s
    plan.start()
    second = plan.next_round()
    assert len(second) == 4  # all fit in the budget, resnet8 amp_bf16 too
    plan.add([_ran(q, 10.0) for q in second])
    mnist_fp32 = next(iter(plan.template))
    plan.records[mnist_fp32][2] = _ran(replace(second[0], repeat=2), 10.0)  # it has three repeats now
    now[0] = 4.0  # 2.5 s left: the cells that have two repeats, in the matrix's order, get their third whatever
    # the budget (a cell's first three are never cut); mnist_mlp fp32's fourth no longer fits
    assert [(Path(q.model).stem, q.precision) for q in plan.next_round()] == [("mnist_mlp", "amp_bf16"),
                                                                          ("resnet8", "fp32"), ("resnet8", "amp_bf16")]
    assert plan.ran_out


RUN_S = 10.0  # a repeat's process on the budget's clock: a framework's import, build and warm-up (3-10 s here)
NOISE = 0.08  # per-process spread of a repeat's median step time (log-normal), as on a shared 2-core machine


def simulated_verdict(speed_up: float, seed: int, budget_s: float = DEFAULT_BUDGET_S) -> str:
    """One `--repeats auto` run of fp32 and amp_bf16 through the runner's own UntilDecided and its outcome line,
    each repeat's median drawn with NOISE, amp_bf16 `speed_up` times faster, every run RUN_S on a simulated clock:
    the verdict its line gives ("faster", "slower", "same"), or "none"."""
    rng, now = np.random.default_rng(seed), [0.0]
    requests = matrix("fake", cells([("mnist_mlp", {})]), ["fp32", "amp_bf16"], 3, ["default"])
    plan = UntilDecided(requests, budget_s, clock=lambda: now[0])

    records = {q.precision: _ran(q, 0.0, wall_s=RUN_S) for q in requests}  # built once: a record is slow to build

    def ran(q):
        true_ms = 10.0 if q.precision == "fp32" else 10.0 / speed_up
        return {**records[q.precision], "repeat": q.repeat, "run_id": q.run_id,
                "step_time_ms": {"median": true_ms * math.exp(rng.normal(0, NOISE))}}

    plan.add([ran(q) for q in plan.first_round()])
    plan.start()
    while batch := plan.next_round():
        now[0] += RUN_S * len(batch)
        plan.add([ran(q) for q in batch])
    (line,) = plan.outcomes()
    found = re.search(r": decided after \d+ repeats(?: \(fp32 \d+\))?: (faster|slower|same), ", line)
    return found[1] if found else "none"


def test_looking_after_every_repeat_keeps_false_verdicts_within_5_percent():
    """2,000 runs of two precisions that take the same time: however many looks the default budget allows, at most
    5% may end "faster" or "slower" (the upper end of the rate's 95% Clopper-Pearson interval). A rule that tested
    an unadjusted 95% interval after every repeat called a quarter of such runs faster or slower."""
    verdicts = [simulated_verdict(1.0, seed) for seed in range(2000)]
    false = sum(v in ("faster", "slower") for v in verdicts)
    upper = scipy_stats.binomtest(false, len(verdicts)).proportion_ci(0.95).high
    assert upper <= 0.05, f"{false} of {len(verdicts)} false verdicts (95% CI up to {upper:.3f})"


def test_a_true_speed_up_of_1_25x_is_called_faster_within_the_default_budget():
    verdicts = [simulated_verdict(1.25, seed) for seed in range(500)]
    assert verdicts.count("faster") >= 0.8 * len(verdicts), {v: verdicts.count(v) for v in set(verdicts)}
    assert "slower" not in verdicts and "same" not in verdicts
