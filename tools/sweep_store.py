"""Time the store kernel of a config over its launch parameters, in both dim orders of a slots cache.

    python3 tools/sweep_store.py configs/k8v4-d128.yaml [--tokens 65536] [--block-t 2 4 8 16] [--warps 1 2 4]

Quantizes `--tokens` fp16 (key, value) pairs of 8 KV heads into shuffled slots, as `tqgen bench --ops store`
does, for every (tokens per program, warps) pair: a CUDA-graph replay, median, with the percentage of a
4268 GB/s copy ceiling (bytes: fp16 read + slots written; pass --ceiling to use another). A slots config is
timed on `make_cache`'s head-major allocation (vLLM's) and on a position-major cache of the same shape.
Where the store writes its keys by tq_store_keys_mma (planes MSE, 4096+ tokens) the swept launch is that of
tq_store's value pass (the module's _STORE_VALUES_LAUNCH); TQGEN_STORE_KEYS_MMA=0 sweeps tq_store alone.
"""

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tqgen  # noqa: E402
from tqgen import emit  # noqa: E402
from tqgen.testing import as_position_major, codebook_kwargs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--block-t", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ceiling", type=float, default=4268.0, help="GB/s")
    args = parser.parse_args()
    config = emit.as_config(args.config)
    module = tqgen.load(config)
    heads = 8
    key = torch.randn(args.tokens, heads, config.head_dim, dtype=torch.float16, device="cuda")
    value = torch.randn_like(key)
    num_blocks = -(-args.tokens // config.block_size)
    caches = {"make_cache": module.make_cache(num_blocks, heads, "cuda")}
    if config.cache_layout == "slots":
        caches["position-major"] = as_position_major(caches["make_cache"])
    slots = torch.randperm(num_blocks * config.block_size, device="cuda")[:args.tokens]
    codebook = codebook_kwargs(module, "cuda")
    nbytes = 2 * key.numel() * key.element_size() + args.tokens * heads * module.SLOT_BYTES
    print("| cache | tokens per program | warps | us | % of ceiling |\n|---|---|---|---|---|")
    for name, cache in caches.items():
        for block_t in args.block_t:
            for warps in args.warps:
                def call():
                    module.store(key, value, cache, slots, block_t=block_t, num_warps=warps, validate=False, **codebook)

                call()
                ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
                percent = nbytes / ms / 1e6 / args.ceiling * 100
                print(f"| {name} | {block_t} | {warps} | {ms * 1e3:.1f} | {percent:.1f} |", flush=True)


if __name__ == "__main__":
    main()
