"""torchtitan 0.3.0 models on CPU for the integration tests (plain functions, no conftest).

The known CPU workarounds live here, not in the library:

* ``spmd_backend="partial_dtensor"``: the default ``spmd_types`` backend fails on gloo;
* SDPA instead of FlexAttention (no CPU backward); SDPA is causal without document masks,
  which is what these tests feed (one document per row);
* FSDP on gloo needs ``set_force_sum_reduction_for_comms(True)`` (no PREMUL_SUM);
* torchtitan's device type falls back to ``"cuda"`` without an accelerator; the meshes are
  built with ``"cpu"`` here;
* fp32 reference experts: torchtitan's ``GroupedExperts`` always computes in bf16, so the
  fp32 parity tests give the *original* model :class:`Fp32GroupedExperts` (same parameters,
  no casts) and the swapped model ``expert_dtype=None``.

The debug flavors are used with their structure (attention type, router, shared experts,
expert count, top-k) but fewer layers and a smaller expert hidden size, to stay within the
CPU test budget; :func:`model_config` says what it shrinks.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.config.configs import CompileConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts, MoE

from integrations.torchtitan import apply_relibra

BACKEND = "partial_dtensor"

FLAVORS = {
    # name: (registry module, flavor)
    "qwen3": ("torchtitan.models.qwen3", "debugmodel_moe"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "debugmodel"),
}


class Fp32GroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` computing in the parameters' dtype (test reference)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        w1, w2, w3 = self.w1_EFD, self.w2_EDF, self.w3_EFD
        h_RF = F.silu(torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * torch._grouped_mm(x_RD, w3.transpose(-2, -1), offs=offsets_E)
        return torch._grouped_mm(h_RF, w2.transpose(-2, -1), offs=offsets_E)


def use_cpu_backend() -> None:
    """Select torchtitan's DTensor-for-model-parallel-only backend (call in every process)."""
    set_spmd_backend(BACKEND)


def model_spec(name: str):
    """The torchtitan ``ModelSpec`` of a debug flavor (``"qwen3"`` or ``"deepseek_v3"``)."""
    import importlib
    module, flavor = FLAVORS[name]
    return importlib.import_module(module).model_registry(flavor)


def model_config(name: str, *, n_layers: int | None = 2, moe_hidden_dim: int | None = 32,
                 ep: int = 1, fp32_reference: bool = False):
    """The flavor's model config on CPU: SDPA attention, optionally shrunk.

    Args:
        n_layers: keep the first ``n_layers`` transformer layers (``None``: all; the
            deepseek_v3 flavor's first layer is dense, so keep >= 2 there).
        moe_hidden_dim: routed-expert hidden size (``None``: the flavor's).
        ep: expert-parallel degree the sharding config is set for.
        fp32_reference: use :class:`Fp32GroupedExperts` (original models in fp32 tests).
    """
    cfg = model_spec(name).model
    if n_layers is not None:
        cfg.layers = cfg.layers[:n_layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        inner = moe.routed_experts.inner_experts
        if moe_hidden_dim is not None:
            inner.hidden_dim = moe_hidden_dim
        if fp32_reference:
            moe.routed_experts.inner_experts = Fp32GroupedExperts.Config(
                **{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)})
    cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism(ep)))
    return cfg


def relibra_config(name: str, *, expert_dtype: str | None = None, **options):
    """The same model with every MoE swapped by the override (fp32 experts by default)."""
    cfg = model_config(name, **{k: options.pop(k) for k in ("n_layers", "moe_hidden_dim", "ep")
                                if k in options})
    lines = apply_relibra(cfg, expert_dtype=expert_dtype, **options)
    assert len(lines) == sum(getattr(layer, "moe", None) is not None for layer in cfg.layers)
    return cfg


def parallelism(ep: int = 1) -> ParallelismConfig:
    return ParallelismConfig(spmd_backend=BACKEND, expert_parallel_degree=ep,
                             data_parallel_shard_degree=-1)


