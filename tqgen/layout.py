"""The byte layout of one cache slot: the single source of truth.

A slot holds one token's key and value for one KV head (docs/format.md):

    MSE keys:  [key codes | key norm fp16] [value codes | value scale fp16 | value zero fp16] [pad]
    FP8 keys:  [key bytes (e4m3fn)       ] [value codes | value scale fp16 | value zero fp16] [pad]

Codes are packed little-endian, least significant bit first: element i of a
b-bit field occupies bits i*b .. i*b+b-1 of the field read as one bit stream.
Every consumer (templates, reference, store, tests, `tqgen show`) reads its
offsets from `Layout`; nothing else computes them.

Two cache layouts hold those slots (config `cache_layout`):

- "slots" (default, docs/format.md: the cache vLLM allocates): uint8 [num_blocks, page, num_kv_heads,
  slot_bytes]; each token's slot is contiguous.
- "planes" (tqgen's own): uint8 [num_blocks, num_kv_heads, page * slot_bytes]. One
  KV head's page is the page's slots transposed record by record: a *record* is a
  field as one token stores it (key codes, key norm, value codes, value scale+zero
  as 4 bytes, padding), and the record starting at slot byte `o` becomes a plane at
  page byte `page * o` holding the page's tokens in order, `record_bytes` apart.
  Same bytes per token; every plane is 16-byte aligned (pages of >= 8 tokens), so
  kernels read a token's codes with loads as wide as its record allows (16 bytes
  when the record is a multiple of 16 bytes, as at head_dim 128) and the scale and
  zero with one 32-bit load. 3-bit codes are the one change inside a record: they are stored as
  the 2-bit stream of the codes' low bits followed by the 1-bit stream of their high
  bits (same size), so that groups of 8 codes are 16- and 8-bit words; within a group
  the codes take the orders SPLIT_LOW_ORDER and SPLIT_HIGH_ORDER (see there).
  With norm correction (config `norm_correction`), "planes" also stores the key norm
  already corrected: ||k|| / sqrt(sum c^2 + 1e-16) of the token's centroids c, so that
  decode scales each score by the stored norm alone (`key_norm_corrected`). "slots" keeps
  docs/format.md's plain norm, and its decode divides by the centroid norm itself.
"""

from __future__ import annotations

import dataclasses
import math

from .config import Config

# The fp16 fields' record sizes in "planes": a key norm, and a value's scale and zero side by side.
KEY_NORM_BYTES = 2
VALUE_SCALE_ZERO_BYTES = 4


# Split 3-bit codes ("planes"), per group of 8: the code held by each 2-bit field of the
# low word, and by each bit of the high byte. With these orders the low and high bits of
# codes 0..3, and of codes 4..7, each reach the nibbles of a byte-permute selector (code
# k at bits 4k..4k+2) with three masked shifts of the group word: decode's codebook lookup.
SPLIT_LOW_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SPLIT_HIGH_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclasses.dataclass(frozen=True)
class CodeField:
    """One packed field of codes (or fp8 key bytes) as the kernels address it."""
    prefix: str  # "KEY" or "VALUE": the field's layout constants are {prefix}_CODE_OFFSET, {prefix}_CODE_BYTES, ...
    label: str  # what the field holds, for docstrings
    bits: int  # per element: 8 for fp8 key bytes
    offset: int  # slot byte where the field starts
    nbytes: int  # bytes per token (a planes record)
    split: bool  # 3-bit codes split into a 2-bit low stream and a 1-bit high stream ("planes")
    high_bits_at: int | None  # split codes: byte of the record where the high-bit stream starts

    @property
    def alignment(self) -> int:
        """How each token's record of this field is aligned in "planes"."""
        return row_alignment(self.nbytes)

    @property
    def high_bits_alignment(self) -> int:
        """Split codes: how the high-bit stream of each token's record is aligned in "planes"."""
        return row_alignment(self.high_bits_at, self.alignment)


