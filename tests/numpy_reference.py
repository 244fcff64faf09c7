"""Plain-NumPy DeMo, written from docs/design.md (sections 1 to 3) alone, in float64.

It works in the parameter domain, as the reference does (error feedback via
an inverse DCT of the sparse payload), and shares no code with distro_jax, so
the JAX implementation is held to the specification and not to itself.
"""

import numpy as np


def dct_matrix(n):
  k = np.arange(n)[:, None]
  i = np.arange(n)[None, :]
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  d[0] *= np.sqrt(0.5)
  return d


def largest_divisor(n, s):
  return max(d for d in range(1, min(n, s) + 1) if n % d == 0)


class Chunker:
  """Chunked DCT of one tensor, 1-D or 2-D (scalars as (1,))."""

  def __init__(self, shape, s):
    self.shape = shape
    dims = shape if shape else (1,)
    self.cs = [largest_divisor(n, s) for n in dims]
    self.dims = dims
    self.ds = [dct_matrix(c) for c in self.cs]

  def forward(self, x):
    x = np.asarray(x, np.float64).reshape(self.dims)
    if len(self.dims) == 1:
      (n,), (c,), (d,) = self.dims, self.cs, self.ds
      return x.reshape(n // c, c) @ d.T  # (chunks, c)
    (n1, n2), (c1, c2), (d1, d2) = self.dims, self.cs, self.ds
    blocks = x.reshape(n1 // c1, c1, n2 // c2, c2).transpose(0, 2, 1, 3)
    coeff = d1 @ blocks @ d2.T  # (a, b, c1, c2)
    return coeff.reshape(-1, c1 * c2)

  def inverse(self, y):
    if len(self.dims) == 1:
      return (y @ self.ds[0]).reshape(self.shape)
    (n1, n2), (c1, c2), (d1, d2) = self.dims, self.cs, self.ds
    a, b = n1 // c1, n2 // c2
    blocks = d1.T @ y.reshape(a, b, c1, c2) @ d2
    return blocks.transpose(0, 2, 1, 3).reshape(self.shape)


def newton_schulz(q, steps=5):
  """Muon's quintic iteration in float64: X <- aX + b(XX^T)X + c(XX^T)^2 X, on the short side."""
  a, b, c = 3.4445, -4.7750, 2.0315
  x = q.T if q.shape[0] > q.shape[1] else q
  norm = np.linalg.norm(x)
  x = x / norm if norm > 0 else x
  for _ in range(steps):
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x.T if q.shape[0] > q.shape[1] else x


class ReferenceDeMo:
  """DeMo for W workers: one momentum buffer per worker and tensor."""

  def __init__(
    self, shapes, workers, lr, decay, topk, chunk, weight_decay, positions=None, normalize="sign"
  ):
    """``positions(name, worker, step, k)``, if given, names each chunk's k positions
    (``(chunks, k)``) in place of the top-k by magnitude. ``normalize="rms"`` steps
    along the decoded aggregate divided by its root mean square instead of its sign;
    ``"orth"`` first runs :func:`newton_schulz` on each matrix's aggregate."""
    self.chunkers = {k: Chunker(s, chunk) for k, s in shapes.items()}
    self.m = [{k: np.zeros(s) for k, s in shapes.items()} for _ in range(workers)]
    self.lr, self.decay, self.topk, self.wd = lr, decay, topk, weight_decay
    self.positions, self.count = positions, 0
    self.normalize = normalize

  def step(self, params, grads_per_worker):
    new = {}
    for name, p in params.items():
      ch = self.chunker = self.chunkers[name]
      total, count = None, None
      for w, grads in enumerate(grads_per_worker):
        m = self.decay * self.m[w][name] + self.lr * np.asarray(grads[name], np.float64)
        coeff = ch.forward(m)
        k = min(max(self.topk, 1), coeff.shape[1])
        if self.positions is not None:
          idx = np.asarray(self.positions(name, w, self.count, k)).reshape(coeff.shape[0], k)
        else:
          idx = np.argsort(-np.abs(coeff), axis=1, kind="stable")[:, :k]
        vals = np.take_along_axis(coeff, idx, axis=1)
        sent = np.zeros_like(coeff)
        np.put_along_axis(sent, idx, vals, axis=1)
        self.m[w][name] = m - ch.inverse(sent)
        if total is None:
          total, count = np.zeros_like(coeff), np.zeros_like(coeff)
        np.put_along_axis(total, idx, np.take_along_axis(total, idx, 1) + vals, axis=1)
        np.put_along_axis(count, idx, np.take_along_axis(count, idx, 1) + 1, axis=1)
      agg = np.where(count > 0, total / np.maximum(count, 1), 0.0)
      q = ch.inverse(agg)
      p = np.asarray(p, np.float64) * (1 - self.lr * self.wd)
      if self.normalize == "orth" and q.ndim == 2:
        q = newton_schulz(q)
      if self.normalize in ("rms", "orth"):
        rms = np.sqrt(np.mean(q * q))
        step = q / rms if rms > 0 else np.zeros_like(q)
      else:
        step = np.sign(q)
      new[name] = p - self.lr * step
    self.count += 1
    return new
