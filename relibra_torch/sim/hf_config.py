"""A Hugging Face ``config.json`` as the simulator's :class:`ModelSpec` (``--model-config``).

Any MoE config is read by meaning (:mod:`relibra_torch.sim.hf_fields` lists every spelling):
the routed-expert count, top-k, the expert width and the shared experts, which layers are
MoE, the expert groups, the attention (GQA, or DeepSeek's MLA when ``kv_lora_rank`` is set)
and the text model of a multimodal wrapper. Checked on the public configs of
:data:`FAMILIES` (``tests/fixtures/hf_configs``); another ``model_type`` loads the same way
when it spells its fields like one of them. Refused, with a one-line ValueError naming the
field: a config with no routed experts ("not an MoE"), a hybrid Mamba config
(``hybrid_override_pattern`` with ``M`` / ``*`` layers, which have no FFN), and impossible values
(layer indices or a per-layer list beyond ``num_hidden_layers``, ``num_key_value_heads`` not
dividing ``num_attention_heads``, ``topk_group > n_group``, two expert-count spellings that
disagree, e.g. ``num_local_experts`` and ``num_experts``) and an encoder-decoder model
(``is_encoder_decoder``: Switch Transformers, NLLB-MoE). ERNIE-4.5-VL's per-modality
``[text, vision]`` lists are read for the text modality.

Expert width: a dedicated spelling (``moe_intermediate_size``, ...) when the config has one,
and then ``intermediate_size`` is the dense layers' width; otherwise ``intermediate_size``
is the expert width (Mixtral, OLMoE, gpt-oss, Llama 4, MiniMax) and the dense width is
``intermediate_size_mlp`` (Llama 4). Shared experts: ``n_shared_experts`` (or
``num_shared_experts``) experts of ``moe_shared_expert_intermediate_size`` (default: the
expert width), or one of ``shared_expert_intermediate_size`` / ``shared_intermediate_size``
(Qwen2-MoE, MiniMax; 0 = none); Llama 4 has one shared expert of ``intermediate_size``.

What the cost model cannot represent is approximated and said in :attr:`HFModel.notes`
(printed under the simulate table and kept in its JSON): multi-token-prediction layers are
left out; sliding-window, chunked and DeepSeek-sparse attention are priced as full causal
attention; linear-attention / Mamba layers as attention layers; zero-computation
(identity) experts as routed experts (they are ids of the routing, so they count in ``E``);
per-layer widths or top-k as their mean; gates and biases are not priced.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .hf_fields import SPELLINGS, Fields, find_moe_config, layer_map, text_modality
from .presets import ModelSpec

__all__ = ["FAMILIES", "HFModel", "load_hf_config", "model_from_hf_config", "moe_layer_map"]

# the model types whose public configs are fixtures (tests/fixtures/hf_configs)
FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3_vl_moe_text", "deepseek_v2", "deepseek_v3", "kimi_k2",
            "glm4_moe", "glm_moe_dsa", "mixtral", "olmoe", "gpt_oss", "llama4_text", "minimax_m2",
            "bailing_moe", "longcat_flash")


@dataclass(frozen=True)
class HFModel:
    """A model read from a Hugging Face config.

    Attributes:
        spec: the :class:`ModelSpec` for the cost model.
        moe_layers: per hidden layer, whether it is an MoE layer (``len == spec.num_layers``).
        model_type: the ``model_type`` of the config that holds the experts (the inner one
            of a multimodal wrapper).
        notes: what the cost model approximates for this model (empty when nothing).
        topk_group: DeepSeek-style group-limited routing (``topk_group``; 0 when absent); the
            routing already reflects it, so it is informational only.
    """

    spec: ModelSpec
    moe_layers: tuple[bool, ...]
    model_type: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    topk_group: int = 0
    experts_field: str = "num_experts"  # the config field the expert count was read from (for messages)


def load_hf_config(path: str) -> dict:
    """The JSON object of a ``config.json`` (a folder holding one is accepted too)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        hint = "" if os.sep in path or path.endswith(".json") else (
            f" (for a preset by name use --model {path})")
        raise FileNotFoundError(f"--model-config {path!r} does not exist; pass the model's "
                                f"Hugging Face config.json (or the folder holding it){hint}")
    try:
        with open(path, encoding="utf-8-sig") as fh:  # -sig: a byte-order mark some editors write
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--model-config {path!r} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise ValueError(f"--model-config {path!r} cannot be read: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model-config {path!r} must hold a JSON object (a Hugging Face config.json)")
    return data


