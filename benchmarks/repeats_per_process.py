"""What a timed repeat costs, and where its spread comes from: processes as the unit, repeats inside one.

    python benchmarks/repeats_per_process.py FRAMEWORK MODEL [--processes 6] [--per-process 4] [--batch-size N]
        [--steps N] [--precision fp32,amp_bf16]

runs, per precision and interleaved (fp32, amp_bf16, fp32, ...), `--processes` worker processes each of which runs
`--per-process` repeats of the cell one after another (the framework imported once; each repeat builds its own
trainer from its own seed), then prints per precision: the wall time of a process and of a repeat inside it, the
spread of the repeats' medians between processes (their first repeat, as `run` times them today) and within a
process, and a one-way analysis of variance of the log medians: the share of the spread that
is the process's own (the intraclass correlation). Run it in the framework's env (`.tox/torch/bin/python ...`) on
an otherwise idle machine; the figures are in benchmarks/RESULTS.md, "Cheaper evidence".
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict

import numpy as np

from harness.run.plan import resolve, run_id, stamp_now
from harness.run.process import run_group
from harness.run.worker import RunRequest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("framework")
    p.add_argument("model")
    p.add_argument("--processes", type=int, default=6)
    p.add_argument("--per-process", type=int, default=4)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", default="fp32,amp_bf16")
    args = p.parse_args()
    os.environ.setdefault("AMP_HARNESS_CACHE", tempfile.mkdtemp(prefix="amp-harness-cache-"))
    spec, _ = resolve(args.model, args.batch_size, args.steps)
    precisions = args.precision.split(",")
    medians: dict[str, list[list[float]]] = {q: [] for q in precisions}
    walls: dict[str, list[float]] = {q: [] for q in precisions}
    for proc in range(args.processes):
        for precision in precisions:
            first = proc * args.per_process
            reqs = [RunRequest(args.framework, args.model, spec.model_dump(mode="json"), precision,
                               run_id(args.framework, args.model, precision, "default", None, r, stamp_now()),
                               repeat=r, warmup=args.warmup, threads=int(os.environ.get("AMP_HARNESS_THREADS", 2)))
                    for r in range(first, first + args.per_process)]
            started = time.monotonic()
            records = run_group(reqs, 600.0)
            walls[precision].append(time.monotonic() - started)
            bad = [r for r in records if r["status"] != "ok"]
            if bad:
                print(f"{precision}: {bad[0]['status']}: {bad[0].get('reason')}", file=sys.stderr)
                return 1
            medians[precision].append([r["step_time_ms"]["median"] for r in records])
            print(f"process {proc} {precision}: {time.monotonic() - started:.1f} s, medians "
                  + " ".join(f"{m:.3f}" for m in medians[precision][-1]), file=sys.stderr, flush=True)
    print(f"{args.framework} {spec.name} batch {spec.batch_size}, {spec.steps} steps, warmup {args.warmup}; "
          f"{args.processes} processes x {args.per_process} repeats per precision")
    for precision in precisions:
        y = np.log(np.asarray(medians[precision]))  # [process, repeat]
        k, m = y.shape
        between = y.mean(axis=1).var(ddof=1) * m  # one-way ANOVA mean squares
        within = ((y - y.mean(axis=1, keepdims=True)) ** 2).sum() / (k * (m - 1)) if m > 1 else float("nan")
        process_var = max(0.0, (between - within) / m)
        icc = process_var / (process_var + within) if m > 1 else float("nan")
        run_s = np.mean([w / m for w in walls[precision]])
        print(f"  {precision}: process {np.mean(walls[precision]):.1f} s for {m} repeats; spread of first repeats "
              f"between processes {y[:, 0].std(ddof=1):.1%}, of repeats within a process "
              f"{math.sqrt(within) if m > 1 else float('nan'):.1%}; process share of the variance (ICC) {icc:.2f}; "
              f"first repeat {np.exp(y[:, 0]).mean():.3f} ms, later {np.exp(y[:, 1:]).mean():.3f} ms; "
              f"{run_s:.1f} s per repeat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
