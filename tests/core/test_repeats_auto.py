"""`run --repeats auto`: repeats added round by round until each speed-up against fp32 is decided, within a budget."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from harness import results
from harness.run.process import failure_record
from harness.run.plan import cells, matrix
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
                     r"repeats: slower, speed-up \S+x, 95% CI \S+", out.stdout), out.stdout
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
                     r"(\d+)\))?: too noisy here to decide \(speed-up [\d.]+x, 95% CI [\d.]+-[\d.]+; spread \d+% "
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
    assert lines[0].startswith("fake mnist_mlp amp_bf16 against fp32 (variant default): decided after 3 repeats "
                               "(fp32 4): slower, speed-up 0.5x")
    assert lines[1].startswith("fake mnist_mlp amp_fp16 against fp32 (variant default): budget ran out after 4 "
                               "repeats: too noisy here to decide (speed-up ")
    assert len(lines) == 2  # no cell was cut below three repeats


def test_a_budget_too_small_for_three_repeats_runs_each_cell_once_and_says_what_it_cut():
    now = [0.0]
    plan, _ = _plan(4.5, lambda: now[0])
    asked = _rounds(plan, {"fp32": [10.0], "amp_bf16": [20.0], "amp_fp16": [5.0]}, now=now)
    assert [(q.precision, q.repeat) for q in asked] == [("fp32", 0), ("amp_bf16", 0), ("amp_fp16", 0), ("fp32", 1),
                                                        ("amp_bf16", 1), ("amp_fp16", 1), ("fp32", 2)]
    lines = plan.outcomes()
    assert lines[0] == ("fake mnist_mlp amp_bf16 against fp32 (variant default): budget ran out after 2 repeats "
                        "(fp32 3): not enough repeats for a verdict (range of 2 repeats 0.50-0.50)")
    assert lines[-1] == ("the 4.5 s budget cut 2 of 3 cells below 3 repeats (no verdict for them): mnist_mlp "
                         "amp_bf16 (2), mnist_mlp amp_fp16 (2); a larger --budget gives them their repeats")


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
    now[0] = 4.0  # 2.5 s left: two runs, of the cells that have two repeats, in the matrix's order
    assert [(Path(q.model).stem, q.precision) for q in plan.next_round()] == [("mnist_mlp", "amp_bf16"),
                                                                          ("resnet8", "fp32")]
