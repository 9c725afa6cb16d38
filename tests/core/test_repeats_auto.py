"""`run --repeats auto`: repeats added round by round until each speed-up against fp32 is decided, within a budget."""
from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from harness import results, stats
from harness.run.process import failure_record
from harness.run.plan import DEFAULT_BUDGET_S, matrix, resolve_models
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
    # the first round, then 2 repeats a process (what a later one costs is not known yet), then 1 or 2 (amp_bf16's
    # steps take about as long as its process's start, whose cost the runner measures: a loaded machine makes it 2),
    # and the cells compared run alike
    found = re.search(r"fake pitfall_batchnorm amp_bf16 against fp32 \(variant default\): decided after ([45]) "
                      r"repeats in 3 processes: slower, speed-up \S+x, [\d.]+% CI \S+, look 1 of a sequential test",
                      out.stdout)
    assert found, out.stdout
    last = int(found[1]) - 3
    assert _repeats(tmp_path / "out") == {p: list(range(3 + last)) for p in ("fp32", "amp_bf16")}
    processes = [r["process"] for r in results.read_records([tmp_path / "out"]) if r["precision"] == "fp32"]
    assert [processes.count(p) for p in dict.fromkeys(processes)] == [1, 2, last]
    # the report shows the interval that decided, replayed from the records' rounds and processes
    decided = re.search(r"decided after [^:]+: slower, speed-up \S+x, ([\d.]+% CI \S+), look 1", out.stdout)[1]
    page = amp("report", str(tmp_path / "out"), "-o", str(tmp_path / "index.html"))
    assert page.returncode == 0, page.stderr
    assert re.search(re.escape(decided) + r", look 1 of a sequential test", (tmp_path / "index.html").read_text())

    again = amp(*args, "--resume", faults="amp_bf16=slow")  # the recorded repeats count: nothing more to run
    assert again.returncode == 0, again.stderr
    assert "resume: 6 of 6 runs already recorded" in again.stderr
    assert f"decided after {3 + last} repeats in 3 processes: slower" in again.stdout
    assert len(results.read_records([tmp_path / "out"])) == 2 * (3 + last)


