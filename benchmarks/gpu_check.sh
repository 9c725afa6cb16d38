#!/usr/bin/env bash
# GPU check of the PyTorch adapter: `adapters` (each precision proved on the GPU by the capability probe),
# fp32 (strict), tf32, amp_fp16 and amp_bf16 on resnet8 and small_convnet with `--repeats auto` and `--variant auto`
# (the fastest of channels_last, eager and compile on this GPU, recorded in variant_choice), every variant's
# fingerprint held to the default's (`parity`), `diagnose` (tensor capture, numerics verdicts) on resnet8 and
# mnist_mlp, `profile` (per-layer times and the dtype each layer computed in, under torch.profiler) on both
# models, the memory guard against the GPU's free memory (a batch that cannot fit is refused before any run, exit 2,
# one line), then a table of median step times and the report. Then the JAX adapter on the same GPU: its precisions
# with `--repeats auto`, its fingerprints held to torch's by `parity` (the two frameworks on one GPU), `diagnose`;
# and every GPU run's memory figure (the core's template Trainer reads each framework's allocator peak above its
# level before the build) checked to hold the weights, gradients and optimizer state it must hold. Transformers:
# tiny_gpt and vit_tiny timed in torch and JAX in every mixed precision (tokens/s in the report), the transformer
# pitfall specs fingerprinted on the GPU in both (fused attention where exact: which one ran is in each record's
# options.attention) and held to each other by `parity`, and tiny_gpt diagnosed and profiled (the cast map of
# attention and normalisation under CUDA autocast, whose op lists differ from the CPU's, and the attention
# numerics verdict per layer). The optimizer pitfall specs (AdamW's decay and exemptions, warm-up and cosine
# schedules, clipping while the fp16 scaler skips) fingerprinted on the GPU in both and held to each other.
# Training in 16 bits: the transformer study (benchmarks/transformer_study.yaml: tiny_gpt with AdamW, clipping
# and a schedule in fp32, mixed bf16/fp16 and pure bf16/bf16_sr/fp16, 3 seeds) in torch and JAX on the GPU, shown
# in the report's pure 16-bit section, and `diagnose --nonfinite` naming where pure fp16 and an oversized loss
# scale first go non-finite there.
# The scaling study (`study scaling`: tiny_gpt at batch 16, 64, 256 and 1024 in fp32, amp_bf16 and amp_fp16, torch
# and JAX) in its own out dir and report: where 16-bit starts to pay on the GPU, with the GPU's matmul curve per
# dtype beside the model's steps (from which n on tensor cores take over), and each size's own matmul shapes timed
# alone on the GPU (how much of the step they are, and whether 16-bit matmuls are faster at those shapes).
# Every diagnose above also records the FP8 cast statistics (diagnosis.fp8: what e4m3/e5m2 at the current and
# delayed recipes' scales would underflow or saturate per matmul input, computed in the core from the GPU's tensors).
# `compare` (one command from a spec to the report) on resnet8 in torch and JAX from this interpreter, with a budget.
# FP8 emulated by the core's rule on the GPU: fp8_e4m3 and fp8_hybrid, current and delayed, fingerprinted in torch and
# JAX and held to each other by `parity` (the :native ones too: JAX's unsupported rows are n/a), and the FP8 study
# (benchmarks/fp8_study.yaml) in torch. Native FP8 (torch._scaled_mm; Hopper and Ada only: elsewhere the capability
# probe records them unsupported with torch's error): tiny_gpt in fp32, amp_bf16, fp8_hybrid emulated and native,
# 3 repeats, whose report's FP8 section gives native FP8's step time against fp32's.
# A native spec (docs/native.md: the user's own nn.Module, here torch's nn.TransformerEncoder) timed on the GPU in
# fp32, amp_bf16 and amp_fp16, every precision from the same initial weights (options.native.initial_weights), and
# in fp8_hybrid emulated and through torch._scaled_mm (:native; Hopper and Ada only), its nn.Linear modules converted
# and its MultiheadAttention named as not converted (options.native.fp8).
# Needs a CUDA GPU, torch, and the core's packages (pydantic, pyyaml,
# pandas, scikit-learn, pillow, tqdm, jinja2, matplotlib: wheels can travel with the repo on an offline box):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu_check}
mkdir -p "$out"
python3 -m pip install --quiet --no-deps --no-build-isolation -e . -e adapters/torch -e adapters/jax
python3 -m harness adapters
set +e  # the guard must refuse this run (~5 TiB of activations) from the GPU's free memory: exit 2
python3 -m harness run --framework torch --device gpu --model small_convnet --batch-size 512 --input-size 4096x4096 --steps 1 \
  --repeats 1 --no-progress --out "$out/guard" 2> "$out/guard.txt"
code=$?
set -e
echo "memory guard: exit $code: $(cat "$out/guard.txt")"
[ "$code" = 2 ] && [ "$(wc -l < "$out/guard.txt")" = 1 ] && grep -q "free" "$out/guard.txt"
python3 -m harness run --framework torch --device gpu --model resnet8,small_convnet \
  --precision fp32,tf32,amp_fp16,amp_bf16 --steps 50 --warmup 10 --repeats auto --budget 300 --no-progress --out "$out"
