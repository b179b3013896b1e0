"""decode_multi: q_len query tokens per sequence (speculative decoding's verification) against the float64
reference (one single-token decode per query token on the sequence cut to that token's limit), and the
single-token decode it must equal at q_len 1. The CPU runs a subset; the GPU (`pytest -m gpu`) the matrix."""

import json

import numpy as np
import pytest
import torch

from conftest import (DEVICES, HAS_CUDA, KernelRecorder, codebook_kwargs, make_config, offline_compile_reports,
                      replays_of_a_capture, stored_cache)
import tqgen
from tqgen import reference, render
from tqgen.layout import Layout
from tqgen.testing import DECODE_TOLERANCE, relative_error

# Query tokens whose causal limit ends before a split leave that split with a running sum of 0, and stage 1
# stores where(running_sum > 0, running_max + log2(running_sum), -inf): Triton's interpreter computes log2 on
# every lane with numpy, which warns "divide by zero" for those lanes before tl.where discards them (a GPU
# gives -inf silently; the tests check the outputs). Every multi-token case can mask whole splits so, as in
# test_launch_validation.py, the warning is expected throughout this file.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

GPU = [DEVICES[1]]  # the device fixture's CUDA parameter (marked gpu): tests too slow for the interpreter


def ragged_seq_lens(q_len, page=16):
    """Sequences whose first query token sees exactly 1 position (seq_len = q_len), 15 (its limit below a
    page boundary) and 67 - q_len (over three pages, so the last split lies past some tokens' limits)."""
    return [q_len, 14 + q_len, 66]


def multi_inputs(module, config, seq_lens, device, q_len, num_kv_heads=2, group_size=4, dtype=torch.float32, seed=0):
    batch, cache = stored_cache(module, config, seq_lens, device, num_kv_heads, seed)
    generator = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(len(seq_lens), q_len, num_kv_heads * group_size, config.head_dim, generator=generator)
    return batch, cache, query.to(device=device, dtype=dtype), codebook_kwargs(module, config, device)


def check_decode_multi(module, config, device, seq_lens, q_len, num_kv_heads=2, group_size=4, dtype=torch.float32,
                       seed=0, strided_query=False, **launch):
    """decode_multi of a random ragged batch against reference.decode_multi; returns the output."""
    batch, cache, query, kwargs = multi_inputs(module, config, seq_lens, device, q_len, num_kv_heads, group_size,
                                               dtype, seed)
    if strided_query:  # same values, laid out [head_dim, heads, q_len, batch] underneath
        query = query.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    out = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, **kwargs, **launch)
    want = reference.decode_multi(Layout.from_config(config), query, cache, batch.block_table, batch.seq_lens,
                                  kwargs.get("rotation"), kwargs.get("centroids"))
    assert out.dtype == dtype and out.shape == want.shape == query.shape
    assert torch.isfinite(out).all()
    error = relative_error(out, want)
    assert error < DECODE_TOLERANCE[dtype], f"relative error {error:.2e}"
    return out


@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k8v4", "slots")])
def test_decode_multi_matches_the_reference(device, build_module, preset, layout, q_len):
    config = make_config(preset, cache_layout=layout)
    check_decode_multi(build_module(config), config, device, ragged_seq_lens(q_len), q_len, num_kv_heads=1,
                       block_kv=32, num_splits=3)


@pytest.mark.parametrize("q_len", [2, 8])
@pytest.mark.parametrize("preset,layout", [("k3v4", "slots"), ("k8v4", "planes")])
def test_decode_multi_matches_the_reference_in_the_other_layouts(device, build_module, preset, layout, q_len):
    config = make_config(preset, cache_layout=layout)
    check_decode_multi(build_module(config), config, device, [q_len, 14 + q_len], q_len, block_kv=32, num_splits=2)


@pytest.mark.parametrize("group_size,q_len,num_kv_heads", [(1, 4, 2), (6, 3, 1), (8, 2, 1), (16, 8, 1)])
def test_decode_multi_group_sizes(device, build_module, group_size, q_len, num_kv_heads):
    """6 heads pad the dot's rows (3 x 6 = 18 of 32); 16 heads x 8 tokens exceed a program's 64 rows, so
    two programs take 4 tokens each and the first stops at its last token's limit."""
    config = make_config("k3v4", cache_layout="planes")
    check_decode_multi(build_module(config), config, device, [q_len + 1, 40], q_len, num_kv_heads=num_kv_heads,
                       group_size=group_size, block_kv=32, num_splits=2)


@pytest.mark.parametrize("device", GPU)
@pytest.mark.parametrize("group_size", [1, 4, 6, 8, 16, 64])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("preset", ["k3v4", "k4v4", "k3v3", "k8v4"])
@pytest.mark.parametrize("layout", ["slots", "planes"])
def test_decode_multi_matrix_on_the_gpu(device, build_module, layout, preset, q_len, group_size):
    config = make_config(preset, cache_layout=layout)
    check_decode_multi(build_module(config), config, device, ragged_seq_lens(q_len) + [1000, 4097], q_len,
                       group_size=group_size)


@pytest.mark.parametrize("device", GPU)
@pytest.mark.parametrize("block_kv,num_warps,num_stages", [(32, 1, 1), (32, 1, 3), (64, 2, 2), (128, 4, 1)])
@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k8v4", "planes"), ("k4v4", "slots")])
def test_decode_multi_launch_parameters_on_the_gpu(device, build_module, preset, layout, block_kv, num_warps,
                                                   num_stages):
    config = make_config(preset, cache_layout=layout)
    for num_splits in (1, 5, 16):
        check_decode_multi(build_module(config), config, device, ragged_seq_lens(4) + [300], 4, block_kv=block_kv,
                           num_warps=num_warps, num_stages=num_stages, num_splits=num_splits)


@pytest.mark.parametrize("preset,dtype", [("k8v4", torch.bfloat16), ("k3v4", torch.float16)])
def test_decode_multi_reads_a_strided_half_precision_query(device, build_module, preset, dtype):
    """fp8 keys: stage 1 reads the caller's query by its four strides; MSE keys: tq_prepare_query reads
    it as [batch * q_len, heads, D] (a copy where the strides do not allow a view)."""
    config = make_config(preset, cache_layout="planes")
    check_decode_multi(build_module(config), config, device, [3, 20], 3, dtype=dtype, strided_query=True,
                       num_splits=2)


