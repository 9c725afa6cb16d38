"""Native specs (`native:`, the user's own model object) on the core's side, with no framework: the syntax, what
the plan refuses before any worker starts (another framework, a command that takes no native model), `check`
where the model's adapter is not installed, and the rules the core owns (the output's shape, AdamW's kinds)."""
from __future__ import annotations

import pytest
import yaml

from harness.cli import main
from harness.errors import SpecError
from harness.model import native
from harness.model.optimizer import weight_decay
from harness.model.spec import load_spec, validate
from harness.run import compare
from tests.core.test_plan import fake  # noqa: F401  (the fake adapter, in this process and its workers)

SPEC = {"name": "hf_gpt2", "native": {"torch": "my_models:gpt2"}, "input": {"shape": [64], "vocab": 256},
        "dataset": {"name": "synthetic_tokens"},
        "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
        "optimizer": {"type": "adamw", "learning_rate": 1e-3, "weight_decay": 0.01},
        "batch_size": 16, "steps": 20}  # the issue's own example (#43): specs outside the repository look like it


def _file(tmp_path, data, name="native.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_issue_s_syntax_is_a_spec_that_names_its_framework():
    spec = validate(SPEC, "hf_gpt2.yaml")
    assert (spec.native.kind, spec.native.target, spec.native.framework) == ("torch", "my_models:gpt2", "torch")
    assert spec.layers is None and spec.sample_shape == (64,) and spec.dataset.next_token
    # what the optimizer leaves out is its framework's default: torch.optim.AdamW's here, Keras' for a Keras model
    assert (spec.optimizer.beta_1, spec.optimizer.beta_2, spec.optimizer.epsilon) == (0.9, 0.999, 1e-8)
    assert validate({**SPEC, "native": {"keras": "m.keras"}}, "x").optimizer.epsilon == 1e-7
    with pytest.raises(SpecError, match="optimizer.beta_1: Field required"):  # a spec's layers say everything
        validate({**SPEC, "native": None, "layers": [{"type": "dense", "units": 4}]}, "x")
    assert validate({**SPEC, "native": {"torch": "path/to/models.py:Net"}}, "x").native.target.endswith(":Net")


@pytest.mark.parametrize("change, problem", [
    ({"layers": [{"type": "dense", "units": 4}]}, "give the network as `layers` or as `native`"),
    ({"native": None}, "give the network as `layers` or as `native`"),
    ({"native": {"torch": "a:b", "keras": "m.keras"}}, "native: give one of torch, keras, got torch, keras"),
    ({"native": {"torch": "no_colon"}}, "native.torch: "),
    ({"native": {"keras": "model.h5"}}, "is neither a .keras file nor a callable"),
    ({"width": 2.0}, "width: a native model's widths are its own"),
])
def test_a_wrong_native_section_is_one_line_naming_the_place(change, problem):
    explicit = {"type": "adamw", "learning_rate": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8,
                "weight_decay": 0.01}
    data = {key: value for key, value in {**SPEC, "optimizer": explicit, **change}.items() if value is not None}
    with pytest.raises(SpecError, match="^hf_gpt2.yaml: ") as raised:
        validate(data, "hf_gpt2.yaml")
    assert problem in str(raised.value) and "\n" not in str(raised.value)


def test_a_saved_keras_model_is_found_beside_the_spec_file(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    path = _file(folder, {**SPEC, "native": {"keras": "mobilenet.keras"}})
    assert load_spec(str(path)).native.keras == str(folder / "mobilenet.keras")


def test_torch_images_come_channels_first_and_the_data_gives_them_channels_last():
    spec = validate({**SPEC, "input": {"shape": [3, 32, 24]}, "dataset": {"name": "synthetic", "num_classes": 10}},
                    "x")
    assert spec.sample_shape == (32, 24, 3)
    assert spec.with_overrides(input_size=(16, 8)).input.shape == [3, 16, 8]


def test_every_earlier_spec_keeps_its_hash():
    assert load_spec("mnist_mlp").spec_hash() == validate(yaml.safe_load(open("models/mnist_mlp.yaml")),
                                                          "x").spec_hash()
    assert "native" not in load_spec("mnist_mlp").model_dump(exclude_none=True)


def test_the_output_must_fit_the_loss_and_dataset():
    spec = validate(SPEC, "x")
    assert native.output_problem(spec, (2, 64, 256)) is None
    assert native.output_problem(spec, (2, 256)) == (
        "its output for 2 samples is [2, 256]; sparse_categorical_crossentropy on synthetic_tokens needs "
        "[2, 64, 256] (logits over the vocabulary (256) at every position)")
    binary = validate({**SPEC, "input": {"shape": [8]}, "dataset": {"name": "synthetic", "num_classes": 2},
                       "loss": {"type": "binary_crossentropy", "from_logits": True}}, "x")
    assert native.expected_output(binary, 5) == (5, 1)


def test_adamw_exempts_a_native_model_s_biases_norm_scales_and_embeddings_by_their_kind():
    spec = validate(SPEC, "x")
    kinds = {name: native.weight_kind(name, ndim, embedding) for name, ndim, embedding in [
        ("h.0.attn.c_attn.weight", 2, False), ("h.0.attn.c_attn.bias", 1, False), ("h.0.ln_1.weight", 1, False),
        ("wte.weight", 2, True), ("conv.weight", 4, False)]}
    assert kinds == {"h.0.attn.c_attn.weight": "kernel", "h.0.attn.c_attn.bias": "bias", "h.0.ln_1.weight": "gamma",
                     "wte.weight": "embeddings", "conv.weight": "kernel"}
    decays = {name: weight_decay(spec.optimizer, name, kind) for name, kind in kinds.items()}
    assert decays == {"h.0.attn.c_attn.weight": 0.01, "h.0.attn.c_attn.bias": 0.0, "h.0.ln_1.weight": 0.0,
                      "wte.weight": 0.01, "conv.weight": 0.01}


def test_another_framework_is_refused_before_any_worker_naming_import(fake, tmp_path, capsys):
    path = _file(tmp_path, SPEC)
    assert main(["run", "--framework", "fake", "--model", str(path), "--no-progress", "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "a native torch model runs in the torch adapter, not fake; `amp-harness import torch my_models:gpt2" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_command_that_takes_no_native_model_says_so(fake, tmp_path, capsys):
    path = _file(tmp_path, SPEC)
    assert main(["fingerprint", "--framework", "fake", "--model", str(path), "--no-progress", "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "fingerprint does not take native models (run, diagnose, diagnose --nonfinite, profile," in err


def test_check_without_the_model_s_framework_validates_the_spec_and_says_what_it_cannot_count(tmp_path, capsys,
                                                                                               monkeypatch):
    from harness import adapter

    monkeypatch.setattr(adapter, "discover", lambda: {})
    path = _file(tmp_path, SPEC)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: ok  hf_gpt2" in out and "native torch model my_models:gpt2" in out
    assert "the torch adapter is not installed here: its parameters are counted where it is" in out


def test_compare_runs_the_model_in_its_framework_and_its_translation_where_import_gives_one(tmp_path, monkeypatch,
                                                                                              capsys):
    path = _file(tmp_path, SPEC)
    model, envs = load_spec(str(path)), {"torch": "/envs/torch/python", "jax": "/envs/jax/python"}
    translated = tmp_path / "hf_gpt2_imported.yaml"
    monkeypatch.setattr(compare, "translate", lambda model, python, out: (translated, ""))
    assert compare.native_jobs(model, str(path), envs, tmp_path) == [
        compare.Job("torch", "/envs/torch/python", str(path)),
        compare.Job("torch", "/envs/torch/python", str(translated)),
        compare.Job("jax", "/envs/jax/python", str(translated))]
    monkeypatch.setattr(compare, "translate", lambda model, python, out: (None, "module class GPT2Model: not mapped"))
    assert compare.native_jobs(model, str(path), envs, tmp_path) == [compare.Job("torch", "/envs/torch/python",
                                                                                 str(path))]
    assert ("compare: the model runs in torch only (not in jax): `amp-harness import torch` cannot translate it: "
            "module class GPT2Model: not mapped") in capsys.readouterr().out
    assert main(["compare", str(path), "--frameworks", "fake", "--python", "fake=python3", "--out",
                 str(tmp_path / "out")]) == 2
    assert "a native torch model runs in torch, and no torch environment was found (`tox -e torch`)" in \
        capsys.readouterr().err


def test_export_which_writes_a_spec_s_layers_refuses_a_native_model_in_one_line(tmp_path, capsys):
    path = _file(tmp_path, SPEC)
    assert main(["export", str(path), "--framework", "torch", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("native: a torch model's own code has no spec layers, which this command needs; "
                        "`amp-harness import torch my_models:gpt2 ...` translates it to a spec")
    assert len(err.splitlines()) == 1


def test_fp8_on_a_native_model_is_refused_by_the_adapter_s_capabilities_naming_import():
    """Whether a native model trains in FP8 is the adapter's data (Capabilities.no_fp8_for_native_models): an adapter
    that says nothing (the fake) is refused with the reason, one that converts its matmuls is not; other precisions
    are never refused here."""
    from dataclasses import replace

    from harness.precision import parse_precision
    from harness.run.native import refusal
    from tests.core.test_plan import FakeAdapter

    adapter = FakeAdapter()
    reason = refusal(adapter, parse_precision("fp8_hybrid:delayed:16"))
    assert reason == ("fake does not convert a native model's matmuls to FP8 (Capabilities.no_fp8_for_native_models); "
                      "translate the model to a spec with `amp-harness import` to train it in FP8")
    assert refusal(adapter, parse_precision("amp_bf16")) is None
    adapter.capabilities = replace(adapter.capabilities, no_fp8_for_native_models=None)
    assert refusal(adapter, parse_precision("fp8_e4m3")) is None
