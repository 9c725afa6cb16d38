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
from harness.run.executors import LocalExecutor
from harness.run.worker import RunRequest

STDERR_TAIL_LINES = 8


def matrix(framework: str, cells: list[tuple[str, dict]], precisions: list[str], repeats: int,
           variants: list[str], loss_scales: list[str | None] = (None,), **common) -> list[RunRequest]:
    """Requests for every (model with its overrides) x repeat x variant x loss scale x precision, in that
    order: the precisions, scales and variants of a model take turns (fp32, amp_bf16, amp_fp16, fp32, ...), so
    that a drift of the machine during the matrix spreads over all of them instead of falling on one.

    A cell's own "loss_scales" (a matrix file's) replace `loss_scales` for the precisions that scale the loss
    by default (amp_fp16); the others run once, unscaled. A cell's own "precisions" replace `precisions`."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    requests = []
    for (m, overrides), r, v in itertools.product(cells, range(repeats), variants):
        own = overrides.get("loss_scales")
        for i, scale in enumerate(own or loss_scales):
            for p in overrides.get("precisions") or precisions:  # a matrix file's model may name its own
                s = scale
                if own is not None and parse_precision(p).default_loss_scale == "none":
                    if i:
                        continue
                    s = None
                requests.append(RunRequest(
                    framework=framework, model=m, precision=p, repeat=r, variant=v, loss_scale=s,
                    run_id=f"{framework}-{Path(m).stem}-{p}-{v}{'-' + s if s else ''}-r{r}-{stamp}-{uuid.uuid4().hex[:6]}",
                    **{**common, **{key: val for key, val in overrides.items() if val is not None and key not in ("loss_scales", "precisions")}}))
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


def run_group(reqs: list[RunRequest], timeout_s: float, on_progress=None, on_record=None,
              python: str = sys.executable) -> list[dict]:
    """Run requests one after another in one subprocess (untimed runs of one framework and precision: the
    process start, a framework import of seconds, is paid once) and return their records, whatever happens to
    the process: the run it died in gets the failure, and the ones after it run again each in a process of
    its own. `on_record(record)` is called as each record is known; if it raises (a full disk), the worker is
    killed and the exception reaches the caller: a record that cannot be kept must stop the matrix, not vanish
    in the progress-reader thread. `python` is the interpreter of the framework's environment."""
    with tempfile.TemporaryDirectory(prefix="amp-harness-") as tmp:
        tmp = Path(tmp)
        request_file, record_file, stderr_file = tmp / "request.json", tmp / "record.json", tmp / "stderr.txt"
        request_file.write_text(json.dumps([asdict(q) for q in reqs]))
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(reqs[0].threads),
                   MKL_NUM_THREADS=str(reqs[0].threads))
        started = time.time()
        done: list[dict] = []
        raised: list[BaseException] = []

        with open(stderr_file, "w") as err:
            proc = subprocess.Popen([python, "-m", "harness.run.worker", str(request_file), str(record_file)],
                                    stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                    start_new_session=True,  # its own group: Ctrl-C reaches the runner only
                                    preexec_fn=_die_with_parent)

            def finished(i: int) -> None:  # the worker wrote record i (called in the reader thread)
                if raised:
                    return
                done.append(json.loads(Path(f"{record_file}.{i}").read_text()))
                try:
                    if on_record:
                        on_record(done[-1])
                except BaseException as exc:
                    raised.append(exc)
                    os.killpg(proc.pid, signal.SIGKILL)

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
        if raised:
            raise raised[0]
        if len(done) == len(reqs):
            return done
        req = reqs[len(done)]  # the run the process died in
        if code is None:
            record = failure_record(req, "timeout", f"killed after the {timeout_s:g} s timeout", started)
        else:
            how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            if code == -signal.SIGKILL:
                how += " (out of memory? the kernel's OOM killer sends SIGKILL)"
            tail = _stderr_tail(stderr_file)
            record = failure_record(req, "failed", f"worker {how}" + (f": {tail}" if tail else ""), started)
        if on_record:
            on_record(record)
        rest = [r for q in reqs[len(done) + 1:] for r in run_group([q], timeout_s, on_progress, on_record, python)]
        return done + [record] + rest


