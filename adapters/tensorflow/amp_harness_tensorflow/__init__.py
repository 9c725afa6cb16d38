"""TensorFlow / Keras 3 adapter for amp-harness. Importing this package does not import TensorFlow."""
