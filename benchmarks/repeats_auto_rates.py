"""How often `run --repeats auto` calls two equally fast precisions "faster" or "slower", and how often it finds a
true 1.25x speed-up, each rate with its 95% Clopper-Pearson interval.

    python benchmarks/repeats_auto_rates.py simulated [RUNS]   # default 2000: the runner's own decision code
    python benchmarks/repeats_auto_rates.py real [RUNS]        # default 40: whole `amp-harness run` commands
    python benchmarks/repeats_auto_rates.py small [RUNS]       # default 300: small differences at a 300 s budget

`simulated` drives harness.run.runner.UntilDecided through tests/core/test_repeats_auto.py's simulated_verdict
(8% per-process noise and 3% more per repeat, 6 s a process's start and 3 s a repeat in it, so that a process
runs 3 repeats after the first round; the default budget). `real` runs `run --framework fake --precision fp32,amp_bf16 --repeats auto
--budget 30` with the test adapter's `jitter` fault on both precisions (each step sleeps 10 ms times a per-process
factor, 8%, and a per-step one, 5%: the precisions differ in nothing; a process runs 4 repeats, its steps taking far
less than its start), 4 at a time. `small`: how often the same simulation decides the 5-10% differences that
`tox -m compare` meets (5% noise per process, its 300 s budget).
Run from the repository root in an env with the core (`tox -e core`: .tox/core/bin/python).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scipy.stats import binomtest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VERDICT = re.compile(r"amp_bf16 against fp32 \(variant default\): (?:decided after \d+ repeats(?: in \d+ processes)?"
                     r"(?: \(fp32 [^)]+\))?: (faster|slower|same)|budget ran out)")


def rate(name: str, verdicts: Counter, wrong: tuple[str, ...], seconds: float) -> None:
    runs, k = sum(verdicts.values()), sum(verdicts[v] for v in wrong)
    ci = binomtest(k, runs).proportion_ci(0.95)
    print(f"{name}: {dict(verdicts)}; {' or '.join(wrong)}: {k}/{runs} = {k / runs:.1%} (95% CI "
          f"{ci.low:.1%}-{ci.high:.1%}); {seconds:.0f} s", flush=True)


def simulated(runs: int) -> None:
    from tests.core.test_repeats_auto import NOISE, RUN_S, START_S, WITHIN, simulated_verdict

    for speed_up, wrong in ((1.0, ("faster", "slower")), (1.25, ("slower", "same", "none"))):
        started = time.perf_counter()
        verdicts = Counter(simulated_verdict(speed_up, seed) for seed in range(runs))
        rate(f"simulated, true speed-up {speed_up}x, {NOISE:.0%} noise per process and {WITHIN:.0%} per repeat, "
             f"{START_S:g} s a process's start and {RUN_S:g} s a repeat", verdicts, wrong,
             time.perf_counter() - started)


def small(runs: int) -> None:
    import tests.core.test_repeats_auto as simulation
    from tests.core.test_repeats_auto import simulated_verdict

    simulation.NOISE = 0.05
    for speed_up in (1.0, 0.95, 0.93, 0.90):
        started = time.perf_counter()
        verdicts = Counter(simulated_verdict(speed_up, seed, budget_s=300.0) for seed in range(runs))
        rate(f"simulated, true speed-up {speed_up}x, 5% noise per process, 300 s budget", verdicts,
             ("faster", "slower", "same"), time.perf_counter() - started)


def real_run(_: int) -> str:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "fake_adapter"), str(ROOT)]),
                   AMP_FAKE_FAULTS="fp32=jitter,amp_bf16=jitter", AMP_HARNESS_CACHE=str(Path(out) / "cache"))
        done = subprocess.run([sys.executable, "-m", "harness", "run", "--framework", "fake", "--model",
                               "tests/specs/pitfall_batchnorm.yaml", "--precision", "fp32,amp_bf16", "--steps", "20",
                               "--warmup", "2", "--repeats", "auto", "--budget", "30", "--no-progress", "--out", out],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        found = VERDICT.search(done.stdout)
        if done.returncode != 0 or not found:
            return f"error {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}"
        print(done.stdout.strip().splitlines()[-1], flush=True)
        return found[1] or "none"


def real(runs: int) -> None:
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # the steps sleep: four runs at a time leave the 2 cores to spare
        verdicts = Counter(pool.map(real_run, range(runs)))
    rate("real, two precisions that differ in nothing", verdicts, ("faster", "slower"), time.perf_counter() - started)


if __name__ == "__main__":
    mode, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None
    {"simulated": lambda: simulated(runs or 2000), "small": lambda: small(runs or 300),
     "real": lambda: real(runs or 40)}[mode]()
