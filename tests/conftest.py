"""Shared fixtures: where kernels run, and the emitted module of each config.

Kernel tests take the `device` fixture. Without CUDA they run on the CPU under
Triton's interpreter (TRITON_INTERPRET=1, set here before anything imports
triton). With CUDA, run them with `pytest -m gpu`: the same tests then launch
the compiled kernels on the GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available() and not INTERPRET


def _skip_the_interpreters_repeated_language_patches():
    """Triton's interpreter patches triton.language's builtins (about 500 attributes, found by inspect.getmembers)
    at every kernel launch, and again at every call of a @triton.jit helper inside it: the same patches onto the same
    modules, which the launch's own patch already made and undoes only at its end. The CPU suite spent about a third
    of its interpreter time there. Here a helper's call inside a launch patches only the language modules that the
    launch has not patched yet; a launch patches and restores as before. With another triton, whose interpreter
    lacks what this wraps, nothing changes."""
    import inspect
    import weakref

    import triton.language as tl
    from triton.runtime import interpreter

    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return
    patch_lang, run_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched = []  # per launch in progress (innermost last): the language modules patched so far, None before any

    def launch(self, *args, **kwargs):
        patched.append(None)
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            patched.pop()

    languages = weakref.WeakKeyDictionary()  # a function -> the language modules among its globals

    def patch_once(fn):
        seen = languages.get(fn)
        if seen is None:
            seen = languages[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                             if inspect.ismodule(value) and value in (tl, tl.core))
        if patched and patched[-1] is not None:
            if seen <= patched[-1]:
                return interpreter._LangPatchScope()  # a helper's call: patched already, nothing to undo
            seen |= patched[-1]  # (triton.language's own helpers see triton.language.core, which kernels rarely do)
        if patched:
            patched[-1] = seen
        return patch_lang(fn)

    interpreter.GridExecutor.__call__ = launch
    interpreter._patch_lang = patch_once


if INTERPRET:
    _skip_the_interpreters_repeated_language_patches()

import tqgen  # noqa: E402  (after TRITON_INTERPRET is settled)
from tqgen import config as config_mod  # noqa: E402
from tqgen import testing  # noqa: E402
from tqgen import reference  # noqa: E402
from tqgen.testing import relative_error  # noqa: E402
from tqgen.testing import DECODE_TOLERANCE  # noqa: E402
from tqgen.layout import Layout  # noqa: E402

DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU kernels need TRITON_INTERPRET=1")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]

PRESETS = {
    "k8v4": dict(key_format="fp8", value_bits=4),
    "k4v4": dict(key_format="mse", key_bits=4, value_bits=4),
    "k3v4": dict(key_format="mse", key_bits=3, value_bits=4),
    "k3v3": dict(key_format="mse", key_bits=3, value_bits=3),
}


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# --- GPU runs (tools/run_gpu.sh): the suite in shards, and failures logged as they happen ---------------------
def _shard(text):
    """TQGEN_TEST_SHARD "i/n" -> (i, n), 1 <= i <= n; anything else is a usage error naming the variable."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise pytest.UsageError(f"TQGEN_TEST_SHARD must be i/n with 1 <= i <= n (for example 1/2), got {text!r}")
    return int(index), int(count)


def pytest_collection_modifyitems(config, items):
    """TQGEN_TEST_SHARD=i/n keeps the i-th of every n collected tests (interleaved, so that each shard takes a like
    share of every file's slow tests): the GPU suite in n device calls where one call's time limit cannot hold it."""
    text = os.environ.get("TQGEN_TEST_SHARD")
    if not text:
        return
    index, count = _shard(text)
    kept = items[index - 1::count]
    config.hook.pytest_deselected(items=[item for position, item in enumerate(items) if position % count != index - 1])
    items[:] = kept


