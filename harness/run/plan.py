"""The run pipeline's first stage: a command's options (a PlanRequest, and a matrix file) become a Plan, the
resolved requests of every run and how to run them; harness.run.runner.execute runs it. What differs between the
commands is the request's Mode (harness.run.modes).

Everything that can be known wrong is found here, in this process, before a worker starts (one line, exit 2):
the options, the matrix file, each spec (loaded and resolved once, with its overrides: batch size, input size,
steps; its shapes inferred), its data, its memory, the seeds of its repeats, the variants. Each request carries
its resolved spec (RunRequest.spec), so the worker, a failure record and --resume's key read that, never the
file again, and an executor ships no spec file to a node."""
from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from harness.errors import HarnessError, SpecError
from harness.limits import MAX_MODELS, MAX_RUNS, usable_cpus
from harness.model.graph import Graph, infer
from harness.model.spec import ModelSpec, load_spec, spec_path
from harness.precision import parse_loss_scale, parse_precision
from harness.run.executors import Executor, make_executor
from harness.run.modes import DEFAULT_WARMUP, PlanRequest
from harness.run.request import RunRequest
from harness.stats import MIN_REPEATS

AUTO = "auto"  # --repeats auto
DEFAULT_BUDGET_S = 600.0  # --budget: an answer in minutes


def resolve(model: str, batch_size: int | None = None, steps: int | None = None,
            input_size: tuple[int, int] | None = None) -> tuple[ModelSpec, Graph]:
    """The spec of a built-in name or spec path with its overrides applied, and its graph: the one place a spec is
    made ready for use. A SpecError (one line) names the file, or, for shapes only the overrides break, the spec."""
    spec = load_spec(model)
    graph = _infer(spec, str(spec_path(model)))  # the file's own shapes must fit
    if (batch_size, steps, input_size) != (None, None, None):
        spec = spec.with_overrides(batch_size, steps, input_size)
        graph = _infer(spec, spec.name)
    if spec.dataset.name == "text":  # the corpus's hash joins the spec's, so runs on other files never pool
        from harness.model.data import corpus_hash, read_corpus

        try:
            spec = spec.with_corpus_hash(corpus_hash(read_corpus(spec.dataset.path)))
        except HarnessError as exc:
            raise SpecError(f"{spec_path(model)}: {exc}") from None
    return spec, graph


def _infer(spec: ModelSpec, source: str) -> Graph | None:
    """The spec's graph; None for a native model, which only its framework's worker can build."""
    return infer(spec, source) if spec.native is None else None


@dataclass(frozen=True)
class ResolvedModel:
    """A model of the matrix, resolved: its spec with its entry's overrides, and a matrix file's own precisions, loss
    scales and variants for it (None: the command's)."""
    model: str  # as the user named it
    spec: ModelSpec
    graph: Graph | None  # None: a native model
    precisions: tuple[str, ...] | None = None
    loss_scales: tuple[str, ...] | None = None
    variants: tuple[str, ...] | None = None


SIZES = ("batch_size", "steps", "input_size", "width", "seq_len")  # the overrides an entry may give its spec


def resolve_models(entries: list[tuple[str, dict]]) -> list[ResolvedModel]:
    """(model, overrides) -> ResolvedModels; a model named in many entries is loaded once."""
    loaded: dict[str, tuple[ModelSpec, Graph]] = {}
    out = []
    for model, overrides in entries:
        if model not in loaded:
            loaded[model] = resolve(model)
        spec, graph = loaded[model]
        sizes = {k: overrides.get(k) for k in SIZES}
        if any(v is not None for v in sizes.values()):
            spec = spec.with_overrides(**sizes)
            graph = _infer(spec, spec.name)
        own = [tuple(overrides[k]) if overrides.get(k) else None for k in ("precisions", "loss_scales", "variants")]
        out.append(ResolvedModel(model, spec, graph, *own))
    return out


def size_label(spec: ModelSpec) -> str:
    """"batch 64, width 2, seq_len 128": the sizes a scaling study varies, as its lines name a model at them."""
    parts = [f"batch {spec.batch_size}"]
    if spec.width is not None:
        parts.append(f"width {spec.width:g}")
    if spec.tokens:
        parts.append(f"seq_len {spec.input.shape[0]}")
    return ", ".join(parts)


