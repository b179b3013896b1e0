"""Decode stage 1 on mma.sync (the Gluon kernel, templates/decode/stage1_mma.py.jinja).

Triton's interpreter cannot run Gluon, so on the CPU these tests check what can be checked
without a GPU: which configs get the kernel, that every launch the tuner can pick compiles
for sm90 with the MMAs it should have and no shared memory, that the tile layouts give each
lane the words the kernel's index algebra assumes, and that decode dispatches to it where it
should. On the GPU (`pytest -m gpu`) the kernel runs against the float64 reference.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (HAS_CUDA, PRESETS, KernelRecorder, check_decode, codebook_kwargs, make_config,
                      offline_compile_reports, position_major_cache, stored_cache)
from tqgen import config as config_mod, reference, render, tuner
from tqgen.errors import TqgenError
from tqgen.layout import Layout
from tqgen import plan as plan_mod
from tqgen.plan import EXTRA_WORK_CHAINS, EXTRA_WORK_STEPS, Plan
from tqgen.testing import DECODE_TOLERANCE, as_position_major, relative_error

REPO = Path(__file__).resolve().parent.parent


def gpu_test(test):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(test))


def mma_config(preset="k3v4", head_dim=128, **overrides):
    """A planes config of the preset (unless cache_layout says otherwise); fp8 keys for sm90 (without a GPU,
    arch auto resolves to sm80, which has no e4m3 converter and so no Gluon kernel for them)."""
    if PRESETS[preset]["key_format"] == "fp8":
        overrides.setdefault("arch", "sm90")
    overrides.setdefault("cache_layout", "planes")
    return make_config(preset, head_dim=head_dim, **overrides)


def key_units(config):
    """What each token's key is loaded as in the Gluon kernel: fp8 bytes, or groups of 8 codes."""
    return config.head_dim if config.key_format == "fp8" else config.head_dim // 8


# --- which configs --------------------------------------------------------------
@pytest.mark.parametrize("fields,expected", [
    (dict(preset="k3v4"), True), (dict(preset="k4v4"), True), (dict(preset="k3v4", head_dim=64), True),
    (dict(preset="k4v4", head_dim=256), True), (dict(preset="k3v4", norm_correction=False), True),
    (dict(preset="k3v4", block_size=8), True),
    (dict(preset="k3v3"), True), (dict(preset="k3v3", head_dim=256), True),
    (dict(preset="k3v3", head_dim=64), False),  # 3-bit values: a lane's low bits would fill half a 32-bit load
    (dict(preset="k8v4", arch="sm90"), True), (dict(preset="k8v4", arch="sm89", head_dim=64), True),
    (dict(preset="k8v4", arch="sm80"), False),  # no e4m3 converter
    (dict(preset="k3v4", head_dim=96, rotation="random"), False),  # not a power of two
    # slots with MSE keys and 4-bit values at head_dim 128: 2-byte aligned fields, shifted after the copy
    (dict(preset="k3v4", cache_layout="slots"), True), (dict(preset="k4v4", cache_layout="slots"), True),
    (dict(preset="k3v4", cache_layout="slots", norm_correction=False), True),
    (dict(preset="k3v3", cache_layout="slots"), True),  # a packed 3-bit value stream too
    (dict(preset="k4v4", cache_layout="slots", value_bits=3), False),  # not yet run on a GPU (Plan.mma_halfword_slots)
    # ... and at head_dim 64 and 256 with 4-bit values, where a key lane's bytes are whole words (not 3-bit keys at 64)
    (dict(preset="k4v4", cache_layout="slots", head_dim=64), True),
    (dict(preset="k3v4", cache_layout="slots", head_dim=256), True),
    (dict(preset="k4v4", cache_layout="slots", head_dim=256), True),
    (dict(preset="k3v4", cache_layout="slots", head_dim=64), False),
    (dict(preset="k3v3", cache_layout="slots", head_dim=256), False),
    # slots with fp8 keys and 4-bit values: every field 4-byte aligned in every slot
    (dict(preset="k8v4", arch="sm90", cache_layout="slots"), True),
    (dict(preset="k8v4", arch="sm90", cache_layout="slots", head_dim=64), True),
    (dict(preset="k8v4", arch="sm90", cache_layout="slots", head_dim=256, block_size=64), True),
    (dict(preset="k8v4", arch="sm90", cache_layout="slots", value_bits=3), False),  # a packed 3-bit stream
    (dict(preset="k8v4", arch="sm80", cache_layout="slots"), False),
])
def test_which_configs_get_the_kernel(fields, expected):
    """Planes configs at power-of-two head dims, and slots configs whose fields a lane can copy in 4-byte units."""
    fields = dict(fields)
    config = make_config(fields.pop("preset"), **{"cache_layout": "planes", **fields})
    source = render.render(config)
    assert Plan.from_config(config).mma_stage1 == expected
    assert ("def tq_decode_stage1_mma(" in source) == expected
    assert "def tq_decode_stage1(" in source  # the tl.dot kernel stays, for everything else


def test_pending_kernels_are_named_by_the_environment_and_unknown_names_are_refused(monkeypatch):
    """TQGEN_PENDING_KERNELS names kernels waiting for a re-tune or a first GPU run (stand-ins here)."""
    monkeypatch.setattr(plan_mod, "PENDING_KERNELS", {"waiting_kernel": "a stand-in", "other_kernel": "another"})
    config = make_config("k3v4", cache_layout="planes", arch="sm90")
    for setting, expected in (("", set()), ("all", {"waiting_kernel", "other_kernel"}),
                              ("1", {"waiting_kernel", "other_kernel"}), (" waiting_kernel , ", {"waiting_kernel"})):
        monkeypatch.setenv("TQGEN_PENDING_KERNELS", setting)
        assert Plan.from_config(config).pending == expected
    monkeypatch.setenv("TQGEN_PENDING_KERNELS", "waiting_kernel,no_such")
    with pytest.raises(TqgenError, match="TQGEN_PENDING_KERNELS names no_such: expected 'all' or some of "
                                         "waiting_kernel, other_kernel"):
        Plan.from_config(config)
    assert Plan.from_config(config, pending=frozenset()).pending == frozenset()  # an explicit choice wins
    with pytest.raises(ValueError, match="pending kernels no_such: expected some of"):
        Plan.from_config(config, pending=frozenset({"no_such"}))


def test_pending_kernels_land_format_by_format(monkeypatch):
    """A pending kernel renders where TQGEN_PENDING_KERNELS names it or where it landed (PENDING_KERNELS_LANDED,
    formats as the config files spell them: Plan.stage1_format), never where it was slower."""
    monkeypatch.setattr(plan_mod, "PENDING_KERNELS", {"waiting_kernel": "a stand-in"})
    monkeypatch.setattr(plan_mod, "PENDING_KERNELS_LANDED", {"waiting_kernel": frozenset({"k3v4-d128-planes"})})
    monkeypatch.setattr(plan_mod, "PENDING_KERNELS_SLOWER", {"waiting_kernel": frozenset({"k8v4-d128"})})
    shipped = {path.stem: Plan.from_config(config_mod.resolve_arch(config_mod.load(path), (9, 0)), pending=frozenset())
               for path in sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))}
    assert all(plan.stage1_format == name for name, plan in shipped.items())
    for name, plan in shipped.items():
        assert plan.renders("waiting_kernel") == (name == "k3v4-d128-planes")
        assert Plan.from_config(plan.config, pending=frozenset({"waiting_kernel"})).renders("waiting_kernel") == (
            name != "k8v4-d128")


# The PTX counts of stage 1 of each config named, compiled offline for sm90 at 32-token tiles in 1 and 2 stages.
_STAGE1_PTX_COUNTS_SCRIPT = """
import json, os, sys, tempfile
sys.path[:0] = [os.path.join(os.getcwd(), "tools"), os.getcwd()]
import ptx_probe, tqgen
from tqgen import config as config_mod
for name in sys.argv[1:]:
    config = config_mod.resolve_arch(config_mod.load(f"configs/{name}.yaml"), (9, 0))
    module = tqgen.load(config, tempfile.mkdtemp(prefix="tqgen-mma-"))
    for stages in (1, 2):
        ptx = ptx_probe.compile_stage1_mma(module, 32, 4, stages=stages).asm["ptx"]
        print(json.dumps(dict(name=name, stages=stages, stores=ptx.count("st.global"),
                              vector_stores=ptx.count("st.global.v4"), copies=ptx.count("cp.async.ca"),
                              word_loads=ptx.count("ld.global.b32"), local=ptx.count(".local"))))
"""


def test_slots_fp8_keys_store_partials_16_bytes_a_lane_at_one_stage_only():
    """Slots with fp8 keys, the one format whose single-token stage 1 keeps scalar partial stores (the ring's
    32-token tiles lost 4-14% to 16-byte ones), store them 16 bytes a lane in launches of 1 stage, a branch on the
    constexpr STAGES. Compiled for sm90: 8 16-byte stores of partials at 1 stage where the ring has 32 scalar ones."""
    config = config_mod.resolve_arch(config_mod.load(REPO / "configs/k8v4-d128.yaml"), (9, 0))
    source = render.render(config)
    body = source[source.index("def tq_decode_stage1_mma("):].split("@gluon.jit")[0]
    assert "if STAGES == 1:" in body and "VECTOR_PARTIALS: gl.constexpr" in body
    reports = {report["stages"]: report for report in offline_compile_reports("-c", _STAGE1_PTX_COUNTS_SCRIPT,
                                                                              "k8v4-d128", timeout=600)}
    assert reports[1]["vector_stores"] == 8 and reports[2]["vector_stores"] == 0
    assert reports[1]["stores"] == reports[2]["stores"] - 32 + 8


def test_mse_slots_stage1_loads_its_words_where_used_at_one_stage(monkeypatch):
    """The Gluon stage 1 on slots with MSE keys (Plan.mma_halfword_slots) takes launches of one stage, each field's
    words loaded where they are used (_mma_load_words) instead of copied through the ring. Compiled for sm90 (this
    triton): the launch of one stage loads, as 32-bit words, what the ring of 2 copies 4 bytes at a time."""
    monkeypatch.setenv("TQGEN_PENDING_KERNELS", "")  # the shipped renders
    names = []
    for path in sorted(REPO.glob("configs/*.yaml")):
        config = config_mod.resolve_arch(config_mod.load(path), (9, 0))
        source = render.render(config)
        if Plan.from_config(config).mma_halfword_slots:
            names.append(path.stem)
        assert ("def _mma_load_words(" in source) == (path.stem in names), path.stem
    assert names == ["k3v3-d128", "k3v4-d128", "k3v4-d256", "k4v4-d128", "k4v4-d64"]
    pytest.importorskip("triton.experimental.gluon")
    reports = offline_compile_reports("-c", _STAGE1_PTX_COUNTS_SCRIPT, "k3v4-d128", "k3v3-d128", timeout=900)
    by_launch = {(report["name"], report["stages"]): report for report in reports}
    for name in ("k3v4-d128", "k3v3-d128"):
        one, ring = by_launch[name, 1], by_launch[name, 2]
        assert one["copies"] == 0 and one["local"] == 0 and ring["local"] == 0, one
        # Every word a tile's copies move (the ring's PTX copies the first tile before the loop and the next in it)
        # is loaded, beside the words both load outside the tiles; the per-token words more than once (every lane
        # of a token's four loads them: the layout the kernel reads them in holds them so).
        assert one["word_loads"] - ring["word_loads"] >= ring["copies"] // 2, (one, ring)


