"""`amp-harness export SPEC --framework F [--precision P] [-o DIR]`: the verified network as one self-contained
training script for one framework and precision, which a user runs without amp-harness.

The core owns the rules: it validates the spec, refuses in one line (exit 2) what the exporter does not cover
(a layer, an optimizer, a schedule, clipping, a precision, a framework without a template), writes the canonical
initial weights and the first K training batches beside the script (`DIR/<model>_data.npz`, exactly what a
fingerprint of K steps trains on: harness.run.fingerprint) and renders the framework's script from the
template its adapter package holds, found by a naming convention: `amp_harness_<framework>/export_template.py`,
a complete Python script that imports only numpy and its framework, with two marker lines the core replaces:

    \"\"\"@HEADER@\"\"\"          -> the script's docstring (what it is, where it came from, how to run it)
    CONFIG = {}  # @CONFIG@     -> the network, optimizer, loss and precision as a Python literal

Rendering reads the template as text: no framework is imported here. A framework whose package holds no template
(MXNet for now) is refused in one line.

The data file holds `w/<canonical name>` (every weight in the canonical layout: dense [in, out], conv
[kH, kW, in, out], batchnorm's moving statistics included), `x` [K, batch, *input] float32 (NHWC images), `y`
[K, batch] int64 and `spec_hash` (the script refuses a data file of another spec).
"""
from __future__ import annotations

import argparse
import importlib.util
import pprint
import re
from pathlib import Path

import numpy as np

from harness.errors import HarnessError, SpecError, clip
from harness.limits import MAX_STEPS
from harness.model.graph import Graph, same_padding

FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet")
TEMPLATE = "export_template.py"  # in each adapter package: amp_harness_<framework>/export_template.py
HEADER_MARK = '"""@HEADER@"""'
CONFIG_MARK = "CONFIG = {}  # @CONFIG@"
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "fp64")  # fp64: the math checked with no rounding to hide in
LAYERS = ("dense", "conv2d", "maxpool2d", "avgpool2d", "global_avgpool2d", "flatten", "relu", "gelu", "tanh",
          "sigmoid", "softmax", "batchnorm", "layernorm", "dropout", "residual")
