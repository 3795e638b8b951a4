"""Hardware and model presets for the simulator, and the rules for overriding their fields.

The hardware specs live with the planner's pricing (:mod:`relibra_torch.planning.pricing`)
and are re-exported here (``HardwareSpec``, ``HARDWARE``, ``get_hardware``).

Every number names its source in a comment. Hardware numbers are *achievable* figures
(what a well-tuned training job sees), not datasheet peaks, where the two differ; the
peak is given next to them so a user with measurements can override the field
(``--set hardware.inter_node_gbps=42``) or use a config file.

Units: TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s, per GPU and per direction.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, fields, replace

from ..checks import check_int, counted
from ..planning.pricing import HARDWARE, HardwareSpec, get_hardware

__all__ = [
    "HardwareSpec", "ModelSpec", "HARDWARE", "MODELS", "get_hardware", "get_model",
    "apply_overrides", "parse_override", "load_config_file", "describe_model",
]


@dataclass(frozen=True)
class ModelSpec:
    """The parts of an MoE transformer that the cost model needs.

    Attention is GQA (``num_heads``, ``num_kv_heads``, ``head_dim``) unless
    ``kv_lora_rank > 0``, which selects DeepSeek's multi-head latent attention (MLA) with
    the ``q_lora_rank``/``kv_lora_rank``/``qk_nope_head_dim``/``qk_rope_head_dim``/
    ``v_head_dim`` fields. The first ``num_layers - num_moe_layers`` layers are dense
    (``dense_ffn``); every MoE layer has ``num_experts`` routed SwiGLU experts of width
    ``moe_ffn`` (``top_k`` per token) and ``num_shared_experts`` shared experts of width
    ``shared_ffn`` that every token uses. ``num_expert_groups`` is DeepSeek's ``n_group``:
    EPLB packs whole groups onto nodes when the node count divides it. ``max_context`` is the
    checkpoint's ``max_position_embeddings`` (0: unknown); only the serving model reads it,
    to say which requests a server would refuse.
    """

    name: str
    num_layers: int
    num_moe_layers: int
    hidden_size: int
    moe_ffn: int
    num_experts: int
    top_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dense_ffn: int = 0
    num_shared_experts: int = 0
    shared_ffn: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_expert_groups: int = 1
    max_context: int = 0

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_moe_layers", "hidden_size", "moe_ffn", "num_experts",
                  "top_k", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            check_int(f"model.{f}", getattr(self, f))
        for f in ("dense_ffn", "num_shared_experts", "shared_ffn", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_context"):
            check_int(f"model.{f}", getattr(self, f), 0)
        check_int("model.num_expert_groups", self.num_expert_groups)
        if self.num_experts % self.num_expert_groups:
            raise ValueError(f"model.num_expert_groups = {self.num_expert_groups}; allowed: a divisor of "
                             f"model.num_experts = {self.num_experts}")
        if self.num_moe_layers > self.num_layers:
            raise ValueError(f"model.num_moe_layers = {self.num_moe_layers}; allowed: an int in "
                             f"[0, model.num_layers = {self.num_layers}]")
        if self.top_k > self.num_experts:
            raise ValueError(f"model.top_k = {self.top_k}; allowed: an int in [1, model.num_experts = "
                             f"{self.num_experts}]")
        if self.num_dense_layers and not self.dense_ffn:
            raise ValueError(f"model.dense_ffn = 0; allowed: an int >= 1 when there are dense layers "
                             f"(num_layers - num_moe_layers = {self.num_dense_layers}); set "
                             f"model.dense_ffn, or model.num_layers={self.num_moe_layers} for an "
                             f"all-MoE model")
        if not self.is_mla and (self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads):
            raise ValueError(f"model.num_kv_heads = {self.num_kv_heads} with model.num_heads = {self.num_heads}; "
                             f"allowed: a divisor of {self.num_heads} (grouped-query attention: set both so the KV "
                             f"heads divide the query heads)")
        if self.num_shared_experts and not self.shared_ffn:
            raise ValueError("model.shared_ffn = 0; allowed: an int >= 1 when model.num_shared_experts > 0")

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_projection_params(self) -> int:
        """Weights of one layer's attention projections (Q, K, V, O), i.e. FLOPs/token / 2."""
        D, h = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (D * self.q_lora_rank + self.q_lora_rank * h * qk) if self.q_lora_rank else D * h * qk
            kv = D * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (
                self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + h * self.v_head_dim * D
        dh, kvh = self.head_dim, self.num_kv_heads
        return D * h * dh + 2 * D * kvh * dh + h * dh * D

    def attention_qk_dim(self) -> int:
        """Summed query-key dot-product width over heads (FLOPs per (query, key) pair / 2)."""
        if self.is_mla:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_heads * self.head_dim

    def attention_v_dim(self) -> int:
        """Summed value width over heads (FLOPs per (query, key) pair in P @ V / 2)."""
        return self.num_heads * (self.v_head_dim if self.is_mla else self.head_dim)

    def expert_params(self) -> int:
        """Weights of one routed SwiGLU expert: gate, up (``D x F``) and down (``F x D``)."""
        return 3 * self.hidden_size * self.moe_ffn


# --- models ----------------------------------------------------------------------------
MODELS: dict[str, ModelSpec] = {
    # huggingface.co/Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48
    # (all MoE: decoder_sparse_step 1, mlp_only_layers []), moe_intermediate_size 768,
    # num_experts 128, num_experts_per_tok 8, 32 heads / 4 KV heads x head_dim 128,
    # vocab_size 151936, untied embeddings, max_position_embeddings 40960; same numbers in
    # slime scripts/models/qwen3-30B-A3B.sh.
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b", num_layers=48, num_moe_layers=48, hidden_size=2048, moe_ffn=768,
        num_experts=128, top_k=8, num_heads=32, num_kv_heads=4, head_dim=128,
        vocab_size=151936, max_context=40960),
    # huggingface.co/Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, 94 layers (all MoE),
    # moe_intermediate_size 1536, 128 experts, top-8, 64 heads / 4 KV heads x 128,
    # vocab 151936, max_position_embeddings 40960; slime scripts/models/qwen3-235B-A22B.sh agrees.
    "qwen3-235b-a22b": ModelSpec(
        "qwen3-235b-a22b", num_layers=94, num_moe_layers=94, hidden_size=4096, moe_ffn=1536,
        num_experts=128, top_k=8, num_heads=64, num_kv_heads=4, head_dim=128,
        vocab_size=151936, max_context=40960),
    # huggingface.co/zai-org/GLM-4.5-Air config.json: hidden_size 4096, 46 layers with
    # first_k_dense_replace 1 (dense intermediate_size 10944), moe_intermediate_size 1408,
    # n_routed_experts 128, num_experts_per_tok 8, n_shared_experts 1, 96 heads / 8 KV heads
    # x head_dim 128, vocab 151552, max_position_embeddings 131072; slime
    # scripts/models/glm4.5-106B-A12B.sh agrees (N_DENSE_LAYERS=1, N_MOE_LAYERS=45). The MTP
    # layer is not modelled.
    "glm-4.5-air": ModelSpec(
        "glm-4.5-air", num_layers=46, num_moe_layers=45, hidden_size=4096, moe_ffn=1408,
        num_experts=128, top_k=8, num_heads=96, num_kv_heads=8, head_dim=128,
        vocab_size=151552, dense_ffn=10944, num_shared_experts=1, shared_ffn=1408, max_context=131072),
    # huggingface.co/deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, 61 layers with
    # first_k_dense_replace 3 (intermediate_size 18432), moe_intermediate_size 2048,
    # n_routed_experts 256, top-8, n_shared_experts 1, MLA with 128 heads, q_lora_rank 1536,
    # kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
    # vocab 129280, n_group 8 (EPLB's expert groups), max_position_embeddings 163840; slime
    # scripts/models/deepseek-v3.sh agrees. MTP not modelled.
    "deepseek-v3": ModelSpec(
        "deepseek-v3", num_layers=61, num_moe_layers=58, hidden_size=7168, moe_ffn=2048,
        num_experts=256, top_k=8, num_heads=128, num_kv_heads=128, head_dim=128,
        vocab_size=129280, dense_ffn=18432, num_shared_experts=1, shared_ffn=2048,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_expert_groups=8, max_context=163840),
    # huggingface.co/MiniMaxAI/MiniMax-M2 config.json (model_type minimax_m2; the same values
    # as transformers' MiniMaxM2Config defaults): hidden_size 3072, num_hidden_layers 62 (all
    # MoE), intermediate_size 1536 (the expert width), num_local_experts 256,
    # num_experts_per_tok 8, no shared expert, 48 heads / 8 KV heads x head_dim 128,
    # vocab_size 200064, max_position_embeddings 196608. The 3 MTP modules are not modelled.
    "minimax-m2": ModelSpec(
        "minimax-m2", num_layers=62, num_moe_layers=62, hidden_size=3072, moe_ffn=1536,
        num_experts=256, top_k=8, num_heads=48, num_kv_heads=8, head_dim=128,
        vocab_size=200064, max_context=196608),
    # GLM-5 (zai-org/GLM-5 config.json, model_type glm_moe_dsa; the paper serves GLM-5.1-FP8
    # of the same shape): hidden_size 6144, 78 layers with first_k_dense_replace 3
    # (intermediate_size 12288), moe_intermediate_size 2048, n_routed_experts 256, top-8,
    # n_shared_experts 1, MLA with 64 heads, q_lora_rank 2048, kv_lora_rank 512,
    # qk_nope_head_dim 192, qk_rope_head_dim 64, v_head_dim 256, vocab 154880,
    # max_position_embeddings 202752; slime
    # scripts/models/glm5 agrees (3 dense + 75 MoE layers, 6144 / 2048 / 12288, 64 heads).
    # DeepSeek sparse attention (index_topk 2048) and the MTP layer are not modelled.
    "glm-5": ModelSpec(
        "glm-5", num_layers=78, num_moe_layers=75, hidden_size=6144, moe_ffn=2048,
        num_experts=256, top_k=8, num_heads=64, num_kv_heads=64, head_dim=192,
        vocab_size=154880, dense_ffn=12288, num_shared_experts=1, shared_ffn=2048,
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, max_context=202752),
}