def test_stage1_kernel_choices_per_format(monkeypatch):
    """Stage 1 rotates the query itself for MSE keys under the Hadamard rotation at head_dim 128, both layouts;
    the Gluon stage 1 stores its partials 16 bytes a lane (VECTOR_PARTIALS, in decode's, the merging and
    decode_multi's kernels) in every format, slots with fp8 keys in launches of 1 stage only (the ring of its
    32-token tiles was slower with them)."""
    monkeypatch.setenv("TQGEN_PENDING_KERNELS", "")  # the shipped renders
    for path in sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml")):
        config = config_mod.resolve_arch(config_mod.load(path), (9, 0))
        plan = Plan.from_config(config, pending=frozenset())
        assert plan.stage1_rotates_query == (plan.hadamard_keys and plan.D == 128)
        assert plan.stage1_vector_partials == (path.stem != "k8v4-d128")
        if plan.mma_stage1:
            assert plan.stage1_vector_partials or plan.stage1_vector_partials_at_one_stage, path.stem
            assert render.render(config).count("VECTOR_PARTIALS: gl.constexpr") == 3, path.stem


# --- the tile layouts -----------------------------------------------------------
def _coordinates(layout, register, lane):
    """The tensor coordinate a linear layout gives register `register` of lane `lane` (XOR of bases)."""
    coordinate = [0] * len(layout.shape)
    for bases, index in ((layout.reg_bases, register), (layout.lane_bases, lane)):
        for bit, basis in enumerate(bases):
            if index >> bit & 1:
                coordinate = [c ^ b for c, b in zip(coordinate, basis)]
    return coordinate


