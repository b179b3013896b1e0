"""The page-planar cache layout (`cache_layout: planes`): byte positions, store, decode, dequantize.

The "planes" cache holds the same bytes per token as the seed's "slots" cache,
transposed record by record within each KV head's page (tqgen/layout.py). The
tests pin the byte positions by hand, check that the kernels agree with the
reference byte for byte (store) or within the usual tolerances (decode,
dequantize), and that a planes cache is the slots cache re-laid out (with norm-corrected
key norms where the config corrects them: layout.key_norm_corrected).
"""

import math

import pytest
import torch

from conftest import PRESETS, KernelRecorder, check_decode, codebook_kwargs, make_config, stored_cache
from tqgen import config as config_mod, reference, render, tune
from tqgen.errors import ConfigError
from tqgen.layout import SPLIT_HIGH_ORDER, SPLIT_LOW_ORDER, Layout, row_alignment
from tqgen.testing import paged_batch, relative_error
from tqgen.verify import DECODE_TOLERANCE, DEQUANT_TOLERANCE, store_differences

SENTINEL = 0xA5


def planes_config(preset, head_dim=128, **overrides):
    return make_config(preset, head_dim=head_dim, cache_layout="planes", **overrides)


# --- layout ------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("page", [8, 16, 64])
def test_planes_tile_the_page_and_start_16_byte_aligned(preset, head_dim, page):
    layout = Layout.from_config(planes_config(preset, head_dim, block_size=page))
    position = 0
    for _name, start, size in layout.records():
        assert layout.plane_offset(start) == position and position % 16 == 0
        position += page * size
    assert position == layout.page_bytes == page * layout.slot_bytes


def test_k3v4_byte_positions_by_hand():
    """k3v4, head_dim 128, page 16: planes at 0 (key codes, 48 B/token), 768 (norms), 800 (value
    codes, 64 B/token), 1824 (scale+zero, 4 B/token); 1888 bytes per page and head."""
    layout = Layout.from_config(planes_config("k3v4"))
    constants = layout.constants()
    assert (constants["KEY_CODE_PLANE"], constants["KEY_NORM_PLANE"], constants["VALUE_CODE_PLANE"],
            constants["VALUE_SCALE_PLANE"], constants["PAGE_BYTES"]) == (0, 768, 800, 1824, 1888)
    assert constants["KEY_HIGH_BITS_AT"] == 32
    slots = torch.zeros(1, 16, 1, layout.slot_bytes, dtype=torch.uint8)
    slots[0, 3, 0, 48:50] = torch.tensor([0x12, 0x34])  # token 3's key norm
    slots[0, 5, 0, 116:118] = torch.tensor([0x56, 0x78])  # token 5's value zero
    slots[0, 2, 0, 50 + 7] = 0x9A  # token 2's value code byte 7
    pages = reference.slots_to_pages(layout, slots)
    assert pages.shape == (1, 1, 1888)
    assert pages[0, 0, 768 + 3 * 2: 768 + 3 * 2 + 2].tolist() == [0x12, 0x34]
    assert pages[0, 0, 1824 + 5 * 4 + 2: 1824 + 5 * 4 + 4].tolist() == [0x56, 0x78]
    assert pages[0, 0, 800 + 2 * 64 + 7] == 0x9A
    assert int(pages.count_nonzero()) == 5


def test_3bit_codes_split_into_low_and_high_streams():
    """A 3-bit record: one 16-bit word of low bits per group of 8 codes (code k at bit
    4(k % 4) + 2(k // 4)), then one byte of high bits per group (code k at bit 4(k % 2) + k // 2)."""
    layout = Layout.from_config(planes_config("k3v3"))
    codes = torch.arange(128) % 8  # 0, 1, ..., 7, 0, ...
    slots = torch.zeros(1, 16, 1, layout.slot_bytes, dtype=torch.uint8)
    slots[0, 0, 0, :48] = reference.pack_codes(codes, 3)
    record = reference.slots_to_pages(layout, slots)[0, 0, :48]
    # Low bits of codes 0..7 are 0,1,2,3,0,1,2,3: byte 0 holds codes 0,4,1,5 (0,0,1,1) and byte 1
    # codes 2,6,3,7 (2,2,3,3). High bits 0,0,0,0,1,1,1,1 in the order 0,2,4,6,1,3,5,7: 0b11001100.
    assert torch.all(record[:32:2] == 0b01010000) and torch.all(record[1:32:2] == 0b11111010)
    assert torch.all(record[32:] == 0b11001100)


