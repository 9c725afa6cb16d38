"""The capability probe (harness.run.capability): a precision is proved on the device by one step of the probe
network, not assumed; a probe that fails makes it `unsupported` in every command, with the framework's words.
The fake adapter's `nokernel` fault fails every step as a framework without the precision's kernels does."""
from __future__ import annotations

import json

import pytest

from harness import results
from harness.precision import PRECISIONS
from harness.run import capability, measure
from tests.core.test_exit_codes import SHORT, SPEC, amp

NO_KERNEL = "FakeError: no kernel for this dtype on this device"


def test_a_failing_probe_makes_the_run_unsupported_with_the_frameworks_words(tmp_path, machine_cache):
    out = amp("run", *SHORT, "--precision", "fp32,amp_bf16", "--out", str(tmp_path), faults="amp_bf16=nokernel")
    assert out.returncode == 0, out.stderr  # unsupported is a result, not a failure
    by = {r["precision"]: r for r in results.read_records([tmp_path])}
    assert by["fp32"]["status"] == "ok"
    assert by["amp_bf16"]["status"] == "unsupported"
    assert by["amp_bf16"]["reason"].startswith("its probe step failed on this device")
    assert by["amp_bf16"]["reason"].endswith(NO_KERNEL)  # the library's own line, not its C++ traceback
    cache = json.loads((machine_cache / "capabilities.json").read_text())
    assert sorted(json.loads(k)[-1] for k in cache) == ["amp_bf16", "fp32"]  # probed once each, and kept
    report = amp("report", str(tmp_path), "-o", str(tmp_path / "index.html"))
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "index.html").read_text()
    not_run = page[page.index('id="not-run-table"'):]
    assert "<td>amp_bf16</td>" in not_run and NO_KERNEL in not_run[:not_run.index("</table>")]


def test_the_probe_steps_through_a_token_network_too(tmp_path, machine_cache):
    """Token ids through an embedding and attention take kernels an image network never reaches (MXNet's amp_cast
    refused int64 ids only there): a precision whose token network fails is unsupported for every model."""
    out = amp("run", *SHORT, "--precision", "fp32", "--out", str(tmp_path),
              faults=f"{capability.TOKEN_PROBE['name']}=nokernel")
    assert out.returncode == 0, out.stderr
    [record] = results.read_records([tmp_path])
    assert record["status"] == "unsupported" and record["reason"].endswith(NO_KERNEL)


def test_the_probe_is_cached_per_machine(tmp_path):
    amp("run", *SHORT, "--precision", "amp_bf16", "--out", str(tmp_path / "a"), faults="amp_bf16=nokernel")
    # the same machine, the fault gone: the cache answers, the probe does not run again
    amp("run", *SHORT, "--precision", "amp_bf16", "--out", str(tmp_path / "b"))
    assert [r["status"] for r in results.read_records([tmp_path / "b"])] == ["unsupported"]


def test_the_key_holds_every_cpu_flag(monkeypatch):
    class Adapter:
        name = "fake"

        def framework_version(self):
            return "1"

    from harness.adapter import Device

    device, adapter = Device("cpu", "cpu", "test cpu"), Adapter()
    monkeypatch.setattr(measure.Path, "read_text", lambda self: "model name : X\nflags : sse2 avx2\n")
    before = capability.key(adapter, PRECISIONS["amp_bf16"], device)
    monkeypatch.setattr(measure.Path, "read_text", lambda self: "model name : X\nflags : sse2 avx2 vaes\n")
    assert capability.key(adapter, PRECISIONS["amp_bf16"], device) != before  # vaes is no flag "of interest"


def test_profile_and_fingerprint_runs_are_unsupported_too(tmp_path):
    for command, name in (("profile", results.PROFILES_FILE), ("fingerprint", results.FINGERPRINTS_FILE)):
        out = amp(command, "--framework", "fake", "--model", SPEC, "--steps", "2", "--no-progress", "--precision",
                  "amp_bf16", "--out", str(tmp_path / command), faults="amp_bf16=nokernel")
        assert out.returncode == 0, out.stderr
        (record,) = results.read_records([tmp_path / command], name)
        assert record["status"] == "unsupported" and record["reason"].endswith(NO_KERNEL), (command, record)


def test_a_run_failing_past_the_probe_is_failed_not_unsupported(tmp_path):
    """A kernel the probe's step did not cover (the fault comes at the second step): the run fails, with why."""
    out = amp("run", *SHORT, "--precision", "amp_bf16", "--out", str(tmp_path), faults="amp_bf16=raise")
    assert out.returncode == 1
    (record,) = results.read_records([tmp_path])
    assert record["status"] == "failed" and "simulated framework error" in record["reason"]


def test_a_bug_in_the_adapter_is_a_failure_and_is_not_cached(tmp_path, machine_cache):
    """A TypeError in the adapter's own code says nothing about the device: never `unsupported`, never kept."""
    amp("run", *SHORT, "--precision", "amp_bf16", "--out", str(tmp_path), faults="amp_bf16=bug")
    (record,) = results.read_records([tmp_path])
    assert record["status"] == "failed" and "TypeError: simulated bug" in record["reason"]
    cache = machine_cache / "capabilities.json"
    assert not cache.exists() or "amp_bf16" not in cache.read_text()


def test_the_adapters_listing_prints_what_the_probe_found():
    out = amp("adapters", faults="amp_bf16=nokernel", AMP_HARNESS_BLOCK_ADAPTERS="torch,tensorflow,mxnet,jax")
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert "fake 0.0-test" in out.stdout and "measured on this machine" in out.stdout
    assert lines["fp32"].split()[1] == "runs"
    assert lines["amp_bf16"].split()[1] == "unsupported:" and lines["amp_bf16"].endswith(NO_KERNEL)
    assert lines["tf32"].endswith("fake cannot do TF32")  # the adapter's own limit, known without a probe
    assert lines["fp8_hybrid:native"].split()[1] == "unsupported:"  # FP8's native variants are listed too


def test_the_conformance_kit_accepts_unsupported_only_where_the_probe_says_so(tmp_path):
    kit = ["conformance", "--framework", "fake", "--", "-q", "-k", "test_run_writes_complete_records"]
    # the probe says unsupported: accepted
    assert amp(*kit, faults="amp_bf16=nokernel", AMP_HARNESS_CACHE=str(tmp_path / "a")).returncode == 0
    # the probe says it runs (on another machine: a cache of its own), and the run fails: red
    failed = amp(*kit, faults="amp_bf16=raise", AMP_HARNESS_CACHE=str(tmp_path / "b"))
    assert failed.returncode == 1 and "amp_bf16" in failed.stdout


@pytest.mark.parametrize("flags, expected", [
    ("sse2 avx2 fma", "this CPU has no AVX-512: none of avx512f, avx512_bf16, amx_bf16 among its flags"),
    ("sse2 avx2 avx512f", "this CPU has AVX-512 but none of avx512_bf16, amx_bf16 among its flags"),
    ("sse2 avx2 avx512f avx512_bf16 amx_bf16", ""),
    ("fp asimd", ""),  # not x86: these flags mean nothing there
])
def test_the_cpu_evidence_names_what_the_flags_lack(monkeypatch, flags, expected):
    monkeypatch.setattr(measure.Path, "read_text", lambda self: f"model name : X\nflags : {flags}\n")
    assert capability.cpu_evidence(PRECISIONS["amp_bf16"]) == expected
    assert capability.cpu_evidence(PRECISIONS["fp32"]) == ""
