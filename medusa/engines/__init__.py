"""Engines: where the base's KV cache lives and how one forward over new tokens runs (:mod:`medusa.engines.base`).

Registered: ``eager`` (:mod:`.eager`), ``static`` (:mod:`.static`), ``onednn`` (:mod:`.onednn`), ``compiled``
(:mod:`.compiled`), ``native`` (:mod:`.native_fp32`), ``int4`` and ``int8`` (:mod:`.quantized`). All touch-points
with transformers' cache and mask APIs are in :mod:`.kv_cache` and :mod:`.static_cache`.
"""

# The order the engines register in is the order they are listed in (CLI help, errors).
# isort: off
from medusa.engines import kv_cache, static_cache
from medusa.engines.base import (
    AUTO,
    DEFAULT_ENGINE,
    ENGINES,
    Engine,
    attention_kernels,
    auto_candidates,
    auto_choice,
    check_dtype,
    make_engine,
    register_engine,
)
from medusa.engines.eager import EagerEngine
from medusa.engines.static import StaticEngine
from medusa.engines.onednn import OneDNNEngine
from medusa.engines.compiled import CAPACITY_BUCKET, CompiledEngine, compile_unavailable
from medusa.engines.native_fp32 import NativeEngine
from medusa.engines.quantized import Int4Engine, Int8Engine
# isort: on

__all__ = ["AUTO", "CAPACITY_BUCKET", "DEFAULT_ENGINE", "ENGINES", "CompiledEngine", "EagerEngine", "Engine",
           "Int4Engine", "Int8Engine", "NativeEngine", "OneDNNEngine", "StaticEngine", "attention_kernels",
           "auto_candidates", "auto_choice", "check_dtype", "compile_unavailable", "kv_cache", "make_engine",
           "register_engine", "static_cache"]
