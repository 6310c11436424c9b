"""A quantkit checkpoint (or any dense HF directory of a family with GGUF names) as one GGUF
file llama.cpp, Ollama and LM Studio load.

INT4 Linears keep the codes the algorithm chose: each group becomes whole 32-weight blocks of
Q4_0 (symmetric) or Q4_1 (asymmetric) with the group's scale (`gguf_blocks`), so AWQ or GPTQ
codes reach llama.cpp without being rounded again. Dense tensors (embeddings, a dense lm_head,
every Linear of an unquantized model) are written as stored (bf16, f16, f32) or as `--dense-type`
asks; norms and biases stay f32, as llama.cpp wants them. q/k rows are permuted into llama.cpp's
rotary layout (the inverse of `sources.gguf.unpermute_qk`), and the tokenizer goes in as
llama.cpp's gpt2 model (`gguf_vocab`).

Memory is one tensor at a time: the header (every tensor's name, type and size) is planned from
the safetensors headers, then each tensor is read, converted and appended. The file is written
beside the target and renamed into place, so an interrupted export leaves no half file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantkit.errors import CheckpointError, ExportError
from quantkit.export.gguf_blocks import Exactness, check_blockable, int4_blocks, mxfp4_blocks
from quantkit.export.gguf_vocab import GgufVocab, read_vocab
from quantkit.format.compressed_tensors import scheme_from_quantization_config
from quantkit.format.fp4 import unpack_fp4
from quantkit.format.lazy_safetensors import SafetensorsFiles
from quantkit.format.packing import unpack_int4, unpack_zero_points
from quantkit.format.scheme import QuantScheme
from quantkit.models.config import moe_config
from quantkit.models.families import FAMILIES, family_for
from quantkit.models.family import GgufNames
from quantkit.models.rope import Rope, rope_for
from quantkit.paths import atomic_file

INT4_TYPES = ("q4_0", "q4_1")
# Quantized formats whose codes a GGML type holds as they are: kind -> that type.
SAME_CODES = {"mxfp4": "mxfp4"}
DENSE_TYPES = ("auto", "bf16", "f16", "f32", "q8_0")
# What K-quants and others would need: codes searched against their own grids.
NOT_YET = ("q4_k", "q4_k_m", "q5_k", "q6_k", "q5_0", "q5_1")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_INT4_LOCALS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


@dataclass
class ExportReport:
    path: Path
    int4_type: str | None
    dense_type: str
    tensors: int = 0
    bytes: int = 0
    exactness: Exactness = field(default_factory=Exactness)
    pre_tokenizer: str = ""

    def summary(self) -> str:
        what = f"{self.int4_type} (the checkpoint's codes)" if self.int4_type else "dense"
        lines = [
            f"wrote {self.path}: {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB, "
            f"Linears {what}, embeddings/dense {self.dense_type}, "
            f"pre-tokenizer {self.pre_tokenizer}",
        ]
        e = self.exactness
        if self.int4_type and e.exact:
            lines.append(
                f"lossless: all {e.weights:,} quantized weights as the checkpoint holds them"
            )
        elif self.int4_type:
            lines.append(
                f"near-lossless: {e.weights:,} INT4 weights, {e.scales_rounded} scales rounded "
                f"to fp16, largest deviation {e.max_step_error:.2e} of a quantization step"
            )
        return "\n".join(lines)


@dataclass
class _Item:
    """One GGUF tensor: its name, its GGML type, its byte size, how to make its bytes."""

    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order ([N, K] for a Linear)
    nbytes: int
    make: Callable[[], np.ndarray]
    expert: int | None = None  # one expert's slice of a stacked tensor (`_stack`)


def _files(model_dir: Path) -> SafetensorsFiles:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"not a checkpoint: {model_dir} has no *.safetensors file")
    return SafetensorsFiles(files)


def _gguf_names(config: dict[str, Any]) -> tuple[Any, GgufNames]:
    family = family_for(config)
    if family.gguf is None:
        covered = ", ".join(f.model_types[0] for f in FAMILIES if f.gguf is not None)
        raise ExportError(
            f"model_type {config.get('model_type')!r}: GGUF export covers the families with "
            f"llama.cpp tensor names ({covered}), got one without"
        )
    moe = moe_config(config, family)
    if moe is not None and not moe.renormalize:
        raise ExportError(
            f"{family.moe.renormalize_key}: llama.cpp's {family.gguf.architectures[0]} always "
            "renormalizes the chosen experts' routing weights, so expected true, got false"
        )
    return family, family.gguf


def _stack(parts: list[_Item]) -> _Item:
    """One layer's experts of one Linear as llama.cpp's [experts, N, K] tensor."""
    parts = sorted(parts, key=lambda p: p.expert if p.expert is not None else -1)
    first = parts[0]
    indices = [p.expert for p in parts]
    if indices != list(range(len(parts))):
        raise ExportError(f"{first.name}: expected experts 0..{len(parts) - 1}, got {indices}")
    odd = [p.expert for p in parts if (p.qtype, p.shape) != (first.qtype, first.shape)]
    if odd:
        raise ExportError(
            f"{first.name}: expected every expert as {first.qtype.name} {first.shape}, "
            f"got others for experts {odd[:5]}"
        )

    def make() -> np.ndarray:
        return np.stack([np.ascontiguousarray(p.make()) for p in parts])

    shape = (len(parts), *first.shape)
    return _Item(first.name, first.qtype, shape, sum(p.nbytes for p in parts), make)


def _int4_type(scheme: QuantScheme | None, asked: str) -> str | None:
    if scheme is None:
        if asked in INT4_TYPES:
            raise ExportError(
                f"--type {asked}: the checkpoint is dense (no INT4 codes to write); quantize it "
                "first (quantkit quantize MODEL --bits 4 [--symmetric]) or pick "
                f"{', '.join(DENSE_TYPES[1:])}"
            )
        return None
    if scheme.kind in SAME_CODES:
        if asked not in ("auto", SAME_CODES[scheme.kind]):
            raise ExportError(
                f"--type {asked}: an {scheme.kind} checkpoint exports as "
                f"{SAME_CODES[scheme.kind]} (its own codes), got {asked}"
            )
        return SAME_CODES[scheme.kind]
    if scheme.kind != "int4":
        raise ExportError(
            f"{scheme.describe()}: GGUF export writes INT4 codes (q4_0/q4_1) or dense tensors; "
            f"GGUF has no block type holding {scheme.kind} codes as quantkit stores them (mxfp4 "
            "exports as ggml's MXFP4)"
        )
    if asked == "auto":
        return "q4_0" if scheme.symmetric else "q4_1"
    if asked not in INT4_TYPES:
        raise ExportError(
            f"--type {asked}: an INT4 checkpoint exports as q4_0 (symmetric) or q4_1, got {asked}"
        )
    if asked == "q4_0" and not scheme.symmetric:
        raise ExportError(
            "--type q4_0: q4_0 holds symmetric codes (no zero point), got an asymmetric "
            "checkpoint: export it as q4_1, or quantize with --symmetric"
        )
    return asked


def _ggml(name: str) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name.upper()]


def _dense_type(asked: str, dtype: torch.dtype) -> str:
    if asked != "auto":
        return asked
    return {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "f32")


def _dense_bytes(t: torch.Tensor, kind: str) -> np.ndarray:
    """A dense tensor as `kind` bytes (uint8, rows kept), or f32 values for norms and biases."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if kind == "f32":
        return t.float().numpy()
    if kind == "f16":
        return t.to(torch.float16).numpy()
    if kind == "bf16":
        return t.to(torch.bfloat16).view(torch.uint8).numpy()
    return quantize(t.float().numpy(), GGMLQuantizationType.Q8_0)


