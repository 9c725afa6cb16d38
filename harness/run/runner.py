"""The run matrix: every (model, precision, repeat) of one framework, each in a fresh subprocess. `execute` runs
the Plan that harness.run.plan made of a command's options (its requests carry their resolved specs).

A run that crashes, is killed or outlives its timeout still becomes a record (harness.run.process) and the matrix
goes on. Only plain data crosses back from a worker: its JSON record. With `--repeats auto` (UntilDecided) the
matrix grows a round of repeats at a time until every comparison with fp32 is decided or the time budget is spent.
"""
from __future__ import annotations

import math
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from harness import results, stats
from harness.identity import request_key, run_key
from harness.run.executors import Executor, LocalExecutor
from harness.run.modes import work
from harness.run.plan import Plan, run_id, stamp_now
from harness.run.request import RunRequest

AUTO = "auto"  # the variant `--variant auto` asks for (harness.run.variants.AUTO)
DECIDED = stats.DECIDED  # the decisions that stop --repeats auto




def pending(requests: list[RunRequest], out_dir: Path, filename: str) -> list[RunRequest]:
    """The requests that have no result in out_dir yet: no record, or only records of runs that failed or timed
    out (run again; the report keeps the latest record of a run)."""
    if not (out_dir / filename).exists():
        return requests
    done = {run_key(r) for r in results.read_records([out_dir], filename)
            if r.get("status") not in results.NO_RESULT}
    return [q for q in requests if request_key(q) not in done]


def run_matrix(requests: list[RunRequest], out_dir: Path, timeout_s: float, show_progress: bool,
               filename: str = results.RESULTS_FILE, executor: Executor | None = None) -> tuple[list[dict], bool]:
    """Run every request, appending each record to out_dir/filename as soon as it is known. Ctrl-C stops
    after the current run (a second one aborts it); returns the records and whether it was interrupted."""
    from tqdm import tqdm

    records, stop = [], []
    executor = executor or LocalExecutor()
    in_flight = executor.in_flight

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


