"""The one-call C decode step on every dense family's layer (tiny random INT4 models): per-head
q/k norms (Qwen3, Gemma 3), Gemma's (1 + w) and sandwich norms, GELU gates, soft-capped logits
and its q k^T scale, sliding-window layers and Gemma 3's second rope table. Each row's hidden
state equals the PyTorch layers' on the same cache, for batched rows at their own cache rows and
positions (past the window), for a chunked prefill, and for a long row whose attention is split
in chunks (flash-decoding) inside a window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.format.scheme import QuantScheme
from quantkit.fused_kernels.cpu.w4a16 import cpu_kernel_available
from quantkit.quantize.pipeline import quantize_model
from quantkit.runtime.loader import load_model
from tests.family_models import (
    COMMON,
    FAMILIES,
    MOE_CONFIGS,
    MOE_FAMILIES,
    SLIDING_WINDOW,
    make_family_model,
)

pytestmark = [
    pytest.mark.skipif(not cpu_kernel_available(), reason="needs gcc for the C kernel"),
    pytest.mark.usefixtures("one_thread"),
]
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _checkpoint(
    name: str, tmp: Path, group: int = 32, sizes: dict | None = None, **config: object
) -> Path:
    """A family's tiny model quantized (INT4, `group`), made with `sizes` and with `config`
    written over its config.json afterwards."""
    src = make_family_model(name, tmp / "src", **(sizes or {}))
    if config:
        data = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**data, **config}))
    outcome = quantize_model(src, scheme=QuantScheme("int4", group))
    return outcome.save(tmp / "ckpt", source_dir=src)


@pytest.fixture(scope="module", params=FAMILIES + MOE_FAMILIES)
def family_model(request, tmp_path_factory):
    ckpt = _checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, load_model(ckpt, tokenizer=False).model


def _torch_layers(model, tokens, positions, slots, s: int) -> torch.Tensor:
    """Hidden states [R, 1, H] after the PyTorch layers for one token per row, rows given in
    cache-row order (slots 0..R-1), attending under the mask slot <= position."""
    at = torch.tensor([[p] for p in positions])
    x = model.embed(torch.tensor([[t] for t in tokens]))
    cos, sin = model.rope(at)
    mask = (torch.arange(s) <= at).view(len(tokens), 1, 1, s)
    for layer in model.model.layers:
        x = layer(x, cos, sin, positions=at, mask=mask)
    return x


def test_batched_rows_equal_the_pytorch_layers(family_model) -> None:
    name, model = family_model
    s, lengths = 40, [3, 2 * SLIDING_WINDOW + 5, 1, SLIDING_WINDOW + 1]
    with torch.no_grad():
        model.setup_cache(batch=4, max_len=s)
        assert model.decode_path.reason == "bound", (name, model.decode_path.reason)
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(3, 512, (4, max(lengths)), generator=g)
        pos = torch.arange(ids.shape[1]).expand(4, -1)
        path, model.decode_path = model.decode_path, None
        model(ids, positions=pos, mask=(torch.arange(s) <= pos[:1, :, None]).unsqueeze(1))
        model.decode_path = path
        tokens, slots = [42, 7, 99, 300], [2, 0, 3, 1]
        fast = path.run_rows(model, tokens, lengths, slots)
        order = sorted(range(4), key=lambda r: slots[r])
        model.decode_path = None  # rewrites the same cache positions
        slow = _torch_layers(
            model, [tokens[r] for r in order], [lengths[r] for r in order], None, s
        )
        model.decode_path = path
        model.drop_cache()
    torch.testing.assert_close(fast[order], slow, **TOL, msg=name)


def test_chunked_prefill_equals_the_pytorch_path(family_model) -> None:
    """One row's tokens in two chunks through the step (each a causal prefill over the cache),
    against the PyTorch path's logits, past the window."""
    name, model = family_model
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 512, (1, 2 * SLIDING_WINDOW + 6), generator=g)
    s, out = 48, {}
    path = model.decode_path
    for fast in (True, False):
        model.decode_path = path if fast else None
        with torch.no_grad():
            model.setup_cache(batch=1, max_len=s)
            if fast:
                assert path.reason == "bound", (name, path.reason)
            chunks = []
            for lo, hi in ((0, SLIDING_WINDOW + 3), (SLIDING_WINDOW + 3, ids.shape[1])):
                pos = torch.arange(lo, hi).unsqueeze(0)
                mask = (torch.arange(s) <= pos[0, :, None]).view(1, 1, hi - lo, s)
                chunks.append(model(ids[:, lo:hi], positions=pos, mask=mask))
            model.drop_cache()
        out[fast] = torch.cat(chunks, dim=1)
    model.decode_path = path
    torch.testing.assert_close(out[True], out[False], **TOL, msg=name)


