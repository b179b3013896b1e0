"""`tqgen bench`: time the emitted decode against its ceilings, in one run.

For each (config, batch, context) it reports, all measured in the same process:
- the whole decode call (query rotation, stage 1, stage 2): plain launches and
  a CUDA-graph replay, median microseconds;
- GB/s of the bytes the call must move (the compressed cache read, batch x kv_heads x context x bytes of the slot's
  fields, plus the query read and the output written) and that as a percentage of a device-to-device copy ceiling
  measured in this run;
- the speedup over torch SDPA decode on a dense fp16 cache of the same shape (both CUDA-graph replays);
- the speedup over the same generated kernel launched with vLLM's kernel's choice
  (32 splits, 1 warp, 1 stage; BLOCK_KV 32, since tl.dot needs tiles of >= 16
  tokens and triton 3.6 miscompiles 16 -- vLLM's kernel uses 4);
- the launch the call used (tuned for this bucket, or the heuristic) and, side
  by side, the heuristic launch's time (`decode_launch_defaults`).

Store and dequantize are timed the same way (graph replay), counting bytes
read plus bytes written against the same ceiling.

`bench_vllm_decode` times the drop-in for vLLM (tqgen.vllm) as vLLM's backend calls it: on
vLLM's head-major cache, with its workspace buffers and split cap, against the same ceiling and
SDPA, and against the module's own decode of the same bytes (the allocation make_cache makes too).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

from .buckets import bucket_batch, bucket_key
from .config import Config
from .files import write_atomic
from .testing import codebook_kwargs, random_problem
from .tuned_files import LAUNCH_FIELDS, MERGE_FIELD, ROTATE_FIELD, candidate_id

SEED_LAUNCH = dict(num_splits=32, block_kv=32, num_warps=1, num_stages=1)
VLLM_MAX_KV_SPLITS = 32  # the split cap vLLM's backend passes by default (tq_max_kv_splits_for_cuda_graph)


@dataclasses.dataclass
class BenchRow:
    config: str
    batch: int
    context: int
    plain_us: float
    graph_us: float
    gbps: float
    ceiling_pct: float
    sdpa_us: float
    speedup_vs_sdpa: float
    seed_launch_us: float
    speedup_vs_seed_launch: float
    launch: str  # "tuned kv32 w1 st1 sp8" or "heuristic ..."
    heuristic_us: float  # the heuristic launch (decode_launch_defaults), graph replay
    speedup_vs_heuristic: float


@dataclasses.dataclass
class OpRow:
    """A store or dequantize measurement: bytes read + written over the graph-replay time."""
    config: str
    op: str
    shape: str
    graph_us: float
    nbytes: int
    gbps: float
    ceiling_pct: float


@dataclasses.dataclass
class VllmDecodeRow:
    """The drop-in decode (tqgen.vllm) on vLLM's head-major cache, CUDA-graph replay."""
    config: str
    layout: str  # tqgen.vllm's cache layout: the config's
    batch: int
    context: int
    graph_us: float
    gbps: float
    ceiling_pct: float
    sdpa_us: float
    speedup_vs_sdpa: float
    module_us: float  # the module's own decode of the same bytes, same splits
    module_cost: float  # graph_us / module_us: what the drop-in costs


