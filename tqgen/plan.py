"""The kernel plan of one config: its byte layout plus every per-arch kernel decision.

`Plan.from_config` is the one object the templates read (render.py hands them
`plan.template_names()`): the layout's facts and named constants, which kernels a
module carries and which paths they take on its arch, and the few expressions that
are generated from layout facts (field addresses here; code selectors and the
store's search in code_expressions.py, which Plan inherits). Nothing in the templates
computes an offset or a bit position; nothing here renders text beyond single
expressions.

Decisions, each with its reason:
- `fp8_hardware`: sm89 and later convert e4m3 to fp16 in hardware; older archs move
  the bit fields (Triton's float8e4b15 is a different format).
- `mma_stage1`: the Gluon stage 1 on mma.sync exists for "planes" at head_dim 64, 128
  or 256 (each lane then decodes whole units of a record) with MSE keys or hardware
  fp8, and 4-bit values, or 3-bit values from head_dim 128 (a lane's low-bit words then
  fill 32-bit loads); and for "slots" with hardware fp8 keys and 4-bit values, whose
  fields and slots are 4-byte aligned (`Layout.slot_fields_word_aligned`): the same
  decode, fed by 4-byte copies of each token's fields; and for "slots" with 3- or 4-bit
  MSE keys and 4-bit values at head_dim 64, 128 or 256, or k3v3 at 128 (`mma_halfword_slots`), whose fields are
  only 2-byte aligned: the copies start at the 4-byte word at or before each field and
  the reader shifts by 16 bits where the field starts mid-word (one byte permute per
  word); the norm correction is computed per tile (the slot holds the original norm).
- `stage1_rotates_query`: MSE keys under the Hadamard rotation at head_dim 128 (the only one
  timed), both layouts: stage 1 can rotate the query itself at small batches, one launch fewer
  than tq_prepare_query.
- `symmetric_key_lookup`: the Gluon stage 1 on 4-bit MSE keys carries a second codebook lookup
  for codebooks with c[15 - i] == -c[i] (the default Lloyd-Max levels, recognized by address): a
  table of the 8 magnitudes takes one byte permute per four codes where 16 entries take three.
  3-bit keys gain nothing from it (their 8 entries already fit one permute).
- `min_capability`: 8.9 for hardware fp8 keys, else 8.0 (mma.sync, cp.async).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

from . import codebook
from .code_expressions import CodeExpressions
from .config import Config
from .errors import TqgenError
from .layout import KEY_NORM_BYTES, SPLIT_HIGH_ORDER, SPLIT_LOW_ORDER, VALUE_SCALE_ZERO_BYTES, CodeField, Layout

# Archs with a hardware e4m3 -> fp16 converter that Triton uses.
FP8_HARDWARE_ARCHES = ("sm89", "sm90", "sm100")
# Head dims the Gluon stage 1's tiles divide.
MMA_HEAD_DIMS = (64, 128, 256)
# The launches decode runs (decode/launch.py.jinja checks them; the tuner and tuned files keep to them): tiles of a
# power of two from MIN_BLOCK_KV tokens (the launcher's _MIN_BLOCK_KV says why not 16), a power of two of warps up
# to MAX_NUM_WARPS (1024 threads a program).
MIN_BLOCK_KV = 32
MAX_NUM_WARPS = 32


# Kernel changes that passed the GPU tests but change the decode hash of committed tuned files wait here until those
# files are re-tuned, and kernel changes made while no GPU was left wait for their first GPU run (docs/tuning.md,
# "Kernels waiting for a re-tune"), so that they are kept and tested meanwhile. Every module renders without them
# unless TQGEN_PENDING_KERNELS names them ("all", or names joined by commas): the GPU tests and the run that lands
# them do.
PENDING_KERNELS: dict[str, str] = {  # name -> what it changes (docs/tuning.md)
    "store_cell_search": "tq_store_gluon searches the default codebook by a table of cells (Plan.store_cell_search): "
                         "the store's kernel only, no tuned file; waits for its first GPU run",
}
# A pending kernel lands format by format, each in the commit that holds its re-tuned files (a re-tune of every file
# a kernel touches can be more than one session's device time): the formats here (Plan.stage1_format, as the config
# files spell them) render it without TQGEN_PENDING_KERNELS. Landing its last format removes its entries here and
# above and its switch in the templates.
PENDING_KERNELS_LANDED: dict[str, frozenset[str]] = {}
# Formats a pending kernel leaves as they are, because it made them slower.
PENDING_KERNELS_SLOWER: dict[str, frozenset[str]] = {}


def pending_kernels_from_environment() -> frozenset[str]:
    """The PENDING_KERNELS that TQGEN_PENDING_KERNELS names (none where it is unset or empty)."""
    text = os.environ.get("TQGEN_PENDING_KERNELS", "").strip()
    if text in ("all", "1"):
        return frozenset(PENDING_KERNELS)
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(names - set(PENDING_KERNELS))
    if unknown:
        raise TqgenError(f"TQGEN_PENDING_KERNELS names {', '.join(unknown)}: expected 'all' or some of "
                         f"{', '.join(PENDING_KERNELS)}")
    return names


def decode_runs_launch(block_kv: int, num_warps: int) -> bool:
    """Whether decode takes a launch of these tile and warp counts (positive ints)."""
    return (block_kv >= MIN_BLOCK_KV and block_kv & (block_kv - 1) == 0 and num_warps <= MAX_NUM_WARPS
            and num_warps & (num_warps - 1) == 0)


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


# Variants of the Gluon stage 1 that tools/stage1_variants.py times beside the shipped kernel (MSE keys):
# "load_only" keeps every global load of the loop and drops the decode and the MMAs (the loaded words are
# folded into a result, so the loads stay); "compute_only" keeps the decode and the MMAs and loads nothing
# in the loop (its words are made from the addresses, in registers). "extra_alu" and "extra_fma" add 80 independent
# instructions per tile on the integer pipe (lop3) or the FMA pipe (ffma) to the shipped kernel, whose results
# reach the output: how much a tile's time grows with each pipe's load tells which one the kernel waits on.
# Modules render "shipped".
# Experiments that were measured, lost and were removed (docs/limits.md has their numbers; their code is at commit
# 627aebf): "pair_table" / "pair_table16" (key lookups from a table of fp16 pairs in shared memory), "split_warpsN"
# (N one-warp workers a CTA, merged in shared memory) and "prefetch_next" (block ids a tile ahead, L2 prefetches).
STAGE1_VARIANTS = ("shipped", "load_only", "compute_only", "extra_alu", "extra_fma")
# Instructions per tile that the extra_alu / extra_fma variants add (4 independent chains of 20).
EXTRA_WORK_CHAINS, EXTRA_WORK_STEPS = 4, 20


@dataclasses.dataclass(frozen=True)
class RingField:
    """One plane of a page that the Gluon stage 1's cp.async ring copies into shared memory.

    The copy holds [pages, positions, units] (units == 0: [pages, positions], one unit per token) of
    `dtype` for one tile; the kernel reads it back in the register layout `read_layout`, the same
    one its direct loads use, so the decode after it is one piece of code.
    """
    name: str  # the shared buffer is `{name}_ring`, its copy layout `{NAME}_COPY`
    dtype: str  # gl dtype of a unit
    unit_bytes: int
    units: int  # per token; 0 for a per-token field (norm, scale and zero)
    plane: str  # page byte where the units of position 0 start, in the kernels' layout constants
    record: str  # bytes from one token's units to the next one's
    alignment: int  # bytes: how each token's units are aligned (the widest cp.async they allow)
    read_layout: str  # the constexpr layout the kernel reads them in
    # "slots" with 2-byte aligned fields (Plan.mma_halfword_slots) only: which 32-bit words the units are, counted
    # from the word at or before the field (the field starts `shift` bytes into it, 0 or 2): unit j is word
    # first + (shift + j // run * lane_bytes) // 4 + j % run, run words for each lane's lane_bytes bytes (a gather).
    words: tuple[int, int, int] = (0, 0, 0)  # (first, run, lane_bytes); run 0: unit j is word first + j

    @property
    def vector(self) -> int:
        """Units per cp.async (at most 16 bytes, at most one token's units, never past the alignment)."""
        return max(1, min(self.units or 16 // self.unit_bytes, self.alignment // self.unit_bytes))


class StoreCellSearch(NamedTuple):
    """The store's table search of the default codebook (Plan.store_cell_search): y's cell is the low bits of
    |y| * 2**shift + rounding, one of `cells` (codebook.search_cell)."""
    shift: int
    cells: int
    rounding: float


@dataclasses.dataclass(frozen=True)
class Plan(CodeExpressions):
    config: Config
    layout: Layout
    stage1_variant: str = "shipped"  # an experiment of tools/stage1_variants.py; wrong results on purpose
    pending: frozenset[str] = frozenset()  # the PENDING_KERNELS this plan renders

    @classmethod
    def from_config(cls, config: Config, stage1_variant: str = "shipped",
                    pending: frozenset[str] | None = None) -> "Plan":
        """The plan of a resolved config; `pending` (default: TQGEN_PENDING_KERNELS) picks PENDING_KERNELS."""
        if config.arch == "auto":
            raise ValueError("resolve the arch (config.resolve_arch) before planning kernels")
        pending = pending_kernels_from_environment() if pending is None else frozenset(pending)
        if not pending <= set(PENDING_KERNELS):
            raise ValueError(f"pending kernels {', '.join(sorted(pending - set(PENDING_KERNELS)))}: expected some of "
                             f"{', '.join(PENDING_KERNELS)}")
        plan = cls(config, Layout.from_config(config), stage1_variant, pending)
        if stage1_variant not in STAGE1_VARIANTS:
            raise ValueError(f"stage1_variant {stage1_variant!r}: expected one of {', '.join(STAGE1_VARIANTS)}")
        if stage1_variant != "shipped" and (plan.key_fp8 or not plan.mma_stage1 or not plan.planes):
            raise ValueError(f"stage1_variant {stage1_variant!r} exists for the Gluon stage 1 with MSE keys only, "
                             "in planes")
        return plan

    # --- shapes -------------------------------------------------------------
    @property
    def D(self) -> int:  # noqa: N802 (the templates' name for the head dim)
        return self.config.head_dim

    @property
    def D_PAD(self) -> int:  # noqa: N802
        """The head dim rounded up to a power of two: the width of a tensor of head dims."""
        return next_power_of_two(self.config.head_dim)

    @property
    def GROUPS(self) -> int:  # noqa: N802
        """Groups of 8 codes per code plane in the tl.dot stage 1; >= 16 because tl.dot needs K >= 16."""
        return max(16, next_power_of_two(self.config.head_dim // 8))

    @property
    def PAGE(self) -> int:  # noqa: N802
        return self.config.block_size

    @property
    def padded_dims(self) -> bool:
        """Whether tensors of head dims are wider than the head dim (masks needed past it)."""
        return self.D != self.D_PAD

    @property
    def padded_groups(self) -> bool:
        """Whether tensors of code groups (GROUPS, or D_PAD // 8) are wider than the head dim's D // 8."""
        return self.GROUPS != self.D // 8

    @property
    def table_registers(self) -> int:
        """int32 registers per codebook byte table: 4 entries each, 8 entries at least."""
        return max(2, 2**self.layout.key_bits // 4)

    # --- per-arch decisions (see the module docstring) ------------------------
    @property
    def arch(self) -> str:
        return self.config.arch

    @property
    def key_fp8(self) -> bool:
        return self.layout.key_fp8

    @property
    def planes(self) -> bool:
        return self.layout.planes

    @property
    def fp8_hardware(self) -> bool:
        return self.config.arch in FP8_HARDWARE_ARCHES

    @property
    def mma_stage1(self) -> bool:
        layout = self.layout
        keys_ok = not layout.key_fp8 or self.fp8_hardware
        values_ok = layout.value_bits == 4 or (layout.value_bits == 3 and layout.head_dim >= 128)
        slots_ok = layout.key_fp8 and layout.value_bits == 4 and layout.slot_fields_word_aligned
        return ((layout.planes or slots_ok) and keys_ok and values_ok and layout.head_dim in MMA_HEAD_DIMS
                or self.mma_halfword_slots)

    @property
    def mma_halfword_slots(self) -> bool:
        """"slots" with MSE keys on the Gluon stage 1 (3- or 4-bit keys and values, head_dim 128): slots are
        2-byte aligned (their size is 2 mod 4), so every field starts at byte 0 or 2 of a 32-bit word, by the
        parity of its position and the offset of its head. Each token's words are copied from the word at or
        before each field and shifted by a byte permute per word where the field starts mid-word. Only with a
        ring (STAGES >= 2). 3-bit values with 3-bit keys only (k3v3): 4-bit keys with 3-bit values pass the CPU
        emulation and compile, but have not run on a GPU yet, so they keep the tl.dot kernel. At head_dim 64 and
        256: 4-bit values, and keys whose lanes' bytes are whole words (so not 3-bit keys at 64, whose lanes take 6
        bytes each)."""
        layout = self.layout
        if layout.planes or layout.key_fp8 or layout.key_bits not in (3, 4):
            return False
        if layout.head_dim == 128:
            return layout.value_bits == 4 or (layout.value_bits, layout.key_bits) == (3, 3)
        return layout.head_dim in (64, 256) and layout.value_bits == 4 and self.halfword_key_lane_bytes % 4 == 0

    @property
    def halfword_key_lane_bytes(self) -> int:
        """mma_halfword_slots: the key code bytes each of a token's 4 key lanes decodes (a quarter of its groups)."""
        return self.layout.key_bits * self.D // 32

    @property
    def extra_work_shape(self) -> tuple[int, int]:
        """(chains, steps) of the extra_alu / extra_fma variants' added instructions per tile."""
        return EXTRA_WORK_CHAINS, EXTRA_WORK_STEPS

    @property
    def symmetric_key_lookup(self) -> bool:
        return self.mma_stage1 and not self.layout.key_fp8 and self.layout.key_bits == 4

    @property
    def multi_warpgroup(self) -> bool:
        """decode_multi's programs of 17-32 MMA columns run on one warpgroup (decode/multi_warpgroup.py.jinja): MSE
        keys of 4 bits (the symmetric lookup) or split 3 bits, fp8 keys (multi_warpgroup_fp8_keys),
        4-bit values (16-bit units of 4 codes, a lane's share of out^T's rows) or split 3-bit ones
        (multi_warpgroup_split_values), planes, head_dim 128, 16-token pages (a 64-token tile is a page a warp)."""
        layout = self.layout
        keys_ok = (self.symmetric_key_lookup or (self.mma_stage1 and not layout.key_fp8 and self.key_codes.split)
                   or self.multi_warpgroup_fp8_keys)
        values_ok = layout.value_bits == 4 or self.multi_warpgroup_split_values
        return keys_ok and values_ok and layout.planes and layout.head_dim == 128 and layout.page_size == 16

    @property
    def multi_warpgroup_fp8_keys(self) -> bool:
        """The warpgroup kernel takes fp8 keys: each lane's e4m3 bytes converted to fp16 in the single-token kernel's
        order, the caller's query loaded and scaled in the kernel (no rotation, no norm)."""
        return self.mma_stage1 and self.layout.key_fp8

    @property
    def multi_warpgroup_split_values(self) -> bool:
        """The warpgroup kernel's values are split 3-bit codes (k3v3 planes): warp 2c + h decodes low byte h of the
        16-bit low words of groups 8c..8c + 7 (4 codes of each group a lane, the 4 rows a lane holds of each token),
        each code's high bit shifted in beside its low bits (multi_warpgroup_value_code)."""
        return self.layout.split_high_bits(self.layout.value_bits)

    def multi_warpgroup_value_code(self, low_byte: int, field: int) -> int:
        """Split 3-bit values in the warpgroup kernel: which code of a group (0..7) sits in 2-bit field `field`
        (0..3) of low byte `low_byte` (0, 1) of the group's 16-bit low word. The kernel relies on two facts of the
        split orders, checked here: that code's high bit is bit 2 field + low_byte of the group's high byte (so one
        shift by 2 - low_byte puts every high bit of the byte's 4 codes beside their low bits), and the code is
        4 r + 2 low_byte + s for field r + 2 s (the order in which out^T's rows come back to head dims)."""
        code = SPLIT_LOW_ORDER[4 * low_byte + field]
        assert SPLIT_HIGH_ORDER.index(code) == 2 * field + low_byte, "a high bit out of its low byte's pattern"
        assert code == 4 * (field & 1) + 2 * low_byte + (field >> 1), "codes out of the rows' head-dim order"
        return code

    @property
    def multi_warpgroup_ring_fields(self) -> list[RingField]:
        """What the warpgroup kernel's ring copies per tile: ring_fields, but 4-bit value codes as 16-bit units (4
        codes each; warp w decodes units 8w..8w + 7 of every token), split 3-bit ones as each group's 16-bit low word
        and its high byte (unit j of each: group j)."""
        value = self.ring_field("value")
        if self.multi_warpgroup_split_values:
            high = self.ring_field("value_high")
            replaced = {"value": dataclasses.replace(value, dtype="gl.int16", unit_bytes=2, units=self.D // 8),
                        "value_high": dataclasses.replace(high, dtype="gl.uint8", unit_bytes=1, units=self.D // 8)}
        else:
            replaced = {"value": dataclasses.replace(value, dtype="gl.int16", unit_bytes=2, units=value.units * 2)}
        return [replaced.get(field.name, field) for field in self.ring_fields]

    @property
    def hadamard_keys(self) -> bool:
        """MSE keys under the config's Hadamard rotation: the store rotates them by a Walsh-Hadamard transform
        (and stage 1 its query, where stage1_rotates_query), so the module carries one."""
        return not self.key_fp8 and self.config.rotation == "hadamard"

    @property
    def store_keys_mma(self) -> bool:
        """The store writes key codes and norms on the tensor cores (store/keys_mma.py.jinja, Gluon) and tq_store
        the values, for enough tokens on a GPU that can: planes, split 3-bit or 4-bit MSE keys under the config's
        Hadamard rotation, head_dim 128 (its bit placement). Not slots: there the two kernels write each slot's
        fields in two passes, 16 bits at a time, and the pair was slower than tq_store alone (H200, 65536
        tokens: 0.77-0.81x; docs/kernels.md)."""
        layout = self.layout
        return (layout.planes and self.hadamard_keys and layout.head_dim == 128
                and (layout.key_bits == 4 or (layout.key_bits == 3 and self.key_codes.split)))

    @property
    def store_gluon(self) -> bool:
        """The store of MSE keys under the config's Hadamard rotation has a Gluon kernel
        (store/gluon.py.jinja, tq_store_gluon) beside tq_store, for GPUs that run Gluon: tq_store's arithmetic with a
        lane per head_dim / 8 contiguous dims of a token, so that no value crosses lanes but in the Walsh-Hadamard
        transform's stages over lanes and the rows' reductions, where tq_store's compiler moved the transform's
        output through shared memory and shuffled the codes to pack them. Slots (2-byte aligned) at head_dim 64, 128
        and 256, planes at 128."""
        layout = self.layout
        if not (self.mma_stage1 and self.hadamard_keys and layout.key_bits in (3, 4) and layout.value_bits in (3, 4)):
            return False
        if layout.planes:
            return layout.head_dim == 128
        # Slots: a lane's D / 8 codes of each field a whole number of 16-bit words (so not 3 bits at head_dim 64).
        return (self.halfword_loads and layout.head_dim in (64, 128, 256)
                and layout.key_bits * layout.head_dim % 128 == 0 and layout.value_bits * layout.head_dim % 128 == 0)

    @property
    def store_cell_search(self) -> StoreCellSearch | None:
        """The cells (codebook.search_cell's shift, count and rounding constant) where tq_store_gluon finds the default
        codebook's codes (SYMMETRIC_CODEBOOK) by a table of cells instead of the binary search's selects and compares,
        else None. |y| * 2**shift rounded to an integer (one fused multiply-add, exact to the rounding:
        codebook.search_cell) is a cell with at most one of the upper half's boundaries (codebook.search_cells); its
        entry holds that next boundary and the half code below it (and, where the norm is corrected, the squared
        centroids on either side), one or two 8-byte loads a code from a table the launcher builds beside the default
        boundaries. Where it takes fewer instructions (ptxas of triton 3.6, sm90a, 4 tokens a program, SASS; with the
        cell by a conversion and a clamp instead, 8-16 more): 4-bit keys (k4v4 slots 944 -> 896, head_dim 64 608 ->
        584, planes 1072 -> 976 and 80 -> 72 registers) and norm-corrected 3-bit keys (k3v4 planes 1088 -> 1048, k3v3
        planes 1152 -> 1104); 3-bit slots took more with the conversion (k3v4 872 -> 920, k3v3 848 -> 912, k3v4-d256
        1472 -> 1576), their binary search being 2 compares and a select a code."""
        if not (self.store_gluon and self.renders("store_cell_search")):
            return None
        if self.layout.key_bits != 4 and not self.layout.key_norm_corrected:
            return None
        return StoreCellSearch(codebook.search_cells(self.layout.key_bits, self.D), codebook.SEARCH_CELLS,
                               codebook.SEARCH_ROUNDING)

    @property
    def store_gluon_words(self) -> bool:
        """Whether tq_store_gluon (slots) writes each lane's run of slot bytes, which starts 2-byte aligned, as the
        32-bit words inside it and 16-bit halves at its ends (halfword_run_stores), and the scale and zero as one
        run, instead of a 16-bit store per 2 bytes. The slots store was bound by the L2 (87% busy for k3v4, ncu, H100,
        2026-12-06), which takes each store's sectors as requests: a lane's 8 bytes of 4-bit values go out in 2-3
        stores instead of 4. Where the values are 4 bits and a lane holds at least 16 of them (head_dim >= 128): at
        65536 tokens k3v4 165.7 -> 154.2 us, k4v4 166.3 -> 162.1, k3v4-d256 335.9 -> 306.5; not k3v3 (3-bit values,
        6-byte runs: 145.8 -> 148.7) nor k4v4-d64 (4-byte runs: 90.6 -> 90.0, 4096 tokens 6.8 -> 7.0) (H100, one
        run, 2026-12-07, docs/kernels.md)."""
        return (self.store_gluon and not self.planes and self.layout.value_bits == 4
                and self.layout.head_dim >= 128)

    @staticmethod
    def halfword_run_stores(run_bytes: int) -> list[tuple[int, int | None, int | None]]:
        """The stores of a run of `run_bytes` bytes (even) at a 2-byte aligned address: the 32-bit words inside it
        and a 16-bit half at each end that is not word aligned. One (bits, offset where the run starts at a word,
        offset where it starts 2 bytes into one) a store instruction, an offset None where that start has no such
        store: the i-th word of each start shares an instruction, the i-th half too."""
        if run_bytes <= 0 or run_bytes % 2:
            raise ValueError(f"a run of slot bytes is a positive even count, got {run_bytes}")
        at_word_words = list(range(0, run_bytes - 3, 4))
        at_word_halves = [run_bytes - 2] if run_bytes % 4 else []
        mid_word_words = list(range(2, run_bytes - 3, 4))
        mid_word_halves = [0] + ([run_bytes - 2] if run_bytes % 4 == 0 else [])
        stores = []
        for bits, at_word, mid_word in ((32, at_word_words, mid_word_words), (16, at_word_halves, mid_word_halves)):
            for i in range(max(len(at_word), len(mid_word))):
                stores.append((bits, at_word[i] if i < len(at_word) else None,
                               mid_word[i] if i < len(mid_word) else None))
        return stores

    @property
    def store_gluon_run_bytes(self) -> list[int]:
        """The run lengths tq_store_gluon writes with store_gluon_words: a lane's pairs of 8-code groups of a field
        (2 x bits bytes) and the scale and zero (4)."""
        return sorted({4, 2 * self.layout.key_bits, 2 * self.layout.value_bits})

    @staticmethod
    def code_square_terms(bits: int) -> list[tuple[list[int], str]]:
        """The sum of a token's squared centroids from counts of its codes' bits, for tq_store_keys_mma's norm
        correction: sum_i s(code_i) = n s0 + sum over the nonempty subsets S of a code's bits of coef_S times the
        number of codes with every bit of S set (s is multilinear in the bits: coef_S = sum over T within S of
        (-1)^(|S| - |T|) s_T, T read as a code). One (bits of S, coef_S as an expression over `s{code}`) per S."""
        terms = []
        for subset in range(1, 1 << bits):
            parts = [("+" if (bin(subset).count("1") - bin(code).count("1")) % 2 == 0 else "-") + f" s{code}"
                     for code in range(subset, -1, -1) if code & subset == code]
            terms.append(([bit for bit in range(bits) if subset >> bit & 1], "(" + " ".join(parts)[2:] + ")"))
        return terms

    @property
    def stage1_format(self) -> str:
        """The decode format as the shipped config files name it: "k3v4-d128" (slots), "k8v4-d128-planes"."""
        layout = self.layout
        keys = "k8" if layout.key_fp8 else f"k{layout.key_bits}"
        return f"{keys}v{layout.value_bits}-d{layout.head_dim}" + ("-planes" if layout.planes else "")

    def renders(self, kernel: str) -> bool:
        """Whether this plan renders the pending kernel `kernel`: named by `pending`, or landed for this format
        (PENDING_KERNELS_LANDED), and never where it was slower (PENDING_KERNELS_SLOWER)."""
        if self.stage1_format in PENDING_KERNELS_SLOWER.get(kernel, ()):
            return False
        return kernel in self.pending or self.stage1_format in PENDING_KERNELS_LANDED.get(kernel, ())

    @property
    def stage1_vector_partials(self) -> bool:
        """Whether the Gluon stage 1 stores its partials 16 bytes a lane, after a reorder through shared memory
        (decode_multi's always does): every format but slots with fp8 keys, whose best large-batch launches it made
        1.04-1.14x slower (H100, 2026-12-06, docs/limits.md "Small batches"); at 1 x 4096 it took 22-30% off the
        others' calls."""
        return not (self.layout.key_fp8 and not self.layout.planes)

    @property
    def stage1_vector_partials_at_one_stage(self) -> bool:
        """Where the single-token Gluon stage 1 keeps scalar partial stores (stage1_vector_partials false), its
        launches of 1 stage store them 16 bytes a lane anyway (STAGES a constexpr: one kernel, a branch that compiles
        away); the ring keeps the scalar stores. Slots k8v4's 1-stage launches took 0.58-0.99x the time at batch 1-8,
        where their partials' round trip is the call's tail (but 1.055x at 1 x 1024 and 16 splits, 5.4 -> 5.7 us),
        0.98-1.00x at 32 x 16384, the ring's 1.000x (H100, 2026-12-07, tools/ab_modules.py; docs/limits.md "Small
        batches"): its re-tune took the tuner's best at 1 x 4096 from 9.4 to 6.9 us."""
        return not self.stage1_vector_partials

    @property
    def stage1_rotates_query(self) -> bool:
        return self.hadamard_keys and self.D == 128

    # --- the Gluon stage 1's query operand -------------------------------------------------
    def _mma_query_terms(self) -> list[tuple[int, int, int | None]]:
        """(multiplier, shift, mask) terms of the head dim that row m of the Gluon key MMA's B operand holds:
        sum of multiplier * ((m >> shift) & mask), mask None for no mask. Row m = 32 i + 8 p + 2 t + e (MSE
        keys; fp8: m = 16 s + 8 h + 2 t + e) is what the A registers of lane 4 g + t hold
        (_mma_tile_layouts): head dim 2 W t + 8 i + 2 p + e (fp8: KW t + 4 s + 2 h + e)."""
        W = self.D // 8
        if self.key_fp8:
            return [(self.D // 4, 1, 3), (4, 4, None), (2, 3, 1), (1, 0, 1)]
        return [(2 * W, 1, 3), (8, 5, None), (2, 3, 3), (1, 0, 1)]

    def mma_query_dim(self, row: str) -> str:
        """The expression of the head dim held by B-operand row `row` (a name in the template)."""
        return " + ".join(f"{multiplier} * ({row} >> {shift})" if mask is None else
                          (f"({row} & {mask})" if shift == 0 and multiplier == 1 else
                           f"{multiplier} * (({row} >> {shift}) & {mask})")
                          for multiplier, shift, mask in self._mma_query_terms())

    @property
    def mma_query_dims(self) -> list[int]:
        """The head dim each B-operand row holds (mma_query_dim evaluated): a permutation of range(D)."""
        return [sum(multiplier * ((m >> shift) if mask is None else (m >> shift) & mask)
                    for multiplier, shift, mask in self._mma_query_terms()) for m in range(self.D)]

    @property
    def mma_query_bit_order(self) -> list[int]:
        """For a query [rows, D] reshaped to [rows, 2, ..., 2] (axis 1 + j: head-dim bit n - 1 - j, n = log2 D),
        the gl.permute order whose result, reshaped back to [rows, D], holds at column m the head dim that
        B-operand row m holds: a rotated query in registers then takes the operand's order with no gather.
        Needs D a power of two (the Walsh-Hadamard transform's)."""
        dims, bits = self.mma_query_dims, self.D.bit_length() - 1
        if 1 << bits != self.D or sorted(dims) != list(range(self.D)):
            raise ValueError(f"head_dim {self.D}: the MMA query rows are not a bit permutation")
        source_bit = [dims[1 << k].bit_length() - 1 for k in range(bits)]  # head-dim bit of row bit k
        if any(dims[m] != sum(((m >> k) & 1) << source_bit[k] for k in range(bits)) for m in range(self.D)):
            raise ValueError(f"head_dim {self.D}: the MMA query rows are not a bit permutation")
        return [0] + [bits - source_bit[bits - 1 - j] for j in range(bits)]

    @property
    def min_capability(self) -> tuple[int, int]:
        return (8, 9) if (self.key_fp8 and self.fp8_hardware) else (8, 0)

    @property
    def needs_ptx(self) -> bool:
        """Whether the kernels use PTX helpers (byte permutes, fp16 pairs): planes MSE keys' codebook
        lookup and the Gluon stage 1's value codes."""
        return self.mma_stage1 or (self.planes and not self.key_fp8)

    @property
    def word_stores(self) -> bool:
        """"slots" whose every field starts 4-byte aligned (fp8 keys, 4-bit values): the store writes 32-bit
        words where the cache's address and strides keep them aligned (a constexpr the launcher sets), 16-bit
        halves elsewhere."""
        return not self.planes and self.layout.slot_fields_word_aligned

    @property
    def halfword_loads(self) -> bool:
        return self.layout.halfword_aligned

    # --- fields -------------------------------------------------------------
    @property
    def key_codes(self) -> CodeField:
        return self.layout.key_codes

    @property
    def value_codes(self) -> CodeField:
        return self.layout.value_codes

    @property
    def cache_at(self) -> str:
        """The arguments that locate a token in the cache, as the kernels' helpers take them."""
        return "page_base, pos" if self.planes else "slot_base"

    def at(self, field: str) -> str:
        """The byte offset, in a kernel, of `field` ("KEY_CODE", "KEY_NORM", "VALUE_CODE", "VALUE_SCALE",
        "VALUE_ZERO") of each token, from the named layout constants: page_base + PLANE + pos * record
        bytes in "planes" (the zero is the second fp16 of the scale-and-zero record), slot_base + OFFSET
        in "slots"."""
        if not self.planes:
            return f"slot_base + _{field}_OFFSET"
        return {
            "KEY_CODE": "page_base + _KEY_CODE_PLANE + pos * _KEY_CODE_BYTES",
            "KEY_NORM": f"page_base + _KEY_NORM_PLANE + pos * {KEY_NORM_BYTES}",
            "VALUE_CODE": "page_base + _VALUE_CODE_PLANE + pos * _VALUE_CODE_BYTES",
            "VALUE_SCALE": f"page_base + _VALUE_SCALE_PLANE + pos * {VALUE_SCALE_ZERO_BYTES}",
            "VALUE_ZERO": f"page_base + _VALUE_SCALE_PLANE + pos * {VALUE_SCALE_ZERO_BYTES} + 2",
        }[field]

    def cache_strides(self, tensor: str = "kv_cache") -> str:
        """The launcher's stride arguments of the cache tensor."""
        return ", ".join(f"{tensor}.stride({dim})" for dim in self.layout.cache_stride_dims)

    @property
    def ring_fields(self) -> list[RingField]:
        """What the Gluon stage 1's cp.async ring copies per tile, plane by plane: the same words its direct
        loads read (keys as group words, or fp8 bytes; split 3-bit codes as their low and high streams), in
        the same register layouts. In "slots" (fp8 keys) a field starts at its slot offset and a token's
        units TOKEN_STRIDE bytes (the cache's position stride, a kernel constant) after the previous one's,
        every copy 4 bytes. Empty unless mma_stage1."""
        if not self.mma_stage1:
            return []
        layout, words = self.layout, self.D // 8
        keys, values = layout.key_codes, layout.value_codes
        if self.mma_halfword_slots:
            return self._halfword_ring_fields()
        if not self.planes:
            alignment = layout.slot_field_alignment
            return [
                RingField("key", "gl.uint8", 1, self.D, "_KEY_CODE_OFFSET", "TOKEN_STRIDE", alignment, "KEY_TILE"),
                RingField("value", "gl.int32", 4, words, "_VALUE_CODE_OFFSET", "TOKEN_STRIDE", alignment,
                          "VALUE_TILE"),
                RingField("scale_zero", "gl.int32", VALUE_SCALE_ZERO_BYTES, 0, "_VALUE_SCALE_OFFSET", "TOKEN_STRIDE",
                          alignment, "TOKENS"),
            ]
        fields = []
        if self.key_fp8:
            fields.append(RingField("key", "gl.uint8", 1, self.D, "_KEY_CODE_PLANE", "_KEY_CODE_BYTES",
                                    keys.alignment, "KEY_TILE"))
        else:
            if keys.split:  # 32-bit pairs of group words' low bits, then the group words' high bytes
                high_unit = self.split_key_high_unit
                fields.append(RingField("key", "gl.int32", 4, words // 2, "_KEY_CODE_PLANE", "_KEY_CODE_BYTES",
                                        keys.alignment, "KEY_PAIR_TILE"))
                fields.append(RingField("key_high", "gl.uint16" if high_unit == 2 else "gl.int32", high_unit,
                                        words // high_unit, "_KEY_CODE_PLANE + _KEY_HIGH_BITS_AT", "_KEY_CODE_BYTES",
                                        keys.high_bits_alignment, "KEY_HIGH_TILE"))
            else:  # group words: 32 bits of 4-bit codes, 16 of 2-bit codes
                unit = 4 if keys.bits == 4 else 2
                fields.append(RingField("key", "gl.int32" if unit == 4 else "gl.uint16", unit, words,
                                        "_KEY_CODE_PLANE", "_KEY_CODE_BYTES", keys.alignment, "KEY_TILE"))
            fields.append(RingField("key_norm", "gl.float16", KEY_NORM_BYTES, 0, "_KEY_NORM_PLANE",
                                    str(KEY_NORM_BYTES), 16, "TOKENS"))
        if values.split:  # 32-bit words of two groups' low bits, then the groups' high bytes
            high_unit = words // 8  # bytes: the high bits of the groups one lane decodes (_mma_tile_layouts)
            fields.append(RingField("value", "gl.int32", 4, words // 2, "_VALUE_CODE_PLANE", "_VALUE_CODE_BYTES",
                                    values.alignment, "VALUE_TILE"))
            fields.append(RingField("value_high", "gl.uint16" if high_unit == 2 else "gl.int32", high_unit, 8,
                                    "_VALUE_CODE_PLANE + _VALUE_HIGH_BITS_AT", "_VALUE_CODE_BYTES",
                                    values.high_bits_alignment, "VALUE_HIGH_TILE"))
        else:
            fields.append(RingField("value", "gl.int32", 4, words, "_VALUE_CODE_PLANE", "_VALUE_CODE_BYTES",
                                    values.alignment, "VALUE_TILE"))
        fields.append(RingField("scale_zero", "gl.int32", VALUE_SCALE_ZERO_BYTES, 0, "_VALUE_SCALE_PLANE",
                                str(VALUE_SCALE_ZERO_BYTES), 16, "TOKENS"))
        return fields

    def _halfword_ring_fields(self) -> list[RingField]:
        """mma_halfword_slots: what the ring copies per token, every copy 4 bytes from the word at or before a field.

        W = D / 8 group words a token, KW = W / 4 a key lane, VW = W / 8 a value lane (at head_dim 128: 16, 4, 2).
        - key: the lane of key-tile column u (4 per token) decodes a quarter of the key's groups, KW groups of 8
          codes: 3-bit codes are 3 KW bytes from byte 3 KW u of the field, 4-bit ones 4 KW from 4 KW u. Each lane
          takes one word more, for the 16-bit shift: 3-bit keys copy KW words from word 3 KW u / 4 (a gather: at
          head_dim 128 words 3u + i, i < 4, the last for the shift; at 256 one word more than the 7 needed); 4-bit
          keys the W words, and key_next the word after each lane's KW (KW u + KW).
        - tail: from the word at or before the norm: with 4-bit values the norm and the value codes (words
          0..W - 1; value lane g reads words VW g .. VW g + VW - 1, and value_next the word after them, VW g + VW:
          a ring slice cannot start there); with 3-bit values the norm's word (and the next). tail_end: the two
          words that hold the value scale and zero, after the norm and the codes.
        - value (3-bit values, head_dim 128): value lane g decodes groups 2g and 2g + 1, 6 bytes from byte 6g of
          the field, which 2 words hold from the word at or before them (a gather whose words depend on the shift).
        """
        layout, words = self.layout, self.D // 8
        assert layout.value_code_offset == layout.key_norm_offset + KEY_NORM_BYTES
        assert layout.value_scale_offset == layout.value_code_offset + layout.value_code_bytes
        assert layout.value_bits == 4 or layout.head_dim == 128, "3-bit value lanes of 2 groups"
        lane_bytes, lane_words = self.halfword_key_lane_bytes, words // 4
        assert lane_bytes % 4 == 0, "every key lane's bytes start where the field's shift puts its first"
        field = functools.partial(RingField, dtype="gl.int32", unit_bytes=4, record="TOKEN_STRIDE", alignment=4)
        fields = [field(name="key", units=words, plane="_KEY_CODE_OFFSET", read_layout="KEY_TILE",
                        words=(0, lane_words, lane_bytes) if layout.key_bits == 3 else (0, 0, 0))]
        if layout.key_bits == 4:
            fields.append(field(name="key_next", units=4, plane="_KEY_CODE_OFFSET", read_layout="KEY_NEXT_TILE",
                                words=(lane_words, 1, lane_bytes)))
        scale_word = (KEY_NORM_BYTES + layout.value_code_bytes) // 4  # of the scale and zero, from the norm's word
        if layout.value_bits == 4:
            value_lane_words = words // 8
            fields.append(field(name="tail", units=words, plane="_KEY_NORM_OFFSET", read_layout="VALUE_TILE"))
            fields.append(field(name="value_next", units=8, plane="_KEY_NORM_OFFSET", read_layout="VALUE_NEXT_TILE",
                                words=(value_lane_words, 1, 4 * value_lane_words)))
        else:
            fields.append(field(name="tail", units=2, plane="_KEY_NORM_OFFSET", read_layout="TOKEN_WORDS"))
            fields.append(field(name="value", units=16, plane="_VALUE_CODE_OFFSET", read_layout="VALUE_TILE",
                                words=(0, 2, 6)))
        fields.append(field(name="tail_end", units=2, plane="_KEY_NORM_OFFSET", read_layout="TOKEN_WORDS",
                            words=(scale_word, 0, 0)))
        return fields

    @property
    def halfword_scale_word(self) -> int:
        """mma_halfword_slots: the first of the two tail_end words (the value scale and zero), counted from the
        word at or before the norm."""
        return self.ring_field("tail_end").words[0]

    # mma_halfword_slots, 3-bit values: value lane g's two copied words hold its groups 2g and 2g + 1 (6 bytes) from
    # byte r (0 or 2); group 2g + i is one byte permute of the two words, selector base + r * 0x1111, as the bytes
    # [b0, b1, b2, junk] (the junk byte is never read).
    PACKED_VALUE_PERMUTES = (0x3210, 0x6543)
    # ... and the group words of tokens 2q and 2q + 1 paired in 16-bit halves by byte permutes (packed_value_codes):
    # their bytes 0-1, 1-2 and 2 (the top byte of each half of `high` is never read).
    PACKED_VALUE_PAIRS = (("low", 0x5410), ("middle", 0x6521), ("high", 0x7632))

    @property
    def packed_value_codes(self) -> list[tuple[str, int]]:
        """mma_halfword_slots, 3-bit values: per code k of a group, the expression that leaves it at bits p..p+2 of
        each 16-bit half of `low`, `middle` or `high` (the group words of two tokens, bytes 0-1, 1-2 and 2 of each
        paired by byte permutes), and p: bits 3k..3k+2 of a group, masked where they lie (p <= 7 keeps the code an
        exact fp16 subnormal, code * 2**(p - 24), below the exponent bits)."""
        terms = []
        for code in range(8):
            bit = 3 * code
            if bit + 2 <= 9:  # in bits 0..9 of the group: `low`, where they lie
                source, position = "low", bit
            elif bit >= 16:  # in byte 2: `high` holds it in bits 0..7
                source, position = "high", bit - 16
            elif bit >= 8 and bit + 2 <= 15:  # in byte 1: `low >> 8`
                source, position = "(low >> 8)", bit - 8
            else:  # across bytes 1 and 2: `middle` holds bits 8..23
                source, position = "middle", bit - 8
            assert position + 2 <= 9, (code, position)
            terms.append((f"{source} & 0x{(7 << position) * 0x10001:08X}", position))
        return terms

    def ring_field(self, name: str) -> RingField:
        """The ring field `name` (ring_fields): where the kernel's direct loads (STAGES 1) find that field too."""
        return next(field for field in self.ring_fields if field.name == name)

    @property
    def split_key_high_unit(self) -> int:
        """Split 3-bit keys in the Gluon stage 1: bytes of the high-bit stream one lane loads per token, one
        per group word it decodes (D // 32: a lane decodes a quarter of a token's group words)."""
        return max(2, min(4, self.D // 32))

    @property
    def symmetric_store_search(self) -> bool:
        """The store's key search has a second form for a codebook symmetric about 0 (the default one: the launcher
        knows it by address, SYMMETRIC_CODEBOOK): 4-bit MSE keys whose codes alone are stored, not a norm corrected
        by the codes' centroids (its squares are picked by each code bit the general search decides). ptxas of
        triton 3.6, sm90a, a program of 4 tokens on 1 warp: k4v4 slots 1280 -> 1112 SASS instructions, head_dim 64
        768 -> 712; 3-bit keys gained 2-6% at head_dim 128 and lost 2.5% at 256, so they keep one search."""
        return not self.key_fp8 and self.layout.key_bits == 4 and not self.layout.key_norm_corrected

    # --- what the templates read ------------------------------------------------
    def template_names(self) -> dict:
        """Every name the templates may use: the plan itself, its layout, and short names for the
        facts used on most lines."""
        layout = self.layout
        return {
            "plan": self,
            "layout": layout,
            "config": self.config,
            "L": layout.constants(),
            "D": self.D,
            "D_PAD": self.D_PAD,
            "PAGE": self.PAGE,
            "key_fp8": self.key_fp8,
            "planes": self.planes,
            "levels": list(codebook.lloyd_max_levels(layout.key_bits)) if not self.key_fp8 else [],
            "split_orders": (SPLIT_LOW_ORDER, SPLIT_HIGH_ORDER),
            "MIN_BLOCK_KV": MIN_BLOCK_KV,
            "MAX_NUM_WARPS": MAX_NUM_WARPS,
        }
