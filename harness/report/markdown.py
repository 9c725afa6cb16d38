"""The first screen as Markdown (reports/index.md): per device the matrix and the recommendations, for a pull
request, a chat message or a terminal. Rendered from the same view model as the HTML page."""
from __future__ import annotations


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _cell(e: dict | None) -> str:
    if e is None:
        return "no runs"
    head = f"**{e['precision']}**" + (f" ({e['setting']})" if e.get("setting") else "")
    if e["speed"]:
        parts = [f"{head} {e['speed']} ({e['interval']})", e["verdict_text"]]
    else:
        parts = [f"{head} {e['ms']}", e["verdict_text"]]
    if e.get("unstable"):
        parts.append("unstable timings")
    if e.get("accuracy"):
        parts.append(e["accuracy"])
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
                   "(interval: 95% Welch t-interval over repeats, or the range with fewer than "
                   f"{view['min_repeats']} repeats) and its accuracy change."), "",
                  "| model | " + " | ".join(_escape(c) for c in block["columns"]) + " |",
                  "|---|" + "---|" * len(block["columns"])]
        for row in block["rows"]:
            lines.append(f"| {_escape(row['model'])} | " + " | ".join(_cell(e) for e in row["cells"]) + " |")
        lines += [""] + [f"- {line}" for line in block["recommendations"]] + [""]
    if view.get("pure16", {}).get("markdown"):
        lines += [view["pure16"]["markdown"], ""]
    if view.get("profile", {}).get("markdown"):
        lines += [view["profile"]["markdown"], ""]
    if view["why"]:
        lines += ["## Why", ""] + [f"- **{w['title']}**: {w['text']}" for w in view["why"]] + [""]
    if view["not_run"]:
        lines += [f"{len(view['not_run'])} run(s) did not finish; see the HTML report.", ""]
    return "\n".join(lines)