def copy_ceiling_gbps(device="cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    import triton

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    return _gbps(2 * nbytes, ms)


def bench_decode(module: ModuleType, config: Config, batch: int, context: int, *, ceiling_gbps: float,
                 num_q_heads: int = 32, num_kv_heads: int = 8, device="cuda") -> BenchRow:
    import triton

    problem = random_problem(module, config, batch, context, num_q_heads, num_kv_heads, device)
    cache, block_table, seq_lens, query = (problem[k] for k in ("cache", "block_table", "seq_lens", "query"))
    out = decode_output(config, query)
    group_size = num_q_heads // num_kv_heads
    used = dict(zip(LAUNCH_FIELDS, module.decode_launch(batch, num_kv_heads, group_size, context, cache.device)))
    heuristic = dict(zip(LAUNCH_FIELDS, module.decode_launch_defaults(batch, num_kv_heads, group_size, context,
                                                                     cache.device)))
    # Room for every launch timed here: the one decode picks, the heuristic's and the seed's.
    max_splits = max(used["num_splits"], heuristic["num_splits"], SEED_LAUNCH["num_splits"])
    workspace = module.DecodeWorkspace(batch, num_q_heads, max_splits, device)

    def call(**launch):
        return module.decode(query, cache, block_table, seq_lens, out=out, workspace=workspace, validate=False,
                             max_seq_len=context, **launch)

    def graph_ms(**launch) -> float:
        call(**launch)  # compile outside the timing
        return triton.testing.do_bench_cudagraph(lambda: call(**launch), return_mode="median")

    call()  # compile and build the per-device rotation/centroids outside any timing
    plain_ms = triton.testing.do_bench(call, return_mode="median")
    default_ms = graph_ms()
    # The seed's launch and the heuristic's merge the splits in stage 2; decode's, as its shape bucket chose.
    stage2_merge = {MERGE_FIELD: False} if hasattr(module, "merged_in_stage1") else {}
    seed_ms = graph_ms(**SEED_LAUNCH, **stage2_merge)
    if hasattr(module, "query_rotated_in_stage1"):  # where stage 1 rotates the query: the tuned choice, or the rule
        used[ROTATE_FIELD] = module.query_rotated_in_stage1(batch, group_size, context, cache.device,
                                                            num_kv_heads=num_kv_heads)
        heuristic[ROTATE_FIELD] = module.query_rotated_in_stage1(batch, group_size, context, cache.device, tuned=False)
    if stage2_merge:
        used[MERGE_FIELD] = module.merged_in_stage1(batch, group_size, context, cache.device, num_kv_heads)
        heuristic.update(stage2_merge)
    baked = module.TUNED_LAUNCHES.get(torch.cuda.get_device_name(cache.device), {})
    # The bucket decode_launch reads: the batch counted in (sequence, KV head) pairs over the timed KV heads.
    key = bucket_key(group_size, bucket_batch(batch, num_kv_heads, baked.get("kv_heads")), context)
    tuned = baked.get("buckets", {}).get(key)
    source = "tuned" if tuned is not None and tuple(tuned)[:4] == tuple(used[f] for f in LAUNCH_FIELDS) else "heuristic"
    heuristic_ms = graph_ms(**heuristic)

    del cache
    sdpa_ms = _sdpa_ms(query, num_kv_heads, context)

    gbps = _gbps(decode_bytes(module, query, out, num_kv_heads, context), default_ms)
    return BenchRow(
        config=config.name, batch=batch, context=context, plain_us=plain_ms * 1e3, graph_us=default_ms * 1e3,
        gbps=gbps, ceiling_pct=100 * gbps / ceiling_gbps, sdpa_us=sdpa_ms * 1e3,
        speedup_vs_sdpa=sdpa_ms / default_ms, seed_launch_us=seed_ms * 1e3,
        speedup_vs_seed_launch=seed_ms / default_ms,
        launch=f"{source} {candidate_id(used)}", heuristic_us=heuristic_ms * 1e3,
        speedup_vs_heuristic=heuristic_ms / default_ms,
    )


def decode_output(config: Config, query: torch.Tensor) -> torch.Tensor:
    """An out buffer for decode: in the config's output dtype ("auto": the query's)."""
    dtype = query.dtype if config.output_dtype == "auto" else getattr(torch, config.output_dtype)
    return torch.empty_like(query, dtype=dtype)


def sdpa_call(query: torch.Tensor, num_kv_heads: int, context: int):
    """A call of torch SDPA decode of the query over a dense fp16 cache of `context` tokens (the baseline)."""
    batch, _, head_dim = query.shape
    keys = torch.randn(batch, num_kv_heads, context, head_dim, dtype=torch.float16, device=query.device)
    values = torch.randn_like(keys)
    q4 = query.unsqueeze(2)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q4, keys, values, enable_gqa=True)


def _sdpa_ms(query: torch.Tensor, num_kv_heads: int, context: int) -> float:
    """sdpa_call's time, graph replay."""
    import triton

    sdpa = sdpa_call(query, num_kv_heads, context)
    sdpa()
    return triton.testing.do_bench_cudagraph(sdpa, return_mode="median")