class UntilDecided:
    """`--repeats auto`: one budget (`budget_s`) spread over the matrix's cells. Every cell runs once first, outside
    the budget (each gets a figure, and these runs also measure once-per-machine facts: peaks, the fastest
    variant), then the budget's clock starts (`start`): round after round, in the matrix's order
    (fp32, amp_bf16, amp_fp16, fp32, ...), one more process of every cell that has fewer than stats.MIN_REPEATS
    processes or whose speed-up against its fp32 cell (same framework, model and variant: the ratio of their
    per-process figures, stats.per_process) is not decided yet, while the round's processes fit in what is left of
    the budget; a cell's first MIN_REPEATS processes are never cut. A process runs several repeats of its cell one
    after another where its start (the framework's import) costs more than a repeat (`per_process`): the evidence a
    second of budget buys. The decision is sequential (stats: each look at its own level, 5% over all of them) and
    final: a decided comparison is not looked at again when its fp32 cell gets processes for another one. A cell
    whose run ended otherwise than ok (failed, unsupported, diverged) has nothing more to decide. `outcomes()` says
    what stopped each cell. `recorded`: records an earlier invocation wrote (--resume)."""

    def __init__(self, requests: list[RunRequest], budget_s: float, recorded: list[dict] = (),
                 clock=time.monotonic):
        self.budget_s, self.clock, self.started = budget_s, clock, clock()
        self.template: dict[tuple, RunRequest] = {}  # cell -> a request of it, in the matrix's order
        self.next_repeat: dict[tuple, int] = {}
        for q in requests:
            cell = request_key(q)[:-1]
            self.template.setdefault(cell, q)
            self.next_repeat[cell] = min(self.next_repeat.get(cell, q.repeat), q.repeat)
        self.records: dict[tuple, dict[int, dict]] = {cell: {} for cell in self.template}  # the latest per repeat
        self.figures: dict[tuple, list[float]] = {}  # _figures' answers until the next records come
        # worker time (wall_s) of this invocation's runs, and the processes they ran in, since `started`
        self.run_s, self.processes = 0.0, set()
        self.first_overhead = 0.0  # a process's cost besides its runs in the first round (start measures it)
        # per cell, the least a repeat took first in its process (paying the framework's lazy set-up) and after
        # another in the same process: what per_process weighs
        self.first_s: dict[tuple, float] = {}
        self.later_s: dict[tuple, float] = {}
        self.seen: set = set()  # the processes whose first record came
        self.next_process = 0
        self.round = 0  # the round the next requests belong to (their records' auto_round)
        self.ran_out = False
        # the sequential test of each pair: the ratio its last look gave (with that look's number), the one that decided
        self.latest: dict[tuple, stats.Ratio] = {}
        self.decided: dict[tuple, stats.Ratio] = {}
        # the precisions compared with one fp32 cell are adjusted together (Bonferroni), as the report's best-of-k
        self.family = Counter(base for base, _ in self.pairs())
        self.add(recorded, earlier=True)
        # --resume: each pair where its test stood, replayed round by round (a decision made then stays made)
        rounds = [r["auto_round"] for cell in self.records.values() for r in cell.values() if r.get("auto_round")
                  is not None]
        self.round = max(rounds, default=-1) + 1
        for pair in self.pairs():
            found = stats.sequential(*(self._repeats(c) for c in pair), comparisons=self.family[pair[0]])
            if found is not None:
                self.latest[pair] = found
                if found.decision in DECIDED:
                    self.decided[pair] = found

    def start(self) -> None:
        """The budget's clock starts now, after the first round."""
        self.first_overhead = self._overhead()
        self.started, self.run_s, self.processes = self.clock(), 0.0, set()

    def add(self, records: list[dict], earlier: bool = False) -> None:
        self.figures.clear()
        for r in records:
            key, process = run_key(r), r.get("process") or r["run_id"]
            cell, later = key[:-1], process in self.seen
            self.seen.add(process)
            if cell in self.records:
                self.records[cell][key[-1]] = r
                self.next_repeat[cell] = max(self.next_repeat[cell], key[-1] + 1)
                if r["status"] == "ok":
                    costs = self.later_s if later else self.first_s
                    costs[cell] = min(costs.get(cell, math.inf), _run_s(r))
            if not earlier:
                self.run_s += r.get("wall_s") or 0.0
                self.processes.add(process)

    def _overhead(self) -> float:
        """What a worker process costs besides its runs (its start, the framework's import), as measured since
        `started`: over the budget's rounds once one ran, else the first round's."""
        if not self.processes:
            return self.first_overhead
        return max(0.0, self.clock() - self.started - self.run_s) / len(self.processes)

    def pairs(self) -> list[tuple[tuple, tuple]]:
        """(fp32 cell, other cell) for every cell that has an fp32 cell to compare with."""
        fp32 = {(c[0], c[1], c[3]): c for c in self.template if c[2] == "fp32"}
        return [(fp32[(c[0], c[1], c[3])], c) for c in self.template if c[2] != "fp32" and (c[0], c[1], c[3]) in fp32]

    def _figures(self, cell: tuple) -> list[float]:
        """The cell's timing figures: its ok repeats' medians, pooled per process (stats.per_process)."""
        if cell not in self.figures:
            timed = self._repeats(cell)
            self.figures[cell] = stats.per_process([x for x, _, _ in timed], [p for _, p, _ in timed])
        return self.figures[cell]

    def _repeats(self, cell: tuple) -> list[tuple[float, str | None, int]]:
        """The cell's timed repeats as stats.sequential replays them: (median, process, round)."""
        return results.auto_timing([self.records[cell][i] for i in sorted(self.records[cell])])

    def _count(self, cell: tuple, processes: int | None = None) -> str:
        """"N repeats", or "N repeats in P processes" where some shared one: the cell's timed repeats, or those of
        its first `processes` processes."""
        seen: dict[object, int] = {}
        for i, (_, process, _) in enumerate(self._repeats(cell)):
            process = process or ("alone", i)
            if process in seen or processes is None or len(seen) < processes:
                seen[process] = seen.get(process, 0) + 1
        repeats = sum(seen.values())
        return f"{repeats} repeat{'s' * (repeats != 1)}" + (f" in {len(seen)} processes" if len(seen) != repeats
                                                            else "")

    def _ratio(self, pair: tuple[tuple, tuple]) -> stats.Ratio | None:
        """The pair's speed-up (fp32's figures over the other's) as its sequential test last saw it, the interval
        that decided once one has; None before each cell has a repeat. With stats.MIN_REPEATS processes in each
        cell, look k comes when the larger cell has MIN_REPEATS + k - 1 processes, each look at a level of its own (a
        process that does not grow the larger cell waits for the next look)."""
        if pair in self.decided:
            return self.decided[pair]
        a, b = (self._figures(c) for c in pair)
        if not a or not b:
            return None
        if min(len(a), len(b)) < stats.MIN_REPEATS:
            return stats.ratio(a, b)
        look = max(len(a), len(b)) - stats.MIN_REPEATS + 1
        if look > stats.MAX_LOOKS:
            return self.latest[pair]
        if pair not in self.latest or look > self.latest[pair].look:
            self.latest[pair] = r = stats.ratio(a, b, comparisons=self.family[pair[0]], look=look)
            if r.decision in DECIDED:
                self.decided[pair] = r
        return self.latest[pair]

    def _broken(self, cells) -> dict | None:
        """The first record of these cells whose run ended otherwise than ok: nothing more to decide."""
        return next((r for c in cells for r in self.records[c].values() if r["status"] != "ok"), None)

    def _open(self, pair: tuple[tuple, tuple]) -> bool:
        r = self._ratio(pair)
        return not self._broken(pair) and (r is None or r.decision not in DECIDED and not self._spent(r))

    @staticmethod
    def _spent(r: stats.Ratio) -> bool:
        """The sequential test has made its last look (stats.MAX_LOOKS) without deciding."""
        return r.look == stats.MAX_LOOKS and r.decision not in DECIDED

    def _wanted(self, cell: tuple) -> bool:
        """Another process of this cell would be used: it has too few, or one of its comparisons is open."""
        if self._broken([cell]):
            return False
        return len(self._figures(cell)) < stats.MIN_REPEATS or any(self._open(p) and cell in p for p in self.pairs())

    def per_process(self, cell: tuple, overhead: float) -> int:
        """How many repeats of the cell one process runs: about as many as its start costs in later repeats (the
        start: `overhead` outside the worker's runs, and its first repeat, which pays the framework's lazy set-up),
        so that the repeats together cost at most twice their own time; at most MAX_PER_PROCESS (past that, a
        process's figure gains little where its start decides part of the spread, which no repeat inside it
        reduces). 2 until a later repeat of the cell has been timed: what it costs is then measured."""
        if cell not in self.later_s:
            return 2
        first, later = self.first_s.get(cell, 0.0), self.later_s[cell]
        return max(1, min(MAX_PER_PROCESS, round((overhead + first) / later))) if later > 0 else MAX_PER_PROCESS

    def _process_s(self, cell: tuple, overhead: float, repeats: int) -> float:
        """What a process of the cell running `repeats` is expected to cost on the budget's clock."""
        first = self.first_s.get(cell, 0.0)
        return overhead + first + (repeats - 1) * self.later_s.get(cell, first)

    def _request(self, cell: tuple, process: int | None = None) -> RunRequest:
        t, r = self.template[cell], self.next_repeat[cell]
        self.next_repeat[cell] = r + 1
        return replace(t, repeat=r, run_id=run_id(t.framework, t.model, t.precision, t.variant, t.loss_scale, r,
                                                  stamp_now()), shares_process=process, auto_round=self.round)

    def first_round(self) -> list[RunRequest]:
        """A repeat of every cell that has none yet: each cell gets a figure whatever the budget."""
        batch = [self._request(c) for c in self.template if not self.records[c]]
        self.round += 1
        return batch

    def next_round(self) -> list[RunRequest]:
        """The next process of every cell still wanted (per_process repeats in it), as many as fit in the budget
        (none: the matrix is done), the cells with fewest processes first: no cell gets another while one with
        fewer does not fit. A cell's first stats.MIN_REPEATS processes are never cut (without them there is no
        interval): they may overrun the budget."""
        cells = sorted((c for c in self.template if self._wanted(c)), key=lambda c: len(self._figures(c)))
        overhead = self._overhead()
        # the cells compared with one fp32 cell run alike (the fewest any of them would): a process's first repeat
        # is timed colder than its later ones, so both sides of a ratio must hold the same mix
        alike: dict[tuple, int] = {}
        for cell in cells:
            group = (cell[0], cell[1], cell[3])
            alike[group] = min(alike.get(group, MAX_PER_PROCESS), self.per_process(cell, overhead))
        left, batch = self.budget_s - (self.clock() - self.started), []
        for cell in cells:
            repeats = alike[(cell[0], cell[1], cell[3])]
            left -= self._process_s(cell, overhead, repeats)
            if left < 0 and len(self._figures(cell)) >= stats.MIN_REPEATS:
                self.ran_out = True
                break
            process, self.next_process = self.next_process, self.next_process + 1
            batch += [self._request(cell, process) for _ in range(repeats)]
        self.round += 1
        return batch

    def outcomes(self) -> list[str]:
        """A line per compared cell: what stopped its repeats."""
        lines, compared = [], set()
        for base, cell in self.pairs():
            compared.add(cell)
            q = self.template[cell]
            scale = f" loss scale {q.loss_scale}" if q.loss_scale else ""
            name = f"{q.framework} {Path(q.model).stem} {q.precision}{scale} against fp32 (variant {q.variant})"
            broken, r = self._broken((base, cell)), self._ratio((base, cell))
            if broken:
                lines.append(f"{name}: stopped: its {broken['precision']} run r{broken['repeat']} ended "
                             f"{broken['status']} ({broken.get('reason')})")
                continue
            if r is None:
                lines.append(f"{name}: interrupted before a repeat of each")
                continue
            na, nb = r.n if r.decision in DECIDED else (None, None)  # a decision: the processes it had
            n = self._count(cell, nb)
            fp32 = self._count(base, na)
            n += "" if fp32 == n else f" (fp32 {fp32})"
            interval = f"speed-up {r.estimate:.3g}x, {r.label}" if r.is_interval else r.label
            stopped = ((f"the sequential test's {stats.MAX_LOOKS} looks spent" if self._spent(r) else None)
                       or ("budget ran out" if self.ran_out else None))
            if r.decision in DECIDED:
                lines.append(f"{name}: decided after {n}: {r.decision}, {interval}")
            elif stopped:
                a, b = self._figures(base), self._figures(cell)
                lines.append(f"{name}: {stopped} after {n}: too noisy here to decide ({interval}; spread "
                             f"{stats.spread(a):.0%} fp32, {stats.spread(b):.0%} {q.precision})")
            else:
                lines.append(f"{name}: interrupted after {n}: {r.decision} ({r.label})")
        for cell, q in self.template.items():
            if q.precision != "fp32" and cell not in compared:
                lines.append(f"{q.framework} {Path(q.model).stem} {q.precision}: no fp32 cell to compare with "
                             f"(variant {q.variant}); {len(self.records[cell])} repeats")
        return lines


