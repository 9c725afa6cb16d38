"""The report's first screen: per device, a matrix of models x frameworks, each cell the best precision there
against that framework's fp32, and one recommendation line per model.

Every figure comes from the comparisons `view` computed (`stats.ratio` of repeat medians, accuracy changes
judged by `accuracy`); this module only chooses among them and words the choice. Devices are never pooled: a
GPU's speed-up says nothing about a CPU's.

What a cell may say is its comparison's `stats.Ratio.decision`, and nothing else: a precision is named the best
(bold, coloured) only where it is decided faster, with its interval adjusted for the k precisions it was chosen
from (Bonferroni), and its accuracy is decided and does not rule it out (accuracy.Check); a faster precision whose
accuracy is not decided is shown unbolded with what to run; where none is faster, the cell says "keep fp32" and
gives the closest one as detail; fewer than MIN_REPEATS repeats give no verdict, and an interval too wide to decide
says so and what to do about it. "Fastest overall" ranks only cells whose speed is decided (`ranked`).
"""
from __future__ import annotations

from dataclasses import dataclass

from harness import stats
from harness.identity import device_key
from harness.records import RunRecord
from harness.report import format as f
from harness.report.accuracy import Check
from harness.report.verdicts import DECIDED, VERDICTS, Comparison, PooledRuns

RERUN_FEW = f"rerun with --repeats {stats.MIN_REPEATS} or more, or --repeats auto"
RERUN_NOISY = "rerun with more repeats (--repeats auto with a larger --budget) or on a quieter machine"
OPEN = "faster, accuracy not yet decided"


@dataclass
class MatrixEntry:
    """One matrix cell as the first screen words it: `verdict` is what the cell says ("faster", "open": faster but
    its accuracy not yet decided, "keep", "too few", "undecided", or "none" without a comparison), `decision` its
    comparison's own."""
    precision: str
    setting: str
    verdict: str
    decision: str | None
    verdict_text: str
    speed: str | None
    interval: str | None
    advice: str | None
    accuracy: str | None
    accuracy_flag: bool
    ms: str  # the step time, with tokens/s beside it for a sequence model (PooledRuns.step)
    unstable: bool
    not_run: str | None = None


@dataclass(frozen=True)
class Row:
    model: str
    cells: list[MatrixEntry | None]  # one per column; None: no runs


@dataclass(frozen=True)
class Block:
    """The first screen on one device: a matrix of models x frameworks and a recommendation per model."""
    device: str
    columns: list[str]
    rows: list[Row]
    recommendations: list[str]


def verdict(s: Comparison) -> str:
    """The comparison's Ratio.decision: too few, faster, slower, same (within +/-5%) or undecided."""
    return s.decision


def acceptable(s: Comparison) -> bool:
    """Accuracy (a next-token model's eval loss) does not rule this precision out: only a measured loss of
    quality past the margin (worse, or stalled at chance level) does (accuracy.Check)."""
    return s.accuracy_check.acceptable


def recommendable(s: Comparison) -> bool:
    """Decided faster, and its accuracy decided and not ruling it out: what may be bolded and recommended."""
    return verdict(s) == "faster" and acceptable(s) and s.accuracy_check.decided


def pending_accuracy(s: Comparison) -> bool:
    """Decided faster, nothing against its accuracy, but no accuracy verdict yet: neither bolded nor recommended."""
    return verdict(s) == "faster" and acceptable(s) and not s.accuracy_check.decided


def accuracy_advice(check: Check) -> str:
    """What to run so that a precision's accuracy gets a verdict (accuracy.NO_VERDICT: why it has none)."""
    subject = check.metric.subject
    return {"one seed": f"rerun with --repeats {stats.MIN_REPEATS} or more (each repeat trains from a seed of its "
                        f"own) to judge {subject}",
            "undecided": f"rerun with more repeats (each one more seed) to decide {subject}",
            "too short": f"train for more steps (--steps): fp32 learned nothing to judge {subject} by",
            "none": f"no {subject} recorded to judge"}[check.verdict]


def ranked(cells: list[PooledRuns], summary: list[Comparison]) -> list[PooledRuns]:
    """The cells a "fastest" may be named from: at least MIN_REPEATS repeats and, but for fp32's own, a speed
    comparison against fp32 that decided (faster, slower or the same; `summary`: every cell's, unadjusted): a median
    with too few repeats, or too noisy to tell from fp32's, ranks nothing."""
    decided = {s.key for s in summary if s.decision in DECIDED}
    return [c for c in cells if len(c.process_ms) >= stats.MIN_REPEATS and (c.precision == "fp32" or c.key in decided)]


def chosen_among(candidates: list[Comparison]) -> list[Comparison]:
    """One matrix cell's comparisons with their intervals computed for being chosen among len(candidates)
    (Bonferroni, stats.ratio's `comparisons`): the best of k must not look surer than one comparison would."""
    if len(candidates) < 2:
        return candidates
    return [s.among(len(candidates)) for s in candidates]


