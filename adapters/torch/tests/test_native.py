"""Native specs in torch (`native: {torch: MODULE:ATTR}`): the user's own nn.Module, trained as it is in every
precision torch runs, from the same initial weights on the same batches; Hugging Face models built from small
configs with the `transformers` package; and the mistakes that stop the command in one line, exit 2."""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import native_models as M  # noqa: E402
from amp_harness_torch.native import NativeNetwork  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.run import native  # noqa: E402
from tests.native_runs import check_native, run_native  # noqa: E402

MODELS_FILE = Path(__file__).resolve().parent / "native_models.py"
ADAMW = {"type": "adamw", "learning_rate": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "weight_decay": 0.01}
VECTORS = {"name": "native_mlp", "native": {"torch": f"{MODELS_FILE}:MLP"}, "input": {"shape": [16]},
           "dataset": {"name": "synthetic", "num_classes": 4, "size": 128},
           "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True}, "optimizer": ADAMW,
           "batch_size": 8, "steps": 4, "seed": 7}
TOKENS = {**VECTORS, "name": "native_tokens", "input": {"shape": [16], "vocab": 64},
          "dataset": {"name": "synthetic_tokens", "task": "next_token", "size": 128}}
CLASSIFY_TOKENS = {**TOKENS, "dataset": {"name": "synthetic_tokens", "num_classes": 4, "size": 128}}
IMAGES = {**VECTORS, "input": {"shape": [3, 16, 16]}}  # channels first, as the module takes them

_run, _check = partial(run_native, "torch"), partial(check_native, "torch")


def _spec(base: dict, target: str) -> dict:
    return {**base, "name": f"native_{target}", "native": {"torch": f"{MODELS_FILE}:{target}"}}


def test_a_native_module_trains_in_each_precision_from_the_same_weights_and_batches():
    trained = {p: _run(VECTORS, p) for p in ("fp32", "amp_bf16", "amp_fp16", "bf16", "bf16_sr", "fp8_hybrid")}
    assert all(r["status"] == "ok" for r in trained.values()), {p: r["reason"] for p, r in trained.items()}
    digests = {r["options"]["native"]["initial_weights"] for r in trained.values()}
    assert len(digests) == 1, digests  # every precision starts from the same weights
    assert {r["param_count"] for r in trained.values()} == {16 * 32 + 32 + 2 * 32 + 32 * 4 + 4}
    first = trained["fp32"]["loss"][0]
    for precision, record in trained.items():  # the same first batch through the same weights
        assert abs(record["loss"][0] - first) < 0.02, (precision, record["loss"][0], first)
    assert trained["amp_fp16"]["options"]["loss_scaler"] == "GradScaler"
    # FP8: both Linear layers converted, and their casts rounded the first loss (float32 alone agrees to 1e-6)
    assert trained["fp8_hybrid"]["options"]["native"]["fp8"] == {"converted": 2, "not_converted": []}
    assert abs(trained["fp8_hybrid"]["loss"][0] - first) > 1e-4
    half = trained["bf16"]["state_memory_mb"]["weights"]
    assert half == pytest.approx(trained["fp32"]["state_memory_mb"]["weights"] / 2)


def test_hugging_face_models_and_torch_s_transformer_build_with_the_outputs_their_specs_need(tmp_path):
    pytest.importorskip("transformers")
    for base, target in ((TOKENS, "gpt2"), (TOKENS, "llama"), (TOKENS, "encoder"), (CLASSIFY_TOKENS, "bert"),
                         (IMAGES, "vit"), (IMAGES, "mobilenet_v2")):
        answer = _check(_spec(base, target), tmp_path)
        assert "error" not in answer, (target, answer)
        assert answer["output"][0] == 2 and answer["params"] > 0
    record = _run(_spec(TOKENS, "gpt2"), "amp_bf16")  # a ModelOutput's logits, trained under autocast
    assert record["status"] == "ok", record["reason"]
    assert record["options"]["native"]["modules"] > 10


def test_fp8_names_the_matmuls_it_did_not_convert_in_the_record():
    """nn.MultiheadAttention multiplies its weights inside F.multi_head_attention_forward: its in_proj is not a
    module FP8 converts, and its out_proj, a Linear, never runs its forward; both are named, the rest trains in FP8
    (the two feed-forward Linear layers of each encoder layer and the head)."""
    record = _run({**_spec(TOKENS, "encoder"), "steps": 1}, "fp8_hybrid:delayed:4")
    assert record["status"] == "ok", record["reason"]
    fp8 = record["options"]["native"]["fp8"]
    assert fp8["converted"] == 5, fp8
    assert fp8["not_converted"] == [
        f"encoder.layers.{i}.{name}" for i in (0, 1) for name in (
            "self_attn (MultiheadAttention: its projections run inside F.multi_head_attention_forward)",
            "self_attn.out_proj (NonDynamicallyQuantizableLinear: converted, but its forward never ran in the first "
            "training step: other code multiplies its weights)")]