MAX_PER_PROCESS = 4  # repeats one --repeats auto process may run (UntilDecided.per_process)


def _run_s(record: dict) -> float:
    """A run's worker time without the once-per-machine measurement it may have made (--variant auto's)."""
    return (record.get("wall_s") or 0.0) - ((record.get("variant_choice") or {}).get("measure_s") or 0.0)


@dataclass
class Outcome:
    records: list[dict]  # this invocation's, in the order they came
    interrupted: bool  # Ctrl-C
    runs: int  # the runs it set out to run (after --resume left out the recorded ones)
    until: UntilDecided | None  # --repeats auto: what stopped each cell (UntilDecided.outcomes)


def execute(plan: Plan, timeout_s: float, show_progress: bool) -> Outcome:
    """Run a plan (harness.run.plan): --resume leaves out the runs already recorded, --repeats auto adds rounds
    within the plan's budget, the executor runs the rest; every record is appended as soon as it is known."""
    out, filename, requests = plan.out, plan.filename, plan.requests
    until = None
    if plan.budget_s is not None:
        earlier = results.read_records([out], filename) if plan.resume and (out / filename).exists() else []
        until = UntilDecided(requests, plan.budget_s, [r for r in earlier if r.get("status") not in results.NO_RESULT])
        print(f"repeats auto: one of each cell, then more processes until each has {stats.MIN_REPEATS} (whatever "
              f"the budget) and its speed-up against fp32 is decided by a sequential test, within {plan.budget_s:g} s "
              f"after that first round; a process runs up to {MAX_PER_PROCESS} repeats where its start costs more than "
              f"they do", file=sys.stderr)
    if plan.resume:
        total, requests = len(requests), pending(requests, out, filename)
        print(f"resume: {total - len(requests)} of {total} runs already recorded in {out / filename}; "
              f"running {len(requests)}", file=sys.stderr)
    if until is not None:
        records, interrupted = run_until_decided(until, out, timeout_s, show_progress, filename, plan.executor)
    else:
        records, interrupted = run_matrix(requests, out, timeout_s, show_progress, filename, plan.executor)
    return Outcome(records, interrupted, len(requests), until)


