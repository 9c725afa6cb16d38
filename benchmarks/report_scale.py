"""How the report scales: render `amp-harness report` over N generated records (default 10,000: 50 models x 4
frameworks x 5 precisions x 10 repeats, 200 timed steps and losses each) and print the time and the page's size.

    python benchmarks/report_scale.py [--records 10000] [--out /tmp/report-scale]

The records are synthetic but complete (every field the report reads); the figures are this machine's, measured
now: compare them only with figures measured in the same session.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

FRAMEWORKS = ("torch", "tensorflow", "mxnet", "jax")
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "bf16", "fp16")
STEPS = 200


def records(n: int = 10_000, seed: int = 0) -> list[dict]:
    from harness.results import empty_record

    rng = np.random.default_rng(seed)
    out = []
    models = max(1, n // (len(FRAMEWORKS) * len(PRECISIONS) * 10))
    for i in range(n):
        model, rest = divmod(i, len(FRAMEWORKS) * len(PRECISIONS) * 10)
        framework, rest = divmod(rest, len(PRECISIONS) * 10)
        precision, repeat = divmod(rest, 10)
        base_ms = 5.0 * (1 + model % 7) * (1.0 if precision == 0 else 0.8 + 0.1 * precision)
        model = f"model_{model % models:03d}"
        steps = (base_ms * rng.lognormal(0, 0.05, STEPS)).tolist()
        loss = (2.3 * np.exp(-np.arange(STEPS) / 80) + rng.normal(0, 0.02, STEPS)).tolist()
        out.append(empty_record(
            run_id=f"scale-{i}", framework=FRAMEWORKS[framework], framework_version="1.0", model=model,
            spec_hash=f"{model}-hash", num_classes=10, precision=PRECISIONS[precision], variant="eager",
            device="cpu", status="ok", batch_size=64, steps=STEPS, warmup_steps=5, repeat=repeat,
            step_time_ms={"median": float(np.median(steps))}, step_times_ms=steps, first_step_ms=steps[0] * 3,
            samples_per_s=64 / np.median(steps) * 1e3, peak_memory_mb=100.0 + 10 * precision,
            memory_kind="process peak RSS", state_memory_mb={"weights": 1.0, "gradients": 1.0, "optimizer_state": 2.0},
            loss=loss, final_train_loss=loss[-1], eval_loss=0.3, eval_accuracy=0.9 - 0.01 * precision,
            loss_scale={"settings": {"mode": "dynamic" if PRECISIONS[precision] == "amp_fp16" else "none",
                                     "initial": 65536.0, "growth_interval": 2000}},
            flops_per_step=10**9, param_count=10**5, env={"threads": 2, "device": {"description": "test cpu"}},
            started_at="2026-11-30T00:00:00+00:00", wall_s=1.0))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--out", default="/tmp/report-scale")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        for r in records(args.records):
            f.write(json.dumps(r) + "\n")
    from harness.cli import main as amp

    started = time.perf_counter()
    code = amp(["report", str(out), "-o", str(out / "report" / "index.html")])
    seconds = time.perf_counter() - started
    size = (out / "report" / "index.html").stat().st_size
    print(f"report over {args.records} records: {seconds:.1f} s, page {size / 2**20:.2f} MiB (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