def moe_layer_map(cfg: dict, where: str = "config") -> tuple[bool, ...]:
    """Per hidden layer of a Hugging Face config (or a wrapper), whether it holds routed
    experts (see :func:`relibra_torch.sim.hf_fields.layer_map` for the patterns read). The
    config that holds the experts is read, else the config itself (only its layers are needed)."""
    try:
        inner = find_moe_config(cfg, where)
    except ValueError:
        inner = cfg
    return layer_map(inner, where)  # layer_map reads ERNIE-VL's text modality itself


def _name(outer: dict, inner: dict, path: str | None) -> str:
    """``_name_or_path`` (its last part); else a folder passed as the path; else the file's stem
    unless it is ``config`` (``cfg/arctic.json``: "arctic"); else the folder of a ``config.json``
    (a Hugging Face download's layout) unless it is a hub-cache commit hash; else the
    ``model_type``, else the first of ``architectures``."""
    for cfg in (outer, inner):
        named = cfg.get("_name_or_path")
        if isinstance(named, str) and named.strip():
            return os.path.basename(named.strip().rstrip("/")) or named.strip()
    if path:
        if os.path.isdir(path):
            return os.path.basename(os.path.abspath(path)) or path
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem and stem != "config":
            return stem
        folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
        if folder and not (len(folder) == 40 and all(c in "0123456789abcdef" for c in folder)):
            return folder
    for cfg in (inner, outer):
        arch = cfg.get("architectures")
        for named in (cfg.get("model_type"), arch[0] if isinstance(arch, list) and arch else None):
            if isinstance(named, str) and named.strip():
                return named.strip()
    return "hf-model"