@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k8v4", "slots")])
def test_q_len_one_is_decode_bit_for_bit(device, build_module, preset, layout):
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [1, 20, 40], device, 1)
    single = module.decode(query[:, 0], cache, batch.block_table, batch.seq_lens, **kwargs)
    multi = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, **kwargs)
    assert multi.shape == (3, 1, 8, 128)
    assert torch.equal(multi[:, 0], single)


@pytest.mark.parametrize("preset,layout", [("k4v4", "slots"), ("k8v4", "planes")])
def test_q_len_one_with_a_workspace_merges_in_stage1_where_decode_does(device, build_module, monkeypatch, preset,
                                                                        layout):
    """Where the shape bucket merges the splits in stage 1 for calls with a workspace (merged_in_stage1: the H200's
    k4v4 slots tunes do at batch <= 8), decode_multi at q_len 1 takes decode's choice: decode's results bit for
    bit, where stage 2 merging them differs in the last bits."""
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    asked = []  # each call asks for the bucket of its own (sequence, KV head) pairs
    monkeypatch.setattr(module, "merged_in_stage1", lambda batch, group_size, context, device, num_kv_heads=None:
                        asked.append((batch, group_size, num_kv_heads)) or True)
    batch, cache, query, kwargs = multi_inputs(module, config, [1, 20, 70], device, 1)
    workspace = module.DecodeWorkspace(3, 8, 8, device)
    single = module.decode(query[:, 0], cache, batch.block_table, batch.seq_lens, workspace=workspace, num_splits=4,
                           **kwargs)
    multi = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, workspace=workspace, num_splits=4,
                                **kwargs)
    assert torch.equal(multi[:, 0], single)
    assert not workspace.split_counters.any()  # left zeros, as decode leaves them
    assert asked == [(3, 4, 2)] * 2  # decode's call and decode_multi's: 3 sequences, 4 query heads over 2 KV heads


@pytest.mark.parametrize("preset", ["k3v4", "k8v4"])
def test_multi_token_kernel_at_one_token_is_the_tl_dot_decode(device, build_module, monkeypatch, preset):
    """decode_multi runs decode's kernels at q_len 1; its own stage 1 at Q_LEN 1 computes what decode's
    tl.dot stage 1 does, bit for bit (decode held to that kernel, its query from tq_prepare_query)."""
    config = make_config(preset, cache_layout="planes")
    module = build_module(config)
    monkeypatch.setattr(module, "MMA_STAGE1", False, raising=False)
    batch, cache, query, kwargs = multi_inputs(module, config, [1, 20, 40], device, 1)
    if "rotation" in kwargs:
        kwargs["rotation"] = kwargs["rotation"].clone()  # not the default tensor: stage 1 does not rotate it
        arguments = (kwargs["rotation"], kwargs["centroids"])
    else:
        arguments = ()
    launch = (3, 32, 1, 1)  # num_splits, block_kv, num_warps, num_stages
    want = module.decode(query[:, 0], cache, batch.block_table, batch.seq_lens, num_splits=3, block_kv=32,
                         num_warps=1, num_stages=1, **kwargs)
    out = torch.empty_like(query)
    module._run_decode_multi(query, cache, batch.block_table, batch.seq_lens, *arguments, out, None, 128 ** -0.5,
                             *launch)
    assert torch.equal(out[:, 0], want)


@pytest.mark.parametrize("layout", ["slots", "planes"])
def test_a_split_past_a_tokens_limit_has_weight_zero(device, build_module, layout):
    """seq_len 66, q_len 4, 32-token splits: [64, 66) lies past token 0's limit (63) and token 1's (64),
    so their rows of that split keep lse = -inf (stage 2 weighs them 0 and never reads their output,
    NaN here); tokens 2 and 3 see positions 64 and 64-65 of it."""
    config = make_config("k3v4", cache_layout=layout)
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [66], device, 4)
    workspace = module.DecodeWorkspace(1, 8, 4, device, max_q_len=4)
    workspace.partial_out.fill_(float("nan"))
    workspace.partial_lse.fill_(float("nan"))
    out = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, workspace=workspace, num_splits=3,
                              block_kv=32, **kwargs)
    lse = workspace.partial_lse[:4, :, :3]  # [query token, head, split]
    assert torch.isfinite(lse[:, :, :2]).all()
    assert (lse[:2, :, 2] == float("-inf")).all() and torch.isfinite(lse[2:, :, 2]).all()
    want = reference.decode_multi(Layout.from_config(config), query, cache, batch.block_table, batch.seq_lens,
                                  kwargs.get("rotation"), kwargs.get("centroids"))
    assert relative_error(out, want) < DECODE_TOLERANCE[torch.float32]


def test_without_validation_a_token_that_sees_nothing_gets_zeros(device, build_module):
    """validate=False leaves seq_len < q_len to the caller: the tokens whose limit is 0 or less see no
    position and get zeros, as a seq_len of 0 does in decode."""
    config = make_config("k8v4", cache_layout="planes")
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [2, 0, 9], device, 4)
    out = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, validate=False, **kwargs)
    assert (out[0, :2] == 0).all() and (out[1] == 0).all() and not (out[0, 2:] == 0).any()
    want = reference.decode_multi(Layout.from_config(config), query, cache, batch.block_table, batch.seq_lens)
    assert relative_error(out, want) < DECODE_TOLERANCE[torch.float32]


