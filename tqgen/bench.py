"""`tqgen bench`: time the emitted decode against its ceilings, in one run.

For each (config, batch, context) it reports, all measured in the same process:
- the whole decode call (query rotation, stage 1, stage 2): plain launches and
  a CUDA-graph replay, median microseconds;
- GB/s of compressed bytes read (batch x kv_heads x context x slot_bytes) and
  that as a percentage of a device-to-device copy ceiling measured in this run;
- the speedup over torch SDPA decode on a dense fp16 cache of the same shape;
- the speedup over the same generated kernel launched with the seed's choice
  (32 splits, 1 warp, 1 stage; BLOCK_KV 32, since tl.dot needs tiles of >= 16
  tokens and triton 3.6 miscompiles 16 -- the seed used 4).
"""

from __future__ import annotations

import dataclasses
import json
from types import ModuleType

import torch

from .config import Config

SEED_LAUNCH = dict(num_splits=32, block_kv=32, num_warps=1, num_stages=1)


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


def copy_ceiling_gbps(device="cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    import triton

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def random_cache(module: ModuleType, config: Config, num_blocks: int, num_kv_heads: int, device) -> torch.Tensor:
    """Random slot bytes with plausible fp16 norm/scale/zero fields and no fp8 NaNs."""
    cache = torch.randint(0, 256, (num_blocks, config.block_size, num_kv_heads, module.SLOT_BYTES),
                          dtype=torch.uint8, device=device)

    def put_fp16(offset: int, low: float, high: float) -> None:
        values = torch.empty(cache.shape[:3], device=device).uniform_(low, high).half()
        bits = values.view(torch.int16).to(torch.int32) & 0xFFFF
        cache[..., offset] = (bits & 0xFF).to(torch.uint8)
        cache[..., offset + 1] = (bits >> 8).to(torch.uint8)

    put_fp16(module.VALUE_SCALE_OFFSET, 0.01, 0.2)
    put_fp16(module.VALUE_ZERO_OFFSET, -1.0, 0.0)
    if config.key_format == "mse":
        put_fp16(module.KEY_NORM_OFFSET, 5.0, 20.0)
    else:
        cache[..., : config.head_dim] &= 0xF7  # no 0x7F / 0xFF (NaN) bytes, |k| < 240
    return cache


def random_problem(module: ModuleType, config: Config, batch: int, context: int, num_q_heads: int,
                   num_kv_heads: int, device) -> dict:
    """A full-length decode batch over a random cache in shuffled blocks: cache, block_table, seq_lens, query."""
    blocks_per_seq = -(-context // config.block_size)
    return {
        "cache": random_cache(module, config, batch * blocks_per_seq, num_kv_heads, device),
        "block_table": torch.randperm(batch * blocks_per_seq, device=device).to(torch.int32)
                            .view(batch, blocks_per_seq),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "query": torch.randn(batch, num_q_heads, config.head_dim, dtype=torch.float16, device=device),
    }


def bench_decode(module: ModuleType, config: Config, batch: int, context: int, *, ceiling_gbps: float,
                 num_q_heads: int = 32, num_kv_heads: int = 8, device="cuda") -> BenchRow:
    import triton

    problem = random_problem(module, config, batch, context, num_q_heads, num_kv_heads, device)
    cache, block_table, seq_lens, query = (problem[k] for k in ("cache", "block_table", "seq_lens", "query"))
    out = torch.empty_like(query)
    workspace = module.DecodeWorkspace(batch, num_q_heads, 64, device)

    def call(**launch):
        return module.decode(query, cache, block_table, seq_lens, out=out, workspace=workspace, validate=False,
                             **launch)

    call()  # compile and build the per-device rotation/centroids outside any timing
    plain_ms = triton.testing.do_bench(call, return_mode="median")
    graph_ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    call(**SEED_LAUNCH)
    seed_ms = triton.testing.do_bench_cudagraph(lambda: call(**SEED_LAUNCH), return_mode="median")

    keys = torch.randn(batch, num_kv_heads, context, config.head_dim, dtype=torch.float16, device=device)
    values = torch.randn_like(keys)
    q4 = query.unsqueeze(2)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, keys, values, enable_gqa=True)  # noqa: E731
    sdpa()
    sdpa_ms = triton.testing.do_bench_cudagraph(sdpa, return_mode="median")
    del keys, values, cache

    best_ms = min(plain_ms, graph_ms)
    nbytes = batch * num_kv_heads * context * module.SLOT_BYTES
    gbps = nbytes / (graph_ms * 1e-3) / 1e9
    return BenchRow(
        config=config.name, batch=batch, context=context, plain_us=plain_ms * 1e3, graph_us=graph_ms * 1e3,
        gbps=gbps, ceiling_pct=100 * gbps / ceiling_gbps, sdpa_us=sdpa_ms * 1e3,
        speedup_vs_sdpa=sdpa_ms / best_ms, seed_launch_us=seed_ms * 1e3, speedup_vs_seed_launch=seed_ms / graph_ms,
    )


def format_table(rows: list[BenchRow], ceiling_gbps: float) -> str:
    lines = [f"copy ceiling: {ceiling_gbps:.0f} GB/s (device-to-device copy, read + write, this run)",
             "| config | batch | context | decode us (plain) | decode us (graph) | GB/s | % ceiling "
             "| fp16 SDPA us | x SDPA | seed-launch us | x seed launch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.config} | {r.batch} | {r.context} | {r.plain_us:.1f} | {r.graph_us:.1f} | {r.gbps:.0f} "
                     f"| {r.ceiling_pct:.1f} | {r.sdpa_us:.1f} | {r.speedup_vs_sdpa:.2f} | {r.seed_launch_us:.1f} "
                     f"| {r.speedup_vs_seed_launch:.2f} |")
    return "\n".join(lines)


def write_json(path, rows: list[BenchRow], ceiling_gbps: float, metadata: dict) -> None:
    payload = {"metadata": metadata, "copy_ceiling_gbps": ceiling_gbps, "rows": [dataclasses.asdict(r) for r in rows]}
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1)
