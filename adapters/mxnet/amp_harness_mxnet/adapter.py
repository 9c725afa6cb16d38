"""MXNet 1.9 adapter: a Gluon block holding the network and its loss, mxnet.contrib.amp for mixed precision
(its dynamic loss scaler, set to the run's initial scale and growth interval), and the spec's optimizer on
MXNet's fused update operators, applied to the weights directly (no gluon.Trainer: its per-parameter Python
bookkeeping costs more than the update on a small network).

amp.init patches MXNet's operators process-wide and irreversibly: one precision per process, as the runner
runs it. MXNet's engine is asynchronous on CPU too: a step ends with `mx.nd.waitall()`.
"""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from harness.adapter import (LOSS_SCALE_SCOPE, RUNTIME_SCOPE, STEP_SCOPE, UPDATE_SCOPE, Adapter, Capabilities, Device,
                             Refusal, Trainer, layer_scope)
from harness.errors import HarnessError
from harness.model.weights import from_channels_first

NO_RANGE = contextlib.nullcontext()  # MXNetTrainer._range outside profiles


class MXNetAdapter(Adapter):
    name = "mxnet"
    variants = {"hybridized": "one cached graph (hybridize(static_alloc=True, static_shape=True))",
                "imperative": "operators dispatched one by one from Python"}

    def framework_version(self) -> str:
        import mxnet as mx

        return mx.__version__

    def device(self, requested: str) -> Device:
        import mxnet as mx

        gpus = mx.context.num_gpus()
        if requested == "gpu" and not gpus:
            raise HarnessError("--device gpu: MXNet sees no GPU (the mxnet wheel is CPU-only; use mxnet-cu117)")
        if gpus and requested != "cpu":
            free, total = mx.context.gpu_memory_info(0)
            return Device("gpu:0", "gpu", f"CUDA GPU 0 ({total / 2**30:.0f} GiB)", {"memory_gb": total / 2**30})
        return Device.cpu()

    capabilities = Capabilities(
        # checked with 1.9.1, mx.nd and mx.np; the fixed-point grid needs no bit-cast, but the adapter has no
        # rounding_ops (its optimizers update the weights in place; left undone, see docs/stochastic-rounding.md)
        no_bitcast="MXNet 1.9 has no bitcast operator, no ndarray.view(dtype)",
        no_fp8="cannot emulate FP8: MXNet 1.9 has no bitcast operator (the core's FP8 cast reads and writes float32 "
               "exponent bits) and no FP8 dtype",
        no_block_scaling="cannot emulate block-scaled formats: MXNet 1.9 has no bitcast operator (the core's "
                         "E8M0 scales and element casts read and write float32 exponent bits)",
        # seen with 1.9.1 on CPU: a network cast to bfloat16 aborted in native code (free(): invalid pointer) or
        # failed with "Unknown type enum 12"; bfloat16 works inside AMP only
        refused=(Refusal("bf16", "cpu", "MXNet 1.9 runs bfloat16 on CPU only through AMP (amp_bf16); a network "
                                        "cast to it crashes"),),
        dynamic_scale_needs_mixed="scales the loss dynamically only with AMP (contrib.amp's LossScaler): use "
                                  "amp_fp16, or a fixed loss scale",
        dynamic_scale_factors=(2.0, 0.5, "MXNet's AMP loss scaler"))

    def explain_probe_failure(self, precision, device, error) -> str | None:
        dtype = precision.compute_dtype
        if "could not create a primitive descriptor" in error:  # oneDNN found no implementation for these dtypes
            return f"oneDNN has no {dtype} primitives on this CPU"
        if "not implemented" in error and device.kind == "cpu":  # "FP16 gemm on cpu not implemented!"
            return f"MXNet 1.9 has no {dtype} kernel for this step on the CPU"
        return None

    def free_memory_mb(self, device: Device) -> float | None:
        import mxnet as mx

        free, _ = mx.context.gpu_memory_info(0)  # the driver's count: other processes' use too
        return free / 2**20

    def set_threads(self, threads: int) -> None:
        # MXNet reads both at import (docs/methods.md): an operator's threads, and its engine's CPU workers
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if "mxnet" not in sys.modules:
            os.environ["MXNET_CPU_WORKER_NTHREADS"] = "1"

    def build(self, spec, graph, weights, precision, loss_scale, device, variant) -> Trainer:
        return MXNetTrainer(spec, graph, weights, precision, loss_scale, device, variant)

    def matmul(self, shape, dtype, device):
        import mxnet as mx
        from mxnet.contrib.amp.amp import bfloat16

        m, k, n = shape
        ctx = mx.gpu(0) if device.kind == "gpu" else mx.cpu()

        def run():  # a @ b.T (b n x k) by FullyConnected, the networks' matmuls: `dot` has no bfloat16 CPU kernel
            mx.nd.FullyConnected(a, b, num_hidden=n, no_bias=True).wait_to_read()

        try:
            a, b = (mx.nd.random.normal(shape=dims, ctx=ctx).astype(bfloat16 if dtype == "bfloat16" else dtype)
                    for dims in ((m, k), (n, k)))
            run()
        except mx.base.MXNetError:  # no kernel for this dtype here (float16 on CPU)
            return None
        return run


