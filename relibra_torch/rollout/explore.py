"""Exploration routing for rollouts (ESRL-style anchor + noisy candidate pool).

During a rollout a router normally takes its plain top-``K`` experts. With exploration on,
each token keeps the router's top ``K_anchor`` experts (*anchors*) and picks the remaining
``K - K_anchor`` from a *candidate pool*: the next ``M`` experts by score. Inside the pool
the choice uses scores perturbed with Gaussian noise whose scale grows as the router gets
more confident (lower normalised entropy ``H`` in ``[0, 1]``)::

    sigma_t = sigma_min + (sigma_max - sigma_min) * (1 - H_t)

Only the *choice* of experts is perturbed: the layer computes the mixing (gate) weights of
the chosen experts from the unperturbed live scores. :class:`~relibra_torch.moe.ReplayBalancedMoE`
does exactly that when the chosen ids are passed as ``routed_experts``, so exploration
needs no change in the layer, and the recorder stores the explored path so training
replays it exactly.

Noise space (``ExplorationConfig.noise_space``):

* ``"log"`` (default): noise is added to ``log(p)``, with ``p`` the scores normalised to
  sum to 1 per token. Scale-free: the same ``sigma`` means the same amount of exploration
  for 8 or 256 experts and for softmax or sigmoid scores (``sigma`` near 1.3 is about as
  random as sampling the pool in proportion to ``p``, as Gumbel noise would be).
* ``"score"``: noise is added to ``p`` itself (the literal reading; its effect depends on
  ``E`` because ``p`` is about ``1/E``).

Shape legend:
  T  tokens      E  experts      K  top-k      V  anchors (K_anchor, the kept top experts)
  C  candidate pool (``M`` in the ESRL notation)   Y  chosen candidates (K - K_anchor)
  R  ranked experts (anchors, then the pool)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_choice, check_int, check_number

__all__ = [
    "ExplorationConfig",
    "ExplorationPolicy",
    "explore_topk",
    "exploration_sigma",
    "resolve_pool",
    "routing_entropy",
]

_NOISE_SPACES = ("log", "score")


@dataclass(frozen=True)
class ExplorationConfig:
    """Parameters of exploration routing (off by default).

    Attributes:
        enabled: off (plain top-k) unless True.
        num_anchors: ``K_anchor``, experts always kept from the router's top; ``None`` means
            ``top_k // 2`` (so top-1 routing explores its only slot, top-8 keeps 4).
        pool_size: ``M``, candidates after the anchors that may be picked; ``None`` means
            ``2 * (top_k - K_anchor)``. Capped at ``num_experts - K_anchor``.
        sigma_min: noise scale for a maximally uncertain router (``H = 1``), >= 0.
        sigma_max: noise scale for a fully confident router (``H = 0``), >= sigma_min.
        noise_space: ``"log"`` (noise on log normalised scores) or ``"score"``.
        seed: seed of the generator an :class:`ExplorationPolicy` builds.
    """

    enabled: bool = False
    num_anchors: int | None = None
    pool_size: int | None = None
    sigma_min: float = 0.1
    sigma_max: float = 1.0
    noise_space: str = "log"
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled is {type(self.enabled).__name__} {self.enabled!r}; allowed: bool")
        for name, lo in (("num_anchors", 0), ("pool_size", 1)):
            if getattr(self, name) is not None:  # None: the default rule (resolve_pool)
                check_int(name, getattr(self, name), lo)
        for name in ("sigma_min", "sigma_max"):
            check_number(name, getattr(self, name), 0)
        if self.sigma_max < self.sigma_min:
            raise ValueError(
                f"sigma_max = {self.sigma_max} < sigma_min = {self.sigma_min}; allowed: sigma_max >= sigma_min"
            )
        check_choice("noise_space", self.noise_space, _NOISE_SPACES)
        check_int("seed", self.seed, None)


def resolve_pool(top_k: int, num_experts: int, cfg: ExplorationConfig) -> tuple[int, int]:
    """``(K_anchor, M)`` for ``top_k`` of ``num_experts`` after defaults and the cap.

    Raises ``ValueError`` when the configuration cannot fill ``top_k`` slots: explicit
    ``num_anchors > top_k``, or a pool smaller than ``top_k - K_anchor``.
    """
    check_int("top_k", top_k, 1, num_experts)
    anchors = top_k // 2 if cfg.num_anchors is None else cfg.num_anchors
    if anchors > top_k:
        raise ValueError(f"num_anchors = {anchors} exceeds top_k = {top_k}; allowed: 0 <= num_anchors <= top_k")
    need = top_k - anchors
    pool = 2 * need if cfg.pool_size is None else cfg.pool_size
    pool = min(pool, num_experts - anchors)
    if pool < need:
        raise ValueError(
            f"pool_size = {pool} (after capping at num_experts - num_anchors = {num_experts - anchors}) is smaller "
            f"than top_k - num_anchors = {need}; allowed: pool_size >= {need}"
        )
    return anchors, pool


def _check_scores(scores_TE) -> torch.Tensor:
    if not isinstance(scores_TE, torch.Tensor):
        raise TypeError(f"scores is {type(scores_TE).__name__}; allowed: a torch.Tensor [T, E]")
    if not scores_TE.dtype.is_floating_point:
        raise ValueError(f"scores has dtype {scores_TE.dtype}; allowed: a floating dtype")
    if scores_TE.dim() != 2 or scores_TE.shape[1] < 1:
        raise ValueError(f"scores has shape {tuple(scores_TE.shape)}; allowed: [T, E] with E >= 1")
    return scores_TE


def _normalised(scores_TE: torch.Tensor) -> torch.Tensor:
    s = scores_TE.float()
    if s.numel() and not bool(torch.isfinite(s).all()):
        raise ValueError("scores contains inf or nan; allowed: finite non-negative router scores (probabilities)")
    if s.numel() and bool((s < 0).any()):
        t, e = (int(i) for i in (s < 0).nonzero()[0])
        raise ValueError(
            f"scores[{t}, {e}] = {float(s[t, e])} is negative; allowed: non-negative router scores "
            "(softmax or sigmoid outputs, not logits)"
        )
    total = s.sum(dim=-1, keepdim=True)
    if s.numel() and bool((total <= 0).any()):
        t = int((total[:, 0] <= 0).nonzero()[0, 0])
        raise ValueError(f"scores[{t}] sums to 0; allowed: at least one positive score per token")
    return s / total


def routing_entropy(scores_TE: torch.Tensor) -> torch.Tensor:
    """Normalised entropy ``H`` (float32 ``[T]``, in ``[0, 1]``) of each token's scores.

    Scores (``[T, E]``, non-negative) are normalised to a distribution ``p`` per token;
    ``H = -sum_e p log p / log E`` (0 for ``E = 1``). 1 means uniform, 0 one-hot.
    """
    p_TE = _normalised(_check_scores(scores_TE))
    E = p_TE.shape[1]
    if E == 1:
        return torch.zeros(p_TE.shape[0], dtype=torch.float32, device=p_TE.device)
    plogp = torch.where(p_TE > 0, p_TE * torch.log(p_TE.clamp_min(torch.finfo(torch.float32).tiny)), 0.0)
    return (-plogp.sum(dim=-1) / math.log(E)).clamp(0.0, 1.0)


def exploration_sigma(scores_TE: torch.Tensor, cfg: ExplorationConfig) -> torch.Tensor:
    """Per-token noise scale, float32 ``[T]``: ``sigma_min + (sigma_max - sigma_min) * (1 - H)``."""
    H_T = routing_entropy(scores_TE)
    return cfg.sigma_min + (cfg.sigma_max - cfg.sigma_min) * (1.0 - H_T)


def explore_topk(
    scores_TE: torch.Tensor,
    top_k: int,
    cfg: ExplorationConfig | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Expert ids ``[T, K]`` (int64) chosen for each token, with optional exploration.

    Args:
        scores_TE: the router's selection scores ``[T, E]``: non-negative (softmax or
            sigmoid outputs), not necessarily normalised. Experts with score 0 are never
            chosen as candidates (their log score is ``-inf``) unless the pool has nothing else.
        top_k: ``K``.
        cfg: exploration parameters; ``None`` or ``enabled=False`` gives plain top-k
            (``torch.topk(scores_TE, K).indices``, best first).
        generator: source of the Gaussian noise (required when exploration is on; draws
            ``T * M`` normals per call, so the same seed and call sequence give the same ids).

    Returns:
        int64 ``[T, K]``: columns ``0 .. K_anchor-1`` are the anchors (the router's top
        ``K_anchor``, best first), the rest are candidates from ranks
        ``K_anchor .. K_anchor+M-1`` of the unperturbed scores, best perturbed score first.
        Ids within a row are distinct.
    """
    scores_TE = _check_scores(scores_TE)
    E = scores_TE.shape[1]
    check_int("top_k", top_k, 1, E)
    if cfg is not None and not isinstance(cfg, ExplorationConfig):
        raise TypeError(f"cfg is {type(cfg).__name__}; allowed: ExplorationConfig or None")
    if cfg is None or not cfg.enabled:
        return torch.topk(scores_TE, top_k, dim=-1).indices
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator is {type(generator).__name__}; allowed: a torch.Generator (exploration draws noise; "
            "use ExplorationPolicy to hold one)"
        )
    anchors, pool = resolve_pool(top_k, E, cfg)
    need = top_k - anchors
    p_TE = _normalised(scores_TE)
    # Rank on the caller's scores (not p) so anchors are exactly plain top-k's leading ids.
    ranked_TR = torch.topk(scores_TE, anchors + pool, dim=-1).indices
    anchor_TV = ranked_TR[:, :anchors]
    pool_TC = ranked_TR[:, anchors:]
    if need == 0:
        return anchor_TV.contiguous()
    T = scores_TE.shape[0]
    sigma_T = exploration_sigma(scores_TE, cfg)
    # Drawn on the CPU generator's device in float32 regardless of the scores' dtype, so a
    # seed gives the same noise for fp32 and bf16 routers.
    eps_TC = torch.randn((T, pool), generator=generator, dtype=torch.float32, device=generator.device)
    eps_TC = eps_TC.to(scores_TE.device)
    p_pool_TC = p_TE.gather(1, pool_TC)
    if cfg.noise_space == "log":
        base_TC = torch.where(p_pool_TC > 0, torch.log(p_pool_TC.clamp_min(torch.finfo(torch.float32).tiny)), -math.inf)
    else:
        base_TC = torch.where(p_pool_TC > 0, p_pool_TC, -math.inf)
    # -inf + noise stays -inf: zero-score experts (e.g. masked by group-limited routing) lose.
    perturbed_TC = base_TC + sigma_T[:, None] * eps_TC
    pick_TY = torch.topk(perturbed_TC, need, dim=-1).indices
    chosen_TY = pool_TC.gather(1, pick_TY)
    return torch.cat([anchor_TV, chosen_TY], dim=1)


class ExplorationPolicy:
    """A routing policy for rollouts: ``policy(scores_TE, top_k) -> expert_ids_TK``.

    Holds the configuration and a generator seeded with ``cfg.seed`` (on ``device``), so
    one policy object used for a whole rollout reproduces its paths when rebuilt with the
    same seed and fed the same scores in the same order. With ``cfg.enabled = False`` it is
    plain top-k and draws nothing.
    """

    def __init__(self, cfg: ExplorationConfig | None = None, *, device: str | torch.device = "cpu"):
        cfg = ExplorationConfig() if cfg is None else cfg
        if not isinstance(cfg, ExplorationConfig):
            raise TypeError(f"cfg is {type(cfg).__name__}; allowed: ExplorationConfig or None")
        self.cfg = cfg
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(cfg.seed)

    def reseed(self, seed: int) -> None:
        """Restart the noise stream from ``seed``."""
        self.generator.manual_seed(seed)

    def __call__(self, scores_TE: torch.Tensor, top_k: int) -> torch.Tensor:
        return explore_topk(scores_TE, top_k, self.cfg, self.generator)

    def __repr__(self) -> str:
        return f"ExplorationPolicy({self.cfg!r})"
