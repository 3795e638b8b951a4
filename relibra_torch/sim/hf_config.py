"""A Hugging Face ``config.json`` as the simulator's :class:`ModelSpec` (``--model-config``).

Reads the fields the public configs of the MoE families trained with RL today carry:

========================  =====================================================================
``model_type``            fields read (besides hidden_size, num_hidden_layers, attention heads,
                          vocab_size)
========================  =====================================================================
qwen3_moe, qwen2_moe      num_experts, num_experts_per_tok, moe_intermediate_size,
                          decoder_sparse_step, mlp_only_layers, intermediate_size (dense
                          layers), shared_expert_intermediate_size (qwen2_moe: one shared expert)
deepseek_v2, deepseek_v3  n_routed_experts, num_experts_per_tok, moe_intermediate_size,
                          n_shared_experts, first_k_dense_replace, moe_layer_freq,
                          intermediate_size, MLA (q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                          qk_rope_head_dim, v_head_dim), n_group / topk_group,
                          num_nextn_predict_layers (MTP)
glm4_moe                  as deepseek (GQA attention with head_dim instead of MLA)
mixtral                   num_local_experts, num_experts_per_tok, intermediate_size (expert
                          width: every layer is MoE), sliding_window
olmoe                     num_experts, num_experts_per_tok, intermediate_size (expert width)
gpt_oss                   num_local_experts, num_experts_per_tok (or experts_per_token),
                          intermediate_size (expert width), sliding_window, layer_types
========================  =====================================================================

A config nested as ``text_config`` (multimodal wrappers) is read from there. What the cost
model lacks is approximated and said in :attr:`HFModel.notes`: multi-token-prediction
(MTP) layers are left out, sliding-window attention is priced as full causal attention,
qwen2_moe's shared-expert gate and gpt-oss's expert biases and attention sinks are ignored.

Layer legend: H hidden (transformer) layers; the MoE map is a bool per hidden layer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .presets import ModelSpec

__all__ = ["FAMILIES", "HFModel", "load_hf_config", "model_from_hf_config", "moe_layer_map"]

FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "mixtral",
            "olmoe", "gpt_oss")


@dataclass(frozen=True)
class HFModel:
    """A model read from a Hugging Face config.

    Attributes:
        spec: the :class:`ModelSpec` for the cost model.
        moe_layers: per hidden layer, whether it is an MoE layer (``len == spec.num_layers``).
        model_type: the config's ``model_type``.
        notes: what the cost model approximates for this family (empty when nothing).
        topk_group: DeepSeek-style group-limited routing (``topk_group``; 0 when absent); the
            routing already reflects it, so it is informational only.
    """

    spec: ModelSpec
    moe_layers: tuple[bool, ...]
    model_type: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    topk_group: int = 0


def load_hf_config(path: str) -> dict:
    """The JSON object of a ``config.json`` (a folder holding one is accepted too)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model-config {path!r} does not exist; pass the model's "
                                f"Hugging Face config.json (or the folder holding it)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--model-config {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model-config {path!r} must hold a JSON object (a Hugging Face config.json)")
    return data


class _Fields:
    """Typed access to config fields; every error names ``--model-config`` and the field."""

    def __init__(self, cfg: dict, where: str):
        self.cfg, self.where = cfg, where

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"--model-config {self.where}: field {key!r} is missing; "
                                 f"allowed: an int >= {minimum} (model_type {self.cfg.get('model_type')!r})")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"--model-config {self.where}: {key} = {value!r}; allowed: an int >= {minimum}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.cfg.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                  and v >= 0 for v in value):
            raise ValueError(f"--model-config {self.where}: {key} = {value!r}; allowed: a list of layer indices >= 0")
        return value


def moe_layer_map(cfg: dict, where: str = "config") -> tuple[bool, ...]:
    """Per hidden layer of a Hugging Face config, whether it holds routed experts.

    qwen: layer ``i`` is MoE unless ``i in mlp_only_layers`` and when ``(i + 1) %
    decoder_sparse_step == 0``; deepseek/glm: ``i >= first_k_dense_replace`` and ``i %
    moe_layer_freq == 0``; mixtral, olmoe, gpt-oss: every layer.
    """
    cfg = cfg.get("text_config") or cfg
    f = _Fields(cfg, where)
    kind = _family(cfg, where)
    H = f.int("num_hidden_layers")
    if kind in ("qwen3_moe", "qwen2_moe"):
        step = f.int("decoder_sparse_step", 1)
        dense = set(f.int_list("mlp_only_layers"))
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(H))
    if kind in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        first = f.int("first_k_dense_replace", 0, minimum=0)
        freq = f.int("moe_layer_freq", 1)
        return tuple(i >= first and i % freq == 0 for i in range(H))
    return (True,) * H


