"""arch auto: `tqgen build` writes one module per known arch and a dispatcher, on any machine.

The build here runs without a GPU, like a CPU CI pipeline: the module it writes must still carry the
committed Hopper tuning (tuned/) and pick the sm90 variant on a Hopper GPU. Devices are faked
where a GPU is needed to pick a variant (torch.cuda.get_device_capability); the kernels run on CPU
tensors in the interpreter, and on the GPU in the test marked gpu.
"""

import dataclasses
import errno
import hashlib
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import HAS_CUDA, INTERPRET
from tqgen import config as config_mod
from tqgen import dispatch, emit, render, tuned_files
from tqgen.errors import TqgenError

REPO = Path(__file__).resolve().parent.parent
PLANES = {"k3v4": REPO / "configs" / "k3v4-d128-planes.yaml", "k8v4": REPO / "configs" / "k8v4-d128-planes.yaml"}
_fresh_names = itertools.count()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each planes config built with arch auto, as `tqgen build` does here: {preset: emit.Built}."""
    out = tmp_path_factory.mktemp("auto")
    return {preset: emit.build_files(path, out) for preset, path in PLANES.items()}


@pytest.fixture
def fresh_import():
    """fresh_import(path): the dispatcher imported under a name of its own, so that no other test's choice
    of variant per device (cached in the module) is seen. Its variants are imported afresh too."""
    names = []

    def load(path):
        name = f"tqgen_dispatch_test_{next(_fresh_names)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        names.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in names:
        for key in [key for key in sys.modules if key == name or key.startswith(name + "_")]:
            del sys.modules[key]


def fake_capabilities(monkeypatch, capabilities):
    """torch.cuda.get_device_capability answers from {device index: (major, minor)}; returns the queries."""
    asked = []

    def capability(device=None):
        index = torch.device(device).index
        asked.append(index)
        return capabilities[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    return asked


def committed_buckets(config):
    """The winners of each committed tuned/<GPU>/<artifact>.json, by the GPU it names: {device name: {bucket:
    (block_kv, num_warps, num_stages, num_splits)}}, with the query's rotation last where the tuner chose it."""
    winners = {}
    for path in (REPO / "tuned").glob(f"*/{config.artifact_name()}.json"):
        document = json.loads(path.read_text())
        winners[document["metadata"]["device_name"]] = {key: tuned_files.baked_launch(entry["best"])
                                                        for key, entry in document["buckets"].items()}
    return winners


# --------------------------------------------------------------------------
# what a build without a GPU writes
# --------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PLANES))
def test_auto_build_writes_every_arch_exactly_as_an_explicit_build(built, preset, tmp_path):
    config = config_mod.load(PLANES[preset])
    result = built[preset]
    assert result.path.name == f"{config.artifact_name()}.py" and not re.search(r"_sm\d+\.py$", result.path.name)
    assert [v.arch for v in result.variants] == list(config_mod.KNOWN_ARCHES)
    for variant in result.variants:
        explicit = emit.build(dataclasses.replace(config, arch=variant.arch), tmp_path)
        assert variant.path.name == explicit.name
        assert variant.path.read_bytes() == explicit.read_bytes(), f"{variant.arch} differs from its explicit build"
    folder = sorted(p.name for p in result.path.parent.iterdir() if p.name.startswith(config.artifact_name()))
    assert folder == sorted([result.path.name] + [v.path.name for v in result.variants])


@pytest.mark.parametrize("preset", sorted(PLANES))
def test_auto_module_carries_the_committed_launches_and_picks_sm90_on_hopper(built, preset, fresh_import,
                                                                              monkeypatch):
    config = config_mod.load(PLANES[preset])
    tq = fresh_import(built[preset].path)
    asked = fake_capabilities(monkeypatch, {0: (9, 0), 1: (8, 0)})
    on_h200, on_a100 = tq.variant_for(torch.device("cuda", 0)), tq.variant_for("cuda:1")
    assert on_h200.CONFIG["arch"] == "sm90" and on_a100.CONFIG["arch"] == "sm80"
    committed = committed_buckets(dataclasses.replace(config, arch="sm90"))
    baked = {device: launches["buckets"] for device, launches in on_h200.TUNED_LAUNCHES.items()}
    assert committed and baked == committed
    assert all(len(winners) >= 4 for winners in committed.values()) and on_a100.TUNED_LAUNCHES == {}
    # The sm90 variant decodes on the Gluon stage 1; for fp8 keys only with the hardware converter (sm89+).
    assert hasattr(on_h200, "tq_decode_stage1_mma")
    assert hasattr(on_a100, "tq_decode_stage1_mma") == (preset != "k8v4")
    assert ("float8e4nv" in Path(on_h200.__file__).read_text()) == (preset == "k8v4")
    assert "float8e4nv" not in Path(on_a100.__file__).read_text()
    # Picked once per device: later calls are a dict lookup.
    assert tq.variant_for(torch.device("cuda", 0)) is on_h200 and tq.variant_for("cuda:1") is on_a100
    assert asked == [0, 1]
    assert tq.variant_for("cpu").CONFIG["arch"] == "sm80"  # CPU tensors: the interpreter runs sm80


