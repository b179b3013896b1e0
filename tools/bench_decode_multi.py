"""Time decode_multi at q_len 1, 2, 4 and 8 against decode (CUDA-graph replay) at 32 x 8192, 32/8 heads.

    python3 tools/bench_decode_multi.py configs/k3v4-d128-planes.yaml configs/k8v4-d128-planes.yaml [--dot]

Each line: the call's median time, as a multiple of decode's (one query token) and against q_len
separate decode calls. Issue 21's targets: q_len 4 <= 1.25x decode, q_len 8 <= 1.6x, q_len 4 >= 3x
faster than 4 calls. --dot also times each q_len with stage 1 held to the tl.dot kernel (MMA_STAGE1
off: what decode_multi ran before its Gluon kernel), side by side.
"""
import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tqgen  # noqa: E402
from tqgen import emit, testing  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--dot", action="store_true", help="also time the tl.dot stage 1")
    args = parser.parse_args()
    for path in args.configs:
        config = emit.as_config(path)
        module = tqgen.load(config)
        batch, context = 32, 8192
        problem = testing.random_problem(module, config, batch, context, 32, 8, "cuda")
        codebook = testing.codebook_kwargs(module, "cuda")
        q1 = problem["query"]
        ws = module.DecodeWorkspace(batch, 32, 64, "cuda", max_q_len=8)
        out1 = torch.empty_like(q1)

        def single():
            module.decode(q1, problem["cache"], problem["block_table"], problem["seq_lens"], out=out1, workspace=ws,
                          validate=False, max_seq_len=context, **codebook)
        base = triton.testing.do_bench_cudagraph(single, return_mode="median") * 1e3
        print(f"{config.name}: decode q_len 1: {base:.1f} us", flush=True)
        shipped = getattr(module, "MMA_STAGE1", None)
        paths = [("shipped", shipped)] + ([("tl.dot", False)] if args.dot and shipped is not None else [])
        for q_len in (1, 2, 4, 8):
            q = torch.randn(batch, q_len, 32, 128, device="cuda", dtype=q1.dtype)
            out = torch.empty_like(q)

            def multi():
                module.decode_multi(q, problem["cache"], problem["block_table"], problem["seq_lens"], out=out,
                                    workspace=ws, validate=False, max_seq_len=context, **codebook)
            for label, mma in paths:
                if mma is not None:
                    module.MMA_STAGE1 = mma
                us = triton.testing.do_bench_cudagraph(multi, return_mode="median") * 1e3
                print(f"{config.name}: decode_multi q_len {q_len} ({label}): {us:.1f} us = {us / base:.2f}x decode, "
                      f"{q_len * base / us:.2f}x faster than {q_len} decode calls", flush=True)
            if shipped is not None:
                module.MMA_STAGE1 = shipped


if __name__ == "__main__":
    main()
