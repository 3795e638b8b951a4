"""Argument checks with one error style for the whole package.

Every message names the field, the bad value and what is allowed, the way the replay
readers always have::

    TypeError:  top_k is str '8'; allowed: an int >= 1
    ValueError: top_k = 0; allowed: an int >= 1

``bool`` is never accepted where an int or a number is asked for (``True`` is an ``int`` to
Python, never a count to a user). Each check returns the value, so it can sit in an
assignment: ``self.top_k = check_int("top_k", top_k)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_choice", "check_int", "check_number", "check_tensor", "counted", "describe"]


def describe(value: object) -> str:
    """``type value!r``, shortened for long values (used by every message here)."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def check_int(name: str, value: object, minimum: int | None = 1, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (either bound may be ``None``).

    Raises ``TypeError`` for anything but a real int (``bool`` and ``float`` included) and
    ``ValueError`` outside the range; both name ``name`` and the allowed range.
    """
    allowed = _int_range(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is {describe(value)}; allowed: {allowed}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} = {value}; allowed: {allowed}")
    return int(value)


def check_number(name: str, value: object, minimum: float | None = None, *, strict: bool = False,
                 maximum: float | None = None) -> float:
    """``value`` as a finite float ``>= minimum`` (``> minimum`` with ``strict``), ``<= maximum``."""
    op = ">" if strict else ">="
    parts = ["a finite number"]
    if minimum is not None and maximum is not None:  # "in [0, 4]", "in (0, 1]"
        parts.append(f"in {'(' if strict else '['}{minimum:g}, {maximum:g}]")
    elif minimum is not None:
        parts.append(f"{op} {minimum:g}")
    elif maximum is not None:
        parts.append(f"<= {maximum:g}")
    allowed = " ".join(parts)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is {describe(value)}; allowed: {allowed}")
    bad = not math.isfinite(value)
    if minimum is not None:
        bad = bad or (value <= minimum if strict else value < minimum)
    if maximum is not None:
        bad = bad or value > maximum
    if bad:
        raise ValueError(f"{name} = {value}; allowed: {allowed}")
    return float(value)


def check_choice(name: str, value: object, choices) -> object:
    """``value`` if it is one of ``choices``, else ``ValueError`` listing them."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} = {value!r}; allowed: one of {', '.join(repr(c) for c in choices)}")
    return value


def check_tensor(name: str, value: object, *, dim: int | None = None, dtypes=None) -> torch.Tensor:
    """``value`` if it is a tensor with ``dim`` dims and a dtype among ``dtypes`` (when given)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} is {type(value).__name__}; allowed: a torch.Tensor")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} has shape {tuple(value.shape)}; allowed: a {dim}-D tensor")
    if dtypes is not None and value.dtype not in tuple(dtypes):
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(value.dtype).replace('torch.', '')}; allowed: {names}")
    return value


def _int_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def counted(count: int, word: str) -> str:
    """``count`` and ``word``, plural unless one: ``1 sample``, ``2 samples``."""
    return f"{count} {word}{'' if count == 1 else 's'}"
