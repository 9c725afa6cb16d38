"""`amp-harness compare SPEC [--budget 10m]`: one command from a model to the answer.

It runs the spec in every framework environment it finds, each in its own interpreter (one framework per
process, as everywhere: TensorFlow and MXNet cannot share numpy): timed runs of every headline precision
(PRECISIONS; the ones the device cannot run come back `unsupported` with their reason) with `--repeats auto`,
then `diagnose` (is 16-bit safe for it?) and `profile` (where its 16-bit step's time goes), all into one
directory, and renders the report from it.

The environments, found as the Ray executor finds them: the tox env of each built-in framework
(harness.run.executors.TOX_DIR/FRAMEWORK/bin/python, built by `tox -e FRAMEWORK`), then this interpreter for the
adapters installed in it, then `--python FRAMEWORK=PATH`, which replaces either.

A native spec (the user's own model object: docs/native.md) runs as it is in its own framework. Its network is
also translated by `amp-harness import` (in that framework's environment), and where the importer can say it in the
spec language, the translated spec ("NAME_imported": the native spec's data, loss, optimizer and sizes around the
imported layers and input) runs in every environment, its own framework's included, so that the frameworks are
compared on one network; the translated spec starts from the spec's own initial weights, not the model's. Where
the importer refuses, its reason is said and the native model is all that runs.

The budget is shared out as the runs go: each run of a spec in a framework still to come gets an equal share of
what is left; of that share, RUN_SHARE goes to `--repeats auto` (its --budget, which the run spreads over its
cells), and diagnose and profile run only while the share lasts. A cell's first MIN_REPEATS repeats are never cut,
so a slow model can overrun the budget: the closing line says by how much.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from harness.adapter import discover
from harness.errors import HarnessError, one_line
from harness.model.spec import ModelSpec
from harness.run.executors import TOX_DIR

FRAMEWORKS = ("torch", "tensorflow", "mxnet", "jax")  # the built-in adapters, each with its tox env
PRECISIONS = ("fp32", "tf32", "amp_bf16", "amp_fp16", "bf16", "fp16")
PROFILED = ("fp32", "amp_bf16", "amp_fp16")
RUN_SHARE = 0.6  # of a framework's share of the budget, for the timed runs' auto repeats
DIAGNOSE_STEPS, DIAGNOSE_EVERY = 20, 5
DEFAULT_BUDGET_S = 600.0
IMPORT_TIMEOUT_S = 600  # tracing a large model on a slow CPU
UNITS = {"s": 1, "m": 60, "h": 3600}


def budget(text: str) -> float:
    """"600", "90s", "10m", "1.5h": seconds, from 10 s to a day."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text)
    seconds = float(match.group(1)) * UNITS[match.group(2) or "s"] if match else -1
    if not 10 <= seconds <= 86400:
        raise argparse.ArgumentTypeError(f"'{text}' is not a budget from 10 s to a day (e.g. 600, 90s, 10m, 1h)")
    return seconds


def environments(pythons: dict[str, str], only: list[str] | None = None) -> dict[str, str]:
    """The interpreter of each framework's environment (see the module's docstring), limited to `only`."""
    found = {f: str(TOX_DIR / f / "bin" / "python") for f in FRAMEWORKS if (TOX_DIR / f / "bin" / "python").exists()}
    for name in discover():
        found.setdefault(name, sys.executable)
    found.update(pythons)
    if only:
        missing = [f for f in only if f not in found]
        if missing:
            raise HarnessError(f"--frameworks: no environment for {', '.join(missing)} (build one with `tox -e "
                               f"{missing[0]}`, install its adapter here, or give --python {missing[0]}=PATH)")
        found = {f: found[f] for f in only}
    if not found:
        raise HarnessError(f"no framework environment found: no tox env under {TOX_DIR} and no adapter installed "
                           f"here (run `tox` first, pip install -e adapters/torch, or give --python F=PATH)")
    return found