def choose(candidates: list[Comparison]) -> tuple[str, Comparison]:
    """(what the cell says, the comparison it shows): "faster" (the fastest precision decided faster whose accuracy
    is decided and does not rule it out), "open" (decided faster, accuracy not yet decided), "too few" or
    "undecided" (no speed verdict yet), else "keep" (fp32, with the closest)."""
    for kind, test in (("faster", recommendable), ("open", pending_accuracy)):
        found = [s for s in candidates if test(s)]
        if found:
            return kind, max(found, key=lambda s: s.ratio)
    for pending in ("too few", "undecided"):
        open_ = [s for s in candidates if verdict(s) == pending]
        if open_:
            return pending, max(open_, key=lambda s: s.ratio)
    return "keep", max(candidates, key=lambda s: s.ratio)


def _speed(s: Comparison) -> str:
    if verdict(s) not in ("faster", "slower"):  # no direction claimed without a decision
        return f"{f.ratio(s.ratio)} vs fp32"
    return f.faster(s.ratio)


def spread(s: Comparison) -> str:
    """The cells' coefficients of variation over repeats, the spread an undecided interval comes from."""
    cv = [(p, c.cv) for p, c in (("fp32", s.fp32), (s.precision, s.cell))]
    return "repeats spread " + " and ".join(f"{f.percent(v, 0)} ({p})" for p, v in cv if v is not None)


def _entry(kind: str, s: Comparison) -> MatrixEntry:
    v = verdict(s)
    if kind == "keep":
        text = f"{VERDICTS[v]} but {s.accuracy_check.metric.worse_words}" if v == "faster" else VERDICTS[v]
    else:
        text = OPEN if kind == "open" else VERDICTS[kind]
    advice = f"{spread(s)}: {RERUN_NOISY}" if kind == "undecided" else \
        accuracy_advice(s.accuracy_check) if kind == "open" else None
    cell = s.cell
    return MatrixEntry(s.precision + cell.scale_note, cell.setting_note.strip(" []"), kind, v, text, _speed(s), s.ci,
                 advice, s.accuracy_check.phrase, not acceptable(s), cell.step, s.unstable)


def _plain_entry(cells: list[PooledRuns], why: str) -> MatrixEntry:
    """A cell of the matrix without a comparison (fp32 only, or no fp32): the one cell there, or the fastest of
    several where one may be ranked (only fp32 cells may: the others have no speed decided against fp32)."""
    shown = cells if len(cells) == 1 else ranked(cells, [])
    if not shown:
        names = ", ".join(sorted(c.precision + c.scale_note for c in cells))
        return MatrixEntry(names, "", "none", None, f"{why}; none may be named the fastest (fewer than "
                     f"{stats.MIN_REPEATS} repeats, or no speed decided against fp32)", None, None, None, None,
                     False, "", False)
    fastest = min(shown, key=lambda c: c.median_ms)
    return MatrixEntry(fastest.precision + fastest.scale_note, fastest.setting_note.strip(" []"), "none", None, why,
                       None, None, None, None, False, fastest.step, False)


def build(cells: dict[tuple, PooledRuns], summary: list[Comparison], not_run: list[RunRecord]) -> list[Block]:
    """One block per device: columns (frameworks), rows (models), recommendations; a run that did not end ok is
    named in its cell (on every device where its record names none)."""
    not_run_on = [(r, device_key(r.written)) for r in not_run]
    by_place: dict[tuple, list[PooledRuns]] = {}  # (device, model, column): its cells, grouped once
    by_model: dict[tuple, list[PooledRuns]] = {}  # (device, model)
    for c in cells.values():
        by_place.setdefault((c.device, c.model, c.column), []).append(c)
        by_model.setdefault((c.device, c.model), []).append(c)
    compared: dict[tuple, list[Comparison]] = {}
    for s in summary:
        compared.setdefault((s.cell.device, s.model, s.cell.column), []).append(s)
    blocks = []
    for device in sorted({c.device for c in cells.values()}):
        places = [place for place in by_place if place[0] == device]
        columns = sorted({column for _, _, column in places})
        models = sorted({model for _, model, _ in places})
        framework = {c.column: c.framework for (d, _, _), cs in by_place.items() if d == device for c in cs}
        rows, recommendations = [], []
        for model in models:
            row, chosen = [], []
            for column in columns:
                mine = by_place.get((device, model, column), [])
                candidates = chosen_among(compared.get((device, model, column), []))
                chosen += candidates
                if candidates:
                    kind, shown = choose(candidates)
                    row.append(_entry(kind, shown))
                elif mine:
                    fp32 = all(c.precision == "fp32" for c in mine)
                    row.append(_plain_entry(mine, "fp32 only" if fp32 else "no fp32 run to compare"))
                else:
                    row.append(None)
                failed = sorted({f"{r.precision} {r.status}" for r, on in not_run_on if r.model == model
                                 and r.framework == framework[column] and on in (device, None)})
                if row[-1] is not None and failed:
                    row[-1].not_run = ", ".join(failed)
            rows.append(Row(model, row))
            recommendations.append(recommend(model, chosen, by_model[(device, model)], summary))
        blocks.append(Block(device, columns, rows, recommendations))
    return blocks