def test_split_3bit_word_bits_match_the_orders_and_the_store():
    """group_word_bit (decode's selectors, code_of) is a bijection onto the 24 bits of a group,
    and agrees with SPLIT_*_ORDER and with the store's pack formulas (codes.jinja)."""
    layout = Layout.from_config(planes_config("k3v4"))
    positions = [layout.group_word_bit(3, code, bit) for code in range(8) for bit in range(3)]
    assert sorted(positions) == list(range(24))
    for code in range(8):
        assert layout.group_word_bit(3, code, 0) == 2 * SPLIT_LOW_ORDER.index(code) == code % 4 * 4 + code // 4 * 2
        assert layout.group_word_bit(3, code, 1) == layout.group_word_bit(3, code, 0) + 1
        assert layout.group_word_bit(3, code, 2) == 16 + SPLIT_HIGH_ORDER.index(code) == 16 + code % 2 * 4 + code // 2


@pytest.mark.parametrize("layout_name", ["slots", "planes"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_nibble_selectors_hold_each_code_in_its_nibble(layout_name, bits):
    """The rendered selector expressions, evaluated in int32 like the kernel: nibble k of the
    selector for codes first..first+3 is code first+k of the group word."""
    import numpy as np

    layout = Layout.from_config(make_config("k3v4" if bits == 3 else "k4v4", key_bits=bits,
                                            cache_layout=layout_name))
    generator = np.random.default_rng(bits)
    words = generator.integers(0, 1 << (8 * bits), size=4096, dtype=np.int64)
    if layout.split_high_bits(bits):
        words = words & 0xFFFFFF
    word = words.astype(np.uint32).view(np.int32)  # the kernel's int32 words (sign bit included)
    for first in (0, 4):
        selector = eval(render.nibble_selector(layout, bits, "word", first), {"word": word}).astype(np.int64)
        for k in range(4):
            code = sum(((words >> layout.group_word_bit(bits, first + k, bit)) & 1) << bit for bit in range(bits))
            assert np.array_equal((selector >> (4 * k)) & 0xF, code), (first, k)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_slots_to_pages_round_trips_both_ways(preset):
    """Exact inverses on random bytes (3-bit streams have no pad bits: planes needs head_dim % 16 == 0 there)."""
    layout = Layout.from_config(planes_config(preset, 96, block_size=32))
    generator = torch.Generator().manual_seed(0)
    slots = torch.randint(0, 256, (3, 32, 2, layout.slot_bytes), dtype=torch.uint8, generator=generator)
    pages = torch.randint(0, 256, (3, 2, layout.page_bytes), dtype=torch.uint8, generator=generator)
    assert torch.equal(reference.pages_to_slots(layout, reference.slots_to_pages(layout, slots)), slots)
    assert torch.equal(reference.slots_to_pages(layout, reference.pages_to_slots(layout, pages)), pages)
    with pytest.raises(ValueError, match="slots of a 32-token page"):
        reference.slots_to_pages(layout, slots[:, :16])
    with pytest.raises(ValueError, match=f"pages of {layout.page_bytes} bytes"):
        reference.pages_to_slots(layout, pages[..., :-16])


@pytest.mark.parametrize("fields", [dict(key_format="mse", key_bits=4, value_bits=8, head_dim=72, block_size=8),
                                    dict(key_format="mse", key_bits=2, value_bits=2, head_dim=88),
                                    dict(key_format="fp8", value_bits=3, head_dim=80, block_size=64),
                                    dict(key_format="mse", key_bits=3, value_bits=4, head_dim=256)])
def test_every_field_access_is_aligned_as_the_kernels_hint(fields):
    """The kernels hint each record row as row_alignment(record bytes)-aligned (tl.multiple_of, which the
    interpreter ignores): true for every token of every plane, given 16-byte aligned pages."""
    layout = Layout.from_config(config_mod.from_mapping(dict(fields, cache_layout="planes")))
    for _name, start, size in layout.records():
        alignment = row_alignment(size)
        assert alignment == math.gcd(16, size)
        for pos in range(layout.page_size):
            assert (layout.plane_offset(start) + pos * size) % alignment == 0
    if layout.split_high_bits(layout.key_bits):
        assert layout.high_bits_offset % row_alignment(layout.key_code_bytes) == 0


def test_config_refuses_planes_it_cannot_align():
    with pytest.raises(ConfigError, match="block_size.*at least 8 tokens"):
        config_mod.from_mapping(dict(key_format="fp8", value_bits=4, head_dim=128, block_size=4,
                                     cache_layout="planes"))
    with pytest.raises(ConfigError, match="head_dim.*multiple of 16"):
        config_mod.from_mapping(dict(key_format="mse", key_bits=3, value_bits=4, head_dim=72,
                                     cache_layout="planes"))
    with pytest.raises(ConfigError, match="cache_layout.*slots or planes"):
        config_mod.from_mapping(dict(key_format="fp8", value_bits=4, head_dim=128, cache_layout="paged"))


def test_slots_configs_keep_their_hash_and_planes_configs_get_their_own():
    fields = dict(key_format="mse", key_bits=3, value_bits=4, head_dim=128)
    implicit = config_mod.from_mapping(fields)
    explicit = config_mod.from_mapping(dict(fields, cache_layout="slots"))
    planes = config_mod.from_mapping(dict(fields, cache_layout="planes"))
    assert implicit.hash() == explicit.hash() and "cache_layout" not in implicit.canonical_json()
    assert planes.hash() != implicit.hash()
    assert "_planes_" in planes.artifact_name() and "planes" not in implicit.artifact_name()


@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k8v4", "planes"), ("k3v4", "slots"), ("k8v4", "slots")])
def test_who_prepares_the_query(preset, layout):
    """Both layouts prepare the query in Triton and no torch op runs before stage 1. Stage 1 scales
    it for fp8 keys; for MSE keys in the planes layout it also rotates it (a Walsh-Hadamard
    transform) when the rotation is the config's Hadamard, and tq_prepare_query does the rest."""
    source = render.render(make_config(preset, cache_layout=layout))
    decode = source.split("\ndef decode(")[1].split("\ndef ")[0]
    stage1_arguments = source.split("def tq_decode_stage1(")[1].split("):")[0]
    assert ("def tq_prepare_query(" in source) == (preset == "k3v4")
    assert "query.to(torch.float32)" not in decode  # the torch ops that ran before stage 1
    assert ("score_scale," in stage1_arguments) == (preset == "k8v4" or layout == "planes")
    assert ("ROTATE_QUERY" in stage1_arguments) == (preset == "k3v4" and layout == "planes")


# --- kernels -----------------------------------------------------------------
ODD_FORMATS = [  # record sizes that are not multiples of 16 bytes: narrower loads, other hints
    dict(key_format="mse", key_bits=4, value_bits=8, head_dim=72, block_size=8),
    dict(key_format="mse", key_bits=2, value_bits=2, head_dim=88),
    dict(key_format="fp8", value_bits=4, head_dim=200),
]


def _planes_config(spec):
    if isinstance(spec, str):
        preset, head_dim = spec.split("-d")
        return planes_config(preset, int(head_dim))
    return config_mod.resolve_arch(config_mod.from_mapping(dict(spec, cache_layout="planes")))


KERNEL_FORMATS = [f"{p}-d128" for p in sorted(PRESETS)] + ["k3v4-d96", "k4v4-d64", "k3v4-d256"] + ODD_FORMATS


@pytest.mark.parametrize("spec", KERNEL_FORMATS, ids=str)
def test_store_writes_the_reference_bytes_and_nothing_else(device, build_module, spec):
    config = _planes_config(spec)
    head_dim = config.head_dim
    module = build_module(config)
    batch = paged_batch(config, [1, 15, 17, 40], num_kv_heads=2, device=device,
                        generator=torch.Generator().manual_seed(head_dim))
    kwargs = codebook_kwargs(module, config, device)
    cache = torch.full((batch.num_blocks, 2, module.PAGE_BYTES), SENTINEL, dtype=torch.uint8, device=device)
    cache[-1] = 0x5A  # a different byte in one unused block, so that a misplaced field shows in both
    initial, expected = cache.clone(), cache.clone()
    module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
    reference.store(config, batch.key, batch.value, expected, batch.slot_mapping,
                    kwargs.get("rotation"), kwargs.get("centroids"))
    differing = store_differences(config, cache, expected, batch.key, batch.slot_mapping,
                                  kwargs.get("rotation"), kwargs.get("centroids"))
    assert differing == 0, f"{differing} bytes differ"
    # Whole unused pages keep their bytes.
    unused = sorted(set(range(batch.num_blocks)) - set(batch.block_table[batch.block_table >= 0].tolist()))
    assert unused and torch.equal(cache[unused].cpu(), initial[unused].cpu())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_planes_cache_is_the_slots_cache_relaid(device, build_module, preset):
    """The same tokens stored by both layouts' modules: identical bytes but for the key norms, which
    "planes" stores norm-corrected, and a decode as close to the float64 reference (planes looks MSE
    centroids up by byte permutes, so the two kernels round differently)."""
    planes, slots = planes_config(preset), make_config(preset)
    layout = Layout.from_config(planes)
    batch, planes_cache = stored_cache(build_module(planes), planes, [20, 33], device, seed=3)
    _, slots_cache = stored_cache(build_module(slots), slots, [20, 33], device, seed=3)
    kwargs = codebook_kwargs(build_module(planes), planes, device)
    relaid = reference.pages_to_slots(layout, planes_cache.cpu())
    # The slots norm (fp16) over its centroid norm, rounded to fp16 once more: within one unit in
    # the last place of the store's fp32 quotient.
    centroids = kwargs["centroids"].cpu() if "centroids" in kwargs else None  # fp8 keys: none, and no norms
    expected = reference.corrected_key_norms(planes, slots_cache.cpu(), centroids)
    if centroids is not None:  # what the modules tell a reader of their cache
        assert build_module(planes).KEY_NORM_CORRECTED and not build_module(slots).KEY_NORM_CORRECTED
    if layout.key_norm_corrected:
        norm = slice(layout.key_norm_offset, layout.key_norm_offset + 2)
        got_bits, want_bits = (rows[..., norm].contiguous().view(torch.int16).squeeze(-1).int()
                               for rows in (relaid, expected))
        assert (got_bits - want_bits).abs().max() <= 1
        relaid[..., norm] = expected[..., norm] = 0
    assert torch.equal(relaid, expected)
    query = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(5)).to(device)
    from_planes = build_module(planes).decode(query, planes_cache, batch.block_table, batch.seq_lens, **kwargs)
    from_slots = build_module(slots).decode(query, slots_cache, batch.block_table, batch.seq_lens, **kwargs)
    want = reference.decode(planes, query, planes_cache, batch.block_table, batch.seq_lens, **kwargs)
    want_slots = reference.decode(slots, query, slots_cache, batch.block_table, batch.seq_lens, **kwargs)
    # Each kernel is about 3-6e-4 from the float64 reference of its own cache (fp16 query and centroids).
    assert relative_error(from_planes, want) < DECODE_TOLERANCE[torch.float32]
    assert relative_error(from_slots, want_slots) < DECODE_TOLERANCE[torch.float32]
    if layout.key_norm_corrected:
        # The caches round each token's norm scale to fp16 at different points (before or after the
        # division by the centroid norm): up to an ulp apart, which moves the output by 5-8e-4 here.
        assert relative_error(want, want_slots) < 1.5e-3
    else:
        assert torch.equal(want, want_slots)  # the same bytes: the same reference


def test_a_token_whose_centroids_are_all_zero_stores_the_largest_fp16_norm(device, build_module):
    """A codebook may hold 0. A key whose every coordinate codes to it has a centroid norm of 0, and
    its corrected norm would overflow fp16 (decode: 0 * inf = NaN). The store clamps it to 65504:
    the token then scores 0, and the output stays finite."""
    config = planes_config("k3v4")
    module = build_module(config)
    kwargs = codebook_kwargs(module, config, device)
    # Code 3's centroid is 0, and its bucket [-0.5, 0.25) holds every coordinate of the first key.
    kwargs["centroids"] = torch.tensor([-3.0, -2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0], device=device)
    rotation = kwargs["rotation"].cpu().double()
    unit = torch.full((128,), 128 ** -0.5, dtype=torch.float64)  # rotated: every coordinate 0.088, code 3
    key = torch.stack([(2.0 * unit @ rotation.T), torch.randn(128, generator=torch.Generator().manual_seed(1),
                                                             dtype=torch.float64)]).float()[:, None, :]
    key = key.expand(2, 2, 128).contiguous().to(device)
    value = torch.randn(2, 2, 128, generator=torch.Generator().manual_seed(2)).to(device)
    cache = module.make_cache(1, 2, device)
    expected = cache.clone()
    slots = torch.tensor([0, 1], device=device)
    module.store(key, value, cache, slots, **kwargs)
    reference.store(config, key, value, expected, slots, kwargs["rotation"], kwargs["centroids"])
    assert store_differences(config, cache, expected, key, slots, kwargs["rotation"], kwargs["centroids"]) == 0
    rows = reference.as_slots(config, cache.cpu())[0, 0]  # token 0, both heads
    layout = Layout.from_config(config)
    assert torch.all(reference.unpack_codes(rows[:, : layout.key_code_bytes], 3, 128) == 3)
    norm = rows[:, layout.key_norm_offset: layout.key_norm_offset + 2].contiguous().view(torch.float16)
    assert torch.all(norm == 65504.0)
    query = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(3)).to(device)
    block_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    seq_lens = torch.tensor([2], dtype=torch.int32, device=device)
    out = module.decode(query, cache, block_table, seq_lens, **kwargs)
    want = reference.decode(config, query, cache, block_table, seq_lens, **kwargs)
    assert torch.isfinite(out).all() and relative_error(out, want) < DECODE_TOLERANCE[torch.float32]