def test_fp8_keeps_the_module_s_weights_names_and_digest_and_its_casts_record_amax():
    """The casts' amax histories are buffers of the network's own, neither persistent nor trained: the model's
    state, parameter names and initial-weights digest are fp32's; a training forward fills the histories."""
    from harness.precision import parse_precision

    torch.manual_seed(0)
    plain = NativeNetwork(M.MLP())
    torch.manual_seed(0)
    net = NativeNetwork(M.MLP(), parse_precision("fp8_hybrid:delayed:4").fp8)
    assert net.info.digest == plain.info.digest and net.info.trainable == plain.info.trainable
    assert list(net.canonical_weights()) == list(plain.canonical_weights()) == list(plain.model.state_dict())
    assert set(net.canonical_parameters()) == set(plain.canonical_parameters())
    assert net.model.body[0].weight is net.canonical_parameters()["body.0.weight"]
    net.train()(torch.randn(8, 16)).sum().backward()
    assert all(casts.input[0] > 0 and casts.weight[0] > 0 for casts in net.fp8_casts)  # this step's amax
    assert net.info.fp8.ran == {"body.0", "body.3"} and net.info.fp8.counted


def test_adamw_decays_kernels_and_not_biases_norm_scales_or_embeddings():
    kinds = NativeNetwork(M.encoder()).weight_kinds
    assert kinds["embed.weight"] == "embeddings"
    assert kinds["head.weight"] == "kernel" and kinds["head.bias"] == "bias"
    assert kinds["encoder.layers.0.norm1.weight"] == "gamma"
    assert kinds["encoder.layers.0.self_attn.in_proj_bias"] == "bias"


@pytest.mark.parametrize("target, problem", [
    ("raises", "calling raises() failed: RuntimeError: no weights here"),
    ("not_a_module", "not_a_module() returned a int, not an nn.Module"),
    ("missing", "has no attribute missing"),
])
def test_a_model_that_cannot_be_made_is_named_in_one_line(target, problem, tmp_path):
    answer = _check(_spec(VECTORS, target), tmp_path)
    assert problem in answer["error"] and answer["error"].startswith(f"native_{target}: ")
    assert "\n" not in answer["error"]


def test_a_module_that_does_not_import_is_named(tmp_path):
    spec = {**VECTORS, "native": {"torch": "no_such_package.models:build"}}
    assert "importing no_such_package.models failed: ModuleNotFoundError" in _check(spec, tmp_path)["error"]


def test_an_output_that_does_not_fit_the_loss_stops_the_command_with_exit_2(tmp_path, capsys):
    spec = {**VECTORS, "dataset": {"name": "synthetic", "num_classes": 3, "size": 128}}
    path = tmp_path / "wrong.yaml"
    path.write_text(json.dumps(spec))
    assert main(["run", "--framework", "torch", "--model", str(path), "--precision", "fp32", "--repeats", "1",
                 "--no-progress", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "its output for 2 samples is [2, 4]; sparse_categorical_crossentropy on synthetic needs [2, 3]" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "results.jsonl").exists()  # before any run


def test_diagnose_names_each_module_by_its_own_name():
    record = _run(VECTORS, "fp32", mode="diagnose", every=2)
    assert record["status"] == "ok", record["reason"]
    diagnosis = record["diagnosis"]
    assert diagnosis["layer_types"] == {"body": "Sequential", "body.0": "Linear", "body.1": "LayerNorm",
                                        "body.2": "GELU", "body.3": "Linear"}
    assert {"body.0", "body.3"} <= set(diagnosis["groups"]["gradients"])  # by the weights' modules
    assert {"body.0", "body.1", "body.2", "body.3"} <= set(diagnosis["groups"]["activations"])
    assert diagnosis["verdicts"]["amp_bf16"]


def test_a_native_model_that_overflows_float16_gets_the_module_of_its_first_inf():
    spec = _spec(VECTORS, "overflows")
    record = _run(spec, "amp_fp16", nonfinite=True)
    found = record["nonfinite"]
    assert found["found"] and (found["layer"], found["layer_type"]) == ("1", "Exp"), found
    assert (found["pass"], found["tensor"], found["values"], found["step"]) == ("forward", "output", "inf", 0)
    assert found["input_range"] is None  # a module's input is its parent's business: not claimed


def test_the_profile_gives_each_module_its_time_and_the_dtype_it_computed_in():
    record = _run({**VECTORS, "steps": 2}, "amp_bf16", warmup=2, mode="profile")
    assert record["status"] == "ok", record["reason"]
    layers = {layer["path"]: layer for layer in record["profile"]["layers"]}
    assert layers["body.0"]["label"] == "body.0 Linear"
    assert (layers["body.0"]["compute"], layers["body.1"]["compute"]) == ("bfloat16", "float32")  # autocast's lists
    assert record["profile"]["coverage"] > 0.5


def test_compare_translates_what_import_can_say_and_gives_the_importer_s_reason_for_the_rest(tmp_path):
    from harness.model.spec import load_spec, validate
    from harness.run.compare import translate

    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(VECTORS))
    translated, why = translate(load_spec(str(path)), sys.executable, tmp_path)
    assert why == "" and translated == tmp_path / "native_mlp_imported.yaml"
    spec = load_spec(str(translated))  # the native spec's data, loss and optimizer around the imported layers
    assert [layer.type for layer in spec.layers] == ["dense", "layernorm", "gelu", "dense"]
    given = validate(VECTORS, "x")
    assert (spec.dataset, spec.loss, spec.batch_size) == (given.dataset, given.loss, 8)
    assert spec.optimizer.epsilon == 1e-7 and spec.optimizer.weight_decay == 0.01
    path.write_text(json.dumps(_spec(IMAGES, "vit")))
    translated, why = translate(load_spec(str(path)), sys.executable, tmp_path)
    assert translated is None and "concatenates the learned tensor 'vit.embeddings.cls_token'" in why, why