def failure_record(req: RunRequest, status: str, reason: str, started: float) -> dict:
    """The record of a run whose worker gave none (it crashed, hung, or never started: a lost node)."""
    spec = req.resolved_spec()  # validated before the matrix started
    record = results.empty_record(run_id=req.run_id, framework=req.framework, model=spec.name,
                                  spec_hash=spec.spec_hash(), num_classes=spec.dataset.num_classes,
                                  precision=req.precision, repeat=req.repeat, warmup_steps=req.warmup,
                                  batch_size=spec.batch_size, steps=spec.steps, variant=req.variant,
                                  wall_s=round(time.time() - started, 3), status=status, reason=reason,
                                  study=req.study)
    # the settings results.record_key reads: what ties this run to its rerun by --resume
    settings = parse_loss_scale(req.loss_scale, parse_precision(req.precision), req.growth_interval).to_dict()
    record["loss_scale"] = {"settings": settings}
    return record


def _read_progress(stream, on_progress, finished) -> None:
    for line in stream:
        parts = line.split()
        if on_progress and len(parts) == 3 and parts[0] == "progress":
            on_progress(int(parts[1]), int(parts[2]))
        elif len(parts) == 2 and parts[0] == "record":
            finished(int(parts[1]))


def _request_key(q: RunRequest) -> tuple:
    settings = parse_loss_scale(q.loss_scale, parse_precision(q.precision), q.growth_interval).to_dict()
    return q.framework, q.resolved_spec().spec_hash(), q.precision, q.variant, loss_scale_key(settings), q.repeat


def pending(requests: list[RunRequest], out_dir: Path, filename: str) -> list[RunRequest]:
    """The requests that have no result in out_dir yet: no record, or only records of runs that failed or timed
    out (run again; the report keeps the latest record of a run)."""
    if not (out_dir / filename).exists():
        return requests
    done = {results.record_key(r) for r in results.read_records([out_dir], filename)
            if r.get("status") not in results.NO_RESULT}
    return [q for q in requests if _request_key(q) not in done]


def run_matrix(requests: list[RunRequest], out_dir: Path, timeout_s: float, show_progress: bool,
               filename: str = results.RESULTS_FILE, executor=None) -> tuple[list[dict], bool]:
    """Run every request, appending each record to out_dir/filename as soon as it is known. Ctrl-C stops
    after the current run (a second one aborts it); returns the records and whether it was interrupted."""
    from tqdm import tqdm

    records, stop = [], []
    executor = executor or LocalExecutor()
    in_flight = getattr(executor, "in_flight", "the current run")

    def on_sigint(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(True)
        print(f"\nCtrl-C: stopping after {in_flight} (Ctrl-C again aborts it)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    bar = tqdm(total=len(requests), desc="runs", unit="run", disable=not show_progress, position=0)
    steps = tqdm(total=0, desc="steps", unit="step", disable=not show_progress, position=1, leave=False)
    try:
        _run_all(requests, out_dir, timeout_s, show_progress, filename, records, stop, bar, steps, executor)
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


def _run_all(requests, out_dir, timeout_s, show_progress, filename, records, stop, bar, steps, executor) -> None:
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

    def on_batch(batch: list[RunRequest]) -> None:
        req = batch[0]
        bar.set_postfix_str(f"{req.framework} {Path(req.model).stem} {req.precision} r{req.repeat}")
        steps.reset()

    executor.run_batches(_batches(requests), timeout_s, on_progress if show_progress else None, on_record, stop,
                         on_batch)


def summary_line(r: dict) -> str:
    median = (r.get("step_time_ms") or {}).get("median")
    timing = f"{median:9.2f} ms/step" if median else " " * 16
    acc = f"eval acc {r['eval_accuracy']:.3f}" if r.get("eval_accuracy") is not None else ""
    line = f"{r['framework']:<10} {str(r['model']):<14} {r['precision']:<9} r{r['repeat']}  {r['status']:<11} {timing}  {acc}"
    return line + (f"  ({r['reason']})" if r.get("reason") and r["status"] != "ok" else "")
