"""The framework-neutral model spec: a YAML file validated into plain pydantic models. This module is the schema
only: whether the layers' shapes fit is shape inference's question (harness.model.graph.infer), asked where a
spec is resolved for use (harness.run.plan.resolve).

The spec defines the math. Every adapter must reproduce it exactly:
- images are NHWC; `flatten` flattens in H, W, C order;
- conv2d/pool 'same' padding follows TensorFlow: total = max((ceil(n/s)-1)*s + k - n, 0), the odd pixel
  at the bottom/right; average pooling with 'same' excludes padded pixels from the mean;
- batchnorm: running = momentum*running + (1-momentum)*batch, with the *biased* batch variance;
- rmsprop: v = rho*v + (1-rho)*g^2; p -= lr*g/sqrt(v+eps) ("inside") or lr*g/(sqrt(v)+eps) ("outside");
- adam: bias-corrected moments, p -= lr*m_hat/(sqrt(v_hat)+eps) (PyTorch's form, epsilon outside);
- adamw: adam's update plus decoupled weight decay, p -= lr*(m_hat/(sqrt(v_hat)+eps) + weight_decay*p), with p
  before the update on both sides, lr the step's scheduled rate (decay follows the schedule, as in PyTorch,
  Keras and optax); `no_decay` names the kinds of weight that get no decay (default biases, norm betas
  included, and norm scales; harness.model.optimizer.decays);
- sgd: buf = momentum*buf + g; p -= lr*buf (nesterov: p -= lr*(g + momentum*buf));
- every optimizer's `schedule` gives lr per step t = 0, 1, ... (every step the trainer takes, untimed warm-up
  and steps the loss scaler skips included; harness.model.optimizer.learning_rate): constant, or
  warmup_cosine: lr*(t+1)/warmup_steps for t < warmup_steps, then min_lr + (lr - min_lr)*(1 + cos(pi*u))/2 with
  u = (t - warmup_steps)/(decay_steps - warmup_steps) (decay_steps: default the spec's `steps`), min_lr from
  t >= decay_steps on;
- every optimizer's `clip_norm` c: the global norm n = sqrt(sum of g^2 over every weight's gradient) of the
  *unscaled* gradients, after the loss scaler's finite check (a skipped step is neither clipped nor applied);
  every gradient is multiplied by c / max(n, c) (no epsilon: PyTorch's clip_grad_norm_ divides by n + 1e-6,
  which fp64 parity would see) before the update;
- dropout: x * mask / (1 - rate) in training, with the masks the core draws (harness.model.dropout);
  identity in inference; `per_sample`: one mask value per sample, kept or dropped whole (stochastic depth, as
  EfficientNet's Dropout with noise_shape (None, 1, 1, 1) before a residual add);
- conv2d `groups` g: input and output channels in g groups of C/g and F/g, group i's outputs from group i's inputs
  only, the kernel [k, k, C/g, F] (a depthwise convolution of multiplier m: groups C, filters C*m, output channel
  c*m + j from input channel c); `dilation` d: kernel taps d pixels apart, a window of (k-1)*d+1 pixels, 'same'
  padding computed on that window;
- zero_pad2d: zeros added to an image's top, bottom, left and right (`padding`: one number for all four, or
  [top, bottom, left, right]);
- relu6: min(max(x, 0), 6); silu (Keras' swish): x * sigmoid(x); hard_swish: x * relu6(x + 3) / 6;
  global_maxpool2d: the maximum over H and W; `keepdims`: a global pool's [C] as a [1, 1, C] image;
- rescaling: x * scale + offset, each one number or one per channel (feature), in whatever dtype the framework's
  own product gives under mixed precision (Keras' Rescaling computes in the compute dtype; a Keras Normalization
  layer is the rescaling 1/sqrt(variance), -mean/sqrt(variance));
- named tensors: a layer's `name` labels its output; a later layer of the same list takes it with `input: NAME`
  (default: the previous layer's output; the list's input is named `input`), a merge with `inputs: [A, B, ...]`:
  add and multiply elementwise with broadcasting (shapes aligned at their last axes, as numpy does without the
  batch axis: a [C] gate times an [H, W, C] image scales each channel), concat along the last (channel or
  feature) axis in the order named; under mixed precision a merge of a 16-bit and a float32 tensor is in the
  dtype the framework's own add (multiply, concatenate) gives, as a residual block's sum is;
- losses are batch means computed in float32 (float64 in float64 runs); probabilities are clipped to
  [1e-7, 1-1e-7]; a next-token loss is the mean over every token of the batch.

Sequences (an input with `vocab`: token ids [T]; activations [T, D], batch axis first, no layout change in any
framework):
- `dense`, `layernorm`, `rmsnorm`, the activations (softmax included) and `dropout` act on the last axis;
  residual blocks add sequences;
- embedding: out[t] = embeddings[id[t]], the table [vocab, D];
- position_embedding: out[t] = x[t] + embeddings[t], the table [max_length (default T), D], its first T rows;
- attention (multi-head self-attention, H heads of Dh = D / H): q = x @ query_kernel + query_bias, k and v
  likewise (kernels [D, D], biases [D], no biases when use_bias is false); head h is columns h*Dh .. (h+1)*Dh-1
  of q, k and v; `kv_heads` G (grouped-query attention; G divides H): k and v have G heads (kernels [D, G*Dh]),
  query head h attending with key/value head h // (H/G) (Llama's repeat_kv); `rotary` (base b, pairing):
  after the projections, each head of q and k at position t becomes x*cos + x[partner]*signed_sin, the angle of
  dimension i t*b^(-2f/Dh) for its frequency f, the tables computed in float64 and taken in the run's parameter
  dtype, then cast to q's (harness.model.rotary; "half": f = i mod Dh/2, i paired with i +- Dh/2 as Hugging
  Face's rotate_half; "interleaved": f = i // 2, 2f paired with 2f+1 as GPT-J and Meta's Llama); scores s =
  q_h k_h^T / sqrt(Dh) ([T, T] per head, scaled before the softmax); causal: s[i, j] =
  -inf where j > i (a causal row always keeps j = i, so no row is fully masked); p = softmax over j, in the
  compute dtype's own softmax (what each framework keeps in float32 is a finding, not the spec); dropout:
  p * mask / (1 - dropout) with the core's mask [H, T, T] per sample (harness.model.dropout); the heads' p v_h
  concatenated in head order, then @ output_kernel [D, D] + output_bias;
- rmsnorm: x / sqrt(mean(x^2 over the last axis) + epsilon) * gamma (epsilon inside the root; no beta);
- bias: x + bias, a learned vector on the last axis (BERT's token-type row when no token types are given), in
  the dtype the framework's own add gives;
- sequence_pool: mean over T, or the first (t = 0) or last (t = T-1) position: [T, D] -> [D];
- patches (size P, dim D): the image [H, W, C] cut into (H/P) x (W/P) patches in row-major order, each
  flattened in (P, P, C) order and projected: patch @ kernel + bias, the kernel [P, P, C, D] (a conv2d of
  kernel P and stride P, 'valid'), giving [H/P * W/P, D].
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    model_serializer,
    model_validator,
)

from harness.errors import SpecError, clip
from harness.limits import MAX_STEPS
from harness.model.yaml_file import read_yaml

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
PROB_EPSILON = 1e-7  # clip for losses on probabilities (Keras' backend epsilon)
MAX_WIDTH = 64.0  # a width factor beyond this makes a built-in model's step take the machine


class _Strict(BaseModel):
    # no infinities or NaNs anywhere: an infinite learning rate would pass and the run then "diverge"
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# ---- layers -------------------------------------------------------------------------------------------
TENSOR_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# fields a spec without them dumps (and hashes) without: what a spec written before they existed says
OMITTED_DEFAULTS = {"name": None, "input": None, "groups": 1, "dilation": 1, "keepdims": False, "per_sample": False,
                    "kv_heads": None, "rotary": None}


class _Layer(_Strict):
    """What any layer may say besides its type and hyper-parameters: the name of its output and the named tensor it
    takes (the module's docstring, "named tensors"); where and whether they resolve is graph inference's question."""
    name: Optional[str] = Field(None, pattern=TENSOR_NAME)
    input: Optional[str] = Field(None, pattern=TENSOR_NAME)

    @model_serializer(mode="wrap")
    def _without_defaults(self, handler):
        data = handler(self)
        for key, default in OMITTED_DEFAULTS.items():
            if key in data and data[key] == default:
                del data[key]
        return data


class Dense(_Layer):
    type: Literal["dense"]
    units: PositiveInt
    use_bias: bool = True


class Conv2D(_Layer):
    type: Literal["conv2d"]
    filters: PositiveInt
    kernel_size: PositiveInt
    strides: PositiveInt = 1
    padding: Literal["valid", "same"] = "valid"
    use_bias: bool = True
    groups: PositiveInt = 1  # depthwise: groups = the input's channels
    dilation: PositiveInt = 1


class ZeroPad2D(_Layer):
    type: Literal["zero_pad2d"]
    padding: Union[NonNegativeInt, Annotated[list[NonNegativeInt], Field(min_length=4, max_length=4)]]

    @property
    def pads(self) -> tuple[int, int, int, int]:
        """(top, bottom, left, right)"""
        return (self.padding,) * 4 if isinstance(self.padding, int) else tuple(self.padding)


class MaxPool2D(_Layer):
    type: Literal["maxpool2d"]
    pool_size: PositiveInt = 2
    strides: Optional[PositiveInt] = None  # default: pool_size
    padding: Literal["valid", "same"] = "valid"


class AvgPool2D(_Layer):
    type: Literal["avgpool2d"]
    pool_size: PositiveInt = 2
    strides: Optional[PositiveInt] = None
    padding: Literal["valid", "same"] = "valid"


class GlobalPool2D(_Layer):
    type: Literal["global_avgpool2d", "global_maxpool2d"]
    keepdims: bool = False  # [C], or a [1, 1, C] image (what a squeeze-and-excite block's 1x1 convs take)


class Rescaling(_Layer):
    type: Literal["rescaling"]  # x * scale + offset, each a number or one per channel (feature)
    scale: Union[float, Annotated[list[float], Field(min_length=1)]] = 1.0
    offset: Union[float, Annotated[list[float], Field(min_length=1)]] = 0.0


class Flatten(_Layer):
    type: Literal["flatten"]


class Activation(_Layer):
    type: Literal["relu", "tanh", "sigmoid", "softmax", "relu6", "silu", "hard_swish"]


class GELU(_Layer):
    type: Literal["gelu"]
    approximate: bool = False  # False: x*Phi(x) with erf; True: the tanh approximation


class BatchNorm(_Layer):
    type: Literal["batchnorm"]
    momentum: float = Field(0.99, gt=0, lt=1)
    epsilon: float = Field(1e-3, gt=0)


class LayerNorm(_Layer):
    type: Literal["layernorm"]  # over the last (channel/feature) axis
    epsilon: float = Field(1e-3, gt=0)


class Dropout(_Layer):
    type: Literal["dropout"]
    rate: float = Field(ge=0, lt=1)
    per_sample: bool = False  # one draw per sample for its whole output (stochastic depth), not one per unit


class Embedding(_Layer):
    type: Literal["embedding"]  # token ids [T] -> [T, dim]; the vocabulary is the input's
    dim: PositiveInt


class PositionEmbedding(_Layer):
    type: Literal["position_embedding"]  # a learned [max_length, D] table, its first T rows added
    max_length: Optional[PositiveInt] = None  # default: the sequence length


class Rotary(_Strict):
    """Rotary position embedding of an attention's queries and keys (the module's docstring, "rotary")."""
    base: float = Field(10000.0, gt=1)
    pairing: Literal["half", "interleaved"] = "half"  # i with i + Dh/2 (Hugging Face's Llama), or 2i with 2i + 1


class Attention(_Layer):
    type: Literal["attention"]  # multi-head self-attention with its output projection
    heads: PositiveInt
    kv_heads: Optional[PositiveInt] = None  # grouped key/value heads (default: heads; 1: multi-query)
    causal: bool = False
    use_bias: bool = True
    dropout: float = Field(0.0, ge=0, lt=1)  # on the attention probabilities
    rotary: Optional[Rotary] = None

    @property
    def key_heads(self) -> int:
        return self.kv_heads or self.heads


class Bias(_Layer):
    type: Literal["bias"]  # a learned vector added on the last axis


class RMSNorm(_Layer):
    type: Literal["rmsnorm"]  # over the last axis
    epsilon: float = Field(1e-6, gt=0)


class SequencePool(_Layer):
    type: Literal["sequence_pool"]  # a sequence [T, D] to a vector [D]
    mode: Literal["mean", "first", "last"]


class Patches(_Layer):
    type: Literal["patches"]  # a ViT patch embedding: image [H, W, C] -> [H/size * W/size, dim]
    size: PositiveInt
    dim: PositiveInt


class Residual(_Layer):
    type: Literal["residual"]
    layers: list["Layer"] = Field(min_length=1)
    projection: Optional[list["Layer"]] = None  # shortcut path; identity when absent


class Merge(_Layer):
    type: Literal["add", "multiply", "concat"]
    inputs: list[Annotated[str, Field(pattern=TENSOR_NAME)]] = Field(min_length=2)

    @model_validator(mode="after")
    def _inputs_only(self) -> "Merge":
        if self.input is not None:
            raise ValueError("a merge takes `inputs` (a list of names), not `input`")
        return self


Layer = Annotated[
    Union[Dense, Conv2D, ZeroPad2D, MaxPool2D, AvgPool2D, GlobalPool2D, Rescaling, Flatten, Activation, GELU,
          BatchNorm, LayerNorm, Dropout, Embedding, PositionEmbedding, Attention, Bias, RMSNorm, SequencePool, Patches,
          Residual, Merge],
    Field(discriminator="type"),
]
Residual.model_rebuild()
LAYER_TYPES = ("dense", "conv2d", "zero_pad2d", "maxpool2d", "avgpool2d", "global_avgpool2d", "global_maxpool2d",
               "rescaling", "flatten", "relu", "relu6", "silu", "hard_swish", "gelu", "tanh", "sigmoid", "softmax", "batchnorm",
               "layernorm", "dropout", "embedding", "position_embedding", "attention", "rmsnorm", "sequence_pool",
               "patches", "bias", "residual", "add", "multiply", "concat")
MERGE_TYPES = ("add", "multiply", "concat")
SEQUENCE_LAYERS = ("embedding", "position_embedding", "attention", "rmsnorm", "sequence_pool", "patches")


# ---- a native model: the user's own network object ------------------------------------------------------
NATIVE_FRAMEWORKS = {"torch": "torch", "keras": "tensorflow"}  # native key -> the adapter that loads it
CALLABLE = r"^[^:\s]+:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"  # "pkg.module:build", "path/to/file.py:Model"


class Native(_Strict):
    """The user's model as it is, instead of `layers`: "module.path:name" (or "path/to/file.py:name", found as
    Python finds modules from the current folder and PYTHONPATH) naming an nn.Module or a callable of no arguments
    returning one (torch), or a saved Keras 3 model (a .keras path, relative to the spec file) or a callable
    returning one (keras). Only the framework's worker imports it (harness.run.native)."""
    torch: Optional[str] = Field(None, max_length=300, pattern=CALLABLE)
    keras: Optional[str] = Field(None, max_length=4096)

    @model_validator(mode="after")
    def _one(self) -> "Native":
        given = [key for key in NATIVE_FRAMEWORKS if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"give one of {', '.join(NATIVE_FRAMEWORKS)}, got {', '.join(given) or 'none'}")
        if self.keras is not None and not self.keras.endswith(".keras") and not re.match(CALLABLE, self.keras):
            raise ValueError(f"keras: '{clip(self.keras, 80)}' is neither a .keras file nor a callable "
                             f"'package.module:build'")
        return self

    @property
    def kind(self) -> str:
        """"torch" or "keras"."""
        return next(key for key in NATIVE_FRAMEWORKS if getattr(self, key) is not None)

    @property
    def target(self) -> str:
        return getattr(self, self.kind)

    @property
    def framework(self) -> str:
        """The adapter that loads it."""
        return NATIVE_FRAMEWORKS[self.kind]