def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[_ggml(kind)]
    return int(np.prod(shape)) // block * size


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half rows of a q/k projection -> llama.cpp's interleaved pairs (per head),
    the rows moved whole; the inverse of `sources.gguf.unpermute_qk`."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ExportError(f"q/k rows: expected a multiple of 2 x {n_head} heads, got {rows}")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Plan:
    """Every tensor of the GGUF in file order, each read and converted only when written."""

    def __init__(
        self,
        model_dir: Path,
        config: dict[str, Any],
        *,
        int4_type: str | None,
        dense_type: str,
        scheme: QuantScheme | None,
    ) -> None:
        self.files = _files(model_dir)
        self.config = config
        self.scheme = scheme
        self.int4_type = int4_type
        self.dense_type = dense_type
        self.exactness = Exactness()
        self.family, self.names = _gguf_names(config)
        self._hf_to_gguf = {v: k for k, v in self.names.layer.items()}
        moe = self.family.moe
        self._expert = None
        if self.names.experts and moe is not None:
            locals_ = "|".join(re.escape(v) for v in self.names.experts.values())
            self._expert = re.compile(
                rf"^model\.layers\.(\d+)\.{re.escape(moe.block)}\.experts\.(\d+)\."
                rf"({locals_})\.weight$"
            )
            self._expert_part = {v: k for k, v in self.names.experts.items()}
        self._globals = {v: k for k, v in self.names.globals.items()}
        self.items: list[_Item] = []
        self.dense_kind = ""

    def expert_of(self, hf: str) -> tuple[str, int] | None:
        """The stacked GGUF tensor holding `hf` (one expert's Linear weight) and its index."""
        m = self._expert.match(hf) if self._expert is not None else None
        if m is None:
            return None
        layer, expert, local = m.groups()
        return f"blk.{layer}.{self._expert_part[local]}.weight", int(expert)

    def gguf_name(self, hf: str) -> str:
        expert = self.expert_of(hf)
        if expert is not None:
            return expert[0]
        m = _LAYER.match(hf)
        if m:
            layer, module, kind = m.groups()
            part = self._hf_to_gguf.get(module)
            if part is not None:
                return f"blk.{layer}.{part}.{kind}"
        stem, _, kind = hf.rpartition(".")
        if stem in self._globals:
            return f"{self._globals[stem]}.{kind}"
        raise ExportError(
            f"tensor {hf}: expected a {self.names.architectures[0]} tensor llama.cpp "
            "names, got one it has no name for"
        )

    def _heads(self, gguf_name: str) -> int | None:
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        key = self.names.rope_permuted.get(part)
        return None if key is None else int(self.config[key])

    def build(self) -> list[_Item]:
        entries = self.files.entries
        modules = sorted({n.rsplit(".", 1)[0] for n in entries if n.endswith(".weight_packed")})
        for m in modules:
            fp4 = self.int4_type in SAME_CODES.values()
            self.items.append(self._fp4_item(m) if fp4 else self._int4_item(m))
        done = {f"{m}.{local}" for m in modules for local in _INT4_LOCALS}
        for hf, entry in entries.items():
            if hf in done:
                continue
            if not hf.endswith((".weight", ".bias")):
                raise ExportError(f"tensor {hf}: expected a weight or bias, got {entry.dtype}")
            self.items.append(self._dense_item(hf, entry))
        stacks: dict[str, list[_Item]] = {}
        for item in self.items:
            if item.expert is not None:
                stacks.setdefault(item.name, []).append(item)
        self.items = [i for i in self.items if i.expert is None]
        self.items += [_stack(parts) for parts in stacks.values()]
        self.items.sort(key=lambda i: _natural(i.name))
        return self.items

    def _expert_index(self, hf: str) -> int | None:
        expert = self.expert_of(hf)
        return None if expert is None else expert[1]

    def _int4_item(self, module: str) -> _Item:
        assert self.int4_type is not None and self.scheme is not None
        name = self.gguf_name(f"{module}.weight")
        n, k = (int(v) for v in self.files.read(f"{module}.weight_shape").tolist())
        check_blockable(k, self.scheme.group_size_for(k), f"{module}")
        heads = self._heads(name)

        def make() -> np.ndarray:
            codes = unpack_int4(self.files.read(f"{module}.weight_packed"), k)
            scale = self.files.read(f"{module}.weight_scale")
            zero = None
            if not self.scheme.symmetric:  # type: ignore[union-attr]
                zero = unpack_zero_points(self.files.read(f"{module}.weight_zero_point"), n)
            blocks, exact = int4_blocks(codes, scale, zero, qtype=self.int4_type, where=module)  # type: ignore[arg-type]
            self.exactness.add(exact)
            return blocks if heads is None else permute_qk(blocks, heads)

        nbytes = _nbytes((n, k), self.int4_type)
        expert = self._expert_index(f"{module}.weight")
        return _Item(name, _ggml(self.int4_type), (n, k), nbytes, make, expert)

    def _fp4_item(self, module: str) -> _Item:
        name = self.gguf_name(f"{module}.weight")
        packed = self.files.entries[f"{module}.weight_packed"]
        n, k = int(packed.shape[0]), 2 * int(packed.shape[1])
        heads = self._heads(name)

        def make() -> np.ndarray:
            codes = unpack_fp4(self.files.read(f"{module}.weight_packed"))
            exponents = self.files.read(f"{module}.weight_scale")
            self.exactness.add(Exactness(weights=n * k))
            blocks = mxfp4_blocks(codes, exponents, where=module)
            return blocks if heads is None else permute_qk(blocks, heads)

        kind = str(self.int4_type)
        expert = self._expert_index(f"{module}.weight")
        return _Item(name, _ggml(kind), (n, k), _nbytes((n, k), kind), make, expert)

    def _dense_item(self, hf: str, entry: Any) -> _Item:
        name = self.gguf_name(hf)
        shape = tuple(int(s) for s in entry.shape)
        kind = "f32" if len(shape) == 1 else _dense_type(self.dense_type, entry.dtype)
        if kind == "q8_0" and shape[-1] % 32:
            kind = _dense_type("auto", entry.dtype)  # a row that is not whole Q8_0 blocks
        if len(shape) == 2:
            self.dense_kind = self.dense_kind or kind
        heads = self._heads(name)

        def make() -> np.ndarray:
            t = self.files.read(hf)
            out = _dense_bytes(t, kind)
            return out if heads is None else permute_qk(out, heads)

        return _Item(name, _ggml(kind), shape, _nbytes(shape, kind), make, self._expert_index(hf))


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _file_type(int4_type: str | None, dense: str) -> int:
    from gguf import LlamaFileType

    kind = int4_type or dense
    return int(
        {
            "q4_0": LlamaFileType.MOSTLY_Q4_0,
            "q4_1": LlamaFileType.MOSTLY_Q4_1,
            "mxfp4": LlamaFileType.MOSTLY_MXFP4_MOE,
            "q8_0": LlamaFileType.MOSTLY_Q8_0,
            "bf16": LlamaFileType.MOSTLY_BF16,
            "f16": LlamaFileType.MOSTLY_F16,
        }.get(kind, LlamaFileType.ALL_F32)
    )


