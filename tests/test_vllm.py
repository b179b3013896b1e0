"""tqgen.vllm: the drop-ins for vLLM's TurboQuant kernels, called as vLLM's backend calls them.

Caches are vLLM's: allocated head-major `(num_blocks, num_kv_heads, block_size, slot)` and passed
transposed (what the backend does), or position-major. Results are compared with tqgen's float64
reference, on caches the drop-in store wrote and on caches this file builds byte by byte from
docs/format.md's rules. The CPU cases are a few representative combinations (Triton's interpreter
is slow); the full matrix runs on the GPU (`pytest -m gpu`).
"""

import gc
import math
import types
import weakref

import numpy as np
import pytest
import torch

from conftest import HAS_CUDA, INTERPRET, make_config
from tqgen import codebook, emit, reference, vllm
from tqgen.layout import Layout
from tqgen.testing import DECODE_TOLERANCE, relative_error, store_differences

TQGEN_PRESET = {"turboquant_k8v4": "k8v4", "turboquant_4bit_nc": "k4v4", "turboquant_k3v4_nc": "k3v4",
                "turboquant_3bit_nc": "k3v3"}
SENTINEL = 0xA5
CPU = [pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")]
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]


@pytest.fixture(scope="module", autouse=True)
def module_cache_dir(tmp_path_factory):
    """The drop-ins write their modules into TQGEN_CACHE_DIR: a fresh folder, not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TQGEN_CACHE_DIR", str(tmp_path_factory.mktemp("vllm-modules")))
        yield


# --- docs/format.md, written out here (not tqgen's store or reference) --------------------------
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Element i of a b-bit field holds bits i*b .. i*b+b-1 of one little-endian bit stream."""
    count = codes.shape[-1]
    packed = torch.zeros(*codes.shape[:-1], math.ceil(count * bits / 8), dtype=torch.int64)
    for i in range(count):
        for j in range(bits):
            position = i * bits + j
            packed[..., position // 8] |= ((codes[..., i].to(torch.int64) >> j) & 1) << (position % 8)
    return packed.to(torch.uint8)


def fp16_le(x: torch.Tensor) -> torch.Tensor:
    """fp16 values -> their two little-endian bytes."""
    as_bytes = x.to(torch.float16).contiguous().numpy().astype("<f2").view(np.uint8)
    return torch.from_numpy(as_bytes.reshape(*x.shape, 2).copy())


def format_md_slots(key, value, pit, centroids, key_bits, value_bits, slot_bytes):
    """Slot bytes [N, Hk, slot_bytes] of key, value [N, Hk, D] by docs/format.md (padding left 0)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    slots = torch.zeros(num_tokens, num_kv_heads, slot_bytes, dtype=torch.uint8)
    k = key.float().cpu()
    if key_bits == 8:
        slots[..., :head_dim] = k.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        at = head_dim
    else:
        norm = k.norm(dim=-1)
        rotated = (k / (norm[..., None] + 1e-8)) @ pit.float().cpu()
        c = centroids.float().cpu()
        midpoints = (c[1:] + c[:-1]) / 2
        codes = (rotated[..., None] >= midpoints).sum(-1)  # the nearest centroid, ties to the upper one
        code_bytes = math.ceil(head_dim * key_bits / 8)
        slots[..., :code_bytes] = pack_bits(codes, key_bits)
        slots[..., code_bytes:code_bytes + 2] = fp16_le(norm)
        at = code_bytes + 2
    v = value.float().cpu()
    low, high = v.amin(-1), v.amax(-1)
    levels = 2**value_bits - 1
    scale = ((high - low) / levels).clamp_min(1e-8)
    codes = torch.floor((v - low[..., None]) / scale[..., None] + 0.5).clamp(0, levels)
    code_bytes = math.ceil(head_dim * value_bits / 8)
    slots[..., at:at + code_bytes] = pack_bits(codes, value_bits)
    slots[..., at + code_bytes:at + code_bytes + 2] = fp16_le(scale)
    slots[..., at + code_bytes + 2:at + code_bytes + 4] = fp16_le(low)
    return slots


# --- vLLM's side of a call ----------------------------------------------------------------------
def vllm_cache(num_blocks, block_size, num_kv_heads, slot_bytes, order, device):
    """The [num_blocks, block_size, num_kv_heads, slot] tensor vLLM's kernels get, sentinel-filled:
    head-major, the transposed view of get_kv_cache_shape's allocation; or position-major."""
    if order == "head_major":
        allocation = torch.full((num_blocks, num_kv_heads, block_size, slot_bytes), SENTINEL, dtype=torch.uint8)
        return allocation.to(device).transpose(1, 2)
    return torch.full((num_blocks, block_size, num_kv_heads, slot_bytes), SENTINEL, dtype=torch.uint8).to(device)


def codebook_of(cache_dtype, head_dim, rotation, seed=0):
    """(Pi, centroids) as vLLM's backend holds them: the normalized Sylvester Hadamard matrix (Pi =
    PiT) or a caller's random orthogonal matrix, and Lloyd-Max centroids for N(0, 1/D); 'random'
    also perturbs the centroids (still ascending), so only the caller's codebook decodes right."""
    key_bits = vllm.VLLM_PRESETS[cache_dtype][0]
    centroids = torch.tensor(codebook.centroids(4 if key_bits == 8 else key_bits, head_dim))
    if rotation == "hadamard":
        return codebook.hadamard_matrix(head_dim), centroids
    generator = torch.Generator().manual_seed(seed)
    pi = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))[0].float()
    wobble = 1 + 0.2 * torch.rand(centroids.shape, generator=generator)
    return pi, torch.sort(centroids * wobble).values