@pytest.mark.parametrize("preset,head_dim", [(p, 128) for p in sorted(PRESETS)]
                         + [("k3v4", 96), ("k8v4", 96), ("k4v4", 64), ("k3v3", 64)])
def test_decode_matches_reference(device, build_module, preset, head_dim):
    config = planes_config(preset, head_dim)
    check_decode(build_module(config), config, device, [1, 15, 17, 300, 0])


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
    limit = module._ROTATE_QUERY_MAX_BATCH  # 1 where the Gluon kernel takes larger batches
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
    assumes sorted centroids, so these codes quantize badly; decode must still look up
    exactly the entries the reference does."""
    config = planes_config("k4v4", key_bits=key_bits)
    module = build_module(config)
    generator = torch.Generator().manual_seed(key_bits)
    count = 2 ** key_bits
    centroids = (torch.randn(count, generator=generator) * 0.3 / math.sqrt(128))[torch.randperm(count, generator=generator)]
    centroids[count // 2] = 0.0
    codebook = dict(rotation=module.default_rotation(device), centroids=centroids.to(device))
    check_decode(module, config, device, [5, 40], seed=key_bits, codebook=codebook)


@pytest.mark.parametrize("fields", [dict(key_format="mse", key_bits=2, value_bits=2),
                                    dict(key_format="mse", key_bits=4, value_bits=8),
                                    dict(key_format="fp8", value_bits=3)])
def test_other_bit_widths(device, build_module, fields):
    config = config_mod.resolve_arch(config_mod.from_mapping(dict(fields, head_dim=64, cache_layout="planes")))
    check_decode(build_module(config), config, device, [9, 40])


@pytest.mark.parametrize("spec", ODD_FORMATS, ids=str)
def test_decode_with_records_not_multiples_of_16_bytes(device, build_module, spec):
    config = _planes_config(spec)
    check_decode(build_module(config), config, device, [1, 23, 70])


# Every launch `tqgen tune` can pick by default, plus the stage counts of the heuristic.
LAUNCH_GRID = sorted({(c["block_kv"], c["num_warps"], c["num_stages"]) for c in tune.SearchSpace().candidates()}
                     | {(32, 1, 2), (64, 2, 3)})


@pytest.mark.parametrize("preset", ["k3v4", "k8v4"])
@pytest.mark.parametrize("block_kv,num_warps,num_stages", LAUNCH_GRID)
def test_launch_parameters(device, build_module, preset, block_kv, num_warps, num_stages):
    config = planes_config(preset)
    check_decode(build_module(config), config, device, [5, 200], block_kv=block_kv, num_warps=num_warps,
                  num_stages=num_stages, num_splits=3)


@pytest.mark.parametrize("block_kv,num_warps,num_stages", LAUNCH_GRID)
def test_launch_parameters_with_the_query_from_tq_prepare_query(device, build_module, block_kv, num_warps, num_stages):
    """The same launches over stage 1's other specialization (ROTATE_QUERY off, the query from
    tq_prepare_query), which batches above _ROTATE_QUERY_MAX_BATCH take: forced here by a copy of
    the default rotation."""
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


@pytest.mark.parametrize("spec", KERNEL_FORMATS, ids=str)
def test_dequantize_matches_reference(device, build_module, spec):
    config = _planes_config(spec)
    module = build_module(config)
    batch, cache = stored_cache(module, config, [1, 17, 70, 0], device)
    kwargs = codebook_kwargs(module, config, device)
    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, dtype=torch.float32, **kwargs)
    want_keys, want_values = reference.dequantize(config, cache, batch.block_table, batch.seq_lens,
                                                  kwargs.get("rotation"), kwargs.get("centroids"))
    assert relative_error(keys, want_keys) < DEQUANT_TOLERANCE
    assert relative_error(values, want_values) < DEQUANT_TOLERANCE


# --- launch checks -----------------------------------------------------------
def test_launchers_refuse_a_cache_they_cannot_read(device, build_module):
    config = planes_config("k3v4")
    module = build_module(config)
    batch, cache = stored_cache(module, config, [5], device)
    kwargs = codebook_kwargs(module, config, device)
    query = torch.randn(1, 8, 128, device=device)
    slots_shaped = torch.zeros(cache.shape[0], 16, 2, module.SLOT_BYTES, dtype=torch.uint8, device=device)
    with pytest.raises(module.LaunchError, match=r"kv_cache must be \[num_blocks, num_kv_heads, 1888\] "
                                                 r"\(this module's cache_layout is planes"):
        module.decode(query, slots_shaped, batch.block_table, batch.seq_lens, **kwargs)
    with pytest.raises(module.LaunchError, match=r"pages are 1880 bytes \(dim 2\).*1888 bytes"):
        module.decode(query, cache[..., :1880], batch.block_table, batch.seq_lens, **kwargs)
    shifted = torch.zeros(cache.numel() + 8, dtype=torch.uint8, device=device)[8:].view(cache.shape)
    with pytest.raises(module.LaunchError, match=r"16-byte aligned address .*\(address % 16 = 8,"):
        module.store(batch.key, batch.value, shifted, batch.slot_mapping, **kwargs)
    padded = torch.zeros(cache.shape[0], 2, module.PAGE_BYTES + 8, dtype=torch.uint8, device=device)
    with pytest.raises(module.LaunchError, match="multiples of 16 bytes"):
        module.dequantize(padded[..., : module.PAGE_BYTES], batch.block_table, batch.seq_lens, **kwargs)
    strided = torch.zeros(cache.shape[0], 2, 2 * module.PAGE_BYTES, dtype=torch.uint8, device=device)[..., ::2]
    with pytest.raises(module.LaunchError, match=r"contiguous within a page \(stride\(2\) == 1\)"):
        module.decode(query, strided, batch.block_table, batch.seq_lens, **kwargs)
    assert tuple(module.make_cache(3, 2, device).shape) == (3, 2, module.PAGE_BYTES)


def test_a_slots_module_names_its_layout_for_a_planes_cache(device, build_module):
    slots = make_config("k8v4")
    module = build_module(slots)
    planes_cache = torch.zeros(4, 2, 16 * module.SLOT_BYTES, dtype=torch.uint8, device=device)
    table, lens = torch.zeros(1, 1, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(module.LaunchError, match=r"kv_cache must be \[num_blocks, 16, num_kv_heads, 196\] "
                                                 r"\(this module's cache_layout is slots\)"):
        module.dequantize(planes_cache, table, lens)