def test_dispatcher_picks_the_arch_that_resolve_arch_picks(built, fresh_import, monkeypatch):
    config = config_mod.load(PLANES["k3v4"])
    capabilities = [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (11, 0), (12, 0), (12, 1)]
    fake_capabilities(monkeypatch, dict(enumerate(capabilities)))
    tq = fresh_import(built["k3v4"].path)
    for index, capability in enumerate(capabilities):
        expected = config_mod.resolve_arch(config, capability).arch
        assert tq.variant_for(f"cuda:{index}").CONFIG["arch"] == expected, capability


def test_a_device_older_than_every_variant_is_refused_with_one_line(built, fresh_import, monkeypatch):
    tq = fresh_import(built["k3v4"].path)
    fake_capabilities(monkeypatch, {3: (7, 5)})
    with pytest.raises(tq.LaunchError) as caught:
        tq.variant_for("cuda:3")
    message = str(caught.value)
    assert "\n" not in message and "cuda:3" in message and "7.5" in message and "8.0 or newer" in message


# --------------------------------------------------------------------------
# the API
# --------------------------------------------------------------------------
def public_names(module) -> set:
    """Names a module defines without a leading underscore, the imported ones left out (read from its file)."""
    source = Path(module.__file__).read_text()
    imported = set()
    for match in re.finditer(r"^\s*(?:from \S+ )?import (.+)$", source, re.M):
        imported |= {part.split(" as ")[-1].strip().split(".")[0] for part in match.group(1).split(",")}
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and name not in imported and not isinstance(value, types.ModuleType)}


@pytest.mark.parametrize("preset", sorted(PLANES))
def test_dispatcher_has_the_variants_public_names(built, preset, fresh_import, monkeypatch):
    tq = fresh_import(built[preset].path)
    fake_capabilities(monkeypatch, {index: config_mod.arch_capability(arch)
                                    for index, arch in enumerate(config_mod.KNOWN_ARCHES)})
    variants = [tq.variant_for(f"cuda:{index}") for index in range(len(config_mod.KNOWN_ARCHES))]
    assert [v.CONFIG["arch"] for v in variants] == list(config_mod.KNOWN_ARCHES)
    union = set().union(*map(public_names, variants))
    assert {"store", "decode", "dequantize", "make_cache", "DecodeWorkspace", "LaunchError", "HEAD_DIM",
            "PAGE_SIZE", "TUNED_LAUNCHES", "decode_launch"} <= union
    assert set(tq.__all__) == union | set(dispatch.DISPATCHER_NAMES)
    assert set(tq.__all__) <= set(dir(tq))
    portable = variants[0]
    for name in sorted(public_names(portable)):  # every name of the CPU's variant reads through
        value = getattr(tq, name)
        if name in ("CONFIG", "CONFIG_HASH"):  # the dispatcher's own: what it was built from
            continue
        if not callable(value) or name == "LaunchError":
            assert value is getattr(portable, name) or value == getattr(portable, name), name
    assert tq.CONFIG == config_mod.load(PLANES[preset]).to_dict() and tq.CONFIG["arch"] == "auto"
    assert tq.CONFIG_HASH == config_mod.load(PLANES[preset]).hash()
    # One exception class for all: `except tq.LaunchError` catches every variant's refusals.
    assert all(v.LaunchError is tq.LaunchError for v in variants)


