"""``InferaKvdConnector``: vLLM's ``KVConnectorBase_V1`` over kvd, packed blocks by default.

Use with ``--kv-transfer-config '{"kv_connector": "InferaKvdConnector",
"kv_connector_module_path": "infera_kvd.vllm_connector", "kv_role": "kv_both",
"kv_connector_extra_config": {"socket": "/run/infera/kvd.sock"}}'``.

vLLM is imported when the class is first looked up (module ``__getattr__``), and its
``KVConnectorBase_V1`` is checked against the methods this connector implements: a vLLM whose
interface differs fails with :class:`VllmInterfaceError` naming its version and the method.

Keys and namespace: block keys are :func:`infera_kvd.keys.block_keys` of the prompt's token
ids, scoped by what else vLLM keys the request's blocks by (:func:`identity_scope`: the LoRA
adapter's name and path, the ``cache_salt``, the images' identifiers and positions), so one
adapter's, tenant's or image's KV is never loaded for another; the namespace is the model (``extra_config["model"]`` or the served model name) and a
compat key built from the KV-cache layout both the scheduler and the workers see
(``kv_cache_config``: layer names, block size, per-layer block bytes, dtype) and the worker's
TP/PP rank. A restarted engine and another replica of the same model and parallel layout
therefore read each other's blocks. One value per block: a header, then every layer's slice
(:mod:`infera_kvd.packed`).

Per request, ``kv_transfer_params`` (or ``sampling_params.extra_args["kv_transfer_params"]``)
may carry ``infera_retention`` (``none``/``short``/``long``, as the Python connector honours
them; the daemon never writes ``none`` to disk; ``ephemeral`` is not selectable here and maps to
the default) and ``infera_ttl_seconds``; ``extra_config["retention"]`` is the default
(``long``, as the router's).

Scheduler side: ``get_num_new_matched_tokens`` asks ``exists`` for the blocks past what vLLM
computed locally (in every rank's namespace; the common prefix counts, and one token is always
left to compute); ``update_state_after_alloc`` plans the load into the allocated blocks;
``build_connector_meta`` hands loads and the saves of newly completed prompt blocks to the
workers; ``request_finished`` drops the request (saves are synchronous).

Worker side: ``start_load_kv`` copies each planned block from its arena slot into every layer
(a torn or vanished block is reported by ``get_block_ids_with_load_errors`` so vLLM recomputes
it); ``wait_for_save`` packs each block straight into a reserved arena slot and commits it.
A daemon that cannot be reached costs misses and skipped saves, never a failed step.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("infera_kvd.vllm")

CLASS_NAME = "InferaKvdConnector"

# The base-class methods this connector overrides, with the parameters it expects.
EXPECTED_METHODS: dict[str, tuple[str, ...]] = {
    "get_num_new_matched_tokens": ("self", "request", "num_computed_tokens"),
    "update_state_after_alloc": ("self", "request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("self", "scheduler_output"),
    "request_finished": ("self", "request", "block_ids"),
    "register_kv_caches": ("self", "kv_caches"),
    "start_load_kv": ("self", "forward_context", "kwargs"),
    "wait_for_layer_load": ("self", "layer_name"),
    "save_kv_layer": ("self", "layer_name", "kv_layer", "attn_metadata", "kwargs"),
    "wait_for_save": ("self",),
    "get_block_ids_with_load_errors": ("self",),
    "shutdown": ("self",),
}


class VllmInterfaceError(ImportError):
    """The installed vLLM's connector interface is not the one this connector implements."""


def check_interface(base: type, version: str) -> None:
    """Raises :class:`VllmInterfaceError` when ``base`` lacks a method or its parameters differ."""
    for name, params in EXPECTED_METHODS.items():
        method = getattr(base, name, None)
        if method is None:
            raise VllmInterfaceError(
                f"infera-kvd's vLLM connector needs KVConnectorBase_V1.{name}, which vLLM {version} does not have"
            )
        got = tuple(inspect.signature(method).parameters)
        if got != params:
            raise VllmInterfaceError(
                f"infera-kvd's vLLM connector implements KVConnectorBase_V1.{name}{params}, "
                f"but vLLM {version} declares {name}{got}"
            )


