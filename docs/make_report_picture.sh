#!/usr/bin/env bash
# docs/report.png from a real run, so that the picture cannot go stale: trains the small matrix of
# docs/report_picture.yaml in torch on this machine, renders the report and screenshots its first screen.
#
#   bash docs/make_report_picture.sh [RUN OPTIONS]     # e.g. --threads 1 on a machine busy with other work
#
# AMP_HARNESS_BIN: the amp-harness to use (default .tox/torch/bin/amp-harness, the torch env `tox` builds).
# PICTURE_OUT: where the run's records and the rendered report go (default a temporary folder, kept and printed).
# CHROMIUM: the headless browser (default chromium; `apt-get install chromium`).
# The caches (variants, peaks, capabilities) go to a temporary folder: ~/.cache is never touched.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${AMP_HARNESS_BIN:-.tox/torch/bin/amp-harness}
chromium=${CHROMIUM:-chromium}
out=${PICTURE_OUT:-$(mktemp -d -t amp-harness-picture.XXXXXX)}
mkdir -p "$out" && out=$(cd "$out" && pwd)
[ ! -e "$out/results/results.jsonl" ] || { echo "$out/results already holds records: give PICTURE_OUT an empty folder" >&2; exit 2; }
command -v "$bin" >/dev/null || { echo "no $bin: run tox first (it builds .tox/torch) or set AMP_HARNESS_BIN" >&2; exit 2; }
command -v "$chromium" >/dev/null || { echo "no $chromium: apt-get install chromium, or set CHROMIUM" >&2; exit 2; }
export AMP_HARNESS_CACHE="$out/cache"
mkdir -p "$AMP_HARNESS_CACHE"
start=$(date +%s)
# one variant (torch's eager step), so that no run goes to measuring which variant is fastest here
"$bin" run --framework torch --matrix docs/report_picture.yaml --variant eager --no-progress --out "$out/results" "$@"
"$bin" report "$out/results" -o "$out/report/index.html"
"$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1200,900 \
    --screenshot="$PWD/docs/report.png" "file://$out/report/index.html" 2>/dev/null
echo "docs/report.png from $out/report/index.html ($(( $(date +%s) - start )) s; records in $out/results," \
     "the first screen as Markdown in $out/report/index.md)"
