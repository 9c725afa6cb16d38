"""TensorFlow adapter: Keras 3 on the TensorFlow backend, keras.mixed_precision policies, Keras'
LossScaleOptimizer for dynamic loss scaling, and a compiled tf.function training step."""
from __future__ import annotations

import contextlib
import functools
import os

import numpy as np

from harness.adapter import LOSS_SCALE_SCOPE, LOSS_SCOPE, Adapter, Capabilities, Device, Trainer
from harness.errors import HarnessError
from harness.model.training import loss_with

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up chatter out of stderr tails
os.environ.setdefault("KERAS_BACKEND", "tensorflow")


class TensorFlowAdapter(Adapter):
    name = "tensorflow"
    rounding_module = "amp_harness_tensorflow.rounding"  # its OPS: harness.rounding's primitives
    variants = {"graph": "the training step as one tf.function graph",
                "xla": "the training step compiled with XLA (jit_compile=True)"}
    capabilities = Capabilities(
        no_fp8=None,
        no_fp8_native="runs FP8 emulated only: Keras 3's own float8 training (the \"float8\" dtype policy) scales by "
                      "its delayed recipe, not harness.fp8's, so its runs would not be this precision (not built)",
        no_fp8_for_native_models="does not train a native Keras model in FP8: its layers' matmuls would need the FP8 "
                                 "casts wrapped around their kernels (not built)",
        no_block_scaling=None,
        no_block_stochastic=None,
        no_gpu_profile="the host trace times a GPU kernel's launch, not the kernel, and the device planes are not read",
        dynamic_scale_factors=(2.0, 0.5, "Keras' LossScaleOptimizer"))

    def framework_version(self) -> str:
        import keras
        import tensorflow as tf

        return f"{tf.__version__} (keras {keras.__version__})"

    def device(self, requested: str) -> Device:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if requested == "gpu" and not gpus:
            raise HarnessError("--device gpu: TensorFlow sees no GPU (tensorflow-cpu, or no CUDA build)")
        if requested == "cpu" and gpus:
            tf.config.set_visible_devices([], "GPU")
        if requested == "cpu" or not gpus:
            return Device.cpu()
        for gpu in gpus:  # peak memory is only meaningful with memory growth on
            tf.config.experimental.set_memory_growth(gpu, True)
        details = tf.config.experimental.get_device_details(gpus[0])
        cc = details.get("compute_capability")
        return Device("gpu:0", "gpu", details.get("device_name", "GPU"),
                      {"compute_capability": ".".join(map(str, cc)) if cc else None,
                       "cuda": tf.sysconfig.get_build_info().get("cuda_version")})

    def set_threads(self, threads: int) -> None:
        import tensorflow as tf

        try:  # N threads inside an op, 1 across ops
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:  # TensorFlow had started in this process (a test's own model): its pools stay as they
            pass  # are (the record's options say the inter-op one)

    def build(self, spec, graph, weights, precision, loss_scale, device, variant) -> Trainer:
        return TensorFlowTrainer(spec, graph, weights, precision, loss_scale, device, variant)

    def block_linear(self, precision, x, w, dy, device, bits=None):
        """The dense layers' block-scaled product (network.block_product) on x [M, K] and w [K, N], eagerly, and its
        custom gradient of sum(y * dy) by a GradientTape (whose gradient of the sum at y is dy exactly); `bits` a
        stochastic recipe's, given as its noise."""
        import tensorflow as tf

        from amp_harness_tensorflow.network import BlockNoise, block_product

        with tf.device("/GPU:0" if device.kind == "gpu" else "/CPU:0"):
            x, w, dy = (tf.constant(np.asarray(a, dtype=np.float32)) for a in (x, w, dy))
            noise = BlockNoise(None, tuple(tf.constant(b, tf.int32) for b in bits)) if bits is not None else None
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                y = block_product(x, w, precision.blocks, noise)
                total = tf.reduce_sum(y * dy)
            dx, dw = tape.gradient(total, [x, w])
        return tuple(np.asarray(t.numpy(), dtype=np.float32) for t in (y, dx, dw))

    def block_conv2d(self, precision, layer, x, kernel, dy, device):
        """The conv2d and patches layers' block-scaled product (network.block_conv2d, with Fp8Conv2D.blocked's
        geometry) on x [N, H, W, C] and the kernel [k, k, C, F], Keras' layouts and the canonical ones; a patches
        layer is a conv2d of kernel and stride P, 'valid', its [N, H/P, W/P, F] read as patches in row-major order.
        Eagerly, with its gradients of sum(y * dy) by a GradientTape, as block_linear."""
        import tensorflow as tf

        from amp_harness_tensorflow.network import block_conv2d
        from harness.model.graph import same_padding

        k = kernel.shape[0]
        stride, dilation, padding = (layer.size, 1, "valid") if layer.type == "patches" else \
            (layer.strides, layer.dilation, layer.padding)
        pads = [same_padding(n, (k - 1) * dilation + 1, stride) if padding == "same" else (0, 0)
                for n in x.shape[1:3]]
        with tf.device("/GPU:0" if device.kind == "gpu" else "/CPU:0"):
            x, kernel, dy = (tf.constant(np.asarray(a, dtype=np.float32)) for a in (x, kernel, dy))
            with tf.GradientTape() as tape:
                tape.watch([x, kernel])
                y = block_conv2d(x, kernel, precision.blocks, stride, pads, dilation)  # [N, Ho, Wo, F]
                total = tf.reduce_sum(y * tf.reshape(dy, tf.shape(y)))
            dx, dkernel = tape.gradient(total, [x, kernel])
            y = tf.reshape(y, dy.shape)
        return tuple(np.asarray(t.numpy(), dtype=np.float32) for t in (y, dx, dkernel))

    def matmul(self, shape, dtype, device):
        import tensorflow as tf

        m, k, n = shape
        with tf.device("/GPU:0" if device.kind == "gpu" else "/CPU:0"):
            a, b = (tf.cast(tf.random.normal(dims), dtype) for dims in ((m, k), (k, n)))
        product = tf.function(lambda: tf.reduce_sum(tf.matmul(a, b)))
        return lambda: product().numpy()  # a blocking fetch


