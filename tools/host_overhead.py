"""What a decode call costs the host when it is not replayed from a CUDA graph (eager), beside its GPU time.

    python3 tools/host_overhead.py [CONFIG ...] [--shapes 1x4096 8x4096] [--calls 300]

Engines that capture attention in a CUDA graph pay only the GPU time; engines that run attention eagerly between
graph pieces (vLLM's piecewise graphs) also pay the Python and launch work of every call, once per layer and step.
For each config (default: k3v4 and k8v4, planes and slots) and shape (32 query / 8 KV heads), three ways in:
`module.decode` with a workspace and validate=False, tqgen.vllm's `triton_turboquant_decode_attention` as vLLM's
backend calls it (its buffers passed, the cache head-major), and fp16 SDPA of the same shape. For each:
- host us: the CPU time of one call, perf_counter around it with nothing synchronized (median over --calls, after
  warm-up): what the engine's thread spends before it can issue the next kernel;
- eager us: wall time per call of --calls calls issued back to back, synchronized once at the end: the rate of
  eager calls, the larger of the host's time and the GPU's;
- graph us: the median CUDA-graph replay (triton.testing.do_bench_cudagraph): the GPU time alone.
Prints one table. --profile N also prints the N costliest functions (cProfile, own time) of each config's eager
`module.decode` and tqgen.vllm calls at the first shape: where the host time goes.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_CONFIGS = ["configs/k3v4-d128-planes.yaml", "configs/k8v4-d128-planes.yaml", "configs/k3v4-d128.yaml",
                   "configs/k8v4-d128.yaml"]


def host_costs(call, calls: int) -> tuple[float, float, float]:
    """(host us, eager us, graph us) of `call`, as the module docstring defines them."""
    import torch
    import triton

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    host = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        host.append(time.perf_counter() - start)
        if len(host) % 50 == 0:
            torch.cuda.synchronize()  # keep the launch queue short: host time, not back-pressure
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) / calls
    graph_ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    return statistics.median(host) * 1e6, eager * 1e6, graph_ms * 1e3


def print_profile(name: str, call, calls: int, top: int) -> None:
    """cProfile's `top` functions by own time over `calls` calls of `call`."""
    import cProfile
    import io
    import pstats

    import torch

    call()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    print(f"\n{name}, {calls} calls:\n" + "\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--shapes", nargs="+", default=["1x4096", "8x4096"])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    profiles = []  # (name, call): profiled after the table

    import torch
    import triton

    import tqgen
    from tqgen import bench, emit, testing, vllm

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"32 query / 8 KV heads; {args.calls} calls")
    print("| call | batch x context | host us | eager us | graph us |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        batch, context = (int(part) for part in shape.split("x"))
        sdpa = bench.sdpa_call(torch.randn(batch, 32, 128, dtype=torch.float16, device="cuda"), 8, context)
        print(f"| fp16 SDPA | {shape} | " + " | ".join(f"{v:.1f}" for v in host_costs(sdpa, args.calls)) + " |",
              flush=True)
        del sdpa
        for path in args.configs:
            config = emit.as_config(path)
            module = tqgen.load(config)
            problem = testing.random_problem(module, config, batch, context, 32, 8, "cuda")
            cache, table, lens, query = (problem[k] for k in ("cache", "block_table", "seq_lens", "query"))
            codebook = testing.codebook_kwargs(module, "cuda")
            launch = module.decode_launch(batch, 8, 4, context, cache.device)
            workspace = module.DecodeWorkspace(batch, 32, launch[3], "cuda")
            out = torch.empty_like(query)

            decode = functools.partial(module.decode, query, cache, table, lens, out=out, workspace=workspace,
                                       validate=False, **codebook)

            print(f"| {config.name} decode | {shape} | "
                  + " | ".join(f"{v:.1f}" for v in host_costs(decode, args.calls)) + " |", flush=True)
            if args.profile and shape == args.shapes[0]:
                profiles.append((f"{config.name} decode {shape}", decode))
            vllm_decode = bench.vllm_decode_call(module, config, problem)
            with vllm.cache_layout_for(config.cache_layout):
                costs = host_costs(vllm_decode, args.calls)
                if args.profile and shape == args.shapes[0]:
                    print_profile(f"{config.name} tqgen.vllm {shape}", vllm_decode, args.calls, args.profile)
            print(f"| {config.name} tqgen.vllm | {shape} | " + " | ".join(f"{v:.1f}" for v in costs) + " |",
                  flush=True)
    for name, call in profiles:
        print_profile(name, call, args.calls, args.profile)


if __name__ == "__main__":
    main()
