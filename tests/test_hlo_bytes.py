"""Reading collective operand bytes out of HLO text."""

import distro_jax as dj

HLO = """
HloModule m

ENTRY %main (p0: f32[8,3], p1: u8[100]) -> f32[] {
  %p0 = f32[8,3]{1,0} parameter(0)
  %p1 = u8[100]{0} parameter(1)
  %bitcast = u8[1,100]{1,0} bitcast(%p1)
  %ag = u8[4,100]{1,0} all-gather(%bitcast), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %ar = (f32[8,3]{1,0}, bf16[10]{0}) all-reduce(%p0, %p2), channel_id=2, to_apply=%add
  %p2 = bf16[10]{0} parameter(2)
  %rs = f32[2,3]{1,0} reduce-scatter(%p0), channel_id=3, dimensions={0}, to_apply=%add
  %cps = (f32[8,3]{1,0}, f32[8,3]{1,0}, u32[], u32[]) collective-permute-start(%p0), source_target_pairs={{0,1}}
  %cpd = f32[8,3]{1,0} collective-permute-done(%cps)
  %a2a = f32[8,3]{1,0} all-to-all(f32[8,3]{1,0} %p0), dimensions={0}
  ROOT %r = f32[] constant(0)
}
"""


def test_operand_bytes_per_kind():
  got = dj.parse_collective_bytes(HLO)
  assert got.by_kind == {
    "all-gather": 100,
    "all-reduce": 8 * 3 * 4 + 10 * 2,
    "reduce-scatter": 96,
    "collective-permute": 96,
    "all-to-all": 96,
  }
  assert got.total == 100 + 116 + 96 * 3
  assert len(got.ops) == 5


def test_no_collectives_in_a_local_function():
  import jax.numpy as jnp

  assert dj.collective_bytes(lambda x: x @ x, jnp.ones((4, 4))).total == 0


def test_long_operand_lists_with_index_markers_count_every_operand():
  # XLA prints /*index=N*/ before every fifth operand of a combined all-reduce.
  hlo = """
ENTRY %main () -> f32[] {
  %a = f32[10]{0} parameter(0)
  %ar = (f32[10]{0}, f32[10]{0}, f32[10]{0}, f32[10]{0}, f32[10]{0}, /*index=5*/f32[10]{0}, f32[10]{0}) all-reduce(%a, %a, %a, %a, %a, /*index=5*/%a, %a), to_apply=%add
  ROOT %r = f32[] constant(0)
}
"""
  assert dj.parse_collective_bytes(hlo).by_kind["all-reduce"] == 7 * 40


def test_pmean_of_many_leaves_counts_them_all():
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("data",))
  tree = {f"w{i}": jnp.zeros((8, 16)) for i in range(12)}
  fn = jax.jit(
    jax.shard_map(lambda t: jax.lax.pmean(t, "data"), mesh=mesh, in_specs=P(), out_specs=P())
  )
  assert dj.collective_bytes(fn, tree).by_kind["all-reduce"] == 12 * 8 * 16 * 4


def test_mesh_replica_groups_are_read_by_the_axes_they_name():
  # For GSPMD-partitioned collectives XLA may print replica_groups=mesh[...] {axes}
  # in place of a list of groups: the sum over an axis sharded over "fsdp" stays on it.
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "fsdp"))
  x = jax.device_put(jnp.ones((4, 16, 8)), NamedSharding(mesh, P("data", "fsdp")))
  hlo = jax.jit(lambda x: jnp.sum(x, axis=1)).lower(x).compile().as_text()
  assert "replica_groups=mesh[" in hlo
  by_axes = dj.collective_bytes_by_axes(hlo, mesh)
  assert list(by_axes) == [("fsdp",)] and by_axes[("fsdp",)].by_kind["all-reduce"] == 8 * 4


def test_mesh_replica_groups_with_transposed_device_ids():
  import jax
  import numpy as np

  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "fsdp"))
  line = (
    "  %ar = f32[8]{{0}} all-reduce(%p0), channel_id=1, replica_groups=mesh['axis_0'=2,"
    "'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0)) {{{}}}, to_apply=%add"
  )
  for over, crossed in (("'axis_0'", ("fsdp",)), ("'axis_2'", ("data",))):
    hlo = f"ENTRY %main () -> f32[] {{\n  %p0 = f32[8]{{0}} parameter(0)\n{line.format(over)}\n}}"
    assert list(dj.collective_bytes_by_axes(hlo, mesh)) == [crossed], over
