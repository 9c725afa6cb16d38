"""The first screen as Markdown (reports/index.md): per device the matrix and the recommendations, for a pull
request, a chat message or a terminal. Rendered from the same view model as the HTML page."""
from __future__ import annotations


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _cell(e: dict | None) -> str:
    """A matrix cell as the page words it: the precision in bold only where it is decided faster."""
    if e is None:
        return "no runs"
    setting = f" ({e['setting']})" if e.get("setting") else ""
    if e["verdict"] == "faster":
        parts = [f"**{e['precision']}**{setting} {e['speed']} ({e['interval']})", e["verdict_text"]]
    elif e["verdict"] == "keep":
        parts = ["keep fp32", f"closest: {e['precision']}{setting} {e['speed']} ({e['interval']}), {e['verdict_text']}"]
    elif e["speed"]:
        parts = [f"{e['precision']}{setting} {e['speed']} ({e['interval']})", e["verdict_text"]]
    else:
        parts = [f"{e['precision']}{setting} {e['ms']}", e["verdict_text"]]
    for key in ("advice", "accuracy"):
        if e.get(key):
            parts.append(e[key])
    if e.get("unstable"):
        parts.append("unstable timings")
    if e.get("not_run"):
        parts.append(f"not run: {e['not_run']}")
    return _escape("; ".join(parts))


def render_markdown(view: dict) -> str:
    lines = ["# amp-harness: mixed precision report", "",
             (f"{view['n_records']} runs ({view['n_ok']} ok) of {', '.join(view['models']) or 'no model'} in "
              f"{', '.join(view['frameworks']) or 'no framework'}; generated {view['generated']}."), ""]
    if not view["n_ok"]:
        lines += ["No run finished with status ok, so there are no speed, memory or accuracy figures.", ""]
    for block in view["answer"]:
        lines += [f"## Which precision to use, on {_escape(block['device'])}", "",
                  ("Per model and framework: the best precision's step-time speed-up over that framework's fp32 "
                   "and its accuracy change. Interval: 95% Welch t-interval over repeats; where a cell is the best "
                   "of k precisions, adjusted for k comparisons (Bonferroni). A precision is named (bold) only "
                   "where its interval lies above 1, else \"keep fp32\" with the closest one; with fewer than "
                   f"{view['min_repeats']} repeats there is only the range and no verdict. \"Fastest overall\" is "
                   "the best of the model's cells on that device."), "",
                  "| model | " + " | ".join(_escape(c) for c in block["columns"]) + " |",
                  "|---|" + "---|" * len(block["columns"])]
        for row in block["rows"]:
            lines.append(f"| {_escape(row['model'])} | " + " | ".join(_cell(e) for e in row["cells"]) + " |")
        lines += [""] + [f"- {line}" for line in block["recommendations"]] + [""]
    if view["why_short"]:
        lines += ["**Why, in short** (\"likely\": a cause inferred from these figures): "
                  + " ".join(view["why_short"]), ""]
    if view.get("pure16", {}).get("markdown"):
        lines += [view["pure16"]["markdown"], ""]
    if view.get("profile", {}).get("markdown"):
        lines += [view["profile"]["markdown"], ""]
    if view["why"]:
        lines += ["## Why", ""] + [f"- **{w['title']}**: {w['text']}" for w in view["why"]] + [""]
    if view["not_run"]:
        lines += [f"{len(view['not_run'])} run(s) did not finish; see the HTML report.", ""]
    return "\n".join(lines)