@dataclass
class LoadSpec:
    req_id: str
    first_block: int
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class SaveSpec:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    retention: str
    ttl_s: float | None


@dataclass
class _ReqState:
    token_ids: list[int]
    block_ids: list[int]
    retention: str
    ttl_s: float | None
    saved_blocks: int
    load: LoadSpec | None = None
    scope: bytes = b""


def identity_scope(request: Any) -> bytes:
    """What besides its tokens vLLM keys ``request``'s blocks by (``generate_block_hash_extra_keys``:
    the LoRA adapter, the ``cache_salt``, each image's identifier and placeholder run), as the
    key scope of :func:`infera_kvd.keys.block_keys`; empty for plain text.

    The scope is the compact JSON object, keys sorted, ``{"lora": NAME, "mm": [[ID, OFFSET,
    LENGTH], ...], "salt": SALT}`` (absent members left out): exactly what the router derives
    from the request (``infera_core::kv_events::kvd::identity_scope``), so that it can name the
    blocks this connector saves in kvd and credit a worker whose node holds them."""
    parts: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts["lora"] = getattr(lora, "lora_name", None)
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts["salt"] = salt
    features = getattr(request, "mm_features", None) or []
    if features:
        parts["mm"] = [
            [
                str(getattr(f, "identifier", None) or getattr(f, "mm_hash", None)),
                getattr(f.mm_position, "offset", None),
                getattr(f.mm_position, "length", None),
            ]
            for f in features
        ]
    if not parts:
        return b""
    return json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass
class _Plan:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def transfer_params(request: Any) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, dict):
        return params
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return params if isinstance(params, dict) else {}


def retention_of(request: Any, default: str) -> tuple[str, float | None]:
    """``infera_retention`` (``none``/``short``/``long``; ``ephemeral`` and anything unknown map
    to ``default``) and ``infera_ttl_seconds`` from the request's ``kv_transfer_params``."""
    params = transfer_params(request)
    retention = params.get("infera_retention", default)
    if retention not in ("none", "short", "long"):
        logger.warning("kv_transfer_params.infera_retention %r is not none, short or long; using %s", retention, default)
        retention = default
    ttl = params.get("infera_ttl_seconds")
    return retention, (float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else None)


