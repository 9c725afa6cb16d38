"""The run matrix: every (model, precision, repeat) of one framework, each in a fresh subprocess.

A run that crashes, is killed or outlives its timeout still becomes a record (status, reason, last lines of
stderr) and the matrix goes on. Only plain data crosses back from a worker: its JSON record.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from harness import results
from harness.precision import loss_scale_key, parse_loss_scale, parse_precision
from harness.run.worker import RunRequest

STDERR_TAIL_LINES = 8


def matrix(framework: str, cells: list[tuple[str, dict]], precisions: list[str], repeats: int,
           variants: list[str], loss_scales: list[str | None] = (None,), **common) -> list[RunRequest]:
    """Requests for every (model with its overrides) x repeat x variant x loss scale x precision, in that
    order: the precisions, scales and variants of a model take turns (fp32, amp_bf16, amp_fp16, fp32, ...), so
    that a drift of the machine during the matrix spreads over all of them instead of falling on one.

    A cell's own "loss_scales" (a matrix file's) replace `loss_scales` for the precisions that scale the loss
    by default (amp_fp16); the others run once, unscaled."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    requests = []
    for (m, overrides), r, v in itertools.product(cells, range(repeats), variants):
        own = overrides.get("loss_scales")
        for i, scale in enumerate(own or loss_scales):
            for p in precisions:
                s = scale
                if own is not None and parse_precision(p).default_loss_scale == "none":
                    if i:
                        continue
                    s = None
                requests.append(RunRequest(
                    framework=framework, model=m, precision=p, repeat=r, variant=v, loss_scale=s,
                    run_id=f"{framework}-{Path(m).stem}-{p}-{v}{'-' + s if s else ''}-r{r}-{stamp}-{uuid.uuid4().hex[:6]}",
                    **{**common, **{key: val for key, val in overrides.items() if val is not None and key != "loss_scales"}}))
    return requests