def test_without_validation_limits_count_from_seq_lens_past_the_table(device, build_module):
    """validate=False with seq_lens past what the block table holds: only the table's positions are read,
    and each token's limit still counts from seq_lens as passed (3 past a 32-token table at q_len 4: every
    token sees all 32 positions), not from the table's length (which would hide the last 3 from token 0)."""
    config = make_config("k3v4", cache_layout="planes")
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [32], device, 4, num_kv_heads=1)
    table = batch.block_table[:, :32 // config.block_size].contiguous()  # holds the 32 positions, no more
    longer = batch.seq_lens + 3
    out = module.decode_multi(query, cache, table, longer, validate=False, num_splits=2, block_kv=32, **kwargs)
    layout = Layout.from_config(config)
    for token in range(4):
        want = reference.decode(layout, query[:, token], cache, table, batch.seq_lens,
                                kwargs.get("rotation"), kwargs.get("centroids"))
        assert relative_error(out[:, token], want) < DECODE_TOLERANCE[torch.float32], f"token {token}"


def test_workspace_and_out_buffers(device, build_module):
    """A workspace of 2 sequences x 4 tokens serves 2 x 3 (its rows: sequences x tokens), and `out` may
    be a view whose [batch, q_len] dims flatten."""
    config = make_config("k3v4", cache_layout="slots")
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [30, 6], device, 3)
    workspace = module.DecodeWorkspace(max_batch=2, num_q_heads=8, max_splits=4, device=device, max_q_len=4)
    workspace.partial_out.fill_(float("nan"))
    out = torch.full((2, 3, 16, 128), float("nan"), device=device)[:, :, 4:12]  # heads 4..11 of 16
    result = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, out=out, workspace=workspace,
                                 num_splits=3, **kwargs)
    assert result is out
    plain = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, num_splits=3, **kwargs)
    assert torch.equal(out, plain)


def test_q_len_one_takes_any_out_that_decode_takes(device, build_module):
    """At q_len 1 `out`'s [batch, 1] dims need not flatten (decode's kernels write out[:, 0]): a view of one token
    of a larger buffer is written as decode writes it, and nothing else in the buffer."""
    config = make_config("k8v4", cache_layout="planes")
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [1, 20, 40], device, 1)
    buffer = torch.full((3, 2, 8, 128), float("nan"), device=device)
    out = buffer[:, 1:]  # strides (2048, 1024, 128, 1): out.stride(0) != q_len * out.stride(1)
    result = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, out=out, **kwargs)
    assert result is out
    assert torch.equal(out[:, 0], module.decode(query[:, 0], cache, batch.block_table, batch.seq_lens, **kwargs))
    assert buffer[:, 0].isnan().all()


def test_decode_multi_rejects_bad_arguments(device, build_module):
    config = make_config("k3v4", cache_layout="planes")
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [20, 5], device, 4)
    table, lens = batch.block_table, batch.seq_lens
    cases = [
        (dict(query=query[:, :0]), "q_len 0"),
        (dict(query=torch.randn(2, 9, 8, 128, device=device)), "q_len 9"),
        (dict(query=query[:, 0]), "query must have 4 dimensions"),
        (dict(seq_lens=torch.tensor([20, 3], dtype=torch.int32, device=device)), "seq_lens has an entry of 3 tokens"),
        (dict(out=torch.empty(2, 4, 8, 128, device=device).transpose(0, 1)), "out must be"),
        (dict(out=torch.empty(2, 3, 8, 128, device=device)), "out must be"),
        (dict(workspace=module.DecodeWorkspace(2, 8, 4, device, max_q_len=2), num_splits=2), "workspace holds"),
        (dict(block_kv=16), "block_kv must be"),
        (dict(scale=torch.tensor(0.1, device=device)), "scale must be"),
    ]
    arguments = dict(query=query, kv_cache=cache, block_table=table, seq_lens=lens)
    for override, message in cases:
        call = dict(arguments, **override)
        with pytest.raises(module.LaunchError, match=message) as raised:
            module.decode_multi(call.pop("query"), call.pop("kv_cache"), call.pop("block_table"),
                                call.pop("seq_lens"), **kwargs, **call)
        assert "\n" not in str(raised.value)


def test_max_seq_len_takes_any_integer_and_refuses_the_rest_in_one_line(device, build_module):
    """max_seq_len picks the launch: a numpy or 0-dim tensor integer is that int (it was refused as a bad
    num_splits, which the call never passed); a negative, infinite or non-integer one is refused naming it."""
    config = make_config("k8v4", cache_layout="planes")
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [3, 20], device, 3)
    plain = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, max_seq_len=100, **kwargs)
    for max_seq_len in (np.int64(100), torch.tensor(100)):
        out = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, max_seq_len=max_seq_len, **kwargs)
        assert torch.equal(out, plain)
    for max_seq_len in (-1, float("inf"), 100.0, "100", [100], True, torch.tensor(100.0)):
        with pytest.raises(module.LaunchError, match="^decode_multi: max_seq_len must be a non-negative int"):
            module.decode_multi(query, cache, batch.block_table, batch.seq_lens, max_seq_len=max_seq_len, **kwargs)


def test_empty_batch(device, build_module):
    config = make_config("k8v4")
    module = build_module(config)
    cache = module.make_cache(2, 2, device)
    out = module.decode_multi(torch.zeros(0, 3, 4, 128, device=device), cache,
                              torch.zeros(0, 1, dtype=torch.int32, device=device),
                              torch.zeros(0, dtype=torch.int32, device=device))
    assert out.shape == (0, 3, 4, 128)


@pytest.mark.parametrize("stem", ["k3v4-d128", "k3v4-d128-planes", "k8v4-d128", "k8v4-d128-planes"])
def test_the_multi_token_path_is_outside_the_decode_hash(stem):
    """The tuned launches are keyed on what _run_decode reaches: the multi-token kernel and launcher must
    not be among it (they would re-key every committed tuned file), and decode_multi must reach them."""
    planes = stem.endswith("planes")  # built for sm90, where every preset has the Gluon kernels
    config = make_config(stem.split("-")[0], **(dict(cache_layout="planes", arch="sm90") if planes else {}))
    source = render.render(config)
    multi_only = {"tq_decode_multi_stage1", "tq_decode_multi_stage1_mma", "_run_decode_multi", "decode_multi"}
    assert not multi_only & set(render.decode_path(source))
    reached = set(render.decode_path(source, "decode_multi"))
    assert {"tq_decode_multi_stage1", "tq_decode_stage2", "_run_decode"} <= reached
    # slots: MSE keys have the Gluon kernel on every arch, fp8 keys only where e4m3 converts (not sm80)
    assert ("tq_decode_multi_stage1_mma" in reached) == (planes or stem == "k3v4-d128")


# --- the Gluon kernel (planes) ---------------------------------------------------------------
MMA_CASES = [  # (q_len, group size, num_warps, MMA_STAGE1, Gluon programs per sequence, or 0: the tl.dot kernel)
    (4, 4, 1, True, 1), (2, 8, 1, True, 1), (3, 4, 1, True, 1), (8, 2, 1, True, 1), (8, 4, 1, True, 2),
    (3, 8, 1, True, 2), (5, 6, 1, True, 0), (2, 16, 1, True, 2), (4, 4, 2, True, 0), (4, 4, 1, False, 0),
]