def matrix(framework: str, models: list[ResolvedModel], precisions: list[str], repeats: int, variants: list[str],
           loss_scales: list[str | None] = (None,), **common) -> list[RunRequest]:
    """Requests for every model x repeat x variant x loss scale x precision, in that order: the precisions, scales
    and variants of a model take turns (fp32, amp_bf16, amp_fp16, fp32, ...), so that a drift of the machine
    during the matrix spreads over all of them instead of falling on one.

    A model's own loss scales (a matrix file's) replace `loss_scales` for the precisions that scale the loss by
    default (amp_fp16); the others run once, unscaled. A model's own precisions replace `precisions`, its own
    variants (resolved: adapter names) `variants`."""
    stamp = stamp_now()
    requests = []
    for model, r, v in ((m, r, v) for m in models for r in range(repeats) for v in m.variants or variants):
        spec = model.spec.model_dump(mode="json")
        for i, scale in enumerate(model.loss_scales or loss_scales):
            for p in model.precisions or precisions:
                s = scale
                if model.loss_scales is not None and parse_precision(p).default_loss_scale == "none":
                    if i:
                        continue
                    s = None
                requests.append(RunRequest(framework=framework, model=model.model, spec=spec, precision=p, repeat=r,
                                           variant=v, loss_scale=s,
                                           run_id=run_id(framework, model.model, p, v, s, r, stamp), **common))
    return requests


def stamp_now() -> str:
    return time.strftime("%Y%m%dT%H%M%S")


def run_id(framework: str, model: str, precision: str, variant: str, scale: str | None, repeat: int,
           stamp: str) -> str:
    return f"{framework}-{Path(model).stem}-{precision}-{variant}{'-' + scale if scale else ''}-r{repeat}-{stamp}-" \
           f"{uuid.uuid4().hex[:6]}"


@dataclass
class Plan:
    """What one command runs: its requests, where their records go, the executor, and --repeats auto's budget."""
    requests: list[RunRequest]
    out: Path
    filename: str
    executor: Executor
    budget_s: float | None = None  # --repeats auto: seconds for the repeats after each cell's first; None: fixed
    resume: bool = False
    study: str | None = None  # the id tying a study's runs together


