"""The specs that `tox` fingerprints in every framework (tests/identity.yaml) cover the whole spec language, so that
parity proves identity for every layer, activation, loss and optimizer a user can write."""
from __future__ import annotations

import configparser

from harness.model.graph import infer
from harness.model.spec import LAYER_TYPES, load_spec
from harness.run.matrix import load_matrix
from tests.conftest import ROOT

IDENTITY = ROOT / "tests" / "identity.yaml"


def test_tox_fingerprints_and_diagnoses_the_identity_matrix_in_every_framework_env():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    lines = tox["framework"]["commands"].splitlines()
    for command in ("fingerprint", "diagnose"):
        assert any(line.startswith(f"amp-harness {command} ") and "--matrix tests/identity.yaml" in line
                   for line in lines), f"tox's framework envs run no `amp-harness {command} --matrix {IDENTITY}`"
    envs = [name for name in tox.sections() if tox.has_option(name, "commands")
            and "{[framework]commands}" in tox[name]["commands"]]
    assert {"testenv:torch", "testenv:tensorflow", "testenv:mxnet", "testenv:jax"} <= set(envs), envs


def entries(command: str) -> list:
    """The identity matrix's models that `amp-harness COMMAND --matrix` takes."""
    return [m for m in load_matrix(str(IDENTITY)).models if command in m.commands]


def spec_of(model: str):
    return load_spec(str(ROOT / model) if model.endswith(".yaml") else model)


def test_every_variant_is_fingerprinted_in_fp64_and_fp32_on_every_kind_of_layer():
    matrix = load_matrix(str(IDENTITY))
    in_every_variant = [m for m in entries("fingerprint") if m.variants == ["all"]]
    assert all({"fp64", "fp32"} <= set(m.precisions or matrix.precisions) for m in in_every_variant)
    found = set().union(*(features(spec_of(m.model)) for m in in_every_variant))
    assert {"dense", "conv2d", "batchnorm", "residual", "dropout", "attention", "embedding"} <= found, found


def fingerprinted_specs() -> list:
    return [spec_of(m.model) for m in entries("fingerprint")]


def test_every_built_in_model_and_pitfall_spec_is_fingerprinted_and_diagnosed():
    everything = {path.stem for path in (ROOT / "models").glob("*.yaml")} | {
        f"tests/specs/{path.name}" for path in (ROOT / "tests" / "specs").glob("pitfall_*.yaml")}
    for command in ("fingerprint", "diagnose"):
        missing = everything - {m.model for m in entries(command)}
        assert not missing, f"{command}: {sorted(missing)}"


def features(spec) -> set[str]:
    graph = infer(spec)
    found = {info.type for info in graph.layers}
    for info in graph.layers:
        layer = info.spec
        if info.type == "gelu":
            found.add(f"gelu approximate={layer.approximate}")
        if info.type in ("batchnorm", "layernorm"):
            found.add(f"{info.type} on {'images' if len(info.in_shape) == 3 else 'vectors'}")
        if info.type == "residual":
            if layer.projection:
                found.add("residual with projection")
            if info.path.count("."):
                found.add("nested residual")
        if info.type in ("maxpool2d", "avgpool2d", "conv2d"):
            found.add(f"{info.type} {layer.padding}")
        if info.type == "dropout" and layer.rate > 0:
            found.add(f"dropout with {spec.optimizer.type}")
            if layer.per_sample:
                found.add("dropout per sample")
        if info.type == "conv2d":
            if layer.groups > 1:
                found.add("conv2d depthwise" if layer.groups == info.in_shape[-1] == layer.filters else "conv2d grouped")
            if layer.dilation > 1:
                found.add("conv2d dilated")
            if layer.kernel_size % 2 == 0 and layer.padding == "same":
                found.add("conv2d same, even kernel")
        if info.type == "zero_pad2d" and len(set(layer.pads)) > 1:
            found.add("zero_pad2d asymmetric")
        if info.type in ("add", "multiply") and len(set(info.in_shapes)) > 1:
            found.add(f"{info.type} broadcasting")
            if len({len(shape) for shape in info.in_shapes}) > 1:
                found.add(f"{info.type} broadcasting across ranks")
        if info.type.startswith("global_") and layer.keepdims:
            found.add("global pool keepdims")
        if info.type == "rescaling" and isinstance(layer.scale, list):
            found.add("rescaling per channel")
        if info.type == "concat" and len(info.in_shapes) > 2:
            found.add("concat of three")
        if info.type == "attention":
            if layer.key_heads < layer.heads:
                found.add("attention multi-query" if layer.key_heads == 1 else "attention grouped heads")
            if layer.rotary:
                found.add(f"attention rotary {layer.rotary.pairing}")
        if getattr(layer, "input", None) is not None:
            found.add("named input")
    found.add(f"{spec.loss.type} from_logits={spec.loss.from_logits}")
    o = spec.optimizer
    found.add({"sgd": lambda: f"sgd momentum={o.momentum > 0} nesterov={o.nesterov}",
               "adam": lambda: "adam",
               "adamw": lambda: f"adamw no_decay={','.join(o.no_decay)}",
               "rmsprop": lambda: f"rmsprop epsilon {o.epsilon_placement}"}[o.type]())
    if o.clip_norm is not None:
        found.add("clip_norm")
    if o.schedule is not None:
        found.add(f"schedule {o.schedule.type}")
    return found


