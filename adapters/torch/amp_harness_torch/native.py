"""A native model (a spec's `native: {torch: ...}`): the user's own nn.Module, trained by the same TorchTrainer as a
spec's network. NativeNetwork gives it the network's interface (forward with the batch's masks, the weights by
name, layer outputs by module) without changing a line of it: its weights are its own, its dropout draws from
torch's generator, its names are its modules' (`transformer.h.0.attn`), and a Hugging Face output's `logits`
are its output.

Under an FP8 precision (harness.fp8) each nn.Linear, nn.Conv2d and Hugging Face Conv1D computes its product
through the spec network's matmul_layer and Fp8Casts (amp_harness_torch.network): its forward is replaced on the
instance, so its weights keep their names. What holds matmul weights and is not converted (nn.MultiheadAttention's
projections, other module kinds, a converted module whose forward never ran in the first training step) is named
in the record (harness.adapter.NativeFp8).

Its initial weights: the module is made after TorchTrainer.configure's torch.manual_seed(spec.seed), the run's
seed, so every precision of one seed starts from the same values (NativeInfo.digest records them); a module given
as an object rather than made by a callable is the same object on every build in one process, so its first state
is kept and copied for the builds after the first.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from amp_harness_torch.network import NATIVE_FP8, Fp8Casts, matmul_layer
from harness.adapter import NativeFp8, NativeInfo, layer_scope
from harness.errors import HarnessError
from harness.model.native import weight_kind
from harness.run.native import weights_digest

_FIRST_STATE: dict[str, tuple[nn.Module, nn.Module]] = {}  # target -> (the object loaded, a copy of its first state)


def load(spec) -> nn.Module:
    """The spec's native module (made under the trainer's seed), on the CPU; HarnessError in one line naming the
    spec."""
    from amp_harness_torch.importer import load_module

    target = spec.native.target
    try:
        module = load_module(target)
    except HarnessError as exc:
        raise HarnessError(f"{spec.name}: native torch {exc}") from None
    if target in _FIRST_STATE and _FIRST_STATE[target][0] is module:  # the same object, maybe trained since
        return copy.deepcopy(_FIRST_STATE[target][1])
    _FIRST_STATE[target] = module, copy.deepcopy(module)
    return module


def logits(out):
    """The tensor a module's output holds: itself, a Hugging Face ModelOutput's `logits`, or a tuple's first."""
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is not None:
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise HarnessError(f"the native module returned a {type(out).__name__}: give a tensor of logits, a tuple "
                       f"starting with one, or an output with `logits`")


CONVERTED = "Linear, Conv2d and Hugging Face's Conv1D"
MHA = "MultiheadAttention: its projections run inside F.multi_head_attention_forward"


def _fp8_product(module: nn.Module):
    """(the product, its kernel, the bias's shape) matmul_layer computes a module's forward with, or None where FP8
    does not convert the module. A subclass with a forward of its own keeps it (a LoRA or quantized Linear's is
    more than its product)."""
    kind = type(module)
    if isinstance(module, nn.Linear) and kind.forward is nn.Linear.forward:
        return F.linear, lambda: module.weight, (-1,)
    if isinstance(module, nn.Conv2d) and kind.forward is nn.Conv2d.forward:  # emulated, as the spec's conv2d
        return module._conv_forward, lambda: module.weight, (1, -1, 1, 1)
    # transformers.pytorch_utils.Conv1D (GPT-2's): x @ W + b, W [in, out]: F.linear of W^T, so native FP8 takes it
    # too. Known by name: torch's adapter does not import transformers.
    if kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers.") and module.weight.ndim == 2:
        return F.linear, lambda: module.weight.t(), (-1,)
    return None


def _why_not_converted(module: nn.Module) -> str | None:
    """Why a module holding a matmul's weights is not converted to FP8, or None where it holds none (embedding
    tables are looked up, norms' scales multiply elementwise)."""
    if isinstance(module, nn.MultiheadAttention):
        return MHA
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return None
    if any(p.ndim >= 2 for p in module.parameters(recurse=False)):
        own = " whose forward is its own" if isinstance(module, (nn.Linear, nn.Conv2d)) else ""
        return f"{type(module).__name__}{own}: FP8 converts {CONVERTED} only"
    return None


class Fp8Forward:
    """A converted module's forward: its product through matmul_layer with its FP8 casts (`fp8`, as matmul_layer
    reads a spec layer's), set on the instance, so the module, its weights' names and its hooks stay its own. Until
    the first training step has run it notes that it ran (NativeFp8.ran)."""

    blocks = None  # matmul_layer's block-scaled recipe: never, for a native model's matmuls (the core refuses them)

    def __init__(self, name: str, module: nn.Module, casts: Fp8Casts, conversion: NativeFp8):
        self.name, self.conversion, self.fp8 = name, conversion, {"product": casts}
        self.product, self.kernel, self.bias_shape = _fp8_product(module)
        self.bias = lambda: module.bias

    def __call__(self, x):
        if not self.conversion.counted:
            self.conversion.ran.add(self.name)
        return matmul_layer(self, self.product, x, self.kernel(), self.bias(), self.bias_shape)