# ---- the rest of a spec -------------------------------------------------------------------------------
class Input(_Strict):
    # [H, W, C] for images, [F] for vectors, [T] with `vocab` for a sequence of T token ids in [0, vocab)
    shape: list[PositiveInt] = Field(min_length=1, max_length=3)
    vocab: Optional[int] = Field(None, ge=2, le=2**20)

    @model_validator(mode="after")
    def _check(self) -> "Input":
        if len(self.shape) == 2:
            raise ValueError("shape: give [H, W, C] for images, [F] for vectors or [T] (with vocab) for token "
                             "sequences, not two dimensions")
        if self.vocab is not None and len(self.shape) != 1:
            raise ValueError("vocab: token ids come as a sequence [T], not an image")
        return self


TOKEN_DATASETS = ("text", "synthetic_tokens")
TEXT_VOCAB = 256  # text is bytes


class Dataset(_Strict):
    name: Literal["synthetic", "digits", "image_folder", "text", "synthetic_tokens"]
    # classes of a classification; a next-token task predicts the vocabulary and has none
    num_classes: Optional[int] = Field(None, ge=2)
    task: Optional[Literal["next_token", "classification"]] = None  # synthetic_tokens: default from num_classes
    size: PositiveInt = 2048  # synthetic, synthetic_tokens: number of samples
    # image_folder: directory of class sub-folders; text: a file, a directory or a glob (default: the Python
    # standard library's own source files)
    path: Optional[str] = Field(None, max_length=4096)
    eval_fraction: float = Field(0.2, gt=0, lt=1)
    # text: the sha256 (first 16 hex digits) of the corpus's bytes. Resolving a spec (harness.run.plan.resolve)
    # sets it from the files read, so that runs on different corpora never share a spec hash; one given in the
    # file must match them.
    corpus_hash: Optional[str] = Field(None, pattern=r"^[0-9a-f]{16}$")

    @model_validator(mode="after")
    def _check(self) -> "Dataset":
        if self.corpus_hash is not None and self.name != "text":
            raise ValueError("corpus_hash: only a text dataset reads a corpus")
        if self.name == "image_folder" and not self.path:
            raise ValueError("image_folder needs 'path'")
        if self.name == "digits" and self.num_classes not in (2, 10):
            raise ValueError("digits has num_classes 10, or 2 (digit >= 5)")
        if self.name in ("synthetic", "image_folder") and self.num_classes is None:
            raise ValueError(f"{self.name} needs num_classes")
        if self.task is not None and self.name != "synthetic_tokens":
            raise ValueError("task: only synthetic_tokens has a choice of task")
        if self.name == "text" and self.num_classes is not None:
            raise ValueError("text is next-token prediction over its bytes: it has no num_classes")
        if self.name == "synthetic_tokens":
            if self.task == "classification" and self.num_classes is None:
                raise ValueError("synthetic_tokens: a classification task needs num_classes")
            if self.task == "next_token" and self.num_classes is not None:
                raise ValueError("synthetic_tokens: a next_token task predicts the vocabulary: drop num_classes")
        return self

    @property
    def next_token(self) -> bool:
        """Labels are the next token at every position ([T] per sample), not one class per sample."""
        return self.name == "text" or (self.name == "synthetic_tokens" and self.num_classes is None)


