"""Runs of a native model (a spec with `native:`: the user's own network object), on the core's side.

The user's code runs only in the framework's worker: the plan asks a worker to build the model once and answer
what it is (`check_in_child`: its parameters, its output's shape, or the one-line problem that stops the command
with exit 2 before any timed run), and each run's worker builds it again under the run's seed. What the core
decides for every adapter is here and in harness.model.native: the output's shape against the loss and
dataset, the weights' kinds for AdamW, the training state's size, and the precisions a native model cannot run.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from harness.adapter import NativeInfo
from harness.errors import HarnessError, clip, one_line
from harness.model.graph import state_memory_of
from harness.model.native import Modules, output_problem

CHECK_TIMEOUT_S = 600  # building a large model on a slow CPU: minutes


def load_object(target: str, is_model, what: str):
    """The model `target` ("package.module:attr", "path/to/file.py:attr") names: the attribute itself where
    `is_model(it)`, else what it returns when called with no arguments (a class or a builder function), which must
    pass `is_model`; HarnessError in one line naming the target and the problem (`what`: "an nn.Module"...). The
    module is found as Python finds modules from the current folder and PYTHONPATH; a file's own folder is on the
    path while it runs, for its sibling imports."""
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise HarnessError(f"{clip(target, 80)}: give MODULE:ATTR (a module or path/to/file.py, and an attribute)")
    try:
        if where.endswith(".py") or "/" in where or "\\" in where:
            path = Path(where)
            if not path.is_file():
                raise HarnessError(f"{clip(where, 120)}: no such file")
            found = importlib.util.spec_from_file_location(f"_amp_harness_import_{path.stem}", path)
            module = importlib.util.module_from_spec(found)
            sys.modules[found.name] = module  # dataclasses and pickling look their module up there
            with _on_path(str(path.resolve().parent)):
                found.loader.exec_module(module)
        else:
            with _on_path(""):  # as `python -m`: modules in the working directory
                module = importlib.import_module(where)
    except HarnessError:
        raise
    except BaseException as exc:  # the user's code: anything, SystemExit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise HarnessError(f"{clip(target, 80)}: importing {clip(where, 80)} failed: {_first_line(exc)}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise HarnessError(f"{clip(target, 80)}: {clip(where, 80)} has no attribute {clip(attr, 60)}")
        obj = getattr(obj, part)
    if is_model(obj):
        return obj
    if not callable(obj):
        raise HarnessError(f"{clip(target, 80)}: {clip(attr, 60)} is a {type(obj).__name__}, not {what} (or a class "
                           f"or function of no arguments that returns one)")
    try:
        made = obj()
    except Exception as exc:
        raise HarnessError(f"{clip(target, 80)}: calling {clip(attr, 60)}() failed: {_first_line(exc)} (give {what}, "
                           f"or a class or function of no arguments that returns one)") from None
    if not is_model(made):
        raise HarnessError(f"{clip(target, 80)}: {clip(attr, 60)}() returned a {type(made).__name__}, not {what}")
    return made


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {clip(str(exc).splitlines()[0] if str(exc) else '', 120)}"


@contextlib.contextmanager
def _on_path(folder: str):
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def refusal(adapter, precision) -> str | None:
    """Why `adapter` cannot run a native model in `precision`, or None: FP8 where its capabilities say it does not
    convert a native model's matmuls (Capabilities.no_fp8_for_native_models)."""
    why = adapter.capabilities.no_fp8_for_native_models
    if precision.fp8 is None or why is None:
        return None
    return f"{adapter.name} {why}; translate the model to a spec with `amp-harness import` to train it in FP8"


def describe_built(info: NativeInfo, spec, precision, record: dict) -> Modules:
    """What the worker learns of a native model once built (its trainer's native_info()): its trainable
    parameters, its training state's size and, in the record's options, the model, its modules and a digest of its
    initial weights (equal in every precision and framework process of one seed: the proof that they all start
    from the same weights). Returns its modules, the layers numerics and the first-inf locator name."""
    record.update(param_count=info.trainable,
                  state_memory_mb=state_memory_of(info.trainable, info.weights, spec.optimizer, precision))
    record["options"]["native"] = {"model": f"{spec.native.kind} {spec.native.target}", "modules": len(info.modules),
                                   "initial_weights": info.digest}
    return Modules(info.modules)


def describe_trained(info: NativeInfo, record: dict) -> None:
    """After the run's work: an FP8 run's conversion of the model's matmul modules in its options (which computed
    in FP8, known once the first training step ran, and which did not, each with why)."""
    if info.fp8 is not None and "native" in record.get("options", {}):
        record["options"]["native"]["fp8"] = info.fp8.summary()


def weights_digest(arrays) -> str:
    """A digest of a model's initial weights (numpy arrays in the model's order), equal for equal values."""
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
    return digest.hexdigest()[:16]


def check_in_child(spec, framework: str) -> dict:
    """Build the native model in a worker of `framework` (this interpreter's environment) and return what it is:
    {"params", "output"}; a HarnessError with the problem (one line) where it cannot be loaded, built or run, or
    its output does not fit the spec's loss and dataset."""
    with tempfile.TemporaryDirectory(prefix="amp-harness-native-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec.model_dump(mode="json")))
        out = subprocess.run([sys.executable, "-m", "harness.run.worker", "native", framework, str(path)],
                             capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    try:
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise HarnessError(f"{spec.name}: building its native model in a {framework} worker ended without an "
                           f"answer: {last}") from None
    if "error" in answer:
        raise HarnessError(answer["error"])
    return answer


def check_here(framework: str, spec_file: str) -> dict:
    """`python -m harness.run.worker native FRAMEWORK SPEC.json`: the model built once in float32 on the CPU, two
    samples through it; {"params", "output"} or {"error"}: the spec's name and the problem, one line."""
    from harness.adapter import load_adapter
    from harness.model.data import Data
    from harness.model.spec import validate
    from harness.precision import parse_loss_scale, parse_precision

    spec = validate(json.loads(Path(spec_file).read_text()), spec_file)
    try:
        adapter = load_adapter(framework)
        precision = parse_precision("fp32")
        trainer = adapter.build(spec, None, None, precision, parse_loss_scale(None, precision),
                                adapter.device("cpu"), next(iter(adapter.variants)))
        x, _ = Data(spec, order_seed=spec.seed).train_batch(0)
        shape = tuple(trainer.predict(x[:2]).shape)
    except HarnessError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # the user's model failed on the samples
        return {"error": f"{spec.name}: its native model failed on two samples of {spec.dataset.name}: "
                         f"{one_line(exc)}"}
    problem = output_problem(spec, shape)
    if problem:
        return {"error": f"{spec.name}: native {spec.native.kind} {spec.native.target}: {problem}"}
    return {"params": trainer.native_info().trainable, "output": list(shape)}