def get_model(name: str) -> ModelSpec:
    """The model preset ``name`` (case-insensitive); ``ValueError`` lists the choices."""
    key = str(name).lower()
    if key not in MODELS:
        raise ValueError(f"--model {name!r} is unknown; choose one of {', '.join(MODELS)}")
    return MODELS[key]


def _convert(section: str, spec_cls: type, key: str, raw: object) -> object:
    types = {f.name: f.type for f in fields(spec_cls)}
    if key not in types or key == "name":
        allowed = ", ".join(k for k in types if k != "name")
        raise ValueError(f"{section}.{key} is not a field; allowed: {allowed}")
    kind = types[key]
    if isinstance(raw, str):
        try:
            value: object = int(raw) if kind == "int" else float(raw)
        except ValueError:
            raise ValueError(f"{section}.{key}={raw!r} is not a{'n int' if kind == 'int' else ' number'}") from None
    else:
        value = raw
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def apply_overrides(spec, section: str, overrides: dict[str, object]):
    """Return ``spec`` with fields replaced; values are converted and validated.

    Args:
        spec: a :class:`HardwareSpec` or :class:`ModelSpec`.
        section: ``"hardware"`` or ``"model"`` (used in error messages).
        overrides: field name -> value (strings are parsed as the field's type).
    """
    if not overrides:
        return spec
    changes = {k: _convert(section, type(spec), k, v) for k, v in overrides.items()}
    return replace(spec, **changes)


