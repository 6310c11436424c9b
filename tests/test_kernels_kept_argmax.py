"""The best tokens the int8 and int6 head GEMVs keep while they store the logits (`best`), and
their way to the greedy sampler and the grammar processor (`runtime.kept_argmax`): numpy's
arg-max order every time (larger first, the first of equal values, across lanes, tiles and
threads), none for a NaN, and none for logits that are not exactly what the head wrote."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from quantkit.fused_kernels.cpu.abi import QK_TOP
from quantkit.fused_kernels.cpu.bf16_gemv import I8I8Weight, i8i8_gemv, i8i8_gemv_available
from quantkit.fused_kernels.cpu.i6_gemv import I6Weight, i6_gemv, i6_gemv_available
from quantkit.models.decoder import build_model
from quantkit.runtime.head import CastHead, Int6Head, set_head_dtype
from quantkit.runtime.kept_argmax import keep, kept_argmax, kept_best
from quantkit.runtime.sampling import RepetitionPenalty, apply_processors, greedy_tokens
from tests.family_models import make_family_model

needs_vnni = pytest.mark.skipif(
    not (i8i8_gemv_available() and i6_gemv_available()), reason="the head GEMVs need AVX512-VNNI"
)


def _i8(weight: torch.Tensor) -> I8I8Weight:
    scale = weight.abs().amax(-1) / 127
    return I8I8Weight(torch.round(weight / scale[:, None]).to(torch.int8), scale)


def _gemvs(weight: torch.Tensor):
    """The two kernels over `weight`: (name, x -> (y, best))."""
    i8, i6 = _i8(weight), I6Weight(weight)

    def run_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best = torch.full((x.shape[0], QK_TOP), 7, dtype=torch.int64)
        return i8i8_gemv(x, i8, best=best), best

    def run_i6(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best = torch.full((x.shape[0], QK_TOP), 7, dtype=torch.int64)
        return i6_gemv(x, i6, best=best), best

    return [("int8", run_i8), ("int6", run_i6)]


def _numpys_order(y: torch.Tensor) -> list[list[int]]:
    """Each row's first QK_TOP columns in arg-max order (a stable sort of -y: the first of
    equal values first), -1 from the first value that is not finite."""
    out = []
    for row in y.numpy():
        cols = np.argsort(-row, kind="stable")[:QK_TOP].tolist()
        cut = next((i for i, c in enumerate(cols) if not np.isfinite(row[c])), len(cols))
        out.append(cols[:cut] + [-1] * (QK_TOP - cut))
    return out


@needs_vnni
@pytest.mark.parametrize(("rows", "threads"), [(r, t) for r in (1, 3, 9, 16) for t in (1, 2, 3)]
                         + [(3, 70)])  # more threads than a merge could once take  # fmt: skip
def test_the_kept_argmax_is_numpys_on_what_was_stored(rows: int, threads: int) -> None:
    g = torch.Generator().manual_seed(rows * 10 + threads)
    # 63 tiles, the last one 11 rows; 251 where every one of 70 threads takes some
    weight = torch.randn(1003 if threads < 64 else 4011, 64, generator=g)
    x = torch.randn(rows, 64, generator=g)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, run in _gemvs(weight):
            y, best = run(x)
            assert best[:, 0].tolist() == y.numpy().argmax(-1).tolist(), name
            assert best.tolist() == _numpys_order(y), name
    finally:
        torch.set_num_threads(saved)


@needs_vnni
@pytest.mark.parametrize("pair", [(3, 7), (5, 37), (9, 1000), (0, 1002)])
def test_equal_maxima_give_the_first_column(pair: tuple[int, int]) -> None:
    """Two equal rows of the weight give equal logits: in one tile's lanes (3, 7), in two
    tiles (5, 37), and in the two threads' halves (9, 1000; 0 and the padded last tile's
    1002); the earlier column wins, as numpy's arg-max says, and the later comes next."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(1003, 64, generator=g) * 0.1
    x = torch.rand(2, 64, generator=g) + 0.5
    top = torch.ones(64) * 3
    weight[pair[0]] = weight[pair[1]] = top
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, run in _gemvs(weight):
            y, best = run(x)
            assert float(y[0, pair[0]]) == float(y[0, pair[1]]) == float(y[0].max()), name
            assert best[:, :2].tolist() == [list(pair), list(pair)], name
            assert best.tolist() == _numpys_order(y), name
    finally:
        torch.set_num_threads(saved)


@needs_vnni
def test_a_nan_logit_is_not_kept() -> None:
    weight = torch.randn(40, 64)
    x = torch.randn(2, 64)
    scale = weight.abs().amax(-1) / 127
    scale[17] = float("nan")
    packed = I8I8Weight(torch.round(weight / (weight.abs().amax(-1) / 127)[:, None])
                        .to(torch.int8), scale)  # fmt: skip
    best = torch.zeros(2, QK_TOP, dtype=torch.int64)
    y = i8i8_gemv(x, packed, best=best)
    assert bool(y[:, 17].isnan().all()) and best.tolist() == [[-1] * QK_TOP] * 2
    with pytest.raises(ValueError, match=rf"best: expected int64 \[2, {QK_TOP}\]"):
        i8i8_gemv(x, packed, best=torch.zeros(2, dtype=torch.int64))


