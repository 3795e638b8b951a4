"""Hugging Face config fields read by meaning: each quantity of an MoE and its spellings.

Every MoE family names the same quantities differently (``n_routed_experts`` /
``num_experts`` / ``num_local_experts`` / ``moe_num_experts`` for the expert count, four
ways to say which layers are MoE, ...). :mod:`relibra_torch.sim.hf_config` asks for a
quantity, not for a key: the first spelling present (not null) wins. A config nested in a
wrapper (``text_config``, ``llm_config``, ``language_config``, ``thinker_config``) is read
where the experts are.

Layer legend: H hidden (transformer) layers; the MoE map is a bool per hidden layer.
"""

from __future__ import annotations

__all__ = ["SPELLINGS", "NESTED", "MERGED", "MOE_TYPES", "PER_MODALITY", "Fields", "find_moe_config", "layer_map",
           "text_modality"]

# quantity -> its spellings, in the order they are tried
SPELLINGS: dict[str, tuple[str, ...]] = {
    "experts": ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "n_experts",
                "num_routed_experts"),
    # not plain "top_k": old configs serialise the sampling default top_k = 50
    "top_k": ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k", "num_selected_experts",
              "moe_top_k"),
    "expert_ffn": ("moe_intermediate_size", "expert_ffn_hidden_size", "moe_ffn_hidden_size",
                   "expert_intermediate_size"),
    "expert_ffn_fallback": ("intermediate_size", "ffn_hidden_size"),  # Mixtral, gpt-oss, Llama 4, MiniMax, DBRX
    "dense_ffn": ("intermediate_size_mlp", "dense_intermediate_size", "ffn_hidden_size", "intermediate_size"),
    "shared_count": ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "num_shared_expert"),
    "shared_width": ("moe_shared_expert_intermediate_size",),
    "shared_total": ("shared_expert_intermediate_size", "shared_intermediate_size"),
    "layers": ("num_hidden_layers", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "d_model", "n_embd"),
    "heads": ("num_attention_heads", "n_heads", "n_head"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "kv_n_heads"),
    "head_dim": ("head_dim", "attention_head_dim", "kv_channels"),  # kv_channels: Megatron, JetMoE
    "vocab": ("vocab_size", "padded_vocab_size"),
    "groups": ("n_group", "num_expert_group", "moe_n_group"),
    "topk_group": ("topk_group",),
    "first_dense": ("first_k_dense_replace", "first_k_dense", "moe_layer_start_index"),
    "mtp": ("num_nextn_predict_layers", "num_mtp_modules", "mtp_num_layers", "mtp_num_hidden_layers"),
}
# wrappers whose text model is nested (multimodal, omni)
NESTED = ("text_config", "llm_config", "language_config", "thinker_config")
# sub-tables whose fields belong to the model itself (DBRX: ffn_config.moe_num_experts, attn_config.kv_n_heads)
MERGED = ("ffn_config", "attn_config", "moe_config")
# model types that are MoE by architecture: a missing expert field is an error, not "not an MoE"
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_vl_moe_text", "qwen3_next", "deepseek_v2", "deepseek_v3",
             "kimi_k2", "glm4_moe", "glm_moe_dsa", "mixtral", "olmoe", "gpt_oss", "llama4_text",
             "minimax_m2", "bailing_moe", "longcat_flash", "ernie4_5_moe", "hunyuan_v1_moe", "dots1")
# ERNIE-4.5-VL: these may be [text, vision] pairs (one per modality, not per layer)
PER_MODALITY = ("moe_num_experts", "moe_intermediate_size", "moe_layer_start_index", "moe_layer_end_index",
                "moe_k", "moe_num_shared_experts")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_LAYERS = 4096  # far above any published model (DeepSeek-V3: 61, Qwen3-235B: 94)


