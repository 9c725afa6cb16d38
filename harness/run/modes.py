"""The commands that train, in one table: what each runs in its worker, whether its step times are measured, what
it writes, and the defaults and rules of its options. The CLI, the planner (harness.run.plan), the runner, the
executors and the worker read it, and none of them tells modes apart otherwise.

Two levels: a Work is what a worker process does with a run once its trainer is built (a RunRequest's `mode` names
it); a Mode is a command as the user types it (`run`, `study scaling`, `diagnose --nonfinite`, ...), which runs
one Work with defaults and rules of its own."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from harness.errors import HarnessError
from harness.identity import SCALING_STUDY
from harness.results import DIAGNOSES_FILE, FINGERPRINTS_FILE, PROFILES_FILE, RESULTS_FILE
from harness.run import profile
from harness.run.diagnose import diagnose
from harness.run.executors import ExecutorOptions
from harness.run.fingerprint import fingerprint
from harness.run.request import BuiltRun
from harness.run.train import train

if TYPE_CHECKING:  # for annotations only
    from harness.adapter import Adapter, Device


@dataclass(frozen=True)
class Work:
    """What a worker does with a run once its trainer is built."""
    name: str  # RunRequest.mode
    run: Callable[[BuiltRun], None]  # fills the run's record
    # its step times are a result: each run has a process to itself (else the runs of one framework and precision
    # share one, harness.run.runner) and the machine to itself (no --jobs; --pack is warned about)
    timed: bool
    # repeat r trains from the spec's seed + r (harness.run.worker.run_seed): independent draws; else the spec's
    # own seed, which parity and the golden fingerprints compare
    seed_per_repeat: bool = False
    refusal: Callable[[Adapter, Device], str | None] | None = None  # why an adapter cannot do it on a device


def _diagnose(run: BuiltRun) -> None:
    diagnose(run.spec, run.layers, run.data, run.masks, run.trainer, run.record, run.request.every, run.progress)


def _profile(run: BuiltRun) -> None:
    profile.profile(run.spec, run.layers, run.data, run.masks, run.trainer, run.record, run.request.warmup,
                    run.progress)


WORKS = {work.name: work for work in (
    Work("run", train, timed=True, seed_per_repeat=True),  # harness.run.train
    Work("fingerprint", fingerprint, timed=False),  # harness.run.fingerprint
    Work("diagnose", _diagnose, timed=False),  # harness.run.diagnose
    Work("profile", _profile, timed=True, refusal=profile.refusal),  # harness.run.profile
)}


def work(name: str) -> Work:
    """The Work a RunRequest's `mode` names."""
    try:
        return WORKS[name]
    except KeyError:
        raise HarnessError(f"no mode '{name}' (the modes: {', '.join(WORKS)})") from None


@dataclass(frozen=True)
class Mode:
    """A command that trains: the Work it runs, the records file it appends to, its options' defaults, and what it
    takes from a matrix file."""
    command: str  # as the user types it
    work: Work
    filename: str  # the records file, in --out
    out: str  # --out's default
    precisions: tuple[str, ...] = ("fp32",)  # --precision's default
    steps: int | None = None  # --steps' default (None: the spec's), also for the models a matrix file gives none
    repeats: int | None = None  # the repeats of every run; None: --repeats, a matrix file's, else stats.MIN_REPEATS
    warmup: int | None = None  # the warm-up steps of every run; None: --warmup, a matrix file's, else DEFAULT_WARMUP
    warmup_as_steps: bool = False  # as many warm-up steps as --steps (profile: the profiled steps' twins)
    fastest_variant: bool = False  # --variant auto (the default) runs the fastest here; else the adapter's first
    matrix: str | None = None  # the `commands` entry of a matrix file's models it takes; None: it takes no --matrix
    # what it takes from a matrix file: of the top level (precisions, warmup, repeats, budget, steps) and of each
    # model's entry (batch_size, input_size, steps, precisions, loss_scales, variants)
    from_matrix: tuple[str, ...] = ()
    nonfinite: bool = False  # its runs also locate the first step the loss scaler skipped (RunRequest.nonfinite)
    study: str | None = None  # how the id tying its runs together starts (RunRequest.study)
    rules: Callable[[PlanRequest], PlanRequest] | None = None  # its own checks of the options, and what they imply
    native: bool = False  # it takes native specs (the user's own model object: harness.run.native)


DEFAULT_WARMUP = 5  # warm-up steps of a timed run (run --warmup)
SIZES = ("batch_size", "input_size", "steps")
ARMS = ("precisions", "loss_scales", "variants")


