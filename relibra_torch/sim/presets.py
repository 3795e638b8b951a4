"""Hardware and model presets for the simulator, and the rules for overriding their fields.

Every number names its source in a comment. Hardware numbers are *achievable* figures
(what a well-tuned training job sees), not datasheet peaks, where the two differ; the
peak is given next to them so a user with measurements can override the field
(``--set hardware.inter_node_gbps=42``) or use a config file.

Units: TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s, per GPU and per direction.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields, replace

__all__ = [
    "HardwareSpec", "ModelSpec", "HARDWARE", "MODELS", "get_hardware", "get_model",
    "apply_overrides", "parse_override", "load_config_file",
]


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU type in an HGX/DGX-style cluster (8 GPUs per node on NVLink, one NIC per GPU).

    Attributes:
        name: preset name.
        bf16_tflops: peak dense bf16 tensor-core throughput, TFLOP/s.
        grouped_gemm_efficiency: fraction of ``bf16_tflops`` the expert grouped GEMMs achieve.
        dense_efficiency: fraction of ``bf16_tflops`` attention and dense layers achieve.
        nvlink_gbps: achievable NVLink bandwidth per GPU per direction, GB/s.
        inter_node_gbps: achievable inter-node (RDMA) bandwidth per GPU per direction, GB/s.
    """

    name: str
    bf16_tflops: float
    grouped_gemm_efficiency: float
    dense_efficiency: float
    nvlink_gbps: float
    inter_node_gbps: float

    def __post_init__(self) -> None:
        for f in ("bf16_tflops", "nvlink_gbps", "inter_node_gbps"):
            _check_positive(f"hardware.{f}", getattr(self, f))
        for f in ("grouped_gemm_efficiency", "dense_efficiency"):
            v = getattr(self, f)
            _check_positive(f"hardware.{f}", v)
            if v > 1:
                raise ValueError(f"hardware.{f} must be in (0, 1] (a fraction of peak), got {v}")