def _caches(model) -> list[torch.Tensor]:
    return [t.clone() for layer in model.model.layers
            for t in (layer.self_attn.cache.k, layer.self_attn.cache.v)]  # fmt: skip


def _last_rows_runs(model, n: int, s: int, seed: int):
    """A prompt of n random tokens through the step with out_rows None (all), 3, 1 and 0: each
    run's states, its cache after, and the state of one more token after it; and the prompt's
    logits through `last_only`."""
    tokens = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    path = model.decode_path
    runs = {}
    with torch.no_grad():
        for want in (None, 3, 1, 0):
            model.setup_cache(batch=1, max_len=s)
            assert path.reason == "bound", path.reason
            hidden = path.run_rows(model, tokens, list(range(n)), [0] * n, out_rows=want)
            caches = _caches(model)
            after = path.run_rows(model, [11], [n], [0])
            runs[want] = (hidden, caches, after)
        ids, pos = torch.tensor([tokens]), torch.arange(n).unsqueeze(0)
        mask = (torch.arange(s) <= pos[0, :, None]).view(1, 1, n, s)
        model.setup_cache(batch=1, max_len=s)
        last = model(ids, positions=pos, mask=mask, last_only=True)
        model.drop_cache()
    return runs, last


def _check_last_rows(model, runs, last, same) -> None:
    whole, caches, after = runs[None]
    for want in (3, 1, 0):
        hidden, got_caches, got_after = runs[want]
        if want:
            same(hidden[-want:], whole[-want:])
        # every row's keys and values as a whole call writes them: the next step's bits
        assert all(torch.equal(a, b) for a, b in zip(got_caches, caches, strict=True))
        assert torch.equal(got_after, after)
    assert last.shape == (1, 1, model.config.vocab_size)
    same(last, model.logits(whole[-1:].view(1, 1, -1)))


def test_a_prompt_wanting_its_last_rows_gets_them_and_every_key(family_model) -> None:
    """`out_rows`: the last layer computes, past every row's keys and values, only the last
    rows' states (a prefill wants its last row's; 0 rows: a long prompt's chunk before its
    last). The cache holds the same keys and values as after a whole call (so the next step
    is the same bits), and the rows wanted equal the whole call's: with fp32 activations to
    rounding (a GEMV's accumulators depend on how many rows it takes), past the window, on
    every family and mixture of experts."""
    name, model = family_model
    runs, last = _last_rows_runs(model, 2 * SLIDING_WINDOW + 6, 48, seed=8)
    _check_last_rows(model, runs, last,
                     lambda a, b: torch.testing.assert_close(a, b, **TOL, msg=name))  # fmt: skip
    if not model.decode_path.tail_rows:  # a prompt's logits then come from the whole call
        assert torch.equal(last, model.logits(runs[None][0][-1:].view(1, 1, -1))), name


