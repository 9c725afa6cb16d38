"""One setting key for every section of the report (harness.identity): runs on two nodes, at two batch
sizes, are never pooled; memory figures are called comparable only when they are of one kind."""
from __future__ import annotations

from harness.report import build_view
from harness.identity import Setting, compatible, node, setting
from tests.core.test_report_answer import cell


def on(node_: str, records: list[dict]) -> list[dict]:
    return [{**r, "env": {**r["env"], "hostname": node_}} for r in records]


def test_two_nodes_are_not_pooled():
    view = build_view(on("a", cell("torch", "fp32", 12.0) + cell("torch", "amp_bf16", 10.0))
                      + on("b", cell("torch", "fp32", 30.0) + cell("torch", "amp_bf16", 15.0)))
    speed = {(r.framework, r.precision): r.repeats for r in view.speed}
    assert speed == {("torch [node a]", "fp32"): 3, ("torch [node a]", "amp_bf16"): 3,
                     ("torch [node b]", "fp32"): 3, ("torch [node b]", "amp_bf16"): 3}
    ratios = {s.framework: s.ratio for s in view.summary}  # each against its own node's fp32
    assert 1.1 < ratios["torch [node a]"] < 1.3 and 1.8 < ratios["torch [node b]"] < 2.2


def test_the_key_holds_every_part_of_a_setting():
    (r,) = cell("torch", "fp32", 12.0, repeats=1)
    r = {**r, "variant": "eager", "env": {**r["env"], "hostname": "a"}}
    assert setting(r) == Setting("cpu (test cpu)", "a", 2, "eager", "1.0", 32)
    assert setting({**r, "batch_size": 16}) != setting(r)
    # a run whose worker never reported: the node the executor placed it on (a Ray node's name adds its address)
    crashed = {"variant": None, "batch_size": 32, "env": {"node": "a 10.0.0.1 (ray node 5f3e)"}}
    assert node(crashed) == "a" and compatible(setting(crashed), setting(r))
    assert not compatible(setting({**crashed, "batch_size": 16}), setting(r))


def test_variants_chosen_by_auto_compare_each_precision_at_its_fastest():
    def chose(variant, records):
        return [{**r, "variant": variant, "variant_choice": {"chosen": variant}} for r in records]

    view = build_view(chose("compile", cell("torch", "fp32", 12.0)) + chose("channels_last", cell("torch", "amp_bf16", 10.0)))
    (s,) = view.summary  # one comparison: the two chosen variants are one setting, "auto"
    assert 1.1 < s.ratio < 1.3
    forced = build_view([{**r, "variant": "compile"} for r in cell("torch", "fp32", 12.0)]
                        + [{**r, "variant": "eager"} for r in cell("torch", "amp_bf16", 10.0)])
    assert not forced.summary  # variants asked for by name are settings of their own


def test_memory_is_called_comparable_only_for_figures_of_one_kind():
    same = build_view(cell("torch", "fp32", 12.0) + cell("jax", "fp32", 10.0))
    assert same.memory_note == "Every peak figure is of one kind, comparable across frameworks and precisions: rss."
    xla = [{**r, "memory_kind": "XLA GPU allocator peak"} for r in cell("jax", "fp32", 10.0)]
    differs = build_view(cell("torch", "fp32", 12.0) + xla).memory_note
    assert "comparable" not in differs
    assert differs == ("Peak figures are of 2 kinds, and only figures of one kind compare: jax: XLA GPU allocator "
                       "peak; torch: rss.")


def test_a_loss_scale_study_is_held_against_the_fp32_of_its_own_setting():
    fp32 = on("a", cell("torch", "fp32", 12.0, accuracy=0.9)) + on("b", cell("torch", "fp32", 12.0, accuracy=0.5))
    study = [{**r, "study": "ls", "precision": "amp_fp16",
              "loss_scale": {"settings": {"mode": "fixed", "initial": 2.0 ** k}}} for k, r in
             enumerate(on("b", cell("torch", "amp_fp16", 10.0, repeats=2)))]
    (s,) = build_view(fp32 + study).studies
    assert {p.fp32_accuracy for p in s.rows} == {0.5}