class Fields:
    """Typed access to a config's quantities; every error names ``--model-config`` and the field."""

    def __init__(self, cfg: dict, where: str):
        self.cfg, self.where = cfg, where

    def key(self, quantity: str) -> str | None:
        """The spelling of ``quantity`` this config uses (None when it has none)."""
        return next((k for k in SPELLINGS[quantity] if self.cfg.get(k) is not None), None)

    def int(self, quantity: str, default: int | None = None, minimum: int = 1) -> int:
        """An int quantity (a per-layer list is refused here; see :meth:`per_layer`)."""
        key = self.key(quantity) if quantity in SPELLINGS else (quantity if self.cfg.get(quantity) is not None else None)
        if key is None:
            if default is None:
                names = SPELLINGS.get(quantity, (quantity,))
                null = next((k for k in names if k in self.cfg), None)  # present, but null
                if null is not None:
                    raise ValueError(f"--model-config {self.where}: {null} = null; allowed: an int >= {minimum} "
                                     f"(model_type {self.cfg.get('model_type')!r})")
                raise ValueError(f"--model-config {self.where}: field {names[0]!r} is missing (also read as "
                                 f"{', '.join(names[1:]) or 'nothing else'}); allowed: an int >= {minimum} "
                                 f"(model_type {self.cfg.get('model_type')!r})")
            return default
        value = self.cfg[key]
        if not _is_int(value) or value < minimum:
            raise ValueError(f"--model-config {self.where}: {key} = {value!r}; allowed: an int >= {minimum}")
        return value

    def per_layer(self, quantity: str, default: int | None = None, minimum: int = 1) -> tuple[int, list[int] | None]:
        """``(value, per-layer list or None)``: a list (one value per layer, Hunyuan-style) is
        reduced to its rounded mean so the cost model can price one width."""
        key = self.key(quantity)
        value = self.cfg.get(key) if key else None
        if isinstance(value, list) and value:
            if not all(_is_int(v) and v >= minimum for v in value):
                raise ValueError(f"--model-config {self.where}: {key} = {value!r}; allowed: ints >= {minimum}")
            H = self.int("layers")
            if len(value) != H:
                raise ValueError(f"--model-config {self.where}: {key} has {len(value)} entries; allowed: one int, "
                                 f"or one per layer ({H}, num_hidden_layers)")
            return round(sum(value) / len(value)), list(value)
        return self.int(quantity, default, minimum), None

    def int_list(self, key: str, layers: int) -> list[int]:
        """Layer indices, each in ``0..layers-1``."""
        value = self.cfg.get(key) or []
        if not isinstance(value, list) or not all(_is_int(v) and 0 <= v < layers for v in value):
            raise ValueError(f"--model-config {self.where}: {key} = {value!r}; allowed: a list of layer indices "
                             f"0..{layers - 1} (num_hidden_layers {layers})")
        return value


def text_modality(cfg: dict, where: str) -> tuple[dict, tuple[str, ...]]:
    """ERNIE-4.5-VL's per-modality ``[text, vision]`` lists (:data:`PER_MODALITY`, recognised by a
    list ``moe_layer_start_index`` / ``moe_layer_end_index``) reduced to their text (first)
    element: ``(config, the keys reduced)``; any other config is returned as is."""
    if not any(isinstance(cfg.get(k), list) for k in ("moe_layer_start_index", "moe_layer_end_index")):
        return cfg, ()
    keys = tuple(k for k in PER_MODALITY if isinstance(cfg.get(k), list))
    for k in keys:
        if not cfg[k] or not _is_int(cfg[k][0]):
            raise ValueError(f"--model-config {where}: {k} = {cfg[k]!r}; allowed: an int, or per-modality "
                             f"[text, vision] ints (the text one, first, is read)")
    return {**cfg, **{k: cfg[k][0] for k in keys}}, keys


def _has_experts(cfg: dict) -> bool:
    f = Fields(cfg, "")
    key = f.key("experts")
    if key is None:
        return False
    v = cfg[key]
    return (_is_int(v) and v > 1) or (isinstance(v, list) and bool(v))


def find_moe_config(outer: dict, where: str) -> dict:
    """The (possibly nested) config that holds the routed experts.

    Raises:
        ValueError "not an MoE" when neither the config nor a nested text config names a
        routed-expert count (and its model_type is not a known MoE type).
    """
    todo, seen = [outer], []
    while todo:
        cfg = todo.pop(0)
        subs = [cfg[k] for k in MERGED if isinstance(cfg.get(k), dict)]
        if subs:  # the model's own fields first, then those of its sub-tables
            cfg = {**{k: v for sub in subs for k, v in sub.items()}, **cfg}
        seen.append(cfg)
        if _has_experts(cfg):
            return cfg
        todo += [cfg[k] for k in NESTED if isinstance(cfg.get(k), dict)]
    known = [c for c in seen if c.get("model_type") in MOE_TYPES]
    if known:  # an MoE architecture that lost its expert field: name the field
        Fields(known[-1], where).int("experts", minimum=2)
        return known[-1]
    kinds = sorted({str(c.get("model_type")) for c in seen})
    raise ValueError(f"--model-config {where}: not an MoE (model_type {', '.join(kinds)}): no routed-expert "
                     f"count ({', '.join(SPELLINGS['experts'])}) > 1 in the config or its "
                     f"{'/'.join(NESTED)}; relibra balances routed experts. For another model give its dims "
                     f"without --model-config: simulate and serve-sim take --model PRESET with --set "
                     f"model.FIELD=VALUE (simulate also a --config [model] table), convert takes --num-experts, "
                     f"--top-k and --moe-layers")


