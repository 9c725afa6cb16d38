"""PyTorch adapter: torch.autocast for mixed precision, torch.amp.GradScaler for dynamic loss scaling."""
from __future__ import annotations

import contextlib
import functools

import numpy as np

from harness.adapter import (LOSS_SCALE_SCOPE, LOSS_SCOPE, RUNTIME_SCOPE, UPDATE_SCOPE, Adapter, Capabilities, Device,
                             Trainer)
from harness.errors import HarnessError
from harness.model.optimizer import scheduled
from harness.model.training import loss_with
from harness.model.weights import to_channels_first
from harness.precision import LossScaler
from harness.rounding import round_nearest_with

NO_SCOPE = contextlib.nullcontext()  # reusable: a timed step enters it instead of a profiler range or autocast


class TorchAdapter(Adapter):
    name = "torch"
    rounding_module = "amp_harness_torch.rounding"  # its OPS: harness.rounding's primitives
    variants = {  # channels-last first: the fast layout for oneDNN on CPU and for tensor cores
        "channels_last": "eager, image activations in channels-last (NHWC) memory",
        "eager": "eager, NCHW (contiguous) activations, as most PyTorch code runs",
        "compile": "torch.compile (inductor) of the network, channels-last",
    }
    capabilities = Capabilities(no_fp8=None, no_fp8_native=None, no_fp8_for_native_models=None, no_block_scaling=None,
                                no_block_stochastic=None,
                                no_gpu_profile="its profile reads CPU times only, and a GPU kernel's time is not its "
                                               "launch's (the device's activities are not read)")

    def framework_version(self) -> str:
        import torch

        return torch.__version__

    def device(self, requested: str) -> Device:
        import torch

        if requested in ("auto", "gpu") and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return Device("cuda:0", "gpu", props.name,
                          {"cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                           "compute_capability": f"{props.major}.{props.minor}",
                           "memory_gb": round(props.total_memory / 2**30, 1)})
        if requested == "gpu":
            raise HarnessError("--device gpu: torch sees no CUDA GPU (is this a CPU build of torch?)")
        return Device.cpu()

    def free_memory_mb(self, device: Device) -> float | None:
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device.name))  # the driver's count: other processes' too
        return free / 2**20

    def set_threads(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        try:  # N threads inside an op, 1 across ops
            torch.set_num_interop_threads(1)
        except RuntimeError:  # set once per process (an earlier run here did), or parallel work had started
            pass  # the trainer records the size the pool has (options.inter_op_threads)

    def build(self, spec, graph, weights, precision, loss_scale, device, variant) -> Trainer:
        return TorchTrainer(spec, graph, weights, precision, loss_scale, device, variant)

    def import_model(self, target, input_shape, options):  # `amp-harness import torch` (importer.py)
        try:
            from amp_harness_torch.importer import import_torch
        except ImportError as exc:  # the adapter is installed, torch is not
            raise HarnessError(f"amp-harness import torch needs torch in this environment ({exc})") from None
        return import_torch(target, input_shape, options)

    def block_linear(self, precision, x, w, dy, device, bits=None):
        """network.block_linear, the dense layers' product, on x and F.linear's kernel w^T; its gradients are
        autograd's with dy as y's (those of sum(y * dy)), dw back in the canonical layout."""
        import torch

        from amp_harness_torch.network import BlockNoise, block_linear

        def tensor(a, dtype=np.float32):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device.name)

        x, kernel = tensor(x).requires_grad_(), tensor(np.transpose(w)).requires_grad_()
        noise = BlockNoise(None, tuple(tensor(b, np.int32) for b in bits)) if bits is not None else None
        y = block_linear(x, kernel, precision.blocks, noise)
        dx, dkernel = torch.autograd.grad(y, (x, kernel), tensor(dy))
        return tuple(t.detach().cpu().numpy() for t in (y, dx, dkernel.t()))

    def block_conv2d(self, precision, layer, x, kernel, dy, device):
        """network.block_conv2d, the conv2d and patches layers' product, in torch's layouts (x [N, C, H, W], kernel
        [F, C, k, k]); a patches layer is a conv2d of kernel and stride P, its output [N, D, H/P, W/P] read as
        patches in row-major order. Gradients as block_linear's, back in the canonical layouts."""
        import torch

        from amp_harness_torch.network import block_conv2d
        from harness.model.graph import same_padding

        def tensor(a, axes):
            return torch.from_numpy(np.ascontiguousarray(np.transpose(a, axes), dtype=np.float32)).to(device.name)

        k = kernel.shape[0]
        x_t, kernel_t = tensor(x, (0, 3, 1, 2)).requires_grad_(), tensor(kernel, (3, 2, 0, 1)).requires_grad_()
        stride, dilation, padding = (layer.size, 1, "valid") if layer.type == "patches" else \
            (layer.strides, layer.dilation, layer.padding)
        padded = x_t
        if padding == "same":  # TensorFlow's 'same': the odd pixel after, so pad explicitly
            (top, bottom), (left, right) = (same_padding(n, (k - 1) * dilation + 1, stride) for n in x.shape[1:3])
            padded = torch.nn.functional.pad(x_t, (left, right, top, bottom))
        y = block_conv2d(padded, kernel_t, precision.blocks, stride, (0, 0), dilation)  # [N, F, Ho, Wo]
        dy_t = tensor(np.reshape(dy, y.shape[:1] + y.shape[2:] + y.shape[1:2]), (0, 3, 1, 2))
        dx, dkernel = torch.autograd.grad(y, (x_t, kernel_t), dy_t)
        y = y.detach().permute(0, 2, 3, 1).cpu().numpy()
        return (y.reshape(np.shape(dy)), dx.permute(0, 2, 3, 1).cpu().numpy(),
                dkernel.permute(2, 3, 1, 0).cpu().numpy())

    def matmul(self, shape, dtype, device):
        import torch

        m, k, n = shape
        a, b = (torch.randn(*dims, device=device.name).to(getattr(torch, dtype)) for dims in ((m, k), (k, n)))
        return lambda: (a @ b).sum().item()  # .item() waits for the device


