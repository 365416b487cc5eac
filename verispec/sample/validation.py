"""Input checks for the public sampler entry points.

Shape, dtype and device checks read only tensor metadata. Value checks (NaN / +inf, ids out of
range, offsets that do not add up) read tensor contents and therefore synchronise with the
device; they run when the caller asks for validation (the default for direct users), and the
engine, which builds its inputs itself, turns them off.
"""

from __future__ import annotations

import torch


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    *,
    floating: bool = False,
    integer: bool = False,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is {type(t).__name__}: expected a torch.Tensor")
    if t.dim() != ndim:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {ndim} dimensions")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name} has dtype {t.dtype}: expected a floating-point dtype")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{name} has dtype {t.dtype}: expected an integer dtype")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}: expected {device}, like target_logits")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {shape}")


def check_logit_values(name: str, t: torch.Tensor) -> None:
    """Logits may be -inf (masked tokens) but not NaN or +inf, and every row needs a finite one."""
    bad = torch.isnan(t) | (t == float("inf"))
    if bool(bad.any()):
        row = int(bad.any(dim=-1).nonzero()[0, 0])
        raise ValueError(f"{name} row {row} contains NaN or +inf: expected finite logits (or -inf)")
    empty = ~torch.isfinite(t).any(dim=-1)
    if bool(empty.any()):
        row = int(empty.nonzero()[0, 0])
        raise ValueError(f"{name} row {row} is all -inf: expected at least one finite logit")


def check_prob_values(name: str, t: torch.Tensor, tol: float = 1e-3) -> None:
    """Probability rows: finite, non-negative, summing to 1 within tol."""
    bad = ~torch.isfinite(t) | (t < 0)
    if bool(bad.any()):
        row = int(bad.any(dim=-1).nonzero()[0, 0])
        raise ValueError(f"{name} row {row} has NaN, inf or negative entries: expected probabilities")
    off = (t.double().sum(dim=-1) - 1).abs() > tol
    if bool(off.any()):
        row = int(off.nonzero()[0, 0])
        total = float(t[row].double().sum())
        raise ValueError(f"{name} row {row} sums to {total:.6g}: expected 1 (within {tol})")


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} contains token id {bad}: expected ids in [0, {vocab_size})")


def check_offsets(name: str, cu: torch.Tensor, batch_size: int, total: int) -> list[int]:
    """cu: [B + 1] cumulative counts with a leading 0. Returns the per-request counts."""
    check_shape(name, cu, (batch_size + 1,))
    values = cu.tolist()
    counts = [b - a for a, b in zip(values, values[1:])]
    if values[0] != 0 or any(c < 0 for c in counts) or values[-1] != total:
        raise ValueError(
            f"{name}={values!r} is invalid: expected a leading 0, non-decreasing values "
            f"(counts >= 0) and a last value equal to the number of draft tokens ({total})"
        )
    return counts