def build(cfg, seed: int = 0) -> torch.nn.Module:
    """Build on meta, materialise on CPU and initialise with torchtitan's ``init_weights``."""
    use_cpu_backend()
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def parallel_dims(world_size: int, ep: int) -> ParallelDims:
    """torchtitan's meshes over the gloo world (EP ``ep``, FSDP over the rest)."""
    import torchtitan.distributed.parallel_dims as pd

    # torchtitan falls back to "cuda" when no accelerator is present; the meshes must be CPU.
    pd.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=ep,
                        world_size=world_size, spmd_backend=BACKEND)
    dims.build_mesh()
    return dims


def build_parallel(name: str, cfg, dims: ParallelDims, full_params: dict | None = None,
                   fsdp: bool = True, ac_config=None) -> torch.nn.Module:
    """Build ``cfg`` through the flavor's own parallelize function (EP, FSDP), in fp32.

    ``full_params``: full (unsharded, logical order) ``named_parameters`` values every rank
    loads (see :func:`load_full_params`). ``ac_config``: torchtitan activation checkpointing.
    """
    from torch.distributed.fsdp import FSDPModule

    use_cpu_backend()
    spec = model_spec(name)
    with torch.device("meta"):
        model = cfg.build()
    training = TrainingConfig(mixed_precision_param="float32", local_batch_size=1, seq_len=16)
    extra = {} if fsdp else {"skip_dp": True}
    model = spec.parallelize_fn(model, parallel_dims=dims, training=training,
                                parallelism=parallelism(dims.ep), compile_config=CompileConfig(),
                                ac_config=ac_config, dump_folder="/tmp", **extra)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if full_params is not None:
        load_full_params(model, full_params)
    model.train()
    return model


def _unwrapped(name: str) -> str:
    """A parameter name without activation-checkpoint wrapper components."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _expert_placements(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from integrations.torchtitan import RelibraRoutedExperts
    return {_unwrapped(f"{n}.inner_experts."): m.placement_E.cpu() for n, m in model.named_modules()
            if isinstance(m, RelibraRoutedExperts)}


@torch.no_grad()
def load_full_params(model: torch.nn.Module, full_params: dict[str, torch.Tensor]) -> None:
    """Copy full parameters into a (possibly sharded, possibly reordered) model.

    Written against ``named_parameters`` rather than ``set_model_state_dict``: torchtitan's
    fused-QKV state-dict hooks do not load a full state dict into FSDP-sharded Qwen3.
    Expert rows go to the physical slots of the layer's placement.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    placements = _expert_placements(model)
    params = {_unwrapped(k): p for k, p in model.named_parameters()}
    assert params.keys() == full_params.keys(), sorted(set(params) ^ set(full_params))
    for name, p in params.items():
        full = full_params[name].detach()
        for prefix, placement_E in placements.items():
            if name.startswith(prefix):
                physical = torch.empty_like(full)
                physical[placement_E] = full
                full = physical
        if isinstance(p, DTensor):
            rep = distribute_tensor(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            p.to_local().copy_(rep.redistribute(p.device_mesh, p.placements).to_local())
        else:
            p.copy_(full)


@torch.no_grad()
def gather_full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters in logical expert order (collective when the model is sharded).

    Reads the parameters and the placements directly (not the library's state-dict hooks),
    so it checks those hooks' result independently.
    """
    from torch.distributed.tensor import DTensor

    placements = _expert_placements(model)
    out = {}
    for name, p in model.named_parameters():
        name = _unwrapped(name)
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for prefix, placement_E in placements.items():
            if name.startswith(prefix):
                full = full.index_select(0, placement_E)
        out[name] = full
    return out


def tokens(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def loss_fn(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (callers normalise by the global token count)."""
    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), reduction="sum")


def num_moe_layers(cfg) -> int:
    return sum(isinstance(getattr(layer, "moe", None), MoE.Config) for layer in cfg.layers)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    """``|a - e| <= rtol * max|e|`` (relative to the tensor's scale, not per element)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = expected.abs().max().clamp(min=1e-30)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol:.0e} * {scale:.3e}"