def _rope_freqs(config: dict[str, Any], head_dim: int) -> tuple[Rope, np.ndarray | None]:
    """The model's rope and, for Llama 3's rule, llama.cpp's `rope_freqs` factors (the base
    frequencies over the scaled ones: llama.cpp divides each frequency by its factor)."""
    rope = rope_for(config, "full_attention")
    if rope.llama3 is None:
        return rope, None
    base = Rope(rope.theta).inv_freq(head_dim)
    return rope, (base / rope.inv_freq(head_dim)).numpy().astype(np.float32)


def _write_metadata(
    writer: Any, config: dict[str, Any], vocab: GgufVocab, file_type: int, name: str
) -> np.ndarray | None:
    """The model's and the tokenizer's keys; the `rope_freqs` factors when Llama 3's rope needs
    them as a tensor."""
    from gguf import RopeScalingType

    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    writer.add_name(name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope, freqs = _rope_freqs(config, head_dim)
    writer.add_rope_freq_base(rope.theta)
    if rope.factor != 1.0:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope.factor)
    moe = moe_config(config, family_for(config))
    if moe is not None:
        writer.add_expert_count(moe.experts)
        writer.add_expert_used_count(moe.top_k)
        writer.add_expert_feed_forward_length(moe.intermediate)
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        if key in vocab.special:
            add(vocab.special[key])
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
    return freqs