def bench_vllm_decode(module: ModuleType, config: Config, batch: int, context: int, *, ceiling_gbps: float,
                      num_q_heads: int = 32, num_kv_heads: int = 8, max_num_kv_splits: int = VLLM_MAX_KV_SPLITS,
                      device="cuda") -> VllmDecodeRow:
    """tqgen.vllm's decode as vLLM's backend calls it, in the config's cache layout: the cache allocated
    head-major (num_blocks, num_kv_heads, block_size, slot) and passed transposed, the workspace's mid_o_buf,
    output_buf and lse_buf, the config's rotation and centroids; beside it the module's own decode of the
    same bytes (slots: the head-major cache make_cache allocates too; planes: the allocation's pages themselves)."""
    import triton

    from . import vllm

    problem = random_problem(module, config, batch, context, num_q_heads, num_kv_heads, device)
    cache, block_table, seq_lens, query = (problem[k] for k in ("cache", "block_table", "seq_lens", "query"))
    codebook = codebook_kwargs(module, device)
    call = vllm_decode_call(module, config, problem, max_num_kv_splits)
    with vllm.cache_layout_for(config.cache_layout):
        call()
        graph_ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    group_size = num_q_heads // num_kv_heads
    num_splits = min(module.decode_launch(batch, num_kv_heads, group_size, block_table.shape[1] * config.block_size,
                                          cache.device)[3], max_num_kv_splits)
    workspace = module.DecodeWorkspace(batch, num_q_heads, num_splits, device)
    out = decode_output(config, query)

    def module_decode():
        module.decode(query, cache, block_table, seq_lens, out=out, workspace=workspace, num_splits=num_splits,
                      validate=False, **codebook)

    module_decode()
    module_ms = triton.testing.do_bench_cudagraph(module_decode, return_mode="median")
    del problem, cache, call
    sdpa_ms = _sdpa_ms(query, num_kv_heads, context)
    gbps = _gbps(decode_bytes(module, query, out, num_kv_heads, context), graph_ms)  # out: as output_buf
    return VllmDecodeRow(config=config.name, layout=config.cache_layout, batch=batch, context=context,
                         graph_us=graph_ms * 1e3, gbps=gbps, ceiling_pct=100 * gbps / ceiling_gbps,
                         sdpa_us=sdpa_ms * 1e3, speedup_vs_sdpa=sdpa_ms / graph_ms, module_us=module_ms * 1e3,
                         module_cost=graph_ms / module_ms)


def vllm_decode_call(module: ModuleType, config: Config, problem: dict,
                     max_num_kv_splits: int = VLLM_MAX_KV_SPLITS):
    """A call of tqgen.vllm's decode as vLLM's backend makes it, over a random_problem of `module`: the cache
    allocated head-major (num_blocks, num_kv_heads, block_size, slot) and passed transposed, the workspace's
    mid_o_buf, output_buf and lse_buf, copies of the config's rotation and centroids. Run it inside
    vllm.cache_layout_for(config.cache_layout)."""
    from . import vllm

    cache, block_table, seq_lens, query = (problem[k] for k in ("cache", "block_table", "seq_lens", "query"))
    batch, num_q_heads, _ = query.shape
    device = cache.device
    arguments = vllm.format_arguments(config.key_bits, config.value_bits, config.norm_correction, config.head_dim)
    head_major = vllm_cache_view(module, config, cache)
    # Copies of the config's rotation and centroids: vLLM's backend holds its own tensors, not the module's.
    codebook = {name: tensor.clone() for name, tensor in codebook_kwargs(module, device).items()}
    rotation = codebook.get("rotation")
    pi = rotation.t().contiguous() if rotation is not None else None  # vLLM's PiT is tqgen's rotation
    buffers = dict(mid_o_buf=torch.empty(batch, num_q_heads, max_num_kv_splits, config.head_dim + 1, device=device),
                   output_buf=torch.empty_like(query), lse_buf=torch.empty(batch, num_q_heads, device=device))

    def call():
        vllm.triton_turboquant_decode_attention(query, head_major, block_table, seq_lens, pi,
                                                codebook.get("centroids"), config.head_dim**-0.5, PiT=rotation,
                                                max_num_kv_splits=max_num_kv_splits, **buffers, **arguments)

    return call


def vllm_cache_view(module: ModuleType, config: Config, cache: torch.Tensor) -> torch.Tensor:
    """A module's make_cache cache as vLLM's kernels take their head-major allocation, [num_blocks, block_size,
    num_kv_heads, slot]: a slots cache is that already; a planes cache's pages [num_blocks, Hk, block_size * slot]
    are the allocation, viewed so."""
    if config.cache_layout != "planes":
        return cache
    return cache.view(cache.shape[0], cache.shape[1], config.block_size, module.SLOT_BYTES).transpose(1, 2)