@pytest.mark.parametrize("name", ["llama3", "gemma2", "qwen3_moe"])
def test_with_int8_activations_the_rows_wanted_are_the_whole_calls_bits(
    name: str, tmp_path: Path
) -> None:
    """With int8 activations (integer sums, each row's operations in the same order whatever
    the row count) the rows a prompt wants are the whole call's bits: the prefill's logits do
    not move."""
    from quantkit.fused_kernels.cpu.decode import int8_activations_available
    from quantkit.runtime.fast_path import set_act_dtype

    if not int8_activations_available():
        pytest.skip("needs AVX512-VNNI for the int8 tiles")
    model = load_model(_checkpoint(name, tmp_path), tokenizer=False).model
    set_act_dtype(model, torch.int8)
    assert model.decode_path.tail_rows
    runs, last = _last_rows_runs(model, 2 * SLIDING_WINDOW + 6, 48, seed=2)
    _check_last_rows(model, runs, last, lambda a, b: _assert_equal(a, b, name))


def _assert_equal(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    assert torch.equal(a, b), (name, (a - b).abs().max().item())


def test_out_rows_outside_the_call_is_one_error(family_model) -> None:
    name, model = family_model
    path = model.decode_path
    with torch.no_grad():
        model.setup_cache(batch=1, max_len=8)
        for bad in (-1, 4):
            with pytest.raises(ValueError, match="out_rows: expected 0 to 3"):
                path.run_rows(model, [5, 6, 7], [0, 1, 2], [0, 0, 0], out_rows=bad)
        model.drop_cache()


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_a_long_row_split_in_chunks_inside_its_window(name: str, tmp_path: Path) -> None:
    """A row at position 1300 with a 700-position window: its sliding layers attend to
    positions 601..1300 in two chunks of 512 (flash-decoding), the full ones (Gemma 2's) to
    all 1301 in three; the hidden state equals the PyTorch layers'."""
    model = load_model(_checkpoint(name, tmp_path, sliding_window=700), tokenizer=False).model
    s, n = 1312, 1300
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 512, (1, n), generator=g)
    with torch.no_grad():
        model.setup_cache(batch=1, max_len=s)
        path, model.decode_path = model.decode_path, None
        assert path.reason == "bound", path.reason
        pos = torch.arange(n).unsqueeze(0)
        model(ids, positions=pos, mask=(torch.arange(s) <= pos[0, :, None]).view(1, 1, n, s))
        fast = path.run_rows(model, [77], [n])
        slow = _torch_layers(model, [77], [n], None, s)
        model.decode_path = path
    torch.testing.assert_close(fast, slow, **TOL)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_a_moe_step_reads_only_its_rows_top_k_experts(name: str, tmp_path: Path) -> None:
    """The roofline's bytes per step count, of a layer's experts, the top-k one row runs (and
    the expected distinct ones for more rows); the memory total still counts them all."""
    from quantkit.perf.roofline import model_read_bytes

    model = load_model(_checkpoint(name, tmp_path), tokenizer=False).model
    moe = model.config.moe
    experts = sum(
        m.weight_bytes() for where, m in model.named_modules()
        if ".experts." in where and hasattr(m, "weight_bytes")
    )  # fmt: skip
    everything = model_read_bytes(model, batch=10**6)  # every expert is somebody's
    one = model_read_bytes(model)
    assert everything.unread == 0 and one.total == everything.total
    assert one.unread == round(experts * (1 - moe.top_k / moe.experts))
    assert one.read_per_step == everything.read_per_step - one.unread
    assert 0 < model_read_bytes(model, batch=2).unread < one.unread


