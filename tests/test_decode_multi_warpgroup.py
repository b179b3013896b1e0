"""decode_multi's warpgroup stage 1 (Plan.multi_warpgroup, decode/multi_warpgroup.py.jinja): programs of 17-32 MMA
columns (query tokens x heads) on one 4-warp wgmma program. Which configs render it and which calls take it run on
the CPU; Gluon never runs in the interpreter, so the kernel compiles offline here and runs against the float64
reference on a GPU (`pytest -m gpu`)."""

import itertools
import json
import re

import pytest
import torch

from conftest import HAS_CUDA, KernelRecorder, make_config, offline_compile_reports
from test_decode_multi import (check_decode_multi, check_graph_replays, check_pages_outside_the_cache, multi_inputs,
                               ragged_seq_lens)
import tqgen
from tqgen import render
from tqgen.plan import Plan

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

# (q_len, group size): 17-32 columns, padded to 32 where they are not a power of two
WARPGROUP_CASES = [(8, 4), (5, 4), (3, 6), (4, 8), (3, 8), (2, 16)]
# fp8 keys take it from 8 columns (decode/multi.py.jinja, _WG_MIN_COLUMNS): 8, 12 and 16 columns too
FP8_KEYS_CASES = WARPGROUP_CASES + [(2, 4), (3, 4), (4, 4), (8, 1)]
# The warpgroup kernel's launch (decode_multi_launch gives it from 16 (sequence, KV head) pairs up; these small
# batches pass it); the kernel takes 64-token tiles too
WARPGROUP_LAUNCH = dict(block_kv=128, num_warps=4, num_stages=3)
# planes: 4-bit keys (the symmetric lookup) and split 3-bit keys with 4-bit values, and split 3-bit values (fp8
# keys, whose kernel reads the caller's query, have tests of their own)
PRESETS = ["k4v4", "k3v4", "k3v3"]


@pytest.fixture
def warpgroup_modules(build_module):
    """warpgroup_modules(preset) -> (the planes module, its config)."""
    def build(preset):
        config = make_config(preset, cache_layout="planes")
        return build_module(config), config
    return build


def hopper(module, monkeypatch, sm_count=132):
    """The module as on an H200 that runs Gluon, on any machine."""
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: True)
    monkeypatch.setattr(module, "_multi_wg_ready", lambda device: True)
    monkeypatch.setattr(module, "_sm_count", lambda device: sm_count)


def test_only_mse_keys_with_4_bit_or_split_3_bit_values_in_16_token_planes_render_it():
    cases = [(dict(preset="k4v4", cache_layout="planes"), True), (dict(preset="k4v4", cache_layout="slots"), False),
             (dict(preset="k3v4", cache_layout="planes"), True), (dict(preset="k3v4", cache_layout="slots"), False),
             (dict(preset="k3v3", cache_layout="planes"), True), (dict(preset="k3v3", cache_layout="slots"), False),
             (dict(preset="k8v4", cache_layout="planes", arch="sm90"), True),
             (dict(preset="k4v4", cache_layout="planes", block_size=32), False),
             (dict(preset="k4v4", cache_layout="planes", head_dim=64), False)]
    for fields, expected in cases:
        config = make_config(fields.pop("preset"), **fields)
        assert Plan.from_config(config).multi_warpgroup == expected, config.name
        assert ("def tq_decode_multi_stage1_wg(" in render.render(config)) == expected, config.name


@pytest.mark.parametrize("q_len,group_size", WARPGROUP_CASES + [(4, 4), (8, 2), (2, 8), (5, 8), (3, 16), (1, 32)])
def test_decode_multi_launch_takes_the_warpgroup_for_17_to_32_columns(warpgroup_modules, monkeypatch, q_len,
                                                                      group_size):
    """17-32 columns from 16 (sequence, KV head) pairs up take (128-token tiles, 4 warps, a ring of 3) and about 2
    programs an SM, at most decode's splits; 4-bit keys with the default centroids only (a caller's codebook need
    not be symmetric); at most 16 columns, more than 32, fewer pairs, or q_len 1 (decode's own kernels and launch),
    the one-warp kernels' launch."""
    module, _ = warpgroup_modules("k4v4")
    hopper(module, monkeypatch)
    check_warpgroup_launches(module, q_len, group_size, 17)


