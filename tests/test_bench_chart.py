"""The benchmark's host-side pieces: table, JSON and chart (the timings themselves need a GPU)."""

import contextlib
import json
from pathlib import Path

import pytest

from tqgen import bench, chart, cli
from tqgen.errors import TqgenError

BENCH_RUNS = Path(__file__).resolve().parent.parent / "docs" / "bench"  # the committed runs' JSON


def _decode_row(config, batch, context, gbps):
    return bench.BenchRow(config=config, batch=batch, context=context, plain_us=12.0, graph_us=10.0, gbps=gbps,
                          ceiling_pct=gbps / 42.0, sdpa_us=20.0, speedup_vs_sdpa=2.0, seed_launch_us=30.0,
                          speedup_vs_seed_launch=3.0, launch="tuned kv32 w1 st1 sp8", heuristic_us=15.0,
                          speedup_vs_heuristic=1.5)


def _bench_file(tmp_path):
    rows = [_decode_row(c, b, t, 100.0 * b + t / 1000) for c in ("k3v4-d128", "k8v4-d128")
            for b in (1, 32) for t in (1024, 4096, 16384)]
    ops = [bench.OpRow(config="k3v4-d128", op="store", shape="4096 tokens", graph_us=8.0, nbytes=8_000_000,
                       gbps=1000.0, ceiling_pct=23.8)]
    path = tmp_path / "bench.json"
    bench.write_json(path, bench.payload(rows, 4200.0, {"device": "NVIDIA H200", "triton": "3.6.0",
                                                         "date": "2026-11-29"}, ops))
    return path, rows, ops


def test_table_has_every_row_and_column(tmp_path):
    _, rows, ops = _bench_file(tmp_path)
    table = bench.format_table(rows, 4200.0, ops)
    assert "copy ceiling: 4200 GB/s" in table
    assert table.count("| k3v4-d128 | 1 |") == 3 and table.count("tuned kv32 w1 st1 sp8") == len(rows)
    assert "| k3v4-d128 | store | 4096 tokens | 8.0 | 8.0 | 1000 | 23.8 |" in table
    header = next(line for line in table.splitlines() if line.startswith("| config | batch"))
    assert all(line.count("|") == header.count("|") for line in table.splitlines() if "| tuned" in line)


def test_vllm_decode_rows_make_a_table_of_their_own(tmp_path):
    rows = [bench.VllmDecodeRow(config="k3v4-d128", layout="planes", batch=32, context=8192, graph_us=50.0, gbps=2000.0,
                                ceiling_pct=47.6, sdpa_us=150.0, speedup_vs_sdpa=3.0, module_us=45.0,
                                module_cost=1.11)]
    table = bench.format_table([], 4200.0, (), rows)
    assert "head-major cache" in table
    assert "| k3v4-d128 | planes | 32 | 8192 | 50.0 | 2000 | 47.6 | 150.0 | 3.00 | 45.0 | 1.11 |" in table
    document = bench.payload([], 4200.0, {}, (), rows)
    assert document["vllm_rows"][0]["module_cost"] == 1.11


def test_json_round_trips(tmp_path):
    path, rows, ops = _bench_file(tmp_path)
    payload = json.loads(path.read_text())
    assert payload["copy_ceiling_gbps"] == 4200.0
    assert [r["gbps"] for r in payload["rows"]] == [r.gbps for r in rows]
    assert payload["op_rows"][0]["op"] == "store"


