"""The Keras models behind the importer's test data (`amp-harness import keras`), built in real Keras 3.

Run once with a Keras environment to (re)write the data beside this file (NAME.json: `model.to_json()`;
NAME.json.gz for keras.applications models; mnist_mlp_dropout.keras: `model.save()`; params.json: what Keras's
`count_params()` reported):

    .venv-tf/bin/python tests/core/data/keras/build_models.py

The core's tests read only the files written; adapters/tensorflow/tests/test_import_roundtrip.py builds the models
again from here and checks the imported spec's network against them.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import keras
from keras import layers

HERE = Path(__file__).resolve().parent


def small_convnet() -> keras.Model:
    """The README's seed model (models/small_convnet.yaml): four 3x3 conv/ReLU/2x2 max-pool blocks, average pool,
    flatten, dense(1) with sigmoid; RMSprop lr 1e-4 and binary cross-entropy on 224x336x3."""
    model = keras.Sequential(name="small_convnet")
    model.add(keras.Input(shape=(224, 336, 3)))
    for filters in (32, 32, 64, 64):
        model.add(layers.Conv2D(filters, 3, activation="relu"))
        model.add(layers.MaxPooling2D(2))
    model.add(layers.AveragePooling2D(2))
    model.add(layers.Flatten())
    model.add(layers.Dense(1, activation="sigmoid"))
    model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=1e-4), loss="binary_crossentropy")
    return model


def resnet_mini() -> keras.Model:
    """A ResNet-style functional model: a stem, an identity block and a projection block (stride 2), batchnorm."""
    def bn(x):
        return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)

    inputs = keras.Input(shape=(32, 32, 3), name="image")
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(bn(x))
    y = layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
    y = layers.Activation("relu")(bn(y))
    y = bn(layers.Conv2D(16, 3, padding="same", use_bias=False)(y))
    x = layers.Activation("relu")(layers.Add()([y, x]))  # identity shortcut
    y = layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False)(x)
    y = layers.Activation("relu")(bn(y))
    y = bn(layers.Conv2D(32, 3, padding="same", use_bias=False)(y))
    shortcut = bn(layers.Conv2D(32, 1, strides=2, use_bias=False)(x))  # projection shortcut
    x = layers.Activation("relu")(layers.Add()([y, shortcut]))
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10)(x)
    model = keras.Model(inputs, outputs, name="resnet_mini")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def mnist_mlp_dropout() -> keras.Model:
    """An MLP on 8x8 digits as vectors, with batchnorm and dropout, softmax output; Adam."""
    model = keras.Sequential([
        keras.Input(shape=(64,)),
        layers.Dense(64, activation="relu"),
        layers.BatchNormalization(),
        layers.Dropout(0.2),
        layers.Dense(32),
        layers.Activation("tanh"),
        layers.Dropout(0.1),
        layers.Dense(10, activation="softmax"),
    ], name="mnist_mlp_dropout")
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3), loss="sparse_categorical_crossentropy")
    return model


def tiny_transformer() -> keras.Model:
    """A token classifier: embedding, a pre-norm block of causal self-attention and one of a GELU MLP, mean pool."""
    inputs = keras.Input(shape=(16,), dtype="int32", name="tokens")
    x = layers.Embedding(64, 32)(inputs)
    y = layers.LayerNormalization(epsilon=1e-5)(x)
    y = layers.MultiHeadAttention(num_heads=4, key_dim=8)(y, y, use_causal_mask=True)
    x = layers.Add()([x, y])
    y = layers.RMSNormalization(epsilon=1e-6)(x)
    y = layers.Dense(64, activation="gelu")(y)
    y = layers.Dense(32)(y)
    x = layers.Add()([x, y])
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(4)(x)
    model = keras.Model(inputs, outputs, name="tiny_transformer")
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=3e-4, weight_decay=0.01, global_clipnorm=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def inception_mini() -> keras.Model:
    """Branches the chain cannot say: an Inception-style block (three branches from one tensor, concatenated), a
    vector gate multiplied onto an image, a depthwise convolution and a dilated one; Adam."""
    inputs = keras.Input(shape=(16, 16, 3), name="image")
    x = layers.Conv2D(8, 3, strides=2, padding="same", activation="relu6", name="stem")(inputs)
    a = layers.Conv2D(4, 1, name="branch_1x1")(x)
    b = layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="branch_depthwise")(x)
    c = layers.Conv2D(4, 3, padding="same", dilation_rate=2, activation="swish", name="branch_dilated")(x)
    x = layers.Concatenate(name="mixed")([a, b, c])
    gate = layers.Dense(24, activation="sigmoid", name="gate")(layers.GlobalMaxPooling2D(name="squeeze")(x))
    x = layers.Multiply(name="excite")([x, layers.Reshape((1, 1, 24))(gate)])
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(5)(x)
    model = keras.Model(inputs, outputs, name="inception_mini")
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def mobilenetv2_mini() -> keras.Model:
    """MobileNetV2 cut short, from keras.applications' own block code: its stem, its first three inverted residual
    blocks (the expansion-free one, the stride-2 one with its correct_pad ZeroPadding2D, the one with the residual
    Add) and its head, at width 0.35 on 32x32x3 images; SGD with momentum (the tests' imported MobileNetV2-style
    network: its spec, tests/specs/imported_mobilenetv2_mini.yaml, is fingerprinted in every framework)."""
    from keras.src.applications.mobilenet_v2 import _inverted_res_block, _make_divisible

    alpha = 0.35
    inputs = keras.Input(shape=(32, 32, 3), name="image")
    x = layers.Conv2D(_make_divisible(32 * alpha, 8), 3, strides=2, padding="same", use_bias=False, name="Conv1")(inputs)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999, name="bn_Conv1")(x)
    x = layers.ReLU(6.0, name="Conv1_relu")(x)
    x = _inverted_res_block(x, filters=16, alpha=alpha, stride=1, expansion=1, block_id=0)
    x = _inverted_res_block(x, filters=24, alpha=alpha, stride=2, expansion=6, block_id=1)
    x = _inverted_res_block(x, filters=24, alpha=alpha, stride=1, expansion=6, block_id=2)
    x = layers.Conv2D(64, 1, use_bias=False, name="Conv_1")(x)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999, name="Conv_1_bn")(x)
    x = layers.ReLU(6.0, name="out_relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs, outputs, name="mobilenetv2_mini")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def application(build, **options):
    """A keras.applications model as a user starts from one: random weights, 32x32x3 images, 10 classes, trained with
    SGD and momentum on integer labels."""
    def make() -> keras.Model:
        model = build(weights=None, input_shape=(32, 32, 3), classes=10, **options)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
        return model
    return make


MODELS = {"small_convnet": small_convnet, "resnet_mini": resnet_mini, "mnist_mlp_dropout": mnist_mlp_dropout,
          "tiny_transformer": tiny_transformer, "inception_mini": inception_mini,
          "mobilenetv2_mini": mobilenetv2_mini}
# keras.applications, written gzipped (hundreds of KiB of JSON each)
APPLICATIONS = {"MobileNetV2": application(keras.applications.MobileNetV2),
                "ResNet50": application(keras.applications.ResNet50),
                "DenseNet121": application(keras.applications.DenseNet121),
                "EfficientNetB0": application(keras.applications.EfficientNetB0)}


def main() -> None:
    counts = {}
    for name, build in {**MODELS, **APPLICATIONS}.items():
        model = build()
        if name in APPLICATIONS:
            with gzip.open(HERE / f"{name}.json.gz", "wt") as f:
                f.write(model.to_json())
        else:
            (HERE / f"{name}.json").write_text(json.dumps(json.loads(model.to_json()), indent=1) + "\n")
        counts[name] = {"count_params": model.count_params(),
                        "trainable": sum(int(w.numpy().size) for w in model.trainable_weights),
                        "keras": keras.__version__}
        if name == "mnist_mlp_dropout":
            model.save(HERE / f"{name}.keras")
    (HERE / "params.json").write_text(json.dumps(counts, indent=1) + "\n")


if __name__ == "__main__":
    main()
