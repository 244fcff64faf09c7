"""The compression options: one typed value for what a worker's message holds.

Every DeMo-family factory (:func:`distro_jax.demo`, :func:`distro_jax.distro`,
:func:`distro_jax.distro_adamw`, :func:`distro_jax.scale_by_demo`) and
:func:`distro_jax.gradient_point` take :class:`Compression`'s fields as
keywords of the same names, so one dict of options can be passed to all of
them; adding an option is one field here.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

from distro_jax import codec, dct, wire
from distro_jax.hyperparams import (
  StaticFloat,
  StaticInt,
  check_decay,
  static_nonnegative_float,
  static_positive_int,
  unwrap_static,
)

__all__ = ["Compression"]


class Compression(NamedTuple):
  """What a worker's message holds and how it is chosen (docs/design.md, section 2).

  Attributes:
    compression_decay: the decoupled momentum's decay in ``[0, 1)``; 0 is the
      stateless mode.
    compression_topk: coefficients sent per chunk, clamped to the chunk size.
      Static.
    compression_chunk: chunk length target per axis. Static.
    quantize_1bit: send each value's sign only; the error feedback still
      removes the full value. Static.
    use_dct: ``False`` selects raw entries instead of DCT coefficients (an
      ablation). Static.
    random_positions: send the values at ``compression_topk`` positions per
      chunk that every receiver draws from the step and the sender's index,
      so the message carries no indices. Static.
    frequency_bias: with ``random_positions``, draw coefficient ``(i, j)``
      with probability proportional to ``((1 + i) (1 + j)) ** -bias``;
      ``None`` draws uniformly. Static.
    error_feedback: remove what was sent from the momentum (DeMo's); with
      ``False`` the momentum keeps it, so it is Muon's momentum of the
      worker's own gradient and the message samples it. Static.
    sent_keep: with ``error_feedback``, the share in ``[0, 1)`` of each sent
      coefficient that stays in the momentum: 0 removes all of it (DeMo's),
      ``mu`` keeps ``mu`` of it (Dion's error feedback, arXiv:2504.05295), so
      what was sent decays as a momentum does, and with nothing dropped the
      momentum is heavy-ball with decay ``compression_decay * mu``. Static.

  Example:
    >>> import distro_jax as dj
    >>> opts = dj.Compression(compression_topk=8, quantize_1bit=True)._asdict()
    >>> tx = dj.demo(1e-3, axis_name=None, **opts)
  """

  compression_decay: float = StaticFloat(0.999)
  compression_topk: int = StaticInt(32)
  compression_chunk: int = StaticInt(64)
  quantize_1bit: bool = False
  use_dct: bool = True
  random_positions: bool = False
  frequency_bias: float | None = None
  error_feedback: bool = True
  sent_keep: float = StaticFloat(0.0)

  @classmethod
  def of(cls, options: Mapping[str, Any]) -> "Compression":
    """The options named in ``options`` (a dict of keywords), the rest at their defaults.

    Raises:
      TypeError: a name that is not a field, with the fields listed.
    """
    unknown = sorted(set(options) - set(cls._fields))
    if unknown:
      raise TypeError(
        f"unexpected keyword {', '.join(unknown)}: neither an argument of this function nor a "
        f"compression option ({', '.join(cls._fields)})."
      )
    return cls(**options)

  def checked(self) -> "Compression":
    """The options with each refused, with the fix, when wrong; sizes as ints, decay unwrapped."""
    decay = unwrap_static(self.compression_decay)
    check_decay(
      "compression_decay",
      decay,
      one_allowed=False,
      hint="Use 0 for the stateless mode, or e.g. 0.999 (the reference default).",
    )
    keep = unwrap_static(self.sent_keep)
    check_decay(
      "sent_keep",
      keep,
      one_allowed=False,
      hint="Use 0 for DeMo's error feedback, or e.g. 0.5; error_feedback=False keeps all of it.",
    )
    if keep and not self.error_feedback:
      raise ValueError(
        f"sent_keep={keep} is the share of a sent value the error feedback leaves, and "
        "error_feedback=False leaves all of it; drop sent_keep, or pass error_feedback=True."
      )
    bias = 0.0
    if self.frequency_bias is not None:
      bias = static_nonnegative_float("frequency_bias", self.frequency_bias, example=1.0)
      if not self.random_positions:
        raise ValueError(
          f"frequency_bias={self.frequency_bias} shapes the draw of random_positions=True; "
          "pass random_positions=True, or leave frequency_bias=None."
        )
    return Compression(
      compression_decay=decay,
      compression_topk=static_positive_int("compression_topk", self.compression_topk, example=32),
      compression_chunk=static_positive_int(
        "compression_chunk", self.compression_chunk, example=64
      ),
      quantize_1bit=bool(self.quantize_1bit),
      use_dct=bool(self.use_dct),
      random_positions=bool(self.random_positions),
      frequency_bias=bias,
      error_feedback=bool(self.error_feedback),
      sent_keep=float(keep),
    )

  @property
  def basis(self) -> dct.Basis:
    """The chunk transform: the DCT, or the identity of ``use_dct=False``."""
    return dct.basis(self.use_dct)

  def layout(self, params: Any) -> codec.WireLayout:
    """The message's bytes for ``params`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return wire.wire_layout(
      params,
      compression_topk=self.compression_topk,
      compression_chunk=self.compression_chunk,
      quantize_1bit=self.quantize_1bit,
      random_positions=self.random_positions,
    )


_F = TypeVar("_F", bound=Callable[..., Any])


def takes_compression(fn: _F) -> _F:
  """Lists :class:`Compression`'s fields in ``fn``'s signature, for ``fn(..., **compression)``.

  ``optax.inject_hyperparams`` and ``help`` read the signature, so they see
  each option by name with its default.
  """
  sig = inspect.signature(fn)
  own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
  fields = [
    inspect.Parameter(
      name,
      inspect.Parameter.KEYWORD_ONLY,
      default=default,
      annotation=Compression.__annotations__[name],
    )
    for name, default in Compression._field_defaults.items()
  ]
  fn.__signature__ = sig.replace(parameters=own + fields)
  return fn