@dataclass(frozen=True)
class ModelSpec:
    """The parts of an MoE transformer that the cost model needs.

    Attention is GQA (``num_heads``, ``num_kv_heads``, ``head_dim``) unless
    ``kv_lora_rank > 0``, which selects DeepSeek's multi-head latent attention (MLA) with
    the ``q_lora_rank``/``kv_lora_rank``/``qk_nope_head_dim``/``qk_rope_head_dim``/
    ``v_head_dim`` fields. The first ``num_layers - num_moe_layers`` layers are dense
    (``dense_ffn``); every MoE layer has ``num_experts`` routed SwiGLU experts of width
    ``moe_ffn`` (``top_k`` per token) and ``num_shared_experts`` shared experts of width
    ``shared_ffn`` that every token uses.
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

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_moe_layers", "hidden_size", "moe_ffn", "num_experts",
                  "top_k", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            _check_positive_int(f"model.{f}", getattr(self, f))
        for f in ("dense_ffn", "num_shared_experts", "shared_ffn", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_positive_int(f"model.{f}", getattr(self, f), minimum=0)
        if self.num_moe_layers > self.num_layers:
            raise ValueError(f"model.num_moe_layers={self.num_moe_layers} exceeds "
                             f"model.num_layers={self.num_layers}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}")
        if self.num_dense_layers and not self.dense_ffn:
            raise ValueError(f"model.dense_ffn must be > 0 when there are dense layers "
                             f"(num_layers - num_moe_layers = {self.num_dense_layers})")
        if self.num_shared_experts and not self.shared_ffn:
            raise ValueError("model.shared_ffn must be > 0 when model.num_shared_experts > 0")

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


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _check_positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


# --- hardware --------------------------------------------------------------------------
# bf16 dense peak: NVIDIA H100 and H200 datasheets list 1,979 TFLOP/s bf16 *with sparsity*
# for the SXM parts, i.e. 989 TFLOP/s dense (the H200 has the same tensor cores as the H100,
# more and faster HBM: 141 GB HBM3e at 4.8 TB/s vs 80 GB HBM3 at 3.35 TB/s).
# NVLink: 4th-generation NVLink, 900 GB/s total per GPU = 450 GB/s per direction (both
# datasheets). All-to-all over NVSwitch reaches about 80% of that in nccl-tests
# (alltoall busbw of roughly 350-370 GB/s on 8x H100 SXM), hence 360.
# Inter-node: DGX/HGX H100 and H200 pair every GPU with one ConnectX-7 400 Gb/s NIC
# = 50 GB/s per direction; DeepEP's README measures 43-58 GB/s "RDMA bottleneck bandwidth"
# for EP 16-64 dispatch/combine on the same NIC, NCCL all-to-all sees about 90% of line
# rate, hence 45.
# Grouped GEMM: Megatron-Core/TransformerEngine bf16 grouped GEMMs for experts of a few
# thousand tokens reach roughly 55-65% of peak on H100 (smaller, skinnier GEMMs than
# dense layers); the H200's extra memory bandwidth helps these partly memory-bound shapes,
# hence 0.55 (H100) and 0.60 (H200). Attention (FlashAttention-3: 600-750 TFLOP/s forward
# bf16, less backward) and dense projections: 0.55 for both. These two efficiencies are
# estimates: measure your own kernels and override them.
HARDWARE: dict[str, HardwareSpec] = {
    "h100": HardwareSpec("h100", bf16_tflops=989.0, grouped_gemm_efficiency=0.55,
                         dense_efficiency=0.55, nvlink_gbps=360.0, inter_node_gbps=45.0),
    "h200": HardwareSpec("h200", bf16_tflops=989.0, grouped_gemm_efficiency=0.60,
                         dense_efficiency=0.55, nvlink_gbps=360.0, inter_node_gbps=45.0),
}

# --- models ----------------------------------------------------------------------------
MODELS: dict[str, ModelSpec] = {
    # huggingface.co/Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48
    # (all MoE: decoder_sparse_step 1, mlp_only_layers []), moe_intermediate_size 768,
    # num_experts 128, num_experts_per_tok 8, 32 heads / 4 KV heads x head_dim 128,
    # vocab_size 151936, untied embeddings; same numbers in slime scripts/models/qwen3-30B-A3B.sh.
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b", num_layers=48, num_moe_layers=48, hidden_size=2048, moe_ffn=768,
        num_experts=128, top_k=8, num_heads=32, num_kv_heads=4, head_dim=128,
        vocab_size=151936),
    # huggingface.co/Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, 94 layers (all MoE),
    # moe_intermediate_size 1536, 128 experts, top-8, 64 heads / 4 KV heads x 128,
    # vocab 151936; slime scripts/models/qwen3-235B-A22B.sh agrees.
    "qwen3-235b-a22b": ModelSpec(
        "qwen3-235b-a22b", num_layers=94, num_moe_layers=94, hidden_size=4096, moe_ffn=1536,
        num_experts=128, top_k=8, num_heads=64, num_kv_heads=4, head_dim=128,
        vocab_size=151936),
    # huggingface.co/zai-org/GLM-4.5-Air config.json: hidden_size 4096, 46 layers with
    # first_k_dense_replace 1 (dense intermediate_size 10944), moe_intermediate_size 1408,
    # n_routed_experts 128, num_experts_per_tok 8, n_shared_experts 1, 96 heads / 8 KV heads
    # x head_dim 128, vocab 151552; slime scripts/models/glm4.5-106B-A12B.sh agrees
    # (N_DENSE_LAYERS=1, N_MOE_LAYERS=45). The MTP layer is not modelled.
    "glm-4.5-air": ModelSpec(
        "glm-4.5-air", num_layers=46, num_moe_layers=45, hidden_size=4096, moe_ffn=1408,
        num_experts=128, top_k=8, num_heads=96, num_kv_heads=8, head_dim=128,
        vocab_size=151552, dense_ffn=10944, num_shared_experts=1, shared_ffn=1408),
    # huggingface.co/deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, 61 layers with
    # first_k_dense_replace 3 (intermediate_size 18432), moe_intermediate_size 2048,
    # n_routed_experts 256, top-8, n_shared_experts 1, MLA with 128 heads, q_lora_rank 1536,
    # kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
    # vocab 129280; slime scripts/models/deepseek-v3.sh agrees. MTP not modelled.
    "deepseek-v3": ModelSpec(
        "deepseek-v3", num_layers=61, num_moe_layers=58, hidden_size=7168, moe_ffn=2048,
        num_experts=256, top_k=8, num_heads=128, num_kv_heads=128, head_dim=128,
        vocab_size=129280, dense_ffn=18432, num_shared_experts=1, shared_ffn=2048,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128),
}


def get_hardware(name: str) -> HardwareSpec:
    """The hardware preset ``name`` (case-insensitive); ``ValueError`` lists the choices."""
    key = str(name).lower()
    if key not in HARDWARE:
        raise ValueError(f"--hardware {name!r} is unknown; choose one of {', '.join(HARDWARE)}")
    return HARDWARE[key]


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
# (relibra_torch.sim.baselines.SECTIONS).
SET_SECTIONS = ("hardware", "model", "eplb", "online")


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
    "eplb": {FIELD: VALUE}, "online": {FIELD: VALUE}, "simulate": {OPTION: VALUE}}`` where
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
            raise ValueError(f"--config {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold an object/table at the top level")
    unknown = set(data) - {"simulate", *SET_SECTIONS}
    if unknown:
        raise ValueError(f"--config {path!r} has unknown sections {sorted(unknown)}; "
                         f"allowed: {', '.join(SET_SECTIONS)}, simulate")
    return data


def spec_dict(spec) -> dict:
    """A JSON-ready dict of a spec."""
    return dataclasses.asdict(spec)