def plan(request: PlanRequest) -> Plan:
    """The Plan of a command (`request.mode`: harness.run.modes) from its options. Repeats "auto": MIN_REPEATS,
    then more until decided or the budget is spent (runner.UntilDecided); not given: a matrix file's, else
    MIN_REPEATS. A scaling study's sizes (batch sizes, widths, sequence lengths) make a grid of cells of every
    model; a cell the memory guard refuses is skipped with one line on stdout instead of stopping the command."""
    from harness.adapter import discover, load_adapter
    from harness.model import data, memory
    from harness.results import prove_writable
    from harness.run.worker import run_seed

    mode = request.mode
    if mode.rules is not None:
        request = mode.rules(request)
    study = f"{mode.study}{stamp_now()}" if mode.study else None
    if request.executor.executor == "local" and request.threads > usable_cpus():  # a cluster's nodes have their own
        cpus = usable_cpus()
        raise HarnessError(f"--threads {request.threads}: this process may use {cpus} CPU{'s' if cpus > 1 else ''} "
                           f"(os.sched_getaffinity); more threads only contend, and too many exhaust the machine")
    if request.framework not in discover():
        load_adapter(request.framework)  # raises the "not installed" error
    precisions = request.precisions or list(mode.precisions)
    steps = request.steps if request.steps is not None else mode.steps
    warmup, budget = request.warmup, request.budget
    repeats = mode.repeats if mode.repeats is not None else request.repeats
    grid = _grid(request)
    if request.matrix:
        entries, settings = _from_matrix_file(request, steps)
        precisions = settings.get("precisions") or precisions
        warmup = settings.get("warmup", warmup)  # beside the file, --warmup is refused
        repeats = repeats if repeats is not None else settings.get("repeats")
        budget = budget if budget is not None else settings.get("budget")
    elif request.models:
        sizes = {"batch_size": request.batch_size, "input_size": request.input_size, "steps": steps}
        entries = [(model, {**sizes, **{k: v for k, v in point.items() if v is not None}})
                   for model in request.models for point in grid or [{}]]
    else:
        raise HarnessError("--model (or, for run, --matrix) is required")
    if mode.warmup_as_steps:
        warmup = steps
    elif mode.warmup is not None:
        warmup = mode.warmup
    elif warmup is None:
        warmup = DEFAULT_WARMUP
    if len(entries) > MAX_MODELS:
        raise HarnessError(f"{len(entries)} models: more than {MAX_MODELS} in one command (harness.limits.MAX_MODELS);"
                           f" split them")
    if budget is not None and repeats != AUTO:
        raise HarnessError("--budget: only with --repeats auto (it bounds the repeats that auto adds)")
    auto, repeats = repeats == AUTO, MIN_REPEATS if repeats in (None, AUTO) else repeats
    loss_scales = request.scales or [request.loss_scale]
    for name in precisions:
        for loss_scale in loss_scales:
            parse_loss_scale(loss_scale, parse_precision(name))
    _check_runs(entries, precisions, repeats, 1, loss_scales)  # before the specs are read; with the variants below
    resolved, fitting, refused, native_models = resolve_models(entries), [], None, []
    for model in resolved:  # every error certain before a worker starts: the spec, its data, its memory
        run_seed(model.spec, repeats - 1)  # the last repeat's seed must fit numpy's generators
        try:
            data.check(model.spec, model.model)  # a batch larger than the training split, say
            if model.graph is None:
                native_models.append(model)
            elif not request.force:
                memory.check_fits(model.spec, model.graph,
                                  [parse_precision(p) for p in model.precisions or precisions], request.device,
                                  model.model)
        except HarnessError as exc:
            if grid is None:
                raise
            refused = exc  # a study's size that cannot run here: skipped, said in one line, the rest run
            print(f"skipped {model.model} at {size_label(model.spec)}: {str(exc).split('; use a smaller')[0]}")
            continue
        fitting.append(model)
    if not fitting:
        raise HarnessError(f"no size of the study can run here (each skipped above); the last: {refused}")
    resolved = fitting
    _check_native(native_models, request.framework, mode)
    adapter, fastest = load_adapter(request.framework), mode.fastest_variant
    variants = _variants(adapter, request.variants, fastest)
    resolved = [replace(m, variants=tuple(_variants(adapter, list(m.variants), fastest,
                                                    f"{request.matrix}: {m.model}: variants"))) if m.variants else m
                for m in resolved]
    _check_runs(entries, precisions, repeats, max(len(v) for v in [variants, *(m.variants or () for m in resolved)]),
                loss_scales)
    requests = matrix(request.framework, resolved, precisions, repeats, variants, loss_scales, warmup=warmup,
                      growth_interval=request.growth_interval, device=request.device, threads=request.threads,
                      mode=mode.work.name, force=request.force, every=request.every, study=study,
                      nonfinite=mode.nonfinite)
    executor = make_executor(request.executor, request.framework, mode.work.timed)
    out = Path(request.out or mode.out)
    prove_writable(out, mode.filename)  # before the first run: a run's record must not be lost to a read-only --out
    return Plan(requests, out, mode.filename, executor, (budget or DEFAULT_BUDGET_S) if auto else None,
                request.resume, study)


def _check_native(models: list[ResolvedModel], framework: str, mode) -> None:
    """Native models (the user's own objects): each for a command that takes them, in the framework it belongs to,
    and built once in that framework's worker (harness.run.native), so that a module that does not import, a
    callable that fails or an output that does not fit the loss stops the command here, in one line."""
    from harness.run import native
    from harness.run.modes import MODES

    checked = set()
    for model in models:
        spec = model.spec
        if not mode.native:
            takes = ", ".join(m.command for m in MODES.values() if m.native)
            raise HarnessError(f"{model.model}: {mode.command} does not take native models ({takes} do); "
                               f"`amp-harness import {spec.native.kind} ...` translates the model to a spec that "
                               f"every command takes")
        if spec.native.framework != framework:
            raise HarnessError(f"{model.model}: a native {spec.native.kind} model runs in the {spec.native.framework} "
                               f"adapter, not {framework}; `amp-harness import {spec.native.kind} "
                               f"{spec.native.target} ...` translates it to a spec that every framework runs")
        key = spec.spec_hash()
        if key not in checked:
            native.check_in_child(spec, framework)
            checked.add(key)