class Loss(_Strict):
    type: Literal["sparse_categorical_crossentropy", "binary_crossentropy"]
    from_logits: bool  # explicit: the frameworks' defaults differ


class ConstantSchedule(_Strict):
    type: Literal["constant"]


class WarmupCosine(_Strict):
    type: Literal["warmup_cosine"]
    warmup_steps: int = Field(ge=0, le=MAX_STEPS)
    min_learning_rate: float = Field(0.0, ge=0)
    decay_steps: Optional[PositiveInt] = Field(None, le=MAX_STEPS)  # to the floor; default the spec's steps


Schedule = Annotated[Union[ConstantSchedule, WarmupCosine], Field(discriminator="type")]
SCHEDULE_TYPES = ("constant", "warmup_cosine")


class _Optimizer(_Strict):
    learning_rate: float = Field(gt=0)
    clip_norm: Optional[float] = Field(None, gt=0)  # of the unscaled gradients' global norm
    schedule: Optional[Schedule] = None  # none: the constant learning_rate

    @model_validator(mode="after")
    def _schedule_fits(self):
        schedule = self.schedule
        if isinstance(schedule, WarmupCosine):
            if schedule.min_learning_rate > self.learning_rate:
                raise ValueError(f"schedule.min_learning_rate: {schedule.min_learning_rate} is above learning_rate "
                                 f"{self.learning_rate}")
            if schedule.decay_steps is not None and schedule.decay_steps <= schedule.warmup_steps:
                raise ValueError(f"schedule.decay_steps: {schedule.decay_steps} must be above warmup_steps "
                                 f"{schedule.warmup_steps}")
        return self


