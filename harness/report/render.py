"""Rendering: the view (harness.report.data.View) -> one self-contained HTML page and a Markdown summary beside
it, each from its templates (templates/report.html.j2 and report.md.j2, a partial per section), and the records
as CSV."""
from __future__ import annotations

import json
from pathlib import Path

from harness.report import jinja
from harness.report.data import View
from harness.report.view import build_view

PER_STEP = ("step_times_ms", "loss", "loss_scale.history")  # lists with one value per step


def render(view: View) -> str:
    """The page. Its charts are SVG markup already (harness.report.svg escapes their text)."""
    return jinja.render("report.html.j2", **vars(view))


def render_markdown(view: View) -> str:
    """The first screen as Markdown (reports/index.md): per device the matrix and the recommendations, for a pull
    request, a chat message or a terminal; then the causes in short, the pure 16-bit and profile findings and
    the Why section."""
    return jinja.render("report.md.j2", **vars(view)).rstrip("\n") + "\n"  # the sections' blank lines, one end


def markdown_path(out: Path) -> Path:
    """Where write_report puts the Markdown summary: beside the page (reports/index.html -> reports/index.md)."""
    return out.with_suffix(".md")


def write_report(records: list[dict], out: Path, parity_records: list[dict] | None = None,
                 diagnoses: list[dict] | None = None, profiles: list[dict] | None = None,
                 markdown: bool = True) -> tuple[Path, Path]:
    """The page at `out`, the records as CSV beside it and (with markdown) the first screen as Markdown."""
    from harness.results import to_frame

    view = build_view(records, parity_records, diagnoses, profiles)
    out.parent.mkdir(parents=True, exist_ok=True)
    if markdown:
        markdown_path(out).write_text(render_markdown(view))
    out.write_text(render(view))
    frame = to_frame(records)
    # per-step lists are summarised by their statistics (step_time_ms.*, final_train_loss) and stay whole in the
    # records: over 10,000 runs they would make the CSV hundreds of MB
    frame = frame.drop(columns=[c for c in frame.columns if c in PER_STEP or c.startswith(("fingerprint.", "diagnosis."))])
    if {"tokens_per_sample", "samples_per_s"} <= set(frame.columns) and frame["tokens_per_sample"].notna().any():
        # a sequence model's throughput in tokens, beside the samples/s its worker measured
        frame.insert(frame.columns.get_loc("samples_per_s") + 1, "tokens_per_s",
                     frame["samples_per_s"] * frame["tokens_per_sample"])
    for column in frame.columns:  # what is left of lists and option dicts as JSON cells
        if frame[column].dtype == object:
            frame[column] = frame[column].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v)
    csv = out.with_suffix(".csv")
    frame.to_csv(csv, index=False)
    return out, csv
