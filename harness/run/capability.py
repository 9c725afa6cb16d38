"""What this device can run, proved on it rather than assumed from the framework.

A precision the adapter does not rule out itself (``Adapter.unsupported``: limits it knows without running
anything) is proved by the probe: the adapter builds each of PROBE_SPECS (an image network: dense, conv2d, max
and average pooling, batchnorm, layernorm, dropout, a residual; a token network: embedding, positions, causal
attention with dropout, rmsnorm, sequence pooling) in that precision and takes one training step and one
prediction with it, through the same kernels a run uses. A framework error on the way makes the precision ``unsupported`` with the
library's own words (and the adapter's reading of them, ``Adapter.explain_probe_failure``); a Python programming
error or a HarnessError is a failure of the adapter, not of the device, and is raised.

Probes run in the worker's process (one framework and one precision per process, as a run) and are cached per
machine (harness.run.cache, "capabilities"), keyed by framework and version, device, CPU model and every CPU
flag: the CPU changes between machines, and what ran on another one says nothing about this one.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from datetime import datetime, timezone

from harness.errors import HarnessError, one_line
from harness.microscaling import missing_block_ops
from harness.run.cache import MISSING, cached, lookup
from harness.run.measure import cpu_info

IMAGE_PROBE = {
    "name": "capability_probe",
    "description": "one step through every kernel family a run uses, to prove a precision on this device",
    "input": {"shape": [8, 8, 3]},
    "dataset": {"name": "synthetic", "num_classes": 4, "size": 16},
    "layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same"},
               {"type": "batchnorm"},
               {"type": "relu"},
               {"type": "residual", "layers": [{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": "same"}]},
               {"type": "maxpool2d"},
               {"type": "avgpool2d", "padding": "same"},
               {"type": "flatten"},
               {"type": "dense", "units": 8},
               {"type": "layernorm"},
               {"type": "dropout", "rate": 0.25},
               {"type": "dense", "units": 4}],
    "loss": {"type": "sparse_categorical_crossentropy", "from_logits": True},
    "optimizer": {"type": "adam", "learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
    "batch_size": 4,
    "steps": 1,
    "seed": 0,
}
# integer ids through an embedding take other paths than float inputs (MXNet's amp_cast refuses int64 in oneDNN)
TOKEN_PROBE = {
    **IMAGE_PROBE,
    "name": "capability_probe_tokens",
    "input": {"shape": [6], "vocab": 16},
    "dataset": {"name": "synthetic_tokens", "num_classes": 4, "size": 16},
    "layers": [{"type": "embedding", "dim": 8},
               {"type": "position_embedding"},
               {"type": "residual", "layers": [{"type": "rmsnorm"},
                                               {"type": "attention", "heads": 2, "causal": True, "dropout": 0.25}]},
               {"type": "layernorm"},
               {"type": "sequence_pool", "mode": "mean"},
               {"type": "dense", "units": 4}],
}
PROBE_SPECS = (IMAGE_PROBE, TOKEN_PROBE)
# errors in the adapter's own Python code: a bug to fix, not a kernel this device lacks
PROGRAMMING_ERRORS = (HarnessError, AttributeError, NameError, TypeError, ImportError, KeyError, IndexError,
                      AssertionError)
SUBPROCESS_TIMEOUT_S = 600
KIND = "capabilities"
PROBES_HASH = hashlib.sha256(json.dumps(PROBE_SPECS, sort_keys=True).encode()).hexdigest()[:8]  # new probes, new key


def key(adapter, precision, device) -> str:
    model, flags = cpu_info(every_flag=True)
    return json.dumps([adapter.name, adapter.framework_version(), device.name, device.description, model,
                       hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16], PROBES_HASH, precision.name])


def unsupported(adapter, precision, device, in_process: bool = False, loss_scale=None) -> str | None:
    """Why `precision` cannot run on `device` with this adapter, or None where it can: the adapter's own limits,
    then the probe (cached; on a miss it runs here with `in_process`, the worker's case, else in a child
    process, since a precision may change a framework's process-wide state); with `loss_scale`, whether the
    adapter's loss scaler can follow it (Adapter.unsupported_loss_scale). FP8 first, whatever the adapter's
    own unsupported() says: an adapter that does not declare its emulation would train it as plain float32."""
    no_fp8 = adapter.capabilities.no_fp8 or (None if adapter.rounding_ops() else
                                             "has no rounding ops (Adapter.rounding_ops) for the FP8 casts")
    if precision.fp8 is not None and no_fp8:
        return f"{adapter.name} {no_fp8}"
    if precision.fp8 is not None and precision.fp8.native and adapter.capabilities.no_fp8_native:
        return f"{adapter.name} {adapter.capabilities.no_fp8_native}"
    if precision.blocks is not None:
        ops = adapter.rounding_ops()
        missing = missing_block_ops(ops) if ops is not None else ["the RoundingOps table (Adapter.rounding_ops)"]
        if adapter.capabilities.no_block_scaling or missing:
            return f"{adapter.name} {adapter.capabilities.no_block_scaling or 'lacks ' + ', '.join(missing)}"
        for wanted, reason in ((precision.blocks.stochastic, adapter.capabilities.no_block_stochastic),
                               (precision.blocks.native, adapter.capabilities.no_block_native)):
            if wanted and reason:
                return f"{adapter.name} {reason}"
    reason = adapter.unsupported(precision, device) or \
        (adapter.unsupported_loss_scale(precision, loss_scale) if loss_scale is not None else None)
    if reason:
        return reason
    k = key(adapter, precision, device)
    found = lookup(KIND, k)
    if found is MISSING:
        if in_process:
            found = cached(KIND, k, lambda: _probe(adapter, precision, device))
        else:
            found = _probe_in_child(adapter.name, precision.name, device.kind)
    return found["reason"]


def _probe(adapter, precision, device) -> dict:
    """Build the probe network in `precision` and take one training step and one prediction, here."""
    from harness.model.data import Data
    from harness.model.dropout import DropoutMasks
    from harness.model.graph import infer
    from harness.model.spec import validate
    from harness.model.weights import initial_weights
    from harness.precision import parse_loss_scale

    started = time.perf_counter()
    reason = None
    try:
        # a block-scaled precision changes only matmuls, and a convolution's is the dense product of its windows
        # (the kit's test_block_training holds each framework's windows to the rule): the token network's dense and
        # attention products prove the quantizer runs here
        for probe in (TOKEN_PROBE,) if precision.blocks is not None else PROBE_SPECS:
            if precision.blocks is not None and precision.blocks.hadamard:  # its transform takes rows 16 at a time
                probe = {**probe, "batch_size": 16, "dataset": {**probe["dataset"], "size": 64}}
            spec = validate(probe, "the capability probe")
            graph = infer(spec)
            data, masks = Data(spec), DropoutMasks(graph, spec.seed)
            x, y = data.train_batch(0)
            trainer = adapter.build(spec, graph, initial_weights(graph, spec.seed), precision,
                                    parse_loss_scale(None, precision), device, next(iter(adapter.variants)))
            trainer.train_step(trainer.to_device(x, y, masks.for_step(0, len(y))))
            trainer.predict(x)
    except PROGRAMMING_ERRORS:
        raise
    except Exception as exc:  # the framework's own error: this precision cannot run here
        error = one_line(exc)
        reading = adapter.explain_probe_failure(precision, device, error)
        evidence = cpu_evidence(precision) if device.kind == "cpu" else ""
        reason = (f"{reading or 'its probe step failed on this device'}{f' ({evidence})' if evidence else ''}: "
                  f"{error}")
    return {"reason": reason, "probed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "probe_s": round(time.perf_counter() - started, 3)}


def cpu_evidence(precision) -> str:
    """What this x86 CPU lacks for the precision's 16-bit arithmetic, from its flags ("" where nothing is missing
    or the CPU is not x86)."""
    dtypes = {precision.compute_dtype, precision.param_dtype} & {"bfloat16", "float16"}
    model, flags = cpu_info(every_flag=True)
    if not dtypes or "sse2" not in flags:
        return ""
    short = {"bfloat16": "bf16", "float16": "fp16"}
    wanted = ["avx512f"] + [f"{prefix}_{short[d]}" for d in sorted(dtypes) for prefix in ("avx512", "amx")]
    missing = [flag for flag in wanted if flag not in flags]
    if not missing:
        return ""
    head = "no AVX-512:" if "avx512f" in missing else "AVX-512 but"
    return f"this CPU has {head} none of {', '.join(missing)} among its flags"


def _probe_in_child(framework: str, precision: str, device: str) -> dict:
    """Probe in a process of its own, which writes the cache; its answer as the cache holds it."""
    out = subprocess.run([sys.executable, "-m", "harness.run.worker", "capability", framework, precision, device],
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    try:
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise HarnessError(f"the {framework} {precision} capability probe ended without an answer: {last}") from None
    if "error" in answer:
        raise HarnessError(answer["error"])
    return answer


def probe_here(framework: str, precision: str, device: str = "auto") -> dict:
    """`python -m harness.run.worker capability FRAMEWORK PRECISION [DEVICE]`: the answer, probed in this
    process where the cache has none."""
    from harness.adapter import load_adapter
    from harness.precision import parse_precision

    adapter = load_adapter(framework)
    return {"reason": unsupported(adapter, parse_precision(precision), adapter.device(device), in_process=True)}