def _dense(gradient):
    """A gradient as a dense tensor. An embedding lookup's (tf.gather's) is IndexedSlices, the rows it read: the
    spec's optimizers update every row (Adam's moments decay in rows no token read), and a captured gradient is
    the whole table. The sum into the table's shape is built in the scope of the lookup's gradient, so that a
    profile gives it to the embedding layer's backward."""
    import tensorflow as tf

    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    with tf.name_scope(gradient.values.op.name.rpartition("/")[0] + "/"):  # a trailing "/" re-enters that scope
        return tf.convert_to_tensor(gradient)


class TensorFlowTrainer(Trainer):
    network_module = "amp_harness_tensorflow.network"  # its attention_mask
    profile_module = "amp_harness_tensorflow.profile"  # its profile_steps

    def configure(self, spec, precision, device, variant):
        import keras
        import tensorflow as tf

        from amp_harness_tensorflow.optimizers import LOSS_OPS

        self.tf, self.loss_fn = tf, functools.partial(loss_with, LOSS_OPS)
        self.is_gpu = device.kind == "gpu"
        tf.config.experimental.enable_tensor_float_32_execution(precision.tf32)  # on by default in TF
        # Keras' dtype policy: mixed_float16 / mixed_bfloat16, else the weights' dtype (pure fp16: "floatx": "float16")
        self.policy = f"mixed_{precision.compute_dtype}" if precision.mixed else precision.param_dtype
        self.floatx = precision.param_dtype
        # global, process-wide state: set before building (the runner gives each precision its own process)
        keras.config.set_floatx(self.floatx)
        keras.mixed_precision.set_global_policy(self.policy)
        keras.utils.set_random_seed(spec.seed)

    def build_network(self, spec, graph, weights, precision, device, variant):
        if spec.native is not None:
            from amp_harness_tensorflow.native import NativeNetwork

            self.net = NativeNetwork(spec, self.policy, self.floatx)
        else:
            from amp_harness_tensorflow.network import Network

            self.net = Network(spec, graph, weights, self.floatx, precision.fp8, precision.blocks, self.rounding_seed)
        self.trainable = self.net.train_model.trainable_variables
        self._trainable_names = [self.net.name_of[id(v)] for v in self.trainable]

    def build_optimizer(self, optimizer):
        from amp_harness_tensorflow.optimizers import OPTIMIZERS

        self.spec_optimizer = OPTIMIZERS[optimizer.type](optimizer, self._trainable_names, self.net.weight_kinds)
        self.spec_optimizer.build(self.trainable)  # every slot created now

    def build_rounded_optimizer(self, optimizer):
        from amp_harness_tensorflow.rounding import OPS, RoundedOptimizer
        from harness.rounding import round_nearest_with

        if self.rounding.format == "fixed16":  # the initial weights onto the grid
            for variable in self.trainable:
                variable.assign(round_nearest_with(OPS, variable, self.rounding))
        self.spec_optimizer = RoundedOptimizer(optimizer, self._trainable_names, self.rounding, self.rounding_seed,
                                               self.net.weight_kinds)
        self.spec_optimizer.build(self.trainable)

    def build_step(self, spec, precision, loss_scale, variant):
        import keras

        tf, loss_fn, model, variables = self.tf, self.loss_fn, self.net.train_model, self.trainable
        # the spec's optimizer (whose schedule's rate run_step sets) inside the loss-scale wrapper if there is one
        self.scaler = {"dynamic": "LossScaleOptimizer", "fixed": "harness (fixed)"}.get(loss_scale.mode)
        optimizer = self.optimizer = self.spec_optimizer
        if loss_scale.mode == "dynamic":
            optimizer = self.optimizer = keras.mixed_precision.LossScaleOptimizer(
                optimizer, initial_scale=loss_scale.initial, dynamic_growth_steps=loss_scale.growth_interval)
            optimizer.build(variables)  # the wrapper's own state (the inner one is built)
        self.applied_steps = 0  # the LossScaleOptimizer's iterations advance only on applied steps
        self.xla = variant == "xla"
        fixed_scale = loss_scale.initial if loss_scale.mode == "fixed" else None

        def step(x, y, *masks, capture=False):
            """(loss, applied) of one step; with `capture`, also the gradients unscaled and before the update.
            The parts' name scopes are names in the graph, free at run time; their gradients are named after them."""
            with tf.GradientTape() as tape:
                outputs = model([x, *masks] if masks else x, training=True)
                with tf.name_scope(LOSS_SCOPE):
                    loss = loss_fn(spec.loss, outputs, y)
                with tf.name_scope(LOSS_SCALE_SCOPE):
                    scaled = loss * fixed_scale if fixed_scale else optimizer.scale_loss(loss)
            grads = [_dense(g) for g in tape.gradient(scaled, variables)]
            if fixed_scale:
                def apply():
                    optimizer.apply(grads, variables)
                    return tf.constant(True)

                with tf.name_scope(LOSS_SCALE_SCOPE):
                    grads = [g / tf.cast(fixed_scale, g.dtype) for g in grads]
                    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
                    applied = tf.cond(finite, apply, lambda: tf.constant(False))
            else:  # LossScaleOptimizer unscales, skips non-finite steps and adapts the scale
                with tf.name_scope(LOSS_SCALE_SCOPE) if self.scaler else contextlib.nullcontext():
                    unscaled = [g / tf.cast(optimizer.dynamic_scale, g.dtype) for g in grads] \
                        if capture and self.scaler else grads  # read before apply() moves the scale
                    optimizer.apply(grads, variables)
                applied, grads = tf.constant(True), unscaled
            return (loss, applied, grads) if capture else (loss, applied)

        self._step = tf.function(step, jit_compile=self.xla)
        # diagnose and fingerprint runs (traced on first use): the same step, also returning the gradients
        self._captured = tf.function(lambda *batch: step(*batch, capture=True), jit_compile=self.xla)
        self._predict = tf.function(lambda x: self.net.model(x, training=False), jit_compile=self.xla)

    def framework_options(self, precision, variant):
        return {"xla": self.xla, "tf32": precision.tf32, "policy": self.policy, "floatx": self.floatx,
                "loss_scaler": self.scaler, "train_step": "tf.function",
                **({"attention": dict(self.net.attention)} if self.net.attention else {}),
                "inter_op_threads": self.tf.config.threading.get_inter_op_parallelism_threads()}

    def to_device(self, x, y, masks):
        with self.tf.device("/GPU:0" if self.is_gpu else "/CPU:0"):
            batch = (self.tf.constant(x, dtype=self.net.input_dtype), self.tf.constant(y),
                     *(self.tf.constant(masks[path], dtype=self.floatx) for path in self.net.mask_paths))
        if self.is_gpu:
            batch[0].numpy()  # wait for the copy (a blocking fetch is TF's synchronisation)
        return batch

    def set_rounding_noise(self, bits):
        for name, value in bits.items():  # Keras' layouts are the canonical ones
            self.spec_optimizer.set_bits(self.net.variables[name], value)

    def run_step(self, batch, capture: dict | None) -> float:
        if self.spec_optimizer.scheduled_rate is not None:  # a variable the traced step reads: no retrace
            self.spec_optimizer.scheduled_rate.assign(self.learning_rate())
        if capture is None:
            loss, self._applied = self._step(*batch)
        else:  # diagnose and fingerprint runs: the step's capturing twin
            loss, self._applied, grads = self._captured(*batch)
            capture.update({name: self.output(g) for name, g in zip(self._trainable_names, grads)})
        return float(loss.numpy())  # a blocking fetch: the step has finished on the device

    def layer_outputs(self, x, y):
        tf = self.tf
        inputs = tf.constant(x, dtype=self.net.input_dtype)
        with tf.GradientTape() as tape:
            if inputs.dtype.is_floating:  # a layer of no weights on the input (a rescaling) is on the tape too
                tape.watch(inputs)
            outputs, out = self.net.layer_outputs(inputs)
            tape.watch(list(outputs.values()))
            loss = self.loss_fn(self.spec.loss, out, tf.constant(y))
        grads = tape.gradient(loss, list(outputs.values()))
        return {path: (self.output(value), self.output(grad))
                for (path, value), grad in zip(outputs.items(), grads) if grad is not None}

    def native_info(self):
        return self.net.info

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.output(self._predict(self.tf.constant(x, dtype=self.net.input_dtype)))

    def get_weights(self) -> dict[str, np.ndarray]:
        return {name: self.output(v) for name, v in self.net.variables.items()}  # Keras' layouts: the canonical

    def param_count(self) -> int:
        return int(sum(np.prod(v.shape) for v in self.net.model.trainable_variables))

    def _loss_scale_now(self):
        if self.loss_scale.mode == "fixed":
            return self.loss_scale.initial, not bool(self._applied.numpy())
        iterations = int(self.optimizer.iterations.numpy())
        skipped, self.applied_steps = iterations == self.applied_steps, iterations
        return float(self.optimizer.dynamic_scale.numpy()), skipped

    memory_kind = "TensorFlow GPU allocator peak above its level before the build (memory growth on)"
    def _reset_memory_peak(self) -> None:
        self.tf.config.experimental.reset_memory_stats("GPU:0")

    def _memory_in_use(self) -> int:
        return self.tf.config.experimental.get_memory_info("GPU:0")["current"]

    def _memory_peak(self) -> int:
        return self.tf.config.experimental.get_memory_info("GPU:0")["peak"]