@pytest.mark.parametrize("q_len,group_size,num_warps,switched_on,token_blocks", MMA_CASES)
@pytest.mark.parametrize("preset", ["k3v4", "k8v4"])
def test_decode_multi_takes_the_gluon_kernel_where_it_can(build_module, monkeypatch, preset, q_len, group_size,
                                                           num_warps, switched_on, token_blocks):
    """Where decode would take the Gluon kernel (one warp, MMA_STAGE1, a GPU that can), decode_multi does
    when its query tokens fit in _MULTI_MMA_MAX_TOKEN_BLOCKS (2) programs of at most 16 MMA columns (query
    tokens x heads): each such program reads the tiles once for its tokens; else the tl.dot kernel. (fp8 keys: built for sm90, as arch auto resolves to
    sm80 without a GPU, which has no e4m3 converter and so no Gluon kernel for them.)"""
    config = make_config(preset, cache_layout="planes", **({"arch": "sm90"} if preset == "k8v4" else {}))
    module = build_module(config)
    device = "cuda" if HAS_CUDA else "cpu"
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: True)  # a GPU that can, on any machine
    monkeypatch.setattr(module, "MMA_STAGE1", switched_on)
    mma, dot = KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", mma)
    monkeypatch.setattr(module, "tq_decode_multi_stage1", dot)
    monkeypatch.setattr(module, "tq_decode_stage2", KernelRecorder())
    batch, cache, query, kwargs = multi_inputs(module, config, [40, 40], device, q_len, group_size=group_size)
    module.decode_multi(query, cache, batch.block_table, batch.seq_lens, num_warps=num_warps, block_kv=32,
                        num_stages=2, num_splits=3, **kwargs)
    assert (len(mma.launches), len(dot.launches)) == ((1, 0) if token_blocks else (0, 1))
    if token_blocks:
        grid, _, launch = mma.launches[0]
        assert grid == (2 * token_blocks, 2, 3)
        tokens = -(-q_len // token_blocks)
        columns = tokens * group_size
        assert columns <= 16
        assert (launch["Q_LEN"], launch["TOKENS_PER_PROGRAM"], launch["GROUP_SIZE"]) == (q_len, tokens, group_size)
        assert launch["BLOCK_H"] == max(8, 1 << (columns - 1).bit_length()) and launch["STAGES"] == 2
        assert launch["num_warps"] == 1 and launch["BLOCK_KV"] == 32


def wide_launch_module(build_module, monkeypatch, preset, sm_count=132):
    """A planes module as on an H200 (132 SMs) whose GPU runs the one-warp Gluon kernel, on any machine (the
    warpgroup kernel of 17-32 columns held off: test_decode_multi_warpgroup.py has its launches)."""
    config = make_config(preset, cache_layout="planes", **({"arch": "sm90"} if preset == "k8v4" else {}))
    module = build_module(config)
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: True)
    if hasattr(module, "_multi_wg_ready"):
        monkeypatch.setattr(module, "_multi_wg_ready", lambda device: False)
    monkeypatch.setattr(module, "_sm_count", lambda device: sm_count)
    return module


