"""The tests are hermetic: no test, and no command tox runs, reads or writes the user's ~/.cache/amp-harness or
what an earlier test or run left behind (.ci/run also fails if the whole suite wrote the cache under its home)."""
from __future__ import annotations

import configparser
import os
from pathlib import Path

from harness.run.cache import cache_file
from tests.conftest import ROOT
from tests.core.test_runner import amp


def test_a_test_has_a_cache_of_its_own(machine_cache, tmp_path):
    assert cache_file("capabilities").parent == machine_cache
    assert Path.home() / ".cache" not in machine_cache.parents


def test_the_commands_the_tests_run_write_only_the_test_s_cache(machine_cache, tmp_path, monkeypatch):
    """A fingerprint (its worker probes the precision's capability) with a home of the test's own: the probe's
    answer lands in the test's cache, and nothing in the home."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    out = amp("fingerprint", "--framework", "fake", "--model", "mnist_mlp", "--steps", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (machine_cache / "capabilities.json").exists()
    assert not (home / ".cache" / "amp-harness").exists(), list(home.rglob("*"))


def test_every_tox_test_env_has_a_cache_of_its_own_emptied_at_each_run():
    """tox empties an env's temporary folder at the start of every run: there the env's commands (the kit, the
    fingerprints) keep the machine facts they share, never in the user's cache."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    setenv = dict(line.split(" = ", 1) for line in tox["testenv"]["setenv"].splitlines() if " = " in line)
    assert setenv["AMP_HARNESS_CACHE"].startswith("{envtmpdir}"), setenv
    for name in tox.sections():
        if name.startswith("testenv:") and not name.startswith("testenv:compare") and "setenv" in tox[name]:
            assert "{[testenv]setenv}" in tox[name]["setenv"], f"{name} sets its own environment without the cache"
    assert os.environ["AMP_HARNESS_CACHE"] != str(Path.home() / ".cache" / "amp-harness")