def _die_with_parent() -> None:
    """In the worker, before exec: get SIGKILL if the runner dies (Linux), so no orphan runs on."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stderr_tail(path: Path) -> str:
    lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    return " | ".join(lines[-STDERR_TAIL_LINES:])


def run_one(req: RunRequest, timeout_s: float, on_progress=None) -> dict:
    """Run one request in a subprocess and return its record, whatever happens to the process."""
    return run_group([req], timeout_s, on_progress)[0]


def run_group(reqs: list[RunRequest], timeout_s: float, on_progress=None, on_record=None) -> list[dict]:
    """Run requests one after another in one subprocess (untimed runs of one framework and precision: the
    process start, a framework import of seconds, is paid once) and return their records, whatever happens to
    the process: the run it died in gets the failure, and the ones after it run again each in a process of
    its own. `on_record(record)` is called as each record is known."""
    with tempfile.TemporaryDirectory(prefix="amp-harness-") as tmp:
        tmp = Path(tmp)
        request_file, record_file, stderr_file = tmp / "request.json", tmp / "record.json", tmp / "stderr.txt"
        request_file.write_text(json.dumps([asdict(q) for q in reqs]))
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(reqs[0].threads),
                   MKL_NUM_THREADS=str(reqs[0].threads))
        started = time.time()
        done: list[dict] = []

        def finished(i: int) -> None:  # the worker wrote record i
            done.append(json.loads(Path(f"{record_file}.{i}").read_text()))
            if on_record:
                on_record(done[-1])

        with open(stderr_file, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "harness.run.worker", str(request_file), str(record_file)],
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                    start_new_session=True,  # its own group: Ctrl-C reaches the runner only
                                    preexec_fn=_die_with_parent)
            reader = threading.Thread(target=_read_progress, args=(proc.stdout, on_progress, finished), daemon=True)
            reader.start()
            try:
                code = proc.wait(timeout=timeout_s * len(reqs))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
            except KeyboardInterrupt:  # a second Ctrl-C: abort the run in progress too
                os.killpg(proc.pid, signal.SIGKILL)
                raise
            reader.join(timeout=5)
        if len(done) == len(reqs):
            return done
        req = reqs[len(done)]  # the run the process died in
        spec = req.resolved_spec()  # validated before the matrix started
        record = results.empty_record(run_id=req.run_id, framework=req.framework, model=spec.name,
                                      spec_hash=spec.spec_hash(), num_classes=spec.dataset.num_classes,
                                      precision=req.precision, repeat=req.repeat, warmup_steps=req.warmup,
                                      batch_size=spec.batch_size, steps=spec.steps,
                                      wall_s=round(time.time() - started, 3))
        if code is None:
            record.update(status="timeout", reason=f"killed after the {timeout_s:g} s timeout")
        else:
            how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            if code == -signal.SIGKILL:
                how += " (out of memory? the kernel's OOM killer sends SIGKILL)"
            tail = _stderr_tail(stderr_file)
            record.update(status="failed", reason=f"worker {how}" + (f": {tail}" if tail else ""))
        if on_record:
            on_record(record)
        rest = [r for q in reqs[len(done) + 1:] for r in run_group([q], timeout_s, on_progress, on_record)]
        return done + [record] + rest


def _read_progress(stream, on_progress, finished) -> None:
    for line in stream:
        parts = line.split()
        if on_progress and len(parts) == 3 and parts[0] == "progress":
            on_progress(int(parts[1]), int(parts[2]))
        elif len(parts) == 2 and parts[0] == "record":
            finished(int(parts[1]))


def run_key(framework: str, spec_hash: str, precision: str, variant: str | None, loss_scale: str,
            repeat: int) -> tuple:
    """What identifies a run for --resume (loss_scale as harness.precision.loss_scale_key gives it)."""
    return framework, spec_hash, precision, variant, loss_scale, repeat


def _request_key(q: RunRequest) -> tuple:
    settings = parse_loss_scale(q.loss_scale, parse_precision(q.precision), q.growth_interval).to_dict()
    return run_key(q.framework, q.resolved_spec().spec_hash(), q.precision, q.variant, loss_scale_key(settings),
                   q.repeat)


def pending(requests: list[RunRequest], out_dir: Path, filename: str) -> list[RunRequest]:
    """The requests that have no record in out_dir yet (whatever that record's status)."""
    if not (out_dir / filename).exists():
        return requests
    done = {run_key(r["framework"], r.get("spec_hash"), r["precision"], r.get("variant"),
                    loss_scale_key((r.get("loss_scale") or {}).get("settings")), r["repeat"])
            for r in results.read_records([out_dir], filename)}
    return [q for q in requests if _request_key(q) not in done]


def run_matrix(requests: list[RunRequest], out_dir: Path, timeout_s: float, show_progress: bool,
               filename: str = results.RESULTS_FILE) -> tuple[list[dict], bool]:
    """Run every request, appending each record to out_dir/filename as soon as it is known. Ctrl-C stops
    after the current run (a second one aborts it); returns the records and whether it was interrupted."""
    from tqdm import tqdm

    records, stop = [], []

    def on_sigint(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(True)
        print("\nCtrl-C: stopping after the current run (Ctrl-C again aborts it)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    bar = tqdm(total=len(requests), desc="runs", unit="run", disable=not show_progress, position=0)
    steps = tqdm(total=0, desc="steps", unit="step", disable=not show_progress, position=1, leave=False)
    try:
        _run_all(requests, out_dir, timeout_s, show_progress, filename, records, stop, bar, steps)
    finally:
        signal.signal(signal.SIGINT, previous)
        steps.close()
        bar.close()
    return records, bool(stop)


UNTIMED = ("fingerprint", "diagnose")  # modes whose runs of one precision may share a process


def _batches(requests: list[RunRequest]) -> list[list[RunRequest]]:
    """Timed runs alone, in the matrix's interleaved order; untimed runs grouped by everything that is set
    process-wide (framework, precision, device, threads, variant), so each group shares one process."""
    batches: dict[tuple, list[RunRequest]] = {}
    for i, q in enumerate(requests):
        key = (q.mode, q.framework, q.precision, q.device, q.threads, q.variant) if q.mode in UNTIMED else (i,)
        batches.setdefault(key, []).append(q)
    return list(batches.values())


def _run_all(requests, out_dir, timeout_s, show_progress, filename, records, stop, bar, steps) -> None:
    def on_record(record: dict) -> None:
        results.append(out_dir, record, filename)
        records.append(record)
        bar.update(1)
        if not show_progress:
            print(summary_line(record), file=sys.stderr, flush=True)

    def on_progress(step: int, total: int) -> None:
        steps.total = total
        steps.n = step
        steps.refresh()

    for batch in _batches(requests):
        if stop:
            break
        req = batch[0]
        bar.set_postfix_str(f"{req.framework} {Path(req.model).stem} {req.precision} r{req.repeat}")
        steps.reset()
        run_group(batch, timeout_s, on_progress if show_progress else None, on_record)


def summary_line(r: dict) -> str:
    median = (r.get("step_time_ms") or {}).get("median")
    timing = f"{median:9.2f} ms/step" if median else " " * 16
    acc = f"eval acc {r['eval_accuracy']:.3f}" if r.get("eval_accuracy") is not None else ""
    line = f"{r['framework']:<10} {str(r['model']):<14} {r['precision']:<9} r{r['repeat']}  {r['status']:<11} {timing}  {acc}"
    return line + (f"  ({r['reason']})" if r.get("reason") and r["status"] != "ok" else "")