def test_a_noisy_pair_repeats_until_the_budget_runs_out_and_says_too_noisy(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_FAKE_NOISE_FILE", str(tmp_path / "noise"))
    out = amp("run", *SHORT, "--model", SPEC, "--precision", "fp32,amp_bf16", "--repeats", "auto", "--budget", "8",
              "--out", str(tmp_path / "out"), faults="fp32=noisy,amp_bf16=noisy")
    assert out.returncode == 0, out.stderr
    line = re.search(r"amp_bf16 against fp32 \(variant default\): budget ran out after (\d+) repeats(?: in \d+ "
                     r"processes)?(?: \(fp32 (\d+) repeats(?: in \d+ processes)?\))?: too noisy here to decide \(speed-up [\d.]+x, [\d.]+% CI [\d.]+-[\d.]+, look \d+ of a "
                     r"sequential test \(4% over its 20 looks\); spread \d+% "
                     r"fp32, \d+% amp_bf16\)", out.stdout)
    assert line, out.stdout
    n = int(line[1])
    assert n > 3  # repeats were added past the first three
    assert _repeats(tmp_path / "out") == {"fp32": list(range(int(line[2] or n))), "amp_bf16": list(range(n))}


def _plan(budget_s: float, clock) -> tuple[UntilDecided, list]:
    requests = matrix("fake", resolve_models([("mnist_mlp", {})]), ["fp32", "amp_bf16", "amp_fp16"], 3, ["default"])
    return UntilDecided(requests, budget_s, clock=clock), requests


def _ran(q, median_ms: float, status: str = "ok", wall_s: float = 1.0) -> dict:
    record = failure_record(q, status, None, 0.0)
    record.update(step_time_ms={"median": median_ms}, wall_s=wall_s,
                  process=None if q.shares_process is None else f"process {q.shares_process}")
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
    """Every run 1 s, nothing outside them: the first round, then 2 repeats a process (what a later repeat costs is
    not known yet), then 1 (it costs what a first one does), until the budget has no room for a round."""
    now = [0.0]
    plan, _ = _plan(11.5, lambda: now[0])
    times = {"fp32": [10.0, 10.1, 9.9, 10.0], "amp_bf16": [20.0, 20.2, 19.8], "amp_fp16": [5.0, 15.0, 9.0, 10.0]}
    asked = _rounds(plan, times, now=now)
    assert [(q.precision, q.repeat, q.shares_process) for q in asked] == [
        ("fp32", 0, None), ("amp_bf16", 0, None), ("amp_fp16", 0, None),  # the first round
        ("fp32", 1, 0), ("fp32", 2, 0), ("amp_bf16", 1, 1), ("amp_bf16", 2, 1), ("amp_fp16", 1, 2), ("amp_fp16", 2, 2),
        ("fp32", 3, 3), ("amp_bf16", 3, 4), ("amp_fp16", 3, 5),  # three processes each, past the budget (9 of 11.5 s)
        ("fp32", 4, 6), ("amp_fp16", 4, 7)]  # amp_bf16 is decided; then half a second is left: no process fits
    lines = plan.outcomes()
    assert lines[0].startswith("fake mnist_mlp amp_bf16 against fp32 (variant default): decided after 4 repeats in 3 "
                               f"processes: slower, speed-up 0.5x, {(1 - 2 * stats.look_level(2)) * 100:.4g}% CI 0.50-0.50, adjusted "
                               f"for 2 comparisons (Bonferroni), look 1 of a sequential test")  # final: fp32's 5th process is no look
    assert lines[1].startswith("fake mnist_mlp amp_fp16 against fp32 (variant default): budget ran out after 5 "
                               "repeats in 4 processes: too noisy here to decide (speed-up ")
    assert len(lines) == 2  # no cell was cut below three processes


def test_a_budget_too_small_for_three_repeats_still_gives_every_cell_three_and_no_more():
    now = [0.0]
    plan, _ = _plan(4.5, lambda: now[0])
    times = {"fp32": [10.0, 10.2, 9.8, 10.0], "amp_bf16": [10.0, 13.0, 13.0, 7.0], "amp_fp16": [5.0, 5.1, 4.9]}
    asked = _rounds(plan, times, now=now)
    # three processes each: alone, 2 repeats, 1
    assert sorted((q.precision, q.repeat) for q in asked) == sorted((p, r) for p in times for r in range(4))
    lines = plan.outcomes()
    assert lines[0].startswith("fake mnist_mlp amp_bf16 against fp32 (variant default): budget ran out after 4 "
                               "repeats in 3 processes: too noisy here to decide (speed-up ")
    assert lines[1].startswith("fake mnist_mlp amp_fp16 against fp32 (variant default): decided after 4 repeats in 3 "
                               "processes: "
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
    found = _repeats(tmp_path / "out")  # tf32 unsupported: once is enough; fp32 has its three processes
    assert found["tf32"] == [0] and found["fp32"] == list(range(len(found["fp32"])))
    assert len({r["process"] for r in results.read_records([tmp_path / "out"]) if r["precision"] == "fp32"}) == 3


def test_cells_with_fewest_repeats_go_first_and_a_first_runs_measurement_is_not_counted_again():
    now = [0.0]
    requests = matrix("fake", resolve_models([("mnist_mlp", {}), ("resnet8", {})]), ["fp32", "amp_bf16"], 3, ["auto"])
    plan = UntilDecided(requests, 6.5, clock=lambda: now[0])
    first = [_ran(q, 10.0, wall_s=1.0) for q in plan.first_round()]
    first[3].update(wall_s=61.0, variant_choice={"chosen": "default", "cached": False, "measure_s": 60.0})
    plan.add(first)  # resnet8 amp_bf16's first run measured the variants for 60 s: its repeats take 1 s
    plan.start()
    second = plan.next_round()
    # a process of 2 repeats each, resnet8 amp_bf16 first: its first run measured the variants, so it is not timed
    # (a repeat there takes 1 s)
    assert [(Path(q.model).stem, q.precision) for q in second[::2]] == [
        ("resnet8", "amp_bf16"), ("mnist_mlp", "fp32"), ("mnist_mlp", "amp_bf16"), ("resnet8", "fp32")]
    plan.add([_ran(q, 10.0) for q in second])
    plan.add([_ran(replace(second[2], repeat=3, shares_process=99), 10.0)], earlier=True)  # mnist fp32: 3 processes
    now[0] = 4.0  # 2.5 s left, a repeat 1 s, a process 1 repeat now: the cells with fewest processes go first, and
    # get their third whatever the budget (a cell's first three are never cut); mnist_mlp fp32's fourth no longer
    # fits. resnet8 amp_bf16 has one timed process
    assert [(Path(q.model).stem, q.precision) for q in plan.next_round()] == [("resnet8", "amp_bf16"),
                                                                          ("mnist_mlp", "amp_bf16"), ("resnet8", "fp32")]
    assert plan.ran_out


def test_a_process_runs_as_many_repeats_as_its_start_costs_in_later_ones():
    """Each process start costs 2 s outside the runs, a cell's first repeat in a process 1 s; later repeats cost
    0.25 s (fp32), 1 s (amp_bf16) or 3 s (amp_fp16): 4 (the most), 3 and 1 repeats a process, and the cells compared
    with one fp32 cell run the fewest of them (a first repeat is timed colder: both sides of a ratio hold one mix)."""
    now = [0.0]
    plan, _ = _plan(1000, lambda: now[0])
    later = {"fp32": 0.25, "amp_bf16": 1.0, "amp_fp16": 3.0}
    noisy = [10.0, 14.0, 7.0, 12.0]  # nothing decides

    def ran(batch):
        found, seen = [], set()
        for q in batch:
            key = (q.precision, q.repeat) if q.shares_process is None else q.shares_process
            wall = later[q.precision] if key in seen else 1.0
            now[0] += wall + (2.0 if key not in seen else 0.0)
            seen.add(key)
            found.append({**_ran(q, noisy[q.repeat % 4], wall_s=wall), "process": str(key)})
        return found

    plan.add(ran(plan.first_round()))
    plan.start()
    counts = []
    for _ in range(2):
        batch = plan.next_round()
        counts.append({p: [q.precision for q in batch].count(p) for p in later})
        plan.add(ran(batch))
    assert counts == [{p: 2 for p in later}, {p: 1 for p in later}]  # 2 until a later repeat was timed
    assert {c[2]: plan.per_process(c, plan._overhead()) for c in plan.template} == \
        {"fp32": 4, "amp_bf16": 3, "amp_fp16": 1}


START_S, RUN_S = 6.0, 3.0  # a process's start (a framework's import) and a repeat in it, on the budget's clock
NOISE = 0.08  # per-process spread of a repeat's median step time (log-normal), as on a shared 2-core machine
WITHIN = 0.03  # and of each repeat in a process


def simulated_run(speed_up: float, seed: int, budget_s: float = DEFAULT_BUDGET_S) -> UntilDecided:
    """One `--repeats auto` run of fp32 and amp_bf16 through the runner's own UntilDecided, to its end: every
    process starts in START_S and draws its own NOISE, each repeat in it takes RUN_S and draws WITHIN more (so
    UntilDecided runs 3 repeats in a process after the first round), amp_bf16 `speed_up` times faster, on a simulated
    clock."""
    rng, now = np.random.default_rng(seed), [0.0]
    requests = matrix("fake", resolve_models([("mnist_mlp", {})]), ["fp32", "amp_bf16"], 3, ["default"])
    plan = UntilDecided(requests, budget_s, clock=lambda: now[0])
    records = {q.precision: _ran(q, 0.0, wall_s=RUN_S) for q in requests}  # built once: a record is slow to build

    def ran(batch):
        found, process = [], {}
        for q in batch:
            key = (q.precision, q.repeat) if q.shares_process is None else q.shares_process
            if key not in process:
                process[key] = rng.normal(0, NOISE)
                now[0] += START_S
            now[0] += RUN_S
            true_ms = 10.0 if q.precision == "fp32" else 10.0 / speed_up
            found.append({**records[q.precision], "repeat": q.repeat, "run_id": q.run_id, "process": str(key),
                          "auto_round": q.auto_round, "step_time_ms": {"median": true_ms * math.exp(process[key] + rng.normal(0, WITHIN))}})
        return found

    plan.add(ran(plan.first_round()))
    plan.start()
    while batch := plan.next_round():
        plan.add(ran(batch))
    return plan


def simulated_verdict(speed_up: float, seed: int, budget_s: float = DEFAULT_BUDGET_S) -> str:
    """simulated_run's verdict as its outcome line gives it ("faster", "slower", "same"), or "none"."""
    (line,) = simulated_run(speed_up, seed, budget_s).outcomes()
    found = re.search(r": decided after \d+ repeats(?: in \d+ processes)?(?: \(fp32 [^)]+\))?: (faster|slower|same), ",
                      line)
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


def test_a_comparison_undecided_at_its_last_look_stops_there_whatever_the_budget():
    plan = next(p for p in (simulated_run(1.0, seed, budget_s=100_000) for seed in range(20))
                if p._ratio(p.pairs()[0]).decision not in stats.DECIDED)
    (line,) = plan.outcomes()
    assert f"the sequential test's {stats.MAX_LOOKS} looks spent after " in line and "too noisy here to decide" in line
    assert max(len(plan._figures(c)) for c in plan.pairs()[0]) == stats.MIN_REPEATS + stats.MAX_LOOKS - 1
    assert not plan.next_round()


def test_the_sequential_test_replayed_from_the_records_is_the_one_the_runner_decided_with():
    """What the report shows (stats.sequential over the records' rounds and processes) is the interval that decided,
    or the last look, in runs that decide early, late and never."""
    kinds = set()
    for seed in range(60):
        plan = simulated_run(1.0 + 0.02 * (seed % 6), seed)
        (pair,) = plan.pairs()
        ran, replayed = plan._ratio(pair), stats.sequential(*(plan._repeats(c) for c in pair), comparisons=1)
        assert (replayed.estimate, replayed.low, replayed.high, replayed.look) == \
            (ran.estimate, ran.low, ran.high, ran.look)
        kinds.add((ran.decision, ran.look > 1))
    assert {("faster", True), ("none", True)} <= {(d if d in stats.DECIDED else "none", late) for d, late in kinds}


def test_a_resumed_run_keeps_the_decision_an_earlier_look_made():
    plan = simulated_run(1.1, 2)
    (pair,) = plan.pairs()
    decided = plan._ratio(pair)
    assert decided.decision == "faster" and decided.look > 1
    records = [r for cell in plan.records.values() for r in cell.values()]
    last = max(r["auto_round"] for r in records)
    # a later round (as for another precision compared with the same fp32) where amp_bf16 ran slower
    later = [{**plan.records[cell][0], "repeat": 100 + i, "auto_round": last + 1, "process": f"later {cell[2]} {i}",
              "step_time_ms": {"median": 10.0 if cell[2] == "fp32" else 14.0}} for cell in pair for i in range(2)]
    resumed = UntilDecided(list(plan.template.values()), DEFAULT_BUDGET_S, records + later)
    assert resumed._ratio(pair) == decided  # not the look all the records would give at once:
    assert stats.ratio(*(resumed._figures(c) for c in pair), look=decided.look + 1).decision != "faster"
    assert resumed.round == last + 2
