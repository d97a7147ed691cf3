"""The derived tolerance every fast-path test uses.

A fast path (fused kernel, chunked prefill, step decode, banded or sparse attention, a batched
stream, a quantized GEMV, ...) may be at most **twice** as far from a float64 evaluation of the
same weights as the plain float32 reference path is:

    err(fast, ref64) <= 2 * err(plain32, ref64) + floor

The factor 2 leaves room for a different but equally good summation order; anything looser
would hide a real bug. The ``floor`` is an absolute term for an error the plain path does not
have but the fast path is allowed, or for a reference error that can be (near) zero. Each floor
is one of the named ones below, so a reader sees why it is there:

- ``LOGIT_FLOOR`` (1e-6): a few float32 ulps of an O(1) logit. Tiny models sometimes give a
  plain-path error of almost nothing on some rows; without the floor a fast path rounding one
  ulp differently would fail.
- ``ulps(n, scale)``: ``n`` float32 ulps of ``scale``. Fused C++ kernels compute ``exp`` with a
  polynomial of 2 ulp relative error on each attention weight; an attention output is a convex
  combination of value rows, so that adds at most ``2 * 2**-23 * max|v|`` (``ulps(2, vmax)``);
  through a whole model's logits ``ulps(4, max|logit|)``. ``ulps(1, 1.0)`` is one ulp at 1.0.
- ``TIE_FLOOR`` (1e-12): for quantities far below 1 in error (a mean of bits per token, a GEMV
  of a few hundred terms) where only a tie with the reference error must also pass.
"""

from __future__ import annotations

import torch

EPS32 = 2.0 ** -23   # float32 ulp at 1.0 (torch.finfo(torch.float32).eps)
LOGIT_FLOOR = 1e-6
TIE_FLOOR = 1e-12


def ulps(n: float, scale: float) -> float:
    """``n`` float32 ulps of a quantity of magnitude ``scale``: the floor an exp polynomial
    (2 ulp relative per weight) or a summation order adds on outputs bounded by ``scale``."""
    return n * EPS32 * scale


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref|, computed in float64 (any shapes that broadcast)."""
    return (x.double() - ref.double()).abs().max().item()


def derived_bound(reference_err: float, floor: float = 0.0) -> float:
    """The 2x rule: ``2 * reference_err + floor``.

    ``reference_err`` is the plain float32 reference path's error against float64; where a test
    compares two runs directly, it is what the same comparison shows on a setting known to be
    exact in real arithmetic (two engines' dense logits, a run shifted by a RoPE translation,
    keys turned by a re-rotation's angle error). ``floor``: one of the module's named floors,
    or a test's own bound of an error source the reference does not have (say a re-rotation
    bound), documented where it is passed."""
    return 2.0 * reference_err + floor


def derived_tolerance(plain: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``derived_bound(max |plain - ref|, floor)``: the tolerance for any fast path computing
    what ``plain`` (the float32 reference path) computes, against ``ref`` (float64)."""
    return derived_bound(max_err(plain, ref), floor)


def assert_within_derived(fast: torch.Tensor, plain: torch.Tensor, ref: torch.Tensor,
                          floor: float = 0.0, what: str = "") -> float:
    """Assert ``max |fast - ref| <= 2 * max |plain - ref| + floor``; return the fast error.

    fast, plain: the fast path's and the plain float32 path's outputs of the same inputs (any
    shape); ref: the float64 evaluation of the same weights, same shape."""
    tol = derived_tolerance(plain, ref, floor)
    err = max_err(fast, ref)
    assert err <= tol, f"{what + ': ' if what else ''}{err:.3e} > 2x plain error + floor = {tol:.3e}"
    return err