@pytest.mark.parametrize("q_len,group_size", FP8_KEYS_CASES + [(2, 2), (4, 1), (1, 8), (5, 8)])
def test_decode_multi_launch_takes_the_fp8_keys_warpgroup_from_8_columns(build_module, monkeypatch, q_len,
                                                                          group_size):
    """k8v4 planes: 8-32 columns (q_len 2-4 at 4 query heads per KV head too, which one one-warp program would
    hold) from 16 pairs up (8 columns: from 64) take the warpgroup launch; fewer than 8 columns, more than 32, or
    q_len 1 do not."""
    module = build_module(make_config("k8v4", cache_layout="planes", arch="sm90"))
    hopper(module, monkeypatch)
    check_warpgroup_launches(module, q_len, group_size, 8, fewest_pairs=64 if q_len * group_size == 8 else 16)


def check_warpgroup_launches(module, q_len, group_size, fewest_columns, fewest_pairs=16):
    """decode_multi_launch over small to large shapes: the warpgroup launch where q_len > 1, fewest_columns-32
    columns and fewest_pairs (sequence, KV head) pairs up, else decode's (the caller's codebook: the one-warp launch
    always)."""
    cpu = torch.device("cpu")
    columns = q_len * group_size
    takes_it = q_len > 1 and fewest_columns <= columns <= 32
    for batch, context in [(1, 4096), (1, 8192), (2, 8192), (4, 8192), (8, 8192), (32, 8192), (128, 16384)]:
        launch = module.decode_multi_launch(batch, 8, group_size, q_len, context, cpu)
        caller_codebook = module.decode_multi_launch(batch, 8, group_size, q_len, context, cpu,
                                                     symmetric_codebook=False)
        assert caller_codebook[1] == 1
        if not takes_it or batch * 8 < fewest_pairs:
            assert launch == caller_codebook
            continue
        decode_splits = module.decode_launch(batch, 8, group_size, context, cpu)[3]
        assert launch[:3] == (128, 4, 3)
        assert launch[3] == max(1, min(decode_splits, 2 * 132 // (batch * 8)))
    if takes_it:  # the timed shapes' best split counts
        for batch, splits in [(32, 1), (16, 2), (8, 4), (4, 8), (2, 16)]:
            if batch * 8 >= fewest_pairs:
                assert module.decode_multi_launch(batch, 8, group_size, q_len, 8192, cpu)[3] == splits


@pytest.mark.parametrize("dtype,own_rotation,rotated", [(torch.float16, True, True), (torch.bfloat16, True, True),
                                                        (torch.float32, True, False), (torch.float16, False, False)])
@pytest.mark.parametrize("own_centroids", [True, False])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_multi_launches_the_warpgroup_with_the_query_rotation(warpgroup_modules, monkeypatch, preset,
                                                                     own_centroids, dtype, own_rotation, rotated):
    """One program per (sequence, KV head, split) of 4 warps, then stage 2. The kernel rotates a 16-bit query under
    the config's own rotation itself (ROTATE_QUERY: reads the caller's query, launched in stream order as the
    call's first kernel); an fp32 query or a caller's rotation goes through tq_prepare_query first, which the
    kernel then waits for (a dependent launch at batch 1). A caller's centroids (the same values, another tensor)
    take the one-warp kernel where the keys' lookup needs a symmetric codebook (4 bits), not with 3-bit keys."""
    module, config = warpgroup_modules(preset)
    hopper(module, monkeypatch)
    monkeypatch.setattr(module, "_dependent_launch", lambda device: True)
    warpgroup, one_warp, prepare, stage2 = KernelRecorder(), KernelRecorder(), KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_wg", warpgroup)
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", one_warp)
    monkeypatch.setattr(module, "tq_prepare_query", prepare)
    monkeypatch.setattr(module, "tq_decode_stage2", stage2)
    batch, cache, query, kwargs = multi_inputs(module, config, [40], "cpu", 8, dtype=dtype)
    if not own_centroids:
        kwargs["centroids"] = kwargs["centroids"].clone()
    if not own_rotation:
        kwargs["rotation"] = kwargs["rotation"].clone()  # the same values, not the config's tensor
    monkeypatch.setattr(module, "_WG_MIN_PROGRAMS", 1)  # one sequence of 2 KV heads takes it too
    module.decode_multi(query, cache, batch.block_table, batch.seq_lens, num_splits=3, **kwargs)
    assert len(stage2.launches) == 1
    if not own_centroids and preset == "k4v4":
        assert not warpgroup.launches and len(one_warp.launches) == 1
        return
    assert not one_warp.launches
    (grid, args, launch), = warpgroup.launches
    assert grid == (1, 2, 3)
    assert (launch["Q_LEN"], launch["GROUP_SIZE"], launch["BLOCK_H"], launch["BLOCK_KV"]) == (8, 4, 32, 128)
    assert launch["num_warps"] == 4 and launch["STAGES"] == 3
    assert launch["ROTATE_QUERY"] == rotated and len(prepare.launches) == (0 if rotated else 1)
    assert launch["launch_pdl"] == launch["DEPENDENT_LAUNCH"] == (not rotated)
    if rotated:
        assert args[0] is query
        assert args[12:15] == query.stride()[:3]  # stride_query_batch, _token, _head
    else:
        prepared = args[0]  # [sequences x query tokens, query heads, head dim]
        assert prepared is not query and prepared.dtype == torch.float16
        assert args[12:15] == (8 * prepared.stride(0), prepared.stride(0), prepared.stride(1))
    assert args[4] is kwargs["centroids"]


_COMPILE_SCRIPT = """
import json, os, sys, dataclasses, tempfile
sys.path[:0] = [os.path.join(os.getcwd(), "tools"), os.getcwd()]
import ptx_probe, tqgen
from tqgen import config as config_mod
folder = tempfile.mkdtemp(prefix="tqgen-multi-wg-")
for stem, q_len, group_size, block_kv, rotate in json.loads(sys.argv[1]):
    config = dataclasses.replace(config_mod.load(f"configs/{stem}.yaml"), arch="sm90")
    module = tqgen.load(config, folder)
    compiled = ptx_probe.compile_multi_stage1_wg(module, group_size, q_len, dependent_launch=True, block_kv=block_kv,
                                                 rotate_query=rotate)
    ptx = compiled.asm["ptx"]
    print(json.dumps(dict(wgmma=ptx.count("wgmma.mma_async"), shared_bytes=compiled.metadata.shared,
                          registers=int(ptx_probe.ptxas_usage(ptx).split()[1]), stores=ptx.count("st.global.v4"),
                          ldmatrix_trans=ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans"))))
"""


def test_the_warpgroup_kernel_compiles_for_sm90():
    """Each case compiles offline with 16 wgmma a 64-token tile (scores^T: 128 head dims in 8 steps of 16 for each
    64 rows; out^T: 64 tokens in 4 steps, for each of its two 64-row halves) and 32 a 128-token tile, and 16 more
    where it rotates the query (two 64-row halves of H times Q^T, 8 steps each); a ring of 3 tiles (64 or 128
    tokens x 134 bytes, k4v4) beside Q^T, P and the warps' maxes (and at most the unrotated query where it
    rotates), the partials stored 16 bytes at a time (128 head dims x 32 columns over 128 lanes: 8 stores a lane),
    and at most 168 registers a lane at 64-token tiles (3 programs of 4 warps an SM), 255 at 128 (2 an SM, as many
    as _multi_wg_launch asks for); the values' 16-bit units (k3v3: the low words) through ldmatrix, 8 tokens a lane
    an instruction."""
    cases = [(f"{preset}-d128-planes", q_len, group_size, 64, False) for preset in PRESETS
             for q_len, group_size in WARPGROUP_CASES]
    cases += [(f"{preset}-d128-planes", 8, 4, 128, False) for preset in PRESETS]
    cases += [(f"{preset}-d128-planes", 8, 4, 64, True) for preset in PRESETS]
    reports = offline_compile_reports("-c", _COMPILE_SCRIPT, json.dumps(cases), timeout=600)
    assert len(reports) == len(cases)
    for case, report in zip(cases, reports):
        block_kv, rotate = case[3:]
        key_bytes = 64 if case[0].startswith("k4") else 48  # a token's key codes: 128 x 4 or 3 bits
        value_bytes = 48 if "v3" in case[0] else 64  # and its value codes
        ring = 3 * block_kv * (key_bytes + value_bytes + 2 + 4)  # and its key norm and value scale-zero
        assert report["wgmma"] == 16 * block_kv // 64 + (16 if rotate else 0), case
        operands = 128 * 32 * 2 + block_kv * 32 * 2  # Q^T and P, fp16
        # and the warps' maxes (4 x 32 fp32) and flags, with the allocator's alignment: under 1 KB; where it rotates,
        # the unrotated query (128 x 32 x 2 bytes), whose space the allocator may share with what comes later
        query = 128 * 32 * 2 if rotate else 0
        assert ring + operands <= report["shared_bytes"] <= ring + operands + query + 1024, (case, report)
        assert report["registers"] <= (168 if block_kv == 64 else 255), (case, report)
        assert report["stores"] == 8, (case, report)
        assert report["ldmatrix_trans"] == block_kv // 32, (case, report)  # the value units' (k3v3: low words)


def test_the_kernel_loads_each_tiles_block_ids_a_tile_before_it_uses_them():
    """The page test at the top of a tile and the ring's copies of the tile two ahead read block ids loaded a loop
    pass before (_wg_tile_blocks; without it each tile began with waits on the block table: docs/limits.md); only
    the single-token kernel loads its pages where it uses them (_mma_tile_pages)."""
    source = render.render(make_config("k3v4", cache_layout="planes", arch="sm90"))
    kernel = source[source.index("def tq_decode_multi_stage1_wg("):]
    kernel = kernel[:kernel.index("\n\n\n")]
    assert "_mma_tile_pages(" not in kernel
    assert "page_ok = _wg_blocks_ok(next_blocks, num_blocks)" in kernel
    loop = kernel[kernel.index("for tile_start in range("):]
    for loaded_ahead in ("next_blocks = _wg_tile_blocks(tile_start + BLOCK_KV, page_in_tile",
                         "copy_blocks = _wg_tile_blocks(ahead + BLOCK_KV, copy_page", "_wg_copy_tile(copy_blocks, "):
        assert loop.count(loaded_ahead) == 1, loaded_ahead
    assert loop.index("page_ok = _wg_blocks_ok(next_blocks") < loop.index("next_blocks = _wg_tile_blocks(")
    assert loop.index("_wg_copy_tile(copy_blocks, ") < loop.index("copy_blocks = _wg_tile_blocks(")


def test_the_split_values_decode_puts_each_code_where_its_row_expects_it():
    """k3v3's value decode (Plan.multi_warpgroup_split_values), evaluated on every group the store can write (the
    rendered masks, shifts and orders): field i = r + 2s of low byte h, after the low word's shift by 8h and the
    high byte's by 2 - h, is code 4r + 2h + s of the group (the code the out^T row of (s, h, r) maps back to), at
    bits 2i..2i + 2 alone."""
    config = make_config("k3v3", cache_layout="planes", arch="sm90")
    plan = Plan.from_config(config)
    assert plan.multi_warpgroup and plan.multi_warpgroup_split_values
    source = render.render(config)
    assert "low = low >> (8 * h)" in source and "high = high << (2 - h)" in source
    selects = dict(re.findall(r"(even|odd)_fields = low \^ \(\(low \^ high\) & 0x([0-9A-F]{8})\)", source))
    masks = re.findall(r"code(\d) = (even|odd)_fields & 0x([0-9A-F]{8})", source)
    assert sorted(selects) == ["even", "odd"] and [int(code) for code, _, _ in masks] == [0, 1, 2, 3]
    layout = plan.layout
    for codes in itertools.product(range(8), repeat=2):  # two codes of a group at a time: every pair of codes
        for first, second in itertools.permutations(range(8), 2):
            group = [0] * 8
            group[first], group[second] = codes
            low = sum((group[k] >> bit & 1) << layout.group_word_bit(3, k, bit) for k in range(8) for bit in (0, 1))
            high = sum((group[k] >> 2 & 1) << (layout.group_word_bit(3, k, 2) - 16) for k in range(8))
            for h in (0, 1):
                shifted_low, shifted_high = low >> 8 * h, high << (2 - h)
                for field, (_, fields, mask) in enumerate(masks):
                    select = int(selects[fields], 16)
                    word = (shifted_low ^ ((shifted_low ^ shifted_high) & select)) & int(mask, 16)
                    assert word & ~(7 << 2 * field) & 0xFFFF == 0
                    r, s = field & 1, field >> 1
                    code = group[plan.multi_warpgroup_value_code(h, field)]
                    assert word >> 2 * field == group[4 * r + 2 * h + s] == code


def test_the_fp8_keys_kernel_launches_and_compiles_for_sm90(tmp_path, monkeypatch):
    """k8v4 planes (Plan.multi_warpgroup_fp8_keys): decode_multi launches the warpgroup kernel for 32 columns with
    the caller's query (its dtype and all four strides, scale * log2(e); no tq_prepare_query, no centroids, not a
    dependent launch), and it compiles offline as the MSE kernels do: 32 wgmma a 128-token tile, 16-byte stores, at
    most 168 registers at 64-token tiles and 255 at 128, a ring of 128 + 64 + 4 bytes a token; at 8 and 16 columns
    (q_len 2 and 4: 16 columns, the kernel's fewest) too, with a 16-byte store per 4 columns."""
    config = make_config("k8v4", cache_layout="planes", arch="sm90")
    assert Plan.from_config(config).multi_warpgroup
    source = render.render(config)
    assert max(len(line) for line in source.splitlines()) <= render.MAX_LINE
    kernel = source[source.index("def tq_decode_multi_stage1_wg("):]
    assert "centroids_ptr" not in kernel[:kernel.index("):")] and "stride_query_dim," in kernel
    module = tqgen.load(config, tmp_path)
    hopper(module, monkeypatch)
    warpgroup, one_warp, stage2 = KernelRecorder(), KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_wg", warpgroup)
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", one_warp)
    monkeypatch.setattr(module, "tq_decode_stage2", stage2)
    monkeypatch.setattr(module, "_WG_MIN_PROGRAMS", 1)
    batch, cache, query, kwargs = multi_inputs(module, config, [40], "cpu", 8, dtype=torch.bfloat16)
    query = query.transpose(1, 2).contiguous().transpose(1, 2)  # strided: the kernel takes any strides
    module.decode_multi(query, cache, batch.block_table, batch.seq_lens, num_splits=3, scale=0.5, **kwargs)
    assert not one_warp.launches and len(stage2.launches) == 1
    (grid, args, launch), = warpgroup.launches
    assert grid == (1, 2, 3) and args[0] is query
    assert args[11:15] == query.stride()
    assert args[-1] == pytest.approx(0.5 * 1.4426950408889634)
    assert (launch["Q_LEN"], launch["GROUP_SIZE"], launch["BLOCK_KV"], launch["DEPENDENT_LAUNCH"]) == (8, 4, 128, False)
    assert launch["num_warps"] == 4 and launch["launch_pdl"] is False
    cases = [("k8v4-d128-planes", q_len, 4, block_kv, False) for q_len, block_kv in ((8, 64), (8, 128), (2, 128),
                                                                                     (4, 128))]
    reports = offline_compile_reports("-c", _COMPILE_SCRIPT, json.dumps(cases), timeout=600)
    assert len(reports) == len(cases)
    for (_, q_len, group_size, block_kv, _), report in zip(cases, reports):
        columns = max(16, 1 << (q_len * group_size - 1).bit_length())  # the MMA's N (_multi_wg_constants)
        assert report["wgmma"] == 16 * block_kv // 64 and report["stores"] == columns // 4, report
        assert report["registers"] <= (168 if block_kv == 64 else 255), report
        ring = 3 * block_kv * (128 + 64 + 4)
        assert ring + 128 * columns * 2 + block_kv * columns * 2 <= report["shared_bytes"], report


def test_decode_multi_caps_the_warpgroup_kernel_at_168_registers_on_64_token_tiles(warpgroup_modules, monkeypatch):
    """3 programs of 4 warps an SM at 64-token tiles (the compile test checks the kernel fits); 2 at 128, uncapped."""
    module, config = warpgroup_modules("k4v4")
    hopper(module, monkeypatch)
    warpgroup = KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_wg", warpgroup)
    monkeypatch.setattr(module, "tq_decode_stage2", KernelRecorder())
    batch, cache, query, kwargs = multi_inputs(module, config, [40], "cpu", 8, dtype=torch.float16)
    for block_kv, cap in [(64, 168), (128, None)]:
        module.decode_multi(query, cache, batch.block_table, batch.seq_lens, num_splits=2, block_kv=block_kv,
                            num_warps=4, num_stages=3, **kwargs)
        launch = warpgroup.launches[-1][2]
        assert launch["BLOCK_KV"] == block_kv and launch.get("maxnreg") == cap


# --- on the GPU --------------------------------------------------------------------------------------------------
def on_hopper(warpgroup_modules, monkeypatch, preset):
    """(module, config, a spy on its warpgroup kernel), or the test skipped on a GPU other than Hopper's."""
    module, config = warpgroup_modules(preset)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma: Hopper only")
    spy = KernelRecorder(module.tq_decode_multi_stage1_wg)
    monkeypatch.setattr(module, "tq_decode_multi_stage1_wg", spy)
    return module, config, spy


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block_kv", [64, 128])
@pytest.mark.parametrize("q_len,group_size", WARPGROUP_CASES)
@pytest.mark.parametrize("preset", PRESETS)
def test_the_warpgroup_kernel_matches_the_reference_on_the_gpu(warpgroup_modules, monkeypatch, preset, q_len,
                                                               group_size, block_kv):
    """Ragged sequences whose causal limits fall at 1, below a page boundary and past several splits, and a long
    one, at 1, 2, 5 and 40 splits (some past the sequences' ends), fp32 queries (tq_prepare_query's rotation) and
    fp16 and bf16 ones (rotated in the kernel); 64- and 128-token tiles."""
    module, config, spy = on_hopper(warpgroup_modules, monkeypatch, preset)
    cases = ((1, torch.float32), (5, torch.float16), (2, torch.bfloat16), (40, torch.float32))
    for num_splits, dtype in cases:
        check_decode_multi(module, config, "cuda", ragged_seq_lens(q_len) + [1000], q_len, group_size=group_size,
                           dtype=dtype, num_splits=num_splits, **dict(WARPGROUP_LAUNCH, block_kv=block_kv))
    assert [launch["ROTATE_QUERY"] for _, _, launch in spy.launches] == [False, True, True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block_kv", [64, 128])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_warpgroup_kernel_masks_pages_outside_the_cache(warpgroup_modules, monkeypatch, preset, block_kv):
    """validate=False with a block id outside the cache inside the first and second tiles: that page's tokens are
    masked, and block 0, which such a page reads, holds NaN fields that must not leak into the output."""
    module, config, spy = on_hopper(warpgroup_modules, monkeypatch, preset)
    # positions 16-31 (the first tile) and 96-111 (the second 64-token tile; the first of 128)
    check_pages_outside_the_cache(module, config, 10, (1, 6), 8, **dict(WARPGROUP_LAUNCH, block_kv=block_kv))
    assert len(spy.launches) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset", PRESETS)
def test_the_warpgroup_kernel_replays_in_a_cuda_graph(warpgroup_modules, monkeypatch, preset):
    """Captured with a workspace, replayed for new queries, block tables and seq_lens (from q_len up)."""
    module, config, spy = on_hopper(warpgroup_modules, monkeypatch, preset)
    check_graph_replays(module, config, 8, 4, **WARPGROUP_LAUNCH)
    assert spy.launches


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block_kv", [64, 128])
@pytest.mark.parametrize("q_len,group_size", FP8_KEYS_CASES)
def test_the_fp8_keys_kernel_matches_the_reference_on_the_gpu(warpgroup_modules, monkeypatch, q_len, group_size,
                                                              block_kv):
    """k8v4 planes on the warpgroup kernel: ragged sequences as above, fp32, fp16 (strided) and bf16 queries read
    and scaled by the kernel itself; then pages outside the cache masked, and a CUDA-graph replay."""
    module, config, spy = on_hopper(warpgroup_modules, monkeypatch, "k8v4")
    launch = dict(WARPGROUP_LAUNCH, block_kv=block_kv)
    for num_splits, dtype in ((1, torch.float32), (5, torch.float16), (2, torch.bfloat16), (40, torch.float32)):
        check_decode_multi(module, config, "cuda", ragged_seq_lens(q_len) + [1000], q_len, group_size=group_size,
                           dtype=dtype, num_splits=num_splits, strided_query=dtype == torch.float16, **launch)
    assert len(spy.launches) == 4
    if (q_len, group_size) == (8, 4):
        check_pages_outside_the_cache(module, config, 10, (1, 6), 8, **launch)
        check_graph_replays(module, config, 8, 4, **WARPGROUP_LAUNCH)
        assert len(spy.launches) > 7