@dataclass(frozen=True)
class PlanRequest:
    """What a command asks the planner for (harness.run.plan.plan): its Mode and its options as given; None: not
    given (the mode's default, or a matrix file's)."""
    mode: Mode
    framework: str
    models: list[str] | None = None  # built-in names or spec paths
    matrix: str | None = None  # a matrix file (harness.run.matrix), instead of `models`
    precisions: list[str] | None = None
    steps: int | None = None
    batch_size: int | None = None
    input_size: tuple[int, int] | None = None
    loss_scale: str | None = None
    growth_interval: int = 2000
    variants: list[str] | None = None
    device: str = "auto"
    threads: int = 1
    warmup: int | None = None
    repeats: int | str | None = None  # a number, or "auto" (harness.run.runner.UntilDecided)
    budget: float | None = None  # seconds, for --repeats auto
    every: int = 10  # diagnose: capture after every this many steps
    scales: list[str] | None = None  # study loss-scale: the loss scales to sweep
    batch_sizes: list[int] | None = None  # study scaling: the sizes to vary
    widths: list[float] | None = None
    seq_lens: list[int] | None = None
    out: str | None = None  # the output directory
    resume: bool = False
    force: bool = False  # past the memory guard
    executor: ExecutorOptions = ExecutorOptions()


def _diagnose_rules(request: PlanRequest) -> PlanRequest:
    if request.precisions:
        raise HarnessError("diagnose trains in strict float32 (what each 16-bit format would do is derived from it): "
                           "--precision goes with --nonfinite")
    return request


def _loss_scale_study_rules(request: PlanRequest) -> PlanRequest:
    for option in ("batch_sizes", "widths", "seq_lens"):
        if getattr(request, option) is not None:
            raise HarnessError(f"--{option.replace('_', '-')}: only `study scaling` varies sizes")
    if not request.scales:
        raise HarnessError("study loss-scale: --scales is required, e.g. --scales none,2^8,2^16,dynamic")
    return request


def _scaling_study_rules(request: PlanRequest) -> PlanRequest:
    """Sizes to vary, no sizes fixed, and fp32 first among the precisions: the speed-ups are over it."""
    if request.scales:
        raise HarnessError("--scales: the loss-scale study's; `study scaling` runs each precision's default scaling")
    for option, instead in (("batch_size", "--batch-sizes"), ("input_size", None)):
        if getattr(request, option) is not None:
            raise HarnessError(f"--{option.replace('_', '-')}: `study scaling` takes "
                               + (f"{instead} (a list)" if instead else "the spec's input size"))
    if not (request.batch_sizes or request.widths or request.seq_lens):
        raise HarnessError("study scaling: give the sizes to vary: --batch-sizes, --widths and/or --seq-lens")
    precisions = request.precisions or list(request.mode.precisions)
    if "fp32" not in precisions:
        raise HarnessError("study scaling: --precision must hold fp32, the baseline every speed-up is over")
    return replace(request, precisions=["fp32", *[p for p in precisions if p != "fp32"]])


_TRAIN, _FINGERPRINT, _DIAGNOSE, _PROFILE = (WORKS[name] for name in ("run", "fingerprint", "diagnose", "profile"))

RUN = Mode("run", _TRAIN, RESULTS_FILE, "results", fastest_variant=True, matrix="run",
           from_matrix=("precisions", "warmup", "repeats", "budget", *SIZES, *ARMS), native=True)
FINGERPRINT = Mode("fingerprint", _FINGERPRINT, FINGERPRINTS_FILE, "parity", steps=20, repeats=1, warmup=0,
                   matrix="fingerprint", from_matrix=("precisions", *SIZES, *ARMS))
DIAGNOSE = Mode("diagnose", _DIAGNOSE, DIAGNOSES_FILE, "diagnoses", repeats=1, warmup=0, matrix="diagnose",
                from_matrix=SIZES, rules=_diagnose_rules, native=True)  # strict float32: 16-bit formats derived
NONFINITE = Mode("diagnose --nonfinite", _TRAIN, RESULTS_FILE, "diagnoses", precisions=("amp_fp16", "fp16"), repeats=1,
                 warmup=0, nonfinite=True, native=True)
PROFILE = Mode("profile", _PROFILE, PROFILES_FILE, "profiles", precisions=("fp32", "amp_fp16", "amp_bf16"), steps=5,
               repeats=1, warmup_as_steps=True, matrix="profile", from_matrix=("batch_size", "input_size"),
               native=True)
STUDY_LOSS_SCALE = Mode("study loss-scale", _TRAIN, RESULTS_FILE, "results", fastest_variant=True,
                        study="loss-scale-", rules=_loss_scale_study_rules, native=True)
STUDY_SCALING = Mode("study scaling", _TRAIN, RESULTS_FILE, "results", precisions=("fp32", "amp_bf16", "amp_fp16"),
                     fastest_variant=True, study=SCALING_STUDY, rules=_scaling_study_rules, native=True)

MODES = {mode.command: mode for mode in (RUN, FINGERPRINT, DIAGNOSE, NONFINITE, PROFILE, STUDY_LOSS_SCALE,
                                         STUDY_SCALING)}
