"""The run pipeline: harness.run.plan resolves each spec once, with its overrides, into the requests; after the
plan nothing reads the spec file again (the worker, a failure record, --resume, an executor's task on a node);
both executors are an Executor."""
from __future__ import annotations

import os
import shutil
import sys
import types

import pytest

from harness import adapter
from harness.cli import build_parser, plan_request
from harness.errors import HarnessError, SpecError
from harness.run.executors import Executor, LocalExecutor
from harness.run.executors.ray_cluster import RayExecutor, _run_batch
from harness.run.modes import DIAGNOSE, FINGERPRINT, RUN
from harness.run.plan import plan, resolve
from harness.run.process import failure_record
from harness.run.runner import execute
from tests.conftest import ROOT, SPECS
from tests.core.test_runner import FAKE_SITE
from tests.fake_adapter.fake_adapter import FakeAdapter


@pytest.fixture
def fake(monkeypatch):
    """The fake adapter in this process (for the plan) and in the workers (PYTHONPATH)."""
    monkeypatch.setattr(adapter, "discover", lambda: {"fake": None})
    monkeypatch.setattr(adapter, "load_adapter", lambda name: FakeAdapter())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_SITE), str(ROOT)]))
    monkeypatch.setenv("AMP_FAKE_FAULTS", "")


def _spec_file(tmp_path):
    path = tmp_path / "mlp.yaml"
    shutil.copy(SPECS / "pitfall_rmsprop_epsilon.yaml", path)
    return path


def _plan(tmp_path, *options):
    args = build_parser().parse_args(["run", "--framework", "fake", "--precision", "fp32", "--repeats", "1",
                                      "--warmup", "0", "--out", str(tmp_path / "out"), "--no-progress", *options])
    return plan(plan_request(args, RUN))


def test_the_spec_is_resolved_once_in_the_plan_and_never_read_again(fake, tmp_path):
    path = _spec_file(tmp_path)
    planned = _plan(tmp_path, "--model", str(path), "--batch-size", "8", "--steps", "3")
    expected = resolve(str(path), batch_size=8, steps=3)[0]
    (request,) = planned.requests
    assert request.model == str(path) and request.spec == expected.model_dump(mode="json")
    path.unlink()  # from here on, nothing may need the file
    assert failure_record(request, "failed", "lost", 0.0)["spec_hash"] == expected.spec_hash()
    (record,) = execute(planned, 60, False).records
    assert record["status"] == "ok", record["reason"]
    assert (record["spec_hash"], record["batch_size"], record["steps"]) == (expected.spec_hash(), 8, 3)
    planned.resume = True  # --resume knows the run is done from the request's spec alone
    assert execute(planned, 60, False).runs == 0


def test_a_matrix_files_overrides_travel_in_the_requests_spec(fake, tmp_path):
    path = _spec_file(tmp_path)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(f"precisions: [fp32]\nrepeats: 1\nwarmup: 0\nsteps: 4\n"
                      f"models:\n  - {{model: {path}, batch_size: 16}}\n  - {{model: {path}, steps: 2}}\n")
    args = build_parser().parse_args(["run", "--framework", "fake", "--matrix", str(matrix), "--out",
                                      str(tmp_path / "out")])
    requests = plan(plan_request(args, RUN)).requests
    base = resolve(str(path))[0]
    assert [(q.spec["batch_size"], q.spec["steps"]) for q in requests] == [(16, 4), (base.batch_size, 2)]


def test_a_shape_the_overrides_break_is_refused_in_the_plan_naming_the_spec(fake, tmp_path):
    with pytest.raises(SpecError, match=r"^small_convnet: layers.*does not fit"):
        _plan(tmp_path, "--model", "small_convnet", "--input-size", "16x16")


def test_both_executors_are_executors():
    assert isinstance(LocalExecutor(), Executor)
    assert isinstance(RayExecutor(address=None, python=sys.executable, pack=False, retries=0), Executor)


def test_a_ray_task_runs_its_batch_from_the_requests_alone(fake, tmp_path, monkeypatch):
    """The Ray task on a node that has no copy of the spec file: the request's resolved spec is all it needs.
    (A stand-in for Ray's runtime context here; the real cluster: tests/cluster.)"""
    from dataclasses import asdict

    context = types.SimpleNamespace(get_node_id=lambda: "0" * 40)
    ray = types.SimpleNamespace(get_runtime_context=lambda: context, get_gpu_ids=lambda: [],
                                util=types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1"))
    monkeypatch.setitem(sys.modules, "ray", ray)
    path = _spec_file(tmp_path)
    planned = _plan(tmp_path, "--model", str(path), "--steps", "2")
    path.unlink()
    out = _run_batch([asdict(q) for q in planned.requests], sys.executable, 60)
    (record,) = out["records"]
    assert record["status"] == "ok", record["reason"]
    assert record["spec_hash"] == planned.requests[0].resolved_spec().spec_hash()


def test_a_matrix_file_gives_fingerprint_each_model_s_precisions_loss_scales_and_variants(fake, tmp_path,
                                                                                          monkeypatch):
    """What tox's identity proof (tests/identity.yaml) rests on: one fingerprint command runs each entry's own
    precisions, its loss scales on the scaled precisions only, its variants; diagnose takes sizes, not arms."""
    monkeypatch.setattr(FakeAdapter, "variants", {"slowed": "first", "plain": "second"}, raising=False)
    spec = _spec_file(tmp_path)
    matrix = tmp_path / "identity.yaml"
    matrix.write_text("precisions: [fp64, fp32]\nmodels:\n"
                      f"  - {{model: mnist_mlp, batch_size: 8, precisions: [fp32, amp_fp16, bf16_sr],"
                      f" loss_scales: ['dynamic:1024']}}\n"
                      f"  - {{model: {spec}, batch_size: 4, variants: [all], commands: [fingerprint]}}\n"
                      f"  - {{model: underflow_mlp, batch_size: 4, commands: [diagnose]}}\n")

    def requests(*argv):
        args = build_parser().parse_args([*argv, "--framework", "fake", "--matrix", str(matrix),
                                          "--out", str(tmp_path / "out")])
        return plan(plan_request(args, FINGERPRINT if argv[0] == "fingerprint" else DIAGNOSE))

    got = {(q.model, q.precision, q.variant, q.loss_scale, q.resolved_spec().batch_size, q.resolved_spec().steps)
           for q in requests("fingerprint").requests}
    assert got == {("mnist_mlp", "fp32", "slowed", None, 8, 20), ("mnist_mlp", "amp_fp16", "slowed", "dynamic:1024", 8, 20),
                   ("mnist_mlp", "bf16_sr", "slowed", None, 8, 20),
                   *((str(spec), p, v, None, 4, 20) for p in ("fp64", "fp32") for v in ("slowed", "plain"))}
    diagnosed = {(q.model, q.precision, q.variant, q.resolved_spec().steps)
                 for q in requests("diagnose", "--steps", "3").requests}
    assert diagnosed == {("mnist_mlp", "fp32", "slowed", 3), ("underflow_mlp", "fp32", "slowed", 3)}
    matrix.write_text(matrix.read_text().replace("precisions: [fp64, fp32]", "precisions: [fp64, fp32]\nsteps: 5"))
    with pytest.raises(HarnessError, match="--steps: the matrix file .* sets this"):
        requests("diagnose", "--steps", "3")
    matrix.write_text(matrix.read_text().replace("variants: [all]", "variants: [nosuch]"))
    with pytest.raises(HarnessError, match=r"identity.yaml: .*mlp.yaml: variants nosuch: fake has the variants"):
        requests("fingerprint")
