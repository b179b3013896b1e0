"""Decode (stage 1 + stage 2) against the float64 reference of the same quantized cache."""

import math
from pathlib import Path

import pytest
import torch

from conftest import (ODD_FORMATS, PRESETS, KernelRecorder, check_decode, codebook_kwargs, make_config, planes_config,
                      planes_config_of, skip_a_launch_the_interpreter_already_ran, stored_cache)
from tqgen import config as config_mod, layout, render, tuner
from tqgen.layout import Layout
from tqgen.testing import relative_error


def _decode_inputs(module, config, seq_lens, device, query_seed, cache_seed=0):
    """A filled cache over 2 KV heads, a query of 8 heads, and the module's codebook arguments."""
    batch, cache = stored_cache(module, config, seq_lens, device, seed=cache_seed)
    generator = torch.Generator().manual_seed(query_seed)
    query = torch.randn(len(seq_lens), 8, config.head_dim, generator=generator).to(device)
    return batch, cache, query, codebook_kwargs(module, config, device)


@pytest.mark.parametrize("cache_layout", ["slots", "planes"])
@pytest.mark.parametrize("preset,head_dim", [(p, 128) for p in sorted(PRESETS)]
                         + [("k3v4", 96), ("k8v4", 96), ("k4v4", 64), ("k3v3", 64)])
def test_presets_and_head_dims(device, build_module, preset, head_dim, cache_layout):
    config = make_config(preset, head_dim=head_dim, cache_layout=cache_layout)
    check_decode(build_module(config), config, device, [1, 15, 17, 300, 0])


@pytest.mark.parametrize("fields,head_dim,cache_layout", [
    (dict(key_format="mse", key_bits=2, value_bits=2), 128, "slots"),
    (dict(key_format="mse", key_bits=4, value_bits=8), 128, "slots"),
    (dict(key_format="fp8", value_bits=8), 96, "slots"),
    (dict(key_format="mse", key_bits=3, value_bits=2), 64, "slots"),
    # head_dim / 8 odd with 3-bit codes: fields at odd bytes, so the byte-load path.
    (dict(key_format="mse", key_bits=3, value_bits=4), 72, "slots"),
    (dict(key_format="mse", key_bits=4, value_bits=3), 72, "slots"),
    (dict(key_format="mse", key_bits=2, value_bits=2), 64, "planes"),
    (dict(key_format="mse", key_bits=4, value_bits=8), 64, "planes"),
    (dict(key_format="fp8", value_bits=3), 64, "planes"),
])
def test_other_bit_widths_and_load_paths(device, build_module, fields, head_dim, cache_layout):
    config = config_mod.resolve_arch(config_mod.from_mapping(dict(fields, head_dim=head_dim,
                                                                  cache_layout=cache_layout), "<test>"))
    module = build_module(config)
    if cache_layout == "slots":
        aligned = layout.Layout.from_config(config).halfword_aligned
        assert aligned == (head_dim != 72)
        assert ("_load_u16(" in Path(module.__file__).read_text()) == aligned  # the templates follow the layout
    seq_lens = [1, 17, 40] if cache_layout == "slots" else [9, 40]
    check_decode(module, config, device, seq_lens)


def test_byte_load_layouts_accept_a_cache_at_an_odd_address(device, build_module):
    """head_dim 72 with 3-bit keys puts fields at odd bytes: byte loads, so any address works."""
    config = config_mod.resolve_arch(config_mod.from_mapping(
        dict(key_format="mse", key_bits=3, value_bits=4, head_dim=72), "<test>"))
    module = build_module(config)
    batch, cache, query, kwargs = _decode_inputs(module, config, [5, 33], device, query_seed=1)
    odd = torch.zeros(cache.numel() + 1, dtype=torch.uint8, device=device)[1:].view(cache.shape)
    odd.copy_(cache)
    assert odd.data_ptr() % 2 == 1
    expected = module.decode(query, cache, batch.block_table, batch.seq_lens, **kwargs)
    torch.testing.assert_close(module.decode(query, odd, batch.block_table, batch.seq_lens, **kwargs), expected,
                               rtol=0, atol=0)


@pytest.mark.parametrize("group_size", [1, 4, 6, 8, 16])
def test_gqa_group_sizes(device, build_module, group_size):
    config = make_config("k3v4")
    check_decode(build_module(config), config, device, [33, 70], group_size=group_size, num_kv_heads=2)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_splits_and_page_sizes_on_ragged_batches(device, build_module, block_size, num_splits):
    config = make_config("k4v4", block_size=block_size)
    page = block_size
    check_decode(build_module(config), config, device, [1, page - 1, page + 1, 130, 0],
                  num_splits=num_splits)


