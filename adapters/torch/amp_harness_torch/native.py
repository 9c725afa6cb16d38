"""A native model (a spec's `native: {torch: ...}`): the user's own nn.Module, trained by the same TorchTrainer as a
spec's network. NativeNetwork gives it the network's interface (forward with the batch's masks, the weights by
name, layer outputs by module) without changing a line of it: its weights are its own, its dropout draws from
torch's generator, its names are its modules' (`transformer.h.0.attn`), and a Hugging Face output's `logits`
are its output.

Its initial weights: the module is made after TorchTrainer.configure's torch.manual_seed(spec.seed), the run's
seed, so every precision of one seed starts from the same values (NativeInfo.digest records them); a module given
as an object rather than made by a callable is the same object on every build in one process, so its first state
is kept and copied for the builds after the first.
"""
from __future__ import annotations

import contextlib
import copy

import numpy as np
import torch
from torch import nn

from harness.adapter import NativeInfo, layer_scope
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


class NativeNetwork(nn.Module):
    """The user's module with the interface TorchTrainer trains (amp_harness_torch.network.Network's)."""

    attention_kernels: dict[str, str] = {}  # its attention is its own code
    fp8_matmuls = None

    def __init__(self, module: nn.Module):
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

    def forward(self, x, masks=None):
        return logits(self.model(x))

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
