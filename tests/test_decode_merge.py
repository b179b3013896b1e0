"""Decode with stage 1 merging its own splits (decode's merge_in_stage1, templates/decode/merge.jinja): one kernel
instead of stage 1 and stage 2. The last program of each (sequence, KV head) to finish merges its splits in split
order and sets its counter back to 0.

On the CPU the tl.dot kernel runs under the interpreter; the Gluon kernel compiles offline for sm90 here and runs
in the GPU tests (`pytest -m gpu`): numerics, the same bits over repeated calls, and CUDA-graph replays.
"""

import json

import pytest
import torch

from conftest import (HAS_CUDA, KernelRecorder, check_decode, codebook_kwargs, make_config, offline_compile_reports,
                      replays_of_a_capture, stored_cache)
from tqgen import reference
from tqgen.layout import Layout
from tqgen.testing import relative_error

# A ragged batch: an empty sequence, one token, a partial page, several pages; at 24 splits the longest sequence
# fills 19 of 32 tokens, more than a merging program reads per step at head_dim 128 (_MERGE_CHUNK: 16).
SEQ_LENS = [0, 1, 13, 600]


@pytest.mark.parametrize("preset,layout,head_dim,num_splits", [("k3v4", "planes", 128, 24), ("k8v4", "planes", 128, 1),
                                                               ("k4v4", "slots", 64, 3), ("k3v3", "slots", 128, 24)])
def test_stage1_merging_matches_the_reference_and_stage2(device, build_module, preset, layout, head_dim, num_splits):
    config = make_config(preset, head_dim=head_dim, cache_layout=layout)
    module = build_module(config)
    merged = check_decode(module, config, device, SEQ_LENS, num_splits=num_splits, merge_in_stage1=True)
    staged = check_decode(module, config, device, SEQ_LENS, num_splits=num_splits, merge_in_stage1=False)
    assert relative_error(merged, staged) < 1e-5
    assert torch.count_nonzero(merged[0]) == 0  # seq_len 0: zeros, as stage 2 gives


@pytest.mark.parametrize("group_size", [1, 6])
def test_stage1_merging_at_other_group_sizes(device, build_module, group_size):
    config = make_config("k3v4", head_dim=64, cache_layout="planes")
    check_decode(build_module(config), config, device, [0, 1, 200], group_size=group_size, num_splits=7,
                 merge_in_stage1=True)


def _inputs(module, config, device, seq_lens, num_kv_heads=2, group_size=4):
    """A stored random batch with a query: (query, cache, block_table, seq_lens, codebook keyword arguments)."""
    kwargs = codebook_kwargs(module, config, device)
    batch, cache = stored_cache(module, config, seq_lens, device, num_kv_heads, codebook=kwargs)
    query = torch.randn(len(seq_lens), num_kv_heads * group_size, config.head_dim,
                        generator=torch.Generator().manual_seed(5)).to(device)
    return query, cache, batch.block_table, batch.seq_lens, kwargs


