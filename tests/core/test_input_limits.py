"""No input can hurt the machine: every numeric option (and what a matrix file or spec sets in its place) is
refused past its bound in under a second with exit 2 and one line, before any process starts; large specs are
refused for their size in bounded time; an output that cannot be written is found before the first run; and the
memory guards hold a run to the GPU's free memory, not its total."""
from __future__ import annotations

import contextlib
import importlib
import io
import subprocess
import time
from importlib.metadata import EntryPoint

import pytest
import yaml

from harness import adapter
from harness.cli import main
from harness.limits import MAX_MODELS, usable_cpus
from harness.model import memory
from tests.conftest import ROOT

for _module in ("harness.model.data", "harness.run.matrix", "harness.run.runner"):
    importlib.import_module(_module)  # here, so that no case below pays for its first import in its time

SPEC = str(ROOT / "tests" / "specs" / "pitfall_rmsprop_epsilon.yaml")  # dense layers, 256 synthetic samples
FAKE = EntryPoint("fake", "tests.fake_adapter.fake_adapter:FakeAdapter", adapter.ENTRY_POINT_GROUP)


@pytest.fixture
def no_process(monkeypatch):
    """The fake adapter, found without an installed entry point, and a record of every process started (each
    refused): a bad input must be refused before any worker, probe or nvidia-smi runs."""
    started = []

    def refuse(args, *rest, **kw):
        started.append(args)
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(adapter, "discover", lambda: {"fake": FAKE})
    monkeypatch.setenv("AMP_HARNESS_MEMORY_LIMIT_MB", "4096")
    return started


def _cli(*args) -> tuple[int, list[str], float]:
    """(exit code, stderr's lines, seconds) of the command line, in this process; argparse's exit included."""
    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue().strip().splitlines(), time.perf_counter() - start


def _matrix(tmp_path, **fields) -> str:
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump({"models": [{"model": SPEC}], "precisions": ["fp32"], **fields}))
    return str(path)


RUN = ["run", "--framework", "fake", "--model", SPEC]
BIG = 10**12
# (name, arguments, what the one line says): every numeric option of harness/cli.py's parsers, at a value that
# would take the machine (threads, memory, disk, time), and the matrix file's and spec's own numbers
HUNGRY = [
    ("threads", RUN + ["--threads", 100_000], "more than 4,096 threads"),
    ("threads-here", RUN + ["--threads", usable_cpus() + 1], "CPUs (os.sched_getaffinity)"),
    ("steps", RUN + ["--steps", BIG], "more than 500,000 steps"),
    ("warmup", RUN + ["--warmup", BIG], "more than 500,000 warm-up steps"),
    ("repeats", RUN + ["--repeats", BIG], "more than 1,000 repeats"),
    ("repeats-times-models", ["run", "--framework", "fake", "--model", ",".join([SPEC] * 200), "--repeats", 1000,
                              "--precision", "fp32,amp_bf16"], "400,000 runs"),
    ("models", ["run", "--framework", "fake", "--model", ",".join([SPEC] * (MAX_MODELS + 1))],
     f"{MAX_MODELS + 1} models: more than {MAX_MODELS}"),
    ("batch-size", RUN + ["--batch-size", BIG], f"batch_size {BIG} exceeds the"),
    ("input-size", ["run", "--framework", "fake", "--model", "resnet8", "--input-size", "100000x100000"],
     "needs about"),
    ("timeout", RUN + ["--timeout", 1e12], "more than 604,800 seconds"),
    ("budget", RUN + ["--repeats", "auto", "--budget", 1e12], "more than 604,800 seconds"),
    ("growth-interval", RUN + ["--growth-interval", BIG], "more than 2,147,483,647 steps"),
    ("loss-scale", RUN + ["--precision", "amp_fp16", "--loss-scale", "2^100000"], "--loss-scale '2^100000'"),
    ("retries", RUN + ["--executor", "ray", "--retries", BIG], "from 0 to 10"),
    ("fingerprint-steps", ["fingerprint", "--framework", "fake", "--model", SPEC, "--steps", BIG], "500,000 steps"),
    ("diagnose-every", ["diagnose", "--framework", "fake", "--model", SPEC, "--every", BIG], "500,000 steps"),
    ("profile-steps", ["profile", "--framework", "fake", "--model", SPEC, "--steps", BIG], "500,000 steps"),
    ("study-repeats", ["study", "loss-scale", "--framework", "fake", "--model", SPEC, "--precision", "amp_fp16",
                       "--scales", "none", "--repeats", BIG], "more than 1,000 repeats"),
    ("study-warmup", ["study", "loss-scale", "--framework", "fake", "--model", SPEC, "--precision", "amp_fp16",
                      "--scales", "none", "--warmup", BIG], "500,000 warm-up steps"),
    ("study-scales", ["study", "loss-scale", "--framework", "fake", "--model", SPEC, "--precision", "amp_fp16",
                      "--scales", "none,2^100000"], "--loss-scale '2^100000'"),
    ("matrix-repeats", lambda tmp: ["run", "--framework", "fake", "--matrix", _matrix(tmp, repeats=BIG)],
     "repeats"),
    ("matrix-steps", lambda tmp: ["run", "--framework", "fake", "--matrix", _matrix(tmp, steps=BIG)],
     "steps: Input should be less than or equal to 500000"),
    ("matrix-warmup", lambda tmp: ["run", "--framework", "fake", "--matrix", _matrix(tmp, warmup=BIG)],
     "warmup: Input should be less than or equal to 500000"),
    ("matrix-budget", lambda tmp: ["run", "--framework", "fake", "--matrix", _matrix(tmp, repeats="auto", budget=1e12)],
     "budget: Input should be less than or equal to 604800"),
    ("matrix-models", lambda tmp: ["run", "--framework", "fake", "--matrix", _matrix(
        tmp, models=[{"model": SPEC}] * (MAX_MODELS + 1))], f"models: List should have at most {MAX_MODELS} items"),
    ("spec-steps", lambda tmp: RUN[:-1] + [_spec(tmp, steps=BIG)], "steps: Input should be less than or equal"),
]