@pytest.mark.parametrize("preset,resident", [("k3v4", 12), ("k8v4", 8)])
def test_wide_programs_take_at_most_one_wave_of_splits(build_module, monkeypatch, preset, resident):
    """A Gluon program of more than 8 MMA columns (decode_multi's query tokens x heads, or decode's heads past 8)
    takes 32-token tiles in a ring of 2 and decode's splits, fewer where its programs would not all be resident
    at once: 12 one-warp programs per SM under the MSE kernels' cap of 168 registers, 8 for fp8 keys (uncapped:
    counted at 255). Narrow programs (q_len 1, or 2 tokens x 4 heads) keep decode's launch."""
    module = wide_launch_module(build_module, monkeypatch, preset)
    cpu = torch.device("cpu")
    assert module._mma_resident_programs(32, 16, 132) == resident * 132
    assert module._mma_resident_programs(32, 4, 132) == (16 if preset == "k3v4" else 8) * 132
    for batch, context in [(1, 4096), (8, 8192), (32, 8192), (32, 16384), (128, 16384), (256, 65536)]:
        decode = module.decode_launch(batch, 8, 4, context, cpu)
        for q_len in (1, 2):  # 4 and 8 columns: decode's launch
            assert module.decode_multi_launch(batch, 8, 4, q_len, context, cpu) == decode
        for q_len, group_size in [(4, 4), (8, 4), (3, 4), (2, 8), (8, 2), (2, 16), (3, 6)]:
            tokens = min(q_len, 16 // group_size)
            programs = batch * 8 * -(-q_len // tokens)
            block_kv, warps, stages, splits = module.decode_multi_launch(batch, 8, group_size, q_len, context, cpu)
            decode_splits = module.decode_launch(batch, 8, group_size, context, cpu)[3]
            assert (block_kv, warps, stages) == (32, 1, 2)
            assert 1 <= splits <= decode_splits
            assert splits == 1 or programs * splits <= resident * 132
            assert splits == decode_splits or programs * (splits + 1) > resident * 132
    # The measured case (issue 21's shape): 4 and 8 query tokens x 4 heads at 32 x 8192
    assert module.decode_multi_launch(32, 8, 4, 4, 8192, cpu)[3] == (6 if preset == "k3v4" else 4)
    assert module.decode_multi_launch(32, 8, 4, 8, 8192, cpu)[3] == (3 if preset == "k3v4" else 2)
    # decode itself: the heuristic for 16 query heads per KV head is the wide launch; up to 8 it is not (5-8 in the
    # planes configs: their own rule, _mma_full_columns_launch)
    assert module.decode_launch_defaults(32, 8, 16, 16384, cpu) == (32, 1, 2, 6 if preset == "k3v4" else 4)
    narrow = module.heuristic_launch(32, 8, 16384, 132)
    assert module.decode_launch_defaults(32, 8, 8, 16384, cpu) == module._mma_full_columns_launch(32, 8, 16384, 132)
    assert module.decode_launch_defaults(32, 8, 4, 16384, cpu) == narrow
    # where the Gluon kernel does not run, every launch is the narrow one
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: False)
    assert module.decode_multi_launch(32, 8, 4, 4, 8192, cpu) == module.decode_launch(32, 8, 4, 8192, cpu)
    assert module.decode_launch_defaults(32, 8, 16, 16384, cpu) == module.heuristic_launch(32, 8, 16384, 132)


def test_decode_multi_launches_the_wide_launch_unless_given_one(build_module, monkeypatch):
    """decode_multi runs decode_multi_launch's launch for what the call does not pass, capped at the workspace's
    splits: 2 sequences x 2 KV heads of 4 query tokens x 4 heads on 1 SM (12 resident programs) take 3 splits."""
    module = wide_launch_module(build_module, monkeypatch, "k3v4", sm_count=1)
    config = make_config("k3v4", cache_layout="planes")
    mma = KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", mma)
    monkeypatch.setattr(module, "tq_decode_stage2", KernelRecorder())
    monkeypatch.setattr(module, "tq_prepare_query", KernelRecorder())
    batch, cache, query, kwargs = multi_inputs(module, config, [40, 40], "cpu", 4)
    assert module.decode_multi_launch(2, 2, 4, 4, 8192, torch.device("cpu")) == (32, 1, 2, 3)

    def splits(**launch):
        module.decode_multi(query, cache, batch.block_table, batch.seq_lens, max_seq_len=8192, **launch, **kwargs)
        grid, _, constants = mma.launches[-1]
        return grid[2], constants["BLOCK_KV"], constants["STAGES"]
    assert splits() == (3, 32, 2)
    assert splits(num_splits=5, block_kv=64) == (5, 64, 2)
    assert splits(workspace=module.DecodeWorkspace(2, 8, 2, "cpu", max_q_len=4)) == (2, 32, 2)


@pytest.mark.parametrize("layout", ["planes", "slots"])
@pytest.mark.parametrize("dtype,own_rotation,rotated", [(torch.float16, True, True), (torch.bfloat16, True, True),
                                                        (torch.float32, True, False), (torch.float16, False, False)])
def test_decode_multi_rotates_a_16_bit_query_in_stage_1(tmp_path, monkeypatch, layout, dtype, own_rotation,
                                                         rotated):
    """The Gluon kernel of decode_multi rotates a 16-bit query under the config's own Hadamard rotation itself
    (ROTATE_QUERY, reading the caller's query: no tq_prepare_query, and launched in stream order as the call's
    first kernel, as decode's does); an fp32 query, or a rotation of the caller's, goes through tq_prepare_query
    first, and stage 1 waits for it (a dependent launch)."""
    config = make_config("k3v4", cache_layout=layout)
    module = tqgen.load(config, tmp_path)
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: True)  # a GPU that can, on any machine
    monkeypatch.setattr(module, "_dependent_launch", lambda device: True)
    mma, prepare = KernelRecorder(), KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", mma)
    monkeypatch.setattr(module, "tq_decode_stage2", KernelRecorder())
    monkeypatch.setattr(module, "tq_prepare_query", prepare)
    batch, cache, query, kwargs = multi_inputs(module, config, [40], "cpu", 3, dtype=dtype)  # batch 1: dependent
    if not own_rotation:
        kwargs["rotation"] = kwargs["rotation"].clone()  # the same values, not the config's tensor
    module.decode_multi(query, cache, batch.block_table, batch.seq_lens, block_kv=32, num_stages=2, **kwargs)
    (_, args, launch), = mma.launches
    assert launch["ROTATE_QUERY"] == rotated and len(prepare.launches) == (0 if rotated else 1)
    assert (args[0] is query) == rotated and launch["launch_pdl"] == (not rotated)


@pytest.mark.parametrize("q_len,capped_when_wide", [(2, False), (4, True)])
def test_decode_multi_drops_the_register_cap_where_its_grid_is_one_wave(tmp_path, monkeypatch, q_len,
                                                                         capped_when_wide):
    """decode_multi's Gluon kernel of more than 8 columns (4 query tokens x 4 heads) compiles under decode's
    register cap for as many heads only where its grid exceeds what the GPU holds at 255 registers
    (_one_wave_programs): in one wave the cap's occupancy buys nothing. At 8 columns (q_len 2) decode's options
    hold either way."""
    config = make_config("k3v4", cache_layout="planes")
    module = tqgen.load(config, tmp_path)
    monkeypatch.setattr(module, "_mma_stage1_ready", lambda device: True)  # a GPU that can, on any machine
    mma = KernelRecorder()
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", mma)
    monkeypatch.setattr(module, "tq_decode_stage2", KernelRecorder())
    batch, cache, query, kwargs = multi_inputs(module, config, [40, 70, 33], "cpu", q_len, dtype=torch.float16)
    programs = 3 * 2 * 2  # sequences x KV heads x splits, one block of query tokens each
    wide_cap = module._mma_stage1_options(32, 16).get("maxnreg")
    assert wide_cap is not None  # the premise: decode caps its 16-head kernel
    for one_wave_programs, one_wave in [(programs, True), (programs - 1, False)]:
        monkeypatch.setattr(module, "_one_wave_programs", lambda device, count=one_wave_programs: count)
        module.decode_multi(query, cache, batch.block_table, batch.seq_lens, block_kv=32, num_stages=2,
                            num_splits=2, **kwargs)
        grid, _, launch = mma.launches[-1]
        assert grid == (3, 2, 2)
        want = module._mma_stage1_options(32, q_len * 4).get("maxnreg")
        if capped_when_wide and one_wave:
            want = None
        assert launch.get("maxnreg") == want