python3 -m harness fingerprint --framework torch --device gpu --variant all --precision fp32,amp_bf16 \
  --model tests/specs/pitfall_nested_residual_dropout.yaml --no-progress --out "$out/parity"
python3 -m harness parity "$out/parity"
python3 -m harness diagnose --framework torch --device gpu --model resnet8,mnist_mlp --steps 20 --every 10 \
  --no-progress --out "$out/diagnose"
python3 -m harness profile --framework torch --device gpu --model resnet8,small_convnet \
  --precision fp32,amp_fp16,amp_bf16 --steps 5 --no-progress --out "$out/profile"
python3 -m harness run --framework jax --device gpu --model resnet8,mnist_mlp --precision fp32,amp_fp16,amp_bf16 \
  --steps 50 --warmup 10 --repeats auto --budget 200 --no-progress --out "$out"
python3 -m harness fingerprint --framework jax --device gpu --precision fp32,amp_bf16 \
  --model tests/specs/pitfall_nested_residual_dropout.yaml --no-progress --out "$out/parity"
python3 -m harness parity "$out/parity"
python3 -m harness diagnose --framework jax --device gpu --model resnet8,mnist_mlp --steps 20 --every 10 \
  --no-progress --out "$out/diagnose"
transformers=tests/specs/pitfall_causal_mask.yaml,tests/specs/pitfall_attention_dropout.yaml,tests/specs/pitfall_pre_norm.yaml,tests/specs/pitfall_patches.yaml,tests/specs/pitfall_long_sequence.yaml
for fw in torch jax; do
  python3 -m harness run --framework $fw --device gpu --model tiny_gpt,vit_tiny --precision fp32,amp_fp16,amp_bf16 \
    --steps 50 --warmup 10 --repeats 3 --no-progress --out "$out"
  python3 -m harness fingerprint --framework $fw --device gpu --precision fp32,amp_bf16,amp_fp16 \
    --model "$transformers" --no-progress --out "$out/parity_transformers"
done
python3 -m harness parity "$out/parity_transformers"
optimizers=tests/specs/pitfall_adamw_decay.yaml,tests/specs/pitfall_norm_decay.yaml,tests/specs/pitfall_clip_scaled.yaml,tests/specs/pitfall_warmup_cosine.yaml
for fw in torch jax; do
  python3 -m harness fingerprint --framework $fw --device gpu --precision fp32,amp_bf16,amp_fp16 \
    --model "$optimizers" --no-progress --out "$out/parity_optimizers"
done
python3 -m harness parity "$out/parity_optimizers"
# the whole identity proof tox runs on CPUs (tests/identity.yaml: every built-in model and pitfall spec in fp64, fp32,
# the mixed precisions, stochastic rounding, FP8 and the block-scaled precisions; pitfall_mobile_graph's named
# tensors, merges, depthwise, grouped and dilated convolutions with cuDNN's kernels here; pitfall_rotary's rotary
# embeddings and grouped key/value heads; the imported MobileNetV2-style network and Hugging Face Llama), on the GPU in
# both, held to each other
for fw in torch jax; do
  python3 -m harness fingerprint --framework $fw --device gpu --matrix tests/identity.yaml --no-progress \
    --out "$out/parity_identity"
done
python3 -m harness parity "$out/parity_identity"
python3 -m harness diagnose --framework torch --device gpu --model tiny_gpt --steps 20 --every 10 \
  --no-progress --out "$out/diagnose"
for fw in torch jax; do
  python3 -m harness run --framework $fw --device gpu --matrix benchmarks/transformer_study.yaml --no-progress \
    --out "$out/transformer_study"
  python3 -m harness diagnose --nonfinite --framework $fw --device gpu --model tiny_gpt --precision fp16 --steps 5 \
    --no-progress --out "$out/nonfinite"
  python3 -m harness diagnose --nonfinite --framework $fw --device gpu --model tiny_gpt --precision amp_fp16 \
    --loss-scale dynamic:2^24 --steps 5 --no-progress --out "$out/nonfinite"
done
python3 -m harness report "$out/transformer_study" -o "$out/transformer_study.html"
# where 16-bit starts to pay on the GPU, in each framework's first variant (torch eager, JAX jit), so that no
# size of the study measures compiled variants first
for fw in torch jax; do
  variant=$([ $fw = torch ] && echo eager || echo jit)
  python3 -m harness study scaling --framework $fw --device gpu --variant $variant --model tiny_gpt \
    --batch-sizes 16,64,256,1024 --precision fp32,amp_bf16,amp_fp16 --repeats 3 --steps 30 --warmup 10 \
    --no-progress --out "$out/scaling"
