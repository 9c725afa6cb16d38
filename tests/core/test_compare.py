"""`amp-harness compare SPEC`: one command from a spec to the report, through every framework environment it
finds (here: the fake adapter's, an interpreter given by --python), within a budget."""
from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

import pytest

from harness import results
from harness.errors import HarnessError
from harness.run import compare
from tests.core.test_runner import FAKE_SITE, ROOT, amp


def fake_env(tmp_path: Path) -> Path:
    """An interpreter whose environment has the fake adapter installed (as a tox env has its framework's)."""
    python = tmp_path / "fake-env" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{FAKE_SITE}{os.pathsep}{ROOT}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def test_compare_runs_diagnoses_profiles_and_reports_in_each_environment(tmp_path):
    out = tmp_path / "answer"
    done = amp("compare", "tests/specs/pitfall_rmsprop_epsilon.yaml", "--frameworks", "fake", "--python",
               f"fake={fake_env(tmp_path)}", "--precision", "fp32,amp_bf16,tf32", "--steps", "4", "--budget", "30",
               "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = results.read_records([out])
    assert {r["precision"] for r in runs} == {"fp32", "amp_bf16", "tf32"}
    assert {r["status"] for r in runs if r["precision"] == "tf32"} == {"unsupported"}  # a CPU: said, with why
    assert sum(r["precision"] == "fp32" for r in runs) >= 3  # --repeats auto: at least the minimum repeats
    assert results.read_records([out], results.DIAGNOSES_FILE), "diagnose did not run"
    assert results.read_records([out], results.PROFILES_FILE), "profile did not run"
    assert (out / "index.html").exists() and f"the answer: {out / 'index.html'}" in done.stdout
    assert "compare: fake (" in done.stdout and "s of the budget; --repeats auto within" in done.stdout


def test_a_framework_without_an_environment_or_a_bad_budget_is_one_line(tmp_path):
    done = amp("compare", "mnist_mlp", "--frameworks", "nosuch", "--out", str(tmp_path))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--frameworks: no environment for nosuch" in done.stderr
    done = amp("compare", "mnist_mlp", "--budget", "5", "--out", str(tmp_path))
    assert done.returncode == 2 and "'5' is not a budget from 10 s to a day" in done.stderr, done.stderr


@pytest.mark.parametrize("text, seconds", [("600", 600), ("90s", 90), ("10m", 600), ("1.5h", 5400)])
def test_budgets_read_with_units(text, seconds):
    assert compare.budget(text) == seconds


def test_environments_prefer_given_interpreters_over_tox_envs(tmp_path, monkeypatch):
    tox = tmp_path / ".tox"
    (tox / "torch" / "bin").mkdir(parents=True)
    (tox / "torch" / "bin" / "python").touch()
    monkeypatch.setattr(compare, "TOX_DIR", tox)
    monkeypatch.setattr(compare, "discover", lambda: {})
    assert compare.environments({}) == {"torch": str(tox / "torch" / "bin" / "python")}
    assert compare.environments({"torch": "/opt/t/python", "jax": "/opt/j/python"}, ["jax"]) == \
        {"jax": "/opt/j/python"}
    monkeypatch.setattr(compare, "TOX_DIR", tmp_path / "none")
    with pytest.raises(HarnessError, match="no framework environment found"):
        compare.environments({})
    with pytest.raises(argparse.ArgumentTypeError):
        compare.budget("ten minutes")