def run_until_decided(plan: UntilDecided, out_dir: Path, timeout_s: float, show_progress: bool,
                      filename: str = results.RESULTS_FILE, executor: Executor | None = None) -> tuple[list[dict], bool]:
    """run_matrix for `--repeats auto`: plan's first round (a repeat of every cell), then its rounds until it has
    none."""
    records, interrupted = run_matrix(plan.first_round(), out_dir, timeout_s, show_progress, filename, executor)
    plan.add(records)
    plan.start()
    while not interrupted:
        more = plan.next_round()
        if not more:
            break
        done, interrupted = run_matrix(more, out_dir, timeout_s, show_progress, filename, executor)
        plan.add(done)
        records += done
    return records, interrupted


def _batches(requests: list[RunRequest]) -> list[list[RunRequest]]:
    """Timed runs (harness.run.modes.Work.timed) alone, in the matrix's interleaved order, but for the repeats of a
    cell that share a process (RunRequest.shares_process); untimed runs grouped by everything that is set
    process-wide (framework, precision, device, threads, variant), so each group shares one process."""
    batches: dict[tuple, list[RunRequest]] = {}
    for i, q in enumerate(requests):
        if not work(q.mode).timed:
            key = (q.mode, q.framework, q.precision, q.device, q.threads, q.variant)
        else:
            key = (i,) if q.shares_process is None else (request_key(q)[:-1], q.shares_process)
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
