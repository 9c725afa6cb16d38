"""One table of modes (harness.run.modes): the worker runs the Work a request names, the runner shares processes
as the Work says, the planner takes each command's defaults and matrix-file rules from its Mode; none of them
tells modes apart otherwise."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import get_args

import pytest

from harness import adapter
from harness.cli import build_parser, plan_request
from harness.errors import HarnessError
from harness.run import modes, runner, worker
from harness.run.matrix import MatrixModel
from harness.run.plan import matrix, plan, resolve, resolve_models
from harness.run.request import RunRequest
from tests.conftest import ROOT, SPECS
from tests.core.test_runner import FAKE_SITE
from tests.fake_adapter.fake_adapter import FakeAdapter

SPEC = str(SPECS / "pitfall_dropout_adam.yaml")  # seed 6


@pytest.fixture
def fake(monkeypatch):
    """The fake adapter in this process (the plan, the worker's run here) and in the workers (PYTHONPATH)."""
    monkeypatch.setattr(adapter, "discover", lambda: {"fake": None})
    monkeypatch.setattr(adapter, "load_adapter", lambda name: FakeAdapter())
    monkeypatch.setattr(worker, "load_adapter", lambda name: FakeAdapter())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SITE), str(ROOT)]))
    monkeypatch.setenv("AMP_FAKE_FAULTS", "")


def _request(mode: str, repeat: int = 2) -> RunRequest:
    return RunRequest(framework="fake", model=SPEC, spec=resolve(SPEC, steps=2)[0].model_dump(mode="json"),
                      precision="fp32", run_id="r", repeat=repeat, warmup=0, mode=mode, measure_peak=False)


def _noted(built) -> None:
    """A Work of the test's own: says what the worker built for it."""
    built.record.update(status="ok", reason=f"seed {built.seed}, variant {built.variant}, trainer "
                                            f"{type(built.trainer).__name__}")


def test_the_worker_runs_the_work_its_request_names_with_the_seed_the_work_asks_for(fake, monkeypatch):
    monkeypatch.setitem(modes.WORKS, "noted", modes.Work("noted", _noted, timed=False))
    monkeypatch.setitem(modes.WORKS, "noted_repeats", modes.Work("noted_repeats", _noted, timed=True,
                                                                 seed_per_repeat=True))
    untimed, timed = worker.run(_request("noted")), worker.run(_request("noted_repeats"))
    assert (untimed["status"], untimed["reason"]) == ("ok", "seed 6, variant default, trainer FakeTrainer")
    assert (timed["status"], timed["reason"]) == ("ok", "seed 8, variant default, trainer FakeTrainer")  # 6 + 2


def test_a_works_refusal_makes_the_run_unsupported_before_its_trainer_is_built(fake, monkeypatch):
    built = []
    refused = modes.Work("refused", built.append, timed=True, refusal=lambda adapter, device: f"no {device.kind}")
    monkeypatch.setitem(modes.WORKS, "refused", refused)
    record = worker.run(_request("refused"))
    assert (record["status"], record["reason"], built) == ("unsupported", "no cpu", [])


def test_a_request_of_no_mode_is_a_failed_record_naming_the_modes(fake):
    record = worker.run(_request("nosuch"))
    assert (record["status"], record["reason"]) == (
        "failed", "no mode 'nosuch' (the modes: run, fingerprint, diagnose, profile)")


def test_the_runner_shares_a_process_among_the_runs_of_an_untimed_work(monkeypatch):
    monkeypatch.setitem(modes.WORKS, "shared", replace(modes.WORKS["fingerprint"], name="shared"))
    monkeypatch.setitem(modes.WORKS, "alone", replace(modes.WORKS["fingerprint"], name="alone", timed=True))
    models = resolve_models([("mnist_mlp", {})])
    shared = matrix("fake", models, ["fp32"], 3, ["default"], mode="shared")
    alone = matrix("fake", models, ["fp32"], 3, ["default"], mode="alone")
    assert [len(b) for b in runner._batches(shared)] == [3]
    assert [len(b) for b in runner._batches(alone)] == [1, 1, 1]


def test_every_mode_that_takes_a_matrix_file_names_a_command_of_its_models():
    (literal,) = get_args(MatrixModel.model_fields["commands"].annotation)
    assert {mode.matrix for mode in modes.MODES.values() if mode.matrix} == set(get_args(literal))
    assert {mode.work.name for mode in modes.MODES.values()} == set(modes.WORKS)


def _planned(tmp_path, mode: modes.Mode, *argv: str):
    """The plan of the command line that asks for `mode` (its words, then `argv`)."""
    args = build_parser().parse_args([*mode.command.split(), *argv, "--framework", "fake",
                                      "--out", str(tmp_path / "out")])
    return plan(plan_request(args, mode))


def test_each_mode_plans_its_work_defaults_and_filename(fake, tmp_path):
    expected = {  # mode: (work, precisions, warmup, repeats, RunRequest.nonfinite, study id)
        modes.RUN: ("run", ["fp32"] * 3, 5, 3, False, None),
        modes.FINGERPRINT: ("fingerprint", ["fp32"], 0, 1, False, None),
        modes.DIAGNOSE: ("diagnose", ["fp32"], 0, 1, False, None),
        modes.NONFINITE: ("run", ["amp_fp16", "fp16"], 0, 1, True, None),
        modes.PROFILE: ("profile", ["fp32", "amp_fp16", "amp_bf16"], 5, 1, False, None),
        modes.STUDY_LOSS_SCALE: ("run", ["amp_fp16"] * 3, 5, 3, False, "loss-scale-"),
        modes.STUDY_SCALING: ("run", ["fp32", "amp_bf16", "fp32", "amp_bf16"] * 3, 5, 3, False, "scaling-"),
    }
    options = {modes.STUDY_LOSS_SCALE: ["--scales", "dynamic", "--precision", "amp_fp16"],
               modes.STUDY_SCALING: ["--batch-sizes", "4,8", "--precision", "amp_bf16,fp32"]}
    assert set(expected) == set(modes.MODES.values())
    for mode, (work, precisions, warmup, repeats, nonfinite, study) in expected.items():
        planned = _planned(tmp_path, mode, "--model", SPEC, *options.get(mode, []))
        qs = planned.requests
        assert [q.precision for q in qs] == precisions, mode.command
        assert {(q.mode, q.warmup, q.nonfinite) for q in qs} == {(work, warmup, nonfinite)}, mode.command
        assert max(q.repeat for q in qs) + 1 == repeats, mode.command
        assert planned.filename == mode.filename and planned.out == tmp_path / "out", mode.command
        assert (planned.study or "").startswith(study or "") and bool(planned.study) == bool(study), mode.command
        assert {q.study for q in qs} == {planned.study}, mode.command


def test_diagnose_nonfinite_takes_no_matrix_file(fake, tmp_path):
    matrix_file = tmp_path / "m.yaml"
    matrix_file.write_text(f"precisions: [fp16]\nmodels:\n  - {{model: {SPEC}}}\n")
    with pytest.raises(HarnessError, match="^--matrix: diagnose --nonfinite takes its models from --model$"):
        _planned(tmp_path, modes.NONFINITE, "--matrix", str(matrix_file))
