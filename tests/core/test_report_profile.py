"""The report's "Where the time goes" section and the Why lines that cite profiles (harness.report.profile)."""
from __future__ import annotations

import pytest

from harness.adapter import LOSS_SCOPE, UPDATE_SCOPE, OpTime
from harness.model.graph import infer
from harness.model.spec import load_spec
from harness.report import build_view
from harness.report.jinja import render
from harness.report import profile
from harness.report.profile import CastRow, ProfileSection
from harness.results import PROFILES_FILE, append, read_records, typed
from harness.run.profile import attribute
from tests.core.test_runner import amp

SPEC = "tests/specs/pitfall_rmsprop_epsilon.yaml"  # dense 0, relu 1, dropout 2, dense 3, softmax 4


def profile_section(profiles: list[dict]) -> ProfileSection:
    """The section from these profiles, read as the report reads them (an edited one is left out, and said)."""
    return profile.profile_section(typed(profiles, PROFILES_FILE)[0])


def profile_record(framework: str, precision: str, dense_ms: tuple[float, float], dtype: str, cast_ms: float = 0.0,
                   batch: int = 16) -> dict:
    """A profile as the worker writes it, from ops: the two dense layers' backward times given, 1 ms elsewhere."""
    spec = load_spec(SPEC)
    ops = [OpTime("matmul", "layer.0", 0.001, inputs=(dtype, dtype)),
           OpTime("matmul_grad", "layer.0", dense_ms[0] / 1e3, backward=True),
           OpTime("relu", "layer.1", 0.001, inputs=(dtype,)),
           OpTime("matmul", "layer.3", 0.001, inputs=("float32", "float32") if framework == "other" else (dtype, dtype)),
           OpTime("matmul_grad", "layer.3", dense_ms[1] / 1e3, backward=True),
           OpTime("cast", "layer.0", cast_ms / 1e3, cast=True),
           OpTime("loss", LOSS_SCOPE, 0.001), OpTime("update", UPDATE_SCOPE, 0.001)]
    step = sum(op.seconds for op in ops) * 1e3 + 0.5  # 0.5 ms of "other"
    return {"run_id": f"{framework}-{precision}-{batch}", "status": "ok", "framework": framework, "model": spec.name, "precision": precision, "batch_size": batch,
            "device": "cpu", "profile": {"tool": f"{framework}'s profiler", "note": "", "warmup": 1,
                                         **attribute(infer(spec).layers, ops, [step])}}


PROFILES = [profile_record("fake", "fp32", (2, 3), "float32"),
            profile_record("fake", "amp_fp16", (2, 72), "float16", cast_ms=4),
            profile_record("other", "fp32", (2, 3), "float32"),
            profile_record("other", "amp_fp16", (2, 3), "float16")]


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """fake's amp_fp16 really is slower than its fp32 (its "slow" fault sleeps in every step)."""
    out = tmp_path_factory.mktemp("timed")
    ran = amp("run", "--framework", "fake", "--model", SPEC, "--precision", "fp32,amp_fp16", "--repeats", "3",
              "--steps", "3", "--warmup", "0", "--out", str(out), faults="amp_fp16=slow")
    assert ran.returncode == 0, ran.stderr
    return out


def test_section_names_the_layer_that_grew_with_its_factor_and_the_cast_share():
    section = profile_section(PROFILES)
    (entry,) = section.entries
    growth = {g.framework: g for g in entry.growth}
    top = growth["fake"].rows[0]
    assert (top.label, top.phase, top.factor) == ("3 dense", "backward", pytest.approx(24.0))
    assert top.share == pytest.approx(72 / (2 + 72 + 1 + 1 + 1 + 4 + 1 + 1 + 0.5))
    assert growth["fake"].casts == pytest.approx(4 / (83.5))
    assert "layer 3 dense backward takes 86% of the step, 24x its fp32 time" in growth["fake"].citation
    assert growth["other"].rows == []  # no layer grew: said, not invented
    html = render("_profile.html.j2", profile=section)
    assert 'id="profile"' in html and 'data-chart="profile"' in html
    assert "<td>3 dense</td><td>backward</td>" in html and "24x" in html