def layer_map(cfg: dict, where: str) -> tuple[bool, ...]:
    """Per hidden layer, whether it holds routed experts, from whichever pattern the config uses.

    An explicit list wins (``moe_layers``: indices, Llama 4; ``mlp_layer_types``: ``"dense"`` /
    ``"sparse"``, GLM-5; ``hybrid_override_pattern``: ``"E"`` per MoE layer, Nemotron-H;
    ``layers_block_type``: ``"moe"``; ``moe_layers_enum``: ``"4,5,..."``, Step 3;
    ``moe_layer_freq`` as a 0/1 list). Otherwise layer ``i`` is MoE when
    ``i >= first_k_dense_replace`` (or ``first_k_dense``, ``moe_layer_start_index``), ``i <=
    moe_layer_end_index`` (ERNIE; -1 = the last), ``i % moe_layer_freq == 0`` (DeepSeek),
    ``(i + 1) % decoder_sparse_step == 0`` (Qwen), ``(i + 1) % moe_layer_frequency == 0``
    (Arctic), ``(i + 1) % interleave_moe_layer_step == 0`` (Llama 4), ``(i + 1) %
    moe_layer_interval == 0`` (ERNIE), ``i % expert_layer_period == expert_layer_offset``
    (Jamba), and ``i`` is not in ``mlp_only_layers`` (Qwen). ERNIE-4.5-VL's per-modality lists
    are read for the text modality (:func:`text_modality`).

    Raises:
        ValueError naming the field: a layer index outside ``0..H-1``, or a pattern / flag
        list whose length is not ``H`` (``hybrid_override_pattern``: one of ``M/E/*/-`` per layer).
    """
    cfg, _ = text_modality(cfg, where)
    f = Fields(cfg, where)
    H = f.int("layers")
    if H > MAX_LAYERS:  # per-layer tables are built below: a typo must not take minutes and gigabytes
        raise ValueError(f"--model-config {where}: {f.key('layers')} = {H}; allowed: an int in [1, {MAX_LAYERS}]")
    explicit = cfg.get("moe_layers")
    if explicit is not None:
        idx = set(f.int_list("moe_layers", H))
        return tuple(i in idx for i in range(H))
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list):
        if len(types) != H or not all(t in ("dense", "sparse") for t in types):
            raise ValueError(f"--model-config {where}: mlp_layer_types needs {H} entries of 'dense'/'sparse'")
        return tuple(t == "sparse" for t in types)
    pattern = cfg.get("hybrid_override_pattern")  # Nemotron-H: one char per layer, "E" = MoE
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) != H or set(pattern) - set("ME*-"):
            bad = sorted(set(pattern) - set("ME*-")) if isinstance(pattern, str) else ()
            n = (f"{len(pattern)} characters" + (f" ({', '.join(map(repr, bad))} unknown)" if bad else "")
                 if isinstance(pattern, str) else f"{pattern!r}")
            raise ValueError(f"--model-config {where}: hybrid_override_pattern has {n}; allowed: one of "
                             f"M/E/*/- per layer ({H}, num_hidden_layers)")
        return tuple(c == "E" for c in pattern)
    blocks = cfg.get("layers_block_type")
    if isinstance(blocks, list) and len(blocks) == H and "moe" in blocks:
        return tuple(b == "moe" for b in blocks)
    enum = cfg.get("moe_layers_enum")  # Step 3: "4,5,...,59"
    if isinstance(enum, str):
        try:
            idx = {int(x) for x in enum.split(",") if x.strip()}
        except ValueError:
            raise ValueError(f"--model-config {where}: moe_layers_enum = {enum!r}; allowed: comma-separated "
                             f"layer indices") from None
        if idx and not 0 <= min(idx) <= max(idx) < H:
            raise ValueError(f"--model-config {where}: moe_layers_enum = {enum!r}; allowed: layer indices "
                             f"0..{H - 1} (num_hidden_layers {H})")
        return tuple(i in idx for i in range(H))
    freq = cfg.get("moe_layer_freq")
    if isinstance(freq, list):
        if len(freq) != H or not all(v in (0, 1) for v in freq):
            raise ValueError(f"--model-config {where}: moe_layer_freq = {freq!r}; allowed: an int >= 1 or {H} 0/1 flags")
        return tuple(bool(v) for v in freq)
    first = f.int("first_dense", 0, minimum=0)
    end = cfg.get("moe_layer_end_index")
    last = H - 1 if end is None or end == -1 else f.int("moe_layer_end_index", minimum=0)
    freq = f.int("moe_layer_freq", 1)
    step = f.int("decoder_sparse_step", 1)
    arctic = f.int("moe_layer_frequency", 1)
    inter = f.int("interleave_moe_layer_step", 1)
    interval = f.int("moe_layer_interval", 1)
    period = f.int("expert_layer_period", 1)
    offset = f.int("expert_layer_offset", 0, minimum=0)
    dense = set(f.int_list("mlp_only_layers", H))
    return tuple(first <= i <= last and i % freq == 0 and (i + 1) % step == 0 and (i + 1) % arctic == 0
                 and (i + 1) % inter == 0 and (i + 1) % interval == 0 and i % period == offset % period and i not in dense
                 for i in range(H))