class SGD(_Optimizer):
    type: Literal["sgd"]
    momentum: float = Field(ge=0, lt=1)
    nesterov: bool


class Adam(_Optimizer):
    type: Literal["adam"]
    beta_1: float = Field(ge=0, lt=1)
    beta_2: float = Field(ge=0, lt=1)
    epsilon: float = Field(gt=0)


class AdamW(Adam):
    type: Literal["adamw"]
    weight_decay: float = Field(ge=0, lt=1)
    no_decay: list[Literal["biases", "norm_scales", "embeddings"]] = ["biases", "norm_scales"]


class RMSprop(_Optimizer):
    type: Literal["rmsprop"]
    rho: float = Field(gt=0, lt=1)
    epsilon: float = Field(gt=0)
    epsilon_placement: Literal["inside", "outside"]  # Keras/MXNet: inside the sqrt; PyTorch: outside


Optimizer = Annotated[Union[SGD, Adam, AdamW, RMSprop], Field(discriminator="type")]
# what a native model's optimizer may leave out: its framework's own defaults (torch.optim's, keras.optimizers')
_TORCH_ADAM = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8}
_KERAS_ADAM = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}
FRAMEWORK_OPTIMIZER_DEFAULTS = {
    "torch": {"sgd": {"momentum": 0.0, "nesterov": False}, "adam": _TORCH_ADAM, "adamw": _TORCH_ADAM,
              "rmsprop": {"rho": 0.99, "epsilon": 1e-8, "epsilon_placement": "outside"}},
    "keras": {"sgd": {"momentum": 0.0, "nesterov": False}, "adam": _KERAS_ADAM, "adamw": _KERAS_ADAM,
              "rmsprop": {"rho": 0.9, "epsilon": 1e-7, "epsilon_placement": "inside"}},
}
OPTIMIZER_TYPES = ("sgd", "adam", "adamw", "rmsprop")