def _family(cfg: dict, where: str) -> str:
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"--model-config {where}: model_type {kind!r} is not supported; allowed: "
                         f"{', '.join(FAMILIES)} (for another model pass --model PRESET with "
                         f"--set model.FIELD=VALUE, or a --config file with a [model] table)")
    return kind


def _name(cfg: dict, path: str | None) -> str:
    named = cfg.get("_name_or_path")
    if isinstance(named, str) and named.strip():
        return os.path.basename(named.rstrip("/")) or named
    if path:
        folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
        if folder:
            return folder
    return str(cfg.get("model_type"))


def model_from_hf_config(config: dict | str, name: str | None = None) -> HFModel:
    """Build an :class:`HFModel` from a config dict or a ``config.json`` path.

    Args:
        config: the parsed JSON object, or a path (file or folder).
        name: the model name to report; default: ``_name_or_path``, else the folder name.
    Raises:
        ValueError naming ``--model-config`` and the field for an unsupported ``model_type``,
        a missing or non-integer field, or a config with no MoE layer.
    """
    path = config if isinstance(config, str) else None
    outer = load_hf_config(config) if isinstance(config, str) else config
    if not isinstance(outer, dict):
        raise TypeError(f"--model-config is {type(outer).__name__}; allowed: a dict or a path")
    where = repr(path) if path else "config"
    cfg = outer.get("text_config") or outer
    kind = _family(cfg, where)
    f = _Fields(cfg, where)
    moe = moe_layer_map(cfg, where)
    H, D = len(moe), f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    head_dim = f.int("head_dim", D // heads if D % heads == 0 else None)
    notes: list[str] = []
    fields: dict = dict(hidden_size=D, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                        vocab_size=f.int("vocab_size"))
    groups, topk_group = 1, 0
    if kind in ("qwen3_moe", "qwen2_moe"):
        fields.update(num_experts=f.int("num_experts"), top_k=f.int("num_experts_per_tok"),
                      moe_ffn=f.int("moe_intermediate_size"))
        if kind == "qwen2_moe" and f.int("shared_expert_intermediate_size", 0, minimum=0):
            fields.update(num_shared_experts=1, shared_ffn=f.int("shared_expert_intermediate_size"))
            notes.append("the shared expert's sigmoid gate is not priced")
    elif kind in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        fields.update(num_experts=f.int("n_routed_experts"), top_k=f.int("num_experts_per_tok"),
                      moe_ffn=f.int("moe_intermediate_size"))
        shared = f.int("n_shared_experts", 0, minimum=0)
        if shared:
            # n_shared_experts experts of moe_intermediate_size = one FFN of their summed width
            fields.update(num_shared_experts=shared, shared_ffn=shared * fields["moe_ffn"])
        groups = f.int("n_group", 1)
        topk_group = f.int("topk_group", 0, minimum=0)
        if kind != "glm4_moe":
            fields.update(kv_lora_rank=f.int("kv_lora_rank"), q_lora_rank=f.int("q_lora_rank", 0, minimum=0),
                          qk_nope_head_dim=f.int("qk_nope_head_dim"),
                          qk_rope_head_dim=f.int("qk_rope_head_dim"), v_head_dim=f.int("v_head_dim"),
                          num_kv_heads=heads, head_dim=f.int("v_head_dim"))  # unused by MLA pricing
        mtp = f.int("num_nextn_predict_layers", 0, minimum=0)
        if mtp:
            notes.append(f"{mtp} multi-token-prediction (MTP) layer(s) not modelled")
    else:  # mixtral, olmoe, gpt_oss: every layer MoE, the expert width is intermediate_size
        experts_key = "num_experts" if kind == "olmoe" else "num_local_experts"
        top_k = f.int("num_experts_per_tok", f.int("experts_per_token", None) if f.has("experts_per_token") else None)
        fields.update(num_experts=f.int(experts_key), top_k=top_k, moe_ffn=f.int("intermediate_size"))
        if kind == "gpt_oss":
            notes.append("expert biases and attention sinks are not priced")
    window = cfg.get("sliding_window")
    if window is not None and (kind in ("mixtral", "gpt_oss") or cfg.get("use_sliding_window")):
        which = "on the layers layer_types marks sliding" if kind == "gpt_oss" else "on every layer"
        notes.append(f"sliding-window attention (window {window}, {which}) priced as full causal attention")
    num_moe = sum(moe)
    if num_moe == 0:
        raise ValueError(f"--model-config {where}: no MoE layer (check first_k_dense_replace, "
                         f"mlp_only_layers, decoder_sparse_step); allowed: a model with routed experts")
    if num_moe < H:
        fields["dense_ffn"] = f.int("intermediate_size")
    spec = ModelSpec(name or _name(outer, path), num_layers=H, num_moe_layers=num_moe,
                     num_expert_groups=groups, **fields)
    return HFModel(spec, moe, kind, tuple(notes), topk_group)