OPTIMIZERS = ("sgd", "adam", "rmsprop")
# the core's dynamic loss scaling (docs/precisions.md), equal in every framework's script
LOSS_SCALE = {"initial": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
COMPUTE = {"fp32": None, "amp_bf16": "bfloat16", "amp_fp16": "float16", "fp64": None}


def package(framework: str) -> str:
    return f"amp_harness_{framework}"


def template_path(framework: str) -> Path | None:
    """The framework's template: in its installed adapter package, else in this source tree's adapters/ (the core
    env has no adapter installed); None where there is none. Locating a package does not import it."""
    try:
        found = importlib.util.find_spec(package(framework))
    except (ImportError, ValueError):
        found = None
    places = [Path(p) for p in (found.submodule_search_locations or [])] if found else []
    places.append(Path(__file__).resolve().parents[1] / "adapters" / framework / package(framework))
    for place in places:
        if (place / TEMPLATE).is_file():
            return place / TEMPLATE
    return None


# ---- what the exporter covers ---------------------------------------------------------------------------
def check_covered(spec, source: str, framework: str, precision: str) -> None:
    """SpecError (one line naming the file and the place) for the first thing the export does not cover."""
    if framework not in FRAMEWORKS:
        raise HarnessError(f"--framework {clip(framework)}: export knows {', '.join(FRAMEWORKS)}")
    if template_path(framework) is None:
        raise HarnessError(f"--framework {framework}: export has no template for {framework} yet "
                           f"({package(framework)}/{TEMPLATE}); exported: "
                           f"{', '.join(f for f in FRAMEWORKS if template_path(f))}")
    if precision not in PRECISIONS:
        raise HarnessError(f"--precision {clip(precision)}: export covers {', '.join(PRECISIONS)}")

    def walk(layers, where: str) -> None:
        for i, layer in enumerate(layers):
            place = f"{where}[{i}]"
            if layer.type not in LAYERS:
                raise SpecError(f"{source}: {place}: export does not cover layer type '{layer.type}' "
                                f"(covered: {', '.join(LAYERS)})")
            if layer.input is not None:
                raise SpecError(f"{source}: {place}.input: export covers chains of layers, not named tensors")
            if layer.type == "conv2d" and (layer.groups, layer.dilation) != (1, 1):
                raise SpecError(f"{source}: {place}: export does not cover grouped or dilated convolutions")
            if layer.type == "residual":
                walk(layer.layers, f"{place}.layers")
                if layer.projection:
                    walk(layer.projection, f"{place}.projection")

    walk(spec.layers, "layers")
    opt = spec.optimizer
    if opt.type not in OPTIMIZERS:
        raise SpecError(f"{source}: optimizer.type: export does not cover optimizer '{opt.type}' "
                        f"(covered: {', '.join(OPTIMIZERS)})")
    if opt.schedule is not None and opt.schedule.type != "constant":
        raise SpecError(f"{source}: optimizer.schedule: export does not cover schedule '{opt.schedule.type}' "
                        f"(covered: a constant learning rate)")
    if opt.clip_norm is not None:
        raise SpecError(f"{source}: optimizer.clip_norm: export does not cover gradient clipping")


# ---- the script's configuration -------------------------------------------------------------------------
def _layer_config(layer, infos: dict, path: str) -> dict:
    info = infos[path]
    out = {"path": path, **layer.model_dump(exclude={"layers", "projection"}),
           "in_shape": list(info.in_shape), "out_shape": list(info.out_shape)}
    if layer.type in ("conv2d", "maxpool2d", "avgpool2d"):
        k = layer.kernel_size if layer.type == "conv2d" else layer.pool_size
        s = layer.strides or k
        out["strides"] = s
        if layer.padding == "same":  # TF's rule: the odd pixel at the bottom/right
            (top, bottom), (left, right) = (same_padding(n, k, s) for n in info.in_shape[:2])
        else:
            top = bottom = left = right = 0
        out["pads"] = [top, bottom, left, right]
    if layer.type == "residual":
        out["layers"] = [_layer_config(sub, infos, f"{path}.layers.{j}") for j, sub in enumerate(layer.layers)]
        out["projection"] = [_layer_config(sub, infos, f"{path}.projection.{j}")
                             for j, sub in enumerate(layer.projection)] if layer.projection else None
    return out


def config(spec, graph: Graph, framework: str, precision: str, data_file: str, steps: int) -> dict:
    """What the template's CONFIG holds: plain Python data (no harness object)."""
    infos = {info.path: info for info in graph.layers}
    return {
        "model": spec.name,
        "framework": framework,
        "precision": precision,
        "dtype": "float64" if precision == "fp64" else "float32",  # of the weights (and of the math, but for amp)
        "compute_dtype": COMPUTE[precision],
        "loss_scale": dict(LOSS_SCALE) if precision == "amp_fp16" else None,
        "spec_hash": spec.spec_hash(),
        "seed": spec.seed,
        "data_file": data_file,
        "steps": steps,
        "batch_size": spec.batch_size,
        "input_shape": list(spec.input.shape),
        "loss": spec.loss.model_dump(),
        "optimizer": spec.optimizer.model_dump(exclude={"schedule", "clip_norm"}),
        "layers": [_layer_config(layer, infos, str(i)) for i, layer in enumerate(spec.layers)],
    }


def _has_dropout(layers) -> bool:
    return any((layer.type == "dropout" and layer.rate > 0) or
               (layer.type == "residual" and (_has_dropout(layer.layers) or _has_dropout(layer.projection or [])))
               for layer in layers)


def header(spec, source: str, framework: str, precision: str, script: str, data_file: str, steps: int) -> str:
    idiom = {"fp32": "float32 throughout (TF32 off on GPUs)", "fp64": "float64 throughout",
             "amp_bf16": "mixed precision: float32 weights, bfloat16 compute, no loss scaling",
             "amp_fp16": "mixed precision: float32 weights, float16 compute, dynamic loss scaling (initial 2^16, "
                         "x2 after 2000 clean steps, x0.5 and the step skipped on overflow)"}[precision]
    dropout = ("This spec has dropout: the script uses the framework's own dropout, whose masks are not the "
               "harness's, so its losses differ from the fingerprint's by design. "
               if _has_dropout(spec.layers) else "")
    return f'''"""{spec.name}: {framework}, {precision}. Exported by `amp-harness export` from {clip(source, 200)}.

A self-contained training script (it imports numpy and {framework} only): the spec's network built with
{framework}'s own layers, its canonical initial weights and its first {steps} training batches read from
{data_file} (written beside this script), trained {steps} steps with the spec's {spec.optimizer.type} in
{idiom}. Spec hash {spec.spec_hash()}.

    python {script} [--steps N] [--losses-json PATH] [--data PATH]

prints each step's loss; --losses-json writes them as JSON. In fp32 the losses are those of
`amp-harness fingerprint --framework {framework} --precision fp32 --steps {steps}` on the same spec (within
float32 rounding); mixed precision follows {framework}'s own rules of which ops run in 16 bits, so compare those
with a tolerance. {dropout}Compare losses only on specs without dropout.
"""'''


def render(framework: str, cfg: dict, head: str) -> str:
    """The template's text with its header and CONFIG filled in; a template without its markers is a bug."""
    path = template_path(framework)
    text = path.read_text(encoding="utf-8")
    for mark in (HEADER_MARK, CONFIG_MARK):
        if text.count(mark) != 1:
            raise HarnessError(f"{path}: the export template must hold the line {mark!r} exactly once")
    literal = pprint.pformat(cfg, indent=1, width=110, sort_dicts=False)
    return text.replace(HEADER_MARK, head).replace(CONFIG_MARK, f"CONFIG = {literal}")


# ---- the data file --------------------------------------------------------------------------------------
def write_data(spec, graph: Graph, path: Path, steps: int) -> None:
    """The canonical initial weights of the spec's seed and the first `steps` training batches, as the
    fingerprint takes them (Data(spec, order_seed=spec.seed).train_batch(step), step = 0, 1, ...)."""
    from harness.model.data import Data
    from harness.model.weights import initial_weights

    data = Data(spec, order_seed=spec.seed)
    batches = [data.train_batch(step) for step in range(steps)]
    arrays = {f"w/{name}": value for name, value in initial_weights(graph, spec.seed).items()}
    arrays["x"] = np.stack([x for x, _ in batches])
    arrays["y"] = np.stack([y for _, y in batches]).astype(np.int64)
    arrays["spec_hash"] = np.array(spec.spec_hash())
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "model"


def export(model: str, framework: str, precision: str = "fp32", out: str | Path = ".", steps: int | None = None,
           batch_size: int | None = None) -> tuple[Path, Path]:
    """Write DIR/<model>_<framework>_<precision>.py and DIR/<model>_data.npz; (script, data file). `steps`:
    how many batches the data file holds and the script trains (default the spec's steps)."""
    from harness.model.graph import infer
    from harness.model.spec import load_spec, spec_path

    source = str(spec_path(model))
    spec = load_spec(model)
    infer(spec, source)  # the file's own shapes must fit
    check_covered(spec, source, framework, precision)
    if spec.tokens:  # (the first layer of a token model is an embedding, refused above)
        raise SpecError(f"{source}: input.vocab: export does not cover token inputs")
    spec = spec.with_overrides(batch_size=batch_size, steps=steps)
    graph = infer(spec, source)
    steps = spec.steps
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HarnessError(f"-o {clip(out)}: cannot create the directory ({exc.strerror})") from None
    stem = file_stem(spec.name)
    script = out / f"{stem}_{framework}_{precision}.py"
    data_file = out / f"{stem}_data.npz"
    cfg = config(spec, graph, framework, precision, data_file.name, steps)
    text = render(framework, cfg, header(spec, source, framework, precision, script.name, data_file.name, steps))
    compile(text, str(script), "exec")  # a template that renders invalid Python must not leave a script behind
    write_data(spec, graph, data_file, steps)
    script.write_text(text, encoding="utf-8")
    return script, data_file


# ---- the command line -----------------------------------------------------------------------------------
def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{clip(text, 40)}'") from None
    if not 1 <= value <= MAX_STEPS:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_STEPS}, got {value}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    """`export` on the CLI's subparsers."""
    p = subparsers.add_parser("export", help="the spec's network as a self-contained training script for one "
                              "framework and precision, with its weights and batches in a .npz beside it")
    p.add_argument("spec", metavar="SPEC", help="a built-in model name or a spec file")
    p.add_argument("--framework", required=True, help=f"one of {', '.join(FRAMEWORKS)}")
    p.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)} (default fp32)")
    p.add_argument("--steps", type=_steps, help="training batches in the data file, and the steps the script "
                   "trains (default the spec's)")
    p.add_argument("--batch-size", type=_steps, help="override the spec's batch size")
    p.add_argument("-o", "--out", default=".", help="output directory (default .)")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args) -> int:
    script, data_file = export(args.spec, args.framework, args.precision, args.out, args.steps,
                               getattr(args, "batch_size", None))
    print(f"wrote {script} and {data_file}; run: python {script}")
    return 0