@pytest.mark.parametrize("preset,head_dim,page,block_kv", [
    ("k3v4", 128, 16, 64), ("k3v4", 128, 16, 32), ("k3v4", 64, 8, 32), ("k3v4", 256, 64, 32), ("k3v4", 128, 32, 64),
    ("k3v4", 128, 128, 64), ("k3v3", 128, 16, 64), ("k3v3", 256, 16, 32), ("k8v4", 128, 16, 64), ("k8v4", 64, 8, 32),
])
def test_tile_layouts_give_each_lane_the_units_the_kernel_assumes(build_module, preset, head_dim, page, block_kv):
    """Key units (group words, or fp8 bytes): lane l holds tokens l // 4 + 8 r (the MMA rows) and units
    K/4 (l % 4) + i; value units: tokens 2 (l % 4) + e + 8 r (the MMA K columns) and units U/8 (l // 4) + j,
    U the group words, or for split 3-bit values the 32-bit words of low bits (two groups each) and the
    units of high bytes (8 per token). Every element is held by exactly one (lane, register), and a
    token t sits at page t // positions."""
    config = mma_config(preset, head_dim=head_dim, block_size=page)
    module = build_module(config)
    tiles = module._mma_tile_layouts(block_kv)
    words = head_dim // 8
    units = dict(KEY_TILE=key_units(config), VALUE_TILE=words // 2 if config.value_bits == 3 else words)
    if config.value_bits == 3:
        units["VALUE_HIGH_TILE"] = 8
    if config.key_format == "mse" and config.key_bits == 3:  # split keys: 32-bit pairs of words, high bytes
        units.update(KEY_PAIR_TILE=words // 2, KEY_HIGH_TILE=words // max(2, min(4, head_dim // 32)))
    assert {name: tile.shape for name, tile in tiles.items()} \
        == {name: [block_kv // min(block_kv, page), min(block_kv, page), count] for name, count in units.items()}
    positions = min(block_kv, page)
    key_tiles = [tile for name, tile in tiles.items() if name.startswith("KEY")]
    for layout in tiles.values():
        words_per_lane = layout.shape[2] // (4 if layout in key_tiles else 8)
        words = layout.shape[2]
        registers = 1 << len(layout.reg_bases)
        assert registers * 32 == block_kv * words  # no element held twice
        # A lane's words of one token come first in its registers, contiguous: one wide load.
        assert layout.reg_bases[:words_per_lane.bit_length() - 1] == [[0, 0, 1 << b] for b in range(words_per_lane.bit_length() - 1)]
        seen = set()
        for lane in range(32):
            for register in range(registers):
                page_index, position, word = _coordinates(layout, register, lane)
                token = page_index * positions + position
                seen.add((token, word))
                if layout in key_tiles:  # MMA rows: token l // 4 + 8 r; units U/4 (l % 4) + i
                    assert token % 8 == lane // 4 and word // words_per_lane == lane % 4
                else:  # MMA K columns: token 2 (l % 4) + e + 8 r; words W/8 (l // 4) + j
                    assert token % 8 // 2 == lane % 4 and word // words_per_lane == lane // 4
        assert len(seen) == block_kv * words


# --- compiles: loads where used without shared memory, or the cp.async ring ------------
RING_STAGES = sorted(set(tuner.SearchSpace().num_stages) - {1} | {2, 3})  # the ring depths the tuner may pick
COMPILE_CASES = [  # (preset, head_dim, page, block_kv, group_size, norm_correction, stages[, rotate_query])
    *[(preset, 128, 16, kv, 4, True, stages) for preset in ("k3v4", "k3v3", "k8v4", "k4v4")
      for kv in sorted(set(tuner.SearchSpace().block_kv) | {32, 64}) for stages in [1] + RING_STAGES],
    ("k3v4", 128, 16, 64, 8, True, 1), ("k3v4", 128, 16, 32, 16, True, 1), ("k3v4", 128, 16, 32, 16, True, 2),
    ("k3v4", 128, 16, 32, 1, True, 1), ("k3v4", 128, 16, 32, 1, True, 2), ("k3v4", 64, 8, 32, 4, True, 1),
    ("k3v4", 64, 8, 32, 4, True, 2), ("k4v4", 256, 16, 32, 4, True, 1), ("k4v4", 256, 16, 32, 4, True, 2),
    ("k3v4", 128, 64, 32, 4, False, 1), ("k3v4", 128, 64, 32, 4, False, 2), ("k3v3", 256, 16, 32, 4, True, 1),
    ("k3v3", 256, 16, 32, 4, True, 2), ("k3v3", 128, 16, 64, 16, True, 1), ("k8v4", 128, 16, 32, 16, True, 1),
    ("k8v4", 128, 16, 64, 1, True, 1), ("k8v4", 128, 16, 64, 1, True, 2), ("k8v4", 64, 8, 32, 4, True, 1),
    ("k8v4", 64, 8, 32, 4, True, 2), ("k8v4", 256, 16, 32, 4, True, 1), ("k8v4", 256, 16, 32, 4, True, 2),
    # the query rotated in the kernel (Hadamard configs at head_dim 128), a dependent launch at group 1
    ("k3v4", 128, 16, 64, 1, True, 2, True), ("k3v4", 128, 16, 32, 4, True, 1, True),
    ("k4v4", 128, 16, 32, 16, True, 2, True), ("k3v3", 128, 16, 64, 8, True, 1, True),
    # slots (fp8 keys), the cache as vLLM and make_cache allocate it (head-major) and position-major
    *[("k8v4", 128, 16, kv, 4, True, stages, False, order) for kv in (32, 64) for stages in [1] + RING_STAGES
      for order in ("slots-head-major", "slots-position-major")],
    *[("k8v4", head_dim, page, block_kv, group_size, True, stages, False, "slots-head-major")
      for head_dim, page, block_kv, group_size, stages in [(64, 16, 32, 4, 2), (256, 64, 32, 4, 2), (128, 16, 32, 16, 2),
                                                           (128, 16, 64, 1, 1)]],
    # slots with MSE keys (2-byte aligned fields: copied through the ring, or loaded where used), in both dim orders
    *[(preset, 128, 16, kv, 4, True, stages, False, order) for preset in ("k3v4", "k4v4", "k3v3") for kv in (32, 64)
      for stages in [1] + RING_STAGES for order in ("slots-head-major", "slots-position-major")],
    *[(preset, 128, page, block_kv, group_size, norm_correction, 2, False, "slots-head-major")
      for preset in ("k3v4", "k4v4") for page, block_kv, group_size, norm_correction in [
          (64, 32, 4, True), (128, 64, 4, True), (16, 32, 1, True), (16, 32, 16, True), (16, 32, 4, False)]],
    # ... at head_dim 64 and 256 (4-bit values)
    *[(preset, head_dim, 16, block_kv, 4, True, stages, False, order)
      for preset, head_dim in (("k4v4", 64), ("k3v4", 256)) for block_kv, stages, order in (
          (32, 2, "slots-head-major"), (64, 3, "slots-position-major"))],
    ("k4v4", 256, 16, 32, 4, True, 2, False, "slots-head-major"), ("k3v4", 256, 64, 32, 16, True, 2, False,
                                                                   "slots-position-major"),
    ("k4v4", 64, 128, 64, 1, False, 2, False, "slots-head-major"),
    # small pages with a ring: its page bits at their limit (16 pages x 2 slots, 8 x 3; _mma_ring_fits)
    ("k8v4", 128, 2, 32, 4, True, 2, False, "slots-head-major"), ("k3v4", 128, 2, 32, 4, True, 2, False,
                                                                  "slots-position-major"),
    ("k4v4", 128, 4, 32, 4, True, 3, False, "slots-head-major"),
    # slots rotating the query in the kernel (MSE keys), and fp8 keys position-major at group 1
    ("k3v4", 128, 16, 32, 4, True, 2, True, "slots-head-major"), ("k3v3", 128, 16, 32, 8, True, 2, True,
                                                                  "slots-position-major"),
    ("k8v4", 128, 16, 64, 1, True, 1, False, "slots-position-major"),
]


def case_fields(case):
    """(preset, head_dim, page, block_kv, group_size, norm_correction, stages, rotate_query, layout) of a COMPILE_CASES
    entry, whose last two fields may be left out (False, "planes")."""
    preset, head_dim, page, block_kv, group_size, norm_correction, stages, *rest = case
    return (preset, head_dim, page, block_kv, group_size, norm_correction, stages, bool(rest and rest[0]),
            rest[1] if len(rest) > 1 else "planes")


# Under TRITON_INTERPRET=1 the @triton.jit helpers the Gluon kernel calls are interpreter objects that
# triton's compiler refuses, so the kernels are compiled in a process of their own, without it.
_COMPILE_SCRIPT = """
import json, os, re, sys, tempfile
sys.path[:0] = [os.path.join(os.getcwd(), "tools"), os.getcwd()]
import ptx_probe, tqgen
from tqgen import config as config_mod
presets, cases = json.loads(sys.argv[1])
folder = tempfile.mkdtemp(prefix="tqgen-mma-")
for preset, head_dim, page, block_kv, group_size, norm_correction, stages, *rest in cases:
    layout = rest[1] if len(rest) > 1 else "planes"
    fields = dict(presets[preset], head_dim=head_dim, block_size=page, cache_layout=layout.split("-")[0], arch="sm90")
    if fields["key_format"] == "mse":
        fields["norm_correction"] = norm_correction
    module = tqgen.load(config_mod.from_mapping(fields), folder)
    compiled = ptx_probe.compile_stage1_mma(module, block_kv, group_size, dependent_launch=group_size == 1,
                                           stages=stages, rotate_query=bool(rest and rest[0]),
                                           head_major=layout != "slots-position-major")
    ptx = compiled.asm["ptx"]
    copies = re.findall(r"cp[.]async[.]c[ag][.]shared[.]global [[][^]]*[]], [[][^]]*[]], (0x[0-9a-f]+)", ptx)
    print(json.dumps(dict(mma=ptx.count("mma.sync.aligned.m16n8k16"), shared_ops=ptx.count(".shared"),
                          shared_bytes=compiled.metadata.shared, wait="griddepcontrol.wait" in ptx,
                          copy_bytes=sorted({int(size, 16) for size in copies}))))
"""


@pytest.fixture(scope="module")
def compiled_cases():
    reports = offline_compile_reports("-c", _COMPILE_SCRIPT, json.dumps([PRESETS, COMPILE_CASES]), timeout=600)
    assert len(reports) == len(COMPILE_CASES)
    return dict(zip(COMPILE_CASES, reports))


@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda case: "-".join(map(str, case)))
def test_every_launch_compiles_for_sm90(compiled_cases, case):
    """The launches decode gives the kernel compile (triton's compiler rejects what its interpreter
    accepts), with one m16n8k16 MMA per 16 x 8 x 16 block of each product: the scores and the output (and
    the query's rotation, where the kernel rotates it: 16 head dims x 8 columns x the 16 dims of a block),
    nothing for the norm correction ("planes" stores corrected norms; MSE keys in slots sum their squared
    centroids in one product more). One stage uses no shared memory; the ring holds `stages` tiles of exactly
    the bytes a tile's tokens use, copied by cp.async as wide as each plane's alignment allows (16 bytes for
    every plane at head_dim 128 and 256; 4 bytes in slots, where fp8 keys' slots and fields are 4-byte aligned,
    in either dim order of the cache); slots with MSE keys copy the words that hold each field, a few more."""
    _check_compiled_case(case, compiled_cases[case])


def _check_compiled_case(case, report):
    preset, head_dim, page, block_kv, group_size, norm_correction, stages, rotate, layout = case_fields(case)
    columns = max(8, 1 << (group_size - 1).bit_length()) // 8
    key_mmas = (block_kv // 16) * (head_dim // 16) * columns
    value_mmas = (head_dim // 16) * (block_kv // 16) * columns
    halfword_slots = layout != "planes" and PRESETS[preset]["key_format"] == "mse"
    # A 16-bit query rotated in the kernel (these compile an fp16 one): one MMA per 16 head dims and 8 columns.
    rotation_mmas = (head_dim // 16) * columns if rotate else 0
    assert report["mma"] == key_mmas * (2 if halfword_slots and norm_correction else 1) + value_mmas + rotation_mmas
    plan = Plan.from_config(mma_config(preset, head_dim, block_size=page, cache_layout=layout.split("-")[0]))
    if rotate:  # the rotated query goes to the MMA's operand layout through shared memory
        assert report["shared_ops"] > 0 and report["shared_bytes"] > 0
    if stages == 1:
        # ... except the partials' reorder into head-dim order after the loop (plan.stage1_vector_partials, or
        # at 1 stage plan.stage1_vector_partials_at_one_stage).
        if plan.stage1_vector_partials or plan.stage1_vector_partials_at_one_stage:
            assert report["shared_ops"] > 0 and report["shared_bytes"] > 0
        else:
            assert rotate or (report["shared_ops"] == 0 and report["shared_bytes"] == 0)
        assert report["copy_bytes"] == []
    else:
        token_bytes = sum((field.units or 1) * field.unit_bytes for field in plan.ring_fields)
        # Every used byte once; slots with MSE keys copy more: each field from the word at or before it, the
        # words after the lanes' runs, and (3-bit keys) 16 key words of which 13 distinct.
        assert token_bytes == plan.layout.used_bytes if not halfword_slots else token_bytes > plan.layout.used_bytes
        ring_bytes = stages * block_kv * token_bytes
        # The conversion's scratch may share the ring's memory (it is dead before the loop) or lie beside it.
        assert report["shared_bytes"] == ring_bytes if not rotate else report["shared_bytes"] >= ring_bytes
        assert report["copy_bytes"] == sorted({field.vector * field.unit_bytes for field in plan.ring_fields})
        if layout != "planes":
            assert report["copy_bytes"] == [4]
        elif head_dim >= 128:
            assert report["copy_bytes"] == [16]
    # A dependent launch of MSE configs waits on tq_prepare_query; fp8 keys' stage 1 comes first, and so
    # does a stage 1 that rotates the query itself.
    assert report["wait"] == (group_size == 1 and PRESETS[preset]["key_format"] == "mse" and not rotate)


# --- dispatch ---------------------------------------------------------------------
@pytest.mark.parametrize("preset,case,expect_mma", [
    ("k3v4", "batch_above_limit", True), ("k3v4", "batch_at_limit", True), ("k3v4", "random_rotation_at_limit", True),
    ("k3v4", "two_warps", False), ("k3v4", "group_32", False), ("k3v4", "switched_off", False),
    ("k3v3", "batch_above_limit", True), ("k3v3", "batch_at_limit", True),
    ("k8v4", "batch_one", True), ("k8v4", "two_warps", False), ("k8v4", "switched_off", False),
])
def test_decode_takes_the_mma_kernel_where_it_can(build_module, monkeypatch, preset, case, expect_mma):
    """Where the GPU can run it, decode takes the Gluon kernel at any batch: for MSE keys with the default
    rotation up to _ROTATE_QUERY_MAX_BATCH sequences it rotates the query itself (ROTATE_QUERY, the
    caller's query and its strides, no tq_prepare_query), above that or with another rotation it reads
    tq_prepare_query's; never with more than one warp, more than 16 query heads per KV head, or
    MMA_STAGE1 off. The launch gets the constants of its BLOCK_KV."""
    config = mma_config(preset)
    module = build_module(config)
    device = "cuda" if HAS_CUDA else "cpu"
    limit = getattr(module, "_ROTATE_QUERY_MAX_BATCH", 1)
    seq_lens = [40] * (limit + 1 if case == "batch_above_limit" else limit)
    group_size = 32 if case == "group_32" else 4
    kwargs = codebook_kwargs(module, config, device)
    if case == "random_rotation_at_limit":
        kwargs["rotation"] = torch.linalg.qr(torch.randn(128, 128, generator=torch.Generator().manual_seed(3)))[0].to(device)
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: True)  # a GPU that can, on any machine
    monkeypatch.setattr(module, "MMA_STAGE1", case != "switched_off")
    mma, dot, prepare = KernelRecorder(), KernelRecorder(module.tq_decode_stage1), KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_stage1_mma", mma)
    monkeypatch.setattr(module, "tq_decode_stage1", dot)
    if hasattr(module, "tq_prepare_query"):
        monkeypatch.setattr(module, "tq_prepare_query", prepare)
    if expect_mma:
        monkeypatch.setattr(module, "tq_decode_stage2", KernelRecorder())  # the recorded stage 1 wrote nothing
    batch = len(seq_lens)
    cache = module.make_cache(8 * batch, 2, device)
    table = torch.arange(4 * batch, dtype=torch.int32, device=device).view(batch, 4)
    query = torch.randn(batch, 2 * group_size, 128, device=device)
    module.decode(query, cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                  num_warps=2 if case == "two_warps" else 1, block_kv=64, num_splits=2, **kwargs)
    assert (len(mma.launches), len(dot.launches)) == ((1, 0) if expect_mma else (0, 1))
    if expect_mma:
        grid, args, launch = mma.launches[0]
        assert grid == (batch, 2, 2)
        tiles = module._mma_tile_layouts(64)
        assert {name: launch[name] for name in tiles} == tiles
        assert (launch["BLOCK_KV"], launch["BLOCK_H"], launch["TILE_PAGES"], launch["TILE_POSITIONS"], launch["num_warps"]) \
            == (64, 8, 4, 16, 1)
        rotates = case == "batch_at_limit"
        assert launch.get("ROTATE_QUERY", False) == rotates
        assert (args[0] is query) == (rotates or preset == "k8v4")  # fp8 keys: always the caller's query
        assert len(prepare.launches) == (0 if rotates or preset == "k8v4" else 1)


def _record_stage1(module, monkeypatch, expect_mma):
    """Recorders in place of both stage-1 kernels, on a GPU that can run the Gluon one (any machine); stage 2
    recorded too where the Gluon recorder writes nothing. (mma recorder, tl.dot recorder)"""
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: True)
    mma, dot = KernelRecorder(), KernelRecorder(module.tq_decode_stage1)
    monkeypatch.setattr(module, "tq_decode_stage1_mma", mma)
    monkeypatch.setattr(module, "tq_decode_stage1", dot)
    if expect_mma:
        monkeypatch.setattr(module, "tq_decode_stage2", KernelRecorder())
    return mma, dot


def _slots_cache(module, kind, num_blocks, num_kv_heads, device):
    """A k8v4 slots cache: as vLLM and make_cache allocate it (head-major), position-major, or views whose slot
    fields are not 4-byte aligned (a first byte 4 bytes into an allocation; slots 198 bytes apart)."""
    page, slot = module.PAGE_SIZE, module.SLOT_BYTES
    if kind == "head_major":
        return module.make_cache(num_blocks, num_kv_heads, device)
    if kind == "position_major":
        return position_major_cache(module, num_blocks, num_kv_heads, device)
    if kind == "unaligned_start":
        flat = torch.zeros(num_blocks * page * num_kv_heads * slot + 4, dtype=torch.uint8, device=device)
        return flat[4:].view(num_blocks, page, num_kv_heads, slot)
    assert kind == "odd_head_stride"
    return torch.zeros(num_blocks, page, num_kv_heads, slot + 2, dtype=torch.uint8, device=device)[..., :slot]


@pytest.mark.parametrize("kind,expect_mma", [("head_major", True), ("position_major", True),
                                             ("unaligned_start", False), ("odd_head_stride", False)])
def test_slots_decode_takes_the_mma_kernel_where_its_copies_stay_aligned(build_module, monkeypatch, kind, expect_mma):
    """fp8 keys in slots: the Gluon kernel copies each slot's fields 4 bytes at a time, so it takes caches whose
    first byte is 16-byte aligned and whose strides are multiples of 4, in either dim order, with the cache's
    position stride as TOKEN_STRIDE; any other view runs on the tl.dot kernel."""
    config = mma_config("k8v4", cache_layout="slots")
    module = build_module(config)
    device = "cuda" if HAS_CUDA else "cpu"
    mma, dot = _record_stage1(module, monkeypatch, expect_mma)
    cache = _slots_cache(module, kind, 8, 2, device)
    table = torch.arange(8, dtype=torch.int32, device=device).view(2, 4)
    query = torch.randn(2, 8, 128, device=device)
    module.decode(query, cache, table, torch.tensor([40, 64], dtype=torch.int32, device=device), num_warps=1,
                  block_kv=32, num_splits=2, num_stages=2)
    assert (len(mma.launches), len(dot.launches)) == ((1, 0) if expect_mma else (0, 1))
    if expect_mma:
        _, args, launch = mma.launches[0]
        assert launch["TOKEN_STRIDE"] == cache.stride(1) and launch["STAGES"] == 2 and args[1] is cache


@pytest.mark.parametrize("preset", ["k3v4", "k4v4", "k3v3"])
@pytest.mark.parametrize("kind,stages,expect_mma", [
    ("head_major", 2, True), ("position_major", 2, True), ("position_major", 3, True), ("head_major", 1, True),
    ("unaligned_start", 2, False), ("halfword_start", 2, False), ("odd_head_stride", 2, True)])
def test_mse_slots_decode_takes_the_mma_kernel_where_its_words_stay_aligned(build_module, monkeypatch, preset, kind,
                                                                            stages, expect_mma):
    """MSE keys in slots: the Gluon kernel reads the 32-bit words that hold each 2-byte aligned field, through its
    ring (in launches of one stage, loaded where used), so it takes caches whose first byte is 16-byte aligned
    and whose block stride is a multiple of 4 (even position and head strides: fields start at byte 0 or 2 of a
    word); its HEAD_STRIDE_PHASE is the head stride % 4, 0 where every page starts at a word (vLLM's head-major
    cache), in decode's launch, in decode_multi's and in the launch of the kernel that merges its own splits."""
    config = mma_config(preset, cache_layout="slots")
    module = build_module(config)
    device = "cuda" if HAS_CUDA else "cpu"
    mma, dot = _record_stage1(module, monkeypatch, expect_mma)
    if kind == "halfword_start":  # every slot 2 bytes into a word
        flat = torch.zeros(8 * module.PAGE_SIZE * 2 * module.SLOT_BYTES + 2, dtype=torch.uint8, device=device)
        cache = flat[2:].view(8, module.PAGE_SIZE, 2, module.SLOT_BYTES)
    else:
        cache = _slots_cache(module, kind, 8, 2, device)
    table = torch.arange(8, dtype=torch.int32, device=device).view(2, 4)
    query = torch.randn(2, 8, 128, device=device)
    seq_lens = torch.tensor([40, 64], dtype=torch.int32, device=device)
    launch_args = dict(num_warps=1, block_kv=32, num_splits=2, num_stages=stages, **codebook_kwargs(module, config,
                                                                                                  device))
    module.decode(query, cache, table, seq_lens, **launch_args)
    assert (len(mma.launches), len(dot.launches)) == ((1, 0) if expect_mma else (0, 1))
    if not expect_mma:
        return
    head_stride_phase = {"head_major": 0, "position_major": 2, "odd_head_stride": 0}[kind]
    _, args, launch = mma.launches[0]
    assert launch["TOKEN_STRIDE"] == cache.stride(1) and launch["STAGES"] == stages and args[1] is cache
    assert launch["HEAD_STRIDE_PHASE"] == head_stride_phase
    multi, merged = KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", multi)
    monkeypatch.setattr(module, "tq_decode_stage1_mma_merged", merged)
    module.decode_multi(torch.randn(2, 2, 8, 128, device=device), cache, table, seq_lens, **launch_args)
    module.decode(query, cache, table, seq_lens, workspace=module.DecodeWorkspace(2, 8, 2, device),
                  merge_in_stage1=True, **launch_args)
    for recorder in (multi, merged):
        _, args, launch = recorder.launches[0]
        assert len(recorder.launches) == 1 and args[1] is cache
        assert (launch["TOKEN_STRIDE"], launch["HEAD_STRIDE_PHASE"]) == (cache.stride(1), head_stride_phase)


@pytest.mark.parametrize("preset", ["k8v4", "k3v4", "k3v3"])
@pytest.mark.parametrize("page,block_kv,stages,ring_fits", [
    (1, 32, 1, True), (1, 32, 2, False), (2, 32, 2, True), (2, 64, 2, False), (2, 32, 3, False), (4, 64, 2, True),
    (4, 32, 3, True), (4, 64, 3, False), (4, 32, 4, True), (16, 64, 4, True)])
def test_small_pages_take_the_mma_kernel_where_its_ring_tracks_them(build_module, monkeypatch, preset, page, block_kv,
                                                                   stages, ring_fits):
    """The Gluon stage 1's ring keeps one bit per page of each ring slot's tile in a 32-bit word, so a launch whose
    pages per tile (block_kv // min(block_kv, page)) times stages pass 32 takes the tl.dot kernel (decoding them
    on the Gluon kernel lost the pages of the second ring slot: every other tile masked), in decode and in
    decode_multi. Launches of one stage have no ring: they take the Gluon kernel at every page size."""
    config = mma_config(preset, cache_layout="slots", block_size=page)
    module = build_module(config)
    assert module._mma_ring_fits(block_kv, stages) == ring_fits
    device = "cuda" if HAS_CUDA else "cpu"
    mma, dot = _record_stage1(module, monkeypatch, ring_fits)
    blocks_per_seq = 64 // page
    cache = module.make_cache(2 * blocks_per_seq, 2, device)
    table = torch.arange(2 * blocks_per_seq, dtype=torch.int32, device=device).view(2, blocks_per_seq)
    launch = dict(num_warps=1, block_kv=block_kv, num_splits=2, num_stages=stages, **codebook_kwargs(module, config,
                                                                                                   device))
    module.decode(torch.randn(2, 8, 128, device=device), cache, table,
                  torch.tensor([40, 64], dtype=torch.int32, device=device), **launch)
    assert (len(mma.launches), len(dot.launches)) == ((1, 0) if ring_fits else (0, 1))
    multi_mma = KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", multi_mma)
    monkeypatch.setattr(module, "tq_decode_multi_stage1", KernelRecorder())
    monkeypatch.setattr(module, "tq_decode_stage2", KernelRecorder())  # nothing to merge: stage 1 was recorded
    module.decode_multi(torch.randn(2, 2, 8, 128, device=device), cache, table,
                        torch.tensor([40, 64], dtype=torch.int32, device=device), **launch)
    assert len(multi_mma.launches) == int(ring_fits)


@pytest.mark.parametrize("page,stages", [(1, 1), (2, 2), (16, 2)])
def test_the_slots_fp8_heuristic_takes_a_ring_only_where_it_fits(build_module, page, stages):
    """fp8 keys in slots: at 32 x 16384 the heuristic takes 32-token tiles in a ring of 2, but for pages of 1
    (32 pages a tile: more page bits than the ring keeps) 64-token tiles loaded where used, which the Gluon
    kernel still runs, rather than a ring that would send the launch to the tl.dot kernel."""
    module = build_module(mma_config("k8v4", cache_layout="slots", block_size=page))
    block_kv, warps, num_stages, _ = module.heuristic_launch(32, 8, 16384, 132)
    assert (warps, num_stages) == (1, stages) and module._mma_ring_fits(block_kv, num_stages)


def _numpy_byte_perm(low, high, selector):
    """PTX prmt (no sign-replicate nibbles) over int64 arrays of 32-bit values."""
    pair = (high & 0xFFFFFFFF) << 32 | (low & 0xFFFFFFFF)
    return sum(((pair >> (((selector >> (4 * i)) & 7) * 8)) & 0xFF) << (8 * i) for i in range(4))


def _evaluate_steps(steps, word):
    """Plan statements (name, expression) evaluated on int64 arrays as the kernel's int32 holds them."""
    import numpy as np

    names = {"word": np.where(word >= 1 << 31, word - (1 << 32), word)}
    for name, expression in steps:
        value = eval(expression, {}, names) & 0xFFFFFFFF  # noqa: S307 -- the plan's own expressions
        names[name] = np.where(value >= 1 << 31, value - (1 << 32), value)
    return names


@pytest.mark.parametrize("shift", [0, 2])
def test_packed_3bit_key_groups_become_byte_permute_selectors(shift):
    """MSE keys in slots, 3-bit codes: a key lane's four copied words hold its 12 code bytes from byte `shift`; each
    group's byte permute (Plan.PACKED_GROUP_PERMUTES, selector + shift * 0x1111) and the selector steps
    (packed_key_selector_steps) must leave code k of each group in nibble k of the low half (codes 0..3) and of
    the high half (codes 4..7), bit 3 of every nibble clear: every value of group 0 (2**24), 4096 random values
    of the others, beside random bytes."""
    import numpy as np

    plan = Plan.from_config(mma_config("k3v4", cache_layout="slots"))
    rng = np.random.default_rng(shift)
    for k, (low, high, selector) in enumerate(plan.PACKED_GROUP_PERMUTES):
        groups = np.arange(1 << 24, dtype=np.int64) if k == 0 else rng.integers(0, 1 << 24, 4096)
        stream = rng.integers(0, 256, (groups.size, 16)).astype(np.int64)  # the lane's 16 copied bytes
        for byte in range(3):
            stream[:, 3 * k + shift + byte] = (groups >> (8 * byte)) & 0xFF
        words = {name: sum(stream[:, 4 * i + b] << (8 * b) for b in range(4))
                 for i, name in enumerate(("first", "second", "third", "fourth"))}
        word = _numpy_byte_perm(words[low], words[high], selector + shift * 0x1111)
        both = _evaluate_steps(plan.packed_key_selector_steps, word)["both"] & 0xFFFFFFFF
        expected = sum(((groups >> (3 * code)) & 7) << (4 * code) for code in range(8))  # nibble k of each half
        assert np.array_equal(both, expected), k


@pytest.mark.parametrize("shift", [0, 2])
def test_packed_3bit_value_groups_become_exact_subnormal_codes(shift):
    """MSE keys in slots with 3-bit values: a value lane's two copied words hold its groups 2g and 2g + 1 from byte
    `shift`; the group permutes (Plan.PACKED_VALUE_PERMUTES), the token pairing (PACKED_VALUE_PAIRS) and the code
    masks (packed_value_codes) must leave code k of each token at bits p_k..p_k+2 of its 16-bit half and no other
    bit set (so each half is the fp16 subnormal code * 2**(p_k - 24)), for 4096 random pairs of groups of two
    tokens beside random bytes."""
    import numpy as np

    plan = Plan.from_config(mma_config("k3v3", cache_layout="slots"))
    rng = np.random.default_rng(shift)
    groups = rng.integers(0, 1 << 24, (2, 2, 4096))  # [token, group of the lane, sample]
    group_words = []
    for token in range(2):
        stream = rng.integers(0, 256, (4096, 8)).astype(np.int64)  # the lane's two copied words
        for index in range(2):
            for byte in range(3):
                stream[:, shift + 3 * index + byte] = (groups[token, index] >> (8 * byte)) & 0xFF
        first, second = (sum(stream[:, 4 * w + b] << (8 * b) for b in range(4)) for w in range(2))
        group_words.append([_numpy_byte_perm(first, second, base + shift * 0x1111)
                            for base in plan.PACKED_VALUE_PERMUTES])
    for index in range(2):
        even, odd = group_words[0][index], group_words[1][index]
        names = {name: _numpy_byte_perm(even, odd, selector) for name, selector in plan.PACKED_VALUE_PAIRS}
        names = {name: np.where(value >= 1 << 31, value - (1 << 32), value) for name, value in names.items()}
        for code, (expression, position) in enumerate(plan.packed_value_codes):
            got = eval(expression, {}, names) & 0xFFFFFFFF  # noqa: S307 -- the plan's own expressions
            want = sum(((groups[token, index] >> (3 * code)) & 7) << (position + 16 * token) for token in range(2))
            assert position + 2 <= 9 and np.array_equal(got, want), (index, code)


@pytest.mark.parametrize("preset,head_dim", [("k3v4", 128), ("k4v4", 128), ("k3v3", 128), ("k4v4", 64),
                                             ("k3v4", 256), ("k4v4", 256)])
@pytest.mark.parametrize("order", ["head-major", "position-major"])
def test_halfword_slot_copies_and_shifts_give_back_every_field(preset, head_dim, order):
    """MSE keys in slots, emulated on the CPU: the words _mma_copy_words copies (Plan.ring_fields' words, from the
    word at or before each field) and the byte permutes the kernel applies with its selectors (shift_selectors)
    give back each token's key groups, value groups (or words), norm and scale and zero byte for byte, for every
    position and head of a cache of 3 KV heads in either dim order (fields at byte 0 and 2 of a word). Head dim 128
    as its template spells the permutes, and every head dim as the plan's expressions do (halfword_key_groups,
    neighbour_permutes: what 64 and 256 render)."""
    import numpy as np

    plan = Plan.from_config(mma_config(preset, head_dim, cache_layout="slots", block_size=16))
    assert plan.mma_halfword_slots
    key_lane_words, value_lane_words = head_dim // 32, head_dim // 64
    layout, slot, page, heads = plan.layout, plan.layout.slot_bytes, 16, 3
    cache = np.random.default_rng(0).integers(0, 256, 2 * page * heads * slot, dtype=np.int64)
    # (block, position, head) strides
    strides = ((heads * page * slot, slot, page * slot) if order == "head-major"
               else (page * heads * slot, heads * slot, slot))
    offsets = dict(_KEY_CODE_OFFSET=layout.key_code_offset, _KEY_NORM_OFFSET=layout.key_norm_offset,
                   _VALUE_CODE_OFFSET=layout.value_code_offset)
    word_at = lambda byte: int(sum(int(cache[byte + b]) << (8 * b) for b in range(4)))  # noqa: E731
    perm = lambda low, high, selector: int(_numpy_byte_perm(np.int64(low), np.int64(high), selector))  # noqa: E731
    for block in range(2):
        for head in range(heads):
            page_base = block * strides[0] + head * strides[2]
            phase = page_base & 3
            for position in range(page):
                copied = {}
                for field in plan.ring_fields:  # _mma_copy_words
                    first, run, lane_bytes = field.words
                    start = phase + (position & 1) * strides[1] + offsets[field.plane]
                    token_word, shift = start // 4 + position // 2 * (strides[1] // 2), start & 3
                    words = [token_word + (first + j if run == 0 else
                                           first + (shift + j // run * lane_bytes) // 4 + j % run)
                             for j in range(field.units)]
                    copied[field.name] = [word_at(page_base - phase + 4 * word) for word in words]
                slot_start = page_base + position * strides[1]
                def field_bytes(offset, size, slot_start=slot_start):
                    return [int(b) for b in cache[slot_start + offset:slot_start + offset + size]]

                head_phase = (head * strides[2]) & 3
                key_shift = (head_phase + position * strides[1] + layout.key_code_offset) & 3
                keys = field_bytes(layout.key_code_offset, layout.key_code_bytes)
                for u in range(4):  # key lane u's group words, as the plan's expressions take them
                    lane = copied["key"][key_lane_words * u:key_lane_words * (u + 1)]
                    names = dict(zip(plan.numbered("w", key_lane_words), lane), select=key_shift * 0x1111,
                                 after=copied["key_next"][u] if layout.key_bits == 4 else 0)
                    expressions = plan.halfword_key_groups(plan.numbered("w", key_lane_words), "after", "select")
                    assert len(expressions) == key_lane_words
                    for k, expression in enumerate(expressions):
                        got = eval(expression, {"_byte_perm": perm}, names)  # noqa: S307 -- the plan's own
                        group = key_lane_words * u + k
                        if layout.key_bits == 3:  # [b0, b1, b1, b2]
                            b0, b1, b2 = keys[3 * group:3 * group + 3]
                            assert got == b0 | b1 << 8 | b1 << 16 | b2 << 24, (block, head, position, u, k)
                        else:
                            assert got == sum(keys[4 * group + b] << (8 * b) for b in range(4)), (position, u, k)
                lanes = [copied["key"][4 * u:4 * u + 4] for u in range(4)] if head_dim == 128 else []
                for u, (w0, w1, w2, w3) in enumerate(lanes):
                    if layout.key_bits == 3:  # group 4u + k as [b0, b1, b1, b2]
                        named = dict(first=w0, second=w1, third=w2, fourth=w3)
                        for k, (low, high, base) in enumerate(plan.PACKED_GROUP_PERMUTES):
                            got = perm(named[low], named[high], base + key_shift * 0x1111)
                            b0, b1, b2 = keys[3 * (4 * u + k):3 * (4 * u + k) + 3]
                            assert got == b0 | b1 << 8 | b1 << 16 | b2 << 24, (block, head, position, u, k)
                    else:  # words 4u..4u+3, the last with key_next
                        following = [w1, w2, w3, copied["key_next"][u]]
                        for i, (low, high) in enumerate(zip((w0, w1, w2, w3), following)):
                            want = sum(keys[16 * u + 4 * i + b] << (8 * b) for b in range(4))
                            assert perm(low, high, 0x3210 + key_shift * 0x1111) == want, (block, head, position, u, i)
                norm_shift = (head_phase + position * strides[1] + layout.key_norm_offset) & 3
                norm = field_bytes(layout.key_norm_offset, 2)
                assert (copied["tail"][0] >> (8 * norm_shift)) & 0xFFFF == norm[0] | norm[1] << 8
                scale_shift = (norm_shift + layout.value_scale_offset - layout.key_norm_offset
                               - 4 * plan.halfword_scale_word)
                scale = sum(byte << (8 * b) for b, byte in enumerate(field_bytes(layout.value_scale_offset, 4)))
                assert perm(*copied["tail_end"], 0x3210 + scale_shift * 0x1111) == scale
                values = field_bytes(layout.value_code_offset, layout.value_code_bytes)
                for g in range(8 if layout.value_bits == 4 else 0):  # value lane g, as the plan's expressions take
                    selector = 0x3210 + (norm_shift + layout.value_code_offset - layout.key_norm_offset) * 0x1111
                    lane = copied["tail"][value_lane_words * g:value_lane_words * (g + 1)]
                    names = dict(zip(plan.numbered("v", value_lane_words), lane), after=copied["value_next"][g],
                                 select=selector)
                    expressions = plan.neighbour_permutes(plan.numbered("v", value_lane_words), "after", "select")
                    for i, expression in enumerate(expressions):
                        word = value_lane_words * g + i
                        want = sum(values[4 * word + b] << (8 * b) for b in range(4))
                        assert eval(expression, {"_byte_perm": perm}, names) == want, (position, g, i)  # noqa: S307
                for g in range(8 if head_dim == 128 else 0):  # value lane g, as head_dim 128's template spells it
                    if layout.value_bits == 4:  # words 2g, 2g + 1 of the tail row and value_next's word after them
                        selector = 0x3210 + (norm_shift + layout.value_code_offset - layout.key_norm_offset) * 0x1111
                        row = copied["tail"]
                        pairs = [(row[2 * g], row[2 * g + 1]), (row[2 * g + 1], copied["value_next"][g])]
                        for i, (low, high) in enumerate(pairs):
                            want = sum(values[4 * (2 * g + i) + b] << (8 * b) for b in range(4))
                            assert perm(low, high, selector) == want, (block, head, position, g, i)
                    else:  # groups 2g, 2g + 1 as [b0, b1, b2, junk]
                        value_shift = (head_phase + position * strides[1] + layout.value_code_offset + 6 * g) & 3
                        w0, w1 = copied["value"][2 * g:2 * g + 2]
                        for i, base in enumerate(plan.PACKED_VALUE_PERMUTES):
                            got = perm(w0, w1, base + value_shift * 0x1111) & 0xFFFFFF
                            b0, b1, b2 = values[3 * (2 * g + i):3 * (2 * g + i) + 3]
                            assert got == b0 | b1 << 8 | b2 << 16, (block, head, position, g, i)


@pytest.mark.parametrize("lanes,count", [(4, 1), (4, 2), (4, 4), (4, 8), (8, 1), (8, 2), (8, 4)])
def test_lane_split_and_join_steps_give_each_unit_and_back(lanes, count):
    """Plan.lane_split_steps / lane_join_steps (the halfword slots kernel's split_lanes and join_lanes), run with
    numpy standing in for gl.split, gl.join and gl.reshape: names[i] holds unit i of every lane (unit count * l + i
    of [pages, positions, lanes * count]), and the joined units reshape back to the tensor split."""
    import numpy as np

    gl = type("gl", (), dict(split=staticmethod(lambda x: (x[..., 0], x[..., 1])),
                             join=staticmethod(lambda a, b: np.stack([a, b], axis=-1))))
    tensor = np.arange(3 * 2 * lanes * count).reshape(3, 2, lanes * count)
    names = Plan.numbered("unit", count)
    scope = {"gl": gl, "source": tensor.reshape(3, 2, lanes, *[2] * (count.bit_length() - 1))}
    for targets, expression in Plan.lane_split_steps("part", "source", names):
        exec(f"{targets} = {expression}", {}, scope)  # noqa: S102 -- the plan's own statements
    for i, name in enumerate(names):
        assert np.array_equal(scope[name], tensor[:, :, i::count]), (name, scope[name].shape)
    for target, expression in Plan.lane_join_steps("joined", names):
        exec(f"{target} = {expression}", {}, scope)  # noqa: S102
    assert np.array_equal(scope["joined"].reshape(tensor.shape), tensor)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("preset", ["k3v4", "k8v4"])
def test_the_query_operand_order_is_a_bit_permutation(preset, head_dim):
    """The head dims the key MMA's B-operand rows hold (plan.mma_query_dims, the kernel's _mma_query_dim) are
    a permutation of the head dims; for MSE keys, gl.permute by plan.mma_query_bit_order of the query's
    head-dim bits puts them in that order, as the kernel's in-register rotation does."""
    plan = Plan.from_config(mma_config(preset, head_dim))
    dims = plan.mma_query_dims
    assert sorted(dims) == list(range(head_dim))
    assert dims[:4] == [0, 1, 2 * head_dim // 8 if preset == "k3v4" else head_dim // 4, dims[2] + 1]
    bits = head_dim.bit_length() - 1
    order = plan.mma_query_bit_order
    natural = torch.arange(head_dim).view(1, *[2] * bits)
    assert torch.equal(natural.permute(*order).reshape(head_dim), torch.tensor(dims))


@gpu_test
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_size", [1, 4, 8, 16])
@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k4v4", "planes"), ("k3v3", "planes"),
                                           ("k3v4", "slots"), ("k4v4", "slots"), ("k3v3", "slots")])
def test_the_mma_kernel_rotates_the_query_itself(build_module, monkeypatch, preset, layout, group_size, dtype):
    """Up to _ROTATE_QUERY_MAX_BATCH sequences under the config's Hadamard rotation, the Gluon kernel rotates
    the caller's query (any float dtype, strided) and matches the reference; tq_prepare_query never runs (slots:
    their copies need the ring, 2 stages)."""
    config = mma_config(preset, cache_layout=layout)
    assert Plan.from_config(config).stage1_rotates_query
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    prepare = KernelRecorder()
    monkeypatch.setattr(module, "tq_prepare_query", prepare)
    for seq_lens in ([70], [1, 300, 17], [40] * module._ROTATE_QUERY_MAX_BATCH):
        for block_kv, num_stages in ((32, 1) if layout == "planes" else (32, 2), (64, 2)):
            check_decode(module, config, "cuda", seq_lens, group_size=group_size, dtype=dtype, strided_query=True,
                         block_kv=block_kv, num_warps=1, num_stages=num_stages, num_splits=3)
    assert spy.launches and all(launch["ROTATE_QUERY"] for _, _, launch in spy.launches)
    assert not prepare.launches


# --- on the GPU ----------------------------------------------------------------------
def _spy(module, monkeypatch):
    recorder = KernelRecorder(module.tq_decode_stage1_mma)
    monkeypatch.setattr(module, "tq_decode_stage1_mma", recorder)
    return recorder


def _stored_cache(module, config, num_blocks, first_slot, tokens, seed):
    """A cache of num_blocks pages for 2 KV heads with `tokens` random tokens stored from slot
    first_slot on: (cache, the module's codebook arguments, the generator, to draw more from)."""
    codebook = codebook_kwargs(module, config, "cuda")
    cache = module.make_cache(num_blocks, 2, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    key = torch.randn(tokens, 2, config.head_dim, device="cuda", generator=generator)
    value = torch.randn(tokens, 2, config.head_dim, device="cuda", generator=generator)
    module.store(key, value, cache, torch.arange(first_slot, first_slot + tokens, device="cuda"), **codebook)
    return cache, codebook, generator


MANY_LENS = [1, 15, 16, 17, 63, 64, 65, 300, 1025, 0]


MMA_CASES = [  # (preset, head_dim, page, block_kv, group_size, num_splits, num_stages)
    *[(preset, head_dim, page, block_kv, 4, 3, stages)
      for preset, head_dim, page in [("k3v4", 128, 16), ("k4v4", 128, 16), ("k3v4", 64, 16), ("k4v4", 256, 16),
                                     ("k3v4", 128, 8), ("k3v4", 128, 64), ("k3v3", 128, 16), ("k3v3", 256, 16),
                                     ("k3v3", 128, 8), ("k8v4", 128, 16), ("k8v4", 64, 16), ("k8v4", 256, 16),
                                     ("k8v4", 128, 64)]
      for block_kv in sorted(set(tuner.SearchSpace().block_kv)) for stages in (1, 2)],
    *[(preset, 128, 16, block_kv, group_size, num_splits, stages) for preset in ("k3v4", "k3v3", "k8v4")
      for block_kv in sorted(set(tuner.SearchSpace().block_kv)) for group_size in (1, 8, 16) for num_splits in (1, 16)
      for stages in (1, 2)],
    # every ring depth the tuner can pick, at every tile size, for each key and value format
    *[(preset, 128, 16, block_kv, 4, 5, stages) for preset in ("k3v4", "k4v4", "k3v3", "k8v4")
      for block_kv in sorted(set(tuner.SearchSpace().block_kv)) for stages in RING_STAGES if stages != 2],
]


@pytest.mark.parametrize("preset,head_dim,page,block_kv,group_size,num_splits,num_stages", MMA_CASES)
@gpu_test
def test_mma_decode_matches_reference(build_module, monkeypatch, preset, head_dim, page, block_kv, group_size, num_splits,
                                      num_stages):
    """The Gluon kernel against the float64 reference on ragged lengths around tile and page bounds (and 0),
    with its words loaded where used (1 stage) or through the cp.async ring of num_stages tiles."""
    config = mma_config(preset, head_dim, block_size=page)
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    check_decode(module, config, "cuda", MANY_LENS, group_size=group_size, block_kv=block_kv, num_splits=num_splits,
                 num_warps=1, num_stages=num_stages)
    assert len(spy.launches) == 1 and spy.launches[0][2]["STAGES"] == num_stages


SLOTS_MMA_CASES = [  # (head_dim, page, block_kv, group_size, num_splits, num_stages, head_major)
    *[(128, 16, block_kv, 4, 3, stages, head_major) for block_kv in sorted(set(tuner.SearchSpace().block_kv))
      for stages in [1] + RING_STAGES for head_major in (True, False)],
    (64, 16, 32, 4, 3, 2, True), (256, 16, 32, 4, 3, 2, True), (128, 32, 64, 4, 3, 1, True), (128, 64, 64, 4, 3, 2, True),
    (128, 128, 32, 4, 3, 2, False),
    *[(128, 16, 32, group_size, num_splits, 2, True) for group_size in (1, 6, 8, 16) for num_splits in (1, 16)],
    # small pages: the ring's page bits at their limit (16 pages x 2 slots), 8 x 3, and a tile of 32 pages unringed
    (128, 2, 32, 4, 3, 2, True), (128, 4, 32, 4, 3, 3, False), (128, 1, 32, 4, 3, 1, True),
]


@pytest.mark.parametrize("head_dim,page,block_kv,group_size,num_splits,num_stages,head_major", SLOTS_MMA_CASES)
@gpu_test
def test_slots_mma_decode_matches_reference(build_module, monkeypatch, head_dim, page, block_kv, group_size, num_splits,
                                            num_stages, head_major):
    """fp8 keys in slots on the Gluon kernel against the float64 reference, the cache as vLLM and make_cache
    allocate it (head-major) or position-major: ragged lengths around tile and page bounds (and 0)."""
    config = mma_config("k8v4", head_dim, block_size=page, cache_layout="slots")
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    check_decode(module, config, "cuda", MANY_LENS, group_size=group_size, block_kv=block_kv, num_splits=num_splits,
                 num_warps=1, num_stages=num_stages, position_major=not head_major)
    assert len(spy.launches) == 1 and spy.launches[0][2]["STAGES"] == num_stages


MSE_SLOTS_MMA_CASES = [  # (preset, page, block_kv, group_size, num_splits, num_stages, head_major, norm_correction)
    *[(preset, 16, block_kv, 4, 3, stages, head_major, True) for preset in ("k3v4", "k4v4", "k3v3")
      for block_kv in sorted(set(tuner.SearchSpace().block_kv)) for stages in RING_STAGES for head_major in (True, False)],
    *[(preset, page, block_kv, 4, 3, 2, head_major, True) for preset in ("k3v4", "k4v4")
      for page, block_kv, head_major in [(32, 64, True), (64, 32, True), (128, 32, False), (128, 64, True)]],
    *[(preset, 16, 32, group_size, num_splits, 2, True, True) for preset in ("k3v4", "k4v4")
      for group_size in (1, 6, 8, 16) for num_splits in (1, 16)],
    ("k3v4", 16, 32, 4, 3, 2, True, False), ("k4v4", 16, 64, 4, 3, 3, False, False),
    ("k3v3", 64, 32, 8, 16, 2, True, True), ("k3v3", 16, 32, 1, 1, 2, False, True),
    # small pages, the ring's page bits at their limit: 16 pages x 2 slots, 8 x 3
    ("k3v4", 2, 32, 4, 3, 2, True, True), ("k4v4", 4, 32, 4, 3, 3, False, True), ("k3v3", 2, 32, 4, 3, 2, False, True),
    # launches of one stage, the words loaded where used
    *[(preset, 16, block_kv, 4, 3, 1, head_major, True) for preset in ("k3v4", "k4v4", "k3v3") for block_kv in (32, 64)
      for head_major in (True, False)],
    *[(preset, page, block_kv, group_size, num_splits, 1, True, True) for preset in ("k3v4", "k3v3")
      for page, block_kv, group_size, num_splits in [(1, 32, 4, 3), (2, 64, 4, 3), (64, 32, 4, 3), (16, 32, 1, 16),
                                                     (16, 32, 16, 1), (16, 64, 6, 16)]],
    ("k4v4", 16, 32, 8, 16, 1, False, False),
]


@pytest.mark.parametrize("preset,page,block_kv,group_size,num_splits,num_stages,head_major,norm_correction",
                         MSE_SLOTS_MMA_CASES)
@gpu_test
def test_mse_slots_mma_decode_matches_reference(build_module, monkeypatch, preset, page, block_kv, group_size,
                                                num_splits, num_stages, head_major, norm_correction):
    """MSE keys in slots on the Gluon kernel (fields shifted out of the copied words, the norm correction from
    the squared centroids) against the float64 reference, the cache as vLLM and make_cache allocate it
    (head-major) or position-major: ragged lengths around tile and page bounds (and 0)."""
    config = mma_config(preset, block_size=page, cache_layout="slots", norm_correction=norm_correction)
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    check_decode(module, config, "cuda", MANY_LENS, group_size=group_size, block_kv=block_kv, num_splits=num_splits,
                 num_warps=1, num_stages=num_stages, position_major=not head_major)
    assert len(spy.launches) == 1 and spy.launches[0][2]["STAGES"] == num_stages


HALFWORD_SLOTS_64_256_CASES = [  # (preset, head_dim, page, block_kv, group_size, num_splits, num_stages, head_major,
    #                               norm_correction)
    *[(preset, head_dim, 16, block_kv, 4, 3, stages, head_major, True)
      for preset, head_dim in (("k4v4", 64), ("k3v4", 256), ("k4v4", 256)) for block_kv in (32, 64)
      for stages in (2, 3) for head_major in (True, False)],
    *[(preset, head_dim, 16, 32, group_size, num_splits, 2, True, True) for preset, head_dim in (("k4v4", 64),
                                                                                                 ("k3v4", 256))
      for group_size in (1, 6, 8, 16) for num_splits in (1, 16)],
    ("k4v4", 64, 64, 32, 4, 3, 2, True, False), ("k3v4", 256, 128, 64, 4, 3, 2, False, False),
    ("k3v4", 256, 2, 32, 4, 3, 2, True, True), ("k4v4", 64, 4, 32, 4, 3, 3, False, True),
    # launches of one stage, the words loaded where used
    *[(preset, head_dim, 16, block_kv, 4, 3, 1, head_major, True)
      for preset, head_dim in (("k4v4", 64), ("k3v4", 256)) for block_kv, head_major in ((32, True), (64, False))],
]


@pytest.mark.parametrize("preset,head_dim,page,block_kv,group_size,num_splits,num_stages,head_major,norm_correction",
                         HALFWORD_SLOTS_64_256_CASES)
@gpu_test
def test_halfword_slots_at_head_dims_64_and_256_match_reference(build_module, monkeypatch, preset, head_dim, page,
                                                                block_kv, group_size, num_splits, num_stages, head_major,
                                                                norm_correction):
    """MSE keys in slots on the Gluon kernel at head_dim 64 and 256 against the float64 reference, head-major and
    position-major, ragged lengths around tile and page bounds (and 0); and decode_multi's Gluon kernel at 4 query
    tokens against reference.decode_multi."""
    config = mma_config(preset, head_dim, block_size=page, cache_layout="slots", norm_correction=norm_correction)
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    check_decode(module, config, "cuda", MANY_LENS, group_size=group_size, block_kv=block_kv, num_splits=num_splits,
                 num_warps=1, num_stages=num_stages, position_major=not head_major)
    assert len(spy.launches) == 1 and spy.launches[0][2]["STAGES"] == num_stages
    if (group_size, num_splits) != (4, 3):
        return
    multi = KernelRecorder(module.tq_decode_multi_stage1_mma)
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", multi)
    kwargs = codebook_kwargs(module, config, "cuda")
    batch, cache = stored_cache(module, config, [4, 18, 300], "cuda", 2, 0, kwargs, not head_major)
    query = torch.randn(3, 4, 8, head_dim, generator=torch.Generator().manual_seed(5)).cuda()
    out = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, **kwargs, block_kv=block_kv,
                              num_warps=1, num_stages=num_stages, num_splits=num_splits)
    want = reference.decode_multi(Layout.from_config(config), query, cache, batch.block_table, batch.seq_lens,
                                  kwargs.get("rotation"), kwargs.get("centroids"))
    assert multi.launches and relative_error(out, want) < DECODE_TOLERANCE[torch.float32]


@pytest.mark.parametrize("preset", ["k8v4", "k3v4", "k4v4", "k3v3"])
@gpu_test
def test_slots_mma_decode_gives_the_same_bits_in_either_dim_order(build_module, monkeypatch, preset):
    """The same stored slots decoded on the Gluon kernel with one launch: from make_cache's head-major cache, again,
    and from a position-major copy. Where a field starts in its copied word differs between the orders (by the
    position's parity, by the head), the arithmetic on the fields does not: every output bit must agree (the max
    difference is reported if not)."""
    config = mma_config(preset, cache_layout="slots")
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    batch, cache = stored_cache(module, config, [37, 90, 16, 1], "cuda")
    codebook = codebook_kwargs(module, config, "cuda")
    query = torch.randn(4, 8, config.head_dim, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))

    def decode(kv_cache):
        return module.decode(query, kv_cache, batch.block_table, batch.seq_lens, block_kv=32, num_splits=2,
                             num_warps=1, num_stages=2, **codebook)

    first = decode(cache)
    others = {"again": decode(cache), "position-major": decode(as_position_major(cache))}
    assert len(spy.launches) == 3
    for name, out in others.items():
        assert torch.equal(out, first), f"{name}: max |difference| {(out - first).abs().max().item():.3e}"


@pytest.mark.parametrize("variant", ["no_norm_correction", "asymmetric_codebook", "fp16_query", "bf16_query",
                                     "strided_query", "two_bit_keys", "fp8_fp16_query", "fp8_bf16_query",
                                     "fp8_strided_query", "four_bit_keys_three_bit_values",
                                     "four_bit_keys_asymmetric_codebook"])
@gpu_test
def test_mma_decode_variants(build_module, monkeypatch, variant):
    if variant == "four_bit_keys_asymmetric_codebook":  # the 16-entry lookup, not the magnitudes' one
        config = mma_config("k4v4")
        variant = "asymmetric_codebook"
    elif variant == "two_bit_keys":
        config = make_config("k3v4", cache_layout="planes", key_bits=2)
    elif variant == "four_bit_keys_three_bit_values":
        config = make_config("k3v3", cache_layout="planes", key_bits=4)
    elif variant.startswith("fp8_"):  # the caller's query goes straight to stage 1, in its dtype and strides
        config = mma_config("k8v4")
        variant = variant[len("fp8_"):]
    else:
        config = mma_config(norm_correction=variant != "no_norm_correction")
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    codebook = codebook_kwargs(module, config, "cuda")
    if variant == "asymmetric_codebook":  # any centroids, not only the symmetric Lloyd-Max ones
        generator = torch.Generator().manual_seed(5)
        codebook["centroids"] = (torch.rand(2 ** config.key_bits, generator=generator) * 0.3 - 0.1).to("cuda")
    dtype = {"fp16_query": torch.float16, "bf16_query": torch.bfloat16}.get(variant, torch.float32)
    check_decode(module, config, "cuda", [300, 17, 64], codebook=codebook, dtype=dtype,
                 strided_query=variant == "strided_query", num_warps=1, block_kv=64)
    assert len(spy.launches) == 1


@pytest.mark.parametrize("num_stages", [1, 2])
@gpu_test
def test_symmetric_codebook_lookup_equals_the_general_one(build_module, monkeypatch, num_stages):
    """4-bit keys: the default centroids (recognized by address) take the lookup of 8 magnitudes and a sign;
    the same values in another tensor take the 16-entry lookup. Both must decode to the same bits."""
    config = mma_config("k4v4")
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    codebook = codebook_kwargs(module, config, "cuda")
    default = module.default_centroids("cuda")
    outputs = []
    for centroids in (default, default.clone()):
        outputs.append(check_decode(module, config, "cuda", [700, 33, 64, 1], codebook=dict(codebook, centroids=centroids),
                                    num_warps=1, block_kv=32, num_stages=num_stages, num_splits=3))
    assert [launch["SYMMETRIC_CODEBOOK"] for _, _, launch in spy.launches] == [True, False]
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("preset", ["k3v4", "k3v3", "k8v4"])
@pytest.mark.parametrize("block_kv,num_stages", sorted({(c["block_kv"], c["num_stages"]) for c in tuner.SearchSpace().candidates()}
                                                  | {(32, 3), (64, 3)}))
@gpu_test
def test_mma_and_dot_kernels_agree(build_module, monkeypatch, preset, block_kv, num_stages):
    """Both stage-1 kernels on the same cache and prepared query: equal up to the fp16 rounding of
    their operands. MMA_STAGE1 = False (TQGEN_MMA_STAGE1=0) keeps one-warp launches on the tl.dot
    kernel, whose stages the Gluon kernel ignores."""
    config = mma_config(preset)
    module = build_module(config)
    outputs = []
    for switch in (True, False):
        monkeypatch.setattr(module, "MMA_STAGE1", switch)
        outputs.append(check_decode(module, config, "cuda", [500, 33, 2000], num_warps=1, block_kv=block_kv,
                                    num_stages=num_stages, num_splits=4))
    assert relative_error(outputs[0], outputs[1]) < 1e-3


@pytest.mark.parametrize("preset,num_stages", [
    *[(preset, stages) for preset in ("k3v4", "k3v3", "k8v4", "k8v4-slots", "k3v4-slots", "k4v4-slots", "k3v3-slots")
      for stages in (1, 2, 3)]])
@gpu_test
def test_mma_decode_masks_block_ids_outside_the_cache(build_module, monkeypatch, preset, num_stages):
    """With validate=False, pages whose block id is outside the cache are masked (their tokens read
    block 0, whose fields must not leak, NaN included): attention over the remaining tokens."""
    preset, _, layout = preset.partition("-")
    config = mma_config(preset, cache_layout=layout or "planes")
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    cache, codebook, generator = _stored_cache(module, config, num_blocks=6, first_slot=16, tokens=64, seed=0)  # blocks 1..4
    cache[0].fill_(0xFF)  # block 0: NaN norms, scales and zeros
    query = torch.randn(2, 8, 128, device="cuda", generator=generator)
    lens = torch.tensor([64, 64], dtype=torch.int32, device="cuda")
    for bad in (6, -1, 2**31 - 1):
        table = torch.tensor([[1, bad, 3, 4], [bad, bad, bad, 2]], dtype=torch.int32, device="cuda")
        out = module.decode(query, cache, table, lens, validate=False, num_warps=1, block_kv=32, num_splits=1,
                            num_stages=num_stages, **codebook)
        assert torch.isfinite(out).all()
        remaining = torch.tensor([[1, 3, 4], [2, 0, 0]], dtype=torch.int32, device="cuda")
        want = reference.decode(Layout.from_config(config), query, cache, remaining, torch.tensor([48, 16], dtype=torch.int32, device="cuda"),
                                codebook.get("rotation"), codebook.get("centroids"))
        assert relative_error(out, want) < DECODE_TOLERANCE[torch.float32]
    assert len(spy.launches) == 3


@pytest.mark.parametrize("preset,num_stages", [
    *[(preset, stages) for preset in ("k3v4", "k8v4", "k8v4-slots") for stages in (1, 3)],
    ("k3v4-slots", 2), ("k4v4-slots", 3), ("k3v3-slots", 2)])
@gpu_test
def test_mma_decode_replays_in_a_cuda_graph(build_module, monkeypatch, preset, num_stages):
    preset, _, layout = preset.partition("-")
    config = mma_config(preset, cache_layout=layout or "planes")
    module = build_module(config)
    spy = _spy(module, monkeypatch)
    cache, codebook, generator = _stored_cache(module, config, num_blocks=64, first_slot=0, tokens=1024, seed=1)
    batch = 4
    table = torch.randperm(64, device="cuda").to(torch.int32).view(batch, 16)
    lens = torch.tensor([256, 100, 17, 1], dtype=torch.int32, device="cuda")
    query = torch.randn(batch, 8, 128, device="cuda", generator=generator)
    out = torch.empty_like(query)
    workspace = module.DecodeWorkspace(batch, 8, 8, "cuda")

    def call():
        module.decode(query, cache, table, lens, out=out, workspace=workspace, validate=False, num_warps=1,
                      block_kv=32, num_splits=8, num_stages=num_stages, **codebook)

    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    table.copy_(torch.randperm(64, device="cuda").to(torch.int32).view(batch, 16))
    lens.copy_(torch.tensor([1, 255, 64, 33], dtype=torch.int32, device="cuda"))
    query.normal_(generator=generator)
    graph.replay()
    want = reference.decode(Layout.from_config(config), query, cache, table, lens, codebook.get("rotation"), codebook.get("centroids"))
    assert relative_error(out, want) < DECODE_TOLERANCE[torch.float32]
    assert len(spy.launches) >= 2


# --- the experiment variants of tools/stage1_variants.py ----------------------------
def test_stage1_variants_render_only_when_asked_and_only_for_the_gluon_kernel_with_mse_keys():
    config = make_config("k3v4", cache_layout="planes", arch="sm90")
    assert render.render(config) == render.render(config, stage1_variant="shipped")
    for variant in ("load_only", "compute_only", "extra_alu", "extra_fma"):
        source = render.render(config, stage1_variant=variant)
        assert "EXPERIMENT" in source and source != render.render(config)
    assert "EXPERIMENT" not in render.render(config)
    for refused in (make_config("k8v4", cache_layout="planes", arch="sm90"), make_config("k3v4", arch="sm90")):
        with pytest.raises(ValueError, match="Gluon stage 1 with MSE keys only"):
            render.render(refused, stage1_variant="load_only")
    with pytest.raises(ValueError, match="expected one of shipped, load_only, compute_only"):
        render.render(config, stage1_variant="no_such")
    for removed in ("pair_table", "split_warps2", "prefetch_next", "vector_partials"):  # lost, or landed
        with pytest.raises(ValueError, match=f"stage1_variant '{removed}': expected one of"):
            render.render(config, stage1_variant=removed)


_VARIANT_SCRIPT = """
import json, os, sys, tempfile
sys.path[:0] = [os.path.join(os.getcwd(), "tools"), os.getcwd()]
import ptx_probe, stage1_variants
from tqgen import config as config_mod
config = config_mod.resolve_arch(config_mod.load("configs/k3v3-d128-planes.yaml"), (9, 0))
for variant, module in stage1_variants.variant_modules(config, tempfile.mkdtemp(), stage1_variants.STAGE1_VARIANTS):
    text = ptx_probe.compile_stage1_mma(module, 32).asm["ptx"]
    print(json.dumps(dict(variant=variant, mma=text.count("mma.sync.aligned"), loads=text.count("ld.global"),
                          permutes=text.count("prmt.b32"), logic=text.count("lop3.b32"), fma=text.count("fma.rn.f32"),
                          vector_stores=text.count("st.global.v4"))))
"""


def test_stage1_variants_compile_and_keep_what_they_claim():
    """load_only keeps every load of the shipped loop and no MMA; compute_only every MMA and only the loads
    before the loop (offline sm90 compiles, in a process without the interpreter); extra_alu / extra_fma add
    exactly their instructions. The shipped kernel stores out^T 16 bytes at a time (8 stores a lane for 128 head
    dims x 8 columns), and every variant keeps that store."""
    report = {row["variant"]: row for row in offline_compile_reports("-c", _VARIANT_SCRIPT, timeout=600)}
    assert report["shipped"]["mma"] == report["compute_only"]["mma"] > 0 and report["load_only"]["mma"] == 0
    loop_loads = report["shipped"]["loads"] - report["compute_only"]["loads"]  # compute_only: the prologue's only
    assert loop_loads > 0 and report["load_only"]["loads"] >= loop_loads
    # extra_alu / extra_fma: the shipped kernel and exactly their added instructions of one kind per tile.
    added = EXTRA_WORK_CHAINS * EXTRA_WORK_STEPS
    for variant, kind in (("extra_alu", "logic"), ("extra_fma", "fma")):
        other = {"logic": "fma", "fma": "logic"}[kind]
        assert report[variant][kind] == report["shipped"][kind] + added
        assert {key: report[variant][key] for key in ("mma", "loads", "permutes", other)} == {
            key: report["shipped"][key] for key in ("mma", "loads", "permutes", other)}
    assert all(row["vector_stores"] == 8 for row in report.values())


def test_pipe_rates_kernels_issue_what_they_are_named_for():
    """tools/pipe_rates.py's kernels compiled for sm90 offline: each loop pass issues its 32 instructions of the
    kind it times (a mix 16 of each), so a rate on the GPU is that instruction's."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "tools/pipe_rates.py", "--compile"], cwd=REPO, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = {}  # kind -> {opcode: count in the loop}, from "KIND: N SASS instructions in the loop: OP n, ..."
    for line in result.stdout.splitlines():
        kind, _, mix = line.partition(": ")
        if "SASS instructions in the loop: " in mix:
            pairs = mix.split("in the loop: ", 1)[1].split(", ")
            counts[kind] = {op: int(n) for op, n in (pair.rsplit(" ", 1) for pair in pairs)}
    opcodes = {"prmt": "PRMT", "lop3": "LOP3", "shf": "SHF", "imad": "IMAD", "imad.hi": "IMAD", "ffma": "FFMA",
               "hfma2": "HFMA2"}
    for kind, opcode in opcodes.items():
        assert counts[kind][opcode] == 32, (kind, counts[kind])
    assert counts["prmt+lop3"]["PRMT"] == counts["prmt+lop3"]["LOP3"] == 16
    assert counts["prmt+imad"]["PRMT"] == counts["prmt+imad"]["IMAD"] == 16


_LOOP_LISTING = "\n".join(f"        /*{address:04x}*/                   {instruction} ;" for address, instruction in [
    (0x0080, "MOV R1, R2"),
    (0x0100, "ISETP.GE.AND P0, PT, R3, R4, PT"),
    (0x0110, "@P0 BRA 0x0300"),  # leaves the loop: not a branch inside it
    (0x0120, "LOP3.LUT R5, R5, 0xf, RZ, 0xc0, !PT"),
    (0x0130, "LOP3.LUT R6, R6, 0xf, RZ, 0xc0, !PT"),
    (0x0140, "@!P1 BRA 0x0180"),
    (0x0150, "FMUL R7, R7, R8"),
    (0x0160, "FMUL R9, R9, R8"),
    (0x0170, "FMUL R10, R10, R8"),
    (0x0180, "HMMA.16816.F32 R12, R16, R20, R12"),
    (0x0190, "@P2 BRA 0x0100"),
    (0x0300, "EXIT"),
])


def test_the_loop_mix_counts_the_longest_loop_and_what_its_forward_branches_skip():
    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    import ptx_probe

    assert ptx_probe.loop_mix(_LOOP_LISTING) == ("10 SASS instructions in the loop (forward branches in it skip 3): "
                                                 "BRA 3, FMUL 3, LOP3 2, ISETP 1, HMMA 1")
    # A skipped region with a cp.async copy (the ring's next tile, taken on most tiles) is marked.
    copying = _LOOP_LISTING.replace("FMUL R9, R9, R8", "LDGSTS.E.BYPASS.128 [R9], desc[UR4][R10.64]")
    assert ptx_probe.loop_mix(copying) == ("10 SASS instructions in the loop (forward branches in it skip 3 "
                                           "(cp.async)): BRA 3, LOP3 2, FMUL 2, ISETP 1, LDGSTS 1, HMMA 1")


def test_the_ncu_summary_reads_stalls_and_the_loops_opcodes_from_the_exports(tmp_path):
    """tools/ncu_summary.py over a made-up pair of exports in Nsight Compute's CSV form: stall reasons sorted,
    the loop being the instructions run at least a quarter as often as the hottest, by opcode."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    import ncu_summary

    names = ["gpu__time_duration.sum", "smsp__issue_active.avg.per_cycle_active",
             "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"]
    (tmp_path / "k.raw.csv").write_text("\n".join(",".join(f'"{cell}"' for cell in row) for row in
                                                  (names, ["us", "", "", ""], ["183.1", "0.60", "1,210", "0.99"])))
    columns = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
               "stall_math", "stall_wait (Not Issued)"]
    lines = [("0x10", "LDC R1, c[0x0][0x28]", "5", "10", "5", "0", "5"),  # the prologue: run once per program
             ("0x20", "@!P0 PRMT R2, R3, 0x5140, R4", "30", "1000", "20", "10", "20"),
             ("0x30", "PRMT R5, R6, 0x7362, R7", "10", "1000", "10", "0", "10"),
             ("0x40", "HMMA.16816.F32 R8, R12, R16, R8", "60", "500", "0", "60", "0")]
    (tmp_path / "k.sass.csv").write_text("\n".join([f'"Kernel Name","tq_decode_stage1_mma",']
                                                  + [",".join(f'"{cell}"' for cell in row) for row in [columns, *lines]]))
    metrics, stalls = ncu_summary.raw_summary(str(tmp_path / "k.raw.csv"))
    assert metrics == {"gpu__time_duration.sum": "183.1 us", "smsp__issue_active.avg.per_cycle_active": "0.60"}
    assert list(stalls.items()) == [("wait", 1210.0), ("math_pipe_throttle", 0.99)]
    loop = ncu_summary.sass_summary(str(tmp_path / "k.sass.csv"))
    assert list(loop) == ["PRMT", "HMMA"]
    assert loop["PRMT"][:2] == (0.8, 0.4) and loop["PRMT"][2] == [("wait", 0.75), ("math", 0.25)]
    assert loop["HMMA"] == (0.2, 0.6, [("math", 1.0)])