def _harness(python: str, *args: str) -> int:
    """`python -m harness ARGS` in that environment, its output passed through; its exit code."""
    print(f"$ {Path(python).name} -m harness {' '.join(args)}", flush=True)
    try:
        return subprocess.run([python, "-m", "harness", *args]).returncode
    except OSError as exc:
        print(f"compare: cannot start {python}: {exc.strerror}", file=sys.stderr)
        return 2


class Job(NamedTuple):
    """One spec's runs, diagnosis and profile in one framework's environment."""
    framework: str
    python: str
    spec: str  # a built-in model's name or a spec file's path


def translate(model: ModelSpec, python: str, out: Path) -> tuple[Path | None, str]:
    """A native spec's network translated by `amp-harness import`, run in `python` (its framework's environment):
    (the translated spec's file under `out`, ""), or (None, the importer's reason in one line)."""
    from harness.model.importers import to_yaml
    from harness.model.spec import validate
    from harness.model.yaml_file import read_yaml

    native = model.native
    if native.kind == "keras" and not native.target.endswith(".keras"):
        return None, "import keras reads a saved .keras file (or model.to_json()), not a builder: save its model"
    shape = ["--input-shape", ",".join(map(str, model.input.shape))] if native.kind == "torch" else []
    with tempfile.TemporaryDirectory() as folder:
        imported_file = Path(folder) / "imported.yaml"
        try:
            done = subprocess.run([python, "-m", "harness", "import", native.kind, native.target, *shape, "-o",
                                   str(imported_file)], capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"import did not finish: {one_line(exc)}"
        if done.returncode != 0:
            errors = [line.removeprefix("amp-harness: error: ") for line in done.stderr.splitlines()
                      if line.startswith("amp-harness: error: ")]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            return None, (errors[0] + more) if errors else f"import exited {done.returncode}"
        imported = read_yaml(imported_file, HarnessError)
    data = model.model_dump(mode="json", exclude_defaults=True, exclude={"native"})
    data.update(name=f"{model.name}_imported", layers=imported["layers"],
                input={"vocab": model.input.vocab, **imported["input"]} if model.input.vocab else imported["input"])
    translated = out / f"{model.name}_imported.yaml"
    out.mkdir(parents=True, exist_ok=True)
    try:
        validate(data, str(translated))
    except HarnessError as exc:  # the imported layers against the native spec's loss or dataset
        return None, f"the imported network does not fit the spec: {exc}"
    translated.write_text(to_yaml(data))
    return translated, ""


def compare(jobs: list[Job], out: Path, total_s: float, precisions: list[str],
            steps: int | None) -> tuple[dict[str, list[str]], float]:
    """Every step of the comparison for every job; ({"framework (spec)": the steps that failed}, seconds taken)."""
    started = time.monotonic()
    failed: dict[str, list[str]] = {}
    for i, job in enumerate(jobs):
        share = (total_s - (time.monotonic() - started)) / (len(jobs) - i)
        deadline = time.monotonic() + share
        run_s = max(1.0, share * RUN_SHARE)
        label = job.framework if len(jobs) == len({j.framework for j in jobs}) else \
            f"{job.framework} ({Path(job.spec).stem})"
        print(f"compare: {label} ({job.python}): {share:.0f} s of the budget; --repeats auto within {run_s:.0f} s "
              f"after each precision's first run", flush=True)
        common = ["--framework", job.framework, "--model", job.spec, "--out", str(out), "--no-progress"]
        steps_arg = ["--steps", str(steps)] if steps else []
        plan = [("run", ["run", "--precision", ",".join(precisions), "--repeats", "auto", "--budget", f"{run_s:.0f}",
                         *steps_arg, *common]),
                ("diagnose", ["diagnose", "--steps", str(steps or DIAGNOSE_STEPS), "--every", str(DIAGNOSE_EVERY),
                              *common]),
                ("profile", ["profile", "--precision", ",".join(p for p in PROFILED if p in precisions), *common])]
        for name, args in plan:
            if name != "run" and time.monotonic() >= deadline:
                print(f"compare: {label}: {name} skipped: its share of the budget is spent", flush=True)
                continue
            if _harness(job.python, *args) not in (0, 1):  # 1: some runs failed, their records say why
                failed.setdefault(label, []).append(name)
    return failed, time.monotonic() - started


def native_jobs(model: ModelSpec, spec: str, envs: dict[str, str], out: Path) -> list[Job]:
    """A native spec's jobs: the model as it is in its framework, then its translation (`translate`) in every
    environment; the importer's reason said once where it refuses."""
    native = model.native
    if native.framework not in envs:
        raise HarnessError(f"{spec}: a native {native.kind} model runs in {native.framework}, and no "
                           f"{native.framework} environment was found (`tox -e {native.framework}`)")
    jobs = [Job(native.framework, envs[native.framework], spec)]
    translated, why = translate(model, envs[native.framework], out)
    if translated is None:
        others = ", ".join(f for f in envs if f != native.framework)
        print(f"compare: the model runs in {native.framework} only{f' (not in {others})' if others else ''}: "
              f"`amp-harness import {native.kind}` cannot translate it: {why}", flush=True)
        return jobs
    print(f"compare: `amp-harness import {native.kind}` translated the model to {translated}: it runs in "
          f"{', '.join(envs)} beside the model itself", flush=True)
    return jobs + [Job(framework, python, str(translated)) for framework, python in envs.items()]


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="one command from a model to the answer: every framework env found, every "
                                       "precision, diagnose, profile, report (docs/compare.md)")
    p.add_argument("spec", metavar="SPEC", help="a built-in model's name or a spec file")
    p.add_argument("--budget", type=budget, default=DEFAULT_BUDGET_S,
                   help="time for the whole comparison: 600, 90s, 10m, 1h (default 10m)")
    p.add_argument("--out", default="results/compare", help="where the records and the report go "
                                                             "(default results/compare)")
    p.add_argument("--frameworks", help="only these, comma-separated (default: every environment found)")
    p.add_argument("--precision", help=f"comma-separated (default {','.join(PRECISIONS)})")
    p.add_argument("--steps", type=int, help="timed steps per run (default: the spec's) and diagnose's steps "
                                             f"(default {DIAGNOSE_STEPS})")
    p.add_argument("--python", action="append", metavar="FRAMEWORK=PATH",
                   help="the interpreter of a framework's environment (default: its tox env); repeatable")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    from harness.model.spec import load_spec

    model = load_spec(args.spec)  # a bad spec is one line here, not one per framework
    spec = str(Path(args.spec).resolve()) if Path(args.spec).exists() else args.spec  # a built-in's name
    pythons = {}
    for item in args.python or []:
        framework, sep, path = item.partition("=")
        if not sep or not framework or not path:
            raise HarnessError(f"--python {item}: not FRAMEWORK=PATH")
        pythons[framework] = path
    envs = environments(pythons, [f.strip() for f in args.frameworks.split(",")] if args.frameworks else None)
    precisions = [p.strip() for p in args.precision.split(",")] if args.precision else list(PRECISIONS)
    if "fp32" not in precisions:
        raise HarnessError("--precision must hold fp32, the baseline every comparison is over")
    if args.steps is not None and args.steps < 1:
        raise HarnessError(f"--steps {args.steps}: at least 1")
    out = Path(args.out)
    print(f"compare: {', '.join(envs)}; precisions {', '.join(precisions)}; budget {args.budget:.0f} s; into {out}")
    jobs = [Job(framework, python, spec) for framework, python in envs.items()] if model.native is None else \
        native_jobs(model, spec, envs, out)
    failed, took = compare(jobs, out, args.budget, precisions, args.steps)
    report = out / "index.html"
    # the report reads the directory's diagnoses and profiles too
    code = subprocess.run([sys.executable, "-m", "harness", "report", str(out), "-o", str(report)]).returncode
    over = f", {took - args.budget:.0f} s over the budget" if took > args.budget else ""
    print(f"compare: {took:.0f} s{over}; the answer: {report}")
    for label, steps in failed.items():
        print(f"compare: {label}: {', '.join(steps)} failed (see above)", file=sys.stderr)
    return 1 if failed or code else 0
