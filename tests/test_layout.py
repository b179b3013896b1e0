"""The slot layout against docs/format.md, and the bit packing the layout implies."""

import math

import pytest
import torch

from conftest import PRESETS, make_config, planes_config
from tqgen import config as config_mod, reference
from tqgen.config import from_mapping
from tqgen.errors import ConfigError
from tqgen.layout import SPLIT_HIGH_ORDER, SPLIT_LOW_ORDER, Layout, row_alignment
from tqgen.plan import Plan

# docs/format.md's worked sizes: (head_dim, k8v4, k4v4, k3v4, k3v3)
WORKED_SIZES = [(128, 196, 134, 118, 102), (64, 100, 70, 62, 54), (256, 388, 262, 230, 198)]
PRESET_FIELDS = [
    dict(key_format="fp8", value_bits=4),
    dict(key_format="mse", key_bits=4, value_bits=4),
    dict(key_format="mse", key_bits=3, value_bits=4),
    dict(key_format="mse", key_bits=3, value_bits=3),
]


@pytest.mark.parametrize("head_dim,sizes", [(row[0], row[1:]) for row in WORKED_SIZES])
def test_slot_bytes_match_format_md(head_dim, sizes):
    for fields, expected in zip(PRESET_FIELDS, sizes):
        layout = Layout.from_config(from_mapping(dict(fields, head_dim=head_dim)))
        assert layout.slot_bytes == expected, fields


def test_k3v4_d128_offsets():
    layout = Layout.from_config(from_mapping(dict(key_format="mse", key_bits=3, value_bits=4, head_dim=128)))
    assert layout.constants() == {
        "HEAD_DIM": 128, "KEY_BITS": 3, "VALUE_BITS": 4,
        "KEY_CODE_OFFSET": 0, "KEY_CODE_BYTES": 48, "KEY_NORM_OFFSET": 48, "KEY_PACKED_BYTES": 50,
        "VALUE_CODE_OFFSET": 50, "VALUE_CODE_BYTES": 64, "VALUE_SCALE_OFFSET": 114, "VALUE_ZERO_OFFSET": 116,
        "SLOT_BYTES": 118,
    }


def test_fp8_keys_have_no_norm_and_kps_is_head_dim():
    layout = Layout.from_config(from_mapping(dict(key_format="fp8", value_bits=3, head_dim=96)))
    assert layout.key_norm_offset is None and "KEY_NORM_OFFSET" not in layout.constants()
    assert layout.key_packed_bytes == 96
    assert layout.value_code_offset == 96 and layout.value_code_bytes == 36
    assert layout.used_bytes == 136 and layout.slot_bytes == 136


@pytest.mark.parametrize("head_dim", range(64, 257, 8))
@pytest.mark.parametrize("fields", PRESET_FIELDS)
def test_fields_tile_the_slot_without_gaps(head_dim, fields):
    layout = Layout.from_config(from_mapping(dict(fields, head_dim=head_dim)))
    position = 0
    for _, offset, size in layout.fields():
        assert offset == position and size > 0
        position += size
    assert position == layout.slot_bytes and layout.slot_bytes % 2 == 0
    assert layout.slot_bytes - layout.used_bytes in (0, 1)


def test_four_bit_element_2j_is_the_low_nibble_of_byte_j():
    codes = torch.tensor([[0x1, 0xA, 0x3, 0xF]])
    assert reference.pack_codes(codes, 4).tolist() == [[0xA1, 0xF3]]


def test_three_bit_stream_is_little_endian_lsb_first():
    # codes 0..7: bit stream of element i at bits 3i..3i+2 of the 24-bit word.
    codes = torch.arange(8)[None, :]
    word = sum(i << (3 * i) for i in range(8))
    assert reference.pack_codes(codes, 3).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip(bits):
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, 96), generator=generator)
    packed = reference.pack_codes(codes, bits)
    assert packed.shape == (5, 96 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(reference.unpack_codes(packed, bits, 96), codes)


@pytest.mark.parametrize("cache_layout,norm_correction,corrected", [("planes", True, True), ("planes", False, False),
                                                                      ("slots", True, False)])
def test_only_planes_with_norm_correction_stores_corrected_norms(cache_layout, norm_correction, corrected):
    """The key norm field's meaning: "planes" under norm correction stores it divided by the centroid
    norm, so its readers must not divide again; "slots" (docs/format.md) and uncorrected configs store ||k||."""
    layout = Layout(128, "mse", 3, 4, 16, cache_layout, norm_correction)
    assert layout.key_norm_corrected == corrected
    assert layout.norm_correction_at_decode == (norm_correction and not corrected)
    names = [name for name, _, _ in layout.fields()]
    assert ("key norm, corrected (fp16)" in names) == corrected and ("key norm (fp16)" in names) != corrected
    assert not Layout(128, "fp8", 8, 4, 16, cache_layout, False).key_norm_corrected


# --- the page-planar layout ("planes") ---------------------------------------------------------
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

    plan = Plan.from_config(make_config("k3v4" if bits == 3 else "k4v4", key_bits=bits, cache_layout=layout_name))
    layout = plan.layout
    generator = np.random.default_rng(bits)
    words = generator.integers(0, 1 << (8 * bits), size=4096, dtype=np.int64)
    if layout.split_high_bits(bits):
        words = words & 0xFFFFFF
    word = words.astype(np.uint32).view(np.int32)  # the kernel's int32 words (sign bit included)
    for first in (0, 4):
        selector = eval(plan.nibble_selector(bits, "word", first), {"word": word}).astype(np.int64)
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
    assert "planes" in planes.artifact_name().split("_") and "planes" not in implicit.artifact_name()
    # An arch follows the layout (arch auto, whose module is the dispatcher over every arch, names none).
    assert config_mod.resolve_arch(planes, (9, 0)).artifact_name() == planes.artifact_name() + "_sm90"
