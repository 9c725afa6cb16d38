"""Where the runs of a matrix execute: the local executor (the default: one subprocess after another on this
machine) or a Ray cluster (harness.run.executors.ray_cluster). The runner above is the same for both: matrix,
records, --resume, Ctrl-C, progress, exit codes.

An executor is what the Executor protocol below says. The requests it gets carry their resolved specs
(harness.run.plan), so it ships no spec file anywhere and rewrites no path.

This module imports nothing heavy, and never Ray: the CLI imports it to add its options, and the default
install has no Ray."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from harness.errors import HarnessError
from harness.run.executors.local import LocalExecutor

if TYPE_CHECKING:
    from harness.run.request import RunRequest

__all__ = ["Executor", "ExecutorOptions", "LocalExecutor", "add_executor_arguments", "make_executor"]


@runtime_checkable
class Executor(Protocol):
    """Where the runs of a plan execute (harness.run.runner.run_matrix drives it)."""

    name: str  # what each record's env.executor says
    in_flight: str  # what a first Ctrl-C waits for, in the runner's message

    def run_batches(self, batches: list[list[RunRequest]], timeout_s: float,
                    on_progress: Callable[[int, int], None] | None, on_record: Callable[[dict], None], stop: list,
                    on_batch: Callable[[list[RunRequest]], None]) -> None:
        """Run each batch (requests that share one worker process), calling `on_batch(batch)` as it starts and
        `on_record(record)` for every record as it is known (in the calling thread or the progress reader's; an
        exception from it must stop the executor and reach its caller); start no batch once `stop` is non-empty
        (Ctrl-C)."""

#: where `tox` builds each framework's environment, the default interpreter of a framework's runs on a cluster
TOX_DIR = Path(__file__).resolve().parents[3] / ".tox"
DEFAULT_RETRIES = 2
MAX_JOBS = 64  # --jobs: processes at a time (more than the CPUs share them: harness.limits.slot_cpus)


def _python(text: str) -> tuple[str, str]:
    framework, sep, path = text.partition("=")
    if not sep or not framework.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"'{text}' is not FRAMEWORK=PATH, e.g. torch=/opt/envs/torch/bin/python")
    return framework.strip(), path.strip()


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of processes from 1 to {MAX_JOBS}")
    return value


def _retries(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 10:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of retries from 0 to 10")
    return value


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `run`, `fingerprint`, `diagnose` and `study` that choose the executor."""
    group = parser.add_argument_group("executor", "where the runs execute (docs/cluster.md)")
    group.add_argument("--executor", choices=("local", "ray"), default="local",
                       help="local: one run after another on this machine (default); ray: the runs as Ray tasks "
                            "on a cluster, each in its own worker process on its node (pip install -e .[ray])")
    group.add_argument("--address", help="ray: HOST:PORT of the cluster's head, or 'auto' for the cluster this "
                                         "machine has joined (default: a one-node Ray started for this call)")
    group.add_argument("--python", type=_python, action="append", metavar="FRAMEWORK=PATH",
                       help="ray: the interpreter of the framework's environment, at this path on every node "
                            f"(default: the tox env, {TOX_DIR}/FRAMEWORK/bin/python); repeatable")
    group.add_argument("--pack", action="store_true",
                       help="ray: let runs share a node (one CPU each, a quarter of a GPU) when their timing does "
                            "not matter (fingerprints, diagnoses); by default a run has a GPU or a node to itself")
    group.add_argument("--jobs", type=_jobs, default=1,
                       help="local, fingerprint and diagnose only: run this many processes at a time (their timing "
                            "does not matter; give each --threads 1 where the jobs fill the CPUs); default 1")
    group.add_argument("--retries", type=_retries, default=None,
                       help=f"ray: tries again of a run whose task was lost with its node or worker (default "
                            f"{DEFAULT_RETRIES}); then it is recorded failed with the Ray error")


@dataclass(frozen=True)
class ExecutorOptions:
    """The executor options as given (add_executor_arguments)."""
    executor: str = "local"
    address: str | None = None
    python: list[tuple[str, str]] | None = None  # (framework, interpreter) pairs
    pack: bool = False
    jobs: int = 1
    retries: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ExecutorOptions:
        return cls(args.executor, args.address, args.python, args.pack, args.jobs, args.retries)


def make_executor(options: ExecutorOptions, framework: str, timed: bool) -> Executor:
    """The executor the options ask for, for runs of `framework`; `timed`: their step times are a result
    (harness.run.modes.Work.timed), so they never share the machine."""
    if options.jobs > 1 and (options.executor != "local" or timed):
        raise HarnessError(f"--jobs {options.jobs}: only for fingerprint and diagnose with the local executor (a timed "
                           f"run has the machine to itself; on a cluster, --pack)")
    if options.executor == "local":
        given = [name for name, value in (("--address", options.address), ("--python", options.python),
                                          ("--pack", options.pack), ("--retries", options.retries))
                 if value is not None and value is not False]  # 0 retries is given too
        if given:
            raise HarnessError(f"{', '.join(given)}: only with --executor ray")
        return LocalExecutor(options.jobs)
    if importlib.util.find_spec("ray") is None:
        raise HarnessError("--executor ray: Ray is not installed in this environment (pip install -e '.[ray]', "
                           "see docs/cluster.md)")
    pythons = dict(options.python or [])
    python = pythons.get(framework, str(TOX_DIR / framework / "bin" / "python"))
    if not Path(python).is_absolute():
        raise HarnessError(f"--python {framework}={python}: give an absolute path (the same on every node)")
    if options.address is None and not Path(python).exists():  # the cluster is this machine: check it now
        raise HarnessError(f"--executor ray: no interpreter for {framework} at {python} (build it with "
                           f"`tox -e {framework}` or give --python {framework}=PATH)")
    if options.pack and timed:
        print("note: --pack: runs share nodes, so their step times are disturbed by each other; the records say "
              "placement 'packed'", file=sys.stderr)
    from harness.run.executors.ray_cluster import RayExecutor

    return RayExecutor(address=options.address, python=python, pack=options.pack,
                       retries=DEFAULT_RETRIES if options.retries is None else options.retries)