def test_one_kernel_per_call_and_the_counters_left_at_zero(build_module, monkeypatch):
    """With a workspace and the query rotated in stage 1, a merging call is one launch: no tq_prepare_query, no
    stage 2. Every counter is back at 0 after the call, so the next call (or a graph's replay) starts clean."""
    config = make_config("k3v4", cache_layout="planes")  # head_dim 128: stage 1 can rotate the query
    module = build_module(config)
    query, cache, block_table, seq_lens, kwargs = _inputs(module, config, "cpu", [0, 1, 130])
    workspace = module.DecodeWorkspace(3, query.shape[1], 8, "cpu")
    recorders = {name: KernelRecorder(getattr(module, name))
                 for name in ("tq_decode_stage1_merged", "tq_decode_stage1", "tq_decode_stage2", "tq_prepare_query")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(module, name, recorder)
    out = module.decode(query, cache, block_table, seq_lens, workspace=workspace, num_splits=8, rotate_query=True,
                        merge_in_stage1=True, **kwargs)
    assert [len(recorder.launches) for recorder in recorders.values()] == [1, 0, 0, 0]
    assert not workspace.split_counters.any()
    want = reference.decode(Layout.from_config(config), query, cache, block_table, seq_lens, kwargs.get("rotation"),
                            kwargs.get("centroids"))
    assert relative_error(out, want) < 1.5e-3


def test_the_shape_bucket_chooses_where_merge_in_stage1_is_not_passed(build_module, monkeypatch):
    """merge_in_stage1=None follows merged_in_stage1 (the tuned bucket) where a workspace's split_counters serve
    the call, as the tuner timed it; without a workspace, or with an engine's own without counters, stage 2 merges.
    Passing True with counters that cannot serve is refused with a clear error, and so (validate=True) is a call
    whose counters are not zeros: it would merge too early, in this call and every later one."""
    config = make_config("k8v4", head_dim=64)
    module = build_module(config)
    query, cache, block_table, seq_lens, kwargs = _inputs(module, config, "cpu", [40, 7])
    stage2 = KernelRecorder(module.tq_decode_stage2)
    monkeypatch.setattr(module, "tq_decode_stage2", stage2)
    asked = []  # the shape each choice was asked for: the bucket counts the call's own KV heads
    monkeypatch.setattr(module, "merged_in_stage1",
                        lambda batch, group_size, context, device, num_kv_heads=None: asked.append(
                            (batch, group_size, num_kv_heads)) or True)
    workspace = module.DecodeWorkspace(2, query.shape[1], 4, "cpu")
    module.decode(query, cache, block_table, seq_lens, workspace=workspace, num_splits=4, **kwargs)
    assert len(stage2.launches) == 0
    assert asked == [(2, 4, 2)]  # 2 sequences, 4 query heads over each of _inputs' 2 KV heads
    module.decode(query, cache, block_table, seq_lens, num_splits=4, **kwargs)  # no workspace
    assert len(stage2.launches) == 1

    del workspace.split_counters  # a workspace built by an engine from buffers of its own
    module.decode(query, cache, block_table, seq_lens, workspace=workspace, num_splits=4, **kwargs)
    assert len(stage2.launches) == 2
    for counters in (None, torch.zeros(3, dtype=torch.int32), torch.zeros(16, dtype=torch.int64)):
        workspace.split_counters = counters  # none, fewer than batch x query heads, not int32
        module.decode(query, cache, block_table, seq_lens, workspace=workspace, num_splits=4, **kwargs)
        with pytest.raises(module.LaunchError, match="merge_in_stage1=True needs workspace.split_counters: int32 "
                                                     "zeros on cpu, at least 16"):
            module.decode(query, cache, block_table, seq_lens, workspace=workspace, merge_in_stage1=True, **kwargs)
    assert len(stage2.launches) == 5
    workspace.split_counters = torch.zeros(16, dtype=torch.int32)
    workspace.split_counters[9] = 1
    with pytest.raises(module.LaunchError, match="split_counters must be zeros before a call"):
        module.decode(query, cache, block_table, seq_lens, workspace=workspace, merge_in_stage1=True, **kwargs)


def test_the_program_that_completes_the_count_merges(build_module):
    """Which program merges is decided by the counter, not by the program's split: on the interpreter the programs
    run in grid order, so the last split always completes a zeroed count. With one (sequence, KV head)'s counter
    started at num_splits - 2 (validate=False lets the call through), its second split completes the count, merges
    what the first two splits stored (the rest weigh 0: their lse were set to -inf beforehand) and resets the
    counter, which the remaining num_splits - 2 programs then leave at num_splits - 2; the other heads are right."""
    config = make_config("k3v4", head_dim=64, cache_layout="planes")
    module = build_module(config)
    num_splits, tokens_per_split = 5, 32
    seq_lens = [num_splits * tokens_per_split] * 2
    query, cache, block_table, seq_lens, kwargs = _inputs(module, config, "cpu", seq_lens)
    workspace = module.DecodeWorkspace(2, query.shape[1], num_splits, "cpu")
    launch = dict(num_splits=num_splits, block_kv=32, num_warps=1, num_stages=1, merge_in_stage1=True)
    want = module.decode(query, cache, block_table, seq_lens, workspace=workspace, **launch, **kwargs)
    workspace.partial_lse.fill_(float("-inf"))
    seeded = 1 * query.shape[1] + 1  # sequence 1, KV head 1 (the counter index is seq * num_q_heads + kv_head)
    workspace.split_counters[seeded] = num_splits - 2
    out = module.decode(query, cache, block_table, seq_lens, workspace=workspace, validate=False, **launch, **kwargs)
    expected_counters = torch.zeros_like(workspace.split_counters)
    expected_counters[seeded] = num_splits - 2
    assert torch.equal(workspace.split_counters, expected_counters)
    heads = slice(4, 8)  # the query heads of KV head 1
    assert torch.equal(out[0], want[0]) and torch.equal(out[1, :4], want[1, :4])
    assert not torch.allclose(out[1, heads], want[1, heads], atol=1e-3)
    # What the early merge saw: the first two splits alone (a 2-split decode of their 64 tokens).
    first_two = module.decode(query[1:], cache, block_table[1:], torch.full_like(seq_lens[1:], 2 * tokens_per_split),
                              num_splits=2, block_kv=32, num_warps=1, num_stages=1, merge_in_stage1=False, **kwargs)
    assert relative_error(out[1, heads], first_two[0, heads]) < 1e-5


@pytest.mark.parametrize("stem", ["k3v4-d128-planes", "k8v4-d128-planes", "k3v3-d128", "k8v4-d128", "k4v4-d64"])
def test_the_merging_kernels_take_stage1s_arguments_then_the_outputs(stem):
    """_run_decode passes a merging kernel stage 1's positional arguments followed by out, the counters and out's
    strides, and the rest by keyword: in every rendering, each merging kernel's runtime parameters are its stage-1
    kernel's followed by those four, before any constexpr, and its constexprs are stage 1's and BLOCK_SPLITS."""
    import ast

    from tqgen import config as config_mod, render

    config = config_mod.resolve_arch(config_mod.load(f"configs/{stem}.yaml"), (9, 0))
    functions = {node.name: node for node in ast.walk(ast.parse(render.render(config)))
                 if isinstance(node, ast.FunctionDef)}

    def parameters(name):
        arguments = functions[name].args.args
        constexpr = ["constexpr" in ast.unparse(argument.annotation or ast.Constant("")) for argument in arguments]
        runtime = [argument.arg for argument, is_constexpr in zip(arguments, constexpr) if not is_constexpr]
        assert constexpr == sorted(constexpr), f"{name}: a runtime parameter after a constexpr"
        return runtime, {argument.arg for argument, is_constexpr in zip(arguments, constexpr) if is_constexpr}

    pairs = [("tq_decode_stage1", "tq_decode_stage1_merged")]
    if "tq_decode_stage1_mma" in functions:
        pairs.append(("tq_decode_stage1_mma", "tq_decode_stage1_mma_merged"))
    for stage1, merging in pairs:
        (runtime, constants), (merging_runtime, merging_constants) = parameters(stage1), parameters(merging)
        assert merging_runtime == runtime + ["out_ptr", "split_counters_ptr", "stride_out_batch", "stride_out_head"]
        assert merging_constants == constants | {"BLOCK_SPLITS"}


# Offline compiles for sm90: the Gluon kernel for each layout and key format (a ring of 2 where one stage is not
# taken), and the tl.dot kernel.
_COMPILE_SCRIPT = """
import json, os, sys, tempfile
sys.path[:0] = [os.path.join(os.getcwd(), "tools"), os.getcwd()]
import kernel_fingerprint, tqgen
from tqgen import config as config_mod
folder = tempfile.mkdtemp(prefix="tqgen-merge-")
for stem, label in json.loads(sys.argv[1]):
    config = config_mod.resolve_arch(kernel_fingerprint.dataclass_arch(config_mod.load(f"configs/{stem}.yaml"), "sm90"))
    module = tqgen.load(config, folder)
    planes = module.CONFIG.get("cache_layout") == "planes"
    unaligned = ("stride_cache_pos",) if planes else ("stride_cache_head", "stride_cache_pos")
    spec = {s[0]: s for s in kernel_fingerprint.specializations(module)}[label]
    _, kernel, constants, warps, stages, source_type, options = spec
    ptx = kernel_fingerprint.compile_kernel(kernel, constants, warps, stages, 90, source_type, unaligned,
                                            **options).asm["ptx"]
    lines = [line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith((".loc", "//"))]
    arrive = [i for i, line in enumerate(lines) if "atom.global.gpu.acq_rel.add" in line]
    barriers = [any("bar.sync" in line for line in lines[max(0, i - 8):i]) for i in arrive]
    print(json.dumps(dict(arrivals=len(arrive), barrier_before=bool(arrive) and all(barriers),
                          resets=sum("atom.global.gpu.relaxed.exch" in line for line in lines),
                          l2_loads=sum("ld.global.cg" in line for line in lines),
                          vector_l2_loads=sum("ld.global.cg.v4" in line for line in lines),
                          dependents=sum("griddepcontrol.launch_dependents" in line for line in lines))))
"""
COMPILE_CASES = [("k3v4-d128-planes", "stage1_mma_merged_kv32_g4_st1"),
                 ("k8v4-d128-planes", "stage1_mma_merged_kv32_g8_st1"),
                 ("k3v3-d128", "stage1_mma_merged_kv32_g4_st2"),
                 ("k8v4-d128", "stage1_mma_merged_kv32_g16_st2"),
                 ("k4v4-d128-planes", "stage1_merged_kv64_w2_st1")]
# Where a program arrives: at the end of the Gluon kernel; in the tl.dot kernel also where an empty split exits.
ARRIVAL_SITES = {"stage1_mma_merged": 1, "stage1_merged": 2}


def test_the_merging_kernels_compile_for_sm90():
    """Each merging kernel arrives (one lane's acq_rel atomic, after a barrier of the program's threads) and resets
    its counter at each of its arrival sites, reads the partials through L2 16 bytes a lane, and, compiled for a
    dependent launch (DEPENDENT_LAUNCH, which makes the single-token kernel signal), never lets a dependent kernel
    start early: nothing after it waits for it in this call."""
    reports = offline_compile_reports("-c", _COMPILE_SCRIPT, json.dumps(COMPILE_CASES))
    assert len(reports) == len(COMPILE_CASES)
    for case, report in zip(COMPILE_CASES, reports):
        sites = ARRIVAL_SITES[case[1].split("_kv")[0]]
        assert report["arrivals"] == report["resets"] == sites and report["barrier_before"], (case, report)
        assert report["vector_l2_loads"] > 0 and report["dependents"] == 0, (case, report)


# --- on the GPU --------------------------------------------------------------------------------------------------
GPU_PRESETS = [("k3v4", "planes"), ("k4v4", "planes"), ("k3v3", "planes"), ("k8v4", "planes"),
               ("k3v4", "slots"), ("k4v4", "slots"), ("k3v3", "slots"), ("k8v4", "slots")]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset,layout", GPU_PRESETS)
@pytest.mark.parametrize("group_size", [1, 4, 6, 16])
def test_the_gluon_merging_kernel_on_the_gpu(build_module, monkeypatch, preset, layout, group_size):
    """The Gluon merging kernel runs (a spy says so), matches the reference at 1 to 40 splits and gives the same
    bits as stage 2's merge would within float error."""
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    spy = KernelRecorder(module.tq_decode_stage1_mma_merged)
    monkeypatch.setattr(module, "tq_decode_stage1_mma_merged", spy)
    stages = (1, 2)  # words loaded where used, and through the ring
    for num_splits in (1, 5, 40):
        for num_stages in stages:
            check_decode(module, config, "cuda", SEQ_LENS + [5000], group_size=group_size, dtype=torch.float16,
                         num_splits=num_splits, block_kv=32, num_warps=1, num_stages=num_stages, merge_in_stage1=True)
    assert len(spy.launches) == 3 * len(stages)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset,layout", GPU_PRESETS)
def test_merging_calls_are_deterministic(build_module, preset, layout):
    """20 calls give the same bits, whatever order the programs finish in: the last one merges in split order."""
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    query, cache, block_table, seq_lens, kwargs = _inputs(module, config, "cuda", [4096, 1, 0, 2500], num_kv_heads=8)
    query = query.half()
    workspace = module.DecodeWorkspace(4, query.shape[1], 64, "cuda")
    outputs = [module.decode(query, cache, block_table, seq_lens, workspace=workspace, num_splits=64,
                             merge_in_stage1=True, **kwargs) for _ in range(20)]
    assert all(torch.equal(outputs[0], output) for output in outputs[1:])
    assert not workspace.split_counters.any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset,layout", [("k3v4", "planes"), ("k8v4", "planes"), ("k4v4", "slots"),
                                           ("k8v4", "slots")])
