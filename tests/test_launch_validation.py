"""Wrong calls to every launcher (store, decode, dequantize) are refused before any kernel runs.

A table of (case id, call builder, expected substring) rows, run for one MSE
config (k3v4) and one fp8 config (k8v4): each call must raise the module's
LaunchError (a ValueError) whose message names the offending argument, and
must leave the cache untouched. Then the edge cases that must NOT raise: empty
batches, zero tokens, seq_len 0, block-table columns of -1 past seq_len, and
validate=False with block ids outside the cache (masked by the kernels).
"""

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import codebook_kwargs, make_config, planes_config, stored_cache
from tqgen import reference
from tqgen.layout import Layout
from tqgen.plan import Plan
from tqgen.testing import DECODE_TOLERANCE, paged_batch, relative_error

PRESETS = ("k3v4", "k8v4")  # one MSE config, one fp8 config
SEQ_LENS = [20, 5]  # pages of 16: sequence 0 spans two blocks, sequence 1 one
KV_HEADS, GROUP = 2, 4


@dataclasses.dataclass
class Ctx:
    module: object
    config: object
    device: str
    cache: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    query: torch.Tensor
    codebook: dict

    @property
    def num_blocks(self):
        return self.cache.shape[0]

    @property
    def page(self):
        return self.module.PAGE_SIZE

    @property
    def slot(self):
        return self.module.SLOT_BYTES

    def cache_like(self, *shape, dtype=torch.uint8):
        """A cache-sized tensor of another shape/dtype, holding the cache's bytes where they fit."""
        other = torch.zeros(*shape, dtype=dtype, device=self.device)
        if dtype == torch.uint8:
            region = tuple(slice(0, min(a, b)) for a, b in zip(other.shape, self.cache.shape))
            other[region] = self.cache[region]
        return other

    def defaults(self, op):
        common = dict(self.codebook)
        if op == "store":
            return dict(key=self.key, value=self.value, kv_cache=self.cache, slot_mapping=self.slot_mapping, **common)
        if op == "decode":
            return dict(query=self.query, kv_cache=self.cache, block_table=self.table, seq_lens=self.lens, **common)
        return dict(kv_cache=self.cache, block_table=self.table, seq_lens=self.lens, **common)


_contexts = {}


@pytest.fixture
def make_ctx(build_module, device):
    def make(preset):
        if (preset, device) not in _contexts:
            config = make_config(preset)
            module = build_module(config)
            batch = paged_batch(config, SEQ_LENS, KV_HEADS, device=device,
                                generator=torch.Generator().manual_seed(11))
            cache = module.make_cache(batch.num_blocks, KV_HEADS, device)
            codebook = codebook_kwargs(module, config, device)
            module.store(batch.key, batch.value, cache, batch.slot_mapping, **codebook)
            query = torch.randn(len(SEQ_LENS), KV_HEADS * GROUP, config.head_dim,
                                generator=torch.Generator().manual_seed(12)).to(device)
            _contexts[preset, device] = Ctx(module, config, device, cache, batch.key, batch.value,
                                            batch.slot_mapping, batch.block_table, batch.seq_lens, query, codebook)
        return _contexts[preset, device]
    return make


def invoke(ctx, op, args):
    args = dict(args)
    if op == "store":
        return ctx.module.store(args.pop("key"), args.pop("value"), args.pop("kv_cache"), args.pop("slot_mapping"),
                                **args)
    if op == "decode":
        return ctx.module.decode(args.pop("query"), args.pop("kv_cache"), args.pop("block_table"),
                                 args.pop("seq_lens"), **args)
    return ctx.module.dequantize(args.pop("kv_cache"), args.pop("block_table"), args.pop("seq_lens"), **args)


def call(op, **overrides):
    """A builder: ctx -> (op, arguments), the op's valid arguments with `overrides` (functions of ctx) applied."""
    def build(ctx):
        args = ctx.defaults(op)
        for name, make in overrides.items():
            args[name] = make(ctx)
        return op, args
    return build


