"""The run pipeline's first stage: the CLI's parsed options (and a matrix file) become a Plan, the resolved
requests of every run and how to run them; harness.run.runner.execute runs it.

Everything that can be known wrong is found here, in this process, before a worker starts (one line, exit 2):
the options, the matrix file, each spec (loaded and resolved once, with its overrides: batch size, input size,
steps; its shapes inferred), its data, its memory, the seeds of its repeats, the variants. Each request carries
its resolved spec (RunRequest.spec), so the worker, a failure record and --resume's key read that, never the
file again, and an executor ships no spec file to a node."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from harness.errors import HarnessError, SpecError
from harness.limits import MAX_MODELS, MAX_RUNS, usable_cpus
from harness.model.graph import Graph, infer
from harness.model.spec import ModelSpec, load_spec, spec_path
from harness.precision import parse_loss_scale, parse_precision
from harness.run.executors import Executor, executor_from_args
from harness.run.worker import RunRequest
from harness.stats import MIN_REPEATS

AUTO = "auto"  # --repeats auto
DEFAULT_BUDGET_S = 600.0  # --budget: an answer in minutes


def resolve(model: str, batch_size: int | None = None, steps: int | None = None,
            input_size: tuple[int, int] | None = None) -> tuple[ModelSpec, Graph]:
    """The spec of a built-in name or spec path with its overrides applied, and its graph: the one place a spec is
    made ready for use. A SpecError (one line) names the file, or, for shapes only the overrides break, the spec."""
    spec = load_spec(model)
    graph = infer(spec, str(spec_path(model)))  # the file's own shapes must fit
    if (batch_size, steps, input_size) != (None, None, None):
        spec = spec.with_overrides(batch_size, steps, input_size)
        graph = infer(spec, spec.name)
    if spec.dataset.name == "text":  # the corpus's hash joins the spec's, so runs on other files never pool
        from harness.model.data import corpus_hash, read_corpus

        try:
            spec = spec.with_corpus_hash(corpus_hash(read_corpus(spec.dataset.path)))
        except HarnessError as exc:
            raise SpecError(f"{spec_path(model)}: {exc}") from None
    return spec, graph


@dataclass(frozen=True)
class Cell:
    """A model of the matrix, resolved: its spec with the cell's overrides, and a matrix file's own precisions, loss
    scales and variants for it (None: the command's)."""
    model: str  # as the user named it
    spec: ModelSpec
    graph: Graph
    precisions: tuple[str, ...] | None = None
    loss_scales: tuple[str, ...] | None = None
    variants: tuple[str, ...] | None = None


SIZES = ("batch_size", "steps", "input_size", "width", "seq_len")  # the overrides a cell may give its spec
SIZES_AND_ARMS = ("batch_size", "input_size", "steps", "precisions", "loss_scales", "variants")  # a matrix model's
FINGERPRINT_STEPS = 20  # fingerprint's steps where neither --steps nor a matrix file gives them


def cells(entries: list[tuple[str, dict]]) -> list[Cell]:
    """(model, overrides) -> Cells; a model named in many entries is loaded once."""
    loaded: dict[str, tuple[ModelSpec, Graph]] = {}
    out = []
    for model, overrides in entries:
        if model not in loaded:
            loaded[model] = resolve(model)
        spec, graph = loaded[model]
        sizes = {k: overrides.get(k) for k in SIZES}
        if any(v is not None for v in sizes.values()):
            spec = spec.with_overrides(**sizes)
            graph = infer(spec, spec.name)
        own = [tuple(overrides[k]) if overrides.get(k) else None for k in ("precisions", "loss_scales", "variants")]
        out.append(Cell(model, spec, graph, *own))
    return out


def size_label(spec: ModelSpec) -> str:
    """"batch 64, width 2, seq_len 128": the sizes a scaling study varies, as its lines name a cell."""
    parts = [f"batch {spec.batch_size}"]
    if spec.width is not None:
        parts.append(f"width {spec.width:g}")
    if spec.tokens:
        parts.append(f"seq_len {spec.input.shape[0]}")
    return ", ".join(parts)


def matrix(framework: str, cells: list[Cell], precisions: list[str], repeats: int, variants: list[str],
           loss_scales: list[str | None] = (None,), **common) -> list[RunRequest]:
    """Requests for every cell x repeat x variant x loss scale x precision, in that order: the precisions, scales
    and variants of a model take turns (fp32, amp_bf16, amp_fp16, fp32, ...), so that a drift of the machine
    during the matrix spreads over all of them instead of falling on one.

    A cell's own loss scales (a matrix file's) replace `loss_scales` for the precisions that scale the loss by
    default (amp_fp16); the others run once, unscaled. A cell's own precisions replace `precisions`, its own
    variants (resolved: adapter names) `variants`."""
    stamp = stamp_now()
    requests = []
    for cell, r, v in ((c, r, v) for c in cells for r in range(repeats) for v in c.variants or variants):
        spec = cell.spec.model_dump(mode="json")
        for i, scale in enumerate(cell.loss_scales or loss_scales):
            for p in cell.precisions or precisions:
                s = scale
                if cell.loss_scales is not None and parse_precision(p).default_loss_scale == "none":
                    if i:
                        continue
                    s = None
                requests.append(RunRequest(framework=framework, model=cell.model, spec=spec, precision=p, repeat=r,
                                           variant=v, loss_scale=s,
                                           run_id=run_id(framework, cell.model, p, v, s, r, stamp), **common))
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


def plan(args, mode: str, repeats: int | str | None, warmup: int, filename: str,
         loss_scales: list[str | None] | None = None, budget: float | None = None,
         grid: list[dict] | None = None, **extra) -> Plan:
    """The Plan of `run`, `study`, `fingerprint`, `diagnose` or `profile` (`mode`) from its parsed options `args`.
    `repeats` "auto": MIN_REPEATS, then more until decided or `budget` seconds are spent (runner.UntilDecided);
    None: a matrix file's, else MIN_REPEATS. `extra`: fields of every request (a study's id, diagnose's every).
    `grid` (a scaling study): the size overrides of each cell of every model (batch_size, width, seq_len); a
    cell the memory guard refuses is skipped with one line on stdout instead of stopping the command."""
    from harness.adapter import discover, load_adapter
    from harness.model import data, memory
    from harness.results import prove_writable
    from harness.run.worker import run_seed

    if args.executor == "local" and args.threads > usable_cpus():  # a cluster's nodes have CPUs of their own
        cpus = usable_cpus()
        raise HarnessError(f"--threads {args.threads}: this process may use {cpus} CPU{'s' if cpus > 1 else ''} "
                           f"(os.sched_getaffinity); more threads only contend, and too many exhaust the machine")
    if args.framework not in discover():
        load_adapter(args.framework)  # raises the "not installed" error
    precisions = args.precision or ["fp32"]
    steps = FINGERPRINT_STEPS if mode == "fingerprint" and args.steps is None else args.steps
    if getattr(args, "matrix", None):
        entries, precisions, warmup, repeats, budget = _from_matrix_file(args, mode, precisions, warmup, repeats,
                                                                         budget, steps)
    elif args.model:
        sizes = {"batch_size": args.batch_size, "input_size": args.input_size, "steps": steps}
        entries = [(model, {**sizes, **{k: v for k, v in point.items() if v is not None}})
                   for model in args.model for point in grid or [{}]]
    else:
        raise HarnessError("--model (or, for run, --matrix) is required")
    if len(entries) > MAX_MODELS:
        raise HarnessError(f"{len(entries)} models: more than {MAX_MODELS} in one command (harness.limits.MAX_MODELS);"
                           f" split them")
    if budget is not None and repeats != AUTO:
        raise HarnessError("--budget: only with --repeats auto (it bounds the repeats that auto adds)")
    auto, repeats = repeats == AUTO, MIN_REPEATS if repeats in (None, AUTO) else repeats
    loss_scales = loss_scales or [args.loss_scale]
    for name in precisions:
        for loss_scale in loss_scales:
            parse_loss_scale(loss_scale, parse_precision(name))
    _check_runs(entries, precisions, repeats, 1, loss_scales)  # before the specs are read; with the variants below
    resolved, fitting, refused = cells(entries), [], None
    for cell in resolved:  # every error certain before a worker starts: the spec, its data, its memory
        run_seed(cell.spec, repeats - 1)  # the last repeat's seed must fit numpy's generators
        try:
            data.check(cell.spec, cell.model)  # a batch larger than the training split, say
            if not args.force:
                memory.check_fits(cell.spec, cell.graph, [parse_precision(p) for p in cell.precisions or precisions],
                                  args.device, cell.model)
        except HarnessError as exc:
            if grid is None:
                raise
            refused = exc  # a study's size that cannot run here: skipped, said in one line, the rest run
            print(f"skipped {cell.model} at {size_label(cell.spec)}: {str(exc).split('; use a smaller')[0]}")
            continue
        fitting.append(cell)
    if not fitting:
        raise HarnessError(f"no size of the study can run here (each skipped above); the last: {refused}")
    resolved = fitting
    adapter, timed = load_adapter(args.framework), mode == "run" and not extra.get("nonfinite")
    variants = _variants(adapter, args.variant, timed)
    resolved = [replace(c, variants=tuple(_variants(adapter, list(c.variants), timed, f"{args.matrix}: {c.model}: "
                                                                                      f"variants"))) if c.variants else c
                for c in resolved]
    _check_runs(entries, precisions, repeats, max(len(v) for v in [variants, *(c.variants or () for c in resolved)]),
                loss_scales)
    requests = matrix(args.framework, resolved, precisions, repeats, variants, loss_scales, warmup=warmup,
                      growth_interval=args.growth_interval, device=args.device, threads=args.threads, mode=mode,
                      force=args.force, **extra)
    executor = executor_from_args(args, mode)
    out = Path(args.out)
    prove_writable(out, filename)  # before the first run: a run's record must not be lost to a read-only --out
    return Plan(requests, out, filename, executor, (budget or DEFAULT_BUDGET_S) if auto else None, args.resume)


def _from_matrix_file(args, mode: str, precisions, warmup, repeats, budget, steps: int | None) -> tuple:
    """The entries (model, overrides) a matrix file gives `mode`, for `run` and `fingerprint` its precisions, and
    for `run` its warm-up, repeats and budget (the options win where the file leaves them out). `steps`: the
    command's, for the models the file gives none (--steps is refused beside a file that sets steps)."""
    from harness.run.matrix import load_matrix

    if args.model:
        raise HarnessError("give either --model or --matrix, not both")
    file = load_matrix(args.matrix)
    sets_steps = file.steps is not None or any(m.steps is not None for m in file.models if mode in m.commands)
    beside = [name for name, value in (("--steps", args.steps if mode != "profile" and sets_steps else None),
                                       ("--batch-size", args.batch_size), ("--input-size", args.input_size))
              if value is not None]
    if mode in ("run", "fingerprint"):  # the matrix file sets these; diagnose and profile take its models and sizes
        beside += [name for name, value in (("--precision", args.precision),) if value is not None]
    if mode == "run":
        beside += [name for name, value in (("--warmup", warmup),
                                            ("--repeats", "repeats" in file.model_fields_set and repeats),
                                            ("--budget", "budget" in file.model_fields_set and budget))
                   if value is not None and value is not False]
    if beside:
        raise HarnessError(f"{', '.join(beside)}: the matrix file {args.matrix} sets this; give it there, "
                           f"not beside --matrix")
    # run and fingerprint take a model's precisions, loss scales and variants too; diagnose trains in fp32
    own = {"run": SIZES_AND_ARMS, "fingerprint": SIZES_AND_ARMS, "diagnose": ("batch_size", "input_size", "steps"),
           "profile": ("batch_size", "input_size")}[mode]
    entries = [(m.model, {"steps": file.steps if file.steps is not None else steps,
                          **{k: v for k, v in m.overrides().items() if v is not None and k in own}})
               for m in file.models if mode in m.commands]
    if not entries:
        raise HarnessError(f"{args.matrix}: no model is for {mode} (each model's `commands` leave it out)")
    if mode == "profile":  # its own steps: as many profiled as warm-up, not the matrix's timed steps
        entries = [(m, {**o, "steps": args.steps}) for m, o in entries]
    if mode in ("run", "fingerprint"):
        precisions = file.precisions
    if mode == "run":
        warmup = file.warmup
        repeats = repeats if repeats is not None else file.repeats
        budget = budget if budget is not None else file.budget
    return entries, precisions, warmup, repeats, budget


def _check_runs(entries: list[tuple[str, dict]], precisions: list[str], repeats: int, variants: int,
                loss_scales: list) -> None:
    """HarnessError when the matrix holds more than MAX_RUNS runs, counted before any request is built: a
    million requests would fill the memory before the first one ran."""
    runs = sum(repeats * variants * len(o.get("loss_scales") or loss_scales) * len(o.get("precisions") or precisions)
               for _, o in entries)
    if runs > MAX_RUNS:
        raise HarnessError(f"{runs:,} runs (models x precisions x variants x loss scales x repeats): more than "
                           f"{MAX_RUNS:,} in one command (harness.limits.MAX_RUNS); fewer repeats or a smaller matrix")


def _variants(adapter, asked: list[str] | None, timed: bool, where: str = "--variant") -> list[str]:
    """The variants to run, by name. None asked for, or "auto": for timed runs of an adapter with more than one,
    "auto" (the worker runs the fastest here: harness.run.variants), else the adapter's first; "all": every one,
    the default first. `where`: what asked, as the error names it."""
    from harness.run.variants import AUTO as VARIANT_AUTO

    if asked == ["all"]:
        return list(adapter.variants)
    if not asked or asked == [VARIANT_AUTO]:
        return [VARIANT_AUTO] if timed and len(adapter.variants) > 1 else [next(iter(adapter.variants))]
    unknown = [v for v in asked if v not in adapter.variants]
    if unknown:
        raise HarnessError(f"{where} {unknown[0]}: {adapter.name} has the variants "
                           + ", ".join(f"{name} ({what})" for name, what in adapter.variants.items())
                           + (" and auto (the fastest here), which goes alone" if VARIANT_AUTO in unknown else
                              "; or auto (the fastest here)"))
    return asked