def fastest_overall(mcells: list[PooledRuns], summary: list[Comparison]) -> str:
    """"fastest overall" among the model's cells that may be ranked (`ranked`), of how many; or that none may."""
    found = ranked(mcells, summary)
    if not found:
        return (f"no fastest overall: none of its {len(mcells)} cells has {stats.MIN_REPEATS} repeats and a speed "
                f"decided against fp32")
    best = min(found, key=lambda c: c.median_ms)
    left = len(mcells) - len(found)
    of = f", best of {len(found)} cells" if len(found) > 1 else ""
    if left:
        of += (f"{' with a decided speed' if len(found) > 1 else ', the one cell with a decided speed'} ({left} "
               f"more with fewer than {stats.MIN_REPEATS} repeats or no speed decided)")
    return f"fastest overall{of}: {best.name} {best.precision}{best.scale_note} {best.step}"


def recommend(model: str, comparisons: list[Comparison], mcells: list[PooledRuns], summary: list[Comparison]) -> str:
    """One line: the precision and framework to use for this model on this device, and the fastest cell; or why
    there is no verdict yet and how to get one. `comparisons`: the matrix cells' (adjusted) comparisons; `summary`:
    every cell's own (unadjusted), which says which cells "fastest overall" may name."""
    tail = fastest_overall(mcells, summary)
    if not comparisons:
        return f"{model}: no framework ran both fp32 and another precision, so no speed-up to compare; {tail}."

    def name(s: Comparison) -> str:
        return f"{s.cell.name} {s.precision}{s.cell.scale_note}"

    good = [s for s in comparisons if recommendable(s)]
    pending = [s for s in comparisons if pending_accuracy(s)]
    ruled_out = [s for s in comparisons if verdict(s) == "faster" and not acceptable(s)]
    best = max(s.ratio for s in good) if good else 0.0
    caveat = "".join(f" ({name(s)} was {f.faster(s.ratio)} but {s.accuracy_check.phrase})" for s in ruled_out[:2])
    # faster than the one recommended, but not judged: said, with why not
    caveat += "".join(f" ({name(s)} was {f.faster(s.ratio)}, {s.accuracy_check.metric.subject} not yet decided: "
                      f"{accuracy_advice(s.accuracy_check)})" for s in [s for s in pending if s.ratio > best][:2])
    if good:
        s = max(good, key=lambda s: s.ratio)
        c = s.cell
        unstable = " [unstable timings]" if s.unstable else ""
        among = f", the largest of {len(good)} decided speed-ups" if len(good) > 1 else ""
        return (f"{model}: {name(s)}, {f.faster(s.ratio)} than {c.name} fp32 ({s.ci}){unstable}{among}, "
                f"{s.accuracy_check.phrase}{caveat}; {tail}.")
    if pending:
        s = max(pending, key=lambda s: s.ratio)
        return (f"{model}: nothing to recommend yet: {name(s)} is {f.faster(s.ratio)} than {s.cell.name} fp32 "
                f"({s.ci}), but {s.accuracy_check.phrase}; {accuracy_advice(s.accuracy_check)}; keep fp32 until "
                f"then{caveat}; {tail}.")
    few = [s for s in comparisons if verdict(s) == "too few"]
    if few:
        cases = ", ".join(f"{name(s)} {f.ratio(s.ratio)} ({s.ci})" for s in few[:3])
        # no "fastest overall" either: with this few repeats it would be the same unfounded verdict in other words
        return (f"{model}: not enough repeats for a verdict (fewer than {stats.MIN_REPEATS} in {cases}"
                f"{' and more' if len(few) > 3 else ''}); {RERUN_FEW}{caveat}.")
    noisy = [s for s in comparisons if verdict(s) == "undecided"]
    if noisy:
        s = max(noisy, key=lambda s: s.ratio)
        return (f"{model}: too noisy here to decide (closest: {name(s)} {f.ratio(s.ratio)}, {s.ci}, "
                f"{spread(s)}); {RERUN_NOISY}{caveat}; {tail}.")
    rest = [s for s in comparisons if s not in ruled_out]
    closest = ""
    if rest:
        s = max(rest, key=lambda s: s.ratio)
        where = f"within {f.percent(stats.PRECISE, 0)} of 1" if verdict(s) == "same" else "clearly slower"
        closest = f" (closest: {name(s)} {f.ratio(s.ratio)}, {s.ci}, {where})"
    return (f"{model}: no precision is clearly faster than fp32 in any framework here{closest}{caveat}; "
            f"keep fp32; {tail}.")