class MXNetTrainer(Trainer):
    network_module = "amp_harness_mxnet.network"  # its attention_mask
    profile_module = "amp_harness_mxnet.profile"  # its profile_steps

    def configure(self, spec, precision, device, variant):
        import mxnet as mx
        from mxnet.contrib import amp

        self.mx = mx
        self.ctx = mx.gpu(0) if device.kind == "gpu" else mx.cpu()
        if precision.tf32:
            os.environ["NVIDIA_TF32_OVERRIDE"] = "1"
        mx.random.seed(spec.seed)
        if precision.mixed:  # before the network is built: amp patches the operators it will use
            amp.init(target_dtype=precision.compute_dtype)

    def build_network(self, spec, graph, weights, precision, device, variant):
        from amp_harness_mxnet.network import Network, TrainingLoss, attention_implementation

        self.dtype = precision.param_dtype
        self.label_dtype = "float64" if self.dtype == "float64" else "float32"  # the loss's dtype
        self.net = Network(spec, graph, self.dtype, precision.compute_dtype if precision.mixed else None)
        self.net.initialize(ctx=self.ctx)
        self.net.load(weights, self.ctx)
        self.block = TrainingLoss(self.net, spec.loss, cast_outputs=precision.compute_dtype in ("float16", "bfloat16"))
        self.hybridize = variant == "hybridized"
        if self.hybridize:
            self.block.hybridize(static_alloc=True, static_shape=True)  # the network's own graph too (predict)
        self.trainable_names = [name for name, p in self.net.handles.items() if p.grad_req != "null"]
        self.params = [self.net.handles[name] for name in self.trainable_names]
        self.grads = [p.grad(self.ctx) for p in self.params]
        self.attention = {info.path: attention_implementation(info) for info in graph.layers
                          if info.type == "attention"}

    def build_optimizer(self, optimizer):
        from amp_harness_mxnet.optimizers import make_optimizer
        from harness.model.optimizer import scheduled

        self.optimizer = make_optimizer(optimizer, self.params, self.trainable_names)
        # a constant rate is the spec's: no schedule to evaluate in each step
        self.scheduled, self.constant_rate = scheduled(optimizer), optimizer.learning_rate

    def build_step(self, spec, precision, loss_scale, variant):
        from mxnet.contrib.amp.loss_scaler import LossScaler

        self.fixed_scale = loss_scale.initial if loss_scale.mode == "fixed" else None
        self.scaler = None
        if loss_scale.mode == "dynamic":  # with AMP only, growing by 2 and backing off by 0.5 (Capabilities)
            # contrib.amp's scaler, driven here as gluon.Trainer drives it (amp.init_trainer) without the Trainer
            self.scaler = LossScaler()
            self.scaler._loss_scale = self.scaler._next_loss_scale = loss_scale.initial  # no public setters
            self.scaler._scale_seq_len = loss_scale.growth_interval
            self.scaler._max_loss_scale = float("inf")  # MXNet's cap of 2^24 is not in the core's rules
        self.skipped = False

    def framework_options(self, precision, variant):
        return {"hybridize": self.hybridize, "amp": precision.compute_dtype if precision.mixed else None,
                "loss_scaler": "contrib.amp LossScaler (uncapped; back-off applied at once)"
                if self.scaler else (None if self.loss_scale.mode == "none" else "harness (fixed)"),
                "update": "fused update operators on the weights (no gluon.Trainer)", "tf32": precision.tf32,
                # the engine's CPU workers, as set_threads set them (MXNet 1.9 cannot read it back); unset: 1
                "inter_op_threads": int(os.environ.get("MXNET_CPU_WORKER_NTHREADS", "1")),
                "attention": self.attention}

    def _array(self, a: np.ndarray, dtype: str | None = None, image: bool = False):
        """`a` on the device in `dtype` (default: the weights'); an `image` [N, H, W, C] as NCHW."""
        if image:  # NHWC -> NCHW copy, outside the timed step
            a = np.ascontiguousarray(a.transpose(0, 3, 1, 2))
        return self.mx.nd.array(a, ctx=self.ctx, dtype=dtype or self.dtype)

    def _input(self, x: np.ndarray):
        # token ids as int32: float16 or bfloat16 would round ids above 2048 or 256, and under amp_bf16 the input
        # goes through amp_cast, whose oneDNN path in 1.9.1 refuses int64 ("unknown type for MKLDNN :6")
        return self._array(x, "int32" if x.dtype.kind in "iu" else None, image=x.ndim == 4)

    def _mask(self, mask: np.ndarray, path: str):
        # a dropout's mask on an image [N, H, W, C] as NCHW; an attention's [N, heads, T, T] as it is
        return self._array(mask, image=mask.ndim == 4 and self.net.infos[path].type == "dropout")

    def inference_masks(self, n: int) -> list:
        """Ones for every mask of `n` samples: what the network takes outside training (dropout's identity)."""
        return [self._mask(np.ones((n, *shape)), path) for path, _, shape in self.net.masked]

    def to_device(self, x, y, masks):
        # the masks divided by 1 - rate here, outside the step, so that inference can pass ones (Network's docstring)
        batch = self._input(x), self._array(y, self.label_dtype), [
            self._mask(masks[path].astype(np.float64) / (1 - rate), path) for path, rate, _ in self.net.masked]
        self.mx.nd.waitall()
        return batch

    # -- training -------------------------------------------------------------------------------------
    def run_step(self, batch, capture: dict | None) -> float:
        """While profiling, the ranges name the part (or MXNet's runtime) whose work each dispatches (profile.py)."""
        mx, (x, y, masks), part = self.mx, batch, self._range
        with part(STEP_SCOPE):
            scale = self.scaler.loss_scale if self.scaler else self.fixed_scale
            with mx.autograd.record():
                with part(RUNTIME_SCOPE):  # launching the graph's forward
                    out = self.block(x, y, *masks)
                loss, stats = (out[0], out[1:]) if isinstance(out, (list, tuple)) else (out, ())
                head = loss
                if scale:
                    with part(LOSS_SCALE_SCOPE):  # in the backward, autograd multiplies the gradient by it too
                        head = loss * scale
                with part(RUNTIME_SCOPE):  # launching the graph's backward, after autograd's seed (profile.py)
                    mx.autograd.backward(head)
            if capture is not None:
                capture.update({name: from_channels_first(self.output(g / scale if scale else g), name)
                                for name, g in zip(self.trainable_names, self.grads)})
            if scale:
                with part(LOSS_SCALE_SCOPE):
                    if self.scaler is not None:  # MXNet's check; it sets the next scale; an overflow skips the step
                        self.skipped = self.scaler.has_overflow(self.params)
                        # has_overflow leaves the current scale for one more step: a back-off would come a step
                        # late. Apply it now, as the core's rules (LossScaler) say.
                        self.scaler._loss_scale = self.scaler._next_loss_scale
                    else:
                        self.skipped = not bool(mx.nd.multi_all_finite(*self.grads, num_arrays=len(self.grads))
                                                .asscalar())
            self._update_running_statistics(stats)
            if not self.skipped:
                with part(UPDATE_SCOPE):  # the loss is a batch mean already
                    rate = self.learning_rate() if self.scheduled else self.constant_rate
                    self.optimizer.step(1.0 / scale if scale else 1.0, rate)
            with part(RUNTIME_SCOPE):  # the engine is asynchronous: wait for the update too, hand back the loss
                mx.nd.waitall()
                return float(loss.asscalar())

    # no range outside a profile; while profiling, profile.py's Ranges take its place
    _range = staticmethod(lambda name, drain=False: NO_RANGE)

    def _update_running_statistics(self, stats) -> None:
        """Float64 runs: the spec's running-statistics update, in float64 (see Network's docstring). While
        profiling, each layer's operators run inside its range, before the update's are dispatched."""
        for path, mean, inv_std in zip(self.net.batchnorm_paths, stats[::2], stats[1::2]):
            layer = self.net.infos[path].spec
            with self._range(layer_scope(path), drain=True):
                variance = 1 / (inv_std * inv_std) - layer.epsilon
                for name, batch in (("moving_mean", mean), ("moving_variance", variance)):
                    running = self.net.handles[f"{path}.{name}"].data(self.ctx)
                    running[:] = layer.momentum * running + (1 - layer.momentum) * batch

    def layer_outputs(self, x, y):
        from amp_harness_mxnet.optimizers import loss_ops
        from harness.model.training import loss_with

        mx, probes = self.mx, {}

        def canonical(a):  # the canonical layouts: an NCHW image as NHWC
            value = self.output(a)
            return value.transpose(0, 2, 3, 1) if value.ndim == 4 else value

        def probe(path, output):
            # the output plus a zero leaf: the loss's gradient with respect to the leaf is its gradient with
            # respect to the output, and the graph stays whole (attach_grad on the output itself would cut it)
            zero = mx.nd.zeros_like(output)
            zero.attach_grad()
            probes[path] = output, zero
            return output + zero

        # The inference network (running statistics, no dropout), recorded in training mode all the same: after
        # an inference-mode forward, oneDNN's max-pooling backward has no workspace and drops gradients
        with mx.autograd.record(train_mode=True):
            out = self.net.layer_outputs(self._input(x), self.ctx, probe)
            labels = self._array(y, self.label_dtype)
            loss = loss_with(loss_ops(mx.nd, self.block.cast_outputs), self.net.spec.loss, out, labels)
        loss.backward()
        return {path: (canonical(value), canonical(zero.grad))
                for path, (value, zero) in probes.items()}

    # -- inspection -----------------------------------------------------------------------------------
    def predict(self, x: np.ndarray) -> np.ndarray:
        out = self.net(self._input(x), *self.inference_masks(len(x)))  # outside autograd.record: inference mode
        out = out[0] if isinstance(out, (list, tuple)) else out
        return self.output(out)

    def get_weights(self) -> dict[str, np.ndarray]:
        return {name: from_channels_first(self.output(p.data()), name) for name, p in self.net.handles.items()}

    def param_count(self) -> int:
        return int(sum(np.prod(p.shape) for p in self.net.collect_params().values() if p.grad_req != "null"))

    # -- the core's bookkeeping's primitives ----------------------------------------------------------
    def _loss_scale_now(self):
        return self.scaler.loss_scale if self.scaler else self.loss_scale.initial, self.skipped

    memory_kind = ("device-wide GPU memory in use above its level before the build, sampled after each step "
                   "(MXNet has no peak counter)")
    memory_peak_counter = False  # the core samples _memory_in_use after each step
    def _memory_in_use(self) -> int:
        free, total = self.mx.context.gpu_memory_info(0)  # the driver's count: other processes' use too
        return total - free

    def _numpy(self, tensor) -> np.ndarray:
        # numpy has no bfloat16: 16-bit outputs are cast to float32 (exact) on the device
        return (tensor if tensor.dtype in (np.float32, np.float64) else tensor.astype("float32")).asnumpy()
