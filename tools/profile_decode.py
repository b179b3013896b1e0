"""Run the whole decode call a few times per config, for a profiler to attach to.

    ncu --clock-control none -k regex:tq_decode_stage1 -s 2 -c 1 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        python3 tools/profile_decode.py 32x16384 configs/k3v4-d128-planes.yaml

Each config decodes a random full-length batch (`tqgen.testing.random_problem`, 32 query and
8 KV heads) at its tuned launch, three times: `-s 2` skips the first two stage-1 launches,
which include compilation.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tqgen  # noqa: E402
from tqgen import bench, emit, testing  # noqa: E402

batch, context = map(int, sys.argv[1].split("x"))
for path in sys.argv[2:]:
    config = emit.as_config(path)
    module = tqgen.load(config)
    problem = testing.random_problem(module, config, batch, context, 32, 8, "cuda")
    out = torch.empty_like(problem["query"])
    workspace = module.DecodeWorkspace(batch, 32, 64, "cuda")
    for _ in range(3):
        module.decode(problem["query"], problem["cache"], problem["block_table"], problem["seq_lens"], out=out,
                      workspace=workspace, validate=False, max_seq_len=context)
    torch.cuda.synchronize()
    print(f"{path}: decode at {batch} x {context} ran 3 times", flush=True)
