"""`--variant auto` (the default): the fastest variant for the run, measured once per machine, cached, recorded."""
from __future__ import annotations

import json

import pytest

from harness import results
from harness.run.variants import TIMED_STEPS, WARMUP_STEPS
from tests.core.test_runner import amp

SPEC = "tests/specs/pitfall_batchnorm.yaml"
SHORT = ["--framework", "fake", "--model", SPEC, "--steps", "3", "--warmup", "1", "--repeats", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def two_variants(monkeypatch):
    """The fake adapter with a first variant, "slowed", slower than its second, "plain"."""
    monkeypatch.setenv("AMP_FAKE_VARIANTS", "1")


def test_auto_runs_the_fastest_variant_measured_once_and_the_record_says_why(tmp_path, machine_cache):
    out = amp("run", *SHORT, "--precision", "fp32,tf32", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    fp32, tf32 = results.read_records([tmp_path])
    assert fp32["variant"] == "plain" and fp32["run_id"].startswith("fake-pitfall_batchnorm-fp32-auto-r0-")
    choice = fp32["variant_choice"]
    assert choice["chosen"] == "plain" and choice["cached"] is False and choice["failed"] is None
    assert set(choice["ms_per_step"]) == {"slowed", "plain"}
    assert choice["ms_per_step"]["slowed"] > choice["ms_per_step"]["plain"]
    assert choice["how"].startswith(f"measured once on this machine: {WARMUP_STEPS} warm-up and {TIMED_STEPS} timed "
                                    f"training steps")
    assert tf32["status"] == "unsupported" and tf32["variant"] == "auto" and tf32["variant_choice"] is None
    assert len(json.loads((machine_cache / "variants.json").read_text())) == 1  # nothing measured for tf32

    again = amp("run", *SHORT, "--precision", "fp32", "--steps", "7", "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    (second,) = results.read_records([tmp_path / "again"])  # another run length measures nothing again
    assert second["variant"] == "plain"
    assert second["variant_choice"] == {**choice, "cached": True, "measure_s": 0.0}
    assert choice["measure_s"] > 0  # the first run measured: the seconds it spent

    resumed = amp("run", *SHORT, "--precision", "fp32,tf32", "--out", str(tmp_path), "--resume")
    assert "resume: 2 of 2 runs already recorded" in resumed.stderr  # a chosen variant was asked for as auto


def test_a_named_variant_is_forced_and_untimed_modes_take_the_first(tmp_path, machine_cache):
    out = amp("run", *SHORT, "--variant", "slowed", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    (forced,) = results.read_records([tmp_path])
    assert forced["variant"] == "slowed" and forced["variant_choice"] is None
    out = amp("fingerprint", "--framework", "fake", "--model", SPEC, "--steps", "2", "--out", str(tmp_path / "fp"))
    assert out.returncode == 0, out.stderr
    (fingerprint,) = results.read_records([tmp_path / "fp"], results.FINGERPRINTS_FILE)
    assert fingerprint["variant"] == "slowed" and fingerprint["variant_choice"] is None
    assert not (machine_cache / "variants.json").exists()


def test_when_every_variant_fails_the_first_runs_and_the_record_says_so(tmp_path):
    out = amp("run", *SHORT, "--out", str(tmp_path), faults="fp32=raise")
    (record,) = results.read_records([tmp_path])
    assert record["status"] == "failed" and record["variant"] == "slowed"
    choice = record["variant_choice"]
    assert choice["ms_per_step"] == {"slowed": None, "plain": None}
    assert choice["failed"]["plain"].startswith("failed: RuntimeError: simulated framework error")
    assert choice["how"].endswith("every variant failed, so the adapter's first")
    assert out.returncode == 1


@pytest.mark.parametrize("variant, message", [
    ("auto,plain", "--variant auto: fake has the variants slowed (sleeps 0.02 s in every step), plain (no sleep) "
                   "and auto (the fastest here), which goes alone"),
    ("fast", "--variant fast: fake has the variants slowed (sleeps 0.02 s in every step), plain (no sleep); or "
             "auto (the fastest here)"),
])
def test_a_variant_it_cannot_run_is_one_line_and_exit_2(variant, message):
    out = amp("run", *SHORT, "--variant", variant)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
