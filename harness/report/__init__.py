"""The report: `view` turns records into a view model (statistics in `stats`, prose rules in `explain`,
charts in `charts`), `render` writes the page."""
from harness.report.render import render, write_report
from harness.report.view import build_view

__all__ = ["build_view", "render", "write_report"]
