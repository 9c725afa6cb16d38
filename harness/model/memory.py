"""What one training step needs in memory, from the spec's graph alone (no framework), and how much this
machine can give: `check` prints the estimate per precision, `run` refuses a run that cannot fit before any
worker allocates it.

The estimate counts what every framework must hold:
- the weights (with batchnorm's moving statistics), their gradients and the optimizer's slots, in the weights'
  dtype, and Kahan's compensation buffer (harness.model.graph.state_memory_mb);
- mixed precision: a copy of the trainable weights in the compute dtype;
- activations kept for backward: every layer's output once, in the compute dtype, at the batch size, and the
  two largest of them again (the gradient flowing back and the one it produces); an attention layer also keeps
  its queries, keys, values and concatenated heads (4 x T x D) and its probabilities (heads x T^2), and with
  attention dropout the mask and the dropped probabilities (2 x heads x T^2 more): the T^2 terms are why
  mixed precision saves less than half on long sequences when a framework keeps the softmax in float32, which
  this estimate (a floor every framework must hold) does not assume;
- the input batch: float32 images or vectors, or int64 token ids, on the host and once more as the framework's
  tensor, and its labels (int64: one per sample, or one per token for next-token prediction).
It leaves out what depends on the framework: its own workspace (convolution algorithms, oneDNN primitives,
the allocator's caching and fragmentation, XLA's buffers), temporaries that fusion may or may not remove,
and the fixed cost of importing the framework; the guard adds the dataset when the core keeps it in memory.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass

from harness.errors import HarnessError
from harness.model.data import sample_bytes
from harness.model.graph import DTYPE_BYTES, Graph, attention_widths, state_memory_mb
from harness.precision import Precision

MB = 2**20
LIMIT_ENV = "AMP_HARNESS_MEMORY_LIMIT_MB"
LABEL_BYTES = 8  # int64 class ids


@dataclass(frozen=True)
class MemoryEstimate:
    precision: str
    parts_mb: dict[str, float]  # weights, gradients, optimizer_state, compute_copy, activations, input_batch

    @property
    def step_mb(self) -> float:
        """One training step's memory: what the measured peak above the framework's own level holds."""
        return sum(self.parts_mb.values())


def estimate(graph: Graph, spec, precision: Precision) -> MemoryEstimate:
    parts = state_memory_mb(graph, spec.optimizer, precision)
    compute = DTYPE_BYTES[precision.compute_dtype]
    parts["compute_copy"] = graph.param_count * compute / MB if precision.mixed else 0.0
    outputs = [math.prod(layer.out_shape) for layer in graph.layers if layer.type != "residual"]
    kept = sum(outputs) + sum(sorted(outputs)[-2:]) + sum(attention_kept(layer) for layer in graph.layers)
    parts["activations"] = kept * spec.batch_size * compute / MB
    sample = math.prod(spec.input.shape)
    labels = spec.input.shape[0] if spec.dataset.next_token else 1
    parts["input_batch"] = spec.batch_size * (2 * sample * sample_bytes(spec) + labels * LABEL_BYTES) / MB
    return MemoryEstimate(precision.name, parts)


def attention_kept(layer) -> int:
    """What an attention layer keeps for backward besides its output, per sample, in elements."""
    if layer.type != "attention":
        return 0
    length, dim = layer.in_shape
    probabilities = layer.spec.heads * length * length
    projections = length * sum(attention_widths(layer.spec, dim).values())  # q, k, v and the heads' outputs
    return projections + probabilities * (3 if layer.spec.dropout > 0 else 1)


def dataset_mb(spec) -> float:
    """The dataset the core materialises before training (harness.model.data.Data keeps small ones whole; a token
    dataset's source keeps its ids and labels whole besides)."""
    from harness.model.data import CACHE_LIMIT_BYTES, sample_count

    count = sample_count(spec)
    samples = count * math.prod(spec.input.shape) * sample_bytes(spec)
    total = samples if samples <= CACHE_LIMIT_BYTES else 0
    if spec.tokens:
        total += samples + count * (spec.input.shape[0] if spec.dataset.next_token else 1) * LABEL_BYTES
    return total / MB


def fmt_mb(mb: float) -> str:
    for unit, size in (("TiB", 2**20), ("GiB", 2**10)):
        if mb >= size:
            return f"{mb / size:.2f} {unit}"
    return f"{mb:.1f} MiB" if mb >= 1 else f"{mb * 1024:.1f} KiB"


# ---- what this machine can give ---------------------------------------------------------------------------
def _meminfo_mb(field: str) -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _cgroup_room_mb() -> float | None:
    """What the cgroup (v2) still lets this process tree allocate, when it has a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        return (int(limit) - used) / MB
    except (OSError, ValueError):
        return None


def _gpu_free_mb() -> float | None:
    """The least free memory of the NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES, by index or UUID),
    asked of nvidia-smi (no framework needed): free, not total, so memory other processes hold counts; the
    least, because CUDA may number the visible GPUs in another order than nvidia-smi. None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        rows = [(index, uuid, float(free)) for index, uuid, free in
                (tuple(v.strip() for v in line.split(",")) for line in out.stdout.splitlines() if line.strip())]
    except (OSError, subprocess.SubprocessError, ValueError):  # no GPU, a driver error, an unknown format
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        if not wanted or wanted[0].startswith("-"):
            return None  # no GPU visible: the run takes the CPU
        # a MIG instance or a name nvidia-smi does not list here: the least of them all
        rows = [r for r in rows if r[0] in wanted or any(w.startswith("GPU-") and r[1].startswith(w) for w in wanted)] \
            or rows
    return min(free for _, _, free in rows) if rows else None