def export_gguf(
    model_dir: Path,
    out: Path,
    *,
    int4_type: str = "auto",
    dense_type: str = "auto",
    pre_tokenizer: str | None = None,
    progress: bool = True,
) -> ExportReport:
    """Write the checkpoint (or dense HF directory) `model_dir` as the GGUF file `out`."""
    import gguf
    from tqdm.auto import tqdm

    model_dir, out = Path(model_dir), Path(out)
    if int4_type in NOT_YET:
        raise ExportError(
            f"--type {int4_type}: K-quant and 5-bit blocks need codes chosen for their own grid, "
            "which quantkit does not search yet; use q4_0 or q4_1"
        )
    if int4_type not in ("auto", *INT4_TYPES, *DENSE_TYPES[1:]):
        raise ExportError(
            f"--type: expected auto, {', '.join(INT4_TYPES)} or {', '.join(DENSE_TYPES[1:])}, "
            f"got {int4_type!r}"
        )
    if dense_type not in DENSE_TYPES:
        raise ExportError(
            f"--dense-type: expected one of {', '.join(DENSE_TYPES)}, got {dense_type!r}"
        )
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"not a checkpoint: {model_dir} has no config.json")
    config = json.loads(config_file.read_text())
    qcfg = config.get("quantization_config")
    scheme = None if qcfg is None else scheme_from_quantization_config(qcfg)
    if scheme is None and int4_type in DENSE_TYPES[1:]:
        dense_type, int4 = int4_type, None
    elif scheme is not None and int4_type in DENSE_TYPES[1:]:
        raise ExportError(
            f"--type {int4_type}: an INT4 checkpoint's Linears export as q4_0 or q4_1 (its own "
            "codes); --dense-type sets the embeddings' type"
        )
    else:
        int4 = _int4_type(scheme, int4_type)
    vocab = read_vocab(model_dir, config, pre_tokenizer=pre_tokenizer)
    plan = _Plan(model_dir, config, int4_type=int4, dense_type=dense_type, scheme=scheme)
    items = plan.build()
    arch = plan.names.architectures[0]
    report = ExportReport(out, int4, plan.dense_kind or dense_type, pre_tokenizer=vocab.pre)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        file_type = _file_type(int4, plan.dense_kind)
        freqs = _write_metadata(writer, config, vocab, file_type, model_dir.name)
        if freqs is not None:
            items.insert(
                0,
                _Item(
                    "rope_freqs.weight", _ggml("f32"), freqs.shape, freqs.nbytes, lambda f=freqs: f
                ),
            )
        for item in items:
            byte_shape = (
                item.shape
                if item.qtype.name in ("F32", "F16")
                else (*item.shape[:-1], item.nbytes // max(1, int(np.prod(item.shape[:-1]))))
            )
            dtype = {"F32": np.float32, "F16": np.float16}.get(item.qtype.name, np.uint8)
            writer.add_tensor_info(
                item.name, byte_shape, np.dtype(dtype), item.nbytes, raw_dtype=item.qtype
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item in _progress(items, tqdm, progress, out.name):
            data = np.ascontiguousarray(item.make())
            if data.nbytes != item.nbytes:
                raise ExportError(f"{item.name}: expected {item.nbytes} bytes, got {data.nbytes}")
            writer.write_tensor_data(data)
            report.tensors += 1
            report.bytes += item.nbytes
        writer.close()
    report.exactness = plan.exactness
    return report


def _progress(items: list[_Item], tqdm: Any, progress: bool, what: str) -> Iterator[_Item]:
    total = sum(i.nbytes for i in items)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"writing {what}", disable=not progress
    ) as bar:
        for item in items:
            yield item
            bar.update(item.nbytes)
