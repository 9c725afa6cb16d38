"""The model: the neutral spec, its graph (shapes, parameters, FLOPs), canonical weights, data and the numpy reference."""
