"""Prepared Triton linears as one opaque op for `torch.compile`.

Dynamo cannot trace the Triton launchers (their autotuners sit behind a cache and a pruning
hook; on an H200, `generate --compile` failed with "Can't construct an AttrSource without a
valid base source"). While compiling, `PreparedLinear` calls `quantkit::prepared_linear(x,
handle)` instead: a custom op the graph keeps as one node and runs eagerly, so CUDA graphs
(`mode="reduce-overhead"`) capture the kernels it launches. `handle` is the layer's number in a
weak registry; the layer's output shape comes from its weights.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Protocol

import torch


class _Layer(Protocol):
    run: Callable[[torch.Tensor], torch.Tensor]

    @property
    def out_features(self) -> int: ...


_LAYERS: weakref.WeakValueDictionary[int, _Layer] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def register(layer: _Layer) -> int:
    """The handle `layer` is called by (kept while the layer lives)."""
    handle = next(_NUMBERS)
    _LAYERS[handle] = layer
    return handle


@torch.library.custom_op("quantkit::prepared_linear", mutates_args=())
def prepared_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """y = the prepared layer `handle` applied to x, outside the compiler's view."""
    return _LAYERS[handle].run(x)


@prepared_linear.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _LAYERS[handle].out_features)
