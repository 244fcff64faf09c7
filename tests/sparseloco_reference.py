"""Plain-NumPy SparseLoCo, written from DESIGN.md section 1b and the quantizer's definition.

Float64 throughout, in the parameter domain as Templar's code works (the error
feedback is a param-shaped buffer; what was sent comes back through the
inverse transform), with plain SGD as the inner optimizer. It shares no code
with distro_jax.
"""

import numpy as np
from numpy_reference import Chunker


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
  """SparseLoCo for W workers with SGD inside; ``step`` returns the outer params."""

  def __init__(
    self, params, workers, *, lr, sync_every, outer_lr, decay, topk, chunk, bits, use_dct, clip
  ):
    make = Chunker if use_dct else RawChunker
    self.chunkers = {k: make(np.shape(v), chunk) for k, v in params.items()}
    self.outer = {k: np.asarray(v, np.float64) for k, v in params.items()}
    self.local = [{k: v.copy() for k, v in self.outer.items()} for _ in range(workers)]
    self.errors = [{k: np.zeros_like(v) for k, v in self.outer.items()} for _ in range(workers)]
    self.lr, self.h, self.outer_lr, self.decay = lr, sync_every, outer_lr, decay
    self.topk, self.bits, self.clip = topk, bits, clip
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

  def step(self, grads_per_worker):
    self.t += 1
    for w, grads in enumerate(grads_per_worker):
      for k in self.local[w]:
        self.local[w][k] = self.local[w][k] - self.lr * np.asarray(grads[k], np.float64)
    if self.t % self.h == 0:
      for name, ch in self.chunkers.items():
        msgs = [self._message(w, name) for w in range(len(self.local))]
        vals = [v for _, v in msgs]
        if self.clip:
          norms = np.array([np.linalg.norm(v) for v in vals])
          med = np.sort(norms)[(len(norms) - 1) // 2]
          vals = [v * min(1.0, med / (n + 1e-8)) for v, n in zip(vals, norms)]
        total = np.zeros((msgs[0][0].shape[0], np.prod(ch.cs)))
        for (idx, _), v in zip(msgs, vals):
          np.add.at(total, (np.arange(idx.shape[0])[:, None], idx), v)
        mean = total / len(msgs)
        self.outer[name] = self.outer[name] - self.outer_lr * ch.inverse(mean).reshape(
          self.outer[name].shape
        )
      for w in range(len(self.local)):
        self.local[w] = {k: v.copy() for k, v in self.outer.items()}
    return self.outer