def pytest_runtest_logreport(report):
    """TQGEN_FAILURE_LOG=FILE appends each failing test's id, phase and error (the first line of its exception's
    message, else the last line of its report) to FILE as it fails: a run stopped by a time limit, before pytest's
    summary, still names its failures. Written by the controlling process only (pytest-xdist's workers report
    theirs to it)."""
    path = os.environ.get("TQGEN_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    message = (getattr(crash, "message", None) or "").strip()  # the last report line is only "file:line: Error"
    lines = message.splitlines()[:1] or report.longreprtext.strip().splitlines()[-1:]
    with open(path, "a") as log:
        log.write(f"{report.nodeid} [{report.when}]: {lines[0] if lines else ''}\n")


def offline_compile_reports(*args, timeout=900, environment=None):
    """Run `python3 ARGS` in the repository without the interpreter (triton then compiles for a GPU target offline
    and launches nothing), with `environment`'s variables set too, and return the JSON objects it printed, one a
    line; fail with its stderr if it failed."""
    environment = {**{name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"},
                   **(environment or {})}
    environment.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what triton 3.9 assumes, without its warning
    result = subprocess.run([sys.executable, *args], cwd=Path(__file__).resolve().parent.parent, env=environment,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def skip_a_launch_the_interpreter_already_ran(device, launch, grid):
    """Skip a CPU case whose launch (block_kv, num_warps, num_stages) differs from an earlier one of `grid` only in
    warps and stages: the interpreter runs each program's block operations whole whatever the warps and stages,
    and off the GPU decode takes the tl.dot kernels, whose source has no branch on either (the launcher checks
    them alike). The GPU runs every launch."""
    first = min(other for other in grid if other[0] == launch[0])
    if device == "cpu" and tuple(launch) != first:
        pytest.skip(f"the interpreter runs a launch of {launch[0]}-token tiles as it ran {first}")


def make_config(preset: str, head_dim: int = 128, **overrides) -> config_mod.Config:
    """A preset at a head dim, arch resolved for the machine running the tests."""
    fields = dict(PRESETS[preset], head_dim=head_dim, **overrides)
    return config_mod.resolve_arch(config_mod.from_mapping(fields, f"<{preset}-d{head_dim}>"))


@pytest.fixture(scope="session")
def build_module(tmp_path_factory):
    """build_module(config) -> the imported emitted module (built once per config)."""
    out_dir = tmp_path_factory.mktemp("modules")
    modules = {}

    def build(config):
        if config not in modules:
            modules[config] = tqgen.load(config, out_dir)
        return modules[config]

    return build


def codebook_kwargs(module, config, device):
    """The rotation/centroids keyword arguments a module's launchers take (none for fp8)."""
    assert module.KEY_FORMAT == config.key_format
    return testing.codebook_kwargs(module, device)


def position_major_cache(module, num_blocks, num_kv_heads, device):
    """A fresh slots cache in the other dim order the kernels take (testing.as_position_major); make_cache's is
    head-major, as vLLM allocates it."""
    return testing.as_position_major(module.make_cache(num_blocks, num_kv_heads, device))


def stored_cache(module, config, seq_lens, device, num_kv_heads=2, seed=0, codebook=None, position_major=False):
    """A random ragged batch (testing.paged_batch) stored into a fresh cache by the module: (batch, cache).
    `codebook` (rotation/centroids keyword arguments) replaces the module's defaults; `position_major` (slots)
    stores into a position_major_cache rather than make_cache's."""
    batch = testing.paged_batch(config, seq_lens, num_kv_heads, device=device,
                                generator=torch.Generator().manual_seed(seed))
    if position_major:
        cache = position_major_cache(module, batch.num_blocks, num_kv_heads, device)
    else:
        cache = module.make_cache(batch.num_blocks, num_kv_heads, device)
    kwargs = codebook if codebook is not None else codebook_kwargs(module, config, device)
    # Decode tests also pass unsorted centroids (test_decode, test_decode_mma), to check that decode reads
    # whatever codebook it is given. The store refuses those unless told not to check (validate=False, its
    # documented contract; the refusal is tested in test_launch_validation): its codes then quantize badly
    # but are what the kernels and the reference must both decode.
    centroids = kwargs.get("centroids")
    unsorted = centroids is not None and bool((centroids[1:] < centroids[:-1]).any())
    module.store(batch.key, batch.value, cache, batch.slot_mapping, validate=not unsorted, **kwargs)
    return batch, cache


def check_decode(module, config, device, seq_lens, num_kv_heads=2, group_size=4, dtype=torch.float32, seed=0,
                  codebook=None, strided_query=False, position_major=False, **launch):
    """Decode a random ragged batch with the module and compare it with the float64 reference; returns the output.
    `codebook` (rotation/centroids keyword arguments) replaces the module's defaults; `strided_query` passes
    the query as a view whose head dim is not contiguous; `position_major` (slots) a position-major cache."""
    kwargs = codebook if codebook is not None else codebook_kwargs(module, config, device)
    batch, cache = stored_cache(module, config, seq_lens, device, num_kv_heads, seed, kwargs, position_major)
    generator = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(len(seq_lens), num_kv_heads * group_size, config.head_dim, generator=generator)
    query = query.to(device=device, dtype=dtype)
    if strided_query:  # same values, laid out [head_dim, heads, batch] underneath
        query = query.permute(2, 1, 0).contiguous().permute(2, 1, 0)
        assert query.stride(2) != 1
    out = module.decode(query, cache, batch.block_table, batch.seq_lens, **kwargs, **launch)
    want = reference.decode(Layout.from_config(config), query, cache, batch.block_table, batch.seq_lens,
                            kwargs.get("rotation"), kwargs.get("centroids"))
    assert out.dtype == dtype and out.shape == want.shape
    assert torch.isfinite(out).all()
    error = relative_error(out, want)
    assert error < DECODE_TOLERANCE[dtype], f"relative error {error:.2e}"
    return out


def replays_of_a_capture(run, fill, out, seeds):
    """Graph replay of run() for new inputs: fill(1) and one eager run (it compiles and builds per-device
    constants outside the capture), then run() captured in a CUDA graph; per seed, fill(seed), `out` set to NaN,
    one replay. Yields each seed once its replay has finished, for the caller to check `out`."""
    fill(1)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in seeds:
        fill(seed)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield seed


class KernelRecorder:
    """Stands in for a kernel in a module's globals (the launchers look kernels up there, so
    monkeypatch.setattr(module, name, recorder) catches every launch): records each launch's
    (grid, args, kwargs) in `launches`, and runs it when `kernel` is given."""

    def __init__(self, kernel=None):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            if self.kernel is not None:
                self.kernel[grid](*args, **kwargs)
        return launch


# --- the page-planar layout's configs -----------------------------------------------
def planes_config(preset, head_dim=128, **overrides):
    return make_config(preset, head_dim=head_dim, cache_layout="planes", **overrides)


ODD_FORMATS = [  # record sizes that are not multiples of 16 bytes: narrower loads, other hints
    dict(key_format="mse", key_bits=4, value_bits=8, head_dim=72, block_size=8),
    dict(key_format="mse", key_bits=2, value_bits=2, head_dim=88),
    dict(key_format="fp8", value_bits=4, head_dim=200),
]


def planes_config_of(spec):
    if isinstance(spec, str):
        preset, head_dim = spec.split("-d")
        return planes_config(preset, int(head_dim))
    return config_mod.resolve_arch(config_mod.from_mapping(dict(spec, cache_layout="planes")))


KERNEL_FORMATS = [f"{p}-d128" for p in sorted(PRESETS)] + ["k3v4-d96", "k4v4-d64", "k3v4-d256"] + ODD_FORMATS
