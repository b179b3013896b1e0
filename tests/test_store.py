"""The store kernel: byte-exact against the reference (MSE key codes of coordinates on a decision
boundary excepted: tqgen.verify.store_differences), and nothing written outside its slots."""

import pytest
import torch

from conftest import PRESETS, codebook_kwargs, make_config
from tqgen import reference
from tqgen.verify import store_differences
from tqgen.testing import paged_batch

SENTINEL = 0xA5


def _store_both(module, config, batch, device, num_kv_heads):
    kwargs = codebook_kwargs(module, config, device)
    cache = torch.full((batch.num_blocks, config.block_size, num_kv_heads, module.SLOT_BYTES), SENTINEL,
                       dtype=torch.uint8, device=device)
    expected = cache.clone()
    module.store(batch.key, batch.value, cache, batch.slot_mapping, **kwargs)
    reference.store(config, batch.key, batch.value, expected, batch.slot_mapping,
                    kwargs.get("rotation"), kwargs.get("centroids"))
    differing = store_differences(config, cache, expected, batch.key, batch.slot_mapping,
                                  kwargs.get("rotation"), kwargs.get("centroids"))
    return cache, expected, differing


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (96, torch.bfloat16), (64, torch.float32)])
def test_store_matches_reference_bytes(device, build_module, preset, head_dim, dtype):
    config = make_config(preset, head_dim=head_dim)
    module = build_module(config)
    generator = torch.Generator().manual_seed(head_dim)
    batch = paged_batch(config, [1, 15, 17, 40], num_kv_heads=2, device=device, dtype=dtype, generator=generator)
    _, _, differing = _store_both(module, config, batch, device, num_kv_heads=2)
    assert differing == 0, f"{differing} bytes differ"


@pytest.mark.parametrize("block_size", [1, 32])
def test_store_other_page_sizes(device, build_module, block_size):
    config = make_config("k3v4", block_size=block_size)
    module = build_module(config)
    batch = paged_batch(config, [3, 33], num_kv_heads=3, device=device, generator=torch.Generator().manual_seed(1))
    _, _, differing = _store_both(module, config, batch, device, num_kv_heads=3)
    assert differing == 0


def test_negative_slots_are_skipped_and_nothing_else_changes(device, build_module):
    config = make_config("k4v4")
    module = build_module(config)
    batch = paged_batch(config, [20, 9], num_kv_heads=2, device=device, generator=torch.Generator().manual_seed(2))
    skipped = torch.zeros_like(batch.slot_mapping, dtype=torch.bool)
    skipped[::3] = True
    batch.slot_mapping = torch.where(skipped, torch.full_like(batch.slot_mapping, -1), batch.slot_mapping)
    cache, _, differing = _store_both(module, config, batch, device, num_kv_heads=2)
    assert differing == 0
    # Every byte outside the written slots still holds the sentinel.
    written = torch.zeros(cache.shape[:3], dtype=torch.bool)
    kept = batch.slot_mapping[batch.slot_mapping >= 0].cpu()
    written[kept // config.block_size, kept % config.block_size] = True
    assert torch.all(cache.cpu()[~written] == SENTINEL)
    assert not torch.all(cache.cpu()[written] == SENTINEL)


def test_fp8_keys_round_to_nearest_even_and_saturate(device, build_module):
    """Arbitrary (not fp8-representable) keys: the kernel's integer e4m3fn encoder vs torch's cast."""
    config = make_config("k8v4")
    module = build_module(config)
    generator = torch.Generator().manual_seed(3)
    batch = paged_batch(config, [64], num_kv_heads=2, device=device, dtype=torch.float32, generator=generator)
    magnitudes = torch.logspace(-12, 3.2, batch.key.numel(), base=2.0)  # subnormals .. past 448 (saturates)
    signs = torch.where(torch.rand(batch.key.numel(), generator=generator) < 0.5, -1.0, 1.0)
    batch.key = (magnitudes * signs).reshape(batch.key.shape).to(device)
    batch.key[0, 0, :4] = torch.tensor([0.0, -0.0, 448.0, -1000.0])
    cache, expected, _ = _store_both(module, config, batch, device, num_kv_heads=2)
    assert torch.equal(cache.cpu(), expected.cpu())  # fp8 keys: every byte, no exceptions


@pytest.mark.parametrize("layout", ["slots", "planes"])
def test_unvalidated_slots_past_the_cache_are_skipped_not_written_out_of_bounds(device, build_module, layout):
    """validate=False (and CUDA-graph capture) skip the host check of slot_mapping: the kernel
    must then drop slots past the cache, never write past its end."""
    config = make_config("k3v4", cache_layout=layout)
    module = build_module(config)
    kwargs = codebook_kwargs(module, config, device)
    reference_cache = module.make_cache(4, 2, device)
    guarded = torch.full((2 * reference_cache.numel() + 64,), SENTINEL, dtype=torch.uint8, device=device)
    cache = guarded[: reference_cache.numel()].view(reference_cache.shape)
    cache.fill_(0)
    key = torch.randn(4, 2, 128, device=device, generator=torch.Generator(device).manual_seed(3))
    value = torch.randn(4, 2, 128, device=device, generator=torch.Generator(device).manual_seed(4))
    num_slots = 4 * config.block_size
    slots = torch.tensor([0, num_slots, 5, num_slots + 7], device=device)
    with pytest.raises(module.LaunchError, match=f"slot_mapping has slot {num_slots + 7}"):
        module.store(key, value, cache, slots, **kwargs)
    module.store(key, value, cache, slots, validate=False, **kwargs)
    assert torch.all(guarded[cache.numel():] == SENTINEL), "bytes written past the cache"
    module.store(key[::2], value[::2], reference_cache, slots[::2], **kwargs)
    assert torch.equal(cache, reference_cache)  # the in-range tokens, and nothing else


def test_store_rejects_bad_arguments(device, build_module):
    config = make_config("k3v4")
    module = build_module(config)
    cache = module.make_cache(4, 2, device)
    key = torch.randn(3, 2, 128, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(module.LaunchError, match="key must be"):
        module.store(key[:, :1], key[:, :1], cache, slots)
    with pytest.raises(module.LaunchError, match="slots are 117 bytes"):
        module.store(key, key, cache[..., :117], slots)
    with pytest.raises(module.LaunchError, match="slot_mapping must be int64 or int32"):
        module.store(key, key, cache, slots.float())
    with pytest.raises(module.LaunchError, match="slot_mapping has slot 64"):
        module.store(key, key, cache, torch.tensor([0, 1, 64], device=device))
