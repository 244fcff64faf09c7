"""Measured communication: the bytes each device puts into collectives, read from compiled HLO."""

import math
import re
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = [
  "CollectiveBytes",
  "collective_bytes",
  "collective_bytes_by_axes",
  "parse_collective_bytes",
]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
  **dict.fromkeys(("s4", "u4"), 0.5),
  **dict.fromkeys(("pred", "s8", "u8", "f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz"), 1),
  **dict.fromkeys(("f8e4m3", "f8e3m4", "f8e4m3b11fnuz"), 1),
  **dict.fromkeys(("s16", "u16", "f16", "bf16"), 2),
  **dict.fromkeys(("s32", "u32", "f32"), 4),
  **dict.fromkeys(("s64", "u64", "f64", "c64"), 8),
  "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_DEPTH = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}


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
    if dtype in _DTYPE_BYTES:
      total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
  return int(total)


def _split_shape(rest: str) -> tuple[str, str]:
  """Splits ``"SHAPE opcode(operands), attrs"`` into shape and the remainder."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += _DEPTH.get(ch, 0)
      if depth == 0:
        return rest[: i + 1], rest[i + 1 :].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail


def _operands(call: str) -> list[str]:
  """The operand list of ``opcode(a, b), attrs`` as raw strings."""
  parts, depth = [""], 0
  for ch in call[call.index("(") + 1 :]:
    depth += _DEPTH.get(ch, 0)
    if depth < 0:  # the opcode's closing parenthesis
      break
    if ch == "," and depth == 0:
      parts.append("")
    else:
      parts[-1] += ch
  parts = [p.strip() for p in parts]
  return parts if parts[-1] else parts[:-1]


def _collectives(hlo_text: str) -> list[tuple[str, str, int, str]]:
  """``(kind, name, operand bytes, attributes)`` of every collective in HLO text."""
  # Compiled HLO names operands without their shapes: index every result shape first.
  shapes: dict[str, str] = {}
  calls: list[tuple[str, str, str]] = []
  for line in hlo_text.splitlines():
    # Long operand lists carry /*index=N*/ markers that would hide a name.
    m = _DEF.match(_COMMENT.sub("", line))
    if not m or "(" not in m.group(2):
      continue
    name, rest = m.groups()
    shapes[name], call = _split_shape(rest)
    kind = call.split("(", 1)[0].strip().removesuffix("-start")
    if kind in KINDS:
      calls.append((kind, name, call))
  found = []
  for kind, name, call in calls:
    nbytes = 0
    for operand in _operands(call):
      if _ARRAY.search(operand):
        nbytes += _shape_bytes(operand.rsplit(" ", 1)[0])
      else:
        nbytes += _shape_bytes(shapes.get(operand.lstrip("%"), ""))
    found.append((kind, name, nbytes, call))
  return found


def _tally(found: list[tuple[str, str, int, str]]) -> CollectiveBytes:
  by_kind = dict.fromkeys(KINDS, 0)
  for kind, _, nbytes, _ in found:
    by_kind[kind] += nbytes
  return CollectiveBytes(by_kind, [(kind, name, nbytes) for kind, name, nbytes, _ in found])


def parse_collective_bytes(hlo_text: str) -> CollectiveBytes:
  """Reads per-device collective input bytes from HLO text.

  Args:
    hlo_text: HLO module text, e.g. ``jax.jit(f).lower(...).compile().as_text()``.

  Returns:
    A :class:`CollectiveBytes`. Asynchronous pairs count once, at ``-start``.
  """
  return _tally(_collectives(hlo_text))


_GROUPS_LIST = re.compile(r"(?:replica_groups|source_target_pairs)=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([4,2]T(1,0)) {'axis_1'}: the devices
# (an iota, transposed, or 0..n-1 without device_ids) laid out on a mesh of named axes; each
# group is the devices that differ along the axes in braces only.
_GROUPS_MESH = re.compile(
  r"replica_groups=mesh\[([^\]]*)\]"
  r"(?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}"
)


def _iota(num_devices: int, dims: str, perm: str | None) -> np.ndarray:
  ids = np.arange(num_devices).reshape([int(x) for x in dims.split(",")])
  return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def _mesh_groups(m: re.Match, num_devices: int) -> list[list[int]]:
  axes = re.findall(r"'([^']*)'=([0-9]+)", m.group(1))
  names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
  ids = _iota(num_devices, m.group(2), m.group(3)) if m.group(2) else np.arange(num_devices)
  ids = ids.reshape(sizes)
  over = [names.index(a) for a in re.findall(r"'([^']*)'", m.group(4))]
  rest = [d for d in range(len(names)) if d not in over]
  size = int(np.prod([sizes[d] for d in over]))
  return ids.transpose(rest + over).reshape(-1, size).tolist()


def _device_groups(attrs: str, num_devices: int) -> list[list[int]]:
  """The groups of logical device ids a collective runs over, from its attributes."""
  m = _GROUPS_MESH.search(attrs)
  if m:
    return _mesh_groups(m, num_devices)
  m = _GROUPS_IOTA.search(attrs)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    return _iota(num_devices, m.group(2), m.group(3)).reshape(shape).tolist()
  m = _GROUPS_LIST.search(attrs)
  listed = re.findall(r"\{([0-9,]*)\}", m.group(1)) if m else []
  groups = [[int(x) for x in g.split(",") if x] for g in listed]
  # An empty list means one group of every device.
  return [g for g in groups if g] or [list(range(num_devices))]


def collective_bytes_by_axes(
  hlo_text: str, mesh: jax.sharding.Mesh
) -> dict[tuple[Hashable, ...], CollectiveBytes]:
  """Per-device collective bytes, keyed by the mesh axes each collective crosses.

  A collective crosses an axis when one of its groups spans several positions
  along it: on a ``("replica", "fsdp")`` mesh, ``("replica",)`` is the traffic
  between sites.

  Args:
    hlo_text: the compiled HLO of a step jitted over ``mesh``.
    mesh: the mesh the step runs on.

  Returns:
    A dict from a tuple of axis names, in mesh order, to the
    :class:`CollectiveBytes` of the collectives that cross exactly those axes.
  """
  num_devices = mesh.devices.size
  grouped: dict[tuple[Hashable, ...], list] = {}
  for op in _collectives(hlo_text):
    crossed = set()
    for group in _device_groups(op[3], num_devices):
      coords = np.array(np.unravel_index(group, mesh.devices.shape))
      crossed |= {d for d in range(coords.shape[0]) if len(set(coords[d])) > 1}
    key = tuple(mesh.axis_names[d] for d in sorted(crossed))
    grouped.setdefault(key, []).append(op)
  return {key: _tally(ops) for key, ops in grouped.items()}


def collective_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CollectiveBytes:
  """Compiles ``fn(*args, **kwargs)`` and measures the bytes entering collectives.

  Args:
    fn: a function, jitted or not; for a train step, the jitted step itself.
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
