r"""Per-device bytes of params plus optimizer state under FSDP: DeMo against AdamW.

Everything is built under ``jax.eval_shape``, so the 1.2B preset needs no
memory. Each device's state is ``tx.init`` of its own param shards, planned by
``dj.plan_fsdp`` so that no DeMo chunk straddles two shards; AdamW's two
moment buffers are sharded the same way (ZeRO-3 style). Beside the memory it
prints each device's DeMo message (``dj.wire_bytes`` of its shards) and how
many params a site keeps whole, which every device of the site then sends.

  python -m experiments.memory_report --preset=report-1.2b --fsdp=1,2,4,8
  python -m experiments.memory_report --preset=small --fsdp=2,4,8 --scan_layers
"""

from __future__ import annotations

from collections.abc import Sequence

import optax
from absl import app, flags

import distro_jax as dj
from experiments.run import cli, config, presets
from experiments.run.model import abstract_params


def optimizers(compression_chunk: int = 64) -> dict[str, optax.GradientTransformation]:
  """The optimizers compared, as each device runs them."""
  return {
    "demo": dj.demo(1e-3, compression_chunk=compression_chunk, axis_name="replica"),
    "demo-delayed": dj.demo(
      1e-3, compression_chunk=compression_chunk, axis_name="replica", delayed_apply=True
    ),
    "adamw": optax.adamw(1e-3),
  }


def measure(
  preset: str, fsdps: tuple[int, ...], compression_chunk: int = 64, scan_layers: bool = False
) -> dict[int, dict[str, dj.DeviceBytes]]:
  """Per-device bytes for every fsdp size and optimizer.

  Args:
    preset: a name in ``experiments.run.presets.PRESETS``.
    fsdps: the fsdp sizes to measure.
    compression_chunk: DeMo's chunk target, which the sharding plan respects.
    scan_layers: the model with its layers stacked (``--scan_layers``).

  Returns:
    ``{fsdp: {optimizer: DeviceBytes}}``.
  """
  params = abstract_params(presets.get_preset(preset, scan_layers=scan_layers))
  txs = optimizers(compression_chunk)
  out = {}
  for fsdp in fsdps:
    plan = dj.plan_fsdp(params, fsdp, compression_chunk=compression_chunk)
    out[fsdp] = {
      name: dj.device_bytes(tx, params, plan.specs, {"fsdp": fsdp}) for name, tx in txs.items()
    }
  return out


def device_message(
  preset: str, fsdp: int, compression_chunk: int = 64, scan_layers: bool = False
) -> tuple[int, int]:
  """One device's DeMo message at the defaults' top-k, and the params a site keeps whole.

  Args:
    preset: a name in ``experiments.run.presets.PRESETS``.
    fsdp: devices per site.
    compression_chunk: DeMo's chunk target, which the sharding plan respects.
    scan_layers: the model with its layers stacked (``--scan_layers``).

  Returns:
    ``(bytes, params kept whole)``: the payload of the device's shards, and
    how many params every device of a site holds, and sends, whole.
  """
  params = abstract_params(presets.get_preset(preset, scan_layers=scan_layers))
  plan = dj.plan_fsdp(params, fsdp, compression_chunk=compression_chunk)
  local = dj.local_shapes(params, plan.specs, {"fsdp": fsdp})
  payload = dj.wire_bytes(local, compression_chunk=compression_chunk).payload
  return int(payload), len(plan.whole)


def _gb(n: int) -> str:
  return f"{n / 1e9:.3f} GB"


def _report(preset: str, fsdps: tuple[int, ...], chunk: int, scan_layers: bool) -> None:
  rows = measure(preset, fsdps, chunk, scan_layers)
  if scan_layers:
    print(f"{preset}, layers stacked (--scan_layers)")
  print(
    f"| fsdp | params | DeMo state | DeMo total | vs fsdp={fsdps[0]} | "
    "AdamW state (2 moments) | AdamW total | DeMo message per device | params kept whole |"
  )
  print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  base = rows[fsdps[0]]["demo"].total
  for fsdp in fsdps:
    demo, adamw = rows[fsdp]["demo"], rows[fsdp]["adamw"]
    message, whole = device_message(preset, fsdp, chunk, scan_layers)
    print(
      f"| {fsdp} | {_gb(demo.params)} | {_gb(demo.opt_state)} | {_gb(demo.total)} | "
      f"{demo.total / base:.3f} | {_gb(adamw.opt_state)} | {_gb(adamw.total)} | "
      f"{message:,} B | {whole} |"
    )
  delayed = rows[fsdps[0]]["demo-delayed"].opt_state - rows[fsdps[0]]["demo"].opt_state
  print(f"delayed_apply adds the pending message: {delayed:,} bytes per device at fsdp={fsdps[0]}")


def _checked(preset: str, fsdp: Sequence[str], chunk: int) -> tuple[str, tuple[int, ...], int]:
  """The flags as ``_report`` takes them; each error names its flag and the fix."""
  config.checked_preset(preset)
  sizes = config.positive_ints("fsdp", fsdp, "1,2,4,8", wants="positive sizes")
  return preset, sizes, config.checked_chunk(chunk)


def main(argv: Sequence[str] | None = None) -> None:
  """The command; its flags are defined here, not at import."""
  preset = flags.DEFINE_string(
    "preset", "report-1.2b", "Model preset (experiments/run/presets.py)."
  )
  fsdp = flags.DEFINE_list("fsdp", ["1", "2", "4", "8"], "Devices per site to report.")
  chunk = flags.DEFINE_integer("compression_chunk", 64, "DeMo's chunk target.")
  scan_layers = flags.DEFINE_bool(
    "scan_layers", False, "The model with its layers stacked, as --scan_layers trains it."
  )

  def run(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")

    def report() -> None:
      _report(*_checked(preset.value, fsdp.value, chunk.value), scan_layers.value)

    cli.report_user_errors(report)

  app.run(run, argv=argv)


if __name__ == "__main__":
  main()
