"""The user's own Keras models for the native-spec tests (test_native.py): a small Sequential convnet as users write
them, keras.applications models with random weights at 32x32, and the mistakes a native spec names in one line."""
from __future__ import annotations

import keras


def convnet() -> keras.Model:
    return keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.GlobalAveragePooling2D(),
                             keras.layers.Dense(4)])


def mobilenet_v2() -> keras.Model:
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=10)


def resnet50() -> keras.Model:
    return keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=10)


def not_a_model():
    return "a model"