def _spec(tmp_path, **fields) -> str:
    path = tmp_path / "hungry.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(open(SPEC)), **fields}))
    return str(path)


@pytest.mark.parametrize("name, args, expected", HUNGRY, ids=[h[0] for h in HUNGRY])
def test_resource_hungry_values_are_refused_in_under_a_second_before_any_process(no_process, tmp_path, name,
                                                                                  args, expected):
    code, err, seconds = _cli(*(args(tmp_path) if callable(args) else args), "--out", tmp_path / "out")
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert seconds < 1.0, f"{name}: {seconds:.2f} s"
    assert no_process == [] and not (tmp_path / "out").exists()


def test_threads_are_at_most_the_cpus_this_process_may_use(no_process, monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # `taskset -c 0`, a container
    code, err, seconds = _cli(*RUN, "--threads", 2)
    assert code == 2 and err == ["amp-harness: error: --threads 2: this process may use 1 CPU "
                                 "(os.sched_getaffinity); more threads only contend, and too many exhaust the "
                                 "machine"], err
    assert seconds < 1.0 and no_process == []


# ---- the output, proven writable before the first run -------------------------------------------------------
@pytest.mark.parametrize("command", [
    RUN, ["fingerprint", "--framework", "fake", "--model", SPEC], ["diagnose", "--framework", "fake", "--model", SPEC],
    ["profile", "--framework", "fake", "--model", SPEC],
    ["study", "loss-scale", "--framework", "fake", "--model", SPEC, "--precision", "amp_fp16", "--scales", "none"],
], ids=["run", "fingerprint", "diagnose", "profile", "study"])
def test_an_output_directory_that_cannot_be_written_is_refused_before_any_run(no_process, tmp_path, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err, _ = _cli(*command, "--out", blocker / "out")  # a file where a directory should be: even root fails
    assert code == 2 and len(err) == 1 and f"{blocker}/out/" in err[0] and "cannot write there: Not a directory; " \
        "give --out a place this user can write" in err[0], err
    assert no_process == []


def test_an_existing_records_file_that_cannot_be_appended_to_is_refused_before_any_run(no_process, tmp_path):
    (tmp_path / "out" / "results.jsonl").mkdir(parents=True)  # a directory where the records file should be
    code, err, _ = _cli(*RUN, "--out", tmp_path / "out")
    assert code == 2 and "results.jsonl: cannot write there" in err[0] and no_process == [], err


def test_a_report_output_that_cannot_be_written_is_refused_before_reading(no_process, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err, _ = _cli("report", tmp_path / "no-such-results", "-o", blocker / "index.html")
    assert code == 2 and len(err) == 1 and "is a file, not a directory; give -o" in err[0], err


# ---- large specs, in bounded time ----------------------------------------------------------------------------
def _layers(n: int) -> str:
    spec = yaml.safe_load(open(SPEC))
    head = yaml.safe_dump({k: v for k, v in spec.items() if k != "layers"})
    return head + "layers:\n- {type: dense, units: 3}\n" + "- type: relu\n" * n


def test_a_spec_of_60000_layers_is_refused_for_its_size_in_bounded_time(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text(_layers(60_000))
    assert path.stat().st_size < 1 << 20  # under the byte limit: the size of the document is what refuses it
    start = time.perf_counter()
    code = main(["check", str(path)])
    seconds = time.perf_counter() - start
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "more than 100000 values" in line and "too large for a spec" in line, line
    assert "alias" not in line  # it has none
    assert seconds < 5.0, seconds


def test_a_large_spec_under_the_limit_is_checked_in_bounded_time(tmp_path, capsys):
    path = tmp_path / "wide.yaml"
    path.write_text(_layers(10_000))
    start = time.perf_counter()
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    assert time.perf_counter() - start < 5.0


# ---- memory: the GPU's free memory ---------------------------------------------------------------------------
def _nvidia_smi(monkeypatch, rows: str, visible: str | None = None) -> list:
    asked = []

    def smi(args, **kw):
        asked.append(args)
        return subprocess.CompletedProcess(args, 0, rows, "")

    monkeypatch.setattr(memory.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(memory.subprocess, "run", smi)
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return asked


def test_the_guard_holds_a_run_to_the_gpus_free_memory_not_its_total(monkeypatch):
    from harness.model.graph import infer
    from harness.model.spec import load_spec
    from harness.precision import parse_precision

    asked = _nvidia_smi(monkeypatch, "0, GPU-aaaa, 40\n1, GPU-bbbb, 140000\n")
    assert memory.available_mb("auto") == (40.0, "the GPU's free memory (nvidia-smi)")
    assert "memory.free" in asked[0][1] and "memory.total" not in asked[0][1]
    spec = load_spec("resnet8")  # about 94 MiB a step: more than the 40 MiB another process left free
    with pytest.raises(adapter.HarnessError, match=r"needs about 9\d\.\d MiB .* more than the GPU's free memory"):
        memory.check_fits(spec, infer(spec), [parse_precision("fp32")], "auto", "resnet8")
    _nvidia_smi(monkeypatch, "0, GPU-aaaa, 40\n1, GPU-bbbb, 140000\n", visible="GPU-bbbb")
    assert memory.available_mb("gpu")[0] == 140000  # only the GPUs this process may use
    _nvidia_smi(monkeypatch, "0, GPU-aaaa, 40\n", visible="")
    assert memory.available_mb("auto")[1] == "the host's available memory"  # none visible: the run takes the CPU


def test_the_worker_holds_a_gpu_run_to_the_free_memory_its_framework_reports(monkeypatch):
    from harness.run import worker
    from tests.fake_adapter.fake_adapter import FakeAdapter

    class SmallGPU(FakeAdapter):
        def device(self, requested):
            return adapter.Device("cuda:0", "gpu", "a GPU another process fills")

        def free_memory_mb(self, device):
            return 1e-4  # 0.1 KiB: less than a step of the smallest spec needs

    monkeypatch.setattr(worker, "load_adapter", lambda name: SmallGPU())
    from harness.run.plan import resolve

    request = dict(framework="fake", model=SPEC, spec=resolve(SPEC, steps=2)[0].model_dump(mode="json"),
                   precision="fp32", run_id="r", warmup=0, measure_peak=False)
    record = worker.run(worker.RunRequest(**request))
    assert record["status"] == "failed" and "more than cuda:0's free memory (fake) (0.1 KiB)" in record["reason"]
    forced = worker.run(worker.RunRequest(**request, force=True))  # --force: past this guard too
    assert "free memory" not in (forced["reason"] or ""), forced["reason"]


# ---- YAML: a key given twice --------------------------------------------------------------------------------
def test_a_matrix_file_with_a_key_given_twice_is_refused_naming_the_key_and_both_lines(no_process, tmp_path):
    path = tmp_path / "matrix.yaml"
    path.write_text(f"models: [{{model: {SPEC}}}]\nprecisions: [fp32]\nrepeats: 3\nprecisions: [amp_fp16]\n")
    code, err, _ = _cli("run", "--framework", "fake", "--matrix", path, "--out", tmp_path / "out")
    assert code == 2 and len(err) == 1, err
    assert f"{path}: line 4: key 'precisions' appears twice, at lines 2 and 4" in err[0]


def test_a_merge_key_may_override_what_it_merges(tmp_path):
    """`<<: *base` then `units:` is YAML's way to override on purpose, not a duplicate."""
    from harness.model.spec import load_spec

    spec = yaml.safe_load(open(SPEC))
    spec["layers"] = "LAYERS"
    path = tmp_path / "merged.yaml"
    path.write_text(yaml.safe_dump(spec).replace("LAYERS", "[&d {type: dense, units: 7}, {<<: *d, units: 3}]"))
    assert [getattr(layer, "units", None) for layer in load_spec(str(path)).layers] == [7, 3]
