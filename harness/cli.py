"""The amp-harness command line: models, check, import, adapters, run, fingerprint, diagnose, profile, study,
conformance, parity, compare, export, report."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from harness import export
from harness.errors import HarnessError, clip
from harness.limits import (
    MAX_GROWTH_INTERVAL,
    MAX_REPEATS,
    MAX_SECONDS,
    MAX_STEPS,
    MAX_THREADS,
    default_threads,
)
from harness.results import NO_RESULT
from harness.run import compare
from harness.run.executors import add_executor_arguments
from harness.stats import MIN_REPEATS

if TYPE_CHECKING:  # for annotations only
    from harness.run.modes import Mode, PlanRequest
    from harness.run.plan import Plan


class _Parser(argparse.ArgumentParser):
    """Bad options get one line and exit code 2, like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
        if h > 0 and w > 0:
            return h, w
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"'{text}' is not HEIGHTxWIDTH, e.g. 56x84")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive integer")
    return value


def _width(text: str) -> float:
    from harness.model.spec import MAX_WIDTH

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"'{clip(text, 30)}' is not a width factor in (0, {MAX_WIDTH:g}]")
    return value


def _list_of(parse: Callable[[str], object], what: str) -> Callable[[str], list]:
    """A comma-separated list of `parse`d values, each once, in the order given (at most 64: a study's grid)."""
    def check(text: str) -> list:
        values = [parse(item) for item in _csv(text)]
        if len(values) > 64:
            raise argparse.ArgumentTypeError(f"{len(values)} {what}: at most 64")
        return list(dict.fromkeys(values))
    return check


def _repeats(text: str) -> int | str:
    return "auto" if text == "auto" else _REPEATS(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive number of seconds")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a non-negative integer")
    return value


def _at_most(parse, most: float | Callable[[], float], what: str) -> Callable[[str], float]:
    """`parse`, then refuse a value above `most` (harness.limits; a callable: asked when parsing): a value that
    would take the machine is bad input, refused before any worker starts."""
    def check(text: str):
        value, bound = parse(text), most() if callable(most) else most
        if value > bound:
            raise argparse.ArgumentTypeError(f"'{clip(text, 30)}' is more than {bound:,.0f} {what}")
        return value
    return check


_STEPS = _at_most(_positive, MAX_STEPS, "steps (a record holds every step: harness.limits.MAX_STEPS)")
_WARMUP = _at_most(_count, MAX_STEPS, "warm-up steps (harness.limits.MAX_STEPS)")
_SECONDS = _at_most(_seconds, MAX_SECONDS, "seconds (a week: harness.limits.MAX_SECONDS)")
_REPEATS = _at_most(_positive, MAX_REPEATS, "repeats (harness.limits.MAX_REPEATS)")
_THREADS = _at_most(_positive, MAX_THREADS, "threads (harness.limits.MAX_THREADS; a local run: the CPUs it may use)")


