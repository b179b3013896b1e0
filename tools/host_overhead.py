"""What a decode call costs the host when it is not replayed from a CUDA graph (eager), beside its GPU time.

    python3 tools/host_overhead.py [CONFIG ...] [--shapes 1x4096 8x4096] [--calls 300]

Engines that capture attention in a CUDA graph pay only the GPU time; engines that run attention eagerly between
graph pieces (vLLM's piecewise graphs) also pay the Python and launch work of every call, once per layer and step.
For each config (default: k3v4 and k8v4, planes and slots) and shape (32 query / 8 KV heads), three ways in:
`module.decode` with a workspace and validate=False, tqgen.vllm's `triton_turboquant_decode_attention` as vLLM's
backend calls it (its buffers passed, the cache head-major), and fp16 SDPA of the same shape. For each:
- host us: the CPU time of one call, perf_counter around it with nothing synchronized (median over --calls, after
  warm-up): what the engine's thread spends before it can issue the next kernel. The calls of a shape are timed in
  turn, 10 of each per round (the device machine's CPU drifts by tens of percent between blocks of calls, and
  interleaving spreads that over every call alike);
- eager us: wall time per call of --calls calls issued back to back, synchronized once at the end: the rate of
  eager calls, the larger of the host's time and the GPU's;
- graph us: the median CUDA-graph replay (triton.testing.do_bench_cudagraph): the GPU time alone.
Prints one table. --profile N also prints the N costliest functions (cProfile, own time) of each config's eager
`module.decode` and tqgen.vllm calls at the first shape: where the host time goes. --breakdown times, for each
config's `module.decode` at the first shape, the call with triton's launches stubbed out (tqgen's own part) and each
of its launches whole and in pieces (triton's binder, its cache key, its check of the kernel's globals, the compiled
kernel called directly, and tqgen's _launch, which does so after a first launch, and _launch_with, the same with the
constants as one mapping built once, as the decode stages pass theirs): perf_counter medians, which cProfile's
per-call overhead would distort.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_CONFIGS = ["configs/k3v4-d128-planes.yaml", "configs/k8v4-d128-planes.yaml", "configs/k3v4-d128.yaml",
                   "configs/k8v4-d128.yaml"]


def median_us(call, calls: int) -> float:
    """Median host time of call() in us over `calls` calls (interleaved_host_us of the one call)."""
    return interleaved_host_us({"call": (call, contextlib.nullcontext)}, calls)["call"]


def interleaved_host_us(calls_by_name: dict, calls: int) -> dict:
    """Host us (module docstring) of each (call, context) of calls_by_name: `calls` timed calls of each, 10 of each
    in turn per round, each block inside its context (tqgen.vllm's cache layout); medians by name."""
    import torch

    times = {name: [] for name in calls_by_name}
    for call, context in calls_by_name.values():
        with context():
            for _ in range(10):
                call()
    torch.cuda.synchronize()
    for _ in range(-(-calls // 10)):
        for name, (call, context) in calls_by_name.items():
            with context():
                for _ in range(10):
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def eager_and_graph_us(call, calls: int) -> tuple[float, float]:
    """(eager us, graph us) of `call`, as the module docstring defines them."""
    import torch
    import triton

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) / calls
    graph_ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
    return eager * 1e6, graph_ms * 1e3


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


def print_breakdown(name: str, module, call, calls: int) -> None:
    """The host time of call() split into tqgen's part and each triton launch's pieces (module docstring)."""
    import torch
    from triton import knobs  # triton >= 3.4, as the breakdown's pieces are triton 3.6's launch path
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction, compute_cache_key

    original = JITFunction.run
    launches = []  # (jit function, args, kwargs as run() sees them, grid, compiled kernel)

    def recording(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        launches.append((self, args, dict(kwargs), grid, kernel))
        return kernel

    @contextlib.contextmanager
    def every_launch_through(run):
        """JITFunction.run replaced by `run`, and _launch taking it for every launch (no compiled kernel it holds)."""
        fast = module._FAST_LAUNCH
        JITFunction.run, module._FAST_LAUNCH = run, False
        try:
            yield
        finally:
            JITFunction.run, module._FAST_LAUNCH = original, fast

    with every_launch_through(recording):
        call()
    torch.cuda.synchronize()
    with every_launch_through(lambda self, *args, grid, warmup, **kwargs: None):
        own = median_us(call, calls)
    print(f"\n{name}: whole call {median_us(call, calls):.1f} us, with the launches stubbed out {own:.1f} us")
    print("| kernel | triton's launch us | binder us | cache key us | globals check us | compiled kernel us "
          "| tqgen's _launch us | _launch_with us | globals |")
    print("|---|---|---|---|---|---|---|---|---|")
    device = driver.active.get_current_device()
    extra_options = dict(instrumentation_mode=knobs.compilation.instrumentation_mode)  # what run() adds
    for fn, args, kwargs, grid, compiled in launches:
        run_kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug, **extra_options)
        _, key_cache, _, _, binder = fn.device_caches[device]
        bound, specialization, options = binder(*args, **run_kwargs)
        missing = object()
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        mapping = types.MappingProxyType(kwargs)  # built once, as the decode stages' launchers cache theirs
        pieces = [
            lambda: fn[grid](*args, **kwargs),
            lambda: binder(*args, **run_kwargs),
            lambda: compute_cache_key(key_cache, specialization, options),
            lambda: [globals_dict.get(global_name, missing) != value
                     for (global_name, _), (value, globals_dict) in fn.used_global_vals.items()],
            lambda: compiled[grid3](*bound.values()),
            lambda: module._launch(fn, grid, *args, **kwargs),
            lambda: module._launch_with(fn, grid, mapping, *args),
        ]
        cells = [f"{median_us(piece, calls):.1f}" for piece in pieces]
        print(f"| {fn.__name__} | " + " | ".join(cells) + f" | {len(fn.used_global_vals)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=DEFAULT_CONFIGS)
    parser.add_argument("--shapes", nargs="+", default=["1x4096", "8x4096"])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    profiles = []  # (name, call, context): profiled after the table, with --profile
    breakdowns = []  # (name, module, call): split after the table, with --breakdown

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
        calls = {"fp16 SDPA": (bench.sdpa_call(torch.randn(batch, 32, 128, dtype=torch.float16, device="cuda"), 8,
                                               context), contextlib.nullcontext)}
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
            layout = functools.partial(vllm.cache_layout_for, config.cache_layout)
            calls[f"{config.name} decode"] = (decode, contextlib.nullcontext)
            calls[f"{config.name} tqgen.vllm"] = (bench.vllm_decode_call(module, config, problem), layout)
            if shape == args.shapes[0]:
                profiles += [(f"{config.name} decode {shape}", decode, contextlib.nullcontext),
                             (f"{config.name} tqgen.vllm {shape}", calls[f"{config.name} tqgen.vllm"][0], layout)]
                breakdowns.append((f"{config.name} decode {shape}", module, decode))
        host = interleaved_host_us(calls, args.calls)
        for name, (call, context) in calls.items():
            with context():
                costs = host[name], *eager_and_graph_us(call, args.calls)
            print(f"| {name} | {shape} | " + " | ".join(f"{v:.1f}" for v in costs) + " |", flush=True)
        del calls
    for name, call, context in profiles if args.profile else []:
        with context():
            print_profile(name, call, args.calls, args.profile)
    for name, module, call in breakdowns if args.breakdown else []:
        print_breakdown(name, module, call, args.calls)


if __name__ == "__main__":
    main()