REQUIRED = {
    *LAYER_TYPES,
    "gelu approximate=True", "gelu approximate=False",
    "batchnorm on images", "batchnorm on vectors", "layernorm on images", "layernorm on vectors",
    "residual with projection", "nested residual",
    "conv2d same", "conv2d valid", "conv2d depthwise", "conv2d grouped", "conv2d dilated", "conv2d same, even kernel",
    "zero_pad2d asymmetric", "multiply broadcasting", "multiply broadcasting across ranks", "global pool keepdims",
    "rescaling per channel", "dropout per sample", "concat of three", "named input",
    "attention grouped heads", "attention multi-query", "attention rotary half", "attention rotary interleaved",
    "maxpool2d same", "maxpool2d valid", "avgpool2d same", "avgpool2d valid",
    "dropout with adam",
    "sparse_categorical_crossentropy from_logits=True", "sparse_categorical_crossentropy from_logits=False",
    "binary_crossentropy from_logits=True", "binary_crossentropy from_logits=False",
    "sgd momentum=False nesterov=False", "sgd momentum=True nesterov=False", "sgd momentum=True nesterov=True",
    "adam", "rmsprop epsilon inside", "rmsprop epsilon outside",
    "adamw no_decay=biases,norm_scales", "adamw no_decay=biases", "clip_norm", "schedule constant",
    "schedule warmup_cosine",
}


def test_the_fingerprinted_specs_cover_the_spec_language():
    specs = fingerprinted_specs()
    covered = set().union(*(features(s) for s in specs))
    assert not REQUIRED - covered, f"not fingerprinted by tox in any spec: {sorted(REQUIRED - covered)}"
    with_dropout = [s.name for s in specs if any(i.type == "dropout" and i.spec.rate > 0 for i in infer(s).layers)]
    assert len(with_dropout) >= 2, with_dropout


def test_hyper_parameters_are_not_float32_exact():
    """A float32-rounded constant in one adapter shows only where float32 cannot hold the value exactly."""
    import numpy as np

    for spec in fingerprinted_specs():
        values = [v for k, v in spec.optimizer.model_dump().items() if isinstance(v, float) and v not in (0.0,)]
        inexact = [v for v in values if float(np.float32(v)) != v]
        assert inexact, f"{spec.name}: every optimizer hyper-parameter is exact in float32: {values}"


def test_every_precision_is_fingerprinted_on_every_kind_of_layer_it_computes_differently():
    """fp64 on every spec (the identity proof); fp32 and each mixed precision on specs that hold every layer type
    between them; every other precision the matrix names on at least one spec."""
    matrix = load_matrix(str(IDENTITY))
    arms = [(spec_of(m.model), set(m.precisions or matrix.precisions)) for m in entries("fingerprint")]
    assert {s.name for s, p in arms if "fp64" in p} == {s.name for s, _ in arms}
    for precision in ("fp32", "amp_bf16", "amp_fp16"):
        covered = set().union(*(features(s) for s, p in arms if precision in p))
        assert not set(LAYER_TYPES) - covered, f"{precision}: {sorted(set(LAYER_TYPES) - covered)}"
    named = set().union(*(p for _, p in arms))
    assert {"bf16_sr", "bf16_kahan", "fixed16_sr", "fp8_e4m3", "fp8_hybrid", "fp8_hybrid:delayed:16"} <= named