def _fmt_int(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def cmd_models(args) -> int:
    from harness.model.spec import builtin_models
    from harness.run.plan import resolve

    print(f"{'model':<16}{'params':>10}{'FLOPs/step':>12}  {'batch':>5} {'steps':>5}  {'input':<14}dataset")
    for name in builtin_models():
        spec, graph = resolve(name)
        print(f"{name:<16}{_fmt_int(graph.param_count):>10}{_fmt_int(graph.train_step_flops(spec.batch_size)):>12}"
              f"  {spec.batch_size:>5} {spec.steps:>5}  {'x'.join(map(str, spec.input.shape)):<14}"
              f"{spec.dataset.name} ({_task(spec)})")
    return 0


def _task(spec) -> str:
    return f"next token of {spec.classes}" if spec.dataset.next_token else f"{spec.classes} classes"


MEMORY_PRECISIONS = ("fp32", "amp_fp16", "amp_bf16", "fp16", "bf16", "bf16_kahan")  # what `check` estimates memory for


def cmd_check(args) -> int:
    from harness.model import data, memory
    from harness.model.optimizer import describe as describe_optimizer
    from harness.precision import parse_precision
    from harness.run.plan import resolve

    for path in args.specs:
        spec, graph = resolve(path)
        data.check(spec, path)
        if graph is None:
            _check_native(path, spec)
            continue
        estimates = [memory.estimate(graph, spec, parse_precision(p)) for p in MEMORY_PRECISIONS]
        smallest = min(estimates, key=lambda e: e.step_mb)
        memory.check_fits(spec, graph, [parse_precision(smallest.precision)], "auto", path)  # none fits: an error
        tokens = f" token ids of vocab {spec.input.vocab}" if spec.tokens else ""
        print(f"{path}: ok  {spec.name}  input {list(spec.input.shape)}{tokens}  {_task(spec)}  "
              f"spec_hash {spec.spec_hash()}")
        width = max(len(layer.path) + layer.path.count(".") for layer in graph.layers) + 2
        for layer in graph.layers:
            depth = layer.path.count(".") // 2
            print(f"  {('  ' * depth + layer.path):<{width}}{layer.type:<20}{str(list(layer.out_shape)):<18}"
                  f"{layer.param_count:>10,} params {_fmt_int(layer.flops):>9} FLOPs{_wiring(layer)}")
        print(f"  total {graph.param_count:,} parameters, {_fmt_int(graph.forward_flops)} forward FLOPs/sample, "
              f"{_fmt_int(graph.train_step_flops(spec.batch_size))} FLOPs per training step (batch {spec.batch_size})")
        print(f"  optimizer {describe_optimizer(spec.optimizer, spec.steps)}")
        print(f"  memory of a training step at batch {spec.batch_size} (estimate; the framework's own workspace "
              f"comes on top):")
        for e in estimates:
            parts = ", ".join(f"{name.replace('_', ' ')} {memory.fmt_mb(mb)}" for name, mb in e.parts_mb.items() if mb)
            print(f"    {e.precision:<9}{memory.fmt_mb(e.step_mb):>11}  ({parts})")
        in_memory = memory.dataset_mb(spec)
        if in_memory:
            print(f"    and the dataset, kept in memory: {memory.fmt_mb(in_memory)}")
        _print_block_storage(graph)
    return 0


def _print_block_storage(graph) -> None:
    """The matmul kernels' (dense, attention, convolution) size in each block-scaled format (scales included), beside float32's and
    bfloat16's: what a block-scaled kernel would read; the emulation keeps them in float32."""
    from harness.microscaling import RECIPES, weight_storage_bits

    sizes = {name: weight_storage_bits(graph, recipe) for name, recipe in RECIPES.items()}
    count = next(iter(sizes.values()))[1]
    if count:
        kib = lambda bits: f"{bits / 8 / 1024:,.1f} KiB"  # noqa: E731
        formats = ", ".join(f"{name} {kib(bits)}" for name, (bits, _) in sizes.items())
        print(f"  its {count:,} matmul weights, stored block-scaled (scales included): {formats}; "
              f"float32 {kib(32 * count)}, bfloat16 {kib(16 * count)}")


def _wiring(layer) -> str:
    """Where a layer's inputs come from, where not from the layer before it: "  <- 3, 7" (the list's input: "in")."""
    index = int(layer.path.rpartition(".")[2])
    if layer.sources == (index - 1,):
        return ""
    head = layer.path.rpartition(".")[0]
    return "  <- " + ", ".join("in" if s < 0 else f"{head}.{s}" if head else str(s) for s in layer.sources)


def _check_native(path: str, spec) -> None:
    """`check` of a native spec: what it names; built in its framework's worker where that adapter is installed."""
    from harness.adapter import discover
    from harness.model.native import describe
    from harness.model.optimizer import describe as describe_optimizer
    from harness.run.native import check_in_child

    framework = spec.native.framework
    built = check_in_child(spec, framework) if framework in discover() else None
    tokens = f" token ids of vocab {spec.input.vocab}" if spec.tokens else ""
    print(f"{path}: ok  {spec.name}  input {list(spec.input.shape)}{tokens}  {_task(spec)}  "
          f"spec_hash {spec.spec_hash()}")
    print(f"  {describe(spec)}")
    if built:
        print(f"  built by the {framework} adapter here: {built['params']:,} trainable parameters, output "
              f"{built['output']} for 2 samples")
    else:
        print(f"  the {framework} adapter is not installed here: its parameters are counted where it is")
    print(f"  optimizer {describe_optimizer(spec.optimizer, spec.steps)}")


def cmd_import(args) -> int:
    """`import keras MODEL` or `import torch MODULE:ATTR --input-shape ...`: another framework's model as a spec, on
    stdout or in -o FILE; one line per problem the spec cannot express (exit 2), a note per assumption (stderr).
    Keras's configuration is read as data here; a framework whose models are code imports through its adapter
    (Adapter.import_model), in the adapter's package."""
    from harness.model.importers import ImportOptions, ImportProblems, to_yaml
    from harness.results import prove_writable

    out = Path(args.output) if args.output else None
    if out is not None:
        prove_writable(out.parent, out.name, "-o")
    try:
        if args.framework == "keras":
            from harness.model.importers.keras import import_keras

            imported = import_keras(args.model, args.dataset, args.batch_size, args.steps)
        else:
            from harness.adapter import load_adapter

            options = ImportOptions(args.dataset, args.batch_size, args.steps)
            imported = load_adapter(args.framework).import_model(args.model, args.input_shape, options)
    except ImportProblems as exc:
        if args.debug:
            raise
        for line in exc.lines:
            print(f"amp-harness: error: {line}", file=sys.stderr)
        return 2
    for note in imported.notes:
        print(f"amp-harness: note: {note}", file=sys.stderr)
    text = to_yaml(imported.spec)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        print(f"wrote {out}; `amp-harness check {out}` shows its layers, parameters and memory")
    return 0


def _input_shape(text: str) -> tuple[int, ...]:
    """--input-shape: sizes without the batch axis, comma-separated ("3,224,224")."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not 1 <= len(shape) <= 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"'{clip(text, 40)}': give 1 to 3 positive sizes without the batch axis, "
                                         f"e.g. 3,224,224 (C,H,W), 784 (features) or 128 (token ids)")
    return shape


def cmd_adapters(args) -> int:
    from harness.adapter import discover
    from harness.run.cache import cache_file

    found = discover()
    if not found:
        print("no adapters installed (pip install -e adapters/torch, or use a tox env: tox -e torch)")
        return 0
    for name in sorted(found):
        # one framework per process: describe each adapter in its own subprocess (and each precision's capability
        # probe in one of its own, harness.run.capability)
        out = subprocess.run([sys.executable, "-m", "harness.run.worker", "adapter", name],
                             capture_output=True, text=True, timeout=1800)
        try:
            info = json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            print(f"{name}: probe failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
            continue
        if "error" in info:
            print(f"{name}: {info['error']}")
            continue
        dev = info["device"]
        print(f"{name} {info['version']}  ({found[name].value})  device {dev['name']}: {dev['description']}")
        print(f"  precisions as measured on this machine: the adapter's own limits, else a training step probed "
              f"here ({cache_file('capabilities')})")
        for precision, reason in info["precisions"].items():
            print(f"  {precision:<9} {'runs' if reason is None else 'unsupported: ' + reason}")
        for variant, what in info["variants"].items():
            print(f"  variant {variant}: {what}")
        if len(info["variants"]) > 1:
            print(f"  variant auto (the default of run and profile; fingerprint and diagnose take the first): the "
                  f"fastest of these for the run's model and precision, measured once on this machine "
                  f"({cache_file('variants')})")
    return 0


def plan_request(args, mode: Mode) -> PlanRequest:
    """The typed request of a command that trains (harness.run.modes.PlanRequest), from its parsed options; an
    option its parser does not have is not given."""
    from harness.run.executors import ExecutorOptions
    from harness.run.modes import PlanRequest

    return PlanRequest(mode=mode, framework=args.framework, models=args.model, matrix=getattr(args, "matrix", None),
                       precisions=args.precision, steps=args.steps, batch_size=args.batch_size,
                       input_size=args.input_size, loss_scale=args.loss_scale, growth_interval=args.growth_interval,
                       variants=args.variant, device=args.device, threads=args.threads,
                       warmup=getattr(args, "warmup", None), repeats=getattr(args, "repeats", None),
                       budget=getattr(args, "budget", None), every=getattr(args, "every", PlanRequest.every),
                       scales=getattr(args, "scales", None), batch_sizes=getattr(args, "batch_sizes", None),
                       widths=getattr(args, "widths", None), seq_lens=getattr(args, "seq_lens", None), out=args.out,
                       resume=args.resume, force=args.force, executor=ExecutorOptions.from_args(args))


def _run_mode(args, mode: Mode) -> tuple[list[dict], Plan]:
    """Plan the command's runs (harness.run.plan: every error before a worker starts), run them
    (harness.run.runner.execute), and say what came of them; its records and its Plan."""
    from harness.run.plan import plan
    from harness.run.runner import execute, summary_line

    planned = plan(plan_request(args, mode))
    show = sys.stderr.isatty() and not args.no_progress
    outcome = execute(planned, args.timeout, show)
    records = outcome.records
    if show:
        for r in records:
            print(summary_line(r))
    print(f"{len(records)} records appended to {planned.out / planned.filename}")
    if outcome.until is not None:
        for line in outcome.until.outcomes():
            print(line)
    if outcome.interrupted:
        print(f"interrupted after {len(records)} of {outcome.runs} runs; every finished run is recorded. "
              f"Resume with the same command plus --resume.", file=sys.stderr)
        raise SystemExit(130)
    broken = [r for r in records if r["status"] in NO_RESULT]  # ok, unsupported and diverged are results
    if broken:
        print(f"{len(broken)} of {len(records)} runs failed or timed out (each record says why); run the same "
              f"command plus --resume to run them again", file=sys.stderr)
    return records, planned


def _exit_code(records: list[dict]) -> int:
    return 1 if any(r["status"] in NO_RESULT for r in records) else 0


def cmd_run(args) -> int:
    from harness.run.modes import RUN

    return _exit_code(_run_mode(args, RUN)[0])


def cmd_fingerprint(args) -> int:
    from harness.run.modes import FINGERPRINT

    return _exit_code(_run_mode(args, FINGERPRINT)[0])


def cmd_diagnose(args) -> int:
    from harness.fp8 import verdicts as fp8_verdicts
    from harness.microscaling import block_verdicts
    from harness.run.modes import DIAGNOSE, NONFINITE
    from harness.run.nonfinite import describe

    if args.nonfinite:  # ordinary runs in the 16-bit precisions, each locating its first non-finite value
        records, _ = _run_mode(args, NONFINITE)
        for r in records:
            found = r.get("nonfinite")
            line = describe(found) if found else (
                f"no non-finite value in {len(r.get('loss') or [])} steps" if r["status"] == "ok" else r.get("reason"))
            print(f"{r['framework']} {r['model']} {r['precision']}: {r['status']}: {line}")
        return _exit_code(records)
    records, _ = _run_mode(args, DIAGNOSE)  # strict float32: what each 16-bit format would do is derived from it
    for r in records:
        diagnosis = r.get("diagnosis") or {}
        if r["status"] != "ok" or not diagnosis.get("available"):
            why = r.get("reason") or f"{r['framework']} cannot capture tensors (not available)"
            print(f"{r['framework']} {r['model']}: {r['status']}: {why}")
            continue
        steps = diagnosis["captured_steps"]
        print(f"{r['framework']} {r['model']} (captured after {len(steps)} steps: every {diagnosis['every']} "
              f"from {steps[0]}, and the last, {steps[-1]}):")
        for line in [*diagnosis["verdicts"].values(), *(diagnosis.get("attention") or {}).values(),
                     *fp8_verdicts(diagnosis.get("fp8") or {}, diagnosis["every"]).values(),
                     *block_verdicts(diagnosis.get("blocks") or {}, diagnosis.get("layer_types")).values()]:
            print(f"  {line}")
    return _exit_code(records)


def cmd_profile(args) -> int:
    from harness.run.modes import PROFILE
    from harness.run.profile import COVERAGE_TOLERANCE, table

    records, _ = _run_mode(args, PROFILE)
    for r in records:
        if r["status"] != "ok":
            print(f"{r['framework']} {r['model']} {r['precision']}: {r['status']}: {r.get('reason')}")
            continue
        print(table(r))
        coverage = r["profile"]["coverage"]
        if coverage is None or abs(coverage - 1) > COVERAGE_TOLERANCE:
            print(f"  warning: layers and parts account for {coverage:.0%} of the profiled step, beyond the "
                  f"{COVERAGE_TOLERANCE:.0%} the report trusts")
    return _exit_code(records)


def cmd_study(args) -> int:
    """`study loss-scale` (a sweep of loss scales) or `study scaling` (a grid of sizes: --batch-sizes, --widths,
    --seq-lens): ordinary runs tied by one study id, which the report reads."""
    from harness.run.modes import MODES, STUDY_SCALING

    mode = MODES[f"study {args.kind}"]
    records, planned = _run_mode(args, mode)
    shows = "the crossover" if mode is STUDY_SCALING else "them"
    print(f"study {planned.study}: {len(records)} runs; `amp-harness report {args.out or mode.out}` shows {shows}")
    return _exit_code(records)


def cmd_conformance(args) -> int:
    from harness.adapter import load_adapter
    from harness.conformance import run

    load_adapter(args.framework)  # an unknown name is one line and exit 2, not a failing test suite
    status = run(args.framework, args.pytest_args)
    print(f"conformance of {args.framework}: " + ("passed" if status == 0 else
          "FAILED: each failure above says what to fix" if status == 1 else f"pytest exited with {status}"))
    return int(status)


def cmd_parity(args) -> int:
    from harness.parity import compare, compare_diagnoses, diagnosis_table, table
    from harness.results import DIAGNOSES_FILE, FINGERPRINTS_FILE, read_records

    fingerprints = read_records(args.dirs, FINGERPRINTS_FILE)
    diagnosis_dirs = [d for d in args.dirs if (Path(d) / DIAGNOSES_FILE).exists()]
    found = read_records(diagnosis_dirs, DIAGNOSES_FILE) if diagnosis_dirs else []
    try:
        comparisons = compare(fingerprints)
        diagnoses = compare_diagnoses(found) if found else []
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as exc:
        raise _malformed_records(args.dirs, exc) from exc  # --debug shows where
    print(table(comparisons))
    if diagnoses:
        print()
        print(diagnosis_table(diagnoses))
    failed = [c for c in comparisons + diagnoses if c.failed]
    compared = [c for c in comparisons if c.compared] + diagnoses
    if failed:
        print(f"parity FAILED for {len(failed)} of {len(compared)} comparisons", file=sys.stderr)
        return 1
    if not compared:
        print("parity: nothing to compare (fingerprints of at least two frameworks are needed)", file=sys.stderr)
        return 1
    print(f"parity: {len(compared)} comparisons pass")
    return 0


def _malformed_records(dirs: list[str], exc: Exception) -> HarnessError:
    """Records that passed the field checks (harness.records) but hold something deeper that is not what
    amp-harness writes: one line, not a traceback."""
    return HarnessError(f"{', '.join(dirs)}: a record holds a value amp-harness does not write there "
                        f"({type(exc).__name__}: {clip(exc, 80)}); was the file edited?")


def cmd_report(args) -> int:
    from harness.report import write_report
    from harness.report.render import markdown_path
    from harness.results import (
        DIAGNOSES_FILE,
        FINGERPRINTS_FILE,
        PROFILES_FILE,
        prove_writable,
        read_records,
    )

    out = Path(args.output)
    for path in (out, markdown_path(out), out.with_suffix(".csv")):  # before reading: a failure costs nothing yet
        prove_writable(path.parent, path.name, "-o")
    records = read_records(args.dirs)
    parity_dirs = [d for d in args.parity or [] if (Path(d) / FINGERPRINTS_FILE).exists()]
    for missing in sorted(set(args.parity or []) - set(parity_dirs)):
        print(f"note: no {FINGERPRINTS_FILE} in {missing}; run `tox` first to show parity", file=sys.stderr)
    parity = read_records(parity_dirs, FINGERPRINTS_FILE) if parity_dirs else None
    diagnosis_dirs = [d for d in args.dirs + (args.diagnoses or []) if (Path(d) / DIAGNOSES_FILE).exists()]
    diagnoses = read_records(diagnosis_dirs, DIAGNOSES_FILE) if diagnosis_dirs else None
    profile_dirs = [d for d in args.dirs + (args.profiles or []) if (Path(d) / PROFILES_FILE).exists()]
    profiles = read_records(profile_dirs, PROFILES_FILE) if profile_dirs else None
    try:
        html, csv = write_report(records, out, parity, diagnoses, profiles)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as exc:
        raise _malformed_records(args.dirs, exc) from exc  # --debug shows where
    md = markdown_path(html)
    print(f"wrote {html} ({html.stat().st_size / 1024:.0f} KiB), {md} and {csv} from {len(records)} records")
    if args.format == "md":
        print(md.read_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="amp-harness", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list the built-in models").set_defaults(func=cmd_models)
    check = sub.add_parser("check", help="validate spec files (no framework needed)")
    check.add_argument("specs", nargs="+", metavar="SPEC")
    check.set_defaults(func=cmd_check)
    sub.add_parser("adapters", help="installed adapters and what they can run here").set_defaults(func=cmd_adapters)
    importer = sub.add_parser("import", help="another framework's model as a spec (keras: no framework needed)")
    frameworks = importer.add_subparsers(dest="framework", required=True)
    keras_import = frameworks.add_parser("keras", help="a Keras model: model.to_json() output or a .keras file "
                                         "(docs/import.md)")
    keras_import.add_argument("model", metavar="MODEL", help="a JSON file of model.to_json(), or a .keras file")
    torch_import = frameworks.add_parser("torch", help="a PyTorch nn.Module, traced by torch.fx in the torch adapter "
                                         "(docs/import.md)")
    torch_import.add_argument("model", metavar="MODULE:ATTR", help="an importable module (or a path/to/file.py) and "
                              "an attribute: an nn.Module, or a class or function of no arguments that returns one")
    torch_import.add_argument("--input-shape", required=True, type=_input_shape, metavar="SIZES",
                              help="one sample's input without the batch axis, in PyTorch's layout: C,H,W for "
                                   "images, F for vectors, T for token ids (into an nn.Embedding)")
    for p in (keras_import, torch_import):
        p.add_argument("--dataset", help="synthetic (default), digits, image_folder:PATH, text[:PATH] or "
                       "synthetic_tokens")
        p.add_argument("--batch-size", type=_positive, help="the spec's batch size (default 32)")
        p.add_argument("--steps", type=_STEPS, help="the spec's steps (default 100)")
        p.add_argument("-o", "--output", help="write the spec here instead of stdout")
        p.set_defaults(func=cmd_import)
    run = sub.add_parser("run", help="train a matrix of models x precisions in one framework")
    fingerprint = sub.add_parser("fingerprint", help="write parity fingerprints (outputs, K steps of losses)")
    diagnose = sub.add_parser("diagnose", help="is 16-bit safe for this model? fp32 training with tensor capture, "
                                               "reduced to histograms and verdicts")
    profile = sub.add_parser("profile", help="why is 16-bit slower here? per-layer times and compute dtypes under "
                             "the framework's own profiler (profiles.jsonl; never mixed with timed runs)")
    study = sub.add_parser("study", help="studies made of ordinary runs: `study loss-scale` sweeps loss scales, "
                           "`study scaling` batch sizes, widths and sequence lengths (where 16-bit starts to pay)")
    study.add_argument("kind", choices=["loss-scale", "scaling"])
    for p in (run, fingerprint, diagnose, study, profile):
        _add_matrix_options(p)
    profile.set_defaults(func=cmd_profile)
    diagnose.add_argument("--every", type=_STEPS, default=10, help="capture after every K steps (and the last)")
    diagnose.add_argument("--nonfinite", action="store_true",
                          help="instead: train in --precision (default amp_fp16,fp16) and name the first non-finite "
                               "value: the layer, pass and tensor of a divergence or of the first step the loss "
                               "scaler skipped, or the update that made a weight non-finite (results.jsonl)")
    diagnose.set_defaults(func=cmd_diagnose)
    study.add_argument("--scales", type=_csv,
                       help="loss-scale: the scales to sweep, e.g. none,1,2^4,2^8,2^16,2^24,2^32,dynamic")
    study.add_argument("--batch-sizes", type=_list_of(_positive, "batch sizes"),
                       help="scaling: batch sizes, e.g. 1,4,16,64,256")
    study.add_argument("--widths", type=_list_of(_width, "widths"),
                       help="scaling: factors on every layer's units, filters and dims (not the output layer's), "
                            "e.g. 0.5,1,2,4")
    study.add_argument("--seq-lens", type=_list_of(_positive, "sequence lengths"),
                       help="scaling, models of token ids only: sequence lengths, e.g. 64,128,256")
    study.add_argument("--warmup", type=_WARMUP, default=5)
    study.add_argument("--repeats", type=_REPEATS, default=MIN_REPEATS)
    study.set_defaults(func=cmd_study)
    for p in (run, fingerprint, diagnose, profile):
        p.add_argument("--matrix", help="a matrix file (models with overrides, precisions, loss scales, variants, "
                       "repeats), e.g. benchmarks/compare.yaml (fingerprint takes its models, sizes, precisions, loss "
                       "scales and variants; diagnose and profile its models and sizes)")
    run.add_argument("--warmup", type=_WARMUP, help="untimed steps before the timed ones (default 5)")
    run.add_argument("--repeats", type=_repeats,
                     help=f"runs of each cell, each in a fresh process (default {MIN_REPEATS}: the fewest that "
                          "give a 95%% interval), or auto: each cell once, then more, fewest first, until each has "
                          f"{MIN_REPEATS} (never cut) and its speed-up against fp32 is decided (faster, slower, or the "
                          "same within 5%%, by a sequential test whose 5%% error holds over all its looks) or the "
                          "budget is spent")
    run.add_argument("--budget", type=_SECONDS, help="seconds for --repeats auto's repeats after each cell's first "
                     "run (default 600)")
    run.set_defaults(func=cmd_run)
    fingerprint.set_defaults(func=cmd_fingerprint)
    conformance = sub.add_parser("conformance", help="check an adapter against the contract and the golden "
                                 "fingerprints (the conformance kit); exit 1 on a failure")
    conformance.add_argument("--framework", required=True)
    conformance.add_argument("pytest_args", nargs="*", metavar="PYTEST_ARG", help="after --, e.g. -- -x -k goldens")
    conformance.set_defaults(func=cmd_conformance)
    parity = sub.add_parser("parity", help="compare fingerprints across frameworks; exit 1 on a mismatch")
    parity.add_argument("dirs", nargs="+", metavar="DIR", help="directories holding fingerprints.jsonl")
    parity.set_defaults(func=cmd_parity)
    compare.add_parser(sub)
    export.add_parser(sub)
    report = sub.add_parser("report", help="render results as one self-contained HTML page (and a CSV)")
    report.add_argument("dirs", nargs="+", metavar="DIR", help="result directories or results.jsonl files")
    report.add_argument("-o", "--output", default="reports/index.html")
    report.add_argument("--parity", nargs="*", metavar="DIR", help="fingerprint directories to show parity from")
    report.add_argument("--diagnoses", nargs="*", metavar="DIR", help="diagnose directories (diagnoses.jsonl) for "
                        "the Numerics section; result directories holding one are read anyway")
    report.add_argument("--profiles", nargs="*", metavar="DIR", help="profile directories (profiles.jsonl) for "
                        "\"Where the time goes\"; result directories holding one are read anyway")
    report.add_argument("--format", choices=("html", "md"), default="html",
                        help="md: also print the Markdown summary (always written beside the page as .md)")
    report.set_defaults(func=cmd_report)
    return parser


def _add_matrix_options(run: argparse.ArgumentParser) -> None:
    run.add_argument("--framework", required=True)
    run.add_argument("--model", type=_csv, help="built-in names or spec paths, comma-separated")
    run.add_argument("--precision", type=_csv,
                     help="comma-separated: fp32, tf32, amp_fp16, amp_bf16, fp16, bf16 (fp64: parity reference)")
    run.add_argument("--steps", type=_STEPS, help="timed steps (run: default the spec's; fingerprint: 20)")
    run.add_argument("--batch-size", type=_positive)
    run.add_argument("--input-size", type=_size, help="HEIGHTxWIDTH for image models, e.g. 56x84")
    run.add_argument("--loss-scale", help="dynamic (default for amp_fp16), dynamic:INITIAL, a fixed number, none")
    run.add_argument("--growth-interval", default=2000, help="clean steps before the scale grows",
                     type=_at_most(_positive, MAX_GROWTH_INTERVAL, "steps (frameworks count them in 32 bits)"))
    run.add_argument("--variant", type=_csv, help="the framework's ways to run a step, comma-separated, all (see "
                     "`amp-harness adapters`), or auto (the default): the fastest here for the run's model and "
                     "precision, measured once per machine; fingerprint and diagnose take the adapter's first")
    run.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    run.add_argument("--threads", type=_THREADS, default=default_threads(),
                     help="intra-op threads, at most the CPUs this process may use (default: "
                          "$AMP_HARNESS_THREADS, else all of them)")
    run.add_argument("--timeout", type=_SECONDS, default=1800.0, help="seconds per run (default 1800)")
    run.add_argument("--out", help="output directory (run: ./results; fingerprint: ./parity)")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--resume", action="store_true", help="skip runs already recorded in the output directory")
    run.add_argument("--force", action="store_true", help="run even when the memory estimate exceeds what this "
                     "machine has (see `amp-harness check`)")
    add_executor_arguments(run)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except HarnessError as exc:
        if args.debug:
            raise
        print(f"amp-harness: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("amp-harness: interrupted; finished runs are recorded (run again with --resume)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
