"""The store kernel: byte-exact against the reference (MSE key codes of coordinates on a decision
boundary excepted: tqgen.testing.store_differences), and nothing written outside its slots."""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from conftest import (HAS_CUDA, KERNEL_FORMATS, PRESETS, KernelRecorder, codebook_kwargs, make_config,
                      offline_compile_reports, planes_config, planes_config_of, stored_cache)
import tqgen
from tqgen import codebook, config as config_mod, reference
from tqgen.layout import Layout
from tqgen.plan import Plan
from tqgen.testing import DECODE_TOLERANCE, as_position_major, paged_batch, relative_error, store_differences

SENTINEL = 0xA5
REPO = Path(__file__).resolve().parent.parent


def _store_both(module, config, batch, device, num_kv_heads):
    kwargs = codebook_kwargs(module, config, device)
    cache = module.make_cache(batch.num_blocks, num_kv_heads, device).fill_(SENTINEL)  # either layout
    expected = cache.clone()
    module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
    reference.store(Layout.from_config(config), batch.key, batch.value, expected, batch.slot_mapping,
                    kwargs.get("rotation"), kwargs.get("centroids"))
    differing = store_differences(config, cache, expected, batch.key, batch.slot_mapping,
                                  kwargs.get("rotation"), kwargs.get("centroids"))
    return cache, expected, differing


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (96, torch.bfloat16), (64, torch.float32)])
def test_store_matches_reference_bytes(device, build_module, preset, head_dim, dtype):
    config = make_config(preset, head_dim=head_dim)
    module = build_module(config)
    generator = torch.Generator().manual_seed(head_dim)
    batch = paged_batch(config, [1, 15, 17, 40], num_kv_heads=2, device=device, dtype=dtype, generator=generator)
    _, _, differing = _store_both(module, config, batch, device, num_kv_heads=2)
    assert differing == 0, f"{differing} bytes differ"


@pytest.mark.parametrize("preset", ["k8v4", "k3v4"])
def test_a_slots_make_cache_is_head_major_as_vllm_allocates_it(device, build_module, preset):
    """make_cache of a slots module: zeroed, [num_blocks, page, num_kv_heads, slot], each KV head's page one run of
    page * slot bytes of its allocation (vLLM's order); a slot the store writes lies at (block, head, position)
    of that allocation, as a position-major copy of the cache has it at (block, position, head)."""
    config = make_config(preset)
    module = build_module(config)
    page, slot, heads = config.block_size, module.SLOT_BYTES, 3
    batch = paged_batch(config, [2 * page + 5, 7], num_kv_heads=heads, device=device,
                        generator=torch.Generator().manual_seed(5))
    cache = module.make_cache(batch.num_blocks, heads, device)
    assert tuple(cache.shape) == (batch.num_blocks, page, heads, slot) and not cache.any()
    assert cache.stride() == (heads * page * slot, slot, page * slot, 1)
    module.store(batch.key, batch.value, cache, batch.slot_mapping, **codebook_kwargs(module, config, device))
    allocation = cache.transpose(1, 2).contiguous().view(-1, page, slot)  # the storage's order, as is
    assert allocation.data_ptr() == cache.data_ptr()
    position_major = as_position_major(cache)
    for token in range(0, len(batch.slot_mapping), 5):
        block, position = divmod(int(batch.slot_mapping[token]), page)
        for head in range(heads):
            assert torch.equal(allocation[block * heads + head, position], position_major[block, position, head])
            assert allocation[block * heads + head, position].any()


@pytest.mark.parametrize("block_size", [1, 32])
def test_store_other_page_sizes(device, build_module, block_size):
    config = make_config("k3v4", block_size=block_size)
    module = build_module(config)
    batch = paged_batch(config, [3, 33], num_kv_heads=3, device=device, generator=torch.Generator().manual_seed(1))
    _, _, differing = _store_both(module, config, batch, device, num_kv_heads=3)
    assert differing == 0