def test_forwarded_functions_show_the_variants_signatures_and_docs(built, fresh_import):
    import inspect

    tq = fresh_import(built["k3v4"].path)
    portable = tq.variant_for("cpu")
    for name in ("store", "decode", "dequantize", "make_cache", "DecodeWorkspace", "default_rotation"):
        assert inspect.signature(getattr(tq, name)) == inspect.signature(getattr(portable, name)), name
        assert getattr(tq, name).__doc__ == getattr(portable, name).__doc__, name


def test_assigning_a_setting_reaches_every_variant(built, fresh_import, monkeypatch):
    tq = fresh_import(built["k3v4"].path)
    fake_capabilities(monkeypatch, {0: (9, 0)})
    portable = tq.variant_for("cpu")
    tq.MMA_STAGE1 = False
    h200 = tq.variant_for("cuda:0")  # imported after the assignment
    assert portable.MMA_STAGE1 is False and h200.MMA_STAGE1 is False and tq.MMA_STAGE1 is False


# --------------------------------------------------------------------------
# calls through the dispatcher (CPU tensors, interpreter)
# --------------------------------------------------------------------------
@pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")
@pytest.mark.parametrize("preset", sorted(PLANES))
def test_calls_through_the_dispatcher_match_the_variant_bit_for_bit(built, preset, fresh_import):
    tq = fresh_import(built[preset].path)
    direct = emit.import_module_file(built[preset].variants[0].path)  # the sm80 module, imported on its own
    assert direct is not tq.variant_for("cpu") and direct.CONFIG["arch"] == "sm80"
    generator = torch.Generator().manual_seed(7)
    kv_heads, group, tokens = 1, 4, 20
    key = torch.randn(tokens, kv_heads, 128, generator=generator).half()
    value = torch.randn(tokens, kv_heads, 128, generator=generator).half()
    slots = 16 + torch.arange(tokens)  # blocks 1 and 2
    caches = []
    for module in (tq, direct):
        cache = module.make_cache(4, kv_heads, "cpu")
        module.store(key, value, cache, slots)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1]) and caches[0].any()
    block_table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([tokens, 5], dtype=torch.int32)
    query = torch.randn(2, kv_heads * group, 128, generator=generator).half()
    ours = tq.decode(query, caches[0], block_table, seq_lens)
    theirs = direct.decode(query, caches[1], block_table, seq_lens)
    assert torch.equal(ours, theirs) and torch.isfinite(ours).all()
    workspace = tq.DecodeWorkspace(2, kv_heads * group, 8, device="cpu")
    assert isinstance(workspace, tq.DecodeWorkspace)
    out = torch.empty_like(ours)
    tq.decode(query=query, kv_cache=caches[0], block_table=block_table, seq_lens=seq_lens, out=out,
              workspace=workspace, num_splits=4)
    assert torch.equal(out, direct.decode(query, caches[1], block_table, seq_lens, num_splits=4))
    for ours, theirs in zip(tq.dequantize(caches[0], block_table, seq_lens),
                            direct.dequantize(caches[1], block_table, seq_lens)):
        assert torch.equal(ours, theirs)
    with pytest.raises(tq.LaunchError, match="head_dim"):
        tq.decode(query[..., :64], caches[0], block_table, seq_lens)


class ReportsDevice(torch.Tensor):
    """A CPU tensor that reports another device (`reported`): what the launchers' device checks read."""

    @property
    def device(self):
        return self.reported


def reporting(tensor, device):
    tensor = torch.Tensor._make_subclass(ReportsDevice, tensor)
    tensor.reported = torch.device(device)
    return tensor


