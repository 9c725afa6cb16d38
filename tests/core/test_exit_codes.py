"""The exit-code table of docs/commands.md ("Exit codes"), row by row: each row names the scenarios that must end
with its code, and each scenario below runs the real command line."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.core.test_interruptions import start, wait_for_records
from tests.core.test_runner import FAKE_SITE

SPEC = "tests/specs/pitfall_rmsprop_epsilon.yaml"
SHORT = ["--framework", "fake", "--model", SPEC, "--steps", "3", "--warmup", "0", "--repeats", "1", "--no-progress"]


def amp(*args, faults="", **env):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_SITE), str(ROOT)]), AMP_FAKE_FAULTS=faults, **env)
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


def _statuses(out) -> list[str]:
    from harness import results

    return [r["status"] for r in results.read_records([out])]


def run_ok(tmp):
    out = amp("run", *SHORT, "--precision", "fp32,amp_bf16", "--out", str(tmp))
    assert _statuses(tmp) == ["ok", "ok"]
    return out


def run_unsupported(tmp):
    out = amp("run", *SHORT, "--precision", "tf32", "--out", str(tmp))  # the fake adapter cannot do TF32
    assert _statuses(tmp) == ["unsupported"]
    return out


def run_diverged(tmp):
    out = amp("run", *SHORT, "--precision", "fp32", "--steps", "5", "--out", str(tmp), faults="fp32=nan")  # NaN at step 4
    assert _statuses(tmp) == ["diverged"]
    return out


def run_failed(tmp):
    out = amp("run", *SHORT, "--precision", "fp32,amp_bf16", "--out", str(tmp), faults="amp_bf16=raise")
    assert sorted(_statuses(tmp)) == ["failed", "ok"]
    assert "1 of 2 runs failed or timed out" in out.stderr and "--resume" in out.stderr
    return out


def run_timeout(tmp):
    out = amp("run", *SHORT, "--precision", "fp32", "--timeout", "3", "--out", str(tmp), faults="fp32=hang")
    assert _statuses(tmp) == ["timeout"]
    return out


def run_interrupted(tmp):
    proc = start(tmp)
    wait_for_records(tmp, 1)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode)


def run_bad_option(tmp):
    return amp("run", *SHORT, "--timeout", "-1", "--out", str(tmp))


def run_too_large(tmp):
    """The memory guard, before any worker: resnet8 at its batch needs about 94 MiB, the limit says 1."""
    out = amp("run", "--framework", "fake", "--model", "resnet8", "--out", str(tmp), AMP_HARNESS_MEMORY_LIMIT_MB="1")
    assert "resnet8: fp32 needs about 94.4 MiB for a training step at batch 64 and the dataset in memory" in out.stderr
    assert "more than AMP_HARNESS_MEMORY_LIMIT_MB (1.0 MiB)" in out.stderr and not tmp.joinpath("results.jsonl").exists()
    forced = amp("run", *SHORT, "--precision", "fp32", "--force", "--out", str(tmp), AMP_HARNESS_MEMORY_LIMIT_MB="0.01")
    assert forced.returncode == 0 and _statuses(tmp) == ["ok"], forced.stderr  # --force: past the guard
    return out


def check_ok(tmp):
    return amp("check", SPEC, "models/resnet8.yaml")


def check_bad_spec(tmp):
    (tmp / "bad.yaml").write_text("name: x\n")
    return amp("check", str(tmp / "bad.yaml"))


def report_ok(tmp):
    run_ok(tmp)
    return amp("report", str(tmp), "-o", str(tmp / "report" / "index.html"))


def report_bad_file(tmp):
    (tmp / "results.jsonl").write_text("this is not JSON\n{}\n")
    return amp("report", str(tmp), "-o", str(tmp / "report" / "index.html"))


def _fingerprints(tmp, precision):
    for framework in ("fake", "fake_skipping"):  # the skipping adapter differs only where the loss is scaled
        done = amp("fingerprint", "--framework", framework, "--model", SPEC, "--precision", precision, "--steps", "4",
                   "--out", str(tmp / framework))
        assert done.returncode == 0, done.stderr
    return amp("parity", str(tmp / "fake"), str(tmp / "fake_skipping"))


def parity_ok(tmp):
    return _fingerprints(tmp, "fp32")


def parity_mismatch(tmp):
    return _fingerprints(tmp, "amp_fp16")


def _table() -> list[tuple[int, str]]:
    text = (ROOT / "docs" / "commands.md").read_text()
    section = text[text.index("## Exit codes"):]
    rows = re.findall(r"^\| (\d+) \|[^|]*\| ([^|]+) \|$", section, re.M)
    return [(int(code), scenario.strip()) for code, scenarios in rows for scenario in scenarios.split(",")]


def test_every_row_of_the_table_has_scenarios():
    codes = {code for code, _ in _table()}
    assert codes == {0, 1, 2, 130}
    assert all(scenario.replace("-", "_") in globals() for _, scenario in _table())


@pytest.mark.parametrize("code, scenario", _table(), ids=[s for _, s in _table()])
def test_exit_code(code, scenario, tmp_path):
    out = globals()[scenario.replace("-", "_")](tmp_path)
    assert out.returncode == code, getattr(out, "stderr", "")
