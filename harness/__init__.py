"""amp-harness core: spec, shapes, weights, data, runner, results. It imports no framework."""

__version__ = "0.1.0"