def token_bytes(module: ModuleType) -> int:
    """The cache bytes of one token and KV head that decode and dequantize read and store writes: the slot's
    fields, without the byte that rounds a slot up to an even size (no kernel reads or writes it; "planes" keeps it
    in a plane of its own)."""
    return module.VALUE_ZERO_OFFSET + 2


def decode_bytes(module: ModuleType, query: torch.Tensor, out: torch.Tensor, num_kv_heads: int, context: int) -> int:
    """What a decode of `context` tokens a sequence must move: each KV head's cache bytes of those tokens (once for
    its group of query heads), the query read and the output written."""
    cache_bytes = query.shape[0] * num_kv_heads * context * token_bytes(module)
    return cache_bytes + query.numel() * query.element_size() + out.numel() * out.element_size()


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _op_row(config: Config, op: str, shape: str, graph_ms: float, nbytes: int, ceiling_gbps: float) -> OpRow:
    gbps = _gbps(nbytes, graph_ms)
    return OpRow(config=config.name, op=op, shape=shape, graph_us=graph_ms * 1e3, nbytes=nbytes, gbps=gbps,
                 ceiling_pct=100 * gbps / ceiling_gbps)


def bench_store(module: ModuleType, config: Config, num_tokens: int, *, ceiling_gbps: float,
                num_kv_heads: int = 8, device="cuda") -> OpRow:
    """Quantize num_tokens fp16 (key, value) pairs into shuffled slots; bytes = fp16 read + slots written."""
    import triton


    key = torch.randn(num_tokens, num_kv_heads, config.head_dim, dtype=torch.float16, device=device)
    value = torch.randn_like(key)
    num_blocks = -(-num_tokens // config.block_size)
    cache = module.make_cache(num_blocks, num_kv_heads, device)
    slots = torch.randperm(num_blocks * config.block_size, device=device)[:num_tokens]
    codebook = codebook_kwargs(module, device)

    def call():
        module.store(key, value, cache, slots, **codebook)

    call()
    graph_ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    nbytes = 2 * key.numel() * key.element_size() + num_tokens * num_kv_heads * token_bytes(module)
    return _op_row(config, "store", f"{num_tokens} tokens", graph_ms, nbytes, ceiling_gbps)


def bench_vllm_store(module: ModuleType, config: Config, num_tokens: int, *, ceiling_gbps: float,
                     num_kv_heads: int = 8, device="cuda") -> OpRow:
    """tqgen.vllm's store as vLLM's backend calls it, in the config's cache layout: num_tokens fp16 (key, value)
    pairs into shuffled slots of the cache allocated head-major and passed transposed, with copies of the config's
    rotation (PiT) and the midpoints of its centroids (vLLM holds its own tensors); bytes as bench_store counts."""
    import triton

    from . import vllm

    key = torch.randn(num_tokens, num_kv_heads, config.head_dim, dtype=torch.float16, device=device)
    value = torch.randn_like(key)
    num_blocks = -(-num_tokens // config.block_size)
    cache = vllm_cache_view(module, config, module.make_cache(num_blocks, num_kv_heads, device))
    slots = torch.randperm(num_blocks * config.block_size, device=device)[:num_tokens]
    arguments = vllm.format_arguments(config.key_bits, config.value_bits, config.norm_correction, config.head_dim)
    del arguments["norm_correction"]  # decode's argument, not the store's
    codebook = codebook_kwargs(module, device)
    pit = codebook["rotation"].clone() if codebook else None
    midpoints = module.decision_boundaries(codebook["centroids"]).clone() if codebook else None

    def call():
        vllm.triton_turboquant_store(key, value, cache, slots, pit, midpoints, **arguments)

    with vllm.cache_layout_for(config.cache_layout):
        call()
        graph_ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    nbytes = 2 * key.numel() * key.element_size() + num_tokens * num_kv_heads * token_bytes(module)
    return _op_row(config, "vllm-store", f"{num_tokens} tokens", graph_ms, nbytes, ceiling_gbps)


def bench_dequantize(module: ModuleType, config: Config, batch: int, context: int, *, ceiling_gbps: float,
                     num_kv_heads: int = 8, device="cuda") -> OpRow:
    """Dense K and V of full-length sequences (fp16 unless the config says otherwise); bytes = slots read + K and V
    written.

    MSE keys under a rotation other than the config's Hadamard matrix also make an fp32 round trip for
    their un-rotation GEMMs; that traffic is not counted, so the percentage is of the useful bytes.
    """
    import triton


    problem = random_problem(module, config, batch, context, num_kv_heads, num_kv_heads, device)
    codebook = codebook_kwargs(module, device)

    def call():
        return module.dequantize(problem["cache"], problem["block_table"], problem["seq_lens"], max_len=context,
                                 validate=False, **codebook)

    written = sum(t.numel() * t.element_size() for t in call())  # K and V in the config's output dtype
    graph_ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    nbytes = batch * num_kv_heads * context * token_bytes(module) + written
    return _op_row(config, "dequantize", f"{batch}x{context}", graph_ms, nbytes, ceiling_gbps)


def format_table(rows: list[BenchRow], ceiling_gbps: float, op_rows: list[OpRow] = (),
                 vllm_rows: list[VllmDecodeRow] = ()) -> str:
    lines = [f"copy ceiling: {ceiling_gbps:.0f} GB/s (device-to-device copy, read + write, this run)"]
    if rows:
        lines += ["| config | batch | context | decode us (plain) | decode us (graph) | GB/s | % ceiling "
                  "| fp16 SDPA us | x SDPA | seed-launch us | x seed launch | launch | heuristic us | x heuristic |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r.config} | {r.batch} | {r.context} | {r.plain_us:.1f} | {r.graph_us:.1f} "
                         f"| {r.gbps:.0f} | {r.ceiling_pct:.1f} | {r.sdpa_us:.1f} | {r.speedup_vs_sdpa:.2f} "
                         f"| {r.seed_launch_us:.1f} | {r.speedup_vs_seed_launch:.2f} | {r.launch} "
                         f"| {r.heuristic_us:.1f} | {r.speedup_vs_heuristic:.2f} |")
    if op_rows:
        lines += ["", "| config | op | shape | us (graph) | MB read + written | GB/s | % ceiling |",
                  "|---|---|---|---|---|---|---|"]
        for r in op_rows:
            lines.append(f"| {r.config} | {r.op} | {r.shape} | {r.graph_us:.1f} | {r.nbytes / 1e6:.1f} "
                         f"| {r.gbps:.0f} | {r.ceiling_pct:.1f} |")
    if vllm_rows:
        lines += ["", "tqgen.vllm decode on vLLM's head-major cache (vLLM's buffers, splits capped at "
                  f"{VLLM_MAX_KV_SPLITS}; module us: the module's own decode of the same bytes):",
                  "| config | layout | batch | context | us (graph) | GB/s | % ceiling | fp16 SDPA us | x SDPA "
                  "| module us | drop-in / module |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in vllm_rows:
            lines.append(f"| {r.config} | {r.layout} | {r.batch} | {r.context} | {r.graph_us:.1f} | {r.gbps:.0f} "
                         f"| {r.ceiling_pct:.1f} | {r.sdpa_us:.1f} | {r.speedup_vs_sdpa:.2f} "
                         f"| {r.module_us:.1f} | {r.module_cost:.2f} |")
    return "\n".join(lines)


def run_metadata(num_q_heads: int, num_kv_heads: int, command: str = "", configs: list[Config] = ()) -> dict:
    """What a bench run measured on: device, software versions, date, head counts, the command that ran it (and the
    TQGEN_ settings it ran under), and each config's resolved fields by name (its cache layout, head_dim, ...)."""
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "q_heads": num_q_heads, "kv_heads": num_kv_heads, "command": command,
            "environment": {name: value for name, value in sorted(os.environ.items()) if name.startswith("TQGEN_")},
            "configs": {config.name: config.to_dict() for config in configs}}


def payload(rows: list[BenchRow], ceiling_gbps: float, metadata: dict, op_rows: list[OpRow] = (),
            vllm_rows: list[VllmDecodeRow] = ()) -> dict:
    """One run as the JSON document that `write_json` writes and `chart.draw` reads."""
    return {"metadata": metadata, "copy_ceiling_gbps": ceiling_gbps, "rows": [dataclasses.asdict(r) for r in rows],
            "op_rows": [dataclasses.asdict(r) for r in op_rows],
            "vllm_rows": [dataclasses.asdict(r) for r in vllm_rows]}


def write_json(path, document: dict) -> None:
    """Atomically: a failed write leaves an earlier file intact."""
    write_atomic(Path(path), json.dumps(document, indent=1).encode("utf-8"))