class TorchTrainer(Trainer):
    network_module = "amp_harness_torch.network"  # its attention_mask
    profile_module = "amp_harness_torch.profile"  # its profile_steps

    def configure(self, spec, precision, device, variant):
        import torch

        from amp_harness_torch.optimizers import LOSS_OPS, clip_factor

        self.torch, self.loss_fn, self.clip_factor = torch, functools.partial(loss_with, LOSS_OPS), clip_factor
        self.device = torch.device(device.name)
        # strict fp32 unless the precision asks for TF32 (both default to TF32 for convolutions)
        torch.backends.cuda.matmul.allow_tf32 = precision.tf32
        torch.backends.cudnn.allow_tf32 = precision.tf32
        torch.manual_seed(spec.seed)

    def build_network(self, spec, graph, weights, precision, device, variant):
        from amp_harness_torch.network import Network

        torch = self.torch
        self.images = len(spec.input.shape) == 3
        self.channels_last = self.images and variant in ("channels_last", "compile")
        self.param_dtype = getattr(torch, precision.param_dtype)
        self.autocast_dtype = getattr(torch, precision.compute_dtype) if precision.mixed else None
        if spec.native is not None:
            from amp_harness_torch.native import NativeNetwork, load

            net = NativeNetwork(load(spec), precision.fp8)
        else:
            net = Network(spec.layers, graph, weights, precision.fp8, precision.blocks, self.rounding_seed)
        memory_format = torch.channels_last if self.channels_last else None
        self.net = net.to(self.device, dtype=self.param_dtype, memory_format=memory_format).train()
        self.fp8_matmuls = self.net.fp8_matmuls or self.fp8_matmuls
        self.weight_kinds = getattr(self.net, "weight_kinds", None)  # a native model's (its names are its own)

    def build_optimizer(self, optimizer):
        from amp_harness_torch.optimizers import make_optimizer

        self.optimizer = make_optimizer(optimizer, self.net.canonical_parameters(), self.weight_kinds)

    def build_rounded_optimizer(self, optimizer):
        from amp_harness_torch.rounding import OPS, RoundedUpdate

        if self.rounding.format == "fixed16":  # the initial weights onto the grid
            with self.torch.no_grad():
                for p in self.net.parameters():
                    p.copy_(round_nearest_with(OPS, p, self.rounding))
        self.optimizer = RoundedUpdate(self.net.canonical_parameters(), optimizer, self.rounding, self.rounding_seed,
                                       self.weight_kinds)

    def build_step(self, spec, precision, loss_scale, variant):
        torch = self.torch
        self.params = list(self.net.canonical_parameters().values())
        self.scheduled, self.clip_norm = scheduled(spec.optimizer), spec.optimizer.clip_norm
        self.compiled = variant == "compile"
        self.forward = torch.compile(self.net) if self.compiled else self.net
        self.profiling = False  # the parts' record_function ranges are open only in profile.profile_steps
        # the module calls around the layers' ranges are the runtime's dispatch; a compiled graph would run its
        # kernels (the layers' work, which it cannot attribute) in that range too
        self.forward_scope = None if self.compiled else RUNTIME_SCOPE
        self.grad_scaler = None
        self.scaler = LossScaler(loss_scale)  # the core's rules where GradScaler is not used
        self.skipped = False
        if loss_scale.mode == "dynamic" and precision.mixed:
            self.last_scale = loss_scale.initial
            self.grad_scaler = torch.amp.GradScaler(
                self.device.type, init_scale=loss_scale.initial, growth_factor=loss_scale.growth_factor,
                backoff_factor=loss_scale.backoff_factor, growth_interval=loss_scale.growth_interval)

    def framework_options(self, precision, variant):
        return {"channels_last": self.channels_last, "tf32": precision.tf32, "compile": self.compiled,
                "autocast": precision.compute_dtype if precision.mixed else None,
                "loss_scaler": "GradScaler" if self.grad_scaler else
                (None if self.loss_scale.mode == "none" else "harness (manual)"),
                "inter_op_threads": self.torch.get_num_interop_threads(),
                **({"attention": dict(self.net.attention_kernels)} if self.net.attention_kernels else {})}

    def _input(self, x: np.ndarray):
        t = self.torch.from_numpy(x).to(self.device, non_blocking=True)
        if not t.is_floating_point():  # token ids stay integers (bfloat16 would round ids above 256)
            return t
        if self.images:  # NHWC memory seen as NCHW: a channels-last view, no copy
            t = t.permute(0, 3, 1, 2)
            if not self.channels_last:
                t = t.contiguous()
        return t.to(self.param_dtype) if self.autocast_dtype is None else t

    def _mask(self, path: str, mask: np.ndarray):
        t = self.torch.from_numpy(mask).to(self.device, dtype=self.param_dtype, non_blocking=True)
        # an image's dropout mask: canonical NHWC seen as NCHW, like the input; an attention layer's [N, H, T, T]
        # (and every sequence's) is torch's layout already
        return t.permute(0, 3, 1, 2) if t.dim() == 4 and path not in self.net.attention_kernels else t

    def to_device(self, x, y, masks):
        batch = self._input(x), self.torch.from_numpy(y).to(self.device), \
            {path: self._mask(path, mask) for path, mask in masks.items()}
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        return batch

    def set_rounding_noise(self, bits):
        params = self.net.canonical_parameters()
        self.optimizer.given_bits = {
            params[name]: self.torch.from_numpy(np.ascontiguousarray(to_channels_first(value, name))).to(self.device)
            for name, value in bits.items()}

    # -- training -------------------------------------------------------------------------------------
    def run_step(self, batch, capture: dict | None) -> float:
        x, y, masks = batch
        with self._scope(UPDATE_SCOPE):  # clearing the gradients is the optimizer's bookkeeping
            self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            with self._scope(self.forward_scope):
                out = self.forward(x, masks)
            with self._scope(LOSS_SCOPE):
                loss = self.loss_fn(self.spec.loss, out, y)
        if self.grad_scaler is not None:
            with self._scope(LOSS_SCALE_SCOPE):
                scaled = self.grad_scaler.scale(loss)
            self._backward(scaled)
            # unscaled (and checked for inf) here rather than inside GradScaler.step, which then only skips or
            # calls optimizer.step: the loss scaler's work and the update stay apart in a profile
            with self._scope(LOSS_SCALE_SCOPE):
                self.grad_scaler.unscale_(self.optimizer)
            # clip_factor leaves the gradients of a step GradScaler skips as they are
            self._update(capture, self.grad_scaler.step, self.optimizer)
            with self._scope(LOSS_SCALE_SCOPE):
                self.grad_scaler.update()
        elif self.loss_scale.mode != "none":
            self._manual_scaled_step(loss, capture)
        else:
            self._backward(loss)
            self._update(capture, self.optimizer.step)
        with self._scope(RUNTIME_SCOPE):  # handing the loss back
            return loss.item()  # waits for the device

    def _autocast(self):
        return NO_SCOPE if self.autocast_dtype is None else self.torch.autocast(self.device.type, self.autocast_dtype)

    def _backward(self, loss) -> None:
        with self._scope(RUNTIME_SCOPE):  # the autograd engine's own work; its nodes' ops keep their layers' scopes
            loss.backward()

    def _manual_scaled_step(self, loss, capture: dict | None) -> None:
        """Fixed scaling, or dynamic scaling of pure-fp16 weights (GradScaler refuses fp16 gradients)."""
        torch, scale = self.torch, self.scaler.scale
        with self._scope(LOSS_SCALE_SCOPE):
            scaled = loss * scale
        self._backward(scaled)
        grads = [p.grad for p in self.net.parameters() if p.grad is not None]
        with self._scope(LOSS_SCALE_SCOPE):
            torch._foreach_mul_(grads, 1.0 / scale)
            self.skipped = self.scaler.update(finite=bool(torch.stack([g.isfinite().all() for g in grads]).all()))
        self._update(capture, None if self.skipped else self.optimizer.step)

    def _update(self, capture: dict | None, step, *args) -> None:
        """The unscaled gradients copied into `capture` (if given), then the update, `step(*args)` (None: the loss
        scaler skips it)."""
        if capture is not None:
            capture.update(self.net.canonical_gradients())
        if step is not None:
            with self._scope(UPDATE_SCOPE):
                self._prepare_update()
                step(*args)

    def _prepare_update(self) -> None:
        """Just before an update: the schedule's rate into every param group, and the unscaled gradients clipped
        to the global norm clip_norm (the core's rules); neither costs anything in a spec without them."""
        if self.scheduled:
            lr = self.learning_rate()
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if self.clip_norm is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            factor = self.clip_factor(grads, self.clip_norm)
            if self.rounding is None:
                self.torch._foreach_mul_(grads, factor)
            else:  # the rounded update multiplies its float32 gradients
                self.optimizer.gradient_factor = factor

    def _scope(self, name: str | None):
        """A part's record_function range while profiling; a shared no-op in any other step (or without a name)."""
        return self.torch.profiler.record_function(name) if self.profiling and name else NO_SCOPE

    def layer_outputs(self, x, y):
        torch = self.torch
        self.net.eval()
        try:
            inputs = self._input(x).detach()
            if inputs.is_floating_point():  # so that every layer's output has a gradient (an embedding's has one)
                inputs.requires_grad_(True)
            with self._autocast():
                outputs, out = self.net.layer_outputs(inputs)
                loss = self.loss_fn(self.spec.loss, out, torch.from_numpy(y).to(self.device))
            grads = torch.autograd.grad(loss, list(outputs.values()), allow_unused=True)
        finally:
            self.net.train()
        return {path: (self.net.canonical_activation(value), self.net.canonical_activation(grad))
                for (path, value), grad in zip(outputs.items(), grads) if grad is not None}

    def native_info(self):
        return self.net.info

    # -- inspection -----------------------------------------------------------------------------------
    def predict(self, x: np.ndarray) -> np.ndarray:
        self.net.eval()
        try:
            with self.torch.no_grad(), self._autocast():
                return self.output(self.net(self._input(x)))
        finally:
            self.net.train()

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.net.canonical_weights()

    def param_count(self) -> int:
        return sum(p.numel() for p in self.net.parameters() if p.requires_grad)

    # -- the core's bookkeeping's primitives ----------------------------------------------------------
    def _loss_scale_now(self):
        if self.grad_scaler is not None:
            scale = self.grad_scaler.get_scale()
            # GradScaler backs off exactly when it skips a step
            self.skipped, self.last_scale = scale < self.last_scale, scale
            return scale, self.skipped
        return self.scaler.scale, self.skipped

    memory_kind = "torch CUDA allocator peak above its level before the build (max_memory_allocated)"
    def _reset_memory_peak(self) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()

    def _memory_in_use(self) -> int:
        return self.torch.cuda.memory_allocated()

    def _memory_peak(self) -> int:
        return self.torch.cuda.max_memory_allocated()

    def _numpy(self, tensor) -> np.ndarray:
        tensor = tensor.detach().cpu()
        # numpy has no bfloat16: its values as float32 (exact)
        return (tensor.float() if tensor.dtype == self.torch.bfloat16 else tensor).numpy()