TUNER_SPACE = tuner.SearchSpace()  # every launch `tqgen tune` can pick by default (splits vary elsewhere)


TUNER_LAUNCHES = sorted({(c["block_kv"], c["num_warps"], c["num_stages"]) for c in TUNER_SPACE.candidates()}
                        | {(128, 8, 2)})


@pytest.mark.parametrize("preset", ["k3v3", "k8v4"])
@pytest.mark.parametrize("block_kv,num_warps,num_stages", TUNER_LAUNCHES)
def test_launch_parameters_the_tuner_can_pick(device, build_module, preset, block_kv, num_warps, num_stages):
    skip_a_launch_the_interpreter_already_ran(device, (block_kv, num_warps, num_stages), TUNER_LAUNCHES)
    config = make_config(preset)
    check_decode(build_module(config), config, device, [5, 200], block_kv=block_kv, num_warps=num_warps,
                  num_stages=num_stages, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_queries_and_outputs(device, build_module, dtype):
    config = make_config("k8v4")
    check_decode(build_module(config), config, device, [40, 9], dtype=dtype)


def test_fp8_keys_portable_decode_path(device, build_module):
    """sm80's bit-manipulation fp8 decode is correct on any device."""
    config = make_config("k8v4", arch="sm80")
    check_decode(build_module(config), config, device, [50, 3])


@pytest.mark.parametrize("preset", ["k3v4", "k8v4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_query_of_any_float_dtype_and_strides(device, build_module, preset, dtype):
    """The query is read by Triton (stage 1 scales it for fp8 keys, tq_prepare_query rotates it for
    MSE keys), strides and all; the fp8 path once read a strided head dim as contiguous."""
    config = make_config(preset)
    check_decode(build_module(config), config, device, [40, 9, 17], dtype=dtype, strided_query=True)


def test_seq_len_zero_gives_zeros(device, build_module):
    config = make_config("k3v4")
    out = check_decode(build_module(config), config, device, [0, 20, 0], num_splits=4)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0) and not torch.all(out[1] == 0)


def test_one_split_and_many_splits_agree(device, build_module):
    config = make_config("k3v4")
    module = build_module(config)
    batch, cache, query, kwargs = _decode_inputs(module, config, [100, 257], device, query_seed=5)
    one = module.decode(query, cache, batch.block_table, batch.seq_lens, num_splits=1, **kwargs)
    many = module.decode(query, cache, batch.block_table, batch.seq_lens, num_splits=7, **kwargs)
    # Not bit-equal: probabilities enter P @ V as fp16 relative to each split's own
    # running max, so their rounding differs with the split layout (~1e-4).
    assert relative_error(many, one) < 1e-3


def test_gqa_equals_heads_expanded(device, build_module):
    """Group size 4 over 2 KV heads == group size 1 over the KV heads repeated 4 times, on the tl.dot stage 1
    (2 warps). The Gluon stage 1 is checked against the reference at each group size (test_decode_mma): its
    lazy running max moves for all of a program's query heads at once, so the two groupings round their fp16
    probabilities against different maxima and agree only to that rounding."""
    config = make_config("k4v4")
    module = build_module(config)
    batch, cache, query, kwargs = _decode_inputs(module, config, [37, 90], device, query_seed=6)
    expanded = cache.repeat_interleave(4, dim=2).contiguous()
    launch = dict(num_splits=2, block_kv=32, num_warps=2, num_stages=1)
    grouped = module.decode(query, cache, batch.block_table, batch.seq_lens, **launch, **kwargs)
    mha = module.decode(query, expanded, batch.block_table, batch.seq_lens, **launch, **kwargs)
    assert relative_error(mha, grouped) < 1e-5


def test_page_size_one_equals_page_size_sixteen(device, build_module):
    """The same tokens in pages of 1 and of 16, decoded with one launch on the tl.dot stage 1 (2 warps: the same
    tiles and splits): where a token's page is must not change the result. (The Gluon stage 1 takes pages of 1
    in launches of one stage, without a ring: test_decode_mma checks it at small pages.)"""
    small, large = make_config("k3v3", block_size=1), make_config("k3v3", block_size=16)
    outputs = []
    for config in (small, large):
        module = build_module(config)
        batch, cache, query, kwargs = _decode_inputs(module, config, [45, 18], device, query_seed=9, cache_seed=9)
        outputs.append(module.decode(query, cache, batch.block_table, batch.seq_lens, num_splits=2, block_kv=32,
                                     num_warps=2, num_stages=1, **kwargs))
    assert relative_error(outputs[0], outputs[1]) < 1e-6


def test_workspace_and_out_buffers(device, build_module):
    config = make_config("k3v4")
    module = build_module(config)
    batch, cache, query, kwargs = _decode_inputs(module, config, [30, 64], device, query_seed=4)
    workspace = module.DecodeWorkspace(max_batch=4, num_q_heads=8, max_splits=8, device=device)
    out = torch.full((2, 8, 128), float("nan"), device=device)
    result = module.decode(query, cache, batch.block_table, batch.seq_lens, out=out, workspace=workspace,
                           num_splits=3, **kwargs)
    assert result is out
    plain = module.decode(query, cache, batch.block_table, batch.seq_lens, num_splits=3, **kwargs)
    assert relative_error(out, plain) < 1e-6


def test_decode_rejects_bad_arguments(device, build_module):
    config = make_config("k3v4")
    module = build_module(config)
    batch, cache = stored_cache(module, config, [20, 5], device)
    query = torch.randn(2, 8, 128, device=device)
    table, lens = batch.block_table, batch.seq_lens
    cases = [
        (dict(query=query.to(torch.int32)), "query must be"),
        (dict(query=torch.randn(2, 7, 128, device=device)), "not a multiple"),
        (dict(query=torch.randn(2, 8, 96, device=device)), "head_dim 96"),
        (dict(kv_cache=cache[..., :-2]), "slots are 116 bytes"),
        (dict(block_table=table.to(torch.int64)), "block_table must be int32"),
        (dict(seq_lens=lens[:1]), "seq_lens has 1 entries"),
        (dict(seq_lens=lens + 1000), "block_table holds"),
        (dict(block_table=table.clone().fill_(cache.shape[0])), "refers to block"),
        (dict(block_kv=16), "block_kv must be"),
    ]
    args = dict(query=query, kv_cache=cache, block_table=table, seq_lens=lens)
    for override, message in cases:
        call = dict(args, **override)
        with pytest.raises(module.LaunchError, match=message):
            module.decode(call.pop("query"), call.pop("kv_cache"), call.pop("block_table"), call.pop("seq_lens"),
                          **call)


def test_empty_batch(device, build_module):
    config = make_config("k8v4")
    module = build_module(config)
    cache = module.make_cache(2, 2, device)
    out = module.decode(torch.zeros(0, 4, 128, device=device), cache,
                        torch.zeros(0, 1, dtype=torch.int32, device=device),
                        torch.zeros(0, dtype=torch.int32, device=device))
    assert out.shape == (0, 4, 128)


# --- the page-planar layout ("planes") ---------------------------------------------------------
@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k8v4", "planes"), ("k3v4", "slots"), ("k8v4", "slots")])
def test_who_prepares_the_query(preset, layout):
    """Both layouts prepare the query in Triton and no torch op runs before stage 1. Stage 1 scales
    it for fp8 keys; for MSE keys in the planes layout it also rotates it (a Walsh-Hadamard
    transform) when the rotation is the config's Hadamard, and tq_prepare_query does the rest."""
    config = make_config(preset, cache_layout=layout)
    source = render.render(config)
    decode = source.split("\ndef decode(")[1].split("\ndef ")[0]
    stage1_arguments = source.split("def tq_decode_stage1(")[1].split("):")[0]
    assert ("def tq_prepare_query(" in source) == (preset == "k3v4")
    assert "query.to(torch.float32)" not in decode  # the torch ops that ran before stage 1
    rotates = preset == "k3v4"  # MSE keys under the Hadamard rotation at head_dim 128, both layouts
    assert ("score_scale," in stage1_arguments) == (preset == "k8v4" or rotates)
    assert ("ROTATE_QUERY" in stage1_arguments) == rotates


@pytest.mark.parametrize("preset,head_dim", [("k8v4", 128), ("k3v4", 128), ("k3v4", 96), ("k4v4", 72), ("k4v4", 256)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_reads_a_query_of_any_float_dtype_and_strides(device, build_module, preset, head_dim, dtype):
    """Modules read the caller's query in Triton (stage 1 scales it for fp8 keys;
    tq_prepare_query rotates it for MSE keys, 16 rows x 16 head dims per program, so 24 rows
    leave a partial row block, 96 and 72 head dims a masked inner step and 72 a partial column block)."""
    config = planes_config(preset, head_dim)
    check_decode(build_module(config), config, device, [40, 9, 17], dtype=dtype, strided_query=True)


@pytest.mark.parametrize("rotation,batch,dtype", [("default", "small", torch.float32), ("default", "small", torch.bfloat16),
                                                 ("default", "large", torch.float32), ("copy", "small", torch.float32),
                                                 ("random", "small", torch.float32)])
def test_decode_rotates_the_query_in_stage1_or_in_its_own_kernel(device, build_module, rotation, batch, dtype,
                                                                 monkeypatch):
    """Up to _ROTATE_QUERY_MAX_BATCH sequences the default rotation (the very tensor
    default_rotation returns) is applied by stage 1's Walsh-Hadamard transform; a larger batch or
    any other tensor, even an equal copy, takes tq_prepare_query. Each matches the reference, and
    the two paths agree to the fp16 rounding of the prepared query."""
    config = planes_config("k3v4", 128)
    module = build_module(config)
    limit = module._ROTATE_QUERY_MAX_BATCH
    seq_lens = [40, 9, 17][:limit] if batch == "small" else [9, 1, 17] * (limit // 3 + 1)
    assert (len(seq_lens) <= limit) == (batch == "small")
    kwargs = codebook_kwargs(module, config, device)
    if rotation == "copy":
        kwargs["rotation"] = kwargs["rotation"].clone()
    elif rotation == "random":
        kwargs["rotation"] = torch.linalg.qr(torch.randn(128, 128, generator=torch.Generator().manual_seed(7)))[0].to(device)
    prepare = KernelRecorder(module.tq_prepare_query)
    monkeypatch.setattr(module, "tq_prepare_query", prepare)
    out = check_decode(module, config, device, seq_lens, dtype=dtype, codebook=kwargs, strided_query=True)
    assert len(prepare.launches) == (0 if rotation == "default" and batch == "small" else 1)
    if rotation == "copy":
        kwargs["rotation"] = module.default_rotation(device)
        in_stage1 = check_decode(module, config, device, seq_lens, codebook=kwargs, strided_query=True)
        assert relative_error(in_stage1, out) < 5e-4


@pytest.mark.parametrize("rotate_query,batch", [(True, "large"), (False, "small")])
def test_rotate_query_overrides_the_batch_rule(device, build_module, rotate_query, batch, monkeypatch):
    """decode's rotate_query (what the tuner times both ways) forces the choice: stage 1 rotates the query above
    _ROTATE_QUERY_MAX_BATCH sequences too, or tq_prepare_query runs below it; either matches the reference."""
    config = planes_config("k3v4", 128)
    module = build_module(config)
    limit = module._ROTATE_QUERY_MAX_BATCH
    seq_lens = [40, 9, 17] if batch == "small" else [9, 1, 17] * (limit // 3 + 1)
    assert (len(seq_lens) <= limit) == (batch == "small")
    prepare = KernelRecorder(module.tq_prepare_query)
    monkeypatch.setattr(module, "tq_prepare_query", prepare)
    check_decode(module, config, device, seq_lens, rotate_query=rotate_query)
    assert len(prepare.launches) == (0 if rotate_query else 1)


@pytest.mark.parametrize("rotate_query", [True, False])
def test_slots_stage1_rotates_the_query_itself(device, build_module, monkeypatch, rotate_query):
    """A slots MSE module's stage 1 (the tl.dot kernel in the interpreter, the Gluon one on a GPU) rotates the
    caller's query itself where rotate_query (no tq_prepare_query), as planes does, and both ways match the
    reference of the same cache."""
    config = make_config("k3v4", cache_layout="slots")
    module = build_module(config)
    assert "ROTATE_QUERY" in module.tq_decode_stage1.arg_names
    prepare = KernelRecorder(module.tq_prepare_query)
    monkeypatch.setattr(module, "tq_prepare_query", prepare)
    check_decode(module, config, device, [40, 9, 17], strided_query=True, rotate_query=rotate_query)
    assert len(prepare.launches) == (0 if rotate_query else 1)


def test_rotate_query_needs_the_configs_own_rotation(device, build_module):
    config = planes_config("k3v4", 128)
    module = build_module(config)
    kwargs = codebook_kwargs(module, config, device)
    kwargs["rotation"] = kwargs["rotation"].clone()  # equal values, another tensor: tq_prepare_query's to apply
    with pytest.raises(module.LaunchError, match=r"rotate_query=True needs the config's own rotation"):
        check_decode(module, config, device, [5], codebook=kwargs, rotate_query=True)
    check_decode(module, config, device, [5], codebook=kwargs, rotate_query=False)


@pytest.mark.parametrize("layout", ["slots", "planes"])
def test_stage2_ignores_what_empty_splits_left_in_the_workspace(device, build_module, layout):
    """Stage 2 (both layouts) loads every split's partial output before it knows which splits are
    empty; an empty split's output is whatever the workspace held (NaN here) and must not leak."""
    config = make_config("k3v4", cache_layout=layout)
    module = build_module(config)
    workspace = module.DecodeWorkspace(max_batch=3, num_q_heads=8, max_splits=16, device=device)
    workspace.partial_out.fill_(float("nan"))
    out = check_decode(module, config, device, [5, 0, 70], workspace=workspace, num_splits=16)
    assert (out[1] == 0).all()


@pytest.mark.parametrize("key_bits", [2, 3, 4])
def test_decode_with_an_unsorted_asymmetric_codebook(device, build_module, key_bits):
    """The register byte tables come from the centroids passed, whatever their order and signs
    (the default codebook is sorted and symmetric): decode with a shuffled one. The store
    needs sorted centroids (stored_cache passes validate=False for these), so these codes
    quantize badly; decode must still look up exactly the entries the reference does."""
    config = planes_config("k4v4", key_bits=key_bits)
    module = build_module(config)
    generator = torch.Generator().manual_seed(key_bits)
    count = 2 ** key_bits
    centroids = (torch.randn(count, generator=generator) * 0.3 / math.sqrt(128))[torch.randperm(count, generator=generator)]
    centroids[count // 2] = 0.0
    codebook = dict(rotation=module.default_rotation(device), centroids=centroids.to(device))
    check_decode(module, config, device, [5, 40], seed=key_bits, codebook=codebook)


@pytest.mark.parametrize("spec", ODD_FORMATS, ids=str)
def test_decode_with_records_not_multiples_of_16_bytes(device, build_module, spec):
    config = planes_config_of(spec)
    check_decode(build_module(config), config, device, [1, 23, 70])


# Every launch `tqgen tune` can pick by default, plus the stage counts of the heuristic.
LAUNCH_GRID = sorted({(c["block_kv"], c["num_warps"], c["num_stages"]) for c in tuner.SearchSpace().candidates()}
                     | {(32, 1, 2), (64, 2, 3)})


@pytest.mark.parametrize("preset", ["k3v4", "k8v4"])
@pytest.mark.parametrize("block_kv,num_warps,num_stages", LAUNCH_GRID)
def test_launch_parameters(device, build_module, preset, block_kv, num_warps, num_stages):
    skip_a_launch_the_interpreter_already_ran(device, (block_kv, num_warps, num_stages), LAUNCH_GRID)
    config = planes_config(preset)
    check_decode(build_module(config), config, device, [5, 200], block_kv=block_kv, num_warps=num_warps,
                  num_stages=num_stages, num_splits=3)


@pytest.mark.parametrize("block_kv,num_warps,num_stages", LAUNCH_GRID)
def test_launch_parameters_with_the_query_from_tq_prepare_query(device, build_module, block_kv, num_warps, num_stages):
    """The same launches over stage 1's other specialization (ROTATE_QUERY off, the query from
    tq_prepare_query), which batches above _ROTATE_QUERY_MAX_BATCH take: forced here by a copy of
    the default rotation."""
    skip_a_launch_the_interpreter_already_ran(device, (block_kv, num_warps, num_stages), LAUNCH_GRID)
    config = planes_config("k3v4")
    module = build_module(config)
    codebook = codebook_kwargs(module, config, device)
    codebook["rotation"] = codebook["rotation"].clone()
    check_decode(module, config, device, [5, 200], codebook=codebook, block_kv=block_kv, num_warps=num_warps,
                  num_stages=num_stages, num_splits=3)


@pytest.mark.parametrize("block_size", [8, 64])
def test_page_sizes(device, build_module, block_size):
    config = planes_config("k3v4", block_size=block_size)
    check_decode(build_module(config), config, device, [1, block_size - 1, block_size + 1, 130],
                  num_splits=2)
