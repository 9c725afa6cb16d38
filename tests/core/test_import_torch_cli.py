"""`amp-harness import torch MODULE:ATTR --input-shape ...` from the core's side: the CLI hands the target to the torch
adapter's importer (Adapter.import_model) and writes what it returns; without the adapter, or with an adapter that
has no importer, it is one line and exit 2. No framework is imported here (the torch env's
adapters/torch/tests/test_import_torch.py tests the importer itself)."""
from __future__ import annotations

import pytest
import yaml

import harness.adapter
from harness.adapter import BLOCK_ENV, Adapter
from harness.cli import main
from harness.model.importers import Imported, ImportOptions, ImportProblems

SPEC = {
    "name": "Net", "input": {"shape": [8]}, "dataset": {"name": "synthetic", "num_classes": 2},
    "layers": [{"type": "dense", "units": 2}],
    "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
    "optimizer": {"type": "adam", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8},
    "batch_size": 32, "steps": 100, "seed": 0,
}


class NoImporter(Adapter):
    name = "torch"

    def framework_version(self):
        return "0"

    def device(self, requested):
        raise NotImplementedError

    def set_threads(self, threads):
        pass

    def build(self, *args):
        raise NotImplementedError


class Importer(NoImporter):
    calls: list = []

    def import_model(self, target, input_shape, options):
        self.calls.append((target, input_shape, options))
        if target.endswith(":Broken"):
            raise ImportProblems([f"{target}: module '0' (SiLU): not in the spec",
                                  f"{target}: forward calls torch.cat"])
        return Imported(dict(SPEC), ["a note"], {"0": "fc"})


def _run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    code = main(["import", "torch", *argv])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def test_without_the_torch_adapter_it_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setenv(BLOCK_ENV, "torch")  # as in the core env, where adapters/torch is not installed
    code, out, err = _run(capsys, "net.py:Net", "--input-shape", "3,32,32")
    assert code == 2 and not out and len(err) == 1, err
    assert err[0].startswith("amp-harness: error: no adapter for framework 'torch' is installed"), err


def test_an_adapter_without_an_importer_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(harness.adapter, "load_adapter", lambda name: NoImporter())
    code, out, err = _run(capsys, "net.py:Net", "--input-shape", "8")
    assert code == 2 and not out and len(err) == 1, err
    assert "the torch adapter has no importer (Adapter.import_model)" in err[0], err


def test_the_adapter_gets_the_target_shape_and_options_and_the_spec_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(harness.adapter, "load_adapter", lambda name: Importer())
    Importer.calls.clear()
    code, out, err = _run(capsys, "pkg.mod:Net", "--input-shape", "3,32,32", "--dataset", "digits",
                          "--batch-size", "8", "--steps", "5")
    assert code == 0 and err == ["amp-harness: note: a note"], err
    assert yaml.safe_load(out) == SPEC
    assert Importer.calls == [("pkg.mod:Net", (3, 32, 32), ImportOptions("digits", 8, 5))]
    code, out, _ = _run(capsys, "pkg.mod:Net", "--input-shape", "8", "-o", str(tmp_path / "net.yaml"))
    assert code == 0 and "wrote" in out and yaml.safe_load((tmp_path / "net.yaml").read_text()) == SPEC
    assert Importer.calls[-1][1:] == ((8,), ImportOptions())


def test_each_problem_is_a_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(harness.adapter, "load_adapter", lambda name: Importer())
    code, out, err = _run(capsys, "net.py:Broken", "--input-shape", "8")
    assert code == 2 and not out
    assert err == ["amp-harness: error: net.py:Broken: module '0' (SiLU): not in the spec",
                   "amp-harness: error: net.py:Broken: forward calls torch.cat"]


@pytest.mark.parametrize("shape", ["3,0,4", "a,b", "1,2,3,4", ""])
def test_a_bad_input_shape_is_a_usage_error(capsys, monkeypatch, shape):
    monkeypatch.setattr(harness.adapter, "load_adapter", lambda name: pytest.fail("loaded before parsing"))
    with pytest.raises(SystemExit) as exc:
        main(["import", "torch", "net.py:Net", "--input-shape", shape])
    assert exc.value.code == 2
    assert "give 1 to 3 positive sizes without the batch axis" in capsys.readouterr().err


def test_the_input_shape_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["import", "torch", "net.py:Net"])
    assert exc.value.code == 2 and "--input-shape" in capsys.readouterr().err