def layout_key(kv_cache_config: Any, tp: tuple[int, int], pp: tuple[int, int]) -> tuple[str, int, list[str]]:
    """The compat key of a rank, the block size, and the layer order, from ``kv_cache_config``."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ValueError(f"infera-kvd packs one KV-cache group; this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    layers = list(groups[0].layer_names)
    digest = hashlib.sha256(
        repr((type(spec).__name__, spec.block_size, spec.page_size_bytes, str(getattr(spec, "dtype", "")), layers)).encode()
    ).hexdigest()[:16]
    compat = f"vllm-packed1-bs{spec.block_size}-L{len(layers)}-{digest}-tp{tp[0]}of{tp[1]}-pp{pp[0]}of{pp[1]}"
    return compat, spec.block_size, layers


def _ranks(vllm_config: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    parallel = vllm_config.parallel_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    tp_rank = pp_rank = 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except (AssertionError, AttributeError, ImportError, RuntimeError):
        pass  # the scheduler process, or a single process without distributed state: rank 0
    return (tp_rank, tp_size), (pp_rank, pp_size)


def _build(base: type | None = None, version: str | None = None) -> type:
    import torch  # noqa: F401 - vLLM needs it; failing here names the real cause

    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as vbase

    from infera_kvd.client import KvdClient, socket_path
    from infera_kvd.keys import block_keys
    from infera_kvd.packed import PackedLayout
    from infera_kvd.transfer import LayerCache, copier, describe, find_block_dim, load_block, save_block

    base = base or vbase.KVConnectorBase_V1
    version = version or getattr(vllm, "__version__", "unknown")
    check_interface(base, version)

    class InferaKvdMetadata(vbase.KVConnectorMetadata):
        def __init__(self, plan: _Plan) -> None:
            self.loads = plan.loads
            self.saves = plan.saves

    class InferaKvdConnector(base):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
            model_config = getattr(vllm_config, "model_config", None)
            self._model = extra.get("model") or getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
            if isinstance(self._model, list):
                self._model = self._model[0]
            if not self._model:
                raise ValueError("infera-kvd: no model name (set kv_connector_extra_config.model)")
            self._default_retention = extra.get("retention", "long")
            tp, pp = _ranks(vllm_config)
            self._compat, self._block_size, self._layer_names = layout_key(kv_cache_config, tp, pp)
            path = socket_path(extra.get("socket"))
            timeout = float(extra.get("timeout_s", 5.0))
            self._num_blocks = kv_cache_config.num_blocks
            is_worker = role == vbase.KVConnectorRole.WORKER
            if is_worker:
                self._client = KvdClient(path, self._model, self._compat, timeout_s=timeout, client_id=f"vllm-worker-{self._compat}")
                self._peers = [self._client]
            else:
                # The scheduler counts a block as present only if every rank saved it.
                self._peers = [
                    KvdClient(path, self._model, layout_key(kv_cache_config, (t, tp[1]), (p, pp[1]))[0], timeout_s=timeout, shared_arena=False, pin=False, client_id="vllm-scheduler")
                    for t in range(tp[1])
                    for p in range(pp[1])
                ]
            self._reqs: dict[str, _ReqState] = {}
            self._pending_loads: dict[str, LoadSpec] = {}
            # Each waiting request's key scope, taken from the Request itself (the scheduler
            # output's NewRequestData has no cache_salt).
            self._scopes: dict[str, bytes] = {}
            self._layers: list[LayerCache] = []
            self._layout: PackedLayout | None = None
            self._fast = None
            self._load_errors: set[int] = set()
            logger.info("infera-kvd connector (%s) on %s: model %s, namespace %s", "worker" if is_worker else "scheduler", path, self._model, self._compat)

        # Scheduler side.
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            tokens = list(request.prompt_token_ids or [])
            bs = self._block_size
            usable = (len(tokens) - 1) // bs  # full blocks, leaving one token to compute
            first = num_computed_tokens // bs
            if usable <= first:
                return 0, False
            scope = self._scopes[request.request_id] = identity_scope(request)
            keys = block_keys(tokens, bs, first, usable, scope)
            hit = min(peer.try_exists_prefix(keys) for peer in self._peers)
            if hit == 0:
                return 0, False
            self._pending_loads[request.request_id] = LoadSpec(request.request_id, first, keys[:hit], [])
            return (first + hit) * bs - num_computed_tokens, False

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            spec = self._pending_loads.pop(request.request_id, None)
            if spec is None or num_external_tokens == 0:
                return
            block_ids = blocks.get_block_ids()[0]
            spec.block_ids = list(block_ids[spec.first_block : spec.first_block + len(spec.keys)])
            if len(spec.block_ids) != len(spec.keys):
                logger.warning("request %s: %d blocks allocated for %d to load; not loading", request.request_id, len(spec.block_ids), len(spec.keys))
                return
            self._reqs.setdefault(request.request_id, self._new_state(request.request_id, request)).load = spec

        def _new_state(self, req_id: str, request: Any) -> _ReqState:
            retention, ttl = retention_of(request, self._default_retention)
            scope = self._scopes.get(req_id)
            if scope is None:
                scope = identity_scope(request)
            return _ReqState(list(request.prompt_token_ids or []), [], retention, ttl, 0, scope=scope)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            plan = _Plan()
            for new in scheduler_output.scheduled_new_reqs:
                state = self._reqs.get(new.req_id)
                if state is None:
                    state = self._reqs[new.req_id] = self._new_state(new.req_id, new)
                state.token_ids = list(new.prompt_token_ids or [])
                state.block_ids = list(new.block_ids[0])
                if state.load is not None:
                    plan.loads.append(state.load)
                    state.load = None
                # Blocks computed before this step were loaded from kvd or cached locally.
                state.saved_blocks = new.num_computed_tokens // self._block_size
                self._plan_saves(plan, new.req_id, new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                state = self._reqs.get(req_id)
                if state is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if new_ids is not None:
                    if req_id in cached.resumed_req_ids:
                        state.block_ids = list(new_ids[0])
                    else:
                        state.block_ids.extend(new_ids[0])
                self._plan_saves(plan, req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0))
            for req_id in scheduler_output.finished_req_ids:
                self._reqs.pop(req_id, None)
                self._scopes.pop(req_id, None)
            return InferaKvdMetadata(plan)

        def _plan_saves(self, plan: _Plan, req_id: str, computed_after_step: int) -> None:
            state = self._reqs[req_id]
            bs = self._block_size
            done = min(computed_after_step, len(state.token_ids)) // bs
            done = min(done, len(state.block_ids))
            if done <= state.saved_blocks:
                return
            keys = block_keys(state.token_ids, bs, state.saved_blocks, done, state.scope)
            plan.saves.append(SaveSpec(req_id, keys, state.block_ids[state.saved_blocks : done], state.retention, state.ttl_s))
            state.saved_blocks = done

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            self._reqs.pop(request.request_id, None)
            self._pending_loads.pop(request.request_id, None)
            self._scopes.pop(request.request_id, None)
            return False, None

        # Worker side.
        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            missing = [n for n in self._layer_names if n not in kv_caches]
            if missing:
                raise ValueError(f"infera-kvd: the KV caches lack layers {missing[:3]}")
            self._layers = [LayerCache(n, kv_caches[n], find_block_dim(kv_caches[n], self._num_blocks)) for n in self._layer_names]
            sizes = {layer.block_bytes for layer in self._layers}
            if len(sizes) != 1:
                raise ValueError(f"infera-kvd packs layers of one block size; these have {sorted(sizes)}")
            self._layout = PackedLayout(len(self._layers), self._block_size, sizes.pop(), self._compat)
            self._fast = copier(self._layers, self._layout, pinned=bool(self._client.arena_info().get("pinned")))
            logger.info(
                "infera-kvd: %d layers, packed blocks of %d bytes, %s copies; arena %s",
                len(self._layers), self._layout.total_bytes, describe(self._fast), self._client.arena_info(),
            )

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            meta = self._connector_metadata
            if meta is None or self._layout is None:
                return
            for load in meta.loads:
                slots = self._client.try_lookup(load.keys)
                for slot, block_id in zip(slots, load.block_ids):
                    if slot is None or not load_block(slot, self._layers, block_id, self._layout, self._fast):
                        self._load_errors.add(block_id)

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None  # loads finish in start_load_kv

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None  # packed: every layer is written in wait_for_save

        def wait_for_save(self) -> None:
            meta = self._connector_metadata
            if meta is None or self._layout is None:
                return
            for save in meta.saves:
                for key, block_id in zip(save.keys, save.block_ids):
                    save_block(self._client, key, self._layers, block_id, self._layout, save.retention, save.ttl_s, self._fast)

        def get_block_ids_with_load_errors(self) -> set[int]:
            errors, self._load_errors = self._load_errors, set()
            return errors

        def shutdown(self) -> None:
            for peer in self._peers:
                peer.close()

    InferaKvdConnector.__qualname__ = CLASS_NAME
    InferaKvdConnector.__module__ = __name__
    InferaKvdMetadata.__module__ = __name__
    return InferaKvdConnector


_built: type | None = None


def connector_class() -> type:
    """The connector class, built (and vLLM imported and checked) on first use."""
    global _built
    if _built is None:
        _built = _build()
    return _built


def __getattr__(name: str) -> Any:
    if name == CLASS_NAME:
        return connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