def ragged_batch(block_size, num_kv_heads, head_dim, seq_lens, key_fp8, seed=0):
    """Keys, values, a block table over shuffled blocks, slot_mapping with one extra token at slot -1.
    Each row's columns past its pages point to a spare block of its own (room for one more page)."""
    generator = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + len(seq_lens) + 1
    order = torch.randperm(num_blocks, generator=generator)
    block_table = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    slots, used = [], 0
    for b, (n, p) in enumerate(zip(seq_lens, pages)):
        block_table[b, :p] = order[used:used + p].to(torch.int32)
        block_table[b, p:] = order[sum(pages) + b]
        used += p
        t = torch.arange(n)
        slots.append(block_table[b, t // block_size].long() * block_size + t % block_size)
    slot_mapping = torch.cat(slots + [torch.tensor([-1])]).to(torch.int32)
    shape = (len(slot_mapping), num_kv_heads, head_dim)
    key = torch.randn(shape, generator=generator) * 2
    if key_fp8:
        key = key.to(torch.float8_e4m3fn).float()
    value = torch.randn(shape, generator=generator)
    return key.half(), value.half(), block_table, torch.tensor(seq_lens, dtype=torch.int32), slot_mapping, num_blocks


def reference_decode(config, query, cache, block_table, seq_lens, pit, centroids, scale, key_fp8):
    """tqgen's reference: keys coded as (k / n) @ R and scored q @ R, R = vLLM's PiT."""
    codebook_args = (None, None) if key_fp8 else (pit, centroids)
    return reference.decode(Layout.from_config(config), query, cache, block_table, seq_lens, *codebook_args, scale)


CASE_FIELDS = "cache_dtype,head_dim,block_size,group_size,order,rotation"
CPU_CASES = [
    ("turboquant_k3v4_nc", 128, 16, 4, "head_major", "hadamard"),
    ("turboquant_k8v4", 64, 32, 1, "position_major", "hadamard"),
    ("turboquant_3bit_nc", 96, 16, 6, "head_major", "random"),
    ("turboquant_4bit_nc", 256, 16, 8, "position_major", "hadamard"),
]
GPU_CASES = (
    [(p, d, 16, 4, o, "random" if d == 96 else "hadamard")
     for p in vllm.VLLM_PRESETS for d in (64, 96, 128, 256) for o in ("head_major", "position_major")]
    + [(p, 128, b, g, "head_major", "hadamard")
       for p in ("turboquant_k3v4_nc", "turboquant_k8v4") for b in (16, 32, 64, 128) for g in (1, 4, 6, 8)]
    + [("turboquant_4bit_nc", 128, 16, 4, "head_major", "random")]  # a non-Hadamard PiT at a power-of-two dim
)
CASES = ([pytest.param("cpu", *case, marks=CPU, id="cpu-" + "-".join(map(str, case))) for case in CPU_CASES]
         + [pytest.param("cuda", *case, marks=GPU, id="cuda-" + "-".join(map(str, case))) for case in GPU_CASES])


@pytest.mark.parametrize("device," + CASE_FIELDS, CASES)
def test_store_writes_format_md_slots_and_decode_matches_the_reference(device, cache_dtype, head_dim, block_size,
                                                                       group_size, order, rotation):
    arguments = vllm.preset_arguments(cache_dtype, head_dim)
    key_fp8 = arguments["key_fp8"]
    num_kv_heads = 2
    slot_bytes = vllm.slot_size_aligned(cache_dtype, head_dim)
    config = make_config(TQGEN_PRESET[cache_dtype], head_dim=head_dim, block_size=block_size)
    pi, centroids = codebook_of(cache_dtype, head_dim, rotation)
    pit = pi.t().contiguous()
    key, value, block_table, seq_lens, slot_mapping, num_blocks = ragged_batch(
        block_size, num_kv_heads, head_dim, [block_size + 3, 0, 5], key_fp8)
    cache = vllm_cache(num_blocks, block_size, num_kv_heads, slot_bytes, order, device)
    c_sorted = torch.sort(centroids).values
    vllm.triton_turboquant_store(
        key.to(device), value.to(device), cache, slot_mapping.to(device), pit.to(device),
        ((c_sorted[:-1] + c_sorted[1:]) / 2).to(device), arguments["mse_bits"], arguments["key_packed_size"],
        arguments["value_quant_bits"], key_fp8=key_fp8, kv_group_size=group_size)

    # docs/format.md's bytes in the stored slots; the sentinel everywhere else, the skipped token included.
    built = vllm_cache(num_blocks, block_size, num_kv_heads, slot_bytes, order, "cpu")
    written = slot_mapping >= 0
    mapping = slot_mapping[written].long()
    slots = format_md_slots(key, value, pit, centroids, 8 if key_fp8 else arguments["mse_bits"],
                            arguments["value_quant_bits"], slot_bytes)[written]
    used = arguments["key_packed_size"] + math.ceil(head_dim * arguments["value_quant_bits"] / 8) + 4
    built[mapping // block_size, mapping % block_size, :, :used] = slots[..., :used]  # padding keeps the sentinel
    stored = cache.cpu()
    assert store_differences(config, stored, built, key.float(), slot_mapping, pit, centroids) == 0

    query = torch.randn(len(seq_lens), num_kv_heads * group_size, head_dim,
                        generator=torch.Generator().manual_seed(7)).half()
    scale = head_dim**-0.5
    for source, kv_cache in (("the drop-in store", cache), ("format.md", built.to(device))):
        out = vllm.triton_turboquant_decode_attention(
            query.to(device), kv_cache, block_table.to(device), seq_lens.to(device), pi.to(device),
            centroids.to(device), scale, PiT=pit.to(device) if rotation == "hadamard" else None, **arguments)
        want = reference_decode(config, query, kv_cache.cpu(), block_table, seq_lens, pit, centroids, scale, key_fp8)
        assert out.dtype == torch.float16 and out.shape == want.shape
        assert torch.all(out[1] == 0), f"seq_len 0 on a cache from {source}"
        error = relative_error(out.cpu(), want)
        assert error < DECODE_TOLERANCE[torch.float16], f"relative error {error:.2e} on a cache from {source}"


def test_store_leaves_slot_padding_and_other_slots_alone(device):
    """At head_dim 72, 3-bit keys and 4-bit values fill 69 bytes of a 70-byte slot: the store writes
    the 69 bytes of each mapped slot and nothing else (padding, unmapped slots, the token at -1)."""
    arguments = vllm.preset_arguments("turboquant_k3v4_nc", 72)
    slot_bytes = vllm.slot_size_aligned("turboquant_k3v4_nc", 72)
    assert slot_bytes == 70
    key, value, _, _, slot_mapping, num_blocks = ragged_batch(16, 1, 72, [9], key_fp8=False)
    cache = vllm_cache(num_blocks, 16, 1, slot_bytes, "head_major", device)
    pi, centroids = codebook_of("turboquant_k3v4_nc", 72, "random")
    vllm.triton_turboquant_store(key.to(device), value.to(device), cache, slot_mapping.to(device),
                                 pi.t().contiguous().to(device), ((centroids[1:] + centroids[:-1]) / 2).to(device),
                                 **{k: arguments[k] for k in ("mse_bits", "key_packed_size", "value_quant_bits")})
    changed = (cache.cpu() != SENTINEL).any(-1)  # [blocks, positions, heads]: slots with a byte written
    mapping = slot_mapping[slot_mapping >= 0].long()
    expected = torch.zeros_like(changed)
    expected[mapping // 16, mapping % 16] = True
    assert torch.equal(changed, expected)
    assert torch.all(cache.cpu()[..., 69] == SENTINEL)


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_store_reads_as_many_slot_mapping_entries_as_key_has_tokens():
    """As vLLM's kernel: a slot_mapping longer than key (padded for a CUDA graph) has its tail ignored, even
    where the tail names real slots; a shorter one is refused; the module's own refusals (here a value of
    another shape) come as VllmArgumentError naming the drop-in."""
    arguments = vllm.preset_arguments("turboquant_k8v4", 64)
    slot_bytes = vllm.slot_size_aligned("turboquant_k8v4", 64)
    key, value, _, _, slot_mapping, num_blocks = ragged_batch(16, 1, 64, [5], key_fp8=True)
    store_arguments = (None, None, 0, arguments["key_packed_size"], arguments["value_quant_bits"])
    exact = vllm_cache(num_blocks, 16, 1, slot_bytes, "head_major", "cpu")
    vllm.triton_turboquant_store(key, value, exact, slot_mapping, *store_arguments, key_fp8=True)
    padded = vllm_cache(num_blocks, 16, 1, slot_bytes, "head_major", "cpu")
    tail = torch.arange(num_blocks * 16 - 3, num_blocks * 16, dtype=slot_mapping.dtype)  # real slots
    vllm.triton_turboquant_store(key, value, padded, torch.cat([slot_mapping, tail]), *store_arguments, key_fp8=True)
    assert torch.equal(padded, exact) and (exact != SENTINEL).any()
    with pytest.raises(vllm.VllmArgumentError, match="slot_mapping has 4 entries for 6 tokens"):
        vllm.triton_turboquant_store(key, value, padded, slot_mapping[:4], *store_arguments, key_fp8=True)
    with pytest.raises(vllm.VllmArgumentError) as refusal:
        vllm.triton_turboquant_store(key, value[:, :, :32], padded, slot_mapping, *store_arguments, key_fp8=True)
    message = str(refusal.value)
    assert message.startswith("triton_turboquant_store: ") and "value" in message and "\n" not in message


def stored_problem(cache_dtype, head_dim, device, rotation="hadamard", group_size=4, block_size=16,
                   seq_lens=(21, 0, 40)):
    """A cache the drop-in store filled (head-major), with a query: the inputs of a decode call."""
    arguments = vllm.preset_arguments(cache_dtype, head_dim)
    pi, centroids = codebook_of(cache_dtype, head_dim, rotation)
    key, value, block_table, seq_lens, slot_mapping, num_blocks = ragged_batch(
        block_size, 2, head_dim, list(seq_lens), arguments["key_fp8"])
    cache = vllm_cache(num_blocks, block_size, 2, vllm.slot_size_aligned(cache_dtype, head_dim), "head_major", device)
    vllm.triton_turboquant_store(key.to(device), value.to(device), cache, slot_mapping.to(device),
                                 pi.t().contiguous().to(device), ((centroids[1:] + centroids[:-1]) / 2).to(device),
                                 arguments["mse_bits"], arguments["key_packed_size"], arguments["value_quant_bits"],
                                 key_fp8=arguments["key_fp8"])
    query = torch.randn(len(seq_lens), 2 * group_size, head_dim, generator=torch.Generator().manual_seed(3)).half()
    return types.SimpleNamespace(
        arguments=arguments, pi=pi.to(device), centroids=centroids.to(device), cache=cache, query=query.to(device),
        block_table=block_table.to(device), seq_lens=seq_lens.to(device), key=key, value=value)


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_decode_reads_the_first_batch_rows_of_longer_metadata():
    """As vLLM's kernel: block_table and seq_lens with more rows than the query (padded for a CUDA graph)
    are read for the query's B sequences only; fewer rows are refused as VllmArgumentError."""
    problem = stored_problem("turboquant_k8v4", 64, "cpu")
    arguments = problem.arguments

    def decode(block_table, seq_lens):
        return vllm.triton_turboquant_decode_attention(problem.query, problem.cache, block_table,
                                                       seq_lens, problem.pi, problem.centroids, 0.125, **arguments)

    exact = decode(problem.block_table, problem.seq_lens)
    padding = torch.full((2, problem.block_table.shape[1]), 10**6, dtype=torch.int32)  # no such block
    padded = decode(torch.cat([problem.block_table, padding]),
                    torch.cat([problem.seq_lens, torch.tensor([7, 10**6], dtype=torch.int32)]))
    assert torch.equal(padded, exact) and exact.abs().sum() > 0
    with pytest.raises(vllm.VllmArgumentError) as refusal:
        decode(problem.block_table[:2], problem.seq_lens)
    message = str(refusal.value)
    assert message.startswith("triton_turboquant_decode_attention: ") and "block_table has 2 rows" in message


def test_decode_scores_with_pit_or_pi_transposed(device):
    """q @ PiT, with Pi.T when PiT is None: for a non-symmetric Pi the two spellings agree bit for bit,
    and the other convention (q @ Pi) decodes something else."""
    p = stored_problem("turboquant_3bit_nc", 96, device, rotation="random")
    common = (p.query, p.cache, p.block_table, p.seq_lens)
    by_pi = vllm.triton_turboquant_decode_attention(*common, p.pi, p.centroids, 0.1, **p.arguments)
    by_pit = vllm.triton_turboquant_decode_attention(*common, None, p.centroids, 0.1, PiT=p.pi.t().contiguous(),
                                                     **p.arguments)
    wrong = vllm.triton_turboquant_decode_attention(*common, None, p.centroids, 0.1, PiT=p.pi, **p.arguments)
    assert torch.equal(by_pi, by_pit)
    assert relative_error(wrong, by_pi) > 0.05


def test_decode_writes_into_vllms_buffers_and_builds_nothing_after_the_first_call(device, monkeypatch):
    """With vLLM's workspace buffers the output is output_buf[:B], the partials live in mid_o_buf,
    buf_holder gets nothing and lse_buf is left as it was; without them the buffers decode allocates
    are recorded on buf_holder, as vLLM's launcher does. Once a format's module is loaded, calls
    render and load nothing."""
    p = stored_problem("turboquant_k3v4_nc", 128, device)
    batch, num_q_heads, head_dim = p.query.shape
    splits = 4
    mid_o_buf = torch.full((batch + 1, num_q_heads, splits, head_dim + 1), float("nan"), device=device)
    output_buf = torch.full((batch + 1, num_q_heads, head_dim), float("nan"), dtype=torch.float16, device=device)
    lse_buf = torch.full((batch + 1, num_q_heads), 123.0, device=device)
    holder = types.SimpleNamespace()
    call = (p.query, p.cache, p.block_table, p.seq_lens, p.pi, p.centroids, head_dim**-0.5)
    plain = vllm.triton_turboquant_decode_attention(*call, PiT=p.pi, **p.arguments)

    def no_build(*args, **kwargs):
        raise AssertionError("rendered or loaded a module on the hot path")

    for name in ("load", "build", "render", "import_module_file"):
        monkeypatch.setattr(emit, name, no_build)
    out = vllm.triton_turboquant_decode_attention(*call, PiT=p.pi, mid_o_buf=mid_o_buf, output_buf=output_buf,
                                                  lse_buf=lse_buf, buf_holder=holder, max_num_kv_splits=splits,
                                                  **p.arguments)
    assert out.data_ptr() == output_buf.data_ptr() and torch.equal(out, output_buf[:batch])
    assert torch.all(output_buf[batch].isnan())  # the row past the batch is untouched
    assert relative_error(out, plain) < 1e-3  # maybe another split count: sums in another order
    assert not mid_o_buf.isnan().all()  # the partials were written there
    assert torch.all(lse_buf == 123.0) and vars(holder) == {}

    unfit = mid_o_buf[:, :, :2]  # fewer splits than max_num_kv_splits: vLLM allocates instead
    out = vllm.triton_turboquant_decode_attention(*call, PiT=p.pi, mid_o_buf=unfit, output_buf=None,
                                                  buf_holder=holder, max_num_kv_splits=splits, **p.arguments)
    assert holder._tq_output_buf is out and holder._tq_mid_o_buf.shape == (batch, num_q_heads, splits, head_dim + 1)
    assert relative_error(out, plain) < 1e-3


def test_a_continuation_chunk_decodes_through_an_expanded_block_table(device):
    """vLLM's short continuation chunks: each of the chunk's queries decoded as a sequence of its own,
    through `block_table[i:i + 1].expand(q_len, -1)` (row stride 0) and seq_lens cached_len + 1 ..
    seq_len sliced from an arange; query positions see the tokens up to their own (causal)."""
    p = stored_problem("turboquant_4bit_nc", 128, device, seq_lens=(40,))
    q_len, seq_len = 6, 40
    arange = torch.arange(0, seq_len + 1, dtype=torch.int32, device=device)
    block_table = p.block_table[0:1].expand(q_len, -1)
    assert block_table.stride(0) == 0
    seq_lens = arange[seq_len - q_len + 1:seq_len + 1]
    query = torch.randn(q_len, 8, 128, generator=torch.Generator().manual_seed(4)).half().to(device)
    out = vllm.triton_turboquant_decode_attention(query, p.cache, block_table, seq_lens, p.pi, p.centroids,
                                                  128**-0.5, PiT=p.pi, **p.arguments)
    config = make_config("k4v4", head_dim=128)
    want = reference_decode(config, query.cpu(), p.cache.cpu(), block_table.cpu(), seq_lens.cpu(), p.pi.cpu(),
                            p.centroids.cpu(), 128**-0.5, key_fp8=False)
    assert relative_error(out.cpu(), want) < DECODE_TOLERANCE[torch.float16]


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
@pytest.mark.parametrize("num_splits,max_splits", [(3, 4), (4, 4)])
def test_decode_workspace_is_carved_out_of_mid_o_buf(num_splits, max_splits):
    """Partial outputs, partial log-sum-exps and (when fewer splits than max_num_kv_splits leave room)
    the rotated query: disjoint pieces of vLLM's mid_o_buf; at the full split count the query is a
    tensor of its own."""
    module = vllm._module("test", torch.device("cpu"), 128, 16, False, 4, 66, 4, True)
    batch, num_q_heads, head_dim = 3, 8, 128
    mid_o_buf = torch.empty(batch, num_q_heads, max_splits, head_dim + 1)
    workspace = vllm._decode_workspace(module, mid_o_buf, None, batch, num_q_heads, head_dim, num_splits, max_splits,
                                       torch.device("cpu"), needs_query=True)
    start, end = mid_o_buf.data_ptr(), mid_o_buf.data_ptr() + mid_o_buf.numel() * 4
    pieces = [workspace.partial_out, workspace.partial_lse, workspace.query]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in pieces)
    assert workspace.partial_out.shape == (batch, num_q_heads, num_splits, head_dim)
    assert workspace.partial_lse.shape == (batch, num_q_heads, num_splits)
    assert workspace.query.shape == (batch, num_q_heads, head_dim) and workspace.query.dtype == torch.float16
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    inside = [start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end for t in pieces]
    assert inside == [True, True, num_splits < max_splits]
    assert workspace.query.data_ptr() % 16 == 0


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_decode_views_of_vllms_buffers_are_built_once_per_buffer_and_shape(monkeypatch):
    """The workspace and output views of a buffer are reused by later calls of the same shape (no views built on
    the hot path), rebuilt for another shape, and dropped (with the reference to the buffer) when another buffer
    object comes: nothing of a freed buffer is written or kept."""
    monkeypatch.setattr(vllm, "_buffer_views", {})
    monkeypatch.setattr(vllm, "_split_counter_store", {})
    module = vllm._module("test", torch.device("cpu"), 128, 16, False, 4, 66, 4, True)
    cpu = torch.device("cpu")
    mid_o_buf, output_buf = torch.empty(4, 8, 4, 129), torch.empty(4, 8, 128, dtype=torch.float16)

    def workspace(buffer, batch):
        return vllm._decode_workspace(module, buffer, None, batch, 8, 128, 3, 4, cpu, needs_query=True)

    def output(buffer, batch):
        return vllm._decode_output(buffer, None, batch, 8, 128, torch.float16, cpu)

    first, first_out = workspace(mid_o_buf, 3), output(output_buf, 3)
    assert workspace(mid_o_buf, 3) is first and output(output_buf, 3) is first_out
    other = workspace(mid_o_buf, 2)
    assert other is not first and other.partial_out.shape == (2, 8, 3, 128)
    assert other.partial_out.data_ptr() == first.partial_out.data_ptr() == mid_o_buf.data_ptr()
    assert output(output_buf, 2).shape == (2, 8, 128)
    # decode's merge in stage 1 counts in zeros of tqgen's own, one per row of the buffer, shared by its calls.
    assert other.split_counters is first.split_counters and first.split_counters.dtype == torch.int32
    assert first.split_counters.numel() == 4 * 8 and not first.split_counters.any()
    new_mid, new_out = torch.empty_like(mid_o_buf), torch.empty_like(output_buf)
    fresh, fresh_out = workspace(new_mid, 3), output(new_out, 3)
    assert fresh.partial_out.data_ptr() == new_mid.data_ptr() and fresh_out.data_ptr() == new_out.data_ptr()
    # Another buffer, other counters; the first buffer's stay (a captured graph may hold their address).
    assert fresh.split_counters is not first.split_counters
    assert vllm._split_counter_store[(cpu, mid_o_buf.data_ptr())] is first.split_counters
    assert vllm._buffer_views["workspace"][0] is new_mid and vllm._buffer_views["output"][0] is new_out
    assert all(view is not first for view in vllm._buffer_views["workspace"][2].values())
    # A buffer too small for the call is not used, and nothing is held for it.
    small = torch.empty(1, 8, 4, 129)
    unheld = workspace(small, 3)
    assert unheld.partial_out.data_ptr() != small.data_ptr() and unheld.split_counters.numel() == 3 * 8
    assert vllm._buffer_views["workspace"][0] is new_mid


def workspace_manager_buffers(base, batch, num_q_heads, splits, head_dim, dtype):
    """What vLLM's backend passes decode from its WorkspaceManager (get_simultaneous): new views of one uint8 base
    tensor on every call, mid_o_buf, output_buf and lse_buf each at a 256-byte aligned offset."""
    shapes = [((batch, num_q_heads, splits, head_dim + 1), torch.float32), ((batch, num_q_heads, head_dim), dtype),
              ((batch, num_q_heads), torch.float32)]
    views, start = [], 0
    for shape, view_dtype in shapes:
        size = math.prod(shape) * view_dtype.itemsize
        views.append(base[start:start + size].view(view_dtype).reshape(shape))
        start += -(-size // 256) * 256
    return views


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_decode_views_of_workspace_manager_buffers_are_built_once_per_shape(monkeypatch):
    """vLLM's backend hands decode new view objects of its WorkspaceManager's one allocation on every call: the
    workspace carved out of mid_o_buf and the output view are built by the first call of a shape and found again by
    later calls over the same memory (they were rebuilt on every call: the held views matched the buffer object), for
    each batch size; views of another allocation (the workspace grown) replace them. Results are the plain call's."""
    monkeypatch.setattr(vllm, "_buffer_views", {})
    monkeypatch.setattr(vllm, "_split_counter_store", {})
    p = stored_problem("turboquant_k3v4_nc", 128, "cpu")
    batch, num_q_heads, head_dim = p.query.shape
    call = (p.cache, p.block_table, p.seq_lens, p.pi, p.centroids, head_dim**-0.5)
    plain = vllm.triton_turboquant_decode_attention(p.query, *call, PiT=p.pi, **p.arguments)
    carved = []
    carve = vllm._carve_workspace
    monkeypatch.setattr(vllm, "_carve_workspace",
                        lambda *args, **kwargs: carved.append(args[3]) or carve(*args, **kwargs))
    base = torch.empty(1 << 20, dtype=torch.uint8)
    for rows in (batch, batch - 1, batch, batch - 1):
        mid_o_buf, output_buf, lse_buf = workspace_manager_buffers(base, rows, num_q_heads, 4, head_dim, torch.float16)
        out = vllm.triton_turboquant_decode_attention(p.query[:rows], *call, PiT=p.pi, mid_o_buf=mid_o_buf,
                                                      output_buf=output_buf, lse_buf=lse_buf, max_num_kv_splits=4,
                                                      **p.arguments)
        assert out.data_ptr() == output_buf.data_ptr() and relative_error(out, plain[:rows]) < 1e-3
    assert carved == [batch, batch - 1]  # one workspace per batch size, none per call
    grown = torch.empty(2 << 20, dtype=torch.uint8)
    mid_o_buf, output_buf, _ = workspace_manager_buffers(grown, batch, num_q_heads, 4, head_dim, torch.float16)
    workspace = vllm._decode_workspace(vllm._module("test", torch.device("cpu"), 128, 16, False, 3, 50, 4, True),
                                       mid_o_buf, None, batch, num_q_heads, head_dim, 4, 4, torch.device("cpu"), True)
    output = vllm._decode_output(output_buf, None, batch, num_q_heads, head_dim, torch.float16, torch.device("cpu"))
    assert workspace.partial_out.data_ptr() == grown.data_ptr() and output.data_ptr() == output_buf.data_ptr()


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_split_counters_first_made_in_a_cuda_graph_capture_are_not_kept(monkeypatch):
    """The split counters kept per mid_o_buf address must be zeros for every call over it (decode's merge in stage 1
    counts the finished splits in them and leaves them zero). Made by a call captured in a CUDA graph (vLLM's buffer
    first passed back in a capture: its warm-up call allocated it), torch.zeros is a memset the graph holds and runs
    only when it replays: kept, the counters were whatever memory the capture was given for every eager call and
    every other graph before that replay, which then merged too early or never. Here the capture's memset leaves
    7s: the eager calls after it, of the captured shape and another, must count in zeros, and a later capture in
    the counters they kept."""
    monkeypatch.setattr(vllm, "_buffer_views", {})
    monkeypatch.setattr(vllm, "_split_counter_store", {})
    cpu = torch.device("cpu")
    module = vllm._module("test", cpu, 128, 16, False, 4, 66, 4, True)
    mid_o_buf = torch.empty(4, 8, 4, 129)
    capturing = [True]
    monkeypatch.setattr(vllm, "_capturing", lambda tensor: capturing[0])

    def workspace(batch):
        return vllm._decode_workspace(module, mid_o_buf, None, batch, 8, 128, 3, 4, cpu, needs_query=True)

    captured = workspace(3)
    assert captured.split_counters.numel() >= 3 * 8 and not captured.split_counters.any()
    captured.split_counters.fill_(7)  # the memset the capture recorded has not run
    capturing[0] = False
    for batch in (3, 2):
        eager = workspace(batch)
        assert eager.split_counters.numel() >= batch * 8 and not eager.split_counters.any()
    capturing[0] = True
    assert workspace(2).split_counters is eager.split_counters and workspace(1).split_counters is eager.split_counters


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_a_rotated_query_of_its_own_outlives_the_views_of_its_buffer(monkeypatch):
    """At the full split count the rotated query has no room in mid_o_buf and gets a tensor of its own, which a CUDA
    graph captured over the buffer's workspace writes on every replay: like the split counters, it stays allocated
    when another buffer object replaces the held views (it was freed, and a replay then wrote into whatever tensor
    the allocator put there), and later calls over the buffer's memory find the same one."""
    monkeypatch.setattr(vllm, "_buffer_views", {})
    monkeypatch.setattr(vllm, "_query_store", {}, raising=False)
    cpu = torch.device("cpu")
    module = vllm._module("test", cpu, 128, 16, False, 4, 66, 4, True)
    mid_o_buf = torch.empty(4, 8, 4, 129)

    def workspace(buffer, batch):
        return vllm._decode_workspace(module, buffer, None, batch, 8, 128, 4, 4, cpu, needs_query=True)

    first = workspace(mid_o_buf, 4)
    start, end = mid_o_buf.data_ptr(), mid_o_buf.data_ptr() + mid_o_buf.numel() * 4
    assert not start <= first.query.data_ptr() < end  # no room: a tensor of its own
    address, storage = first.query.data_ptr(), weakref.ref(first.query.untyped_storage())
    del first
    workspace(torch.empty_like(mid_o_buf), 4)  # another buffer object: the first one's views are dropped
    gc.collect()
    assert storage() is not None
    assert workspace(mid_o_buf, 4).query.data_ptr() == address


# vLLM launches the qgroup4 variant for MSE keys only.
DEQUANTIZE_LAUNCHES = [("_tq_full_dequant_kv", "turboquant_4bit_nc"), ("_tq_full_dequant_kv", "turboquant_k8v4"),
                       ("_tq_full_dequant_kv_qgroup4", "turboquant_k3v4_nc"),
                       ("_tq_full_dequant_kv_qgroup4", "turboquant_3bit_nc")]
DEQUANTIZE_FIELDS = "launch,cache_dtype,head_dim,block_size,order,source"
DEQUANTIZE_CPU_CASES = (
    [(launch, preset, 128, 16, "head_major", "store") for launch, preset in DEQUANTIZE_LAUNCHES[:3]]
    + [("_tq_full_dequant_kv", "turboquant_3bit_nc", 96, 32, "position_major", "format.md"),
       ("_tq_full_dequant_kv", "turboquant_k8v4", 64, 64, "position_major", "format.md")])
DEQUANTIZE_GPU_CASES = (
    [(launch, preset, d, 16, order, source) for launch, preset in DEQUANTIZE_LAUNCHES for d in (64, 96, 128, 256)
     for order in ("head_major", "position_major") for source in ("store", "format.md")]
    + [(launch, preset, 128, b, "head_major", "store") for launch, preset in DEQUANTIZE_LAUNCHES for b in (32, 64, 128)])
DEQUANTIZE_CASES = (
    [pytest.param("cpu", *case, marks=CPU, id="cpu-" + "-".join(map(str, case))) for case in DEQUANTIZE_CPU_CASES]
    + [pytest.param("cuda", *case, marks=GPU, id="cuda-" + "-".join(map(str, case))) for case in DEQUANTIZE_GPU_CASES])


@pytest.mark.parametrize("device," + DEQUANTIZE_FIELDS, DEQUANTIZE_CASES)
def test_continuation_prefill_dequantize_launch(device, launch, cache_dtype, head_dim, block_size, order, source):
    """vLLM's continuation prefill: `kernel[(alloc_len, Hk)](...)` into fp16 [1, Hk, alloc_len, D] buffers
    with the backend's arguments, then keys @ Pi: the reference's dequantized keys and values, on a cache the
    drop-in store wrote or one built byte by byte from docs/format.md, in either position order (head_dim 96
    under a caller's random orthogonal Pi and its own centroids)."""
    cached_len = block_size + 5  # past a page boundary
    arguments = vllm.preset_arguments(cache_dtype, head_dim)
    key_fp8, num_kv_heads = arguments["key_fp8"], 2
    pi, centroids = codebook_of(cache_dtype, head_dim, "random" if head_dim == 96 else "hadamard")
    pit = pi.t().contiguous()
    key, value, block_table, _, slot_mapping, num_blocks = ragged_batch(block_size, num_kv_heads, head_dim,
                                                                        [cached_len], key_fp8)
    slot_bytes = vllm.slot_size_aligned(cache_dtype, head_dim)
    cache = vllm_cache(num_blocks, block_size, num_kv_heads, slot_bytes, order, device)
    if source == "store":
        vllm.triton_turboquant_store(
            key.to(device), value.to(device), cache, slot_mapping.to(device), pit.to(device),
            ((centroids[:-1] + centroids[1:]) / 2).to(device), arguments["mse_bits"], arguments["key_packed_size"],
            arguments["value_quant_bits"], key_fp8=key_fp8)
    else:
        written = slot_mapping >= 0
        mapping = slot_mapping[written].long()
        slots = format_md_slots(key, value, pit, centroids, 8 if key_fp8 else arguments["mse_bits"],
                                arguments["value_quant_bits"], slot_bytes)[written]
        built = cache.cpu()
        built[mapping // block_size, mapping % block_size] = slots
        cache.copy_(built)

    alloc_len = -(-cached_len // block_size) * block_size
    k_buf = torch.full((1, num_kv_heads, alloc_len + 5, head_dim), float("nan"), dtype=torch.float16, device=device)
    v_buf = torch.full_like(k_buf, float("nan"))
    k_cached, v_cached = k_buf[:, :, :alloc_len, :], v_buf[:, :, :alloc_len, :]
    mse_bytes = head_dim if key_fp8 else math.ceil(head_dim * arguments["mse_bits"] / 8)
    common = dict(HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, MSE_BYTES=mse_bytes,
                  VQB=arguments["value_quant_bits"], VAL_DATA_BYTES=head_dim * arguments["value_quant_bits"] // 8,
                  MSE_BITS=arguments["mse_bits"], BLOCK_D=1 << (head_dim - 1).bit_length(),
                  NORM_CORRECTION=int(arguments["norm_correction"]), num_warps=4)
    if launch == "_tq_full_dequant_kv":
        common.update(KPS=arguments["key_packed_size"], KEY_FP8=int(key_fp8), FP8_E4B15=vllm._use_fp8_e4b15(0))
    block_table = block_table[:1].to(device)
    getattr(vllm, launch)[(alloc_len, 1 * num_kv_heads)](
        cache, block_table, centroids.to(device), k_cached, v_cached,
        k_cached.stride(0), k_cached.stride(1), k_cached.stride(2),
        v_cached.stride(0), v_cached.stride(1), v_cached.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2), block_table.stride(0), **common)

    config = make_config(TQGEN_PRESET[cache_dtype], head_dim=head_dim, block_size=block_size)
    want_keys, want_values = reference.dequantize(
        Layout.from_config(config), cache.cpu(), block_table.cpu(), torch.tensor([cached_len], dtype=torch.int32),
        None if key_fp8 else pit, None if key_fp8 else centroids)
    keys = k_cached[0, :, :cached_len].float().cpu()
    if not key_fp8:
        keys = keys @ pi  # the backend's k_flat @ Pi: back from the rotated domain
    assert relative_error(keys, want_keys[0]) < 2e-3  # fp16 outputs
    assert relative_error(v_cached[0, :, :cached_len].float().cpu(), want_values[0]) < 1e-3
    assert not k_cached.isnan().any() and torch.all(k_buf[:, :, alloc_len:].isnan())


def test_derived_codebook_tensors_are_kept_per_source_and_version_without_a_bound(monkeypatch):
    """One derived tensor per (source, kind) as long as the source lives and is not written: 300 per-layer
    sources cycled three times derive 300 times (a bounded cache shorter than the cycle would miss every
    time); an in-place write derives again; while a graph is captured, fresh_in_capture always derives; the
    entries go when their sources do."""
    calls = []
    held_before = len(vllm._derived)

    def make(source, capturing):
        calls.append(capturing)
        return source * 2

    sources = [torch.full((4, 4), float(i)) for i in range(300)]
    for _ in range(3):
        for source in sources:
            assert torch.equal(vllm._derive("test-kind", source, make), source * 2)
    assert len(calls) == 300
    sources[7].add_(1.0)  # a weight reload writing in place
    assert torch.equal(vllm._derive("test-kind", sources[7], make), sources[7] * 2) and len(calls) == 301
    monkeypatch.setattr(vllm, "_capturing", lambda tensor: True)
    vllm._derive("test-kind", sources[8], make)  # derived before the capture: its entry is used
    vllm._derive("test-kind", sources[8], make, fresh_in_capture=True)
    assert calls[301:] == [True]
    assert len(vllm._derived) == held_before + 300
    del sources, source  # the loop's variable holds the last
    gc.collect()
    assert len(vllm._derived) == held_before


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_codebook_tensors_made_under_inference_mode():
    """vLLM runs its forward under torch.inference_mode, so a codebook it builds there (Pi, PiT, centroids,
    midpoints) is made of inference tensors, which keep no version counter: store and decode take them as any
    tensor (they crashed with "Inference tensors do not track version counter"), Hadamard PiT, Pi alone (PiT None)
    and fp16 midpoints and centroids (copied to fp32) alike."""
    arguments = vllm.preset_arguments("turboquant_4bit_nc", 128)
    key, value, block_table, seq_lens, slot_mapping, num_blocks = ragged_batch(16, 2, 128, [21, 5], key_fp8=False)
    query = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(3)).half()

    def store_and_decode(pit_given):
        pi, centroids = codebook_of("turboquant_4bit_nc", 128, "hadamard")
        pi, centroids = pi.clone(), centroids.half()
        midpoints = (centroids[1:] + centroids[:-1]) / 2
        cache = vllm_cache(num_blocks, 16, 2, vllm.slot_size_aligned("turboquant_4bit_nc", 128), "head_major", "cpu")
        vllm.triton_turboquant_store(key, value, cache, slot_mapping, pi.t().contiguous(), midpoints, 4, 66, 4)
        out = vllm.triton_turboquant_decode_attention(query, cache, block_table, seq_lens, pi, centroids, 0.1,
                                                      PiT=pi.t().contiguous() if pit_given else None, **arguments)
        return cache, out

    for pit_given in (True, False):
        want_cache, want = store_and_decode(pit_given)
        with torch.inference_mode():
            cache, out = store_and_decode(pit_given)
        assert torch.equal(cache, want_cache) and torch.equal(out, want)


def test_a_hadamard_pit_takes_the_stores_walsh_hadamard_path():
    """vLLM's Hadamard matrix (built in fp32, one rounding from tqgen's) is replaced by the module's
    own, which the store's kernel applies itself; any other matrix is passed on as it is."""
    module = vllm._module("test", torch.device("cpu"), 128, 16, False, 4, 66, 4, True)
    sylvester = torch.ones(1, 1)
    while sylvester.shape[0] < 128:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    vllms = sylvester / math.sqrt(128)
    assert vllm._store_rotation("test", module, vllms, 128) is module.default_rotation("cpu")
    pi = codebook_of("turboquant_4bit_nc", 128, "random")[0].contiguous()
    assert vllm._store_rotation("test", module, pi, 128) is pi
    flipped = vllms.clone()
    flipped[0, 0] = -flipped[0, 0]
    assert vllm._store_rotation("test", module, flipped, 128).data_ptr() != module.default_rotation("cpu").data_ptr()
    # Decode alike, so that its stage 1 may rotate the query itself: PiT, or Pi (PiT None) transposed.
    assert vllm._decode_rotation("test", module, None, vllms, 128) is module.default_rotation("cpu")
    assert vllm._decode_rotation("test", module, vllms, None, 128) is module.default_rotation("cpu")
    assert vllm._decode_rotation("test", module, None, pi, 128) is pi
    assert torch.equal(vllm._decode_rotation("test", module, pi, None, 128), pi.t())


def test_default_centroids_of_the_callers_own_take_the_modules_tensor_in_decode():
    """vLLM's copy of the default levels is replaced by the module's own tensor when the two agree in fp16 (what
    the Gluon decode reads), so that 4-bit keys take decode's symmetric lookup; other centroids, and 3-bit keys'
    (which have no such lookup), are passed on as they are. Decided once per tensor and version: an in-place write
    is seen."""
    module = vllm._module("test", torch.device("cpu"), 128, 16, False, 4, 66, 4, True)
    default = module.default_centroids("cpu")
    copy = (default.double() * (1 + 1e-6)).to(torch.float32)  # another solver's rounding of the same levels
    assert not torch.equal(copy, default)
    assert vllm._decode_centroids("test", module, copy) is default
    assert vllm._decode_centroids("test", module, default.half()) is default
    other = default.clone()
    other[3] += 1e-2
    assert vllm._decode_centroids("test", module, other) is other
    copy[3] += 1e-2  # in place: its version moves
    assert vllm._decode_centroids("test", module, copy) is copy
    three_bit = vllm._module("test", torch.device("cpu"), 128, 16, False, 3, 50, 4, True)
    assert module.SYMMETRIC_KEY_LOOKUP and not three_bit.SYMMETRIC_KEY_LOOKUP  # no other lookup to take there
    levels = three_bit.default_centroids("cpu").clone()
    assert vllm._decode_centroids("test", three_bit, levels) is levels


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_default_midpoints_of_the_callers_own_take_the_stores_half_search(monkeypatch):
    """vLLM's midpoints within STORE_MIDPOINTS_RTOL of the default codebook's go to the store as no codebook at all
    (the module's default centroids, whose boundaries its kernels search by half: 4-bit keys, and 3-bit ones in
    tq_store_gluon), and the cache holds format.md's bytes; other midpoints, those of a module with no half search
    and a tensor first seen in a capture keep their own."""
    module = vllm._module("test", torch.device("cpu"), 128, 16, False, 4, 66, 4, True)
    default = module.decision_boundaries(module.default_centroids("cpu"))
    copy = (default.double() * (1 + 1e-7)).to(torch.float32)  # another solver's rounding of the same levels
    assert not torch.equal(copy, default)
    assert module.STORE_SYMMETRIC_SEARCH and vllm._store_boundaries(module, copy) == {}
    other = default.clone()
    other[3] += 1e-4
    assert vllm._store_boundaries(module, other)["boundaries"] is other
    copy[3] += 1e-4  # in place: its version moves
    assert vllm._store_boundaries(module, copy)["boundaries"] is copy
    # 3-bit keys at head_dim 128 search by half in tq_store_gluon; at 64 no kernel does.
    three_bit = vllm._module("test", torch.device("cpu"), 128, 16, False, 3, 50, 4, True)
    assert three_bit.STORE_SYMMETRIC_SEARCH and vllm._store_boundaries(
        three_bit, three_bit.decision_boundaries(three_bit.default_centroids("cpu")).clone()) == {}
    three_bit = vllm._module("test", torch.device("cpu"), 64, 16, False, 3, 26, 4, True)
    levels = three_bit.decision_boundaries(three_bit.default_centroids("cpu"))
    assert not three_bit.STORE_SYMMETRIC_SEARCH and vllm._store_boundaries(three_bit, levels)["boundaries"] is levels
    monkeypatch.setattr(vllm, "_capturing", lambda tensor: True)
    fresh = default.clone()
    assert vllm._store_boundaries(module, fresh)["boundaries"] is fresh

    # The store takes the default codebook for them, and writes what format.md says of the caller's midpoints.
    monkeypatch.setattr(vllm, "_capturing", lambda tensor: False)
    taken, store = [], module.store
    monkeypatch.setattr(module, "store", lambda *args, **kwargs: taken.append(kwargs) or store(*args, **kwargs))
    pi, centroids = codebook_of("turboquant_4bit_nc", 128, "hadamard")
    key, value, _, _, slot_mapping, num_blocks = ragged_batch(16, 2, 128, [19, 5], key_fp8=False)
    slot_bytes = vllm.slot_size_aligned("turboquant_4bit_nc", 128)
    cache = vllm_cache(num_blocks, 16, 2, slot_bytes, "head_major", "cpu")
    vllm.triton_turboquant_store(key, value, cache, slot_mapping, pi.t().contiguous(),
                                 (centroids[1:] + centroids[:-1]) / 2, 4, 66, 4)
    assert len(taken) == 1 and "boundaries" not in taken[0]
    built = vllm_cache(num_blocks, 16, 2, slot_bytes, "head_major", "cpu")
    written = slot_mapping >= 0
    mapping = slot_mapping[written].long()
    slots = format_md_slots(key, value, pi.t(), centroids, 4, 4, slot_bytes)[written]
    built[mapping // 16, mapping % 16, :, :134] = slots[..., :134]
    config = make_config("k4v4", head_dim=128, block_size=16)
    assert store_differences(config, cache, built, key.float(), slot_mapping, pi.t(), centroids) == 0


REFUSALS = [
    (dict(value_quant_bits=2), "value_quant_bits 2"),
    (dict(mse_bits=2, key_packed_size=34), "mse_bits 2"),
    (dict(key_packed_size=50), "key_packed_size 50"),
    (dict(head_dim=48), "head_dim 48"),
    (dict(max_num_kv_splits=0), "max_num_kv_splits"),
    (dict(pi_shape=(128, 64)), "Pi must be a [128, 128]"),
]


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
@pytest.mark.parametrize("change,named", REFUSALS, ids=[named for _, named in REFUSALS])
def test_decode_refuses_what_it_cannot_serve_in_one_line(change, named):
    change = dict(change)
    head_dim = change.pop("head_dim", 128)
    pi = torch.eye(*change.pop("pi_shape", (head_dim, head_dim)))
    arguments = dict(mse_bits=4, key_packed_size=head_dim // 2 + 2, value_quant_bits=4, norm_correction=True)
    arguments.update(change)
    cache = torch.zeros(2, 16, 1, 200, dtype=torch.uint8)
    with pytest.raises(vllm.VllmArgumentError) as refusal:
        vllm.triton_turboquant_decode_attention(
            torch.zeros(1, 4, head_dim), cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            pi, torch.zeros(16), 0.1, **arguments)
    message = str(refusal.value)
    assert named in message and "\n" not in message and message.startswith("triton_turboquant_decode_attention: ")


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
@pytest.mark.parametrize("block_table", [torch.zeros(1, dtype=torch.int32), [[0]]], ids=["1d", "list"])
def test_decode_refuses_a_block_table_of_another_rank_in_one_line(block_table):
    """block_table must be [batch, max_blocks]: another rank (or no tensor) is refused naming it, not an IndexError
    or AttributeError from reading its width."""
    arguments = vllm.preset_arguments("turboquant_4bit_nc", 128)
    with pytest.raises(vllm.VllmArgumentError) as refusal:
        vllm.triton_turboquant_decode_attention(
            torch.zeros(1, 4, 128), torch.zeros(2, 16, 1, 134, dtype=torch.uint8), block_table,
            torch.ones(1, dtype=torch.int32), torch.eye(128), torch.zeros(16), 0.1, **arguments)
    message = str(refusal.value)
    assert "block_table must be [batch, max_blocks_per_seq]" in message and "\n" not in message


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_store_and_dequantize_refuse_in_one_line():
    key = torch.zeros(1, 1, 128)
    cache = torch.zeros(2, 16, 1, 134, dtype=torch.uint8)
    with pytest.raises(vllm.VllmArgumentError, match="midpoints must be a \\[15\\] tensor"):
        vllm.triton_turboquant_store(key, key, cache, torch.zeros(1, dtype=torch.int32), torch.eye(128),
                                     torch.zeros(16), 4, 66, 4)
    with pytest.raises(vllm.VllmArgumentError, match="FP8_E4B15=1"):
        vllm._tq_full_dequant_kv[(16, 1)](cache, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(16), None, None,
                                          0, 0, 0, 0, 0, 0, *cache.stride()[:3], 1, HEAD_DIM=128, BLOCK_SIZE=16,
                                          NUM_KV_HEADS=1, MSE_BYTES=64, KPS=66, VQB=4, VAL_DATA_BYTES=64, MSE_BITS=4,
                                          KEY_FP8=0, BLOCK_D=128, FP8_E4B15=1)


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_dequantize_launch_refuses_outputs_and_block_tables_that_do_not_fit_in_one_line():
    """vLLM's kernel writes K_out / V_out [B, Hk, grid[0], D] through the given strides and reads one block-table row
    per sequence of grid[1]: outputs too small for that (torch's "setStorage: ... out of bounds" RuntimeError, after
    the whole dequantize), no tensor (an AttributeError), or fewer block-table rows than sequences (refused naming
    seq_lens, which the caller never passed) are refused first, naming what does not fit."""
    cache = torch.zeros(4, 16, 2, 134, dtype=torch.uint8)
    block_table = torch.zeros(1, 2, dtype=torch.int32)
    k_out = torch.zeros(1, 2, 32, 128, dtype=torch.float16)

    def launch(grid, k, v, table=block_table):
        strides = [t.stride()[:3] if isinstance(t, torch.Tensor) else (0, 0, 0) for t in (k, v)]
        vllm._tq_full_dequant_kv[grid](cache, table, torch.zeros(16), k, v, *strides[0], *strides[1],
                                       *cache.stride()[:3], table.stride(0), HEAD_DIM=128, BLOCK_SIZE=16,
                                       NUM_KV_HEADS=2, MSE_BYTES=64, KPS=66, VQB=4, VAL_DATA_BYTES=64, MSE_BITS=4,
                                       KEY_FP8=0, BLOCK_D=128, NORM_CORRECTION=1)

    launch((32, 2), k_out, k_out.clone())  # fits
    unfit = [((48, 2), k_out, k_out.clone(), "K_out_ptr"), ((32, 2), k_out, k_out[:, :, :16].clone(), "V_out_ptr"),
             ((32, 2), None, k_out, "K_out_ptr"), ((32, 4), k_out, k_out, "Block_table_ptr")]
    for grid, k, v, named in unfit:
        with pytest.raises(vllm.VllmArgumentError) as refusal:
            launch(grid, k, v)
        message = str(refusal.value)
        assert message.startswith("_tq_full_dequant_kv: ") and named in message and "\n" not in message
        assert "seq_lens" not in message


# --- GPU: CUDA graphs with vLLM's workspace buffers -----------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("layout", vllm.CACHE_LAYOUTS)
@pytest.mark.parametrize("max_splits", [32, 1])
@pytest.mark.parametrize("cache_dtype", ["turboquant_k3v4_nc", "turboquant_k8v4"])
def test_cuda_graph_of_store_and_decode_with_vllms_buffers(cache_dtype, max_splits, layout, monkeypatch):
    """vLLM's decode step captured once: store the new tokens, decode into the workspace's buffers.
    Replayed with new keys, queries and lengths, it matches the reference; buf_holder gets nothing
    (the buffers fit). At max_num_kv_splits 1 the rotated query does not fit in mid_o_buf and is
    a tensor kept for the buffer's address (built by the warm-up call, before the capture)."""
    device, head_dim, block_size, batch, num_kv_heads, group_size = "cuda", 128, 16, 4, 2, 4
    use_layout(monkeypatch, layout)
    arguments = vllm.preset_arguments(cache_dtype, head_dim)
    pi, centroids = (t.to(device) for t in codebook_of(cache_dtype, head_dim, "hadamard"))
    midpoints = (centroids[1:] + centroids[:-1]) / 2
    context = 64
    key, value, block_table, _, prefill_slots, num_blocks = ragged_batch(
        block_size, num_kv_heads, head_dim, [context] * batch, arguments["key_fp8"])
    cache = vllm_cache(num_blocks, block_size, num_kv_heads, vllm.slot_size_aligned(cache_dtype, head_dim),
                       "head_major", device)
    block_table = block_table.to(device)
    store_args = (pi, midpoints, arguments["mse_bits"], arguments["key_packed_size"], arguments["value_quant_bits"])
    vllm.triton_turboquant_store(key.to(device), value.to(device), cache, prefill_slots.to(device), *store_args,
                                 key_fp8=arguments["key_fp8"])

    num_q_heads = num_kv_heads * group_size
    step_key = torch.zeros(batch, num_kv_heads, head_dim, dtype=torch.float16, device=device)
    step_value, step_slots = torch.zeros_like(step_key), torch.zeros(batch, dtype=torch.int32, device=device)
    query = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float16, device=device)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=device)
    mid_o_buf = torch.empty(batch, num_q_heads, max_splits, head_dim + 1, device=device)
    output_buf = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float16, device=device)
    lse_buf = torch.empty(batch, num_q_heads, device=device)
    holder = types.SimpleNamespace()

    def step():
        vllm.triton_turboquant_store(step_key, step_value, cache, step_slots, *store_args, key_fp8=arguments["key_fp8"])
        return vllm.triton_turboquant_decode_attention(
            query, cache, block_table, seq_lens, pi, centroids, head_dim**-0.5, PiT=pi, mid_o_buf=mid_o_buf,
            output_buf=output_buf, lse_buf=lse_buf, buf_holder=holder, max_num_kv_splits=max_splits, **arguments)

    step()  # warm up: builds the modules and compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert out.data_ptr() == output_buf.data_ptr() and vars(holder) == {}

    generator = torch.Generator().manual_seed(5)
    for lengths in ([context + 1, 3, 17, 40], [1, context + 1, 0, 33]):
        new_key = torch.randn(batch, num_kv_heads, head_dim, generator=generator) * 2
        if arguments["key_fp8"]:
            new_key = new_key.to(torch.float8_e4m3fn).float()
        step_key.copy_(new_key.half())
        step_value.copy_(torch.randn(batch, num_kv_heads, head_dim, generator=generator).half())
        lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device)
        position = (lengths_t - 1).clamp_min(0)  # the new token's position; a length-0 row stores at -1
        blocks = block_table.gather(1, (position // block_size).long()[:, None])[:, 0]
        slots = blocks * block_size + position % block_size
        step_slots.copy_(torch.where(lengths_t > 0, slots, -1).to(torch.int32))
        query.copy_(torch.randn(batch, num_q_heads, head_dim, generator=generator).half())
        seq_lens.copy_(lengths_t)
        graph.replay()
        torch.cuda.synchronize()
        planes = layout == "planes"
        config = make_config(TQGEN_PRESET[cache_dtype], head_dim=head_dim, cache_layout=layout)
        want = reference_decode(config, query.cpu(), pages_of(cache).cpu() if planes else cache.cpu(),
                                block_table.cpu(), seq_lens.cpu(), pi.cpu(), centroids.cpu(), head_dim**-0.5,
                                arguments["key_fp8"])
        assert relative_error(output_buf.cpu(), want) < DECODE_TOLERANCE[torch.float16]


# --- the planes layout in vLLM's allocation -----------------------------------------------------------
def use_layout(monkeypatch, layout):
    """The drop-ins in a cache layout, as a fresh process would be: no module loaded yet."""
    monkeypatch.setattr(vllm, "_modules", {})
    monkeypatch.setattr(vllm, "_modules_by_config", {})
    monkeypatch.setattr(vllm, "_layout", None)
    monkeypatch.setenv(vllm.LAYOUT_VARIABLE, layout)


def pages_of(cache):
    """vLLM's [num_blocks, block_size, Hk, slot] view of its head-major allocation as planes pages
    [num_blocks, Hk, block_size * slot] (a view of the same bytes)."""
    num_blocks, block_size, num_kv_heads, slot_bytes = cache.shape
    return cache.transpose(1, 2).reshape(num_blocks, num_kv_heads, block_size * slot_bytes)


PLANES_CPU_CASES = [("turboquant_k3v4_nc", 128, 16, 4), ("turboquant_k8v4", 64, 32, 1)]
PLANES_GPU_CASES = ([(p, d, 16, 4) for p in vllm.VLLM_PRESETS for d in (64, 128, 256)]
                    + [(p, 128, b, g) for p in ("turboquant_3bit_nc", "turboquant_k8v4") for b in (32, 64, 128)
                       for g in (1, 6, 8)])
PLANES_CASES = ([pytest.param("cpu", *c, marks=CPU, id="cpu-" + "-".join(map(str, c))) for c in PLANES_CPU_CASES]
                + [pytest.param("cuda", *c, marks=GPU, id="cuda-" + "-".join(map(str, c))) for c in PLANES_GPU_CASES])


@pytest.mark.parametrize("device,cache_dtype,head_dim,block_size,group_size", PLANES_CASES)
def test_planes_layout_in_vllms_allocation(device, cache_dtype, head_dim, block_size, group_size, monkeypatch):
    """TQGEN_VLLM_CACHE_LAYOUT=planes: the store writes, into each (block, KV head) page of vLLM's head-major
    allocation, the planes page of docs/format.md's slots (norms corrected) and nothing else; decode and the
    continuation prefill's dequantize read it as the reference does, from the drop-in store's cache and
    from one built here."""
    use_layout(monkeypatch, "planes")
    arguments = vllm.preset_arguments(cache_dtype, head_dim)
    key_fp8, num_kv_heads = arguments["key_fp8"], 2
    slot_bytes = vllm.slot_size_aligned(cache_dtype, head_dim)
    config = make_config(TQGEN_PRESET[cache_dtype], head_dim=head_dim, block_size=block_size, cache_layout="planes")
    layout = Layout.from_config(config)
    pi, centroids = codebook_of(cache_dtype, head_dim, "hadamard")
    key, value, block_table, seq_lens, slot_mapping, num_blocks = ragged_batch(
        block_size, num_kv_heads, head_dim, [block_size + 3, 0, 5], key_fp8)
    cache = vllm_cache(num_blocks, block_size, num_kv_heads, slot_bytes, "head_major", device)
    vllm.triton_turboquant_store(key.to(device), value.to(device), cache, slot_mapping.to(device), pi.to(device),
                                 ((centroids[:-1] + centroids[1:]) / 2).to(device), arguments["mse_bits"],
                                 arguments["key_packed_size"], arguments["value_quant_bits"], key_fp8=key_fp8)

    # format.md's slots of the stored tokens, norms corrected, over the sentinel pages, as planes pages.
    built_slots = reference.as_slots(layout, pages_of(vllm_cache(num_blocks, block_size, num_kv_heads, slot_bytes,
                                                                 "head_major", "cpu")))
    written = slot_mapping >= 0
    mapping = slot_mapping[written].long()
    slots = format_md_slots(key, value, pi, centroids, 8 if key_fp8 else arguments["mse_bits"],
                            arguments["value_quant_bits"], slot_bytes)[written]
    built_slots[mapping // block_size, mapping % block_size] = reference.corrected_key_norms(layout, slots, centroids)
    built = reference.slots_to_pages(layout, built_slots)
    stored = pages_of(cache).cpu()
    assert store_differences(config, stored, built, key.float(), slot_mapping, pi, centroids) == 0

    built_cache = torch.empty_like(cache)
    pages_of(built_cache).copy_(built.to(device))
    query = torch.randn(len(seq_lens), num_kv_heads * group_size, head_dim,
                        generator=torch.Generator().manual_seed(7)).half()
    scale = head_dim**-0.5
    for source, kv_cache in (("the drop-in store", cache), ("format.md", built_cache)):
        out = vllm.triton_turboquant_decode_attention(
            query.to(device), kv_cache, block_table.to(device), seq_lens.to(device), pi.to(device),
            centroids.to(device), scale, PiT=pi.to(device), **arguments)
        want = reference_decode(config, query, pages_of(kv_cache).cpu(), block_table, seq_lens, pi, centroids, scale,
                                key_fp8)
        assert torch.all(out[1] == 0), f"seq_len 0 on a cache from {source}"
        error = relative_error(out.cpu(), want)
        assert error < DECODE_TOLERANCE[torch.float16], f"relative error {error:.2e} on a cache from {source}"

    length = block_size + 3  # the first sequence, through its own row of the block table
    k_out = torch.empty(1, num_kv_heads, length, head_dim, dtype=torch.float16, device=device)
    v_out = torch.empty_like(k_out)
    vllm._tq_full_dequant_kv[(length, num_kv_heads)](
        cache, block_table[:1].to(device), centroids.to(device), k_out, v_out, *k_out.stride()[:3],
        *v_out.stride()[:3], *cache.stride()[:3], block_table.stride(0), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads, MSE_BYTES=head_dim if key_fp8 else math.ceil(head_dim * arguments["mse_bits"] / 8),
        KPS=arguments["key_packed_size"], VQB=arguments["value_quant_bits"],
        VAL_DATA_BYTES=math.ceil(head_dim * arguments["value_quant_bits"] / 8), MSE_BITS=arguments["mse_bits"],
        KEY_FP8=int(key_fp8), BLOCK_D=head_dim, NORM_CORRECTION=int(arguments["norm_correction"]))
    want_keys, want_values = reference.dequantize(layout, stored, block_table[:1], seq_lens[:1],
                                                  None if key_fp8 else pi, None if key_fp8 else centroids)
    keys = k_out[0].float().cpu()
    if not key_fp8:
        keys = keys @ pi  # the backend multiplies the rotated keys by Pi
    assert relative_error(keys, want_keys[0]) < 2e-3
    assert relative_error(v_out[0].float().cpu(), want_values[0]) < 1e-3


@pytest.mark.skipif(not INTERPRET, reason="a CPU test")
def test_planes_layout_refusals_in_one_line(monkeypatch):
    """What the planes layout cannot hold is refused naming it: a position-major cache, MSE keys without norm
    correction, a codebook other than the default, a bad layout name, and a change of layout after a call."""
    use_layout(monkeypatch, "planes")
    p = stored_problem("turboquant_4bit_nc", 64, "cpu", seq_lens=(5,))
    common = (p.query, p.cache, p.block_table, p.seq_lens, p.pi, p.centroids, 0.125)
    arguments = p.arguments

    def refused(match, *args, **changes):
        with pytest.raises(vllm.VllmArgumentError, match=match) as refusal:
            vllm.triton_turboquant_decode_attention(*(args or common), **dict(arguments, **changes))
        assert "\n" not in str(refusal.value)

    position_major = p.cache.contiguous()  # [num_blocks, block_size, Hk, slot] in position order
    refused("needs vLLM's head-major cache", p.query, position_major, *common[2:])
    refused("norm_correction=False", norm_correction=False)
    refused("centroids differ from the default", *common[:5], p.centroids * 1.01, 0.125)
    with pytest.raises(vllm.VllmArgumentError, match="midpoints differ from the default"):
        vllm.triton_turboquant_store(p.key[:1], p.value[:1], p.cache, torch.zeros(1, dtype=torch.int32), p.pi,
                                     torch.linspace(-0.2, 0.2, 15), 4, 34, 4)
    with pytest.raises(vllm.VllmArgumentError, match="the cache layout is 'planes' since the first call"):
        vllm.set_cache_layout("slots")
    vllm.set_cache_layout("planes")  # the layout in use: accepted
    use_layout(monkeypatch, "pages")
    with pytest.raises(vllm.VllmArgumentError, match="TQGEN_VLLM_CACHE_LAYOUT='pages' is not one of slots, planes"):
        vllm.cache_layout()


def test_set_cache_layout_refuses_an_unknown_layout_before_any_call(monkeypatch):
    """A misspelt layout is refused before the first call too (it then ran slots as if nothing were wrong), and the
    layout stays as it was."""
    use_layout(monkeypatch, "slots")
    with pytest.raises(vllm.VllmArgumentError, match="cache layout 'plane' is not one of slots, planes"):
        vllm.set_cache_layout("plane")
    assert vllm.cache_layout() == "slots"


def test_cache_layout_for_runs_a_layout_with_modules_of_its_own_then_restores(monkeypatch):
    """tqgen bench times both layouts in one process: inside, the other layout and a module table of its own, kept
    for the layout's next use (tools enter it around every few calls); after, the layout and modules as they were
    (an engine's modules are not lost)."""
    use_layout(monkeypatch, "slots")
    monkeypatch.setattr(vllm, "_modules_of_layout", {})
    module = vllm._module("test", torch.device("cpu"), 64, 16, True, 0, 64, 4, False)
    with vllm.cache_layout_for("planes"):
        assert vllm.cache_layout() == "planes" and vllm._modules == {}
        planes = vllm._module("test", torch.device("cpu"), 64, 16, True, 0, 64, 4, False)
        assert planes.CONFIG["cache_layout"] == "planes"
    assert vllm.cache_layout() == "slots"
    assert list(vllm._modules.values()) == [module]
    with vllm.cache_layout_for("planes"):
        assert list(vllm._modules.values()) == [planes]  # found, not built again
    with vllm.cache_layout_for("slots"):
        assert vllm._modules == {}  # the slots layout's own table, not the process's
    with pytest.raises(vllm.VllmArgumentError, match="cache layout 'pages' is not one of slots, planes"):
        with vllm.cache_layout_for("pages"):
            pass