class NativeNetwork(nn.Module):
    """The user's module with the interface TorchTrainer trains (amp_harness_torch.network.Network's)."""

    attention_kernels: dict[str, str] = {}  # its attention is its own code
    fp8_matmuls = None

    def __init__(self, module: nn.Module, fp8=None):
        super().__init__()
        self.model = module.float()
        self.named = {name: m for name, m in module.named_modules() if name}  # its layers, by their own names
        embeddings = {f"{name}.{p}" for name, m in self.named.items() if isinstance(m, nn.Embedding)
                      for p, _ in m.named_parameters(recurse=False)}
        #: each trainable weight's kind (harness.model.native.weight_kind: which AdamW's no_decay exempts)
        self.weight_kinds = {name: weight_kind(name, p.ndim, name in embeddings)
                             for name, p in module.named_parameters() if p.requires_grad}
        weights = [w for w in (*module.parameters(), *module.buffers()) if w.is_floating_point()]
        #: as built, before the trainer casts it to the precision's dtype
        self.info = NativeInfo(trainable=sum(module.get_parameter(n).numel() for n in self.weight_kinds),
                               weights=sum(w.numel() for w in weights),
                               modules={name: type(m).__name__ for name, m in self.named.items()},
                               digest=weights_digest(w.detach().cpu().numpy() for w in weights))
        if fp8 is not None:
            self._convert(fp8)

    def _convert(self, policy) -> None:
        """Each matmul module's forward through FP8's casts (after the digest: the casts hold no weights); their
        casts are held here, a module list beside the model, so that .to() moves their amax histories (buffers that
        are neither persistent nor trained)."""
        converted = {name: m for name, m in self.named.items() if _fp8_product(m) is not None}
        conversion = NativeFp8(converted={name: type(m).__name__ for name, m in converted.items()},
                               not_converted={name: why for name, m in self.named.items()
                                              if name not in converted and (why := _why_not_converted(m))})
        self.fp8_casts = nn.ModuleList(Fp8Casts(policy) for _ in converted)
        for (name, m), casts in zip(converted.items(), self.fp8_casts):
            m.forward = Fp8Forward(name, m, casts, conversion)
        self.info = dataclasses.replace(self.info, fp8=conversion)
        if policy.native:
            convolutions = any(isinstance(m, nn.Conv2d) for m in converted.values())
            self.fp8_matmuls = NATIVE_FP8 + ("; conv2d emulated (torch has no FP8 convolution)" if convolutions else "")

    def forward(self, x, masks=None):
        conversion = self.info.fp8
        if conversion is not None and not conversion.counted and self.training:
            return self._counted_forward(x, conversion)
        return logits(self.model(x))

    @torch.compiler.disable  # eager, once: a compiled graph then never sees the count
    def _counted_forward(self, x, conversion: NativeFp8):
        """The first training step's forward, in which each converted module that runs says so (Fp8Forward)."""
        conversion.ran.clear()  # an evaluation before it does not count
        out = logits(self.model(x))
        conversion.counted = True
        return out

    def canonical_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def canonical_gradients(self) -> dict[str, np.ndarray]:
        return {name: _numpy(p.grad).copy() for name, p in self.canonical_parameters().items() if p.grad is not None}

    def canonical_weights(self) -> dict[str, np.ndarray]:
        return {name: _numpy(value) for name, value in self.model.state_dict().items() if value.is_floating_point()}

    @staticmethod
    def canonical_activation(t) -> np.ndarray:
        return _numpy(t)  # the module's own layout

    def layer_outputs(self, x):
        """(each module's tensor output by its name, the model's output): one forward with hooks."""
        outputs, hooks = {}, []
        for name, module in self.named.items():
            hooks.append(module.register_forward_hook(
                lambda m, args, out, name=name: outputs.__setitem__(name, out) if isinstance(out, torch.Tensor)
                else None))
        try:
            out = self(x)
        finally:
            for hook in hooks:
                hook.remove()
        return outputs, out

    @contextlib.contextmanager
    def scoped(self):
        """Profile mode: each module's forward in a record_function range named after it (Network.scoped's)."""
        ranges, hooks = [], []

        def open_range(name):
            return lambda m, args: ranges.append(torch.profiler.record_function(layer_scope(name)).__enter__())

        def close_range(m, args, out):
            ranges.pop().__exit__(None, None, None)

        for name, module in self.named.items():
            hooks += [module.register_forward_pre_hook(open_range(name)),
                      module.register_forward_hook(close_range, always_call=True)]
        try:
            yield {layer_scope(name) for name in self.named}
        finally:
            for hook in hooks:
                hook.remove()


def _numpy(t) -> np.ndarray:
    return (t if t.dtype == torch.float64 else t.float()).detach().cpu().numpy()