def row_alignment(*sizes: int) -> int:
    """Alignment of a "planes" row: gcd(16, sizes). Pages and planes start 16-byte aligned, so
    a record of `size` bytes starts gcd(16, size)-aligned for every token (the kernels' hints)."""
    return math.gcd(16, *sizes)


def packed_bytes(count: int, bits: int) -> int:
    """Bytes needed for `count` codes of `bits` bits each."""
    return (count * bits + 7) // 8


@dataclasses.dataclass(frozen=True)
class Layout:
    head_dim: int
    key_format: str  # "mse" or "fp8"
    key_bits: int  # bits per key element (8 for fp8)
    value_bits: int
    page_size: int = 16  # tokens per cache block
    cache_layout: str = "slots"  # or "planes" (see the module docstring)
    norm_correction: bool = False  # MSE keys: scores use the centroid vector rescaled to unit length

    @classmethod
    def from_config(cls, config: Config) -> "Layout":
        return cls(config.head_dim, config.key_format, config.key_bits, config.value_bits,
                   config.block_size, config.cache_layout, config.norm_correction)

    @property
    def planes(self) -> bool:
        return self.cache_layout == "planes"

    # --- the cache tensor ---------------------------------------------------
    @property
    def heads_dim(self) -> int:
        """The KV-head dim of the cache tensor."""
        return 1 if self.planes else 2

    @property
    def cache_stride_dims(self) -> tuple[int, ...]:
        """The dims of the cache tensor whose strides the kernels take (block, [position,] head)."""
        return (0, 1) if self.planes else (0, 1, 2)

    @property
    def cache_shape_text(self) -> str:
        """The cache tensor's shape, as docstrings and errors spell it."""
        if self.planes:
            return f"[num_blocks, num_kv_heads, {self.page_bytes}] (page-planar)"
        return f"[num_blocks, {self.page_size}, num_kv_heads, {self.slot_bytes}]"

    # --- keys -------------------------------------------------------------
    @property
    def key_fp8(self) -> bool:
        return self.key_format == "fp8"

    @property
    def key_code_offset(self) -> int:
        """Offset of the key codes (MSE) or of the fp8 key bytes."""
        return 0

    @property
    def key_code_bytes(self) -> int:
        return packed_bytes(self.head_dim, self.key_bits)

    @property
    def key_norm_offset(self) -> int | None:
        """Offset of the fp16 key norm; None for fp8 keys, which have none."""
        return None if self.key_fp8 else self.key_code_bytes

    @property
    def key_norm_corrected(self) -> bool:
        """Whether the stored key norm is already divided by the norm of the token's centroid
        vector ("planes" with norm correction): decode then needs no centroid squares, which
        cost the tensor-core stage 1 a second MMA and 10 registers (ptxas, sm90)."""
        return self.planes and not self.key_fp8 and self.norm_correction

    @property
    def norm_correction_at_decode(self) -> bool:
        """Whether readers of the cache divide by the centroid norm themselves ("slots")."""
        return self.norm_correction and not self.key_fp8 and not self.key_norm_corrected

    @property
    def _key_norm_name(self) -> str:
        return "key norm, corrected" if self.key_norm_corrected else "key norm"

    @property
    def key_packed_bytes(self) -> int:
        """KPS (key packed size): every key byte of the slot."""
        return self.key_code_bytes + (0 if self.key_fp8 else 2)

    # --- values -----------------------------------------------------------
    @property
    def value_code_offset(self) -> int:
        return self.key_packed_bytes

    @property
    def value_code_bytes(self) -> int:
        return packed_bytes(self.head_dim, self.value_bits)

    @property
    def value_scale_offset(self) -> int:
        return self.value_code_offset + self.value_code_bytes

    @property
    def value_zero_offset(self) -> int:
        return self.value_scale_offset + 2

    # --- the slot ---------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self.value_zero_offset + 2

    @property
    def slot_bytes(self) -> int:
        """Rounded up to an even size; no other padding (slots are not 4- or 16-byte aligned)."""
        return self.used_bytes + (self.used_bytes & 1)

    @property
    def halfword_aligned(self) -> bool:
        """Every field starts at an even byte (true unless head_dim / 8 is odd with 3-bit codes).

        Slots are even-sized, so kernels may then read every field 16 bits at a
        time (half the load instructions of byte reads), given an even cache
        address and even strides, which the launchers check.
        """
        return self.key_code_bytes % 2 == 0 and self.value_code_bytes % 2 == 0

    @property
    def fp16_bytes_per_token(self) -> int:
        """What the same token and head costs in a plain fp16 K/V cache."""
        return 2 * 2 * self.head_dim

    # --- the page-planar layout ("planes") --------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one KV head's page: the last dim of a "planes" cache."""
        return self.page_size * self.slot_bytes

    def records(self) -> list[tuple[str, int, int]]:
        """(name, slot offset, bytes) of each record: what "planes" stores per token and plane."""
        rows = [("key values (fp8 e4m3fn)" if self.key_fp8 else "key codes", self.key_code_offset, self.key_code_bytes)]
        if not self.key_fp8:
            rows.append((self._key_norm_name, self.key_norm_offset, 2))
        rows.append(("value codes", self.value_code_offset, self.value_code_bytes))
        rows.append(("value scale and zero", self.value_scale_offset, 4))
        if self.slot_bytes != self.used_bytes:
            rows.append(("padding", self.used_bytes, self.slot_bytes - self.used_bytes))
        return rows

    def plane_offset(self, slot_offset: int) -> int:
        """Page byte where the plane of the record starting at `slot_offset` begins."""
        return self.page_size * slot_offset

    def split_high_bits(self, bits: int) -> bool:
        """3-bit codes in "planes" are a 2-bit low stream then a 1-bit high stream."""
        return self.planes and bits == 3

    @property
    def key_codes(self) -> CodeField:
        label = "fp8 key bytes" if self.key_fp8 else "key codes"
        return self._code_field("KEY", label, self.key_bits, self.key_code_offset, self.key_code_bytes)

    @property
    def value_codes(self) -> CodeField:
        return self._code_field("VALUE", "value codes", self.value_bits, self.value_code_offset,
                                self.value_code_bytes)

    def _code_field(self, prefix: str, label: str, bits: int, offset: int, nbytes: int) -> CodeField:
        split = self.split_high_bits(bits)
        return CodeField(prefix, label, bits, offset, nbytes, split, self.high_bits_offset if split else None)

    def split_shift_terms(self, stream: str) -> tuple[int, ...]:
        """Split 3-bit codes: where code k of a group goes in its word of the `stream` ("low" bits at
        2-bit fields, "high" bits at 1-bit fields) as a sum over the bits of k, k = k0 + 2 k1 + 4 k2:
        (shift of k0, of k1, of k2). The orders permute code bits, so the position is linear in them."""
        if stream == "low":
            position = [2 * SPLIT_LOW_ORDER.index(code) for code in range(8)]
        else:
            position = [SPLIT_HIGH_ORDER.index(code) for code in range(8)]
        terms = tuple(position[1 << bit] for bit in range(3))
        assert all(position[code] == sum(terms[b] for b in range(3) if code >> b & 1) for code in range(8))
        return terms

    @property
    def has_split_codes(self) -> bool:
        """Whether the key or the value codes are split 3-bit codes."""
        return self.split_high_bits(self.key_bits) or self.split_high_bits(self.value_bits)

    def group_word_bit(self, bits: int, code: int, bit: int) -> int:
        """Where bit `bit` of code `code` (0..7) of a group of 8 codes sits in the group's word,
        as the kernels load it (`_load_*_words`): a little-endian bit stream, except split
        3-bit codes, whose 2-bit low parts fill bits 0..15 and high bits 16..23 in the
        orders SPLIT_LOW_ORDER and SPLIT_HIGH_ORDER."""
        if self.split_high_bits(bits):
            if bit < 2:
                return 2 * SPLIT_LOW_ORDER.index(code) + bit
            return 16 + SPLIT_HIGH_ORDER.index(code)
        return bits * code + bit

    @property
    def high_bits_offset(self) -> int:
        """Byte within a split 3-bit record where the high-bit stream starts."""
        return packed_bytes(self.head_dim, 2)

    def fields(self) -> list[tuple[str, int, int]]:
        """(name, offset, size) of every field in slot order, padding included."""
        rows = []
        if self.key_fp8:
            rows.append(("key values (fp8 e4m3fn)", self.key_code_offset, self.key_code_bytes))
        else:
            rows.append((f"key codes ({self.key_bits}-bit)", self.key_code_offset, self.key_code_bytes))
            rows.append((f"{self._key_norm_name} (fp16)", self.key_norm_offset, 2))
        rows.append((f"value codes ({self.value_bits}-bit)", self.value_code_offset, self.value_code_bytes))
        rows.append(("value scale (fp16)", self.value_scale_offset, 2))
        rows.append(("value zero (fp16)", self.value_zero_offset, 2))
        if self.slot_bytes != self.used_bytes:
            rows.append(("padding", self.used_bytes, self.slot_bytes - self.used_bytes))
        return rows

    @property
    def slot_field_alignment(self) -> int:
        """How every field of every slot is aligned in "slots" (slots start 16-byte aligned in a 16-byte aligned
        cache): gcd(16, the slot size, each field's offset)."""
        offsets = [self.key_code_offset, self.value_code_offset, self.value_scale_offset]
        if not self.key_fp8:
            offsets.append(self.key_norm_offset)
        return row_alignment(self.slot_bytes, *offsets)

    @property
    def slot_fields_word_aligned(self) -> bool:
        """Whether every field of a slot starts 4-byte aligned in every slot (as for fp8 keys with 4-bit values
        at head dims that are multiples of 8), so that 4-byte copies and stores can move them (cp.async copies
        no less)."""
        return self.slot_field_alignment % 4 == 0

    def constants(self) -> dict[str, int]:
        """The layout as the UPPER_CASE constants baked into emitted modules."""
        out = {
            "HEAD_DIM": self.head_dim,
            "KEY_BITS": self.key_bits,
            "VALUE_BITS": self.value_bits,
            "KEY_CODE_OFFSET": self.key_code_offset,
            "KEY_CODE_BYTES": self.key_code_bytes,
        }
        if not self.key_fp8:
            out["KEY_NORM_OFFSET"] = self.key_norm_offset
        out.update(
            KEY_PACKED_BYTES=self.key_packed_bytes,
            VALUE_CODE_OFFSET=self.value_code_offset,
            VALUE_CODE_BYTES=self.value_code_bytes,
            VALUE_SCALE_OFFSET=self.value_scale_offset,
            VALUE_ZERO_OFFSET=self.value_zero_offset,
            SLOT_BYTES=self.slot_bytes,
        )
        if self.planes:
            out.update(
                PAGE_BYTES=self.page_bytes,
                KEY_CODE_PLANE=self.plane_offset(self.key_code_offset),
                VALUE_CODE_PLANE=self.plane_offset(self.value_code_offset),
                VALUE_SCALE_PLANE=self.plane_offset(self.value_scale_offset),  # scale and zero, 4 bytes per token
            )
            if not self.key_fp8:
                out["KEY_NORM_PLANE"] = self.plane_offset(self.key_norm_offset)
            if self.split_high_bits(self.key_bits):
                out["KEY_HIGH_BITS_AT"] = self.high_bits_offset
            if self.split_high_bits(self.value_bits):
                out["VALUE_HIGH_BITS_AT"] = self.high_bits_offset
        return out