def available_mb(device: str) -> tuple[float, str] | None:
    """(MiB, what it is) a run on `device` ("auto", "cpu", "gpu") may use: a GPU's free memory when one is
    visible and the run may use it, else the host's available RAM (within its cgroup's limit); None when unknown."""
    if os.environ.get(LIMIT_ENV):  # users who share a machine, and tests
        try:
            return float(os.environ[LIMIT_ENV]), LIMIT_ENV
        except ValueError:
            raise HarnessError(f"{LIMIT_ENV}={os.environ[LIMIT_ENV]!r}: expected a number of MiB") from None
    if device != "cpu":
        gpu = _gpu_free_mb()
        if gpu is not None:
            return gpu, "the GPU's free memory (nvidia-smi)"
    room = [v for v in (_meminfo_mb("MemAvailable"), _cgroup_room_mb()) if v is not None]
    return (min(room), "the host's available memory") if room else None


def check_fits(spec, graph: Graph, precisions: list[Precision], device: str, source: str) -> None:
    """HarnessError, before anything is allocated, when a training step of `spec` in any of `precisions`
    cannot fit in what this machine has for `device` (see the module's note on what the estimate holds)."""
    room = available_mb(device)
    if room is None:
        return
    limit, what = room
    extra = dataset_mb(spec)
    for precision in precisions:
        _refuse_beyond(estimate(graph, spec, precision).step_mb + extra, limit, what, spec, precision, source, extra)


def check_device_free(spec, graph: Graph, precision: Precision, free_mb: float | None, what: str) -> None:
    """In the worker, once the framework holds its device: HarnessError when a training step needs more than
    the device's free memory as the framework itself counts it (Adapter.free_memory_mb; None: it cannot tell).
    The guard before the runs asked nvidia-smi, which a machine without it, or another process's allocation
    since, leaves unsaid."""
    if free_mb is not None:
        _refuse_beyond(estimate(graph, spec, precision).step_mb, free_mb, what, spec, precision, spec.name, 0.0)


def _refuse_beyond(need: float, limit: float, what: str, spec, precision: Precision, source: str,
                   extra: float) -> None:
    if need > limit:
        raise HarnessError(f"{source}: {precision.name} needs about {fmt_mb(need)} for a training step at batch "
                           f"{spec.batch_size}{' and the dataset in memory' if extra else ''} (`amp-harness "
                           f"check` shows the parts), more than {what} "
                           f"({fmt_mb(limit)}); use a smaller batch_size or input, or --force")
