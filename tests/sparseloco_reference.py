"""Plain-NumPy SparseLoCo, written from docs/design.md section 6 and the quantizer's definition.

Float64 throughout, in the parameter domain as Templar's code works (the error
feedback is a param-shaped buffer; what was sent comes back through the
inverse transform), with plain SGD as the inner optimizer. It shares no code
with distro_jax.
"""

import numpy as np
from numpy_reference import Chunker, newton_schulz


class RawChunker(Chunker):
  """The same chunks as :class:`Chunker`, with no transform (SparseLoCo's production form)."""

  def __init__(self, shape, s):
    super().__init__(shape, s)
    self.ds = [np.eye(c) for c in self.cs]


def quantize(values, bits):
  """Codes and the float codebook of one tensor's kept values (see distro_jax.sparseloco)."""
  v = np.asarray(values, np.float64).ravel()
  bins = 2**bits
  mu = v.mean()
  c = v - mu
  if bits == 1:
    codes = (c >= 0).astype(np.int64)
  else:
    sigma = np.sqrt(np.sum(c**2) / max(v.size - 1, 1))
    width = 6.0 * sigma / bins
    if not (width > 0 and np.isfinite(width)):
      width = 1.0
    codes = np.clip(np.round(c / width + bins // 2), 0, bins - 1).astype(np.int64)
  book = np.array([mu + (c[codes == j].mean() if np.any(codes == j) else 0.0) for j in range(bins)])
  return codes.reshape(np.shape(values)), book


def topk_rows(coeff, k):
  """Indices of the k largest magnitudes per row, ties to the lower index."""
  return np.argsort(-np.abs(coeff), axis=1, kind="stable")[:, :k]


class ReferenceSparseLoCo:
  """SparseLoCo for W workers with SGD inside; ``step`` returns the outer params.

  ``positions(name, worker, step, k)``, if given, names each chunk's k
  positions (``(chunks, k)``) at each synchronization's step count: DeMo's
  drawn message. Its values then travel as signs (``bits=1``, zero counting
  as positive), what was drawn leaves the buffer whole, and each coefficient
  is averaged over the workers that drew it. ``normalize`` (``"rms"`` or
  ``"orth"``) shapes the mean into the step: each matrix through
  :func:`newton_schulz` with ``"orth"``, then every tensor at unit RMS.
  ``outer_lr`` may be a function of the step count, read at the
  synchronizing step's (``t - 1``).
  """

  def __init__(
    self,
    params,
    workers,
    *,
    lr,
    sync_every,
    outer_lr,
    decay,
    topk,
    chunk,
    bits,
    use_dct,
    clip,
    positions=None,
    normalize=None,
  ):
    make = Chunker if use_dct else RawChunker
    self.chunkers = {k: make(np.shape(v), chunk) for k, v in params.items()}
    self.outer = {k: np.asarray(v, np.float64) for k, v in params.items()}
    self.local = [{k: v.copy() for k, v in self.outer.items()} for _ in range(workers)]
    self.errors = [{k: np.zeros_like(v) for k, v in self.outer.items()} for _ in range(workers)]
    self.lr, self.h, self.outer_lr, self.decay = lr, sync_every, outer_lr, decay
    self.topk, self.bits, self.clip = topk, bits, clip
    self.positions, self.normalize = positions, normalize
    self.t = 0

  def _message(self, w, name):
    """Worker w's decoded contribution to tensor ``name``: (indices, values) per chunk."""
    ch = self.chunkers[name]
    e = self.errors[w][name]
    e = self.decay * e + (self.outer[name] - self.local[w][name])
    coeff = ch.forward(e)
    k = min(self.topk, coeff.shape[1])
    idx = topk_rows(coeff, k)
    val = np.take_along_axis(coeff, idx, axis=1)
    if self.bits is not None:
      codes, book = quantize(val, self.bits)
      val = book[codes]
    sent = np.zeros_like(coeff)
    np.put_along_axis(sent, idx, val, axis=1)
    self.errors[w][name] = e - ch.inverse(sent).reshape(e.shape)
    return idx, val

  def _drawn_message(self, w, name):
    """Worker w's drawn message for tensor ``name``: (indices, values as received)."""
    ch = self.chunkers[name]
    e = self.decay * self.errors[w][name] + (self.outer[name] - self.local[w][name])
    coeff = ch.forward(e)
    k = min(self.topk, coeff.shape[1])
    idx = np.asarray(self.positions(name, w, self.t, k)).reshape(coeff.shape[0], k)
    val = np.take_along_axis(coeff, idx, axis=1)
    sent = np.zeros_like(coeff)
    np.put_along_axis(sent, idx, val, axis=1)
    self.errors[w][name] = e - ch.inverse(sent).reshape(e.shape)
    return idx, (np.where(val >= 0, 1.0, -1.0) if self.bits == 1 else val)

  def _drawn_mean(self, name):
    """Each coefficient's mean over the workers that drew it."""
    ch = self.chunkers[name]
    rows = ch.forward(self.outer[name]).shape[0]
    total, count = np.zeros((rows, np.prod(ch.cs))), np.zeros((rows, np.prod(ch.cs)))
    for w in range(len(self.local)):
      idx, val = self._drawn_message(w, name)
      np.add.at(total, (np.arange(rows)[:, None], idx), val)
      np.add.at(count, (np.arange(rows)[:, None], idx), 1.0)
    return np.where(count > 0, total / np.maximum(count, 1), 0.0)

  def _topk_mean(self, name):
    """The mean over all W of the workers' (clipped) top-k messages."""
    ch = self.chunkers[name]
    msgs = [self._message(w, name) for w in range(len(self.local))]
    vals = [v for _, v in msgs]
    if self.clip:
      norms = np.array([np.linalg.norm(v) for v in vals])
      med = np.sort(norms)[(len(norms) - 1) // 2]
      vals = [v * min(1.0, med / (n + 1e-8)) for v, n in zip(vals, norms)]
    total = np.zeros((msgs[0][0].shape[0], np.prod(ch.cs)))
    for (idx, _), v in zip(msgs, vals):
      np.add.at(total, (np.arange(idx.shape[0])[:, None], idx), v)
    return total / len(msgs)

  def _direction(self, name):
    """The outer step's direction: the mean, or the mean orthogonalized and at unit RMS."""
    mean = self._drawn_mean(name) if self.positions is not None else self._topk_mean(name)
    mean = self.chunkers[name].inverse(mean).reshape(self.outer[name].shape)
    if self.normalize is None:
      return mean
    if self.normalize == "orth" and mean.ndim == 2:
      mean = newton_schulz(mean)
    rms = np.sqrt(np.mean(mean * mean))
    return mean / rms if rms > 0 else np.zeros_like(mean)

  def step(self, grads_per_worker):
    self.t += 1
    for w, grads in enumerate(grads_per_worker):
      for k in self.local[w]:
        self.local[w][k] = self.local[w][k] - self.lr * np.asarray(grads[k], np.float64)
    if self.t % self.h == 0:
      rate = self.outer_lr(self.t - 1) if callable(self.outer_lr) else self.outer_lr
      for name in self.chunkers:
        self.outer[name] = self.outer[name] - rate * self._direction(name)
      for w in range(len(self.local)):
        self.local[w] = {k: v.copy() for k, v in self.outer.items()}
    return self.outer
