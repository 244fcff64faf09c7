"""Measured communication: bytes entering collectives, read from compiled HLO.

The compiled module is the per-device SPMD program, so an operand's shape is
what one device puts into the collective. Compiled HLO prints operands by name
only, so every instruction's result shape is indexed first and the operands are
looked up there.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

__all__ = ["CollectiveBytes", "collective_bytes", "parse_collective_bytes"]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "s32": 4,
  "u32": 4,
  "s64": 8,
  "u64": 8,
  "f16": 2,
  "bf16": 2,
  "f32": 4,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "f8e4m3fnuz": 1,
  "f8e5m2fnuz": 1,
  "f8e4m3": 1,
  "f8e3m4": 1,
  "f8e4m3b11fnuz": 1,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


class CollectiveBytes(NamedTuple):
  """Bytes one device puts into collectives, per kind.

  Attributes:
    by_kind: bytes per collective kind (all five kinds always present).
    ops: ``(kind, instruction name, bytes)`` for every collective found.
  """

  by_kind: dict[str, int]
  ops: list[tuple[str, str, int]]

  @property
  def total(self) -> int:
    return sum(self.by_kind.values())


def _shape_bytes(shape: str) -> int:
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _DTYPE_BYTES:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _DTYPE_BYTES[dtype]
  return int(total)


def _split_shape(rest: str) -> tuple[str, str]:
  """Splits ``"SHAPE opcode(operands), attrs"`` into shape and the remainder."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        return rest[: i + 1], rest[i + 1 :].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail


def _operands(call: str) -> list[str]:
  """The operand list of ``opcode(a, b), attrs`` as raw strings."""
  start = call.index("(")
  depth = 0
  for i in range(start, len(call)):
    depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(call[i], 0)
    if depth == 0:
      inner = call[start + 1 : i]
      break
  else:
    inner = call[start + 1 :]
  parts, depth, cur = [], 0, ""
  for ch in inner:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append(cur.strip())
      cur = ""
    else:
      cur += ch
  if cur.strip():
    parts.append(cur.strip())
  return parts


def parse_collective_bytes(hlo_text: str) -> CollectiveBytes:
  """Reads per-device collective input bytes from HLO text.

  Args:
    hlo_text: HLO module text, e.g. ``jax.jit(f).lower(...).compile().as_text()``.

  Returns:
    A :class:`CollectiveBytes`. Asynchronous pairs count once, at ``-start``.
  """
  shapes: dict[str, str] = {}
  instrs: list[tuple[str, str, str]] = []
  for line in hlo_text.splitlines():
    # Long operand lists carry /*index=N*/ markers that would hide a name.
    m = _DEF.match(_COMMENT.sub("", line))
    if not m or "(" not in m.group(2):
      continue
    name, rest = m.groups()
    shape, call = _split_shape(rest)
    shapes[name] = shape
    opcode = call.split("(", 1)[0].strip()
    instrs.append((name, opcode, call))

  by_kind = dict.fromkeys(KINDS, 0)
  ops = []
  for name, opcode, call in instrs:
    kind = opcode.removesuffix("-start")
    if kind not in KINDS:
      continue
    nbytes = 0
    for operand in _operands(call):
      if _ARRAY.search(operand):
        nbytes += _shape_bytes(operand.rsplit(" ", 1)[0])
      else:
        nbytes += _shape_bytes(shapes.get(operand.lstrip("%"), ""))
    by_kind[kind] += nbytes
    ops.append((kind, name, nbytes))
  return CollectiveBytes(by_kind, ops)


def collective_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CollectiveBytes:
  """Compiles ``fn(*args, **kwargs)`` and measures the bytes entering collectives.

  Args:
    fn: a function, jitted or not (it is jitted if it has no ``lower``). For a
      train step, pass the jitted step itself with its real arguments.
    *args: its arguments, placed as they will be at run time.
    **kwargs: its keyword arguments.

  Returns:
    A :class:`CollectiveBytes` for one call, per device.

  Example:
    >>> import jax, jax.numpy as jnp, distro_jax as dj
    >>> dj.collective_bytes(lambda x: x * 2, jnp.ones(3)).total
    0
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  return parse_collective_bytes(jitted.lower(*args, **kwargs).compile().as_text())