@needs_vnni
def test_fewer_finite_values_than_kept_end_the_list() -> None:
    """Rows with 3 finite logits (the other weight rows' scales -inf, their logits positive
    before) keep those 3 in order, then -1; rows whose largest is +inf keep none."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(40, 64, generator=g)
    x = torch.rand(2, 64, generator=g) + 0.5
    weight[:] = weight.abs()  # positive logits: a scale of -inf makes a logit -inf
    scale = weight.abs().amax(-1) / 127
    codes = torch.round(weight / scale[:, None]).to(torch.int8)
    scale = torch.full_like(scale, float("-inf"))
    scale[[30, 4, 11]] = torch.tensor([0.5, 0.25, 0.125])
    best = torch.zeros(2, QK_TOP, dtype=torch.int64)
    y = i8i8_gemv(x, I8I8Weight(codes, scale), best=best)
    assert int(torch.isfinite(y[0]).sum()) == 3
    assert best.tolist() == _numpys_order(y) and best[0, 3:].tolist() == [-1] * (QK_TOP - 3)
    scale[7] = float("inf")
    y = i8i8_gemv(x, I8I8Weight(codes, scale), best=best)
    assert best.tolist() == [[-1] * QK_TOP] * 2


def test_kept_only_for_the_very_logits_the_head_wrote() -> None:
    logits = torch.randn(2, 50)
    true = logits.argmax(-1).tolist()
    kept = torch.tensor([[4, 8, -1], [9, 2, 3]])  # not the true ones: shows which are read
    keep(logits, kept)
    assert kept_argmax(logits) == [4, 9]
    assert kept_best(logits) == kept.tolist()
    assert kept_argmax(logits.view(2, 1, 50)[:, -1]) == [4, 9]  # the decode loop's view
    assert greedy_tokens(logits).tolist() == [4, 9]
    assert kept_argmax(logits.clone()) is None  # a copy
    assert kept_argmax(logits[:1]) is None  # part of it
    assert kept_argmax(logits[:, :25]) is None
    logits.mul_(1.0)  # written in place since: the version moved
    assert kept_argmax(logits) is None
    assert greedy_tokens(logits).tolist() == true
    other = keep(torch.randn(2, 50), torch.tensor([[3, 1], [-1, -1]]))  # a row not kept
    assert kept_argmax(other) is None and kept_best(other) is None


@needs_vnni
def test_the_heads_keep_their_argmax_and_the_sampler_takes_it() -> None:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 64, generator=g)
    x = torch.randn(3, 1, 64, generator=g)
    for head in (CastHead(weight, torch.int8), Int6Head(weight)):
        logits = head(x)[:, -1]
        kept = kept_argmax(logits)
        assert kept is not None and kept == logits.numpy().argmax(-1).tolist()
        assert kept_best(logits) == _numpys_order(logits)
        assert greedy_tokens(logits).tolist() == kept
        assert np.array_equal(greedy_tokens(logits.clone()).numpy(), np.asarray(kept))


def test_a_processor_that_may_write_its_input_drops_the_kept_argmax() -> None:
    """Inference tensors keep no version counter: `apply_processors` drops the kept arg-max
    before any processor not marked `keeps_logits`, and keeps it through those marked."""

    class Bump:  # writes its input in place (a user's processor may)
        def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            logits[:, 5] = 100.0
            return logits

    ids = torch.zeros(1, 2, dtype=torch.int64)
    with torch.inference_mode():
        logits = keep(torch.randn(1, 20), torch.tensor([[3]]))
        assert kept_argmax(logits) == [3]
        same = apply_processors([RepetitionPenalty(1.0)], ids, logits)  # marked: kept
        assert same is logits and kept_argmax(same) == [3]
        out = apply_processors([Bump()], ids, logits)
        assert kept_argmax(out) is None and greedy_tokens(out).tolist() == [5]


@needs_vnni
def test_a_head_under_a_final_soft_cap_keeps_no_argmax(tmp_path) -> None:
    """Gemma 2 caps the logits in place after the head: the int8 head keeps nothing there,
    and greedy decoding reads the capped row."""
    path = make_family_model("gemma2", tmp_path)
    config = json.loads((path / "config.json").read_text())
    model = build_model(config, load_file(path / "model.safetensors"))
    assert model.config.final_softcap is not None
    set_head_dtype(model, torch.int8)
    assert not model.lm_head.keeps_argmax
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 5, 9]]), last_only=True)[:, -1]
    assert kept_argmax(logits) is None
    plain = build_model(json.loads((path / "config.json").read_text()) | {
        "final_logit_softcapping": None}, load_file(path / "model.safetensors"))  # fmt: skip
    set_head_dtype(plain, torch.int8)
    assert plain.lm_head.keeps_argmax
    with torch.inference_mode():
        logits = plain(torch.tensor([[1, 5, 9]]), last_only=True)[:, -1]
    assert kept_argmax(logits) == logits.numpy().argmax(-1).tolist()
