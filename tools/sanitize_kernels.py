"""Launch every kernel of every shipped config once, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_kernels.py [CONFIG...]

Ragged batches end mid-page, the block table has unused columns, and the
cache has unused blocks, so any read past a sequence's tokens or write outside
the given slots shows up as an error; racecheck sees the Gluon stage 1's shared-memory ring (planes, and
slots with fp8 keys). Besides store, decode and dequantize as an engine calls them: decode with stage 1 merging its
splits (merge_in_stage1: its atomic counters, both stage-1 kernels, ring or not), the store of Hadamard MSE keys
by both kernels where it has two (tq_store_gluon, then tq_store), the tensor-core key store
(its token threshold lowered on the module so this small ragged batch takes it), decode_multi at 3 tokens a
sequence and at 8 tokens x 4 heads (the warpgroup kernel where a module has it; validate=False: the sequences of 0
and 1 tokens give zeros for the tokens that see nothing),
decode_ragged, and dequantize of rotated keys.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tqgen  # noqa: E402
from tqgen import emit  # noqa: E402
from tqgen.testing import as_position_major, codebook_kwargs, paged_batch  # noqa: E402

paths = sys.argv[1:] or sorted(str(p) for p in Path(__file__).resolve().parent.parent.glob("configs/*.yaml"))
for path in paths:
    config = emit.as_config(path)
    module = tqgen.load(config)
    kwargs = codebook_kwargs(module, "cuda")
    page = config.block_size
    batch = paged_batch(config, [1, page - 1, page + 3, 5 * page + 7, 0], 4, device="cuda",
                        generator=torch.Generator().manual_seed(0))
    cache = module.make_cache(batch.num_blocks, 4, "cuda")
    module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
    if hasattr(module, "tq_store_gluon"):  # the same slots again by tq_store (the store above ran tq_store_gluon)
        module.STORE_GLUON = False
        module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
    if hasattr(module, "tq_store_keys_mma"):  # the same slots again, keys on the tensor cores
        module.STORE_MMA_MIN_TOKENS = 1
        module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
    if hasattr(module, "tq_store_gluon"):
        module.STORE_GLUON = True
    query = torch.randn(5, 12, config.head_dim, device="cuda", dtype=torch.float16)  # group size 3
    for num_splits in (1, 4):
        module.decode(query, cache, batch.block_table, batch.seq_lens, num_splits=num_splits, **kwargs)
    # The Gluon stage 1 without a ring and with its cp.async ring (planes, and slots): every depth the tuner may
    # pick, both tile sizes, one warp; in slots also on a position-major copy of the cache (make_cache's is
    # head-major: the position stride differs).
    gluon = hasattr(module, "tq_decode_stage1_mma")
    gluon_launches = [(block_kv, stages) for block_kv in (32, 64) for stages in (1, 2, 3)] if gluon else []
    caches = [cache]
    if gluon_launches and config.cache_layout == "slots":
        caches.append(as_position_major(cache))
    for gluon_cache in caches:
        for block_kv, stages in gluon_launches:
            module.decode(query, gluon_cache, batch.block_table, batch.seq_lens, num_splits=3, block_kv=block_kv,
                          num_warps=1, num_stages=stages, **kwargs)
    # Stage 1 merging its own splits, on the tl.dot kernel (2 warps) and, where it exists, the Gluon one (one warp,
    # without a ring and with one), with a workspace whose counters every call must leave at zero.
    merge_workspace = module.DecodeWorkspace(5, 12, 8, "cuda")
    merge_launches = [dict(block_kv=64, num_warps=2, num_stages=1)]
    if gluon:
        merge_launches += [dict(block_kv=32, num_warps=1, num_stages=stages) for stages in (1, 2)]
    for launch in merge_launches:
        for num_splits in (1, 5):
            module.decode(query, cache, batch.block_table, batch.seq_lens, num_splits=num_splits,
                          workspace=merge_workspace, merge_in_stage1=True, **launch, **kwargs)
    assert not merge_workspace.split_counters.any(), "a merging decode left a split counter set"
    multi_query = torch.randn(5, 3, 12, config.head_dim, device="cuda", dtype=torch.float16)
    module.decode_multi(multi_query, cache, batch.block_table, batch.seq_lens, validate=False, **kwargs)
    # 8 tokens x 4 heads: 32 columns at the warpgroup kernel's launch, which runs it where the module has one
    # (tq_decode_multi_stage1_wg: 64- and 128-token tiles, rotating the fp16 query itself, and an fp32 query after
    # tq_prepare_query), else the tl.dot kernel on 4 warps
    wide_query = torch.randn(5, 8, 16, config.head_dim, device="cuda", dtype=torch.float16)
    wide_launches = [(64, 1, torch.float16), (64, 4, torch.float16)]
    if hasattr(module, "tq_decode_multi_stage1_wg"):
        wide_launches += [(128, 1, torch.float16), (128, 4, torch.float32)]
    for block_kv, num_splits, dtype in wide_launches:
        module.decode_multi(wide_query.to(dtype), cache, batch.block_table, batch.seq_lens, validate=False,
                            num_splits=num_splits, block_kv=block_kv, num_warps=4, num_stages=3, **kwargs)
    # Ragged: sequences of 1, 3, 2, 3 and 0 query tokens (the last sequence has none, like its cache).
    starts = torch.tensor([0, 1, 4, 6, 9, 9], dtype=torch.int32, device="cuda")
    module.decode_ragged(multi_query.flatten(0, 1)[:9], cache, batch.block_table, batch.seq_lens, starts, 3,
                         validate=False, **kwargs)
    module.dequantize(cache, batch.block_table, batch.seq_lens, **kwargs)
    if config.key_format != "fp8":
        module.dequantize(cache, batch.block_table, batch.seq_lens, rotated_keys=True, **kwargs)
    torch.cuda.synchronize()
    print(f"{path}: store{' (both key kernels)' if hasattr(module, 'tq_store_keys_mma') else ''}, decode (1 and 4 "
          f"splits{', the Gluon stage 1 with and without its ring' if gluon_launches else ''}; stage 1 merging), "
          "decode_multi, decode_ragged, dequantize ran", flush=True)