def test_a_merging_call_captured_in_a_cuda_graph_replays_for_new_batch_contents(build_module, preset, layout):
    """Captured once with the workspace, replayed for new queries, block tables and seq_lens (0 and 1 among them):
    each replay equals an eager call and the reference (the counters were left at 0 by every replay)."""
    config = make_config(preset, cache_layout=layout)
    module = build_module(config)
    kwargs = codebook_kwargs(module, config, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_blocks, max_blocks, batch, heads = 96, 16, 4, 8
    cache = module.make_cache(num_blocks, 2, "cuda")
    tokens = num_blocks * config.block_size
    module.store(torch.randn(tokens, 2, 128, device="cuda", generator=generator),
                 torch.randn(tokens, 2, 128, device="cuda", generator=generator),
                 cache, torch.arange(tokens, device="cuda"), **kwargs)
    query = torch.empty(batch, heads, 128, device="cuda", dtype=torch.float16)
    block_table = torch.empty(batch, max_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.empty(batch, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, heads, 128, device="cuda", dtype=torch.float16)
    workspace = module.DecodeWorkspace(batch, heads, 16, "cuda")

    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        query.copy_(torch.randn(batch, heads, 128, device="cuda", generator=g))
        block_table.copy_(torch.randperm(num_blocks, device="cuda", generator=g)[: batch * max_blocks]
                          .view(batch, max_blocks).int())
        lengths = torch.randint(2, max_blocks * config.block_size + 1, (batch,), device="cuda", generator=g)
        lengths[seed % batch] = seed % 2  # a sequence of 0 tokens, or of 1
        seq_lens.copy_(lengths)

    def run():
        module.decode(query, cache, block_table, seq_lens, out=out, workspace=workspace, num_splits=16,
                      merge_in_stage1=True, **kwargs)

    for _ in replays_of_a_capture(run, fill, out, seeds=(2, 3, 4, 5)):
        assert not workspace.split_counters.any()
        want = module.decode(query, cache, block_table, seq_lens, num_splits=16, merge_in_stage1=True, **kwargs)
        assert torch.equal(out, want)
        expected = reference.decode(Layout.from_config(config), query, cache, block_table, seq_lens,
                                    kwargs.get("rotation"), kwargs.get("centroids"))
        assert relative_error(out, expected) < 2e-3