def test_chart_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path, _, _ = _bench_file(tmp_path)
    png = tmp_path / "chart.png"
    assert cli.main(["chart", str(path), str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("{not json", "not a tqgen bench JSON file"),
    ('{"rows": [{"config": "x"}], "copy_ceiling_gbps": 1}', "not a tqgen bench JSON file"),
    ('{"rows": [], "copy_ceiling_gbps": 1}', "no decode rows"),
])
def test_chart_refuses_bad_input_in_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TqgenError, match=message):
        chart.read_bench_json(path)
    assert cli.main(["chart", str(path), str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tqgen: error:") and "\n" not in err and not (tmp_path / "out.png").exists()


def test_chart_write_and_read_failures_are_one_line_errors(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, _, _ = _bench_file(tmp_path)
    assert cli.main(["chart", str(path), str(tmp_path / "missing-dir" / "chart.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tqgen: error: cannot write the chart to") and "missing-dir" in err and "\n" not in err
    assert cli.main(["chart", str(tmp_path), str(tmp_path / "chart.png")]) == 2  # a folder, not a JSON file
    err = capsys.readouterr().err.strip()
    assert "cannot be read" in err and "\n" not in err and not (tmp_path / "chart.png").exists()


def _timed_decode(monkeypatch, *, plain_ms, graph_ms, sdpa_ms, batch=2, context=64, q_heads=12, kv_heads=4,
                  slot_bytes=118, used_bytes=118):
    """bench_decode on the CPU: a stand-in module and problem, the timers replaced by fixed times (graph replays in
    the order bench takes them: decode's launch, the seed's, the heuristic's, then SDPA, which runs once for real)."""
    import types

    import torch
    import triton.testing

    head_dim, sdpa_outputs = 16, []
    module = types.SimpleNamespace(
        SLOT_BYTES=slot_bytes, VALUE_ZERO_OFFSET=used_bytes - 2, TUNED_LAUNCHES={}, bucket_key=lambda *a: "b",
        DecodeWorkspace=lambda *a: None, decode_launch=lambda *a: (32, 1, 2, 8),
        decode_launch_defaults=lambda *a: (32, 1, 2, 8), decode=lambda *a, **k: None)
    monkeypatch.setattr(bench, "random_problem", lambda module, config, b, t, hq, hk, device: {
        "cache": torch.zeros(1), "block_table": None, "seq_lens": None,
        "query": torch.randn(b, hq, head_dim, dtype=torch.float16)})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **k: plain_ms)
    graph_times = [graph_ms, 3 * graph_ms, 2 * graph_ms, sdpa_ms]
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph",
                        lambda fn, **k: sdpa_outputs.append(fn()) or graph_times.pop(0))
    config = types.SimpleNamespace(name="k3v4-d128", output_dtype="auto")
    row = bench.bench_decode(module, config, batch, context, ceiling_gbps=4000.0, num_q_heads=q_heads,
                             num_kv_heads=kv_heads, device="cpu")
    return row, sdpa_outputs[-1]


def test_decode_speedup_over_sdpa_is_of_the_graph_time_the_row_reports(monkeypatch):
    # SDPA is timed as a graph replay, and the tables print it beside the decode's graph replay time: a plain-launch
    # time that happens to be faster must not make the decode look faster than SDPA.
    row, _ = _timed_decode(monkeypatch, plain_ms=0.090, graph_ms=0.100, sdpa_ms=0.250)
    assert row.graph_us == pytest.approx(100.0) and row.sdpa_us == pytest.approx(250.0)
    assert row.speedup_vs_sdpa == pytest.approx(row.sdpa_us / row.graph_us)


def test_decode_bytes_and_sdpa_shape_follow_the_head_counts(monkeypatch):
    batch, context, q_heads, kv_heads = 2, 64, 12, 4
    row, sdpa_out = _timed_decode(monkeypatch, plain_ms=0.2, graph_ms=0.1, sdpa_ms=0.3, batch=batch, context=context,
                                  q_heads=q_heads, kv_heads=kv_heads)
    nbytes = batch * kv_heads * context * 118 + 2 * batch * q_heads * 16 * 2  # the cache, the query and the output
    assert row.gbps == pytest.approx(nbytes / 100e-6 / 1e9)
    assert row.ceiling_pct == pytest.approx(100 * row.gbps / 4000.0)
    assert tuple(sdpa_out.shape) == (batch, q_heads, 1, 16)
    assert row.speedup_vs_seed_launch == pytest.approx(3.0) and row.speedup_vs_heuristic == pytest.approx(2.0)


def test_bench_tables_speedup_over_sdpa_agrees_with_the_times_it_prints():
    # The committed runs: each decode row's "x fp16 SDPA" must be its "fp16 SDPA us" over its "us" (graph replays).
    import bench_tables

    documents = [json.loads(path.read_text()) for path in sorted(BENCH_RUNS.glob("*.json"))]
    rows = [line.split("|")[1:-1] for line in bench_tables.tables(documents).splitlines()
            if line.startswith("| ") and line.split("|")[1].strip()[:1].isdigit()]
    assert rows
    for _, us, _, speedup, sdpa_us, _ in rows:  # each printed to 0.1 us, the speedup to 0.01
        us, speedup, sdpa_us = float(us), float(speedup), float(sdpa_us)
        ratio = sdpa_us / us
        assert abs(speedup - ratio) <= 0.005 + ratio * (0.05 / us + 0.05 / sdpa_us) + 1e-9, (us, speedup, sdpa_us)


def test_bench_tables_keep_runs_of_other_head_counts_apart():
    # The group-size runs: the same configs and shapes at 64 and 128 query heads over 8 KV heads.
    import bench_tables

    documents = [json.loads((BENCH_RUNS / f"2026-12-04-planes-g{g}-tuned.json").read_text()) for g in ("64-8", "128-8")]
    sections = bench_tables.tables(documents).split("### ")[1:]
    for section in sections:  # each table holds one run's head count: every shape once
        shapes = [line.split("|")[1] for line in section.splitlines() if line.startswith("| 32 x")]
        assert len(shapes) == len(set(shapes)) == 2, section
    assert sum("64/8 heads" in section.splitlines()[0] for section in sections) == 4
    assert sum("128/8 heads" in section.splitlines()[0] for section in sections) == 4


@pytest.mark.parametrize("output_dtype, element_size", [("float16", 2), ("float32", 4)])
def test_dequantize_counts_the_bytes_of_the_dtype_it_writes(build_module, monkeypatch, output_dtype, element_size):
    # A config's output_dtype sets what dequantize writes: float32 K and V are twice fp16's bytes.
    import triton.testing

    from conftest import INTERPRET, make_config

    if not INTERPRET:
        pytest.skip("runs the kernel under the interpreter (the timer is a stand-in)")
    config = make_config("k8v4", head_dim=64, output_dtype=output_dtype)
    module = build_module(config)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **k: 0.5)
    batch, context, kv_heads = 1, 16, 2
    row = bench.bench_dequantize(module, config, batch, context, ceiling_gbps=1000.0, num_kv_heads=kv_heads,
                                 device="cpu")
    slots = batch * kv_heads * context
    assert row.nbytes == slots * module.SLOT_BYTES + 2 * slots * config.head_dim * element_size


def _stub_module(slot_bytes, used_bytes, head_dim=16):
    """A stand-in fp8-keys module for the store and dequantize timings on the CPU (the kernels do nothing)."""
    import types

    import torch

    return types.SimpleNamespace(
        KEY_FORMAT="fp8", SLOT_BYTES=slot_bytes, VALUE_ZERO_OFFSET=used_bytes - 2, DecodeWorkspace=lambda *a: None,
        make_cache=lambda blocks, heads, device: torch.zeros(blocks, 16, heads, slot_bytes, dtype=torch.uint8),
        store=lambda *a, **k: None, decode=lambda *a, **k: None, decode_launch=lambda *a: (32, 1, 2, 8),
        dequantize=lambda cache, table, lens, max_len, **k: [torch.zeros(len(lens), cache.shape[2], max_len, head_dim,
                                                                         dtype=torch.float16)] * 2)


def test_bytes_leave_out_the_padding_that_rounds_a_slot_up_to_even(monkeypatch):
    # A slot of 69 bytes of fields is 70 bytes long (Layout.slot_bytes): no kernel reads or writes the padding
    # byte, so decode, store and dequantize count 69 bytes a token and KV head.
    import types

    import torch
    import triton.testing

    from tqgen import vllm

    batch, context, q_heads, kv_heads, head_dim = 2, 64, 12, 4, 16
    row, _ = _timed_decode(monkeypatch, plain_ms=0.2, graph_ms=0.1, sdpa_ms=0.3, slot_bytes=70, used_bytes=69)
    query_and_out = 2 * batch * q_heads * head_dim * 2
    assert row.gbps == pytest.approx((batch * kv_heads * context * 69 + query_and_out) / 100e-6 / 1e9)

    module, config = _stub_module(70, 69), types.SimpleNamespace(name="k3v4-d72", head_dim=head_dim, block_size=16,
                                                                  cache_layout="slots", output_dtype="auto",
                                                                  key_bits=8, value_bits=4, norm_correction=False)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **k: 0.5)
    store = bench.bench_store(module, config, 32, ceiling_gbps=1000.0, num_kv_heads=kv_heads, device="cpu")
    assert store.nbytes == 2 * 32 * kv_heads * head_dim * 2 + 32 * kv_heads * 69
    stored = []
    monkeypatch.setattr(vllm, "cache_layout_for", lambda layout: contextlib.nullcontext())
    monkeypatch.setattr(vllm, "triton_turboquant_store", lambda *a, **k: stored.append(k))
    drop_in_store = bench.bench_vllm_store(module, config, 32, ceiling_gbps=1000.0, num_kv_heads=kv_heads,
                                           device="cpu")
    assert drop_in_store.op == "vllm-store" and drop_in_store.nbytes == store.nbytes
    assert stored and stored[0]["key_fp8"] and "norm_correction" not in stored[0]  # vLLM's store takes none
    monkeypatch.setattr(bench, "random_problem", lambda module, config, b, t, hq, hk, device, **k: {
        "cache": torch.zeros(b * t // 16, 16, hk, 70, dtype=torch.uint8), "block_table": torch.zeros(b, t // 16),
        "seq_lens": torch.full((b,), t), "query": torch.randn(b, hq, head_dim, dtype=torch.float16)})
    dequantize = bench.bench_dequantize(module, config, batch, context, ceiling_gbps=1000.0, num_kv_heads=kv_heads,
                                        device="cpu")
    assert dequantize.nbytes == batch * kv_heads * context * (69 + 2 * head_dim * 2)
    monkeypatch.setattr(bench, "vllm_decode_call", lambda *a: lambda: None)
    monkeypatch.setattr(bench, "_sdpa_ms", lambda *a: 0.5)
    monkeypatch.setattr(vllm, "cache_layout_for", lambda layout: contextlib.nullcontext())
    drop_in = bench.bench_vllm_decode(module, config, batch, context, ceiling_gbps=1000.0, num_q_heads=q_heads,
                                      num_kv_heads=kv_heads, device="cpu")
    assert drop_in.gbps == pytest.approx((batch * kv_heads * context * 69 + query_and_out) / 500e-6 / 1e9)


def test_decode_bytes_count_the_query_read_and_the_output_written(monkeypatch):
    # The ceiling counts bytes read plus bytes written: a decode reads its query and writes its output besides the
    # cache (2 x 1 x 32 x 128 fp16 = 16 KiB, 1.7% of a k3v4 call's cache bytes at 1 x 1024 over 8 KV heads).
    batch, context, q_heads, kv_heads = 1, 1024, 32, 8
    row, _ = _timed_decode(monkeypatch, plain_ms=0.02, graph_ms=0.01, sdpa_ms=0.01, batch=batch, context=context,
                           q_heads=q_heads, kv_heads=kv_heads)
    nbytes = batch * kv_heads * context * 118 + 2 * batch * q_heads * 16 * 2
    assert row.gbps == pytest.approx(nbytes / 10e-6 / 1e9)
    assert row.ceiling_pct == pytest.approx(100 * row.gbps / 4000.0)


def test_bench_tables_take_the_cache_layout_from_the_run_not_the_name():
    # A config's name is cosmetic (its name: field, else its file's name, which need not end in "planes"): the run
    # records each config's fields, and the table's heading takes its layout from them.
    import bench_tables

    from tqgen.config import Config

    config = Config(key_format="mse", key_bits=3, value_bits=4, head_dim=128, norm_correction=True,
                    rotation="hadamard", cache_layout="planes", name="k3v4-d128")
    metadata = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-12-06", "q_heads": 32,
                "kv_heads": 8, "configs": {config.name: config.to_dict()}}
    document = bench.payload([_decode_row(config.name, 32, 8192, 3000.0)], 4200.0, metadata)
    assert bench_tables.tables([document]).count("### k3v4, planes (k3v4-d128)") == 1


def test_bench_tables_label_store_rows_of_other_kv_head_counts():
    # A store of 65536 tokens over 32 KV heads moves 4x the bytes of one over 8: its row must not read as the same
    # shape (decode keeps a table per head count; store and dequantize rows share one table).
    import bench_tables

    documents = []
    for kv_heads, us in ((8, 100.0), (32, 400.0)):
        row = bench.OpRow(config="k3v4-d128", op="store", shape="65536 tokens", graph_us=us, nbytes=1, gbps=1.0,
                          ceiling_pct=40.0)
        metadata = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-12-06",
                    "q_heads": 32, "kv_heads": kv_heads}
        documents.append(bench.payload([], 4200.0, metadata, [row]))
    labels = [line.split("|")[1:4] for line in bench_tables.tables(documents).splitlines()
              if line.startswith("| k3v4-d128 | store")]
    assert len(labels) == 2 and labels[0] != labels[1], labels
    assert "| 65536 tokens, 32 KV heads | 400.0 |" in bench_tables.tables(documents)


def test_decode_of_a_config_with_an_output_dtype_is_timed(build_module, monkeypatch):
    # A config's output_dtype sets what decode writes: bench's out buffer must be of that dtype (decode refuses any
    # other), and its bytes count as that dtype's.
    import torch
    import triton.testing

    from conftest import INTERPRET, make_config

    if not INTERPRET:
        pytest.skip("runs the kernel under the interpreter (the timer is a stand-in)")
    config = make_config("k8v4", head_dim=64, output_dtype="float32")
    module = build_module(config)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **k: 0.5)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **k: 0.5)
    batch, context, q_heads, kv_heads = 1, 16, 2, 1
    row = bench.bench_decode(module, config, batch, context, ceiling_gbps=1000.0, num_q_heads=q_heads,
                             num_kv_heads=kv_heads, device="cpu")
    nbytes = batch * kv_heads * context * bench.token_bytes(module) + batch * q_heads * 64 * (2 + 4)
    assert row.gbps == pytest.approx(nbytes / 0.5e-3 / 1e9)
