"""tqgen: specialized, tunable Triton kernels for TurboQuant KV caches.

    import tqgen
    tq = tqgen.load("configs/k3v4-d128.yaml")   # build (or reuse) and import
    tq.store(key, value, kv_cache, slot_mapping)
    out = tq.decode(query, kv_cache, block_table, seq_lens)
"""

__version__ = "0.1.0"

from .errors import ConfigError, TqgenError  # noqa: E402

__all__ = ["__version__", "ConfigError", "TqgenError", "load", "build"]


def __getattr__(name):
    # Lazy: `import tqgen` stays cheap (no torch/jinja import) for the CLI's error paths.
    if name in ("load", "build"):
        from . import emit

        return getattr(emit, name)
    raise AttributeError(f"module 'tqgen' has no attribute {name!r}")
