"""A source model opened for streaming: its config checked against the tensors' headers, and
its tensors read one at a time, a decoder layer built when the quantizer reaches it.

Nothing here holds more than one layer: `open_source` reads headers only (a config that does
not describe the weights fails before a byte of weights is read), `layer(i)` builds layer i in
fp32 from its tensors exactly as the whole-model loader would, and `embedding_rows` reads only
the rows of the embedding the calibration text uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.format.checkpoint import check_index_holds
from quantkit.format.lazy_safetensors import SafetensorsFiles, TensorEntry, read_tensor
from quantkit.models.config import ModelConfig
from quantkit.models.decoder import CausalLM, DecoderLayer, check_weights, wanted_tensors
from quantkit.models.layers import Rotary
from quantkit.sources.resolve import check_layer_count, read_config, shard_files

EMBED = "model.embed_tokens.weight"
# Dense tensors converted to the storage dtype this many elements at a time (the fp32 copy of a
# 128k-token embedding would be 2 GB).
_CONVERT_CHUNK = 1 << 24
# Widths fp32 holds exactly (NaN payloads aside), so fp32 and back returns the same bits.
_EXACT_IN_FP32 = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class SourceModel:
    """The source's config, its tensors (lazily) and a model shell on the meta device whose
    config, family and rotary tables the algorithms read."""

    model_dir: Path
    config: dict[str, Any]
    files: SafetensorsFiles
    shell: CausalLM

    @property
    def num_layers(self) -> int:
        return self.shell.config.num_layers

    @property
    def head_source(self) -> str:
        """The tensor the lm_head computes with: its own, or the embedding when tied."""
        tied = self.shell.config.tie_word_embeddings
        return "lm_head.weight" if "lm_head.weight" in self.files and not tied else EMBED

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.files.entries.values())

    def layer(self, index: int) -> nn.Module:
        """Decoder layer `index` in fp32, from its tensors (the whole-model loader's values)."""
        with torch.device("meta"):
            layer = DecoderLayer(self.shell.config, index)
        prefix = f"model.layers.{index}."
        state = {}
        for name in wanted_tensors(layer, {}):
            t = self.files.read(prefix + name)
            state[name] = t.to(torch.float32) if t.is_floating_point() else t
        layer.load_state_dict(state, strict=False, assign=True)
        return layer.eval()

    def read_fp32(self, name: str) -> torch.Tensor:
        t = self.files.read(name)
        return t.to(torch.float32) if t.is_floating_point() else t

    def read_as(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A dense tensor in the storage dtype, through fp32 as the whole-model path converts
        (fp32 first, then `dtype`), a chunk of rows at a time."""
        t = self.files.read(name)
        if not t.is_floating_point():
            return t
        if t.dtype == dtype and dtype in _EXACT_IN_FP32 and not torch.isnan(t).any():
            return t  # through fp32 and back is the identity: no second copy of the table
        if t.dim() == 0:
            return t.to(torch.float32).to(dtype)
        out = torch.empty(t.shape, dtype=dtype)
        rows = max(1, _CONVERT_CHUNK // max(1, t[0].numel()))
        for i in range(0, t.shape[0], rows):
            out[i : i + rows] = t[i : i + rows].to(torch.float32).to(dtype)
        return out

    def embedding_rows(self, ids: Sequence[int]) -> torch.Tensor:
        """fp32 rows `ids` of the embedding, read row by row (not the whole table)."""
        entry = self.files.entries[EMBED]
        width = entry.shape[1]
        row_bytes = entry.nbytes // entry.shape[0]
        rows = []
        for i in ids:
            start = entry.start + int(i) * row_bytes
            one = TensorEntry(entry.file, entry.dtype, (width,), start, start + row_bytes)
            rows.append(read_tensor(one).to(torch.float32))
        return torch.stack(rows) if rows else torch.empty(0, width)

    def calibration_shell(self, samples: torch.Tensor) -> torch.Tensor:
        """Give the shell an embedding of just the rows `samples` uses, and return `samples`
        renumbered into it: the embedded activations are the full table's, in fp32."""
        used, renumbered = torch.unique(samples, return_inverse=True)
        rows = self.embedding_rows(used.tolist())
        self.shell.model.embed_tokens = nn.Embedding.from_pretrained(rows, freeze=True)
        return renumbered.reshape(samples.shape)


def open_source(model_dir: Path) -> SourceModel:
    """Open a local HF directory for streaming: headers read and checked, no weights read."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    check_layer_count(model_dir, config)
    names, weight_map = shard_files(model_dir)
    files = SafetensorsFiles(model_dir / n for n in names)
    if weight_map is not None:
        check_index_holds(weight_map, files.entries)
    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        shell = CausalLM(cfg)
    shapes = {k: e.shape for k, e in files.entries.items()}
    if (cfg.tie_word_embeddings or "lm_head.weight" not in shapes) and EMBED in shapes:
        shapes["lm_head.weight"] = shapes[EMBED]
    check_weights(cfg, shell, shapes, wanted_tensors(shell, {}))
    shell.model.rotary = Rotary(cfg.head_dim, cfg.ropes)
    return SourceModel(model_dir, config, files, shell)