def test_a_call_spread_over_gpus_of_two_archs_is_refused_naming_the_argument(built, fresh_import, monkeypatch):
    """An H200 (cuda:0) and an A100 (cuda:1) in one process, and a launcher given a cache on cuda:1 with another
    tensor on cuda:0: the call runs in the variant for the cache's device, whatever its argument order, and is
    refused as a call spread over two devices, naming the argument. (In the variant for the query's or key's
    device, sm90, whose fp8 keys need compute capability 8.9, the cache's device was refused instead, as too old
    for a module "built for sm90", with the advice to rebuild with arch: auto.)"""
    tq = fresh_import(built["k8v4"].path)
    fake_capabilities(monkeypatch, {0: (9, 0), 1: (8, 0)})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # the cache's device: no device switch
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    cache = reporting(torch.zeros(4, 2, tq.PAGE_BYTES, dtype=torch.uint8), cuda1)
    table = reporting(torch.zeros(2, 2, dtype=torch.int32), cuda1)
    lens = reporting(torch.ones(2, dtype=torch.int32), cuda1)
    query = reporting(torch.zeros(2, 8, 128, dtype=torch.float16), cuda0)
    key = reporting(torch.zeros(3, 2, 128, dtype=torch.float16), cuda0)
    slots = reporting(torch.zeros(3, dtype=torch.int64), cuda1)
    calls = {
        "decode: query": lambda: tq.decode(query, cache, table, lens),
        "decode_multi: query": lambda: tq.decode_multi(reporting(torch.zeros(2, 1, 8, 128), cuda0), cache, table, lens),
        "decode_ragged: query": lambda: tq.decode_ragged(query, cache, table, lens, torch.arange(3), 1),
        "store: key": lambda: tq.store(key, key, cache, slots),
    }
    for named, call in calls.items():
        with pytest.raises(tq.LaunchError) as caught:
            call()
        assert str(caught.value) == f"{named} is on cuda:0, expected cuda:1 like the cache"