def test_negative_slots_are_skipped_and_nothing_else_changes(device, build_module):
    config = make_config("k4v4")
    module = build_module(config)
    batch = paged_batch(config, [20, 9], num_kv_heads=2, device=device, generator=torch.Generator().manual_seed(2))
    skipped = torch.zeros_like(batch.slot_mapping, dtype=torch.bool)
    skipped[::3] = True
    batch.slot_mapping = torch.where(skipped, torch.full_like(batch.slot_mapping, -1), batch.slot_mapping)
    cache, _, differing = _store_both(module, config, batch, device, num_kv_heads=2)
    assert differing == 0
    # Every byte outside the written slots still holds the sentinel.
    written = torch.zeros(cache.shape[:3], dtype=torch.bool)
    kept = batch.slot_mapping[batch.slot_mapping >= 0].cpu()
    written[kept // config.block_size, kept % config.block_size] = True
    assert torch.all(cache.cpu()[~written] == SENTINEL)
    assert not torch.all(cache.cpu()[written] == SENTINEL)


@pytest.mark.parametrize("head_dim", [128, 96])
@pytest.mark.parametrize("kind,words", [("position_major", True), ("head_major", True), ("odd_head_stride", False)])
def test_fp8_slots_are_stored_in_words_where_the_cache_keeps_them_aligned(device, build_module, monkeypatch, head_dim,
                                                                          kind, words):
    """fp8 keys with 4-bit values: every field of a slot starts 4-byte aligned, so the store writes 32-bit words
    (WORDS) into caches whose address and strides keep them so, in either dim order, and 16-bit halves into any
    other view (slots 198 bytes apart here): the reference's bytes either way, the padding between slots kept."""
    config = make_config("k8v4", head_dim=head_dim)
    module = build_module(config)
    assert Plan.from_config(config).word_stores
    recorder = KernelRecorder(module.tq_store)
    monkeypatch.setattr(module, "tq_store", recorder)
    batch = paged_batch(config, [1, 15, 17, 40], num_kv_heads=2, device=device,
                        generator=torch.Generator().manual_seed(head_dim))
    cache = module.make_cache(batch.num_blocks, 2, device).fill_(SENTINEL)
    if kind == "position_major":
        cache = as_position_major(cache)
    elif kind == "odd_head_stride":
        padded = torch.full((*cache.shape[:3], module.SLOT_BYTES + 2), SENTINEL, dtype=torch.uint8, device=device)
        cache = padded[..., :module.SLOT_BYTES]
    expected = cache.clone()
    module.store(batch.key, batch.value, cache, batch.slot_mapping)
    reference.store(Layout.from_config(config), batch.key, batch.value, expected, batch.slot_mapping)
    assert [launch["WORDS"] for _, _, launch in recorder.launches] == [words]
    assert torch.equal(cache.cpu(), expected.cpu())
    if kind == "odd_head_stride":
        assert torch.all(padded[..., module.SLOT_BYTES:].cpu() == SENTINEL)


def test_fp8_keys_round_to_nearest_even_and_saturate(device, build_module):
    """Arbitrary (not fp8-representable) keys: the kernel's integer e4m3fn encoder vs torch's cast."""
    config = make_config("k8v4")
    module = build_module(config)
    generator = torch.Generator().manual_seed(3)
    batch = paged_batch(config, [64], num_kv_heads=2, device=device, dtype=torch.float32, generator=generator)
    magnitudes = torch.logspace(-12, 3.2, batch.key.numel(), base=2.0)  # subnormals .. past 448 (saturates)
    signs = torch.where(torch.rand(batch.key.numel(), generator=generator) < 0.5, -1.0, 1.0)
    batch.key = (magnitudes * signs).reshape(batch.key.shape).to(device)
    batch.key[0, 0, :4] = torch.tensor([0.0, -0.0, 448.0, -1000.0])
    cache, expected, _ = _store_both(module, config, batch, device, num_kv_heads=2)
    assert torch.equal(cache.cpu(), expected.cpu())  # fp8 keys: every byte, no exceptions


@pytest.mark.parametrize("layout", ["slots", "planes"])
def test_unvalidated_slots_past_the_cache_are_skipped_not_written_out_of_bounds(device, build_module, layout):
    """validate=False (and CUDA-graph capture) skip the host check of slot_mapping: the kernel
    must then drop slots past the cache, never write past its end."""
    config = make_config("k3v4", cache_layout=layout)
    module = build_module(config)
    kwargs = codebook_kwargs(module, config, device)
    reference_cache = module.make_cache(4, 2, device)
    guarded = torch.full((2 * reference_cache.numel() + 64,), SENTINEL, dtype=torch.uint8, device=device)
    cache = guarded[: reference_cache.numel()].view(reference_cache.shape)
    cache.fill_(0)
    key = torch.randn(4, 2, 128, device=device, generator=torch.Generator(device).manual_seed(3))
    value = torch.randn(4, 2, 128, device=device, generator=torch.Generator(device).manual_seed(4))
    num_slots = 4 * config.block_size
    slots = torch.tensor([0, num_slots, 5, num_slots + 7], device=device)
    with pytest.raises(module.LaunchError, match=f"slot_mapping has slot {num_slots + 7}"):
        module.store(key, value, cache, slots, **kwargs)
    module.store(key, value, cache, slots, validate=False, **kwargs)
    assert torch.all(guarded[cache.numel():] == SENTINEL), "bytes written past the cache"
    module.store(key[::2], value[::2], reference_cache, slots[::2], **kwargs)
    assert torch.equal(cache, reference_cache)  # the in-range tokens, and nothing else


def test_store_rejects_bad_arguments(device, build_module):
    config = make_config("k3v4")
    module = build_module(config)
    cache = module.make_cache(4, 2, device)
    key = torch.randn(3, 2, 128, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(module.LaunchError, match="key must be"):
        module.store(key[:, :1], key[:, :1], cache, slots)
    with pytest.raises(module.LaunchError, match="slots are 117 bytes"):
        module.store(key, key, cache[..., :117], slots)
    with pytest.raises(module.LaunchError, match="slot_mapping must be int64 or int32"):
        module.store(key, key, cache, slots.float())
    with pytest.raises(module.LaunchError, match="slot_mapping has slot 64"):
        module.store(key, key, cache, torch.tensor([0, 1, 64], device=device))


def test_boundaries_replace_the_midpoints_of_the_centroids(device, build_module):
    """boundaries= (what a caller holding only the midpoints passes, as vLLM's store does) codes keys
    like centroids whose midpoints they are; unsorted or misshapen boundaries are refused."""
    config = make_config("k3v4")
    module = build_module(config)
    batch = paged_batch(config, [21], num_kv_heads=2, device=device, generator=torch.Generator().manual_seed(8))
    centroids = torch.sort(module.default_centroids(device) * torch.linspace(0.7, 1.3, 8, device=device)).values
    by_centroids = module.make_cache(batch.num_blocks, 2, device)
    by_boundaries = by_centroids.clone()
    module.store(batch.key, batch.value, by_centroids, batch.slot_mapping, centroids=centroids)
    module.store(batch.key, batch.value, by_boundaries, batch.slot_mapping,
                 boundaries=reference.decision_boundaries(centroids))
    assert torch.equal(by_boundaries, by_centroids)
    default = module.make_cache(batch.num_blocks, 2, device)
    module.store(batch.key, batch.value, default, batch.slot_mapping)
    assert not torch.equal(default, by_centroids)  # the boundaries were not the default ones
    with pytest.raises(module.LaunchError, match="boundaries must be sorted ascending"):
        module.store(batch.key, batch.value, default, batch.slot_mapping,
                     boundaries=reference.decision_boundaries(centroids).flip(0))
    with pytest.raises(module.LaunchError, match="boundaries must have 7 entries"):
        module.store(batch.key, batch.value, default, batch.slot_mapping, boundaries=centroids)


@pytest.mark.parametrize("head_dim,layout", [(128, "slots"), (64, "slots"), (128, "planes")])
def test_the_default_codebook_takes_the_symmetric_search_and_stores_the_same_bytes(device, build_module,
                                                                                    monkeypatch, head_dim, layout):
    """4-bit keys coded with the default centroids search half the boundaries (Plan.code_search_symmetric), a copy
    of them takes the general search: the same bytes, the reference's. (Planes without norm correction: a
    corrected norm needs the general search's code bits.)"""
    config = make_config("k4v4", head_dim=head_dim, cache_layout=layout, norm_correction=layout == "slots")
    module = build_module(config)
    assert Plan.from_config(config).symmetric_store_search
    monkeypatch.setattr(module, "STORE_GLUON", False, raising=False)  # tq_store's (tq_store_gluon: below)
    batch = paged_batch(config, [3, 40, 17], num_kv_heads=2, device=device, generator=torch.Generator().manual_seed(5))
    store = KernelRecorder(module.tq_store)
    monkeypatch.setattr(module, "tq_store", store)
    caches = []
    for centroids in (module.default_centroids(device), module.default_centroids(device).clone()):
        caches.append(module.make_cache(batch.num_blocks, 2, device).fill_(SENTINEL))
        module.store(batch.key, batch.value, caches[-1], batch.slot_mapping, centroids=centroids)
    assert [kwargs["SYMMETRIC_CODEBOOK"] for _, _, kwargs in store.launches] == [True, False]
    assert torch.equal(caches[0], caches[1])
    expected = module.make_cache(batch.num_blocks, 2, device).fill_(SENTINEL)
    reference.store(Layout.from_config(config), batch.key, batch.value, expected, batch.slot_mapping,
                    module.default_rotation(device), module.default_centroids(device))
    assert store_differences(config, caches[0], expected, batch.key, batch.slot_mapping,
                             module.default_rotation(device), module.default_centroids(device)) == 0


@pytest.mark.parametrize("layout", ["slots", "planes"])
def test_hadamard_keys_are_rotated_in_the_kernel_and_other_matrices_by_torch(device, build_module, layout,
                                                                             monkeypatch):
    """The default rotation takes the kernel's Walsh-Hadamard transform; a copy of it (any other
    tensor) takes rotate_keys in torch. Both paths must give the reference's bytes."""
    config = make_config("k4v4", cache_layout=layout)
    module = build_module(config)
    batch = paged_batch(config, [9, 30], num_kv_heads=2, device=device, generator=torch.Generator().manual_seed(5))
    kwargs = codebook_kwargs(module, config, device)
    calls = []
    real = module.rotate_keys
    monkeypatch.setattr(module, "rotate_keys", lambda *args: calls.append(1) or real(*args))
    for rotation, torch_calls in ((kwargs["rotation"], 0), (kwargs["rotation"].clone(), 1)):
        cache = module.make_cache(batch.num_blocks, 2, device)
        expected = cache.clone()
        module.store(batch.key, batch.value, cache, batch.slot_mapping, rotation=rotation,
                     centroids=kwargs["centroids"])
        reference.store(Layout.from_config(config), batch.key, batch.value, expected, batch.slot_mapping, rotation,
                        kwargs["centroids"])
        assert len(calls) == torch_calls
        assert store_differences(config, cache, expected, batch.key, batch.slot_mapping, rotation,
                                 kwargs["centroids"]) == 0


def test_store_differences_allows_only_boundary_ties_and_one_ulp_norms():
    """The comparison itself: a code may differ only on a decision boundary, a norm by one fp16 ulp."""
    config = make_config("k4v4")
    layout = Layout.from_config(config)
    rotation = torch.eye(config.head_dim)  # rotated key = unit key: coordinates placed at will
    centroids = torch.tensor(codebook.centroids(config.key_bits, config.head_dim))
    boundary = float(reference.decision_boundaries(centroids)[9])  # between codes 9 and 10
    unit = torch.zeros(1, 1, config.head_dim, dtype=torch.float64)
    unit[0, 0, 0] = boundary  # on the boundary (to within the rounding of the norm)
    unit[0, 0, 1] = boundary + 0.01  # inside the bucket of code 10
    unit[0, 0, 2] = (1 - unit[0, 0, 0] ** 2 - unit[0, 0, 1] ** 2) ** 0.5  # a unit vector
    key = (unit * 3.0).float()
    slots = torch.tensor([0])
    expected = torch.zeros(1, config.block_size, 1, layout.slot_bytes, dtype=torch.uint8)
    reference.store(Layout.from_config(config), key, key, expected, slots, rotation, centroids)

    def with_code(dim, code):
        cache = expected.clone()
        codes = reference.unpack_codes(cache[0, 0, 0, : layout.key_code_bytes], layout.key_bits, config.head_dim)
        codes[dim] = code
        cache[0, 0, 0, : layout.key_code_bytes] = reference.pack_codes(codes, layout.key_bits)
        return cache

    def differences(cache):
        return store_differences(config, cache, expected, key, slots, rotation, centroids)

    codes = reference.unpack_codes(expected[0, 0, 0, : layout.key_code_bytes], layout.key_bits, 2).tolist()
    assert codes[0] in (9, 10) and codes[1] == 10
    assert differences(expected) == 0
    assert differences(with_code(0, 19 - codes[0])) == 0  # the other side of the tie
    assert differences(with_code(0, 3)) == 1  # not a neighbour of the tie
    assert differences(with_code(1, 9)) == 1
    norm = expected.clone()
    norm[0, 0, 0, layout.key_norm_offset] += 1  # one ulp (the low byte of a positive fp16)
    assert differences(norm) == 0
    norm[0, 0, 0, layout.key_norm_offset] += 1
    assert differences(norm) == 1
    value = expected.clone()
    value[0, 0, 0, layout.value_code_offset] ^= 1
    assert differences(value) == 1


def test_store_differences_takes_a_corrected_norm_from_the_codes_stored():
    """"planes" stores norm-corrected norms (layout.key_norm_corrected): where a tie took the other
    code, the norm must be the one of the codes stored, not the reference's."""
    config = make_config("k4v4", cache_layout="planes")
    layout = Layout.from_config(config)
    assert layout.key_norm_corrected
    rotation = torch.eye(config.head_dim)
    centroids = torch.tensor(codebook.centroids(config.key_bits, config.head_dim))
    unit = torch.zeros(1, 1, config.head_dim, dtype=torch.float64)
    unit[0, 0, 0] = float(reference.decision_boundaries(centroids)[14])  # between the two largest centroids
    unit[0, 0, 1] = (1 - unit[0, 0, 0] ** 2) ** 0.5
    key = (unit * 3.0).float()
    slots = torch.tensor([0])
    expected = torch.zeros(1, 1, layout.page_bytes, dtype=torch.uint8)
    reference.store(Layout.from_config(config), key, key, expected, slots, rotation, centroids)

    def flipped(norm):  # the other side of the tie at dim 0, with this fp16 norm
        rows = reference.as_slots(Layout.from_config(config), expected).clone()
        codes = reference.unpack_codes(rows[0, 0, 0, : layout.key_code_bytes], layout.key_bits, config.head_dim)
        codes[0] = 29 - codes[0]
        rows[0, 0, 0, : layout.key_code_bytes] = reference.pack_codes(codes, layout.key_bits)
        if norm is not None:
            c = centroids.double()[codes]
            exact = 3.0 / torch.sqrt((c * c).sum() + 1e-16)
            rows[0, 0, 0, layout.key_norm_offset: layout.key_norm_offset + 2] = (
                exact.to(torch.float16).reshape(1).view(torch.uint8))
        return reference.slots_to_pages(layout, rows)

    def differences(cache):
        return store_differences(config, cache, expected, key, slots, rotation, centroids)

    assert differences(expected) == 0
    assert differences(flipped(norm="exact")) == 0
    assert differences(flipped(norm=None)) == 1  # the reference's norm: that of the other code


def _codes_of(search, values, boundaries):
    """The store's search statements (Plan.code_search or code_search_symmetric) run as torch code on `values`."""
    namespace = {"tl": SimpleNamespace(where=torch.where, abs=torch.abs, int32=torch.int32), "rotated": values,
                 **{f"boundary{j}": boundary for j, boundary in enumerate(boundaries)}}
    exec("\n".join(search), namespace)
    return namespace["codes"]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_code_search_counts_the_boundaries_at_or_below_each_value(bits):
    """The store's binary search (Plan.code_search), run as torch code: the code of every
    value, boundaries themselves included (ties go up), equals the count the reference takes."""
    boundaries = torch.sort(torch.randn(2**bits - 1, generator=torch.Generator().manual_seed(bits))).values
    values = torch.cat([boundaries, boundaries - 1e-6, boundaries + 1e-6, torch.tensor([-1e9, 1e9]),
                        torch.randn(1000, generator=torch.Generator().manual_seed(bits + 10))])
    codes = _codes_of(Plan.code_search(bits), values, boundaries)
    assert torch.equal(codes, (values[:, None] >= boundaries).sum(-1).to(torch.int32))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_symmetric_search_codes_as_the_general_one_off_the_boundaries(bits):
    """Plan.code_search_symmetric's statements, run on values strictly between and beyond symmetric boundaries
    (and 0, and values at the positive ones), give code_search's codes."""
    boundaries = torch.linspace(-1.0, 1.0, 2**bits - 1)  # fp32, as the kernel's
    boundaries = (boundaries - boundaries.flip(0)) / 2  # exactly antisymmetric, the middle one 0
    between = (boundaries[1:] + boundaries[:-1]) / 2
    values = torch.cat([between, boundaries[-1:] + 1, boundaries[:1] - 1, torch.zeros(1),
                        boundaries[boundaries > 0]])
    expected = torch.searchsorted(boundaries, values, right=True)
    assert torch.equal(_codes_of(Plan.code_search(bits), values, boundaries), expected)
    assert torch.equal(_codes_of(Plan.code_search_symmetric(bits), values, boundaries), expected)


@pytest.mark.parametrize("bits", [3, 4])
def test_a_symmetric_codebooks_squares_follow_the_half_search(bits):
    """The squares tq_store_gluon corrects norms by under the half search (Plan.centroid_square_select over its
    half bits and the upper half's squares), run as torch code, are each code's centroid squared, as the general
    search's selection gives them."""
    centroids = torch.tensor(codebook.centroids(bits, 128))  # the default codebook: symmetric about 0
    boundaries = (centroids[1:] + centroids[:-1]) / 2
    values = torch.randn(2000, generator=torch.Generator().manual_seed(bits)) * float(centroids.abs().max())
    squares = {f"centroid_square{j}": centroid * centroid for j, centroid in enumerate(centroids)}
    for search, select in ((Plan.code_search_symmetric(bits), Plan.centroid_square_select(bits - 1, "half_bit",
                                                                                           2 ** (bits - 1))),
                           (Plan.code_search(bits), Plan.centroid_square_select(bits))):
        namespace = {"tl": SimpleNamespace(where=torch.where, abs=torch.abs, int32=torch.int32), "rotated": values,
                     **{f"boundary{j}": boundary for j, boundary in enumerate(boundaries)}, **squares}
        exec("\n".join(search + select), namespace)
        assert torch.equal(namespace["centroid_square"], (centroids * centroids)[namespace["codes"].long()])


# --- the arithmetic shortcuts of the compiled kernel (GPU: the interpreter takes the plain paths) --
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]


@pytest.mark.parametrize("preset,layout", [("k8v4", "planes"), ("k3v3", "planes"), ("k4v4", "slots")])
@pytest.mark.parametrize("_", [pytest.param(None, id="cuda", marks=GPU)])
def test_value_codes_at_the_rounding_thresholds(build_module, preset, layout, _):
    """fp32 values a few ulps either side of (code + 1/2) * scale, constant rows (the 1e-8 floor of
    the scale) and rows of one outlier: every value byte equals the reference's, which divides in
    IEEE fp32 (the kernel by a reciprocal per row and fused multiply-adds: _divide_rows)."""
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    levels = 2**config.value_bits - 1
    generator = torch.Generator().manual_seed(11)
    batch = paged_batch(config, [256], num_kv_heads=1, dtype=torch.float32, generator=generator)
    value = batch.value.double()
    low, high = value.amin(-1, keepdim=True), value.amax(-1, keepdim=True)
    scale = ((high - low).float() / levels).double()
    code = torch.randint(0, levels, value.shape, generator=generator).double()
    ulps = torch.randint(-3, 4, value.shape, generator=generator).float()
    at = (low + (code + 0.5) * scale).float()
    nudged = at + ulps * torch.finfo(torch.float32).eps * at.abs()
    nudged[..., 0], nudged[..., 1] = low[..., 0].float(), high[..., 0].float()  # keep each row's range
    nudged[:8] = 0.75  # constant rows
    nudged[8:16] = 0.0
    nudged[8:16, :, 3] = 1e4  # one outlier
    batch.key, batch.value, batch.slot_mapping = batch.key.cuda(), nudged.cuda(), batch.slot_mapping.cuda()
    _, _, differing = _store_both(module, config, batch, "cuda", num_kv_heads=1)
    assert differing == 0, f"{differing} bytes differ"


@pytest.mark.parametrize("layout", ["slots", "planes"])
@pytest.mark.parametrize("_", [pytest.param(None, id="cuda", marks=GPU)])
def test_fp8_keys_of_every_fp16_value(build_module, layout, _):
    """Every finite fp16 bit pattern as a key: on sm89+ the kernel casts with cvt.rn.satfinite,
    elsewhere by integer ops; either way the reference's saturating cast, byte for byte."""
    config = make_config("k8v4", cache_layout=layout)
    module = build_module(config)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    every = torch.where(torch.isfinite(every), every, torch.zeros_like(every))
    batch = paged_batch(config, [every.numel() // 128], num_kv_heads=1, generator=torch.Generator().manual_seed(5))
    batch.key, batch.value, batch.slot_mapping = every.reshape(-1, 1, 128).cuda(), batch.value.cuda(), batch.slot_mapping.cuda()
    cache, expected, _ = _store_both(module, config, batch, "cuda", num_kv_heads=1)
    assert torch.equal(cache, expected), f"{int((cache != expected).sum())} bytes differ"


@triton.jit
def _divide_rows_kernel(numerator_ptr, denominator_ptr, fast_ptr, exact_ptr, COLS: tl.constexpr,
                        DIVIDE: tl.constexpr):
    row = tl.program_id(0)
    col = tl.arange(0, COLS)[None, :]
    numerator = tl.load(numerator_ptr + row * COLS + col)
    denominator = tl.load(denominator_ptr + row + tl.arange(0, 1))
    tl.store(fast_ptr + row * COLS + col, DIVIDE(numerator, denominator))
    tl.store(exact_ptr + row * COLS + col, tl.math.div_rn(numerator, denominator[:, None]))


@pytest.mark.parametrize("_", [pytest.param(None, id="cuda", marks=GPU)])
def test_divide_rows_is_div_rn(build_module, _):
    """_divide_rows (a reciprocal per row, then CUDA's own fast path of div.rn by fused multiply-adds)
    equals div_rn bit for bit: 1024 numerators in [0, 16 * divisor), the code thresholds and 0, for
    each of 4096 divisors from 1e-8 to about 2**100 (random mantissas, 1, and all ones)."""
    module = build_module(make_config("k3v4"))
    generator = torch.Generator().manual_seed(3)
    exponents = torch.randint(-27, 100, (4096,), generator=generator).double()
    mantissas = torch.rand(4096, generator=generator, dtype=torch.float64) + 1.0
    mantissas[:64] = 1.0
    mantissas[64:128] = 2.0 - 2.0**-23
    denominator = (mantissas * 2.0**exponents).float().clamp_min(1e-8)
    cols = 1024
    numerator = torch.rand(4096, cols, generator=generator) * 16.0 * denominator[:, None]
    numerator[:, :16] = (torch.arange(16) + 0.5) * denominator[:, None]  # at the code thresholds
    numerator[:, 16] = 0.0
    numerator, denominator = numerator.cuda(), denominator.cuda()
    fast, exact = torch.empty_like(numerator), torch.empty_like(numerator)
    _divide_rows_kernel[(4096,)](numerator, denominator, fast, exact, COLS=cols, DIVIDE=module._divide_rows)
    assert torch.equal(fast.view(torch.int32), exact.view(torch.int32))


# --- the page-planar layout ("planes") ---------------------------------------------------------
@pytest.mark.parametrize("spec", KERNEL_FORMATS, ids=str)
def test_store_writes_the_reference_bytes_and_nothing_else(device, build_module, spec):
    config = planes_config_of(spec)
    head_dim = config.head_dim
    module = build_module(config)
    batch = paged_batch(config, [1, 15, 17, 40], num_kv_heads=2, device=device,
                        generator=torch.Generator().manual_seed(head_dim))
    kwargs = codebook_kwargs(module, config, device)
    cache = torch.full((batch.num_blocks, 2, module.PAGE_BYTES), SENTINEL, dtype=torch.uint8, device=device)
    cache[-1] = 0x5A  # a different byte in one unused block, so that a misplaced field shows in both
    initial, expected = cache.clone(), cache.clone()
    module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
    reference.store(Layout.from_config(config), batch.key, batch.value, expected, batch.slot_mapping,
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
    expected = reference.corrected_key_norms(Layout.from_config(planes), slots_cache.cpu(), centroids)
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
    want = reference.decode(Layout.from_config(planes), query, planes_cache, batch.block_table, batch.seq_lens, **kwargs)
    want_slots = reference.decode(Layout.from_config(slots), query, slots_cache, batch.block_table, batch.seq_lens, **kwargs)
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
    reference.store(Layout.from_config(config), key, value, expected, slots, kwargs["rotation"], kwargs["centroids"])
    assert store_differences(config, cache, expected, key, slots, kwargs["rotation"], kwargs["centroids"]) == 0
    rows = reference.as_slots(Layout.from_config(config), cache.cpu())[0, 0]  # token 0, both heads
    layout = Layout.from_config(config)
    assert torch.all(reference.unpack_codes(rows[:, : layout.key_code_bytes], 3, 128) == 3)
    norm = rows[:, layout.key_norm_offset: layout.key_norm_offset + 2].contiguous().view(torch.float16)
    assert torch.all(norm == 65504.0)
    query = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(3)).to(device)
    block_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    seq_lens = torch.tensor([2], dtype=torch.int32, device=device)
    out = module.decode(query, cache, block_table, seq_lens, **kwargs)
    want = reference.decode(Layout.from_config(config), query, cache, block_table, seq_lens, **kwargs)
    assert torch.isfinite(out).all() and relative_error(out, want) < DECODE_TOLERANCE[torch.float32]


def test_the_tensor_core_key_store_experiment_compiles_for_sm90():
    """tools/store_keys_mma.py (an experiment beside tq_store, BENCHMARKS.md "Store") compiles offline for sm90 with
    this triton: one mma.sync per 16 head dims, 16 tokens and 8 output dims of each block (8 blocks)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.experimental.gluon")
    repo = Path(__file__).resolve().parent.parent
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "tools/store_keys_mma.py", "--compile"], cwd=repo, env=environment,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.findall(r"BLOCK_T (\d+) COUNT_SQUARES (\w+) VALUES (\w+) .*; mma\.sync x(\d+)", result.stdout)
    # 8 blocks x BLOCK_T // 16 row tiles x 2 column tiles
    assert sorted((int(t), c, v, int(m)) for t, c, v, m in found) == [
        (16, "False", "False", 16), (16, "True", "False", 16), (16, "True", "True", 16), (32, "True", "False", 32)]


# --- the store's 3- and 4-bit keys on the tensor cores (plan.store_keys_mma) ---------------------------------
@pytest.mark.parametrize("fields,expected", [
    (dict(preset="k3v4"), True), (dict(preset="k3v3"), True), (dict(preset="k4v4"), True),
    (dict(preset="k8v4"), False), (dict(preset="k3v4", cache_layout="slots"), False),
    (dict(preset="k4v4", cache_layout="slots"), False), (dict(preset="k3v4", head_dim=64), False),
    (dict(preset="k3v4", rotation="random"), False), (dict(preset="k4v4", rotation="random"), False),
    (dict(preset="k3v4", norm_correction=False), True), (dict(preset="k4v4", norm_correction=False), True),
])
def test_the_tensor_core_key_store_renders_for_planes_3_and_4_bit_hadamard_keys_of_head_dim_128(fields, expected):
    fields = dict(fields)
    preset, head_dim = fields.pop("preset"), fields.pop("head_dim", 128)
    config = make_config(preset, head_dim=head_dim, **{"cache_layout": "planes", **fields})
    assert Plan.from_config(config).store_keys_mma is expected
    from tqgen import render
    source = render.render(config)
    assert ("def tq_store_keys_mma(" in source) is expected and ("KEYS: tl.constexpr" in source) is expected


def test_in_the_interpreter_the_store_keeps_one_kernel(build_module, monkeypatch):
    """The Gluon kernel cannot run in the interpreter (nor below STORE_MMA_MIN_TOKENS, nor for fp32 keys):
    tq_store writes keys and values, KEYS=True."""
    config = make_config("k3v4", cache_layout="planes")
    module = build_module(config)
    monkeypatch.setattr(module, "STORE_KEYS_MMA", True)  # the default (TQGEN_STORE_KEYS_MMA unset)
    monkeypatch.setattr(module, "STORE_MMA_MIN_TOKENS", 1)
    store = KernelRecorder(module.tq_store)
    monkeypatch.setattr(module, "tq_store", store)
    batch = paged_batch(config, [3, 17], num_kv_heads=2, device="cpu", generator=torch.Generator().manual_seed(5))
    cache = module.make_cache(batch.num_blocks, 2, "cpu")
    module.store(batch.key, batch.value, cache, batch.slot_mapping, **codebook_kwargs(module, config, "cpu"))
    assert [kwargs["KEYS"] for _, _, kwargs in store.launches] == [True]


@pytest.mark.parametrize("launch,named", [(dict(block_t=3), "block_t"), (dict(num_warps=3), "num_warps")])
def test_a_bad_launch_is_refused_before_the_tensor_core_key_store_runs(build_module, monkeypatch, launch, named):
    """Where the keys go to tq_store_keys_mma (held here to a GPU that runs Gluon), a bad block_t or num_warps for
    tq_store is refused before either kernel runs: a refused call writes nothing, not the keys without the
    values."""
    config = make_config("k3v4", cache_layout="planes")
    module = build_module(config)
    monkeypatch.setattr(module, "STORE_KEYS_MMA", True)
    monkeypatch.setattr(module, "STORE_GLUON", False)  # else tq_store_gluon alone (tests below)
    monkeypatch.setattr(module, "STORE_MMA_MIN_TOKENS", 1)
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: True)
    keys_kernel, store = KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(module, "tq_store_keys_mma", keys_kernel)
    monkeypatch.setattr(module, "tq_store", store)
    batch = paged_batch(config, [3, 17], num_kv_heads=2, device="cpu", dtype=torch.float16,
                        generator=torch.Generator().manual_seed(5))
    cache = module.make_cache(batch.num_blocks, 2, "cpu")
    with pytest.raises(module.LaunchError, match=f"^store: {named} must be"):
        module.store(batch.key, batch.value, cache, batch.slot_mapping, **launch)
    assert keys_kernel.launches == [] and store.launches == []
    module.store(batch.key, batch.value, cache, batch.slot_mapping)  # the same call with a good launch: both run
    assert len(keys_kernel.launches) == 1 and [kwargs["KEYS"] for _, _, kwargs in store.launches] == [False]


_STORE_MMA_COMPILE = """
import json, os, sys, tempfile
sys.path[:0] = [os.path.join(os.getcwd(), "tools"), os.getcwd()]
import ptx_probe, tqgen
from tqgen import config as config_mod
for name in sys.argv[1:]:
    module = tqgen.load(config_mod.resolve_arch(config_mod.load(f"configs/{name}.yaml"), (9, 0)), tempfile.mkdtemp())
    compiled = ptx_probe.compile_store_keys_mma(module)
    print(json.dumps(dict(name=name, usage=ptx_probe.ptxas_usage(compiled.asm["ptx"]),
                          mma=compiled.asm["ptx"].count("mma.sync.aligned.m16n8k16"),
                          local=compiled.asm["ptx"].count(".local"))))
"""


def test_the_tensor_core_key_store_compiles_for_sm90():
    """The rendered tq_store_keys_mma of every shipped config that has one, compiled offline for sm90 (this
    triton): 16 MMAs (8 blocks x 2 column tiles), no local memory."""
    pytest.importorskip("triton.experimental.gluon")
    names = ["k3v4-d128-planes", "k3v3-d128-planes", "k4v4-d128-planes"]
    reports = offline_compile_reports("-c", _STORE_MMA_COMPILE, *names)
    assert [report["name"] for report in reports] == names
    for report in reports:
        assert report["mma"] == 16 and report["local"] == 0, report
        assert "stack" not in report["usage"] or "0 bytes cumulative stack" in report["usage"], report


@pytest.mark.parametrize("preset", ["k3v4", "k3v3", "k4v4"])
@pytest.mark.parametrize("norm_correction", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1, 15, 17, 40], [2100, 2001]], ids=["73-tokens", "4101-tokens"])
@pytest.mark.parametrize("_", [pytest.param(None, id="cuda", marks=GPU)])
def test_keys_stored_on_the_tensor_cores_match_the_reference_and_skip_what_they_must(build_module, monkeypatch,
                                                                                    preset, norm_correction, dtype,
                                                                                    lengths, _):
    """tq_store_keys_mma then tq_store (KEYS=False): the reference's bytes (codes up to boundary ties), skipped
    slots (negative, or past the cache unvalidated) untouched, partial tiles masked; 73 tokens with the
    threshold lowered to 1. Norms corrected (the presets) or not."""
    config = make_config(preset, cache_layout="planes", norm_correction=norm_correction)
    module = build_module(config)
    monkeypatch.setattr(module, "STORE_KEYS_MMA", True)  # whatever TQGEN_STORE_KEYS_MMA says
    monkeypatch.setattr(module, "STORE_GLUON", False)  # else tq_store_gluon alone (tests below)
    if sum(lengths) < module.STORE_MMA_MIN_TOKENS:
        monkeypatch.setattr(module, "STORE_MMA_MIN_TOKENS", 1)
    keys_kernel, store = KernelRecorder(module.tq_store_keys_mma), KernelRecorder(module.tq_store)
    monkeypatch.setattr(module, "tq_store_keys_mma", keys_kernel)
    monkeypatch.setattr(module, "tq_store", store)
    batch = paged_batch(config, lengths, num_kv_heads=2, device="cuda", dtype=dtype,
                        generator=torch.Generator().manual_seed(len(lengths)))
    skipped = torch.zeros_like(batch.slot_mapping, dtype=torch.bool)
    skipped[::5] = True
    batch.slot_mapping = torch.where(skipped, torch.full_like(batch.slot_mapping, -1), batch.slot_mapping)
    batch.slot_mapping[1] = batch.num_blocks * config.block_size + 3  # past the cache: skipped unvalidated
    kwargs = codebook_kwargs(module, config, "cuda")
    cache = module.make_cache(batch.num_blocks, 2, "cuda").fill_(SENTINEL)
    expected = cache.clone()
    module.store(batch.key, batch.value, cache, batch.slot_mapping, validate=False, **kwargs)
    assert len(keys_kernel.launches) == 1 and [kw["KEYS"] for _, _, kw in store.launches] == [False]
    inside = batch.slot_mapping < batch.num_blocks * config.block_size
    reference.store(Layout.from_config(config), batch.key[inside], batch.value[inside], expected,
                    batch.slot_mapping[inside], kwargs.get("rotation"), kwargs.get("centroids"))
    differing = store_differences(config, cache, expected, batch.key[inside], batch.slot_mapping[inside],
                                  kwargs.get("rotation"), kwargs.get("centroids"))
    assert differing == 0, f"{differing} bytes differ"
    # store_differences compared every byte outside the written slots' key fields with the reference's (which
    # skips negative slots); and pages that no stored token maps to keep the sentinel in every plane.
    kept = batch.slot_mapping[inside & (batch.slot_mapping >= 0)].cpu()
    unused = sorted(set(range(batch.num_blocks)) - set((kept // config.block_size).tolist()))
    assert unused and torch.all(cache[unused].cpu() == SENTINEL)


@pytest.mark.parametrize("layout", ["slots", "planes"])
def test_boundaries_made_in_a_cuda_graph_capture_are_not_kept_for_later_stores(build_module, monkeypatch, layout):
    """The default centroids' decision boundaries are kept per device for later stores. Made by a store captured in a
    CUDA graph (the engine's first store of the default codebook), they are the output of kernels the capture
    recorded and ran none of: nothing until that graph replays. Kept, every eager store (and every other graph) coded
    its keys against them. Here the capture's kernels write NaN, as memory a capture never filled holds anything: the
    eager store after it must write the bytes of a store given the boundaries themselves, and a later capture those
    the eager store kept."""
    config = make_config("k3v4", cache_layout=layout)
    module = build_module(config)
    device = "cpu"
    monkeypatch.setattr(module, "_per_device", {})  # nothing kept yet
    centroids = module.default_centroids(device)  # made outside the capture, as an engine's warm-up decode makes it
    capturing = [True]
    monkeypatch.setattr(module, "_capturing", lambda tensor: capturing[0])
    decision_boundaries = module.decision_boundaries

    def recorded(centroid_values):  # what a capture leaves in the tensor its kernels would write
        made = decision_boundaries(centroid_values)
        return made.fill_(float("nan")) if capturing[0] else made

    monkeypatch.setattr(module, "decision_boundaries", recorded)
    generator = torch.Generator().manual_seed(5)
    key, value = torch.randn(6, 2, 128, generator=generator), torch.randn(6, 2, 128, generator=generator)
    slots = torch.arange(6)
    module.store(key, value, module.make_cache(1, 2, device), slots)  # captured
    capturing[0] = False
    eager, expected = module.make_cache(1, 2, device), module.make_cache(1, 2, device)
    module.store(key, value, eager, slots)
    module.store(key, value, expected, slots, boundaries=decision_boundaries(centroids))
    assert torch.equal(eager, expected)
    capturing[0] = True  # a later capture takes the boundaries the eager store kept
    captured = module.make_cache(1, 2, device)
    module.store(key, value, captured, slots)
    assert torch.equal(captured, expected)


# --- the slots store of Hadamard MSE keys in Gluon (plan.store_gluon) ---------------------------------------
@pytest.mark.parametrize("fields,expected", [
    (dict(preset="k3v4"), True), (dict(preset="k4v4"), True), (dict(preset="k3v3"), True),
    (dict(preset="k8v4"), False), (dict(preset="k3v4", cache_layout="planes"), True),
    (dict(preset="k3v3", cache_layout="planes"), True), (dict(preset="k8v4", cache_layout="planes"), False),
    (dict(preset="k3v4", head_dim=64), False), (dict(preset="k4v4", head_dim=64), True),
    (dict(preset="k4v4", head_dim=256), True), (dict(preset="k3v4", head_dim=256), True),
    (dict(preset="k4v4", head_dim=96), False), (dict(preset="k4v4", head_dim=64, cache_layout="planes"), False),
    (dict(preset="k3v4", rotation="random"), False), (dict(preset="k4v4", value_bits=3), False),
])
def test_the_gluon_store_renders_for_hadamard_mse_keys(fields, expected):
    """tq_store_gluon beside tq_store: 3- or 4-bit keys under the config's Hadamard rotation, in slots at head_dim
    64, 128 or 256 where a lane's codes are whole 16-bit words (so not 3 bits at 64), in planes at 128; where the
    module carries Gluon (4-bit keys with 3-bit values in slots have no Gluon decode, so no Gluon import)."""
    fields = dict(fields)
    preset, head_dim = fields.pop("preset"), fields.pop("head_dim", 128)
    config = make_config(preset, head_dim=head_dim, **fields)
    plan = Plan.from_config(config)
    assert plan.store_gluon is expected
    assert plan.store_gluon_words == (expected and not plan.planes and plan.layout.value_bits == 4 and head_dim >= 128)
    from tqgen import render
    source = render.render(config)
    assert ("def tq_store_gluon(" in source) is expected and ("STORE_GLUON = " in source) is expected


@pytest.mark.parametrize("call,slots_kernel,symmetric", [
    (dict(), True, True), (dict(boundaries="default"), True, False), (dict(centroids="copy"), True, False),
    (dict(rotation="copy"), False, None), (dict(block_t=4), False, None), (dict(num_warps=1), False, None),
    (dict(disabled=True), False, None),
])
def test_the_slots_store_takes_the_gluon_kernel_unless_the_call_says_otherwise(build_module, monkeypatch, call,
                                                                               slots_kernel, symmetric):
    """On a GPU that runs Gluon (held so here) a slots store of Hadamard keys launches tq_store_gluon alone, with
    STORE_GLUON_TOKENS tokens a program and the half search where it is given the default centroids themselves; a
    call naming tq_store's launch, another rotation (keys rotated by torch first) or STORE_GLUON False takes
    tq_store."""
    config = make_config("k3v4")
    module = build_module(config)
    monkeypatch.setattr(module, "_store_gluon_ready", lambda device: True)
    monkeypatch.setattr(module, "STORE_GLUON", not call.pop("disabled", False))
    slots_store, store = KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(module, "tq_store_gluon", slots_store)
    monkeypatch.setattr(module, "tq_store", store)
    if call.get("boundaries") == "default":
        call["boundaries"] = module.decision_boundaries(module.default_centroids("cpu"))
    if call.get("centroids") == "copy":
        call["centroids"] = module.default_centroids("cpu").clone()
    if call.get("rotation") == "copy":
        call["rotation"] = module.default_rotation("cpu").clone()
    batch = paged_batch(config, [3, 17], num_kv_heads=2, device="cpu", generator=torch.Generator().manual_seed(5))
    module.store(batch.key, batch.value, module.make_cache(batch.num_blocks, 2, "cpu"), batch.slot_mapping, **call)
    assert (len(slots_store.launches), len(store.launches)) == ((1, 0) if slots_kernel else (0, 1))
    if slots_kernel:
        grid, _, kwargs = slots_store.launches[0]
        assert grid == (-(-20 // module.STORE_GLUON_TOKENS), 2) and kwargs["BLOCK_T"] == module.STORE_GLUON_TOKENS
        assert kwargs["SYMMETRIC_CODEBOOK"] is symmetric and kwargs["num_warps"] == 1


_STORE_GLUON_COMPILE = """
import json, os, sys, tempfile
sys.path[:0] = [os.path.join(os.getcwd(), "tools"), os.getcwd()]
import ptx_probe, tqgen
from tqgen import config as config_mod
for name in sys.argv[1:]:
    module = tqgen.load(config_mod.resolve_arch(config_mod.load(f"configs/{name}.yaml"), (9, 0)), tempfile.mkdtemp())
    for symmetric in (True, False):
        ptx = ptx_probe.compile_store_gluon(module, module.STORE_GLUON_TOKENS, symmetric).asm["ptx"]
        print(json.dumps(dict(name=name, symmetric=symmetric, usage=ptx_probe.ptxas_usage(ptx),
                              shuffles=ptx.count("shfl.sync.bfly"), gathers=ptx.count("shfl.sync.idx"),
                              shared=ptx.count(".shared"),
                              local=ptx.count(".local"), stores=ptx.count("st.global"),
                              words=ptx.count("st.global.b32"), halves=ptx.count("st.global.b16"))))
"""


def test_the_gluon_slots_store_compiles_for_sm90():
    """tq_store_gluon of the MSE configs that have it, both searches, compiled offline for sm90 (this triton): the
    transform's 3 head_dim / 8 shuffles of a lane (3 stages over lanes) and the reductions', no shared or local
    memory (no value changes lanes through memory); in planes one store per 32-bit word of codes (or group pair's
    high bytes), norm and scale-and-zero record; in slots with 4-bit values at head_dim >= 128
    (Plan.store_gluon_words) the words and halves Plan.halfword_run_stores gives each lane's runs of codes (pairs
    of 8-code groups) and the scale and zero, and the norm's half; in the other slots one store per 16 bits of a
    lane's codes and per fp16 field."""
    pytest.importorskip("triton.experimental.gluon")
    names = ["k3v4-d128", "k4v4-d128", "k3v3-d128", "k4v4-d64", "k3v4-d256", "k3v4-d128-planes", "k4v4-d128-planes",
             "k3v3-d128-planes"]
    reports = offline_compile_reports("-c", _STORE_GLUON_COMPILE, *names)
    assert [(report["name"], report["symmetric"]) for report in reports] == [
        (name, symmetric) for name in names for symmetric in (True, False)]
    for report in reports:
        key_bits, value_bits = (4, 4) if report["name"].startswith("k4v4") else (3, int(report["name"][3]))
        head_dim = int(report["name"].split("-")[1][1:])
        assert report["shuffles"] >= 3 * head_dim // 8 and report["shared"] == 0 and report["local"] == 0, report
        assert report["gathers"] == 0, report
        config = config_mod.resolve_arch(config_mod.load(REPO / f"configs/{report['name']}.yaml"), (9, 0))
        if report["name"].endswith("planes"):  # 32-bit words (and split codes' high bytes), scale and zero in one
            assert report["stores"] == 6, report
        elif Plan.from_config(config).store_gluon_words:
            pairs = head_dim // 128
            runs = [2 * key_bits] * pairs + [2 * value_bits] * pairs + [4]
            stores = [bits for run in runs for bits, _, _ in Plan.halfword_run_stores(run)]
            assert (report["words"], report["halves"]) == (stores.count(32), stores.count(16) + 1), report
        else:  # a lane's head_dim / 8 codes of a field in 16-bit words, and the three fp16 fields
            assert report["stores"] == report["halves"] == (key_bits + value_bits) * head_dim // 128 + 3, report
        assert "stack" not in report["usage"] or "0 bytes cumulative stack" in report["usage"], report


def test_the_stores_cell_search_renders_where_it_takes_fewer_instructions(monkeypatch):
    """The pending store_cell_search renders only when named, and then for the Gluon store's 4-bit keys and its
    norm-corrected 3-bit keys (planes), not for 3-bit slots (more SASS instructions there: Plan.store_cell_search)
    nor fp8 keys (no search)."""
    cases = {("k4v4", "slots"): True, ("k4v4", "planes"): True, ("k3v4", "planes"): True, ("k3v3", "planes"): True,
             ("k3v4", "slots"): False, ("k3v3", "slots"): False, ("k8v4", "slots"): False}
    for pending in (frozenset(), frozenset({"store_cell_search"})):
        for (preset, layout), takes in cases.items():
            overrides = dict(cache_layout="planes", norm_correction=True) if layout == "planes" else {}
            plan = Plan.from_config(make_config(preset, **overrides), pending=pending)
            assert (plan.store_cell_search is not None) == (takes and bool(pending)), (preset, layout, pending)


def test_the_cell_table_made_in_a_cuda_graph_capture_is_not_kept(tmp_path, monkeypatch):
    """The pending store_cell_search's table is kept per device as the default boundaries are, and, as they are,
    never one made inside a CUDA-graph capture (made from what the capture's kernels have not yet written): a capture
    takes the kept table, or makes its own without keeping it."""
    monkeypatch.setenv("TQGEN_PENDING_KERNELS", "store_cell_search")
    module = tqgen.load(make_config("k4v4"), tmp_path)
    monkeypatch.setattr(module, "_per_device", {})
    centroids = module.default_centroids("cpu")
    boundaries = codebook.decision_boundaries(centroids)
    capturing = [True]
    monkeypatch.setattr(module, "_capturing", lambda tensor: capturing[0])
    made_in_capture = module._store_search_table(boundaries, centroids)
    assert module._kept("store_search_table", centroids.device) is None
    capturing[0] = False
    kept = module._store_search_table(boundaries, centroids)
    assert kept is not made_in_capture and torch.equal(kept, made_in_capture)
    assert module._store_search_table(boundaries, centroids) is kept
    capturing[0] = True
    assert module._store_search_table(boundaries, centroids) is kept


@pytest.mark.parametrize("preset,head_dim,overrides", [
    ("k4v4", 128, {}), ("k4v4", 64, {}), ("k4v4", 256, {}),
    ("k4v4", 128, dict(cache_layout="planes", norm_correction=True)),
    ("k3v4", 128, dict(cache_layout="planes", norm_correction=True)),
    ("k3v3", 128, dict(cache_layout="planes", norm_correction=True))])
def test_the_stores_cell_table_gives_the_binary_searchs_codes(tmp_path, monkeypatch, preset, head_dim, overrides):
    """The pending store_cell_search: _cell_search_table of the default codebook, read as tq_store_gluon reads it (a
    cell of |y|, then the entry's count plus |y| >= its boundary; the square the high one where that holds), gives
    the binary search's half code, the count of the upper half's boundaries at or below |y|, and that code's squared
    centroid bit for bit: at every boundary and cell edge, one fp32 step either side, 0, 1, NaN and 20000 random
    coordinates."""
    monkeypatch.setenv("TQGEN_PENDING_KERNELS", "store_cell_search")
    config = make_config(preset, head_dim, **overrides)
    assert Plan.from_config(config).store_cell_search is not None
    module = tqgen.load(config, tmp_path)
    bits = config.key_bits
    shift = codebook.search_cells(bits, head_dim)
    assert (module.STORE_SEARCH_SHIFT, module.STORE_SEARCH_CELLS) == (shift, codebook.SEARCH_CELLS)
    centroids = module.default_centroids("cpu")
    boundaries = codebook.decision_boundaries(centroids)
    table = module._cell_search_table(boundaries, centroids)
    assert table.shape == (module.STORE_SEARCH_CELLS, 2 if module.KEY_NORM_CORRECTED else 1)
    half = 2 ** (bits - 1)
    upper = boundaries[half:]
    generator = torch.Generator().manual_seed(head_dim + bits)
    edges = (torch.arange(2**shift + 1) + 0.5) / 2**shift  # where the rounding to a cell ties
    magnitude = torch.cat([upper, torch.nextafter(upper, torch.tensor(math.inf)),
                           torch.nextafter(upper, torch.tensor(-math.inf)), torch.tensor([0.0, 1.0, math.nan]),
                           edges, torch.nextafter(edges, torch.tensor(math.inf)),
                           torch.nextafter(edges, torch.tensor(-math.inf)),
                           torch.rand(10000, generator=generator) * upper[-1] * 1.2,
                           torch.randn(10000, generator=generator).abs() / math.sqrt(head_dim)])
    entry = table[codebook.search_cell(magnitude, shift)]
    boundary = (entry[:, 0] & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    above = magnitude >= boundary
    half_code = (entry[:, 0] >> 32) + above
    expected = (magnitude[:, None] >= upper[None, :]).sum(1)  # the binary search's (a NaN's: 0)
    assert torch.equal(half_code, expected)
    if module.KEY_NORM_CORRECTED:
        words = torch.where(above, entry[:, 1] >> 32, entry[:, 1] & 0xFFFFFFFF).to(torch.int32)
        squares = centroids[half:] * centroids[half:]
        assert torch.equal(words, squares[expected].view(torch.int32))


@pytest.mark.parametrize("run_bytes", [2, 4, 6, 8, 12, 16])
def test_a_run_of_slot_bytes_is_its_words_and_a_half_at_each_unaligned_end(run_bytes):
    """Plan.halfword_run_stores, for a run starting at a word and 2 bytes into one: every byte stored once, each
    store aligned to its width, no half where a word fits (so runs of 6 and 8 bytes take 2-3 stores, not 3-4
    halves); the two starts' i-th stores of a width share an instruction."""
    stores = Plan.halfword_run_stores(run_bytes)
    for start in (0, 2):
        covered = []
        pieces = [(bits, at_word if start == 0 else mid_word) for bits, at_word, mid_word in stores]
        for bits, offset in pieces:
            if offset is None:
                continue
            assert (start + offset) % (bits // 8) == 0, (start, bits, offset)
            covered += range(offset, offset + bits // 8)
        assert sorted(covered) == list(range(run_bytes)), start
        halves = sum(1 for bits, offset in pieces if bits == 16 and offset is not None)
        assert halves == (run_bytes % 4) // 2 + (2 * (start == 2) if run_bytes % 4 == 0 else 0)
    if run_bytes == 6:  # a lane's 3-bit codes at head_dim 128: a word and a half from either start
        assert stores == [(32, 0, 2), (16, 4, 0)]
    if run_bytes == 8:  # its 4-bit codes: two words, or a half, a word and a half
        assert stores == [(32, 0, 2), (32, 4, None), (16, None, 0), (16, None, 6)]
    with pytest.raises(ValueError, match="positive even count, got 5"):
        Plan.halfword_run_stores(5)


GLUON_STORE_CASES = ([(preset, 128, order) for preset in ("k3v4", "k4v4", "k3v3")
                      for order in ("head_major", "position_major", "head_major_mid_word", "planes",
                                    "planes-uncorrected")]
                     + [(preset, head_dim, order) for preset, head_dim in (("k4v4", 64), ("k3v4", 256))
                        for order in ("head_major", "position_major", "head_major_mid_word")])


def _two_bytes_into_a_word(cache):
    """The same cache (shape, strides, bytes) at an address 2 bytes into a 32-bit word, which slots allow (fields
    are 2-byte aligned): every run of slot bytes then starts at the other place in its word."""
    buffer = torch.empty(cache.numel() + 2, dtype=torch.uint8, device=cache.device)
    moved = buffer.as_strided(cache.shape, cache.stride(), storage_offset=2)
    moved.copy_(cache)
    assert moved.data_ptr() % 4 == 2
    return moved


@pytest.mark.parametrize("preset,head_dim,order", GLUON_STORE_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("_", [pytest.param(None, id="cuda", marks=GPU)])
def test_the_gluon_store_writes_tq_stores_bytes_and_nothing_else(build_module, monkeypatch, preset, head_dim, order,
                                                                  dtype, _):
    """tq_store_gluon against tq_store on the same call: the same bytes (a key code may differ where its coordinate
    lies within rounding of a boundary, the fp16 norm by a unit in the last place: the norm's sum runs in another
    order), the reference's too; with the default codebook (half search), other centroids and given boundaries
    (the general one); skipped slots (negative, or past the cache unvalidated) and other slots untouched; tokens
    that do not fill the last program. Slots in either order (head_dim 64, 128, 256), and at an address 2 bytes into
    a word (where the word stores of Plan.store_gluon_words start elsewhere); planes with the norms corrected by the
    codes' centroids (the presets) or not."""
    config = (make_config(preset, cache_layout="planes", norm_correction=order == "planes")
              if order.startswith("planes") else make_config(preset, head_dim=head_dim))
    module = build_module(config)
    kernel = KernelRecorder(module.tq_store_gluon)
    monkeypatch.setattr(module, "tq_store_gluon", kernel)
    batch = paged_batch(config, [1, 15, 17, 40], num_kv_heads=3, device="cuda", dtype=dtype,
                        generator=torch.Generator().manual_seed(len(preset)))
    batch.slot_mapping[::7] = -1
    batch.slot_mapping[1] = batch.num_blocks * config.block_size + 3  # past the cache: skipped unvalidated
    inside = batch.slot_mapping < batch.num_blocks * config.block_size
    default = module.default_centroids("cuda")
    other = torch.sort(default * torch.linspace(0.8, 1.2, default.numel(), device="cuda")).values
    # Boundaries replace the centroids' midpoints, not the centroids (a corrected norm's): both passed.
    for codebook, centroids in ((dict(), default), (dict(centroids=other), other),
                                (dict(centroids=other, boundaries=reference.decision_boundaries(other)), other)):
        caches = []
        for gluon in (True, False):
            monkeypatch.setattr(module, "STORE_GLUON", gluon)
            cache = module.make_cache(batch.num_blocks, 3, "cuda").fill_(SENTINEL)
            if order == "position_major":
                cache = as_position_major(cache).contiguous()
            if order == "head_major_mid_word":
                cache = _two_bytes_into_a_word(cache)
            module.store(batch.key, batch.value, cache, batch.slot_mapping, validate=False, **codebook)
            caches.append(cache)
        expected = caches[1].clone().fill_(SENTINEL)
        reference.store(Layout.from_config(config), batch.key[inside], batch.value[inside], expected,
                        batch.slot_mapping[inside], module.default_rotation("cuda"), centroids)
        for cache in caches:
            assert store_differences(config, cache, expected, batch.key[inside], batch.slot_mapping[inside],
                                     module.default_rotation("cuda"), centroids) == 0
        assert store_differences(config, caches[0], caches[1], batch.key[inside], batch.slot_mapping[inside],
                                 module.default_rotation("cuda"), centroids) == 0
    assert [kwargs["SYMMETRIC_CODEBOOK"] for _, _, kwargs in kernel.launches] == [True, False, False]
