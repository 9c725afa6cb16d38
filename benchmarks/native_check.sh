#!/usr/bin/env bash
# Native specs end to end (docs/native.md): the user's own models, as they are, timed in fp32, amp_bf16 and amp_fp16
# (3 repeats) and rendered into one report. torch: Hugging Face GPT-2, Llama, BERT, ViT and MobileNetV2 in small
# configs and torch's nn.TransformerEncoder (adapters/torch/tests/native_models.py); tensorflow: keras.applications
# MobileNetV2 and ResNet50 (random weights, 32x32) and a saved .keras file with its own weights. The specs are in
# benchmarks/native/; their module paths are relative to the repository's root, where this runs. Needs the torch,
# tensorflow and core envs that `tox` builds. About 15 minutes on 2 cores.
#   bash benchmarks/native_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/native_check}
rm -rf "$out"
mkdir -p "$out"
common=(--precision fp32,amp_bf16,amp_fp16 --repeats 3 --warmup 3 --no-progress --out "$out")
for spec in benchmarks/native/torch_*.yaml; do
  .tox/torch/bin/amp-harness run --framework torch --variant eager --model "$spec" "${common[@]}"
done
.tox/tensorflow/bin/python -c "import sys; sys.path.insert(0, 'adapters/tensorflow/tests'); import native_models; \
native_models.convnet().save(sys.argv[1])" "$out/convnet.keras" 2> /dev/null
cat > "$out/keras_saved.yaml" <<SPEC
name: keras_saved
native: {keras: convnet.keras}  # beside this spec file
input: {shape: [16, 16, 3]}
dataset: {name: synthetic, num_classes: 4, size: 512}
loss: {type: sparse_categorical_crossentropy, from_logits: true}
optimizer: {type: adamw, learning_rate: 1.0e-3, weight_decay: 0.01}
batch_size: 16
steps: 20
SPEC
for spec in benchmarks/native/keras_*.yaml "$out/keras_saved.yaml"; do
  .tox/tensorflow/bin/amp-harness run --framework tensorflow --variant graph --model "$spec" "${common[@]}"
done
.tox/core/bin/amp-harness report "$out" -o "$out/index.html"