# --------------------------------------------------------------------------
# files that belong together
# --------------------------------------------------------------------------
def test_a_failed_auto_build_leaves_the_earlier_files_intact(tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = emit.build_files(PLANES["k3v4"], out)
    before = {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.iterdir()}
    # Without the tuned files the sm90 variant and the dispatcher change: the second temp file fails.
    real_fdopen, opened = os.fdopen, []

    def fdopen(fd, *args, **kwargs):
        opened.append(fd)
        if len(opened) == 2:
            os.close(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(TqgenError) as caught:
        emit.build_files(PLANES["k3v4"], out, tmp_path / "no-tuning")
    monkeypatch.undo()
    message = str(caught.value)
    assert len(opened) == 2 and "\n" not in message and "No space left on device" in message
    assert {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.iterdir()} == before  # no temp file either
    # A rename that fails (the first one) also replaces nothing.
    def replace(*args):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(TqgenError, match="Read-only"):
        emit.build_files(PLANES["k3v4"], out, tmp_path / "no-tuning")
    monkeypatch.undo()
    assert {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.iterdir()} == before
    second = emit.build_files(PLANES["k3v4"], out, tmp_path / "no-tuning")  # and the next build works
    changed = {p.name for p in out.iterdir() if p.read_bytes() != before[p.name][0]}
    assert changed == {first.path.name, first.variants[3].path.name} and second.variants[3].tuned == {}


def test_a_variant_from_another_build_is_refused_not_mixed(tmp_path, fresh_import, monkeypatch):
    out = tmp_path / "out"
    built = emit.build_files(PLANES["k3v4"], out)
    sm90 = built.variants[3].path
    sm90.write_bytes(emit.build_files(PLANES["k3v4"], tmp_path / "other", tmp_path / "no-tuning")
                     .variants[3].path.read_bytes())
    tq = fresh_import(built.path)
    fake_capabilities(monkeypatch, {0: (9, 0)})
    with pytest.raises(ImportError, match=f"{re.escape(str(sm90))} is not the sm90 variant") as caught:
        tq.variant_for("cuda:0")
    assert "\n" not in str(caught.value)
    sm90.unlink()
    with pytest.raises(ImportError, match="cannot read its sm90 variant"):
        tq.variant_for("cuda:0")


def test_a_variant_rewritten_within_the_same_second_is_imported_as_checked(tmp_path, fresh_import, monkeypatch):
    """Python's bytecode cache trusts a .pyc while the source's size and mtime in whole seconds match: a variant
    rebuilt within the same second with as many bytes must run as the bytes whose hash the dispatcher checked."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    built = emit.build_files(PLANES["k8v4"], tmp_path / "out")
    sm80 = built.variants[0].path
    stamp = (1_700_000_000, 1_700_000_000)
    os.utime(sm80, stamp)
    os.utime(built.path, stamp)
    tq = fresh_import(built.path)
    assert tq.variant_for("cpu")._MAX_GROUP_SIZE == 64  # imported once: its .pyc written
    old = sm80.read_bytes()
    new = old.replace(b"_MAX_GROUP_SIZE = 64", b"_MAX_GROUP_SIZE = 65")
    sm80.write_bytes(new)
    os.utime(sm80, stamp)  # the same second, the same size
    # The dispatcher of the rebuild: the same but for the variant's hash.
    dispatcher = built.path.read_text().replace(hashlib.sha256(old).hexdigest(), hashlib.sha256(new).hexdigest())
    built.path.write_text(dispatcher)
    os.utime(built.path, (stamp[0] + 10, stamp[1] + 10))  # (the test's own import of it checks its mtime)
    assert fresh_import(built.path).variant_for("cpu")._MAX_GROUP_SIZE == 65


def test_dispatcher_imports_without_tqgen(built, tmp_path):
    """sys.path.insert(0, folder); import <artifact>: all a deployment needs (torch and triton)."""
    folder = built["k8v4"].path.parent
    program = (f"import sys; sys.path.insert(0, {str(folder)!r}); import {built['k8v4'].path.stem} as tq; "
               "print(tq.variant_for('cpu').__name__, tq.PAGE_SIZE, 'tqgen' in sys.modules)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"{built['k8v4'].path.stem}_sm80", "16", "False"]


@pytest.mark.parametrize("preset", sorted(PLANES))
def test_dispatcher_source_is_tidy_and_imports_only_its_runtime(built, preset):
    from test_render import assert_tidy

    source = built[preset].path.read_text()
    assert_tidy(source)  # <= 120 columns, PEP 8 spacing
    assert "{{" not in source and "{%" not in source
    imported = set(re.findall(r"^import (\S+)$", source, re.M)) | set(re.findall(r"^from (\S+) import", source, re.M))
    assert imported == {"hashlib", "importlib.machinery", "importlib.util", "inspect", "os", "sys", "threading",
                        "types", "torch", "triton"}


def test_the_dispatcher_template_is_not_in_the_module_template_hash(tmp_path, monkeypatch):
    """Explicit-arch modules record render.template_hash: the dispatcher's template must not change them."""
    import shutil

    original = render.template_hash()
    copy = tmp_path / "templates"
    shutil.copytree(render.template_dir(), copy)
    monkeypatch.setattr(render, "template_dir", lambda: copy)
    with open(copy / render.DISPATCHER_TEMPLATE, "a") as handle:
        handle.write("# an edit\n")
    assert render.template_hash() == original


# --------------------------------------------------------------------------
# on the GPU
# --------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset", sorted(PLANES))
def test_auto_module_decodes_on_the_gpu_with_its_arch_variant(preset, tmp_path, monkeypatch):
    config = config_mod.load(PLANES[preset])
    capability = tuple(torch.cuda.get_device_capability())
    arch = config_mod.resolve_arch(config, capability).arch
    tq = emit.import_module_file(emit.build(config, tmp_path / "auto"))
    direct = emit.import_module_file(emit.build(dataclasses.replace(config, arch=arch), tmp_path / "direct"))
    variant = tq.variant_for(torch.device("cuda", torch.cuda.current_device()))
    assert variant.CONFIG["arch"] == arch and (capability[0] != 9 or arch == "sm90")
    assert variant.TUNED_LAUNCHES == direct.TUNED_LAUNCHES
    calls = []
    real_decode = variant.decode
    monkeypatch.setattr(variant, "decode", lambda *args, **kwargs: calls.append(1) or real_decode(*args, **kwargs))
    generator = torch.Generator().manual_seed(3)
    kv_heads, group, batch, tokens = 8, 4, 8, 3000
    blocks = (tokens + 15) // 16
    key = torch.randn(batch * tokens, kv_heads, 128, generator=generator).half().cuda()
    value = torch.randn(batch * tokens, kv_heads, 128, generator=generator).half().cuda()
    slots = torch.arange(batch * blocks * 16, device="cuda").view(batch, blocks * 16)[:, :tokens].reshape(-1)
    caches = []
    for module in (tq, direct):
        cache = module.make_cache(batch * blocks, kv_heads, "cuda")
        module.store(key, value, cache, slots)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])
    block_table = torch.arange(batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, kv_heads * group, 128, generator=generator).half().cuda()
    ours = tq.decode(query, caches[0], block_table, seq_lens)
    theirs = direct.decode(query, caches[1], block_table, seq_lens)
    assert calls == [1]
    assert tq.decode_launch(batch, kv_heads, group, blocks * 16, query.device) == \
        direct.decode_launch(batch, kv_heads, group, blocks * 16, query.device)
    assert torch.equal(ours, theirs) and torch.isfinite(ours).all()