def _grid(request: PlanRequest) -> list[dict] | None:
    """A scaling study's cells: the size overrides (batch_size, width, seq_len) of every combination of the sizes
    it varies; None where it varies none."""
    if not (request.batch_sizes or request.widths or request.seq_lens):
        return None
    return [{"batch_size": b, "width": w, "seq_len": t}
            for b, w, t in itertools.product(request.batch_sizes or [None], request.widths or [None],
                                             request.seq_lens or [None])]


def _from_matrix_file(request: PlanRequest, steps: int | None) -> tuple[list[tuple[str, dict]], dict]:
    """The entries (model, overrides) a matrix file gives the request's mode, and the settings of the file's top
    level the mode takes (Mode.from_matrix: precisions, warmup, repeats, budget). `steps`: the command's, for the
    models the file gives none. An option the file sets is refused beside it, not silently overridden."""
    from harness.run.matrix import load_matrix

    mode, takes = request.mode, request.mode.from_matrix
    if mode.matrix is None:
        raise HarnessError(f"--matrix: {mode.command} takes its models from --model")
    if request.models:
        raise HarnessError("give either --model or --matrix, not both")
    file = load_matrix(request.matrix)
    sets_steps = file.steps is not None or any(m.steps is not None for m in file.models if mode.matrix in m.commands)
    given = [("--steps", request.steps if "steps" in takes and sets_steps else None),
             ("--batch-size", request.batch_size), ("--input-size", request.input_size),
             ("--precision", request.precisions if "precisions" in takes else None),
             ("--warmup", request.warmup if "warmup" in takes else None),
             ("--repeats", request.repeats if "repeats" in takes and "repeats" in file.model_fields_set else None),
             ("--budget", request.budget if "budget" in takes and "budget" in file.model_fields_set else None)]
    beside = [name for name, value in given if value is not None]
    if beside:
        raise HarnessError(f"{', '.join(beside)}: the matrix file {request.matrix} sets this; give it there, "
                           f"not beside --matrix")
    entries = [(m.model, {"steps": file.steps if "steps" in takes and file.steps is not None else steps,
                          **{k: v for k, v in m.overrides().items() if v is not None and k in takes}})
               for m in file.models if mode.matrix in m.commands]
    if not entries:
        raise HarnessError(f"{request.matrix}: no model is for {mode.matrix} (each model's `commands` leave it out)")
    return entries, {k: getattr(file, k) for k in ("precisions", "warmup", "repeats", "budget") if k in takes}


def _check_runs(entries: list[tuple[str, dict]], precisions: list[str], repeats: int, variants: int,
                loss_scales: list) -> None:
    """HarnessError when the matrix holds more than MAX_RUNS runs, counted before any request is built: a
    million requests would fill the memory before the first one ran."""
    runs = sum(repeats * variants * len(o.get("loss_scales") or loss_scales) * len(o.get("precisions") or precisions)
               for _, o in entries)
    if runs > MAX_RUNS:
        raise HarnessError(f"{runs:,} runs (models x precisions x variants x loss scales x repeats): more than "
                           f"{MAX_RUNS:,} in one command (harness.limits.MAX_RUNS); fewer repeats or a smaller matrix")


def _variants(adapter, asked: list[str] | None, fastest: bool, where: str = "--variant") -> list[str]:
    """The variants to run, by name. None asked for, or "auto": where the mode runs the fastest
    (Mode.fastest_variant) and the adapter has more than one, "auto" (the worker runs the fastest here:
    harness.run.variants), else the adapter's first; "all": every one, the default first. `where`: what asked, as
    the error names it."""
    from harness.run.variants import AUTO as VARIANT_AUTO

    if asked == ["all"]:
        return list(adapter.variants)
    if not asked or asked == [VARIANT_AUTO]:
        return [VARIANT_AUTO] if fastest and len(adapter.variants) > 1 else [next(iter(adapter.variants))]
    unknown = [v for v in asked if v not in adapter.variants]
    if unknown:
        raise HarnessError(f"{where} {unknown[0]}: {adapter.name} has the variants "
                           + ", ".join(f"{name} ({what})" for name, what in adapter.variants.items())
                           + (" and auto (the fastest here), which goes alone" if VARIANT_AUTO in unknown else
                              "; or auto (the fastest here)"))
    return asked
