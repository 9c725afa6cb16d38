"""One batch of requests in a worker subprocess of this machine (`python -m harness.run.worker`), whatever
happens to it: the code both executors run (the local one directly, Ray's on its node), apart from the runner
that drives them, so that neither imports the other. Each request carries its resolved spec (harness.run.plan):
nothing here reads a spec file."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from harness import results
from harness.precision import parse_loss_scale, parse_precision
from harness.run.request import RunRequest

STDERR_TAIL_LINES = 8


def _before_exec(cpus: set[int]):
    """In the worker, before exec: get SIGKILL if the runner dies (Linux), so no orphan runs on; run on `cpus`
    where given (a job slot of the local executor: harness.limits.slot_cpus)."""
    def setup() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


def _stderr_tail(path: Path) -> str:
    lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    return " | ".join(lines[-STDERR_TAIL_LINES:])


def run_group(reqs: list[RunRequest], timeout_s: float, on_progress=None, on_record=None,
              python: str = sys.executable, cpus: set[int] = frozenset()) -> list[dict]:
    """Run requests one after another in one subprocess (untimed runs of one framework and precision: the
    process start, a framework import of seconds, is paid once) and return their records, whatever happens to
    the process: the run it died in gets the failure, and the ones after it run again each in a process of
    its own. `on_record(record)` is called as each record is known; if it raises (a full disk), the worker is
    killed and the exception reaches the caller: a record that cannot be kept must stop the matrix, not vanish
    in the progress-reader thread. `python` is the interpreter of the framework's environment; `cpus`, where
    given, the CPUs it runs on."""
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
                                    preexec_fn=_before_exec(cpus))

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
        rest = [r for q in reqs[len(done) + 1:]
                for r in run_group([q], timeout_s, on_progress, on_record, python, cpus)]
        return done + [record] + rest


def failure_record(req: RunRequest, status: str, reason: str, started: float) -> dict:
    """The record of a run whose worker gave none (it crashed, hung, or never started: a lost node)."""
    spec = req.resolved_spec()  # as planned: no file is read again
    record = results.empty_record(run_id=req.run_id, framework=req.framework, model=spec.name,
                                  spec_hash=spec.spec_hash(), num_classes=spec.classes,
                                  **results.sequence_fields(spec),
                                  precision=req.precision, repeat=req.repeat, warmup_steps=req.warmup,
                                  batch_size=spec.batch_size, width=spec.width, steps=spec.steps,
                                  variant=req.variant,
                                  wall_s=round(time.time() - started, 3), status=status, reason=reason,
                                  study=req.study, auto_round=req.auto_round)
    # the settings harness.identity.run_key reads: what ties this run to its rerun by --resume
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