def test_cast_map_shows_what_ran_and_marks_where_frameworks_differ():
    maps = {m.precision: m for m in profile_section(PROFILES).entries[0].cast_maps}
    assert maps["fp32"].uniform == "float32"  # one sentence, not a table of float32
    amp16 = maps["amp_fp16"]
    assert amp16.columns == ["fake", "other"] and amp16.uniform is None
    rows = {row.label: row for row in amp16.rows}
    assert rows["3 dense"] == CastRow("3 dense", ["float16", "float32"], True)
    assert rows["0 dense"].differs is False and "2 dropout" not in rows  # no op ran: no row
    html = render("_profile.html.j2", profile=profile_section(PROFILES))
    assert '<tr class="flag"><td><strong>3 dense</strong></td><td>float16</td><td>float32</td></tr>' in html
    assert "every layer with an op computed in float32 in fake, other" in html


def test_why_cites_the_profile_instead_of_the_cpu_flags(timed):
    records = read_records([timed])
    without = build_view(records)
    assert any("float16 ran slower than fp32" in w.title for w in without.why)  # today's reasoning
    view = build_view(records, profiles=PROFILES)
    titles = [w.title for w in view.why]
    assert not any("float16 ran slower than fp32" in t for t in titles)
    (cited,) = [w for w in view.why if "by its profiles" in w.title]
    assert cited.title.startswith("Where 16-bit loses time in fake on cpu")
    assert "fake amp_fp16 (pitfall_rmsprop_epsilon), profiled" in cited.text
    assert "layer 3 dense backward takes 86% of the step" in cited.text and "timed: amp_fp16" in cited.text
    # a profile at another batch size is not this cell's: the reasoning from the CPU comes back
    other_batch = [profile_record("fake", p, ms, d, batch=64) for p, ms, d in
                   (("fp32", (2, 3), "float32"), ("amp_fp16", (2, 72), "float16"))]
    assert any("float16 ran slower" in w.title for w in build_view(records, profiles=other_batch).why)


def test_report_cli_reads_profiles_beside_results(timed, tmp_path):
    for record in PROFILES:
        append(tmp_path / "profiles", record, PROFILES_FILE)
    out = amp("report", str(timed), "--profiles", str(tmp_path / "profiles"), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "r.html").read_text()
    assert '<a href="#profile">Where the time goes</a>' in page and 'id="profile"' in page
    assert "## Where the time goes" in (tmp_path / "r.md").read_text()
    bare = amp("report", str(timed), "-o", str(tmp_path / "bare.html"))
    assert bare.returncode == 0 and 'id="profile"' not in (tmp_path / "bare.html").read_text()


def test_edited_profiles_are_left_out_not_a_traceback():
    broken = [{**PROFILES[0], "profile": {**PROFILES[0]["profile"], "layers": "x"}},
              {**PROFILES[1], "profile": {**PROFILES[1]["profile"], "step_mean_ms": float("nan")}},
              {**PROFILES[2], "profile": None}, {**PROFILES[3], "status": "failed", "run_id": "failed"}]
    assert profile_section(broken) == ProfileSection([], {}, [])
    assert len(profile_section(broken + PROFILES[2:]).entries[0].bars) == 2


def test_a_16_bit_profile_is_compared_with_the_fp32_profile_of_its_own_setting_only():
    """amp_fp16 at batch 16 against fp32 at batch 256 would measure the batch, not the precision."""
    other_batch = [profile_record("fake", "fp32", (2, 3), "float32", batch=256),
                   profile_record("fake", "amp_fp16", (2, 72), "float16", batch=16)]
    (entry,) = profile_section(other_batch).entries
    assert entry.growth == [] and profile_section(other_batch).citations == {}
    assert [b.label for b in entry.bars] == ["fake [batch 16] amp_fp16", "fake [batch 256] fp32"]
    # two nodes: each 16-bit profile against its own node's fp32, labelled by node
    on = [{**r, "env": {"hostname": node}, "run_id": f"{r['run_id']}-{node}"}
          for node, fp32_ms in (("a", 3), ("b", 72)) for r in
          (profile_record("fake", "fp32", (2, fp32_ms), "float32"),
           profile_record("fake", "amp_fp16", (2, 72), "float16"))]
    growth = {g.framework: g for g in profile_section(on).entries[0].growth}
    assert set(growth) == {"fake [node a]", "fake [node b]"}
    assert growth["fake [node a]"].rows[0].factor == pytest.approx(24.0)
    assert growth["fake [node b]"].rows == []  # the same time as its own fp32