_COMPILE_SCRIPT = """
import json, os, sys, dataclasses, tempfile
sys.path[:0] = [os.path.join(os.getcwd(), "tools"), os.getcwd()]
import ptx_probe, tqgen
from tqgen import config as config_mod
folder = tempfile.mkdtemp(prefix="tqgen-multi-mma-")
for stem, q_len, group_size, block_kv, stages, *rotate in json.loads(sys.argv[1]):
    config = dataclasses.replace(config_mod.load(f"configs/{stem}.yaml"), arch="sm90")
    compiled = ptx_probe.compile_multi_stage1_mma(tqgen.load(config, folder), block_kv, group_size, q_len,
                                                  stages=stages, rotate_query=bool(rotate))
    ptx = compiled.asm["ptx"]
    print(json.dumps(dict(mma=ptx.count("mma.sync.aligned.m16n8k16"), shared_bytes=compiled.metadata.shared,
                          vector_stores=ptx.count("st.global.v4"))))
"""
COMPILE_CASES = [  # (config stem, q_len, group_size, block_kv, stages[, the query rotated in stage 1])
    ("k3v4-d128-planes", 4, 4, 32, 2), ("k3v4-d128-planes", 2, 4, 64, 1), ("k3v3-d128-planes", 3, 4, 32, 2),
    ("k4v4-d128-planes", 8, 1, 64, 2), ("k8v4-d128-planes", 2, 8, 32, 1), ("k8v4-d128-planes", 4, 4, 64, 2),
    ("k3v4-d128-planes", 8, 4, 32, 2), ("k8v4-d128", 4, 4, 32, 2), ("k8v4-d128", 2, 8, 64, 1),  # slots: fp8 keys
    ("k3v4-d128", 4, 4, 32, 2), ("k4v4-d128", 2, 8, 64, 3), ("k3v3-d128", 3, 4, 32, 2),  # slots: MSE keys (ring)
    # the caller's fp16 query rotated in stage 1 (MSE keys under the Hadamard rotation, head_dim 128)
    ("k3v4-d128-planes", 4, 4, 32, 2, True), ("k4v4-d128-planes", 2, 4, 64, 1, True), ("k3v3-d128", 3, 4, 32, 2, True),
    ("k4v4-d128", 8, 1, 32, 2, True),
]


