"""JAX adapter: the network, losses and optimizers in jax.numpy (no Flax or optax: their math would have to
be checked against the spec anyway), trained by one jax.jit-compiled step that takes the weights, optimizer
state and batchnorm statistics as donated buffers and returns their successors. Mixed precision is written as
JAX users write it, with no framework policy (network.py), the loss in float32. JAX has no loss scaler of its
own: the step scales the loss, unscales the gradients and, when they are not all finite, keeps the old weights
and optimizer state (jmp's select_tree idiom); it returns that finiteness, and the scale follows the core's rules
(harness.precision.LossScaler) on the host.
"""
from __future__ import annotations

import os
from functools import partial

import numpy as np

from harness.adapter import Adapter, Capabilities, Device, Trainer
from harness.errors import HarnessError
from harness.model.optimizer import scheduled
from harness.model.training import loss_with
from harness.precision import LossScaler
from harness.rounding import round_nearest_with


class JaxAdapter(Adapter):
    name = "jax"
    rounding_module = "amp_harness_jax.rounding"  # its OPS: harness.rounding's primitives
    variants = {"jit": "the training step as one jax.jit-compiled XLA computation, its state buffers donated"}
    capabilities = Capabilities(no_fp8=None, no_block_scaling=None,
                                no_block_stochastic=None,
                                no_fp8_native="runs FP8 emulated only: a dot_general of float8 operands is not "
                                              "wired into its network (not built)",
                                no_gpu_profile="a GPU's instructions run on the trace's device planes, which its "
                                               "profile does not read")

    def framework_version(self) -> str:
        import jax
        import jaxlib

        return f"{jax.__version__} (jaxlib {jaxlib.__version__})"

    def device(self, requested: str) -> Device:
        import jax

        try:
            gpus = jax.devices("gpu") if requested in ("auto", "gpu") else []
        except RuntimeError:  # no GPU backend: a CPU-only jaxlib, or no device
            gpus = []
        if gpus:
            gpu = gpus[0]
            stats = gpu.memory_stats() or {}
            return Device("gpu:0", "gpu", gpu.device_kind,
                          {"compute_capability": getattr(gpu, "compute_capability", None),
                           "platform_version": getattr(gpu.client, "platform_version", None),
                           "memory_gb": round(stats.get("bytes_limit", 0) / 2**30, 1) or None})
        if requested == "gpu":
            raise HarnessError("--device gpu: JAX sees no GPU (is this a CPU-only jaxlib? install jax[cuda12])")
        return Device.cpu()

    def free_memory_mb(self, device: Device) -> float | None:
        import jax

        stats = jax.devices("gpu")[0].memory_stats() or {}  # the device device() chose
        if "bytes_limit" not in stats or "bytes_in_use" not in stats:
            return None  # a backend without allocator statistics
        # XLA's allocator takes its pool (75% of the GPU by default) up front: what the run may use is that pool
        return (stats["bytes_limit"] - stats["bytes_in_use"]) / 2**20

    def set_threads(self, threads: int) -> None:
        # XLA has no intra-op thread setting: its CPU pool, sized when jax starts, has a thread per CPU it may use
        cpus = sorted(os.sched_getaffinity(0))
        if threads < len(cpus):
            os.sched_setaffinity(0, cpus[:threads])

    def build(self, spec, graph, weights, precision, loss_scale, device, variant) -> Trainer:
        return JaxTrainer(spec, graph, weights, precision, loss_scale, device, variant)

    def block_linear(self, precision, x, w, dy, device, bits=None):
        import jax

        from amp_harness_jax.network import block_matmul
        from amp_harness_jax.rounding import jax_device

        if precision.blocks is None:
            return None

        def run(x, w, dy, noise):  # dy is the cotangent of y: the gradients of sum(y * dy)
            y, pullback = jax.vjp(lambda x, w: block_matmul(x, w, precision.blocks, noise), x, w)
            return y, *pullback(dy)

        # jitted, as the training step runs the network's block_matmul; `bits` (a stochastic recipe's) its noise
        dev = jax_device(device)
        noise = None if bits is None else tuple(jax.device_put(np.asarray(b, np.int32), dev) for b in bits)
        got = jax.jit(run)(*(jax.device_put(np.asarray(a, np.float32), dev) for a in (x, w, dy)), noise)
        return tuple(np.asarray(a, np.float32) for a in got)

    def block_conv2d(self, precision, layer, x, kernel, dy, device):
        """The conv2d and patches layers' block-scaled product (network.block_convolution, with the geometry their
        builders give it) on x [N, H, W, C] and the kernel [k, k, C, F], JAX's layouts and the canonical ones; a
        patches layer is a conv2d of kernel and stride P, 'valid', its [N, H/P, W/P, F] read as patches in
        row-major order. Jitted, with its gradients of sum(y * dy) by jax.vjp, as block_linear."""
        import jax

        from amp_harness_jax.network import block_convolution
        from amp_harness_jax.rounding import jax_device
        from harness.model.graph import same_padding

        if precision.blocks is None:
            return None
        k = kernel.shape[0]
        stride, dilation, padding = (layer.size, 1, "valid") if layer.type == "patches" else \
            (layer.strides, layer.dilation, layer.padding)
        pads = [same_padding(n, (k - 1) * dilation + 1, stride) if padding == "same" else (0, 0)
                for n in x.shape[1:3]]
        multiply = block_convolution(precision.blocks, stride, pads, dilation)

        def run(x, kernel, dy):  # dy is the cotangent of y: the gradients of sum(y * dy)
            y, pullback = jax.vjp(multiply, x, kernel)  # [N, Ho, Wo, F]
            return y.reshape(dy.shape), *pullback(dy.reshape(y.shape))

        dev = jax_device(device)
        got = jax.jit(run)(*(jax.device_put(np.asarray(a, np.float32), dev) for a in (x, kernel, dy)))
        return tuple(np.asarray(a, np.float32) for a in got)

    def matmul(self, shape, dtype, device):
        import jax

        m, k, n = shape
        dev = jax.devices("gpu" if device.kind == "gpu" else "cpu")[0]
        a, b = (jax.device_put(jax.random.normal(key, dims).astype(dtype), dev)
                for key, dims in zip(jax.random.split(jax.random.key(0)), ((m, k), (k, n))))
        product = jax.jit(lambda a, b: (a @ b).sum())
        return lambda: product(a, b).block_until_ready()


