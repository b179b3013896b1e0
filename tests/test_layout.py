"""The slot layout against format.md, and the bit packing the layout implies."""

import pytest
import torch

from tqgen import reference
from tqgen.config import from_mapping
from tqgen.layout import Layout

# format.md's worked sizes: (head_dim, k8v4, k4v4, k3v4, k3v3)
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
    norm, so its readers must not divide again; "slots" (format.md) and uncorrected configs store ||k||."""
    layout = Layout(128, "mse", 3, 4, 16, cache_layout, norm_correction)
    assert layout.key_norm_corrected == corrected
    assert layout.norm_correction_at_decode == (norm_correction and not corrected)
    names = [name for name, _, _ in layout.fields()]
    assert ("key norm, corrected (fp16)" in names) == corrected and ("key norm (fp16)" in names) != corrected
    assert not Layout(128, "fp8", 8, 4, 16, cache_layout, False).key_norm_corrected