class ModelSpec(_Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")  # echoed on one line
    description: str = Field("", max_length=10_000)
    input: Input
    dataset: Dataset
    layers: Optional[list[Layer]] = Field(None, min_length=1)  # the network in the spec's language, or
    native: Optional[Native] = None  # the user's own network object
    loss: Loss
    optimizer: Optimizer
    batch_size: PositiveInt
    steps: PositiveInt = Field(le=MAX_STEPS)  # a record holds every step (harness.limits)
    seed: int = Field(0, ge=0, lt=2**32)  # what numpy's generators take
    # the factor a scaling study's --widths scaled the layers by (with_overrides); None: the file's own widths
    width: Optional[float] = Field(None, gt=0, le=MAX_WIDTH)

    @model_serializer(mode="wrap")
    def _one_network(self, handler):
        """A spec's dump holds the network it has: `layers`, or `native` (a spec written before native models
        existed dumps, embeds and hashes as it did)."""
        data = handler(self)
        for key in ("layers", "native"):
            if data.get(key, ...) is None:
                del data[key]
        return data

    @model_validator(mode="before")
    @classmethod
    def _framework_optimizer_defaults(cls, data):
        """A native model's optimizer may leave out what its framework defaults (FRAMEWORK_OPTIMIZER_DEFAULTS): the
        user's model trains with its framework's optimizer as that framework's users write it. A spec's layers
        train in every framework, whose defaults differ, so their optimizer says everything."""
        native = data.get("native") if isinstance(data, dict) else None
        optimizer = data.get("optimizer") if isinstance(native, dict) else None
        if isinstance(optimizer, dict):
            kind = next((key for key in NATIVE_FRAMEWORKS if native.get(key) is not None), None)
            name = optimizer.get("type")  # not yet validated: a list here is the one-line error validation gives
            defaults = FRAMEWORK_OPTIMIZER_DEFAULTS.get(kind, {}).get(name, {}) if isinstance(name, str) else {}
            data = {**data, "optimizer": {**defaults, **optimizer}}
        return data

    @model_validator(mode="after")
    def _network(self) -> "ModelSpec":
        if (self.layers is None) == (self.native is None):
            raise ValueError("give the network as `layers` or as `native` (the model object itself), one of them")
        if self.native is not None and self.width is not None:
            raise ValueError("width: a native model's widths are its own (scaling studies vary batch and length)")
        return self

    @model_validator(mode="after")
    def _token_input(self) -> "ModelSpec":
        token_data, vocab = self.dataset.name in TOKEN_DATASETS, self.input.vocab
        if token_data and vocab is None:
            raise ValueError(f"input.vocab: {self.dataset.name} gives token ids: give the vocabulary size")
        if not token_data and vocab is not None:
            raise ValueError(f"input.vocab: {self.dataset.name} gives no token ids (token datasets: "
                             f"{', '.join(TOKEN_DATASETS)})")
        if self.dataset.name == "text" and vocab != TEXT_VOCAB:
            raise ValueError(f"input.vocab: text is bytes, vocab {TEXT_VOCAB}, got {vocab}")
        return self

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """A sample's shape as the core's data gives it: [H, W, C] images. A native torch model takes its images
        channels first, as `input.shape` says them ([C, H, W]): its trainer transposes the batches."""
        shape = tuple(self.input.shape)
        if self.native is not None and self.native.kind == "torch" and len(shape) == 3:
            return (*shape[1:], shape[0])
        return shape

    @property
    def tokens(self) -> bool:
        """The input is a sequence of token ids."""
        return self.input.vocab is not None

    @property
    def classes(self) -> int:
        """What the output predicts over: the dataset's classes, or the vocabulary for next-token prediction."""
        if self.dataset.next_token:
            return self.input.vocab or TEXT_VOCAB
        return self.dataset.num_classes

    @property
    def task(self) -> str:
        return "next_token" if self.dataset.next_token else "classification"

    def with_corpus_hash(self, corpus_hash: str) -> "ModelSpec":
        """A text dataset's spec with the hash of the corpus it reads (harness.run.plan.resolve)."""
        if self.dataset.corpus_hash not in (None, corpus_hash):
            raise SpecError(f"{self.name}: dataset.corpus_hash: the spec names corpus {self.dataset.corpus_hash}, "
                            f"its files have {corpus_hash}")
        return self.model_copy(update={"dataset": self.dataset.model_copy(update={"corpus_hash": corpus_hash})})

    def with_overrides(self, batch_size: int | None = None, steps: int | None = None,
                       input_size: tuple[int, int] | None = None, width: float | None = None,
                       seq_len: int | None = None) -> "ModelSpec":
        """Return a validated copy with CLI overrides applied (the spec hash covers them). `width` scales every
        layer's units, filters and dims (scaled_layers); `seq_len` is a token model's sequence length T."""
        data = self.model_dump()
        if batch_size is not None:
            data["batch_size"] = batch_size
        if steps is not None:
            data["steps"] = steps
        if input_size is not None:
            if len(self.input.shape) != 3:
                raise SpecError(f"{self.name}: --input-size applies to image inputs [H, W, C] only")
            channels_first = self.sample_shape != tuple(self.input.shape)
            data["input"]["shape"] = [self.input.shape[0], *input_size] if channels_first else \
                [*input_size, self.input.shape[2]]
        if seq_len is not None:
            if not self.tokens:
                raise SpecError(f"{self.name}: --seq-lens applies to models of token ids only (input with vocab); "
                                f"its input is {list(self.input.shape)}")
            data["input"]["shape"] = [seq_len]
        if width is not None and width != (self.width or 1.0):
            if self.native is not None:
                raise SpecError(f"{self.name}: --widths scales a spec's layers; a native model's are its own")
            if not 0 < width <= MAX_WIDTH:
                raise SpecError(f"{self.name}: width {width:g}: a factor in (0, {MAX_WIDTH:g}]")
            factor = width / (self.width or 1.0)
            data["layers"] = scaled_layers(data["layers"], factor)
            data["width"] = None if width == 1.0 else width  # width 1 is the file's own network, and its hash
            _heads_divide(data["layers"], self.name, width)
        return validate(data, self.name)

    def spec_hash(self) -> str:
        """Equal for the same spec, seed and overrides, whatever the framework (description excluded)."""
        data = self.model_dump(exclude={"description"})
        if data["width"] is None:  # added for scaling studies: every earlier spec keeps its hash
            del data["width"]
        # fields added for token sequences hash only when set, so that every earlier spec keeps its hash
        for part, key in (("input", "vocab"), ("dataset", "task"), ("dataset", "corpus_hash"),
                          ("optimizer", "clip_norm"), ("optimizer", "schedule")):
            if data[part][key] is None:
                del data[part][key]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def scaled_layers(layers: list[dict], factor: float) -> list[dict]:
    """Layers (as dumped) with every width scaled by `factor`, rounded, at least 1: dense units, conv filters,
    the embedding's and the patches' dim (the transformer's D, which attention, norms and residual sums follow).
    The output layer (the last dense at the top level: classes or vocabulary) keeps its units."""
    def scale(n: int) -> int:
        return max(1, round(n * factor))

    def walk(items: list[dict], output: int | None) -> list[dict]:
        out = []
        for i, layer in enumerate(items):
            layer = dict(layer)
            if layer["type"] == "dense" and i != output:
                layer["units"] = scale(layer["units"])
            elif layer["type"] == "conv2d":
                layer["filters"] = scale(layer["filters"])
            elif layer["type"] in ("embedding", "patches"):
                layer["dim"] = scale(layer["dim"])
            elif layer["type"] == "residual":
                layer["layers"] = walk(layer["layers"], None)
                if layer.get("projection"):
                    layer["projection"] = walk(layer["projection"], None)
            out.append(layer)
        return out

    dense = [i for i, layer in enumerate(layers) if layer["type"] == "dense"]
    return walk(layers, dense[-1] if dense else None)


def _heads_divide(layers: list[dict], name: str, width: float) -> None:
    """SpecError (one line) where the scaled model dimension is not a multiple of an attention layer's heads."""
    dims = [layer["dim"] for layer in layers if layer["type"] in ("embedding", "patches")]

    def attention(items):
        for layer in items:
            if layer["type"] == "attention":
                yield layer
            elif layer["type"] == "residual":
                yield from attention(layer["layers"])

    for layer in attention(layers):
        for dim in dims:
            if dim % layer["heads"]:
                raise SpecError(f"{name}: width {width:g} makes the model dimension {dim}, which {layer['heads']} "
                                f"attention heads do not divide; choose a width that keeps it a multiple of "
                                f"{layer['heads']}")


# ---- loading ------------------------------------------------------------------------------------------
def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in LAYER_TYPES + OPTIMIZER_TYPES + SCHEDULE_TYPES:
            continue  # the discriminator's branch name, not a place in the file
        else:
            out += f".{clip(part, 40)}" if out else clip(part, 40)
    return out or "(top level)"


def _known_fields() -> set[str]:
    models = [ModelSpec, Native, Input, Dataset, Loss, SGD, Adam, AdamW, RMSprop, WarmupCosine, Dense, Conv2D, ZeroPad2D,
              MaxPool2D, AvgPool2D, GlobalPool2D, Rescaling, GELU, BatchNorm, LayerNorm, Dropout, Embedding,
              PositionEmbedding, Attention, Rotary, Bias, RMSNorm, SequencePool, Patches, Residual, Merge]
    return {name for model in models for name in model.model_fields}


def validate(data: object, source: str) -> ModelSpec:
    """Validate parsed YAML; raise a one-line SpecError naming `source`, the place and the problem."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        spec = ModelSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"]
        if err["type"] == "union_tag_invalid":
            msg = f"unknown type '{clip(err['input'].get('type'), 40)}'" if isinstance(err.get("input"), dict) else msg
            loc = err["loc"]
            valid = LAYER_TYPES if "layers" in loc or "projection" in loc else \
                SCHEDULE_TYPES if "schedule" in loc else OPTIMIZER_TYPES
            msg += f" (valid: {', '.join(valid)})"
        elif err["type"] == "extra_forbidden":
            import difflib

            guess = difflib.get_close_matches(str(err["loc"][-1]), _known_fields(), n=1)
            msg = "unknown key" + (f"; did you mean '{guess[0]}'?" if guess else "")
        elif err["type"] == "string_pattern_mismatch":
            msg = "a tensor name is letters, digits and _, not starting with a digit" \
                if (err.get("ctx") or {}).get("pattern") == TENSOR_NAME else "must be one line of printable characters"
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        # a check across parts of the spec names its place itself
        where = "" if not err["loc"] and err["type"] == "value_error" else f"{_where(err['loc'])}: "
        raise SpecError(f"{source}: {where}{msg}{more}") from None
    return spec


def load_spec(name_or_path: str) -> ModelSpec:
    """Load a built-in model by name (models/NAME.yaml) or a spec file by path."""
    path = spec_path(name_or_path)
    spec = validate(read_yaml(path, SpecError), str(path))
    native = spec.native
    if native is not None and native.kind == "keras" and native.target.endswith(".keras"):
        saved = (path.parent / native.target).resolve()  # relative to the spec file, wherever it is run from
        spec = spec.model_copy(update={"native": native.model_copy(update={"keras": str(saved)})})
    return spec


def spec_path(name_or_path: str) -> Path:
    """The file of a built-in model's name (models/NAME.yaml), or the path itself."""
    path = Path(name_or_path)
    try:
        exists = path.exists()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
        raise SpecError(f"{clip(name_or_path)}: not a model name or spec file ({getattr(exc, 'strerror', exc)})") \
            from None
    if not path.suffix and not exists:
        path = MODELS_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            known = ", ".join(builtin_models()) or "none"
            raise SpecError(f"unknown model '{clip(name_or_path)}'; built-in models: {known}")
    return path


def builtin_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))