class JaxTrainer(Trainer):
    network_module = "amp_harness_jax.network"  # its attention_mask
    profile_module = "amp_harness_jax.profile"  # its profile_steps

    def configure(self, spec, precision, device, variant):
        import jax

        self.jax = jax
        # process-wide switches, set for every build (the contract tests build several precisions in one process)
        jax.config.update("jax_enable_x64", precision.param_dtype == "float64")
        # float32 matmuls and convolutions strict unless the precision asks for TF32 (JAX's GPU default)
        self.matmul_precision = "tensorfloat32" if precision.tf32 else \
            "highest" if precision.compute_dtype == "float32" else None
        jax.config.update("jax_default_matmul_precision", self.matmul_precision)
        self.device = jax.devices("gpu" if device.kind == "gpu" else "cpu")[0]

    def build_network(self, spec, graph, weights, precision, device, variant):
        import jax.numpy as jnp

        from amp_harness_jax.network import Network

        # images, vectors and masks arrive in the weights' dtype (dense and conv layers cast them to the compute
        # dtype); token ids stay integers, int32 (JAX's index dtype without x64): a 16-bit float rounds ids above 256
        self.param_dtype = jnp.dtype(precision.param_dtype)
        self.input_dtype = jnp.dtype(jnp.int32) if spec.tokens else self.param_dtype
        self.net = net = Network(spec, graph, precision.compute_dtype, precision.fp8, precision.blocks,
                                      self.rounding_seed)
        self.params = {n: self._put(weights[n], self.param_dtype) for n in net.trainable}
        self.statistics = {n: self._put(weights[n], self.param_dtype) for n in net.statistics}
        self.statistics.update(self.jax.device_put(net.fp8_histories(), self.device))  # committed, as the optimizer's
        self._bits = None  # fingerprint runs: the core's rounding bits for the next step

    def build_optimizer(self, optimizer):
        from amp_harness_jax.optimizers import make_optimizer

        self.optimizer = make_optimizer(optimizer, self.params)

    def build_rounded_optimizer(self, optimizer):
        from amp_harness_jax.rounding import OPS, make_rounded_optimizer

        if self.rounding.format == "fixed16":  # the initial weights onto the grid
            self.params = {n: round_nearest_with(OPS, p, self.rounding) for n, p in self.params.items()}
        self.optimizer = make_rounded_optimizer(optimizer, self.params, self.rounding, self.rounding_seed)

    def build_step(self, spec, precision, loss_scale, variant):
        import jax.numpy as jnp

        from amp_harness_jax.optimizers import LOSS_OPS, clip_by_global_norm
        from harness.adapter import LOSS_SCALE_SCOPE, LOSS_SCOPE, UPDATE_SCOPE

        jax, net, optimizer, rounding = self.jax, self.net, self.optimizer, self.rounding
        self.opt_state = optimizer.state  # every slot, created in build_optimizer (build_rounded_optimizer)
        self.scaler = LossScaler(loss_scale) if loss_scale.mode != "none" else None
        self.skipped, self._scale, self._device_scale = False, None, None
        scaling = self.scaler is not None
        # the loss scale and a scheduled rate arrive in the dtype the loss and the update compute them in: float32
        # at least (the rounded optimizer's, and Adam's bias corrections of 16-bit weights), float64 in a float64 run
        self._scalar_dtype = jnp.promote_types(self.param_dtype, jnp.float32)
        self.scheduled = scheduled(spec.optimizer)
        constant_rate, clip_norm = spec.optimizer.learning_rate, spec.optimizer.clip_norm

        def step(params, opt_state, statistics, x, y, masks, scale, rate, bits=None, capture=False):
            """(params, opt_state, statistics, loss, finite[, unscaled gradients]) after one step; `rate` the
            scheduled learning rate (one compiled step for every rate), or None for the spec's constant one."""
            def objective(params, gradient_histories):  # the histories' "gradients" are their new values
                # a stochastic block recipe's bits: fresh every step, from the run's seed and the step count
                out, new_statistics = net.apply(params, {**statistics, **gradient_histories}, x, masks, training=True,
                                                noise=net.noise(opt_state["count"]))
                with jax.named_scope(LOSS_SCOPE):
                    loss = loss_with(LOSS_OPS, spec.loss, out, y)
                if not scaling:
                    return loss, (loss, new_statistics)
                with jax.named_scope(LOSS_SCALE_SCOPE):
                    return loss * scale, (loss, new_statistics)

            (grads, recorded), (loss, new_statistics) = jax.grad(objective, (0, 1), has_aux=True)(
                params, {name: value for name, value in statistics.items() if name.endswith(":output_gradient")})
            new_statistics = {**new_statistics, **recorded}
            finite = jnp.array(True)
            if scaling:
                with jax.named_scope(LOSS_SCALE_SCOPE):
                    grads = jax.tree.map(lambda g: (g / scale).astype(g.dtype), grads)
                    finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
            lr = constant_rate if rate is None else rate
            with jax.named_scope(UPDATE_SCOPE):
                # clipped gradients go to the rounded optimizer in float32, the dtype its update computes in
                clipped = grads if clip_norm is None else clip_by_global_norm(
                    grads, clip_norm, finite if scaling else None, jnp.float32 if rounding else None)
                new_params, new_opt_state = optimizer.update(clipped, opt_state, params, lr, bits)
            if scaling:  # a skipped step keeps the weights and optimizer state; batchnorm's statistics move on,
                # as in PyTorch and Keras, whose forward pass has updated them before the scaler decides
                with jax.named_scope(LOSS_SCALE_SCOPE):
                    new_params, new_opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                                             (new_params, new_opt_state), (params, opt_state))
            out = new_params, new_opt_state, new_statistics, loss, finite
            return (*out, grads) if capture else out

        self._step_fn = step
        self._step = jax.jit(step, donate_argnums=(0, 1, 2))
        # diagnose and fingerprint runs (compiled on first use): the same step, also returning the gradients
        self._captured = jax.jit(partial(step, capture=True), donate_argnums=(0, 1, 2))
        self._predict = jax.jit(lambda params, statistics, x: net.apply(params, statistics, x, None, False)[0])

        def layer_outputs(params, statistics, x, y, count):
            def outputs(taps):
                record = {}
                out, _ = net.apply(params, statistics, x, None, False, taps, record, net.noise(count))
                return loss_with(LOSS_OPS, spec.loss, out, y), record

            taps = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda taps: outputs(taps)[1], None))
            grads, values = jax.grad(outputs, has_aux=True)(taps)
            return {path: (values[path], grads[path]) for path in values}

        self._layer_outputs = jax.jit(layer_outputs)
        if scaling:
            self._set_scale()

    def framework_options(self, precision, variant):
        return {"jit": True, "donated_buffers": True, "tf32": precision.tf32,
                "x64": precision.param_dtype == "float64", "compute_dtype": precision.compute_dtype,
                "param_dtype": precision.param_dtype, "matmul_precision": self.matmul_precision,
                "loss_scaler": "harness (manual, in the jitted step)" if self.scaler is not None else None,
                "attention": dict(self.net.attention),
                "inter_op_threads": "none to set: XLA:CPU may run a step's independent ops at once, on its one "
                                    "thread pool (the process's CPUs, narrowed by set_threads)"}

    def _put(self, a: np.ndarray, dtype):
        # astype copies: the device array never aliases the core's arrays, which it refills for the next step
        return self.jax.device_put(a.astype(dtype), self.device)

    def to_device(self, x, y, masks):
        batch = (self._put(x, self.input_dtype), self._put(y, np.int32),
                 {path: self._put(mask, self.param_dtype) for path, mask in masks.items()})
        self._last_batch = self.jax.block_until_ready(batch)  # the profile compiles its step for this batch's shapes
        return self._last_batch

    def set_rounding_noise(self, bits):
        self._bits = {name: self._put(value, np.int32) for name, value in bits.items()}  # JAX's layouts are canonical

    def run_step(self, batch, capture: dict | None) -> float:
        bits, self._bits = self._bits, None
        step = self._step if capture is None else self._captured  # diagnose and fingerprint runs: the capturing twin
        self.params, self.opt_state, self.statistics, loss, finite, *grads = step(
            self.params, self.opt_state, self.statistics, *batch, self._device_scale, self._rate(), bits)
        if capture is not None:
            capture.update({name: self.output(g) for name, g in grads[0].items()})
        if self.scaler is not None:
            loss, finite = self.jax.device_get((loss, finite))
            self.skipped = self.scaler.update(finite=bool(finite))
            self._set_scale()
        return float(loss)  # fetching the loss waits for the device

    def _rate(self):
        """The step's scheduled rate as a device scalar (one compiled step for every rate); None: a constant one."""
        return self._put(np.asarray(self.learning_rate()), self._scalar_dtype) if self.scheduled else None

    def _set_scale(self) -> None:
        """The scale as a device scalar, transferred only when the rules change it."""
        if self._scale != self.scaler.scale:
            self._scale = self.scaler.scale
            self._device_scale = self.jax.device_put(np.asarray(self._scale, self._scalar_dtype), self.device)

    def layer_outputs(self, x, y):
        outputs = self._layer_outputs(self.params, self.statistics, self._put(x, self.input_dtype),
                                      self._put(y, np.int32), self.opt_state["count"])
        return {path: (self.output(value), self.output(grad)) for path, (value, grad) in outputs.items()}

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.output(self._predict(self.params, self.statistics, self._put(x, self.input_dtype)))

    def get_weights(self) -> dict[str, np.ndarray]:
        return {name: self.output(value) for name, value in {**self.params, **self.statistics}.items()
                if name in self.params or name in self.net.statistics}

    def param_count(self) -> int:
        return sum(int(p.size) for p in self.params.values())

    def _loss_scale_now(self):
        return self.scaler.scale, self.skipped

    memory_kind = "XLA GPU allocator peak (peak_bytes_in_use) above its level before the build"
    def _memory_in_use(self) -> int:
        return self.device.memory_stats()["bytes_in_use"]

    def _memory_peak(self) -> int:
        return self.device.memory_stats()["peak_bytes_in_use"]