def _attention(f: Fields, D: int, notes: list[str]) -> dict:
    """GQA fields, or MLA's when the config has a ``kv_lora_rank``; priced-as-full notes."""
    cfg = f.cfg
    heads = f.int("heads")
    kv_heads = f.int("kv_heads", heads)
    if (kv_heads > heads or heads % kv_heads) and not f.int("kv_lora_rank", 0, minimum=0):
        raise ValueError(f"--model-config {f.where}: {f.key('kv_heads')} = {kv_heads} with {f.key('heads')} = "
                         f"{heads}; allowed: a divisor of {heads} (grouped-query attention)")
    if D % heads and f.key("head_dim") is None and not f.int("kv_lora_rank", 0, minimum=0):
        raise ValueError(f"--model-config {f.where}: {f.key('heads')} = {heads} does not divide {f.key('hidden')} = "
                         f"{D} and the config has no head_dim; allowed: a head count that divides the hidden "
                         f"size, or the field head_dim")
    out = dict(num_heads=heads, num_kv_heads=kv_heads,
               head_dim=f.int("head_dim", D // heads if D % heads == 0 else None))
    if f.int("kv_lora_rank", 0, minimum=0):
        v = f.int("v_head_dim")
        out.update(kv_lora_rank=f.int("kv_lora_rank"), q_lora_rank=f.int("q_lora_rank", 0, minimum=0),
                   qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=f.int("qk_rope_head_dim"),
                   v_head_dim=v, num_kv_heads=heads, head_dim=v)  # MLA: head_dim unused by pricing
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window", True):
        types = cfg.get("layer_types")
        which = "on the layers layer_types marks sliding" if isinstance(types, list) else "on every layer"
        notes.append(f"sliding-window attention (window {window}, {which}) priced as full causal attention")
    if cfg.get("attention_chunk_size") is not None:
        notes.append(f"chunked attention (chunks of {cfg['attention_chunk_size']} tokens) priced as full causal attention")
    if cfg.get("index_topk") is not None:
        notes.append(f"DeepSeek sparse attention (index_topk {cfg['index_topk']}) priced as full causal attention")
    types = [cfg.get(k) for k in ("layer_types", "layers_block_type") if isinstance(cfg.get(k), list)]
    kinds = [t for t in (types[0] if types else []) if isinstance(t, str) and any(w in t for w in ("linear", "mamba"))]
    attn = cfg.get("attn_type_list")
    kinds += [t for t in (attn if isinstance(attn, list) else []) if t == 0]  # MiniMax: 0 = lightning attention
    if not kinds:  # Jamba: attention every attn_layer_period layers; Qwen3-Next: every full_attention_interval
        period, interval = f.int("attn_layer_period", 0, minimum=0), f.int("full_attention_interval", 0, minimum=0)
        H = f.int("layers")
        if period > 1:
            offset = f.int("attn_layer_offset", 0, minimum=0)
            kinds = [i for i in range(H) if i % period != offset]
        elif interval > 1:
            kinds = [i for i in range(H) if (i + 1) % interval]
    if kinds:
        notes.append(f"{len(kinds)} linear-attention / Mamba layers priced as full-attention layers")
    return out


def _experts(f: Fields, kind: str, notes: list[str]) -> dict:
    """Routed and shared experts: counts, top-k, widths (see the module docstring)."""
    cfg = f.cfg
    given = {k: cfg[k] for k in SPELLINGS["experts"] if cfg.get(k) is not None}
    if len({repr(v) for v in given.values()}) > 1:  # Mixtral-style num_local_experts beside another count
        a, b = list(given)[:2]
        raise ValueError(f"--model-config {f.where}: {a} = {given[a]!r} but {b} = {given[b]!r}; allowed: one expert "
                         f"count (make them agree, or remove the one the model does not read)")
    E, per_E = f.per_layer("experts", minimum=2)
    K, per_K = f.per_layer("top_k")
    if K > E:
        raise ValueError(f"--model-config {f.where}: {f.key('top_k')} = {K} with {f.key('experts')} = {E}; "
                         f"allowed: an int in [1, {E}] (experts chosen per token)")
    unset = [k for k in SPELLINGS["expert_ffn"] if k in cfg and cfg[k] is None]
    if unset and not f.key("expert_ffn"):  # not the dense width in its place: 8x too wide on Qwen3
        raise ValueError(f"--model-config {f.where}: {unset[0]} = null; allowed: an int >= 1 (the routed "
                         f"experts' width)")
    F, per_F = f.per_layer("expert_ffn" if f.key("expert_ffn") else "expert_ffn_fallback")
    for what, per in (("routed-expert counts", per_E), ("top-k", per_K), ("expert widths", per_F)):
        if per is not None and len(set(per)) > 1:  # e.g. Hunyuan's per-layer lists
            notes.append(f"{what} differ across layers ({min(per)}..{max(per)}); priced at their mean")
    zero = f.int("zero_expert_num", 0, minimum=0)
    if zero:  # LongCat-Flash: the router picks among E + zero experts; the zero ones return their input
        notes.append(f"{zero} zero-computation ({cfg.get('zero_expert_type', 'identity')}) experts are "
                     f"expert ids {E}..{E + zero - 1} of the routing and are priced as routed experts")
        E += zero
    out = dict(num_experts=E, top_k=K, moe_ffn=F)
    count, per_count = f.per_layer("shared_count", 0, minimum=0)  # Hunyuan: one per layer
    if per_count is not None and len(set(per_count)) > 1:
        notes.append(f"shared-expert counts differ across layers ({min(per_count)}..{max(per_count)}); "
                     f"priced at their mean")
    total = f.int("shared_total", 0, minimum=0)
    if count:
        out.update(num_shared_experts=count, shared_ffn=f.int("shared_width", F))  # width of each
    elif total:
        out.update(num_shared_experts=1, shared_ffn=total)
    elif kind == "llama4_text":  # every Llama 4 MoE layer adds one shared expert of the expert width
        out.update(num_shared_experts=1, shared_ffn=F)
    if f.key("shared_total") == "shared_expert_intermediate_size" and total:
        notes.append("the shared expert's sigmoid gate is not priced")
    if kind == "gpt_oss":
        notes.append("expert biases and attention sinks are not priced")
    return out


def model_from_hf_config(config: dict | str, name: str | None = None) -> HFModel:
    """Build an :class:`HFModel` from a config dict or a ``config.json`` path.

    Args:
        config: the parsed JSON object, or a path (file or folder).
        name: the model name to report; default: ``_name_or_path``, else the config's folder,
            else its ``model_type``.
    Raises:
        ValueError naming ``--model-config``: a config that is not an MoE (no routed
        experts, or no MoE layer), or a missing or non-integer field.
    """
    path = config if isinstance(config, str) else None
    outer = load_hf_config(config) if isinstance(config, str) else config
    if not isinstance(outer, dict):
        raise TypeError(f"--model-config is {type(outer).__name__}; allowed: a dict or a path")
    where = repr(path) if path else "config"
    cfg, modal = text_modality(find_moe_config(outer, where), where)
    kind = str(cfg.get("model_type") or outer.get("model_type"))
    if any(c.get("is_encoder_decoder") is True for c in (outer, cfg)):  # Switch Transformers, NLLB-MoE
        raise ValueError(f"--model-config {where}: an encoder-decoder model (is_encoder_decoder: true, model_type "
                         f"{kind}); allowed: a decoder-only MoE (the cost model prices one causal stack); for its "
                         f"dims pass --model PRESET with --set model.FIELD=VALUE")
    f = Fields(cfg, where)
    moe = layer_map(cfg, where)
    H, D = len(moe), f.int("hidden")
    pattern = str(cfg.get("hybrid_override_pattern") or "")  # Nemotron-H, checked by layer_map
    if "M" in pattern or "*" in pattern:  # a Mamba or attention-only layer has no FFN: no ModelSpec layer
        raise ValueError(f"--model-config {where}: hybrid Mamba configs are not supported (hybrid_override_"
                         f"pattern: {pattern.count('M')} Mamba 'M' and {pattern.count('*')} attention '*' layers "
                         f"without an FFN); allowed: a config whose every layer has an FFN (MoE or dense); for its "
                         f"{sum(moe)} MoE layers alone pass --model PRESET with --set model.num_layers={sum(moe)} ...")
    notes: list[str] = []
    if modal:
        notes.append(f"per-modality [text, vision] {', '.join(modal)}: the text modality (first) is read")
    fields: dict = dict(hidden_size=D, vocab_size=f.int("vocab"), **_attention(f, D, notes))
    fields.update(_experts(f, kind, notes))
    groups, topk_group = f.int("groups", 1), f.int("topk_group", 0, minimum=0)
    if topk_group > groups:
        raise ValueError(f"--model-config {where}: topk_group = {topk_group} with {f.key('groups') or 'n_group'} = "
                         f"{groups}; allowed: 0..{groups} (groups a token may route to)")
    if fields["num_experts"] % groups:
        notes.append(f"{groups} expert groups do not divide {fields['num_experts']} experts; groups ignored")
        groups = 1
    num_moe = sum(moe)
    if num_moe == 0:
        raise ValueError(f"--model-config {where}: not an MoE: no layer holds routed experts (check "
                         f"first_k_dense_replace, mlp_only_layers, decoder_sparse_step, moe_layers); "
                         f"allowed: a model with routed experts")
    if kind == "longcat_flash":  # each layer: two attention + two dense FFN sublayers around one MoE
        dense2 = 2 * f.int("dense_ffn")
        _add_shared_mlp(fields, dense2)
        notes.append(f"each layer's two dense FFNs are priced as one shared expert of width {dense2}; "
                     f"its second attention block is not priced")
    if kind == "arctic" and cfg.get("use_residual") is True:  # Arctic: a dense residual MLP beside each MoE
        _add_shared_mlp(fields, D)
        notes.append(f"use_residual: each MoE layer's residual MLP (width hidden_size {D}) is priced as a "
                     f"shared expert")
    if cfg.get("residual_moe") is True:  # Grok-2: a dense MLP of intermediate_size beside each MoE
        dense = f.int("dense_ffn")
        _add_shared_mlp(fields, dense)
        notes.append(f"residual_moe: each MoE layer's dense MLP (width {dense}) is priced as a shared expert")
    if num_moe < H:  # intermediate_size_mlp (Llama 4) first: there intermediate_size is the experts'
        fields["dense_ffn"] = f.int("dense_ffn")
    mtp_key = f.key("mtp")
    mtp = f.int("mtp", 0, minimum=0) if cfg.get("use_mtp", True) is not False else 0
    if mtp:
        notes.append(f"{mtp} multi-token-prediction (MTP) layer(s) ({mtp_key}) not modelled")
    context = cfg.get("max_position_embeddings", cfg.get("max_seq_len"))  # max_seq_len: DBRX
    if isinstance(context, int) and not isinstance(context, bool) and context > 0:
        fields["max_context"] = context
    spec = ModelSpec(name or _name(outer, cfg, path), num_layers=H, num_moe_layers=num_moe,
                     num_expert_groups=groups, **fields)
    experts = f.key("experts") + (" + zero_expert_num" if f.int("zero_expert_num", 0, minimum=0) else "")
    return HFModel(spec, moe, kind, tuple(notes), topk_group, experts)


def _add_shared_mlp(fields: dict, width: int) -> None:
    """Add a dense MLP that runs beside every MoE layer to ``fields``' shared experts.

    ``ModelSpec`` prices ``num_shared_experts`` experts of width ``shared_ffn`` each, so the
    existing ones and the new MLP become one shared expert of their summed width (the same
    FLOPs and parameters)."""
    total = fields.get("num_shared_experts", 0) * fields.get("shared_ffn", 0) + width
    fields.update(num_shared_experts=1, shared_ffn=total)
