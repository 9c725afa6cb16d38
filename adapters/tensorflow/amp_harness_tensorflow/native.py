"""A native model (a spec's `native: {keras: ...}`): the user's own Keras 3 model, trained by the same
TensorFlowTrainer as a spec's network. NativeNetwork gives it the interface of network.Network (the model, the
weights by name, each layer's output) without changing it: its layers, initialisers, weights and names are its own.

Every precision starts from the same weights: the model is made (or loaded, with its own weights) under the float32
policy after Keras' generators are seeded with the run's seed, and a precision with another dtype policy gets the
model made again under that policy (a callable called again; a saved model re-made from its layers' configs by
keras.models.clone_model) holding those float32 weights, as a torch module is cast after it is made.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import keras

from harness.adapter import NativeInfo, layer_scope
from harness.errors import HarnessError, one_line
from harness.model.native import weight_kind
from harness.run.native import load_object, weights_digest


def load(spec) -> keras.Model:
    """The spec's native model as made under the float32 policy; HarnessError in one line naming the spec."""
    target = spec.native.target
    if not target.endswith(".keras"):
        try:
            return load_object(target, lambda obj: isinstance(obj, keras.Model), "a Keras model")
        except HarnessError as exc:
            raise HarnessError(f"{spec.name}: native keras {exc}") from None
    if not Path(target).is_file():
        raise HarnessError(f"{spec.name}: native keras {target}: no such file")
    try:
        return keras.saving.load_model(target, compile=False)
    except Exception as exc:  # Keras refuses the file
        raise HarnessError(f"{spec.name}: native keras {target}: Keras cannot load it: {one_line(exc)}") from None


def _made(spec, policy: str, floatx: str) -> keras.Model:
    """load(spec) in a fresh Keras session under the dtype `policy` and floatx, Keras' generators seeded with the
    run's seed. Fresh: Keras numbers the layers it names itself by how many it has made in the process, and a
    layer's name must be the same in every run and precision."""
    keras.backend.clear_session(free_memory=False)  # (it also puts back the float32 policy)
    keras.mixed_precision.set_global_policy(policy)
    keras.config.set_floatx(floatx)
    keras.utils.set_random_seed(spec.seed)
    return load(spec)


def in_policy(spec, model: keras.Model, policy: str, floatx: str) -> keras.Model:
    """`model` (made under float32) made again under the dtype `policy`, holding its float32 weights (cast where
    the policy stores them in 16 bits): a callable's model by calling it again, a saved one (whose layers keep the
    dtypes they were saved with) re-made from its layers' configs with the policy's dtype."""
    weights = model.get_weights()
    if not spec.native.target.endswith(".keras"):
        copy = _made(spec, policy, floatx)
    else:
        keras.mixed_precision.set_global_policy(policy)
        keras.config.set_floatx(floatx)

        def remade(layer):
            config = layer.get_config()
            config["dtype"] = policy
            return layer.__class__.from_config(config)

        try:
            copy = keras.models.clone_model(model, clone_function=remade)
        except Exception as exc:  # a saved subclassed model: its layers are its Python code's, not configs
            raise HarnessError(f"{spec.name}: native keras {spec.native.target}: its layers cannot be re-made in the "
                               f"{policy} dtype policy ({one_line(exc)}); a functional or Sequential model's "
                               f"can") from None
    copy.set_weights(weights)
    return copy


class NativeNetwork:
    """The user's Keras model with network.Network's interface: `model` and `train_model` (no dropout masks: its
    dropout is Keras' own), the weights by name ("conv1.kernel": the layer's and the variable's), their kinds."""

    mask_paths: list[str] = []
    attention: dict[str, str] = {}  # its attention is its own layers'

    def __init__(self, spec, policy: str, floatx: str):
        made = _made(spec, "float32", "float32")
        saved = spec.native.target.endswith(".keras")  # its layers keep the dtypes they were saved with
        self.model = self.train_model = made if policy == "float32" and not saved else \
            in_policy(spec, made, policy, floatx)
        keras.mixed_precision.set_global_policy(policy)  # the process's, as TensorFlowTrainer.configure set them
        keras.config.set_floatx(floatx)
        self.input_dtype = "int64" if spec.tokens else floatx
        layers = [layer for layer in self.model.layers if not isinstance(layer, keras.layers.InputLayer)]
        #: by "<layer>.<its variable's path within the layer>" ("block_1_expand.kernel", "mha.query.kernel")
        self.variables = {f"{layer.name}.{_within(v.path, layer.name)}": v for layer in layers for v in layer.weights}
        self.name_of = {id(v): name for name, v in self.variables.items()}
        embeddings = {id(v) for layer in layers if isinstance(layer, keras.layers.Embedding) for v in layer.weights}
        #: each trainable weight's kind (harness.model.native.weight_kind: which AdamW's no_decay exempts)
        self.weight_kinds = {self.name_of[id(v)]: weight_kind(self.name_of[id(v)], len(v.shape), id(v) in embeddings)
                             for v in self.model.trainable_variables}
        self.info = NativeInfo(trainable=int(sum(math.prod(v.shape) for v in made.trainable_variables)),
                               weights=int(sum(math.prod(v.shape) for v in made.weights)),
                               modules={layer.name: type(layer).__name__ for layer in layers},
                               digest=weights_digest(made.get_weights()))
        for layer in layers:  # a profile finds each layer's ops by its scope (names in the graph, free at run time)
            layer.call = _scoped(layer.call, layer_scope(layer.name))
        self._probe, self._names = None, []  # layer_outputs' model of every layer's output, made on first use

    def layer_outputs(self, x):
        """(each layer's output by its name, the model's output): a functional model's layers' outputs at once."""
        if self._probe is None:
            layers = [layer for layer in self.model.layers if not isinstance(layer, keras.layers.InputLayer)]
            self._probe = keras.Model(self.model.inputs, [*(layer.output for layer in layers), *self.model.outputs])
            self._names = [layer.name for layer in layers]
        *values, out = self._probe(x, training=False)
        return dict(zip(self._names, values)), out


def _within(path: str, layer: str) -> str:
    """A variable's path within its layer ("model/block_1/kernel" in layer "block_1": "kernel"), dotted."""
    parts = path.split("/")
    return ".".join(parts[parts.index(layer) + 1:] if layer in parts else parts[-1:])


def _scoped(call, scope: str):
    """A layer's call inside a name scope of its own, its signature kept (Keras reads it)."""
    import tensorflow as tf

    @functools.wraps(call)
    def run(*args, **kwargs):
        with tf.name_scope(scope):
            return call(*args, **kwargs)

    return run
