"""Each method's gap to AdamW and to the best dense method, as ``compare`` and ``frontier`` report.

A *dense* method all-reduces the whole gradient every step (the registry's
``Method.dense``: ``adamw``, ``muon``). A user choosing an optimizer compares
against the best of them at the same horizon, not against AdamW alone, so
every result carries both gaps: ``loss / reference - 1``, positive where the
method is behind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from experiments.run import methods

__all__ = ["gaps", "is_dense", "reading_warning"]


def is_dense(name: str) -> bool:
  """Whether the method called ``name`` (family and options) is a dense baseline."""
  return methods.parse(name)[0].dense


def _gap(loss: float, reference: float | None) -> float | None:
  if reference is None or not (math.isfinite(loss) and math.isfinite(reference)):
    return None
  return loss / reference - 1


def gaps(losses: Mapping[str, float]) -> dict[str, dict[str, Any]]:
  """Every method's gaps among ``losses`` (method name to validation loss, one horizon).

  Returns:
    Per method: ``val_gap_vs_adamw`` (to ``adamw``'s loss, if it ran),
    ``best_dense`` (the dense method with the lowest finite loss, if any ran)
    and ``gap_to_best_dense`` (to that loss); ``None`` where there is no
    reference or a loss is not finite.
  """
  dense = {n: v for n, v in losses.items() if is_dense(n) and math.isfinite(v)}
  best = min(dense, key=dense.get) if dense else None
  adamw = losses.get(methods.BASELINE)
  return {
    name: {
      "val_gap_vs_adamw": _gap(loss, adamw),
      "best_dense": best,
      "gap_to_best_dense": _gap(loss, dense[best] if best else None),
    }
    for name, loss in losses.items()
  }


def reading_warning(who: str, train_epochs: float | None) -> str | None:
  """A warning line for a run that read its training data more than once, else ``None``."""
  if train_epochs is None or train_epochs <= 1:
    return None
  return (
    f"warning: {who} reads its training split {train_epochs:.2f} times, so its validation "
    "loss also measures memorization; fewer steps, or more data (python -m "
    "experiments.fetch_corpus), reads it once"
  )