@pytest.mark.parametrize(
    "shape",
    [
        {"hidden_size": 384, "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 64},
        {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64},
        {"hidden_size": 384, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 128},
    ],
    ids=["D64-group6", "D64-group3", "D128-group3"],
)
def test_a_prefill_attends_each_head_as_a_decode_step_does(shape, tmp_path: Path) -> None:
    """A prefill's rows take their GQA group's query heads together (at D = 64 passes of 4 and
    the 2 or 3 left; at D = 128 pairs, a third alone), a decode row takes them one at a time:
    each head's scores, softmax and values in the same order, so with row-invariant GEMVs the
    prefill's hidden states equal one-row steps' bit for bit, in every KV cache format; and a
    700-token prefill,
    whose long rows attend in chunks (each chunk's heads together, as partials), equals the
    PyTorch layers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, **shape, "num_hidden_layers": 2})
    src = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(src)
    ckpt = quantize_model(src, scheme=QuantScheme("int4", 32)).save(
        tmp_path / "ckpt", source_dir=src
    )
    model = load_model(ckpt, tokenizer=False).model
    tokens = [5, 17, 99, 3, 250, 31, 7, 8, 9, 10, 11, 12]
    for kv in (None, "bfloat16", "int8", "fp8"):
        model.kv_dtype = kv
        with torch.no_grad():
            model.setup_cache(batch=2, max_len=32)
            path = model.decode_path
            assert path.reason == "bound", path.reason
            n = len(tokens)
            one = torch.cat([path.run_rows(model, [t], [i], [0]) for i, t in enumerate(tokens)])
            many = path.run_rows(model, tokens, list(range(n)), [1] * n, row_invariant=True)
            model.drop_cache()
        assert torch.equal(one, many), kv
    # 700 positions: the rows past 512 split in chunks (flash-decoding), each chunk's heads
    # together as partials; against the PyTorch layers
    model.kv_dtype = None
    _c_step_equals_pytorch(model, n=700, high=512, seed=2, slots=704)


@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_an_int8_prefill_equals_one_row_steps(name: str, tmp_path: Path) -> None:
    """A prefill of 16 rows or more with int8 activations (not row-invariant: the GEMM tiles,
    the gate_up with its activation in the tile's epilogue and the down's input quantized
    there too, the query heads of a group together) gives each row the bits a one-row step
    gives it: every part does each row's operations in the same order."""
    model = load_model(_checkpoint(name, tmp_path), tokenizer=False).model
    one, many = _one_row_and_many(model, n=20, seed=1, row_invariant=False)
    assert torch.equal(one, many)


@pytest.mark.parametrize("heads,kv_heads,hidden", [(4, 1, 64), (6, 2, 96), (4, 2, 64)])
def test_head_size_128_takes_a_groups_heads_together(
    heads: int, kv_heads: int, hidden: int, tmp_path: Path
) -> None:
    """Head size 128 (Llama-3-8B's, Qwen3's) takes up to 4 query heads of a KV group in one
    pass over the keys and values (groups of 4, 3 and 2 here): each head's operations are the
    same whatever heads share its pass, so a prefill's rows equal one-row steps bit for bit
    with int8 activations, and the C step equals the PyTorch layers."""
    sizes = {"head_dim": 128, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "hidden_size": hidden}  # fmt: skip
    model = load_model(_checkpoint("llama3", tmp_path, sizes=sizes), tokenizer=False).model
    _c_step_equals_pytorch(model, n=24, high=500, seed=5, slots=32)
    one, many = _one_row_and_many(model, n=20, seed=3, row_invariant=False)
    assert torch.equal(one, many)


@pytest.mark.parametrize("rows", [16, 29])
def test_an_int8_prefill_with_128_element_blocks_equals_one_row_steps(
    rows: int, tmp_path: Path
) -> None:
    """Groups of 128: the fused gate_up takes 8 tile pairs (one 128-element block of the
    down's input) at a time and quantizes each row's block of their products for the down
    (`gate_up_glu`); over a last row chunk of 5 rows and a whole number of chunks, each row
    still gets a one-row step's bits."""
    sizes = {"hidden_size": 128, "intermediate_size": 512}
    model = load_model(_checkpoint("llama3", tmp_path, group=128, sizes=sizes),
                       tokenizer=False).model  # fmt: skip
    one, many = _one_row_and_many(model, n=rows, seed=2, row_invariant=False)
    assert torch.equal(one, many)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_a_one_row_moe_step_equals_the_per_expert_loop(name: str, tmp_path: Path) -> None:
    """With int8 activations a one-row step takes its chosen experts' matmuls together (one
    pass over all their gate/up tiles, one over their down tiles); a row-invariant prefill
    runs the per-expert loop. Each row's hidden state is the same bits either way."""
    import transformers

    # 4 of 8 experts a token: the sum of four experts' outputs is where a different order of
    # additions would show (two experts' sums came out equal when the order differed)
    cls, extra = MOE_CONFIGS[name]
    key = "num_local_experts" if "num_local_experts" in extra else "num_experts"
    config = getattr(transformers, cls)(**{**COMMON, **extra, key: 8, "num_experts_per_tok": 4})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    ckpt = quantize_model(tmp_path / "src", scheme=QuantScheme("int4", 32)).save(
        tmp_path / "ckpt", source_dir=tmp_path / "src"
    )
    model = load_model(ckpt, tokenizer=False).model
    one, many = _one_row_and_many(model, n=12, seed=4, row_invariant=True)
    assert torch.equal(one, many)


def _c_step_equals_pytorch(model, *, n: int, high: int, seed: int, slots: int) -> None:
    """An n-token prefill's logits (random ids below `high`) through the C step equal the
    PyTorch layers' to TOL, each in a fresh cache of `slots`."""
    ids = torch.randint(3, high, (1, n), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(n).unsqueeze(0)
    mask = (torch.arange(slots) <= pos[0, :, None]).view(1, 1, n, slots)
    out, path = {}, model.decode_path
    for fast in (True, False):
        model.decode_path = path if fast else None
        with torch.no_grad():
            model.setup_cache(batch=1, max_len=slots)
            out[fast] = model(ids, positions=pos, mask=mask)
            model.drop_cache()
    model.decode_path = path
    torch.testing.assert_close(out[True], out[False], **TOL)


def _one_row_and_many(model, *, n: int, seed: int, row_invariant: bool):
    """n random tokens' hidden states with int8 activations: as n one-row steps of one cache
    row, and as one n-row prefill of another."""
    from quantkit.fused_kernels.cpu.decode import int8_activations_available
    from quantkit.runtime.fast_path import set_act_dtype

    if not int8_activations_available():
        pytest.skip("needs AVX512-VNNI for the int8 tiles")
    set_act_dtype(model, torch.int8)
    tokens = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        model.setup_cache(batch=2, max_len=32)
        path = model.decode_path
        assert path.reason == "bound" and path.act_dtype == torch.int8, path.reason
        one = torch.cat([path.run_rows(model, [t], [i], [0]) for i, t in enumerate(tokens)])
        many = path.run_rows(model, tokens, list(range(n)), [1] * n, row_invariant=row_invariant)
        model.drop_cache()
    return one, many


def test_phase_bytes_count_the_experts_a_step_reads(tmp_path: Path) -> None:
    """The decode breakdown's bytes: of a mixture of experts, the share of experts a step of
    B rows reads on average (top 2 of 4: half at one row, 3/4 at two), the rest of the step's
    read (head, norms) never negative."""
    from quantkit.evals.speed.decode_phases import weight_bytes_by_phase
    from quantkit.perf.roofline import model_read_bytes

    model = load_model(_checkpoint("qwen3_moe", tmp_path), tokenizer=False).model
    every = sum(
        m.weight_bytes()
        for name, m in model.model.layers.named_modules()
        if ".experts." in name and name.endswith(("gate_proj", "up_proj"))
    )
    one, two = weight_bytes_by_phase(model, 1), weight_bytes_by_phase(model, 2)
    assert one["gate_up"] == pytest.approx(every / 2)
    assert two["gate_up"] == pytest.approx(every * 3 / 4)
    assert one["qkv"] == two["qkv"] > 0  # attention's projections: every step reads them all
    assert model_read_bytes(model).read_per_step > sum(one.values())
