"""Weight-only int8 quantization with per-output-channel scales.

Expert weights are stored torchtitan-style, ``[..., out, in]`` (``w1``/``w3`` ``[E, F, D]``,
``w2`` ``[E, D, F]``): one fp32 scale per output row. ``q = round(w / scale)`` with
``scale = max |w[row]| / 127`` (symmetric, no zero point, ``-128`` unused), so every element
comes back within ``scale / 2`` of the original: ``|w - dequantize(q, scale)| <= max|w[row]|
/ 254`` (plus the fp32 rounding of the product). A zero row gets scale 1 and stays exactly 0.

Legend: O output channels, I input channels, ``...`` leading dims (experts).
"""

from __future__ import annotations

import torch

__all__ = ["INT8_MAX", "dequantize_int8", "int8_bytes", "quantize_int8"]

INT8_MAX = 127


def quantize_int8(w_OI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_OI int8, scale_O float32)`` of a float weight ``[..., O, I]``."""
    if not isinstance(w_OI, torch.Tensor) or not w_OI.is_floating_point() or w_OI.dim() < 2:
        raise ValueError(f"w_OI must be a floating tensor [..., out, in], got "
                         f"{getattr(w_OI, 'dtype', type(w_OI).__name__)} {tuple(getattr(w_OI, 'shape', ()))}")
    w = w_OI.detach().to(torch.float32)
    amax_O = w.abs().amax(-1)
    scale_O = torch.where(amax_O > 0, amax_O / INT8_MAX, torch.ones_like(amax_O))
    q_OI = torch.round(w / scale_O.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q_OI, scale_O


def dequantize_int8(q_OI: torch.Tensor, scale_O: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float ``[..., O, I]`` weight of :func:`quantize_int8`'s output, in ``dtype``."""
    return (q_OI.to(torch.float32) * scale_O.unsqueeze(-1)).to(dtype)


def int8_bytes(shape_OI: tuple[int, ...]) -> int:
    """Bytes of one stored int8 weight of ``shape_OI``: the int8 values plus fp32 scales."""
    numel = 1
    for d in shape_OI:
        numel *= int(d)
    return numel + 4 * (numel // int(shape_OI[-1]))
