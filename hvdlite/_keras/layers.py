"""Keras layers' variables, on any backend: what ``local_layers=`` names."""
from __future__ import annotations

from typing import Any

import keras

from hvdlite.errors import HvdliteTypeError


def local_layer_variables(local_layers: Any, what: str) -> list[Any]:
    """The trainable variables of ``local_layers`` (a Keras layer or a list of them)."""
    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else list(local_layers)
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise HvdliteTypeError(f"{what}: local_layers holds Keras layers; got "
                                   f"{type(layer).__name__}")
    return [v for layer in layers for v in layer.trainable_weights]