# Sections of --set and of config files: the presets, then the baselines' settings
# (relibra_torch.sim.baselines.SECTIONS), then the memory model's recipe
# (relibra_torch.sim.memory.MemoryOptions).
SET_SECTIONS = ("hardware", "model", "eplb", "online", "trace", "planning", "relibra", "memory")


def parse_override(text: str) -> tuple[str, str, str]:
    """Parse ``SECTION.FIELD=VALUE`` (``--set``) into its three parts."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set {text!r} must look like SECTION.FIELD=VALUE with SECTION one of "
                         f"{', '.join(SET_SECTIONS)}")
    key, value = text.split("=", 1)
    section, name = key.split(".", 1)
    section = section.strip().lower()
    if section not in SET_SECTIONS:
        raise ValueError(f"--set {text!r}: section must be one of {', '.join(SET_SECTIONS)}, got {section!r}")
    return section, name.strip(), value.strip()


def load_config_file(path: str) -> dict:
    """Read a small JSON or TOML config file.

    Layout: ``{"model": NAME or {FIELD: VALUE, "preset": NAME}, "hardware": same,
    "eplb": {FIELD: VALUE}, "online": {FIELD: VALUE}, "trace": {"skew": X},
    "simulate": {OPTION: VALUE}}`` where
    OPTION is a ``relibra simulate`` long option with dashes as underscores
    (``micro_batch_tokens``) and the ``eplb``/``online`` fields are those of
    :data:`relibra_torch.sim.baselines.SECTIONS`. Unknown top-level keys are an error.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"--config {path!r} does not exist")
    with open(path, "rb") as fh:
        raw = fh.read()
    if path.endswith(".toml"):
        import tomllib
        try:
            data = tomllib.loads(raw.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--config {path!r} is not valid TOML: {exc}") from None
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"--config {path!r} is not valid JSON: {exc} (a file not named .toml is read as "
                             f"JSON)") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold an object/table at the top level")
    unknown = set(data) - {"simulate", *SET_SECTIONS}
    if unknown:
        raise ValueError(f"--config {path!r} has unknown sections {sorted(unknown)}; "
                         f"allowed: {', '.join(SET_SECTIONS)}, simulate")
    for section, table in data.items():  # "64" is text in a file (only --set's values are parsed)
        if section == "simulate" or not isinstance(table, dict):  # simulate's options: checked by name
            continue
        for key, value in table.items():
            if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
                raise ValueError(f"--config {path!r}: [{section}] {key} = {value!r} is a string; allowed: a "
                                 f"number, written without quotes ({key} = {value.strip()})")
    return data


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def spec_dict(spec) -> dict:
    """A JSON-ready dict of a spec."""
    return dataclasses.asdict(spec)


def describe_model(model: dict) -> str:
    """One line of the shape a report prices (``model``: a :class:`ModelSpec` as a dict, as the
    JSON documents hold it), so a config read by meaning can be checked at a glance."""
    m = model
    dense = m["num_layers"] - m["num_moe_layers"]
    text = (f"{counted(m['num_layers'], 'layer')} ({m['num_moe_layers']} MoE"
            + (f", {dense} dense of width {m['dense_ffn']}" if dense else "")
            + f"), hidden {m['hidden_size']}; {counted(m['num_experts'], 'routed expert')}, top-{m['top_k']}, "
            f"width {m['moe_ffn']}")
    if m.get("num_shared_experts"):
        text += f"; {m['num_shared_experts']} shared of width {m['shared_ffn']}"
    if m.get("kv_lora_rank"):
        text += f"; MLA attention, {m['num_heads']} heads, kv_lora_rank {m['kv_lora_rank']}"
    else:
        text += f"; attention {m['num_heads']} query / {m['num_kv_heads']} KV heads x {m['head_dim']}"
    return text + f"; vocab {m['vocab_size']}"

