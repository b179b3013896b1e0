"""Summarize tools/ncu_stage1.sh's exports: per report, the issue rate, occupancy, pipe use and stall reasons
(raw page), and the main loop's instructions by opcode with their stall samples (source page).

    python3 tools/ncu_summary.py OUT_DIR/k3v4-d128-planes OUT_DIR/k8v4-d128-planes ...

Each argument is a report's path without its extension (NAME.raw.csv and NAME.sass.csv beside it). The loop
is every instruction executed at least a quarter as often as the most executed one (stage 1's tile loop).
"""

from __future__ import annotations

import collections
import csv
import re
import sys

RAW = ("gpu__time_duration.sum", "launch__registers_per_thread", "launch__grid_size",
       "launch__shared_mem_per_block_dynamic", "smsp__warps_active.avg.per_cycle_active",
       "smsp__warps_eligible.avg.per_cycle_active", "smsp__issue_active.avg.per_cycle_active",
       "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
       "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
       "sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_elapsed",
       "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
       "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
       "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
       "dram__throughput.avg.pct_of_peak_sustained_elapsed",
       "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum")
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def _number(text: str) -> float:
    return float(text.split()[0].replace(",", "") or 0)


def raw_summary(path: str) -> tuple[dict[str, str], dict[str, float]]:
    """(the RAW metrics found, as 'value unit'; warps stalled per issued instruction by reason, largest first)."""
    rows = list(csv.reader(open(path)))
    values = {name: f"{value} {unit}".strip() for name, unit, value in zip(rows[0], rows[1], rows[2])}
    stalls = {found.group(1): _number(value) for name, value in values.items() if (found := STALL.match(name))}
    return ({name: values[name] for name in RAW if name in values},
            dict(sorted(stalls.items(), key=lambda item: -item[1])))


def sass_summary(path: str) -> dict[str, tuple[float, float, list[tuple[str, float]]]]:
    """The loop's opcodes, most executed first: (share of the loop's executed instructions, share of its stall
    samples, the opcode's three most sampled stall reasons with their shares of its samples)."""
    rows = list(csv.reader(open(path)))
    header = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    names = rows[header]
    column = {name: i for i, name in enumerate(names)}
    stall_columns = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    lines = [r for r in rows[header + 1:] if len(r) == len(names)]
    executed = [int(_number(r[column["Instructions Executed"]])) for r in lines]
    hot = max(executed, default=0)
    by_op: dict[str, list] = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for row, count in zip(lines, executed):
        if count < hot / 4:
            continue
        source = re.sub(r"^@!?U?P\w+\s+", "", row[column["Source"]].strip())
        entry = by_op[source.split()[0].split(".")[0] if source else "?"]
        entry[0] += count
        entry[1] += int(_number(row[column["Warp Stall Sampling (All Samples)"]]))
        for name in stall_columns:
            entry[2][name[len("stall_"):]] += int(_number(row[column[name]]))
    total = sum(e[0] for e in by_op.values()) or 1
    samples = sum(e[1] for e in by_op.values()) or 1
    return {op: (count / total, sampled / samples, [(k, v / max(sampled, 1)) for k, v in stalls.most_common(3) if v])
            for op, (count, sampled, stalls) in sorted(by_op.items(), key=lambda item: -item[1][0])}


def main() -> None:
    for stem in sys.argv[1:]:
        print(f"== {stem}")
        metrics, stalls = raw_summary(stem + ".raw.csv")
        for name, value in metrics.items():
            print(f"  {name} = {value}")
        print("  warps stalled per issue: " + ", ".join(f"{k} {v:.2f}" for k, v in stalls.items() if v >= 0.01))
        print("  loop instructions by opcode (share of executed, share of stall samples, top stalls):")
        for op, (executed, sampled, top) in list(sass_summary(stem + ".sass.csv").items())[:18]:
            print(f"   {op:8s} {executed:6.1%} {sampled:6.1%}  " + ", ".join(f"{k} {v:.0%}" for k, v in top))


if __name__ == "__main__":
    main()
