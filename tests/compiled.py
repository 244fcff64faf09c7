"""Jitted handles on transformations and functions that tests call outside a step.

Called eagerly, JAX compiles one program per operation: an update of a small
DeMo tree is about a hundred programs, and a test of three updates spent
3 CPU-seconds compiling them where one jitted update takes 0.5. Tests that
drive an update by hand go through these, so each step is one program.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax

import distro_jax as dj


def transformation(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` with its ``init`` and ``update`` each compiled as one program."""
  return optax.GradientTransformation(jax.jit(tx.init), jax.jit(tx.update))


def gradient_point(learning_rate: Any = None, **lookahead: Any) -> Callable[[Any, Any], Any]:
  """``dj.gradient_point`` with its options fixed, as one program of (state, params)."""
  return jax.jit(functools.partial(dj.gradient_point, learning_rate=learning_rate, **lookahead))
