"""`amp-harness compare SPEC [--budget 10m]`: one command from a model to the answer.

It runs the spec in every framework environment it finds, each in its own interpreter (one framework per
process, as everywhere: TensorFlow and MXNet cannot share numpy): timed runs of every headline precision
(PRECISIONS; the ones the device cannot run come back `unsupported` with their reason) with `--repeats auto`,
then `diagnose` (is 16-bit safe for it?) and `profile` (where its 16-bit step's time goes), all into one
directory, and renders the report from it.

The environments, found as the Ray executor finds them: the tox env of each built-in framework
(harness.run.executors.TOX_DIR/FRAMEWORK/bin/python, built by `tox -e FRAMEWORK`), then this interpreter for the
adapters installed in it, then `--python FRAMEWORK=PATH`, which replaces either.

The budget is shared out as the runs go: each framework still to run gets an equal share of what is left; of
that share, RUN_SHARE goes to `--repeats auto` (its --budget, which the run spreads over its cells), and diagnose
and profile run only while the share lasts. A cell's first MIN_REPEATS repeats are never cut, so a slow model can
overrun the budget: the closing line says by how much.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from harness.adapter import discover
from harness.errors import HarnessError
from harness.run.executors import TOX_DIR

FRAMEWORKS = ("torch", "tensorflow", "mxnet", "jax")  # the built-in adapters, each with its tox env
PRECISIONS = ("fp32", "tf32", "amp_bf16", "amp_fp16", "bf16", "fp16")
PROFILED = ("fp32", "amp_bf16", "amp_fp16")
RUN_SHARE = 0.6  # of a framework's share of the budget, for the timed runs' auto repeats
DIAGNOSE_STEPS, DIAGNOSE_EVERY = 20, 5
DEFAULT_BUDGET_S = 600.0
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


def compare(spec: str, out: Path, envs: dict[str, str], total_s: float, precisions: list[str],
            steps: int | None) -> tuple[dict[str, list[str]], float]:
    """Every step of the comparison in every environment; ({framework: the steps that failed}, seconds taken)."""
    started = time.monotonic()
    failed: dict[str, list[str]] = {}
    common = ["--model", spec, "--out", str(out), "--no-progress"]
    for i, (framework, python) in enumerate(envs.items()):
        share = (total_s - (time.monotonic() - started)) / (len(envs) - i)
        deadline = time.monotonic() + share
        run_s = max(1.0, share * RUN_SHARE)
        print(f"compare: {framework} ({python}): {share:.0f} s of the budget; --repeats auto within {run_s:.0f} s "
              f"after each precision's first run", flush=True)
        steps_arg = ["--steps", str(steps)] if steps else []
        plan = [("run", ["run", "--framework", framework, "--precision", ",".join(precisions), "--repeats", "auto",
                         "--budget", f"{run_s:.0f}", *steps_arg, *common]),
                ("diagnose", ["diagnose", "--framework", framework, "--steps", str(steps or DIAGNOSE_STEPS),
                              "--every", str(DIAGNOSE_EVERY), *common]),
                ("profile", ["profile", "--framework", framework,
                             "--precision", ",".join(p for p in PROFILED if p in precisions), *common])]
        for name, args in plan:
            if name != "run" and time.monotonic() >= deadline:
                print(f"compare: {framework}: {name} skipped: its share of the budget is spent", flush=True)
                continue
            if _harness(python, *args) not in (0, 1):  # 1: some runs failed, their records say why
                failed.setdefault(framework, []).append(name)
    return failed, time.monotonic() - started


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
    if model.native is not None:  # the user's own model runs in its framework alone
        native = model.native
        for framework in envs:
            if framework != native.framework:
                print(f"compare: {framework}: not run: a native {native.kind} model runs in {native.framework}; "
                      f"`amp-harness import {native.kind} {native.target} ...` translates it to a spec that it runs")
        if native.framework not in envs:
            raise HarnessError(f"{args.spec}: a native {native.kind} model runs in {native.framework}, and no "
                               f"{native.framework} environment was found (`tox -e {native.framework}`)")
        envs = {native.framework: envs[native.framework]}
    precisions = [p.strip() for p in args.precision.split(",")] if args.precision else list(PRECISIONS)
    if "fp32" not in precisions:
        raise HarnessError("--precision must hold fp32, the baseline every comparison is over")
    if args.steps is not None and args.steps < 1:
        raise HarnessError(f"--steps {args.steps}: at least 1")
    out = Path(args.out)
    print(f"compare: {', '.join(envs)}; precisions {', '.join(precisions)}; budget {args.budget:.0f} s; into {out}")
    failed, took = compare(spec, out, envs, args.budget, precisions, args.steps)
    report = out / "index.html"
    # the report reads the directory's diagnoses and profiles too
    code = subprocess.run([sys.executable, "-m", "harness", "report", str(out), "-o", str(report)]).returncode
    over = f", {took - args.budget:.0f} s over the budget" if took > args.budget else ""
    print(f"compare: {took:.0f} s{over}; the answer: {report}")
    for framework, steps in failed.items():
        print(f"compare: {framework}: {', '.join(steps)} failed (see above)", file=sys.stderr)
    return 1 if failed or code else 0
