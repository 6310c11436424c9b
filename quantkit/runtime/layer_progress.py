"""Progress for forwards slow enough to look hung: one stderr line per model call, updated per
decoder layer.

Under `TRITON_INTERPRET=1` every Triton kernel runs as numpy calls on the CPU, and one forward of
the embedded model takes tens of seconds. `layer_progress` hooks the decoder's layers for the
duration of a `with` block and writes, per call, which call it is (the prefill, then token i of
n), the layer reached and the seconds spent, so a user sees work being done and can judge the
wait. Hooks only: the model's arithmetic is untouched."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

import torch
from torch import nn

NON_TTY_EVERY_S = 5.0  # off a terminal: a line at most this often within a call, and at its end


class _Reporter:
    """Counts calls and layers; rewrites one line per call on a terminal, else prints a line
    every NON_TTY_EVERY_S seconds within a call and one when it ends."""

    def __init__(self, layers: int, new_tokens: int, label: str, stream: TextIO) -> None:
        self.layers = layers
        self.new_tokens = new_tokens
        self.label = label
        self.stream = stream
        self.tty = stream.isatty()
        self.calls = 0
        self.start = time.perf_counter()
        self.call_start = self.start
        self.last_line = self.start

    def _what(self) -> str:
        if self.calls == 1:
            return "prefill"
        return f"token {min(self.calls, self.new_tokens)}/{self.new_tokens}"

    def begin_call(self) -> None:
        self.calls += 1
        self.call_start = time.perf_counter()

    def layer_done(self, index: int) -> None:
        now = time.perf_counter()
        spent = now - self.call_start
        left = spent / (index + 1) * (self.layers - index - 1)
        eta = f", ~{left:.0f} s to go" if left > 0 else ""
        line = (
            f"{self.label}: {self._what()}, layer {index + 1}/{self.layers}, "
            f"{spent:.1f} s{eta} (total {now - self.start:.0f} s)"
        )
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            if index + 1 == self.layers:
                self.stream.write("\n")
        elif index + 1 == self.layers or now - self.last_line >= NON_TTY_EVERY_S:
            self.stream.write(line + "\n")
            self.last_line = now
        self.stream.flush()


@contextmanager
def layer_progress(
    model: nn.Module, *, new_tokens: int, label: str, stream: TextIO | None = None
) -> Iterator[None]:
    """Report each forward of `model` (a `CausalLM`: `model.model.layers`) layer by layer on
    `stream` (stderr) while the block runs; the hooks are removed on exit, errors included."""
    layers = list(model.model.layers)
    reporter = _Reporter(len(layers), new_tokens, label, stream or sys.stderr)
    handles = []

    def before_first(_module: nn.Module, _args: tuple) -> None:
        reporter.begin_call()

    def after(index: int):
        def hook(_module: nn.Module, _args: tuple, _out: torch.Tensor) -> None:
            reporter.layer_done(index)

        return hook

    handles.append(layers[0].register_forward_pre_hook(before_first))
    handles.extend(layer.register_forward_hook(after(i)) for i, layer in enumerate(layers))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