done
python3 -m harness report "$out/scaling" -o "$out/scaling.html"
for fw in torch jax; do
  python3 -m harness fingerprint --framework $fw --device gpu \
    --precision fp8_e4m3,fp8_hybrid,fp8_hybrid:delayed:16,fp8_hybrid:native,fp8_hybrid:delayed:16:native \
    --model mnist_mlp,resnet8,tiny_gpt,tests/specs/pitfall_patches.yaml --no-progress --out "$out/parity_fp8"
  python3 -m harness fingerprint --framework $fw --device gpu --precision fp64,fp32,fp8_hybrid,fp8_hybrid:delayed:16 \
    --model tests/specs/pitfall_fp8_delayed.yaml --no-progress --out "$out/parity_fp8"
done
python3 -m harness parity "$out/parity_fp8"
# block-scaled training emulated by the core's rule on the GPU (harness.microscaling), every recipe, in torch and JAX,
# convolutions and patch embeddings (resnet8, vit_tiny) included; :sr draws its bits on the GPU (not compared: two
# runs differ by design, so it is run, not paired); :native must say unsupported (no adapter has the kernels)
for fw in torch jax; do
  python3 -m harness fingerprint --framework $fw --device gpu --precision mxfp8,mxfp6,mxfp4,nvfp4,nvfp4:rht,fp8_block \
    --model mnist_mlp,tiny_gpt,resnet8,vit_tiny --batch-size 16 --no-progress --out "$out/parity_blocks"
  python3 -m harness fingerprint --framework $fw --device gpu --precision nvfp4:rht:sr,mxfp8:native \
    --model tiny_gpt,resnet8 --batch-size 16 --no-progress --out "$out/blocks_sr"
done
python3 -m harness parity "$out/parity_blocks"
python3 -m harness run --framework torch --device gpu --model tiny_gpt \
  --precision fp32,amp_bf16,fp8_hybrid,fp8_hybrid:native --repeats 3 --no-progress --out "$out/fp8_native"
python3 -m harness report "$out/fp8_native" -o "$out/fp8_native.html"
python3 -m harness run --framework torch --device gpu --matrix benchmarks/fp8_study.yaml --no-progress \
  --out "$out/fp8_study"
python3 -m harness report "$out/fp8_study" -o "$out/fp8_study.html"
python3 -m harness compare resnet8 --frameworks torch,jax --precision fp32,tf32,amp_bf16,amp_fp16 --steps 30 \
  --budget 5m --out "$out/compare"
python3 -m harness profile --framework torch --device gpu --model tiny_gpt,vit_tiny \
  --precision fp32,amp_fp16,amp_bf16 --steps 5 --no-progress --out "$out/profile"
python3 - "$out" <<'PY'
import sys
from harness import results
short = []
for r in results.read_records([sys.argv[1]]):
    if r["status"] == "ok" and r.get("peak_memory_mb") is not None:
        held = sum(r["state_memory_mb"][k] for k in ("weights", "gradients", "optimizer_state"))
        print(f"{r['framework']} {r['model']} {r['precision']}: peak {r['peak_memory_mb']:.1f} MB ({r['memory_kind']}); "
              f"weights + gradients + state {held:.1f} MB")
        if r["peak_memory_mb"] < held:
            short.append(r["run_id"])
assert not short, f"memory figures below what the run must hold: {short}"
PY
python3 - "$out" <<'PY'
import sys
from harness.results import load
df = load([sys.argv[1]])
ok = df[df.status == "ok"]
table = ok.groupby(["model", "precision"]).agg(
    median_ms=("step_time_ms.median", "median"), samples_per_s=("samples_per_s", "median"),
    peak_mb=("peak_memory_mb", "median"), eval_acc=("eval_accuracy", "mean"))
print(table.round(2).to_string())
print(df[df.status != "ok"][["model", "precision", "status", "reason"]].to_string())
PY
python3 -m harness report "$out" -o "$out/index.html" --profiles "$out/profile" --diagnoses "$out/diagnose"
python3 -m harness run --framework torch --device gpu --model benchmarks/native_encoder.yaml \
  --precision fp32,amp_bf16,amp_fp16,fp8_hybrid,fp8_hybrid:native --repeats 3 --no-progress --out "$out/native"
python3 - "$out/native" <<'PY'
import sys
from harness import results
records = results.read_records([sys.argv[1]])
native_fp8 = [r for r in records if r["precision"] == "fp8_hybrid:native" and r["status"] == "unsupported"]
records = [r for r in records if r not in native_fp8]  # a GPU without FP8 matmuls: said, with torch's error
assert all(r["status"] == "ok" for r in records), [(r["precision"], r["reason"]) for r in records]
digests = {r["options"]["native"]["initial_weights"] for r in records}
assert len(digests) == 1, digests
for r in records:
    if r["precision"].startswith("fp8"):
        fp8 = r["options"]["native"]["fp8"]
        assert fp8["converted"] > 0 and any("MultiheadAttention" in m for m in fp8["not_converted"]), fp8
print("native encoder on the GPU:", {r["precision"]: round(r["step_time_ms"]["median"], 3) for r in records},
      "; fp8_hybrid:native unsupported:", [r["reason"] for r in native_fp8])
PY