def with_value(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


# Shared wrong arguments (functions of ctx).
def cache_int8(c): return c.cache.view(torch.int8)
def cache_fp16(c): return c.cache_like(*c.cache.shape, dtype=torch.float16)
def cache_strided_slot(c): return c.cache_like(*c.cache.shape[:3], 2 * c.slot)[..., ::2]  # bytes 2 apart
def cache_slot_plus_one(c): return c.cache_like(*c.cache.shape[:3], c.slot + 1)
def cache_slot_minus_one(c): return c.cache_like(*c.cache.shape[:3], c.slot - 1)
def cache_page_double(c): return c.cache_like(c.num_blocks, 2 * c.page, KV_HEADS, c.slot)
def cache_page_half(c): return c.cache_like(c.num_blocks, c.page // 2, KV_HEADS, c.slot)
def cache_odd_address(c):  # fields are read 16 bits at a time: an odd start is refused
    flat = torch.zeros(c.cache.numel() + 1, dtype=torch.uint8, device=c.device)
    return flat[1:].view(c.cache.shape)
def cache_odd_stride(c):  # slots 1 byte apart from each other's ends: stride(2) = slot + 1 is odd
    flat = torch.zeros(c.cache.numel() + c.cache.shape[0] * c.page * KV_HEADS, dtype=torch.uint8, device=c.device)
    shape = c.cache.shape
    return flat.as_strided(shape, (shape[1] * shape[2] * (c.slot + 1), shape[2] * (c.slot + 1), c.slot + 1, 1))
def cache_3d(c): return c.cache[0]
def cache_5d(c): return c.cache[None]
def table_transposed(c): return c.table.t().contiguous().t()  # same values, rows not contiguous
def lens_strided(c): return torch.stack([c.lens, c.lens], 1)[:, 0]
def rotation_shape(c): return torch.eye(c.config.head_dim + 8, device=c.device)
def rotation_fp64(c): return c.codebook["rotation"].double()
def rotation_1d(c): return c.codebook["rotation"][0]
def centroids_short(c): return c.codebook["centroids"][:-1]
def centroids_fp16(c): return c.codebook["centroids"].half()
def centroids_2d(c): return c.codebook["centroids"][None]
def other_device(c): return "meta" if c.device == "cpu" else "cpu"  # a device other than the cache's


def elsewhere(name):
    """A builder: the call's tensor `name` (rotation, centroids: the codebook's) on a device other than the cache's."""
    return lambda c: (c.codebook[name] if name in c.codebook else getattr(c, name)).to(other_device(c))


def workspace_with_buffer_elsewhere(buffer):
    """A builder: a workspace that fits the call, but with one of its buffers on a device other than the cache's."""
    def make(c):
        workspace = c.module.DecodeWorkspace(len(SEQ_LENS), KV_HEADS * GROUP, 8, c.device)
        setattr(workspace, buffer, getattr(workspace, buffer).to(other_device(c)))
        return workspace
    return make


def workspace_with_buffer(buffer, make_buffer):
    """A builder: a workspace that fits the call, but with make_buffer(its buffer) in place of one of its buffers
    (an engine's own, of the wrong size, type or layout)."""
    def make(c):
        workspace = c.module.DecodeWorkspace(len(SEQ_LENS), KV_HEADS * GROUP, 8, c.device)
        setattr(workspace, buffer, make_buffer(getattr(workspace, buffer)))
        return workspace
    return make


MSE, CUDA = "mse", "cuda"  # row flags: MSE configs only; needs a CUDA cache (a CPU tensor that is right on a CPU)

# (case id, builder, expected substring of the message, flags)
ROWS = [
    # ---------------- store ----------------
    ("store-key_int8", call("store", key=lambda c: c.key.to(torch.int8)), "key", ()),
    ("store-key_float64", call("store", key=lambda c: c.key.double()), "key", ()),
    ("store-key_list", call("store", key=lambda c: c.key.tolist()), "key", ()),
    ("store-value_int8", call("store", value=lambda c: c.value.to(torch.int8)), "value", ()),
    ("store-slot_mapping_float", call("store", slot_mapping=lambda c: c.slot_mapping.float()), "slot_mapping", ()),
    ("store-slot_mapping_int16", call("store", slot_mapping=lambda c: c.slot_mapping.to(torch.int16)),
     "slot_mapping", ()),
    ("store-key_kv_heads", call("store", key=lambda c: c.key.repeat(1, 2, 1)[:, :3],
                                value=lambda c: c.value.repeat(1, 2, 1)[:, :3]), "key", ()),
    ("store-key_head_dim", call("store", key=lambda c: c.key[..., :-8], value=lambda c: c.value[..., :-8]),
     "key", ()),
    ("store-value_shape", call("store", value=lambda c: c.value[:-1]), "value", ()),
    ("store-key_2d", call("store", key=lambda c: c.key[:, 0]), "key", ()),
    ("store-slot_mapping_2d", call("store", slot_mapping=lambda c: c.slot_mapping[:, None]), "slot_mapping", ()),
    ("store-slot_mapping_short", call("store", slot_mapping=lambda c: c.slot_mapping[:-1]), "slot_mapping", ()),
    ("store-slot_beyond_cache", call("store", slot_mapping=lambda c: with_value(
        c.slot_mapping, 3, c.num_blocks * c.page)), "slot_mapping", ()),
    ("store-slot_far_beyond_cache", call("store", slot_mapping=lambda c: with_value(
        c.slot_mapping, -1, 2**40)), "slot_mapping", ()),
    ("store-rotation_shape", call("store", rotation=rotation_shape), "rotation", (MSE,)),
    ("store-rotation_float64", call("store", rotation=rotation_fp64), "rotation", (MSE,)),
    ("store-rotation_1d", call("store", rotation=rotation_1d), "rotation", (MSE,)),
    ("store-centroids_short", call("store", centroids=centroids_short), "centroids", (MSE,)),
    ("store-centroids_float16", call("store", centroids=centroids_fp16), "centroids", (MSE,)),
    ("store-centroids_2d", call("store", centroids=centroids_2d), "centroids", (MSE,)),
    ("store-centroids_descending", call("store", centroids=lambda c: c.codebook["centroids"].flip(0)), "centroids",
     (MSE,)),
    ("store-centroids_nan", call("store", centroids=lambda c: with_value(c.codebook["centroids"], 2, float("nan"))),
     "centroids", (MSE,)),
    ("store-key_elsewhere", call("store", key=elsewhere("key")), "key is on", ()),
    ("store-value_elsewhere", call("store", value=elsewhere("value")), "value is on", ()),
    ("store-slot_mapping_elsewhere", call("store", slot_mapping=elsewhere("slot_mapping")), "slot_mapping is on", ()),
    ("store-rotation_elsewhere", call("store", rotation=elsewhere("rotation")), "rotation is on", (MSE,)),
    ("store-centroids_elsewhere", call("store", centroids=elsewhere("centroids")), "centroids is on", (MSE,)),
    ("store-block_t_3", call("store", block_t=lambda c: 3), "block_t", ()),
    ("store-num_warps_3", call("store", num_warps=lambda c: 3), "num_warps", ()),
    # ---------------- decode ----------------
    ("decode-query_int32", call("decode", query=lambda c: c.query.to(torch.int32)), "query", ()),
    ("decode-query_float64", call("decode", query=lambda c: c.query.double()), "query", ()),
    ("decode-block_table_int64", call("decode", block_table=lambda c: c.table.long()), "block_table", ()),
    ("decode-block_table_float", call("decode", block_table=lambda c: c.table.float()), "block_table", ()),
    ("decode-seq_lens_int64", call("decode", seq_lens=lambda c: c.lens.long()), "seq_lens", ()),
    ("decode-cache_no_kv_heads", call("decode", kv_cache=lambda c: c.cache[:, :, :0]), "kv_cache", ()),
    ("decode-block_table_transposed", call("decode", block_table=table_transposed), "block_table", ()),
    ("decode-seq_lens_strided", call("decode", seq_lens=lens_strided), "seq_lens", ()),
    ("decode-query_heads_not_multiple", call("decode", query=lambda c: c.query[:, :7]), "query", ()),
    ("decode-query_group_too_large", call("decode", query=lambda c: c.query.repeat(1, 17, 1)), "query", ()),
    ("decode-query_head_dim", call("decode", query=lambda c: c.query[..., :-8]), "query", ()),
    ("decode-query_2d", call("decode", query=lambda c: c.query[0]), "query", ()),
    ("decode-block_table_1d", call("decode", block_table=lambda c: c.table[0]), "block_table", ()),
    ("decode-block_table_rows", call("decode", block_table=lambda c: c.table[:1]), "block_table", ()),
    ("decode-seq_lens_2d", call("decode", seq_lens=lambda c: c.lens[:, None]), "seq_lens", ()),
    ("decode-seq_lens_short", call("decode", seq_lens=lambda c: c.lens[:1]), "seq_lens", ()),
    ("decode-block_table_too_short", call("decode", block_table=lambda c: c.table[:, :1].contiguous()),
     "block_table", ()),
    ("decode-seq_lens_beyond_table", call("decode", seq_lens=lambda c: c.lens + 1000), "seq_lens", ()),
    ("decode-seq_lens_negative", call("decode", seq_lens=lambda c: with_value(c.lens, 1, -1)), "seq_lens", ()),
    ("decode-block_id_num_blocks", call("decode", block_table=lambda c: with_value(c.table, (0, 1), c.num_blocks)),
     "block_table", ()),
    ("decode-block_id_negative", call("decode", block_table=lambda c: with_value(c.table, (1, 0), -1)),
     "block_table", ()),
    ("decode-block_id_int32_max", call("decode", block_table=lambda c: with_value(c.table, (0, 0), 2**31 - 1)),
     "block_table", ()),
    ("decode-out_dtype", call("decode", out=lambda c: torch.empty(c.query.shape, dtype=torch.float16,
                                                                  device=c.device)), "out", ()),
    ("decode-out_shape", call("decode", out=lambda c: torch.empty(2, 8, 64, device=c.device)), "out", ()),
    ("decode-workspace_small", call("decode", workspace=lambda c: c.module.DecodeWorkspace(
        1, KV_HEADS * GROUP, 4, c.device), num_splits=lambda c: 2), "workspace", ()),
    ("decode-max_seq_len_negative", call("decode", max_seq_len=lambda c: -1), "max_seq_len", ()),
    ("decode-max_seq_len_inf", call("decode", max_seq_len=lambda c: float("inf")), "max_seq_len", ()),
    ("decode-max_seq_len_str", call("decode", max_seq_len=lambda c: "64"), "max_seq_len", ()),
    ("decode-max_seq_len_float_tensor", call("decode", max_seq_len=lambda c: torch.tensor(64.0)), "max_seq_len", ()),
    ("decode-num_splits_zero", call("decode", num_splits=lambda c: 0), "num_splits", ()),
    ("decode-num_stages_zero", call("decode", num_stages=lambda c: 0), "num_stages", ()),
    ("decode-num_stages_float", call("decode", num_stages=lambda c: 2.0), "num_stages", ()),
    ("decode-num_warps_3", call("decode", num_warps=lambda c: 3), "num_warps", ()),
    ("decode-num_warps_64", call("decode", num_warps=lambda c: 64), "num_warps", ()),
    ("decode-num_warps_true", call("decode", num_warps=lambda c: True), "num_warps", ()),
    # Buffers the kernels would write out of bounds or misread (the interpreter crashed on the first).
    ("decode-workspace_partial_out_short", call("decode", workspace=workspace_with_buffer(
        "partial_out", lambda b: b[:1].clone())), "workspace.partial_out", ()),
    ("decode-workspace_partial_out_strided", call("decode", workspace=workspace_with_buffer(
        "partial_out", lambda b: torch.empty_like(b).transpose(0, 1).contiguous().transpose(0, 1))),
     "workspace.partial_out", ()),
    ("decode-workspace_partial_lse_fp16", call("decode", workspace=workspace_with_buffer(
        "partial_lse", lambda b: b.half())), "workspace.partial_out and partial_lse", ()),
    ("decode-workspace_partial_lse_none", call("decode", workspace=workspace_with_buffer(
        "partial_lse", lambda b: None)), "workspace.partial_lse is NoneType", ()),
    ("decode-workspace_query_short", call("decode", workspace=workspace_with_buffer(
        "query", lambda b: b[:1].clone())), "workspace.query", (MSE,)),
    ("decode-workspace_query_float32", call("decode", workspace=workspace_with_buffer(
        "query", lambda b: b.float())), "workspace.query", (MSE,)),
    ("decode-block_kv_16", call("decode", block_kv=lambda c: 16), "block_kv", ()),
    ("decode-scale_tensor", call("decode", scale=lambda c: torch.tensor(0.1, device=c.device)), "scale", ()),
    ("decode-scale_str", call("decode", scale=lambda c: "0.1"), "scale", ()),
    ("decode-rotation_shape", call("decode", rotation=rotation_shape), "rotation", (MSE,)),
    ("decode-rotation_float64", call("decode", rotation=rotation_fp64), "rotation", (MSE,)),
    ("decode-centroids_short", call("decode", centroids=centroids_short), "centroids", (MSE,)),
    ("decode-centroids_float16", call("decode", centroids=centroids_fp16), "centroids", (MSE,)),
    ("decode-query_elsewhere", call("decode", query=elsewhere("query")), "query is on", ()),
    ("decode-block_table_elsewhere", call("decode", block_table=elsewhere("table")), "block_table is on", ()),
    ("decode-seq_lens_elsewhere", call("decode", seq_lens=elsewhere("lens")), "seq_lens is on", ()),
    ("decode-out_on_cpu", call("decode", out=lambda c: torch.empty(c.query.shape)), "out", (CUDA,)),
    ("decode-workspace_other_device", call("decode", workspace=lambda c: c.module.DecodeWorkspace(
        4, KV_HEADS * GROUP, 8, other_device(c))), "workspace", ()),
    ("decode-out_other_device", call("decode", out=lambda c: torch.empty(c.query.shape, device="meta")), "out", ()),
    ("decode-workspace_partial_lse_elsewhere", call("decode", workspace=workspace_with_buffer_elsewhere("partial_lse")),
     "workspace.partial_lse is on", ()),
    ("decode-workspace_query_elsewhere", call("decode", workspace=workspace_with_buffer_elsewhere("query")),
     "workspace.query is on", (MSE,)),
    ("decode-rotation_elsewhere", call("decode", rotation=elsewhere("rotation")), "rotation is on", (MSE,)),
    ("decode-centroids_elsewhere", call("decode", centroids=elsewhere("centroids")), "centroids is on", (MSE,)),
    # ---------------- dequantize ----------------
    ("dequantize-block_table_int64", call("dequantize", block_table=lambda c: c.table.long()), "block_table", ()),
    ("dequantize-seq_lens_int64", call("dequantize", seq_lens=lambda c: c.lens.long()), "seq_lens", ()),
    ("dequantize-seq_lens_float", call("dequantize", seq_lens=lambda c: c.lens.float()), "seq_lens", ()),
    ("dequantize-block_table_transposed", call("dequantize", block_table=table_transposed), "block_table", ()),
    ("dequantize-seq_lens_strided", call("dequantize", seq_lens=lens_strided), "seq_lens", ()),
    ("dequantize-block_table_0d", call("dequantize", block_table=lambda c: c.table[0, 0]), "block_table", ()),
    ("dequantize-block_table_1d", call("dequantize", block_table=lambda c: c.table[0]), "block_table", ()),
    ("dequantize-block_table_3d", call("dequantize", block_table=lambda c: c.table[None]), "block_table", ()),
    ("dequantize-block_table_list", call("dequantize", block_table=lambda c: c.table.tolist()), "block_table", ()),
    ("dequantize-seq_lens_2d", call("dequantize", seq_lens=lambda c: c.lens[:, None]), "seq_lens", ()),
    ("dequantize-seq_lens_short", call("dequantize", seq_lens=lambda c: c.lens[:1]), "seq_lens", ()),
    ("dequantize-block_table_too_short", call("dequantize", block_table=lambda c: c.table[:, :1].contiguous()),
     "block_table", ()),
    ("dequantize-seq_lens_beyond_table", call("dequantize", seq_lens=lambda c: c.lens + 1000), "seq_lens", ()),
    ("dequantize-seq_lens_negative", call("dequantize", seq_lens=lambda c: with_value(c.lens, 0, -3)),
     "seq_lens", ()),
    ("dequantize-block_id_num_blocks", call("dequantize", block_table=lambda c: with_value(
        c.table, (0, 1), c.num_blocks)), "block_table", ()),
    ("dequantize-block_id_negative", call("dequantize", block_table=lambda c: with_value(c.table, (1, 0), -5)),
     "block_table", ()),
    ("dequantize-max_len_negative", call("dequantize", max_len=lambda c: -1), "max_len", ()),
    ("dequantize-max_len_float", call("dequantize", max_len=lambda c: 20.0), "max_len", ()),
    ("dequantize-max_len_bool", call("dequantize", max_len=lambda c: True), "max_len", ()),  # was taken as 1
    ("dequantize-dtype_int32", call("dequantize", dtype=lambda c: torch.int32), "dtype", ()),
    ("dequantize-block_t_0", call("dequantize", block_t=lambda c: 0), "block_t", ()),
    ("dequantize-block_t_48", call("dequantize", block_t=lambda c: 48), "block_t", ()),
    ("dequantize-num_warps_0", call("dequantize", num_warps=lambda c: 0), "num_warps", ()),
    ("dequantize-rotation_shape", call("dequantize", rotation=rotation_shape), "rotation", (MSE,)),
    ("dequantize-rotation_1d", call("dequantize", rotation=rotation_1d), "rotation", (MSE,)),
    ("dequantize-centroids_2d", call("dequantize", centroids=centroids_2d), "centroids", (MSE,)),
    ("dequantize-centroids_float16", call("dequantize", centroids=centroids_fp16), "centroids", (MSE,)),
    ("dequantize-block_table_elsewhere", call("dequantize", block_table=elsewhere("table")), "block_table is on", ()),
    ("dequantize-seq_lens_elsewhere", call("dequantize", seq_lens=elsewhere("lens")), "seq_lens is on", ()),
    ("dequantize-rotation_elsewhere", call("dequantize", rotation=elsewhere("rotation")), "rotation is on", (MSE,)),
    ("dequantize-centroids_elsewhere", call("dequantize", centroids=elsewhere("centroids")), "centroids is on",
     (MSE,)),
]
# Every launcher checks the cache through the same function (_check_cache): the same wrong caches for each.
WRONG_CACHES = {
    "cache_int8": (cache_int8, "kv_cache"),
    "cache_float16": (cache_fp16, "kv_cache"),
    "cache_strided_slot": (cache_strided_slot, "kv_cache"),
    "cache_slot_plus_one": (cache_slot_plus_one, "kv_cache"),
    "cache_slot_minus_one": (cache_slot_minus_one, "kv_cache"),
    "cache_page_double": (cache_page_double, "kv_cache"),
    "cache_page_half": (cache_page_half, "kv_cache"),
    "cache_odd_address": (cache_odd_address, "even address"),
    "cache_odd_stride": (cache_odd_stride, "even strides"),
    "cache_3d": (cache_3d, "kv_cache"),
    "cache_5d": (cache_5d, "kv_cache"),
}
ROWS += [(f"{op}-{name}", call(op, kv_cache=make), expected, ())
         for op in ("store", "decode", "dequantize") for name, (make, expected) in WRONG_CACHES.items()]
assert len({row[0] for row in ROWS}) == len(ROWS), "duplicate case ids"
MATRIX = [pytest.param(preset, builder, expected, flags, id=f"{preset}-{case_id}")
          for preset in PRESETS for case_id, builder, expected, flags in ROWS
          if not (MSE in flags and make_config(preset).key_format != "mse")]


@pytest.mark.parametrize("preset, builder, expected, flags", MATRIX)
def test_wrong_call_is_refused_and_leaves_the_cache_alone(make_ctx, device, preset, builder, expected, flags):
    if CUDA in flags and device != "cuda":
        pytest.skip("mixing a CPU tensor with the cache needs a CUDA cache")
    ctx = make_ctx(preset)
    op, args = builder(ctx)
    caches = [ctx.cache] + [t for t in (args["kv_cache"],) if t is not ctx.cache and isinstance(t, torch.Tensor)]
    before = [t.clone() for t in caches]
    with pytest.raises(ctx.module.LaunchError) as caught:
        invoke(ctx, op, args)
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert message.startswith(f"{op}: "), message
    assert expected in message, f"{expected!r} not named in {message!r}"
    assert "\n" not in message
    for tensor, snapshot in zip(caches, before):
        assert torch.equal(tensor, snapshot), "a refused call changed the cache"


@pytest.mark.parametrize("num_blocks, num_kv_heads, named", [(-1, 2, "num_blocks"), (4, -2, "num_kv_heads"),
                                                             (2.5, 2, "num_blocks")])
def test_make_cache_refuses_bad_sizes_in_one_line(build_module, num_blocks, num_kv_heads, named):
    module = build_module(make_config("k3v4"))
    with pytest.raises(module.LaunchError, match=f"make_cache: {named}"):
        module.make_cache(num_blocks, num_kv_heads, "cpu")


@pytest.mark.parametrize("sizes, max_q_len, named", [((2, 8, 0), 1, "max_splits must be a positive int"),
                                                     ((2, 8, 4), 0, "max_q_len must be a positive int"),
                                                     ((-1, 8, 4), 1, "max_batch must be a non-negative int"),
                                                     ((2, -8, 4), 1, "num_q_heads"), ((2, 8, 4.0), 1, "max_splits")])
def test_a_workspace_refuses_bad_sizes_in_one_line(build_module, sizes, max_q_len, named):
    """max_splits 0 was taken, and each decode with it refused as a num_splits of 0 the call never passed; a negative
    size failed in torch.empty without naming it."""
    module = build_module(make_config("k3v4"))
    with pytest.raises(module.LaunchError, match=f"^DecodeWorkspace: {named}"):
        module.DecodeWorkspace(*sizes, device="cpu", max_q_len=max_q_len)
    module.DecodeWorkspace(0, 8, 1, "cpu")  # no sequence yet (vllm.py's placeholder): taken


@pytest.mark.parametrize("preset", PRESETS)
def test_a_workspace_buffer_replaced_after_a_call_is_checked_again(make_ctx, device, preset):
    """decode keeps its checks of a workspace's buffers for the buffer objects it checked: a buffer replaced by a
    short one later must be refused, not written out of bounds; a larger call than the checked one too."""
    ctx = make_ctx(preset)
    workspace = ctx.module.DecodeWorkspace(len(SEQ_LENS), KV_HEADS * GROUP, 8, device)
    want = ctx.module.decode(ctx.query, ctx.cache, ctx.table, ctx.lens, **ctx.codebook, num_splits=2)
    got = ctx.module.decode(ctx.query, ctx.cache, ctx.table, ctx.lens, **ctx.codebook, workspace=workspace,
                            num_splits=2)
    assert torch.equal(got, want)
    workspace.partial_out = workspace.partial_out[:, :, :1].clone()
    with pytest.raises(ctx.module.LaunchError, match="workspace.partial_out"):
        ctx.module.decode(ctx.query, ctx.cache, ctx.table, ctx.lens, **ctx.codebook, workspace=workspace,
                          num_splits=2)
    # Both buffers of one split: a call of one split fits them; the next call of two is refused.
    workspace.partial_lse = workspace.partial_lse[:, :, :1].clone()
    workspace.max_splits = 8  # an engine's sizes that overstate its buffers
    ctx.module.decode(ctx.query, ctx.cache, ctx.table, ctx.lens, **ctx.codebook, workspace=workspace, num_splits=1)
    with pytest.raises(ctx.module.LaunchError, match="workspace.partial_out"):
        ctx.module.decode(ctx.query, ctx.cache, ctx.table, ctx.lens, **ctx.codebook, workspace=workspace,
                          num_splits=2)


# --------------------------------------------------------------------------
# Edge cases that must not raise
# --------------------------------------------------------------------------
def _decode(ctx, table, lens, query=None, **launch):
    query = ctx.query[: table.shape[0]] if query is None else query
    return ctx.module.decode(query, ctx.cache, table, lens, **ctx.codebook, **launch)


def _reference_decode(ctx, table, lens, query=None):
    query = ctx.query[: table.shape[0]] if query is None else query
    return reference.decode(Layout.from_config(ctx.config), query, ctx.cache, table, lens, ctx.codebook.get("rotation"),
                            ctx.codebook.get("centroids"))


@pytest.mark.parametrize("preset", PRESETS)
def test_empty_batch(make_ctx, device, preset):
    ctx = make_ctx(preset)
    before = ctx.cache.clone()
    for width in (0, 3):
        table = torch.zeros(0, width, dtype=torch.int32, device=device)
        lens = torch.zeros(0, dtype=torch.int32, device=device)
        out = ctx.module.decode(torch.zeros(0, KV_HEADS * GROUP, ctx.config.head_dim, device=device), ctx.cache,
                                table, lens, **ctx.codebook)
        assert out.shape == (0, KV_HEADS * GROUP, ctx.config.head_dim)
        keys, values = ctx.module.dequantize(ctx.cache, table, lens, **ctx.codebook)
        assert keys.shape == values.shape == (0, KV_HEADS, 0, ctx.config.head_dim)
    assert torch.equal(ctx.cache, before)


@pytest.mark.parametrize("preset", PRESETS)
def test_store_of_zero_tokens_and_skipped_slots_writes_nothing(make_ctx, device, preset):
    ctx = make_ctx(preset)
    before = ctx.cache.clone()
    empty = ctx.key[:0]
    for dtype in (torch.int64, torch.int32):
        ctx.module.store(empty, empty, ctx.cache, torch.zeros(0, dtype=dtype, device=device), **ctx.codebook)
    # Negative slots are skipped, however negative.
    skipped = torch.tensor([-1, -2, -(2**40)], device=device)[torch.arange(ctx.key.shape[0]) % 3]
    ctx.module.store(ctx.key, ctx.value * 3, ctx.cache, skipped, **ctx.codebook)
    assert torch.equal(ctx.cache, before)


@pytest.mark.parametrize("preset", PRESETS)
def test_store_accepts_int32_slots_and_strided_inputs(make_ctx, device, preset):
    ctx = make_ctx(preset)
    reference_cache = ctx.module.make_cache(ctx.num_blocks, KV_HEADS, device)
    ctx.module.store(ctx.key, ctx.value, reference_cache, ctx.slot_mapping, **ctx.codebook)
    # Every head dim is 2 elements apart, and the cache is a view of every other block.
    wide_key = torch.zeros(*ctx.key.shape[:2], 2 * ctx.config.head_dim, dtype=ctx.key.dtype, device=device)
    wide_key[..., ::2] = ctx.key
    wide_value = torch.zeros_like(wide_key)
    wide_value[..., ::2] = ctx.value
    big = ctx.module.make_cache(2 * ctx.num_blocks, KV_HEADS, device)
    ctx.module.store(wide_key[..., ::2], wide_value[..., ::2], big[::2], ctx.slot_mapping.to(torch.int32),
                     **ctx.codebook)
    assert torch.equal(big[::2], reference_cache)
    assert not big[1::2].any(), "store wrote outside the view it was given"


@pytest.mark.parametrize("preset", PRESETS)
def test_store_refuses_a_cache_of_2_to_the_31_slots_per_head(make_ctx, device, preset):
    """The kernel takes a slot's block and position in 32-bit arithmetic: a cache with more slots per head is
    refused by its shape alone (a view of one block with stride 0 stands in for a cache no machine holds)."""
    ctx = make_ctx(preset)
    shape = (2**31 // ctx.config.block_size, *ctx.cache.shape[1:])
    huge = ctx.cache[:1].expand(shape)
    message = r"kv_cache has 2147483648 slots per head, more than the 2\*\*31 - 1"
    with pytest.raises(ctx.module.LaunchError, match=message):
        ctx.module.store(ctx.key, ctx.value, huge, ctx.slot_mapping, **ctx.codebook)


@pytest.mark.parametrize("layout", ["slots", "planes"])
def test_store_refuses_unsorted_centroids_and_takes_a_sorted_copy(device, build_module, layout):
    """Keys are coded by the midpoints between neighbouring centroids, so unsorted centroids would write
    wrong codes: validate=True refuses them, naming the first pair out of order, and writes nothing.
    A sorted tensor other than the default one is checked and accepted: the same bytes as the default."""
    config = make_config("k3v4") if layout == "slots" else planes_config("k3v4")
    module = build_module(config)
    batch = paged_batch(config, SEQ_LENS, KV_HEADS, device=device, generator=torch.Generator().manual_seed(5))
    rotation = module.default_rotation(device)
    sorted_copy = module.default_centroids(device).clone()
    swapped = sorted_copy[[0, 1, 2, 4, 3, 5, 6, 7]]
    cache = module.make_cache(batch.num_blocks, KV_HEADS, device)
    with pytest.raises(module.LaunchError, match=r"^store: centroids must be sorted ascending, got centroids\[3\] = "):
        module.store(batch.key, batch.value, cache, batch.slot_mapping, rotation=rotation, centroids=swapped)
    assert not cache.any(), "a refused store wrote to the cache"
    module.store(batch.key, batch.value, cache, batch.slot_mapping, rotation=rotation, centroids=sorted_copy)
    default = module.make_cache(batch.num_blocks, KV_HEADS, device)
    module.store(batch.key, batch.value, default, batch.slot_mapping)
    assert cache.any() and torch.equal(cache, default)


@pytest.mark.parametrize("preset", PRESETS)
def test_seq_len_zero_entries(make_ctx, device, preset):
    ctx = make_ctx(preset)
    lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    out = _decode(ctx, ctx.table, lens, num_splits=3)
    assert torch.isfinite(out).all()
    assert torch.all(out[0] == 0) and not torch.all(out[1] == 0)
    keys, values = ctx.module.dequantize(ctx.cache, ctx.table, lens, **ctx.codebook)
    assert keys.shape[2] == 5 and torch.all(keys[0] == 0) and torch.all(values[0] == 0)
    none = torch.zeros(2, dtype=torch.int32, device=device)
    assert torch.all(_decode(ctx, ctx.table, none) == 0)
    keys, _ = ctx.module.dequantize(ctx.cache, ctx.table, none, **ctx.codebook)
    assert keys.shape == (2, KV_HEADS, 0, ctx.config.head_dim)


@pytest.mark.parametrize("preset", PRESETS)
def test_validate_false_with_negative_seq_lens(make_ctx, device, preset):
    """With validate=False a negative seq_len is an empty sequence: dequantize gives it zeros, and max_len
    defaults to the longest of the others (it refused the call, naming a max_len the caller never passed)."""
    ctx = make_ctx(preset)
    lens = torch.tensor([-3, 5], dtype=torch.int32, device=device)
    keys, values = ctx.module.dequantize(ctx.cache, ctx.table, lens, validate=False, **ctx.codebook)
    good, good_values = ctx.module.dequantize(ctx.cache, ctx.table, ctx.lens, max_len=5, **ctx.codebook)
    assert keys.shape[2] == 5 and torch.all(keys[0] == 0) and torch.all(values[0] == 0)
    assert torch.equal(keys[1], good[1]) and torch.equal(values[1], good_values[1])
    keys, _ = ctx.module.dequantize(ctx.cache, ctx.table, -lens.abs(), validate=False, **ctx.codebook)
    assert keys.shape == (2, KV_HEADS, 0, ctx.config.head_dim)


@pytest.mark.parametrize("preset", PRESETS)
def test_unused_block_table_columns_of_minus_one(make_ctx, device, preset):
    """Columns past each sequence's pages hold -1 (also with validate=True): same result as a trimmed table."""
    ctx = make_ctx(preset)
    trimmed = ctx.table[:, :2].contiguous()
    padded = torch.full((2, 9), -1, dtype=torch.int32, device=device)
    padded[:, :2] = trimmed
    padded[1, 1] = -1  # sequence 1 (5 tokens) uses one page
    for validate in (True, False):
        a = _decode(ctx, padded, ctx.lens, num_splits=2, validate=validate)
        b = _decode(ctx, trimmed, ctx.lens, num_splits=2, validate=validate)
        assert torch.equal(a, b)
        ka, va = ctx.module.dequantize(ctx.cache, padded, ctx.lens, validate=validate, **ctx.codebook)
        kb, vb = ctx.module.dequantize(ctx.cache, trimmed, ctx.lens, validate=validate, **ctx.codebook)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    want = _reference_decode(ctx, trimmed, ctx.lens)
    assert relative_error(a, want) < DECODE_TOLERANCE[torch.float32]


# A split whose every token is masked (block ids outside the cache, validate=False) ends with a running
# sum of 0, and stage 1 stores where(running_sum > 0, running_max + log2(running_sum), -inf). Triton's
# interpreter computes log2 on every lane with numpy, which warns "divide by zero" for that lane before
# tl.where discards it (a GPU gives -inf silently); the tests below check that the output is finite and
# right. Only these tests mask whole splits, so only they expect the warning. (log2 of
# where(running_sum > 0, running_sum, 1) would avoid it, but would change the decode kernels, their
# hash, and so drop every tuned launch, for a warning of the interpreter.)
masked_split_log2 = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
BAD_BLOCK_IDS = [pytest.param(lambda n: n, id="num_blocks"), pytest.param(lambda n: 2**31 - 1, id="int32_max"),
                 pytest.param(lambda n: -1, id="minus_one"), pytest.param(lambda n: -(2**31), id="int32_min")]


@masked_split_log2
@pytest.mark.parametrize("bad_id", BAD_BLOCK_IDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_validate_false_with_block_ids_outside_the_cache(make_ctx, device, preset, bad_id):
    """The kernels mask such tokens: no crash, finite output, masked positions dequantize to zero."""
    ctx = make_ctx(preset)
    before = ctx.cache.clone()
    table = with_value(ctx.table, (0, 0), bad_id(ctx.num_blocks))  # sequence 0: first page bad, second good
    table[1, 0] = bad_id(ctx.num_blocks)  # sequence 1: its only page bad
    for num_splits in (1, 4):
        out = _decode(ctx, table, ctx.lens, num_splits=num_splits, validate=False)
        assert torch.isfinite(out).all()
    with pytest.raises(ctx.module.LaunchError, match="block_table"):
        _decode(ctx, table, ctx.lens)
    keys, values = ctx.module.dequantize(ctx.cache, table, ctx.lens, validate=False, **ctx.codebook)
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert torch.all(keys[0, :, :16] == 0) and torch.all(values[1] == 0)
    good, _ = ctx.module.dequantize(ctx.cache, ctx.table, ctx.lens, **ctx.codebook)
    assert torch.equal(keys[0, :, 16:], good[0, :, 16:])
    assert torch.equal(ctx.cache, before)


@masked_split_log2
@pytest.mark.parametrize("preset", PRESETS)
def test_validate_false_masked_pages_leave_attention_over_the_remaining_tokens(make_ctx, device, preset):
    """launchers: "the result for such a sequence is then attention over the tokens that remain".

    Sequence 0 holds 20 tokens on pages [bad, good]: its result must be attention
    over tokens 16..19, whether or not a whole KV tile (32 tokens here) is masked.
    """
    ctx = make_ctx(preset)
    table = ctx.table[:1, :2].contiguous()
    remaining = _reference_decode(ctx, table[:, 1:].contiguous(), torch.tensor([4], dtype=torch.int32,
                                                                              device=device))
    # Two pages of 16 = one 32-token tile (its first half masked); then 4 tokens per page
    # shifted right by 48 so that the first 32-token tile is entirely masked.
    for bad_pages, length in ((1, 20), (3, 52)):
        padded = torch.full((1, bad_pages + 1), ctx.num_blocks + 7, dtype=torch.int32, device=device)
        padded[0, bad_pages] = table[0, 1]
        shifted = torch.tensor([length], dtype=torch.int32, device=device)
        for num_splits in (1, 2):
            out = _decode(ctx, padded, shifted, num_splits=num_splits, block_kv=32, validate=False)
            assert torch.isfinite(out).all()
            error = relative_error(out, remaining)
            assert error < DECODE_TOLERANCE[torch.float32], (
                f"{bad_pages} masked page(s), {num_splits} split(s): relative error {error:.2e} "
                f"against attention over the 4 remaining tokens")


@pytest.mark.parametrize("preset", PRESETS)
def test_validate_false_seq_lens_past_the_table_are_cut_at_the_table(make_ctx, device, preset):
    ctx = make_ctx(preset)
    table = ctx.table[:, :2].contiguous()
    capacity = table.shape[1] * ctx.page
    long = torch.tensor([20 + 1000, 5], dtype=torch.int32, device=device)
    out = _decode(ctx, table, long, num_splits=2, validate=False)
    cut = _decode(ctx, table, torch.tensor([capacity, 5], dtype=torch.int32, device=device), num_splits=2)
    assert torch.isfinite(out).all() and torch.equal(out, cut)


def test_old_triton_interpreters_read_scalar_indices_whatever_numpy(build_module, monkeypatch):
    """Triton's interpreter before 3.8 read a scalar tensor's index with int(data), which numpy >= 2.4
    refuses for the 1-element arrays it keeps scalars in; the module wraps that patch on those
    versions only, once, so loops over loaded bounds run on the CPU."""
    import numpy as np
    from triton.runtime import interpreter

    module = build_module(make_config("k3v4"))
    patched = []

    def original(tensor, scope):
        patched.append(tensor)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    class Scalar:  # what the interpreter holds a loaded scalar in
        class handle:
            data = np.array([7])

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", original, raising=False)
    monkeypatch.setattr(module.triton, "__version__", "3.8.0")
    module._fix_interpreter_index()
    assert interpreter._patch_lang_tensor is original
    monkeypatch.setattr(module.triton, "__version__", "3.6.0")
    module._fix_interpreter_index()
    wrapped = interpreter._patch_lang_tensor
    module._fix_interpreter_index()  # another module's import does not wrap it twice
    assert interpreter._patch_lang_tensor is wrapped is not original
    wrapped(Scalar, Scope())
    assert patched == [Scalar] and len(range(Scalar())) == 7


# --- the page-planar layout ("planes") ---------------------------------------------------------
def test_launchers_refuse_a_cache_they_cannot_read(device, build_module):
    config = planes_config("k3v4")
    module = build_module(config)
    batch, cache = stored_cache(module, config, [5], device)
    kwargs = codebook_kwargs(module, config, device)
    query = torch.randn(1, 8, 128, device=device)
    slots_shaped = torch.zeros(cache.shape[0], 16, 2, module.SLOT_BYTES, dtype=torch.uint8, device=device)
    with pytest.raises(module.LaunchError, match=r"kv_cache must be \[num_blocks, num_kv_heads, 1888\] "
                                                 r"\(this module's cache_layout is planes"):
        module.decode(query, slots_shaped, batch.block_table, batch.seq_lens, **kwargs)
    with pytest.raises(module.LaunchError, match=r"pages are 1880 bytes \(dim 2\).*1888 bytes"):
        module.decode(query, cache[..., :1880], batch.block_table, batch.seq_lens, **kwargs)
    shifted = torch.zeros(cache.numel() + 8, dtype=torch.uint8, device=device)[8:].view(cache.shape)
    with pytest.raises(module.LaunchError, match=r"16-byte aligned address .*\(address % 16 = 8,"):
        module.store(batch.key, batch.value, shifted, batch.slot_mapping, **kwargs)
    padded = torch.zeros(cache.shape[0], 2, module.PAGE_BYTES + 8, dtype=torch.uint8, device=device)
    with pytest.raises(module.LaunchError, match="multiples of 16 bytes"):
        module.dequantize(padded[..., : module.PAGE_BYTES], batch.block_table, batch.seq_lens, **kwargs)
    strided = torch.zeros(cache.shape[0], 2, 2 * module.PAGE_BYTES, dtype=torch.uint8, device=device)[..., ::2]
    with pytest.raises(module.LaunchError, match=r"contiguous within a page \(stride\(2\) == 1\)"):
        module.decode(query, strided, batch.block_table, batch.seq_lens, **kwargs)
    assert tuple(module.make_cache(3, 2, device).shape) == (3, 2, module.PAGE_BYTES)


def test_a_slots_module_names_its_layout_for_a_planes_cache(device, build_module):
    slots = make_config("k8v4")
    module = build_module(slots)
    planes_cache = torch.zeros(4, 2, 16 * module.SLOT_BYTES, dtype=torch.uint8, device=device)
    table, lens = torch.zeros(1, 1, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(module.LaunchError, match=r"kv_cache must be \[num_blocks, 16, num_kv_heads, 196\] "
                                                 r"\(this module's cache_layout is slots\)"):
        module.dequantize(planes_cache, table, lens)


# --- TRITON_INTERPRET set too late ----------------------------------------------------------
LATE_INTERPRETER = textwrap.dedent("""
    import os, sys, torch, tqgen
    if sys.argv[1] == "triton-first":  # triton imported, then the variable set, then the module imported
        import triton
        os.environ["TRITON_INTERPRET"] = "1"
    module = tqgen.load(sys.argv[2], sys.argv[3])
    if sys.argv[1] == "after-import":  # the module (and triton) imported, then the variable set
        os.environ["TRITON_INTERPRET"] = "1"
    cache = module.make_cache(4, 2, "cpu")
    key = torch.randn(3, 2, module.HEAD_DIM)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for call in (lambda: module.store(key, key, cache, torch.arange(3)),
                 lambda: module.decode(torch.randn(1, 2, module.HEAD_DIM), cache, table, lens),
                 lambda: module.dequantize(cache, table, lens)):
        try:
            call()
        except module.LaunchError as exc:
            print(exc)
        else:
            print("ran")
""")


@pytest.mark.parametrize("when, expected", [
    ("after-import", "TRITON_INTERPRET=1 was set after triton was imported"),
    ("triton-first", "TRITON_INTERPRET=1 was set after triton was imported"),
    ("never", "CPU tensors need Triton's interpreter"),
])
def test_cpu_tensors_without_the_interpreter_at_import_get_one_line(tmp_path, when, expected):
    """Triton fixes interpreter or compiler per function when it defines it (its library at import), so
    TRITON_INTERPRET=1 set later used to pass the module's check and fail inside triton ("0 active
    drivers"). Every launcher now refuses the call, saying to set the variable before Python starts."""
    repo = Path(__file__).resolve().parent.parent
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(repo)
    result = subprocess.run([sys.executable, "-c", LATE_INTERPRETER, when, str(repo / "configs/k3v4-d128.yaml"),
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(": ")[0] for line in lines] == ["store", "decode", "dequantize"], result.stdout
    hint = "set TRITON_INTERPRET=1 in the environment before Python starts (before triton is imported)"
    assert all(expected in line and line.endswith(hint) for line in lines), result.stdout


@pytest.mark.parametrize("preset, symmetric", [("k3v4", False), ("k4v4", True)])
def test_a_first_call_inside_a_cuda_graph_capture_makes_no_default_codebook(build_module, monkeypatch, preset,
                                                                             symmetric):
    """default_rotation and default_centroids are made once per device, by a host copy. A capture would record that
    copy and run none of it, so a device's first call inside one (before any warm-up call) is refused in one line
    naming what it needs, and a call passing its own codebook makes no default: it is not compared with one that
    does not exist. 4-bit keys' decode compares its centroids with the default ones whatever a call passes (its
    symmetric lookup), so there the default centroids are needed, and refused, either way. Here the capture is a
    stand-in (_capturing_on), on the CPU."""
    config = make_config(preset)
    assert Plan.from_config(config).symmetric_key_lookup == symmetric
    module = build_module(config)
    own = dict(rotation=module.default_rotation("cpu").clone(), centroids=module.default_centroids("cpu").clone())
    batch, cache = stored_cache(module, config, SEQ_LENS, "cpu", codebook=own)
    query = torch.randn(len(SEQ_LENS), KV_HEADS * GROUP, config.head_dim, generator=torch.Generator().manual_seed(3))
    expected = module.decode(query, cache, batch.block_table, batch.seq_lens, **own)
    monkeypatch.setattr(module, "_per_device", {})  # nothing made for any device yet
    monkeypatch.setattr(module, "_capturing_on", lambda device: True)
    first_needed = "is first needed inside a CUDA-graph capture, which cannot make it: make one call on cpu before"
    for call in (lambda: module.decode(query, cache, batch.block_table, batch.seq_lens),
                 lambda: module.store(batch.key, batch.value, cache.clone(), batch.slot_mapping),
                 lambda: module.dequantize(cache, batch.block_table, batch.seq_lens)):
        with pytest.raises(module.LaunchError, match=f"the default rotation for cpu {first_needed}"):
            call()
    if symmetric:
        with pytest.raises(module.LaunchError, match=f"decode: the default centroids for cpu {first_needed}"):
            module.decode(query, cache, batch.block_table, batch.seq_lens, **own)
    else:
        out = module.decode(query, cache, batch.block_table, batch.seq_lens, **own)
        assert torch.equal(out, expected)
    assert not module._per_device.get(("rotation", "cpu")) and not module._per_device.get(("centroids", "cpu"))


def test_a_workspace_built_inside_a_cuda_graph_capture_is_refused(build_module, monkeypatch):
    """A DecodeWorkspace's split counters must be zeros before its first call: made inside a capture they are a
    recorded memset, zeros only once the graph replays, so building one there is refused in one line (an empty one
    has none to zero). Here the capture is a stand-in (_capturing_on), on the CPU; outside it the same workspace is
    built with zeros."""
    module = build_module(make_config("k3v4"))
    monkeypatch.setattr(module, "_capturing_on", lambda device: True)
    with pytest.raises(module.LaunchError, match="DecodeWorkspace: built inside a CUDA-graph capture"):
        module.DecodeWorkspace(2, KV_HEADS * GROUP, 4, "cpu")
    assert module.DecodeWorkspace(0, KV_HEADS * GROUP, 4, "cpu").split_counters.numel() == 0  # no counter to zero
    monkeypatch.setattr(module, "_capturing_on", lambda device: False)
    assert not module.DecodeWorkspace(2, KV_HEADS * GROUP, 4, "cpu").split_counters.any()


@pytest.mark.parametrize("preset", ["k3v4", "k4v4"])
def test_calls_passing_their_own_codebook_inside_a_cuda_graph_capture_need_no_default(build_module, monkeypatch,
                                                                                     preset):
    """Only decode's symmetric lookup of 4-bit keys (decode's kernels, which decode_multi runs at q_len 1) compares a
    call's centroids with the default ones: store, dequantize and decode_multi over several query tokens never look
    at them when a call passes its own codebook. A device's first such call inside a capture is then not refused,
    and makes no default. Here the capture is a stand-in (_capturing_on), on the CPU."""
    config = make_config(preset)
    module = build_module(config)
    own = dict(rotation=module.default_rotation("cpu").clone(), centroids=module.default_centroids("cpu").clone())
    batch, cache = stored_cache(module, config, SEQ_LENS, "cpu", codebook=own)
    query = torch.randn(len(SEQ_LENS), 2, KV_HEADS * GROUP, config.head_dim,
                        generator=torch.Generator().manual_seed(3))
    expected_keys, expected_values = module.dequantize(cache, batch.block_table, batch.seq_lens, **own)
    expected_multi = module.decode_multi(query, cache, batch.block_table, batch.seq_lens, **own)
    monkeypatch.setattr(module, "_per_device", {})  # nothing made for any device yet
    monkeypatch.setattr(module, "_capturing_on", lambda device: True)
    stored = module.make_cache(batch.num_blocks, KV_HEADS, "cpu")
    module.store(batch.key, batch.value, stored, batch.slot_mapping, **own)
    assert torch.equal(stored, cache)
    keys, values = module.dequantize(cache, batch.block_table, batch.seq_lens, **own)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert torch.equal(module.decode_multi(query, cache, batch.block_table, batch.seq_lens, **own), expected_multi)
    assert not [key for key in module._per_device if key[0] in ("rotation", "centroids")]