def test_the_gluon_multi_token_kernel_compiles_for_sm90():
    """Triton's compiler rejects what its interpreter accepts, and Gluon kernels never run on the CPU: each
    case compiles offline, with one m16n8k16 MMA per 16 x 8 x 16 block of the scores and of the output
    (the columns: q_len x group size rounded up to 8 or 16), a ring of `stages` tiles when stages > 1, and the
    partials stored 16 bytes at a time (4 head dims of a column a lane: one store a column)."""
    reports = offline_compile_reports("-c", _COMPILE_SCRIPT, json.dumps(COMPILE_CASES), timeout=600)
    assert len(reports) == len(COMPILE_CASES)
    for (stem, q_len, group_size, block_kv, stages, *rotate), report in zip(COMPILE_CASES, reports):
        columns = min(q_len, 16 // group_size) * group_size  # the tokens of one program (8 x 4: two programs)
        column_blocks = max(8, 1 << (columns - 1).bit_length()) // 8
        # MSE keys in slots: one product more, the squared centroids of the norm correction
        products = 3 if stem in ("k3v4-d128", "k4v4-d128", "k3v3-d128") else 2
        # The query rotated in the kernel: one MMA more per 16 head dims and 8 columns (_mma_hadamard_query).
        rotation_mmas = (128 // 16) * column_blocks if rotate else 0
        assert report["mma"] == products * (block_kv // 16) * (128 // 16) * column_blocks + rotation_mmas, (
            stem, q_len, group_size)
        # Without a ring, shared memory holds only the partials' reorder to head-dim order (512 bytes at a time)
        # and, rotating the query, the rotated query on its way to the MMA's operand layout.
        if not rotate:
            assert (report["shared_bytes"] > 512) == (stages > 1), (stem, q_len, group_size, report["shared_bytes"])
        assert report["vector_stores"] == 8 * column_blocks, (stem, q_len, group_size)


@pytest.mark.parametrize("stem", ["k3v4-d128-planes", "k8v4-d128-planes", "k3v4-d128"])
def test_the_lean_softmax_is_decode_multis_kernel_only(stem):
    """decode_multi's one-warp kernel takes the scores relative to the running max and sums the zeros as FFMA
    chains (_mma_row_groups_fma); decode's kernel keeps its own softmax, since the tuned launches are keyed on its
    code (the shipped modules compile in test_the_gluon_multi_token_kernel_compiles_for_sm90)."""
    planes = stem.endswith("planes")
    config = make_config(stem.split("-")[0], **(dict(cache_layout="planes", arch="sm90") if planes else {}))
    source = render.render(config)
    for name in ("tq_decode_multi_stage1_mma", "tq_decode_stage1_mma"):
        body = source[source.index(f"def {name}("):].split("@gluon.jit")[0]  # up to the next definition
        assert ("_mma_row_groups_fma(" in body) == (name == "tq_decode_multi_stage1_mma"), name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("q_len,group_size", [(2, 4), (4, 4), (3, 4), (2, 8), (8, 1), (5, 3), (8, 4), (3, 8)])
@pytest.mark.parametrize("block_kv,num_stages", [(32, 1), (32, 2), (64, 2), (32, 3)])
@pytest.mark.parametrize("preset", ["k3v4", "k4v4", "k3v3", "k8v4", "k3v4-slots", "k4v4-slots", "k3v3-slots"])
def test_the_gluon_multi_token_kernel_on_the_gpu(build_module, monkeypatch, preset, q_len, group_size, block_kv,
                                                 num_stages):
    """The Gluon kernel runs (a spy says so) and matches the reference: ragged sequences whose causal limits
    fall at 1, below a page boundary and past several splits, at every tile size and ring depth (1: no ring)."""
    preset, _, layout = preset.partition("-")
    config = make_config(preset, cache_layout=layout or "planes")
    module = build_module(config)
    spy = KernelRecorder(module.tq_decode_multi_stage1_mma)  # (8, 4), (3, 8): two programs per sequence
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", spy)
    for num_splits in (1, 5):
        check_decode_multi(module, config, "cuda", ragged_seq_lens(q_len) + [1000], q_len, group_size=group_size,
                           block_kv=block_kv, num_warps=1, num_stages=num_stages, num_splits=num_splits)
    assert len(spy.launches) == 2


def check_pages_outside_the_cache(module, config, pages, holes, q_len, **launch):
    """Two sequences of `pages` full pages, decode_multi with validate=False and the block id at column holes[b] of
    sequence b outside the cache (three ways): that page's tokens are masked, and block 0, which such a page reads
    and which holds NaN fields here, does not leak into the output (the reference runs on the remaining pages)."""
    seq_len = pages * config.block_size
    batch, cache, query, kwargs = multi_inputs(module, config, [seq_len, seq_len], "cuda", q_len)
    table = batch.block_table[:, :pages].clone()
    if (table == 0).any():  # block 0 becomes the masked pages' garbage: move its tokens to a spare block
        spare = sorted(set(range(batch.num_blocks)) - set(table.flatten().tolist()))[0]
        cache[spare] = cache[0]
        table[table == 0] = spare
    cache[0].fill_(0xFF)
    kept = [[column for column in range(pages) if column != hole] for hole in holes]
    remaining = torch.stack([table[b, kept[b]] for b in range(2)])
    for bad in (batch.num_blocks, -1, 2**31 - 1):
        holed = table.clone()
        holed[0, holes[0]], holed[1, holes[1]] = bad, bad
        out = module.decode_multi(query, cache, holed, batch.seq_lens, validate=False, num_splits=1, **kwargs,
                                  **launch)
        assert torch.isfinite(out).all()
        want = reference.decode_multi(Layout.from_config(config), query, cache, remaining,
                                      batch.seq_lens - config.block_size, kwargs.get("rotation"),
                                      kwargs.get("centroids"))
        assert relative_error(out, want) < DECODE_TOLERANCE[torch.float32], f"block id {bad}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_stages", [1, 2, 3])
@pytest.mark.parametrize("preset", ["k3v4", "k3v3", "k8v4", "k3v4-slots", "k8v4-slots"])
def test_the_gluon_multi_token_kernel_masks_pages_outside_the_cache(build_module, monkeypatch, preset, num_stages):
    """validate=False with a block id outside the cache in the middle of each sequence: that page's tokens are
    masked in a tile that every query token would otherwise see whole (where the kernel skips the token masks),
    and block 0, which such a page reads, holds NaN fields that must not leak into the output."""
    preset, _, layout = preset.partition("-")
    config = make_config(preset, cache_layout=layout or "planes")
    module = build_module(config)
    spy = KernelRecorder(module.tq_decode_multi_stage1_mma)
    monkeypatch.setattr(module, "tq_decode_multi_stage1_mma", spy)
    # positions 16-31 and 48-63, inside the first and second tiles
    check_pages_outside_the_cache(module, config, 6, (1, 3), 4, num_warps=1, block_kv=32, num_stages=num_stages)
    assert len(spy.launches) == 3


def check_graph_replays(module, config, q_len, num_splits, **launch):
    """decode_multi captured with a workspace and `out` in a CUDA graph, replayed for new queries, block tables and
    seq_lens (from q_len up): each replay equals an eager call and matches the reference."""
    kwargs = codebook_kwargs(module, config, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_blocks, max_blocks, batch, heads = 64, 8, 4, 8
    cache = module.make_cache(num_blocks, 2, "cuda")
    tokens = num_blocks * config.block_size
    module.store(torch.randn(tokens, 2, 128, device="cuda", generator=generator),
                 torch.randn(tokens, 2, 128, device="cuda", generator=generator),
                 cache, torch.arange(tokens, device="cuda"), **kwargs)
    query = torch.empty(batch, q_len, heads, 128, device="cuda")
    block_table = torch.empty(batch, max_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.empty(batch, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, q_len, heads, 128, device="cuda")
    workspace = module.DecodeWorkspace(batch, heads, 16, "cuda", max_q_len=q_len)

    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        query.copy_(torch.randn(batch, q_len, heads, 128, device="cuda", generator=g))
        block_table.copy_(torch.randperm(num_blocks, device="cuda", generator=g)[: batch * max_blocks]
                          .view(batch, max_blocks).int())
        seq_lens.copy_(torch.randint(q_len, max_blocks * config.block_size + 1, (batch,), device="cuda", generator=g))

    def run():
        module.decode_multi(query, cache, block_table, seq_lens, out=out, workspace=workspace, num_splits=num_splits,
                            **kwargs, **launch)

    for _ in replays_of_a_capture(run, fill, out, seeds=(2, 3, 4)):
        want = module.decode_multi(query, cache, block_table, seq_lens, num_splits=num_splits, **kwargs, **launch)
        assert torch.isfinite(out).all()
        assert relative_error(out, want) < 1e-6
        expected = reference.decode_multi(Layout.from_config(config), query, cache, block_table, seq_lens,
                                          kwargs.get("rotation"), kwargs.get("centroids"))
        assert relative_error(out, expected) < DECODE_TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k8v4", "planes"), ("k4v4", "slots")])
def test_decode_multi_captured_in_a_cuda_graph_replays_for_new_batch_contents(build_module, preset, layout):
    config = make_config(preset, cache_layout=layout)
    check_graph_replays(build_module(config), config, 4, 16)


# --- decode_ragged: vLLM's ragged batches (query_start_loc) ------------------------------------------------------
def ragged_reference(config, query, cache, block_table, seq_lens, q_lens, kwargs):
    """One float64 single-token decode per query token on its sequence cut to that token's limit."""
    layout, rows, start = Layout.from_config(config), [], 0
    for b, q_len in enumerate(q_lens):
        for j in range(q_len):
            limit = torch.tensor([int(seq_lens[b]) - q_len + 1 + j], dtype=torch.int32, device=seq_lens.device)
            rows.append(reference.decode(layout, query[start + j][None], cache, block_table[b:b + 1], limit,
                                         kwargs.get("rotation"), kwargs.get("centroids"))[0])
        start += q_len
    return torch.stack(rows)


@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k8v4", "slots")])
def test_decode_ragged_matches_one_decode_per_token(device, build_module, preset, layout):
    """q_lens 3, 1, 0 and 4 (max_query_len 4): limits at 1 (seq_len = q_len), below a page boundary and past
    splits; the sequence without query tokens takes no rows."""
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    q_lens, seq_lens = [3, 1, 0, 4], [3, 15, 9, 66]
    batch, cache = stored_cache(module, config, seq_lens, device, 2, 0)
    kwargs = codebook_kwargs(module, config, device)
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(sum(q_lens), 8, config.head_dim, generator=generator).to(device)
    starts = torch.tensor([0, 3, 4, 4, 8], dtype=torch.int32, device=device)
    out = module.decode_ragged(query, cache, batch.block_table, batch.seq_lens, starts, 4, num_splits=3, **kwargs)
    want = ragged_reference(config, query, cache, batch.block_table, batch.seq_lens, q_lens, kwargs)
    assert out.shape == query.shape and torch.isfinite(out).all()
    assert relative_error(out, want) < DECODE_TOLERANCE[torch.float32]


def test_decode_ragged_with_equal_q_lens_is_decode_multi_bit_for_bit(device, build_module):
    config = make_config("k3v4", cache_layout="planes")
    module = build_module(config)
    batch, cache, query, kwargs = multi_inputs(module, config, [2, 30], device, 2)
    multi = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, num_splits=2, **kwargs)
    starts = torch.tensor([0, 2, 4], dtype=torch.int64, device=device)
    out = torch.full((4, 8, 128), float("nan"), device=device)
    ragged = module.decode_ragged(query.reshape(4, 8, 128), cache, batch.block_table, batch.seq_lens, starts, 2,
                                  out=out, num_splits=2, **kwargs)
    assert ragged is out and torch.equal(out, multi.reshape(4, 8, 128))


@pytest.mark.parametrize("starts,max_query_len,named", [
    ([0, 2, 5], 2, "each must be 0 to max_query_len 2"), ([1, 2, 5], 4, "must run from 0 to num_tokens 5"),
    ([0, 6, 5], 8, "each must be 0 to max_query_len 8"), ([0, 2, 5], 9, "max_query_len must be an int from 1 to 8"),
    ([0, 1, 5], 4, "seq_lens\\[0\\] is shorter"), ([0], 4, "must have batch \\+ 1 entries for 5 query tokens"),
    ([0, 2, 5], True, "max_query_len must be an int"),
])
def test_decode_ragged_refuses_bad_query_start_loc_in_one_line(device, build_module, starts, max_query_len, named):
    config = make_config("k8v4", cache_layout="planes")
    module = build_module(config)
    batch, cache = stored_cache(module, config, [0, 20], device, 2, 0)
    query = torch.zeros(5, 8, 128, device=device)
    with pytest.raises(module.LaunchError, match=named):
        module.decode_ragged(query, cache, batch.block_table, batch.seq_lens,
                             torch.tensor(starts, dtype=torch.int32, device=device), max_query_len)


def test_decode_ragged_names_itself_in_the_checks_it_shares_with_decode_multi(device, build_module):
    """The launch, codebook and workspace checks decode_multi makes for decode_ragged's padded call are refused as
    decode_ragged's: the function called, not one the caller never called."""
    config = make_config("k3v4", cache_layout="planes")
    module = build_module(config)
    batch, cache = stored_cache(module, config, [5, 18], device, 2, 0)
    query = torch.zeros(4, 8, 128, device=device)
    starts = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)
    cases = [
        (dict(num_splits=0), "num_splits must be"), (dict(block_kv=16), "block_kv must be"),
        (dict(num_warps=3), "num_warps must be"), (dict(max_seq_len=-1), "max_seq_len must be"),
        (dict(rotation=torch.eye(64, device=device)), "rotation must be"),
        (dict(workspace=module.DecodeWorkspace(2, 16, 4, device, max_q_len=2)), "workspace holds"),
    ]
    for override, message in cases:
        with pytest.raises(module.LaunchError, match=f"^decode_ragged: {message}"):
            module.decode_ragged(query, cache, batch.block_table, batch.seq_lens, starts, 2, **override)


def test_decode_ragged_refuses_an_empty_query_start_loc_in_one_line(device, build_module):
    """No tokens and a query_start_loc without its leading 0 (batch -1): refused, not an IndexError."""
    config = make_config("k8v4", cache_layout="planes")
    module = build_module(config)
    cache = module.make_cache(2, 2, device)
    table = torch.zeros(0, 1, dtype=torch.int32, device=device)
    lens = torch.zeros(0, dtype=torch.int32, device=device)
    starts = torch.zeros(0, dtype=torch.int32, device=device)
    with pytest.raises(module.LaunchError, match="must have batch \\+ 1 entries for 0 query tokens"):
        module.decode_ragged(torch.zeros(0, 8, 128, device=device), cache, table, lens, starts, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k4v4", "slots")])
def test_decode_ragged_captured_in_a_cuda_graph_replays_for_new_q_lens(build_module, preset, layout):
    """The capture holds no host read: each replay takes new query_start_loc, seq_lens and query contents."""
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    kwargs = codebook_kwargs(module, config, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_blocks, max_blocks, batch, max_q, tokens, heads = 64, 8, 4, 4, 10, 8
    cache = module.make_cache(num_blocks, 2, "cuda")
    module.store(torch.randn(num_blocks * 16, 2, 128, device="cuda", generator=generator),
                 torch.randn(num_blocks * 16, 2, 128, device="cuda", generator=generator),
                 cache, torch.arange(num_blocks * 16, device="cuda"), **kwargs)
    query = torch.empty(tokens, heads, 128, device="cuda")
    starts = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
    block_table = torch.empty(batch, max_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.empty(batch, dtype=torch.int32, device="cuda")
    out = torch.empty(tokens, heads, 128, device="cuda")
    workspace = module.DecodeWorkspace(batch, heads, 16, "cuda", max_q_len=max_q)
    q_lens_of = {1: [4, 1, 2, 3], 2: [1, 4, 4, 1], 3: [0, 4, 3, 3], 4: [2, 2, 2, 4]}  # 10 tokens each

    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        query.copy_(torch.randn(tokens, heads, 128, device="cuda", generator=g))
        starts.copy_(torch.tensor([0] + q_lens_of[seed], device="cuda").cumsum(0))
        block_table.copy_(torch.randperm(num_blocks, device="cuda", generator=g)[: batch * max_blocks]
                          .view(batch, max_blocks).int())
        seq_lens.copy_(torch.randint(max_q, max_blocks * 16 + 1, (batch,), device="cuda", generator=g))

    def run():
        module.decode_ragged(query, cache, block_table, seq_lens, starts, max_q, out=out, workspace=workspace,
                             num_splits=16, **kwargs)

    for seed in replays_of_a_capture(run, fill, out, seeds=(2, 3, 4)):
        want = ragged_reference(config, query, cache, block_table, seq_lens, q_lens_of[seed], kwargs)
        assert torch.isfinite(out).all()
        assert relative_error(out, want) < DECODE_TOLERANCE[torch.float32]
