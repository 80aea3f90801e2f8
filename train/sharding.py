"""Device mesh and sharding rules for training.

Mesh axes: "data" (pure data parallelism) and "fsdp" (data parallel too, but parameters
and optimizer state are split across it). Batches are split over both axes. A parameter
is split along its largest dimension that the fsdp axis divides; vectors and anything
indivisible stay replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dspine_jax.errors import ConfigError

BATCH_AXES = ("data", "fsdp")


def make_mesh(data: int, fsdp: int, devices=None) -> Mesh:
    """A data x fsdp mesh over `devices` (default: all of them)."""
    devices = jax.devices() if devices is None else list(devices)
    n = len(devices)
    if fsdp < 1 or n % fsdp:
        raise ConfigError(f"mesh.fsdp={fsdp} must divide the {n} devices")
    if data == -1:
        data = n // fsdp
    if data * fsdp != n:
        raise ConfigError(f"mesh.data x mesh.fsdp = {data} x {fsdp} must equal the "
                          f"{n} devices")
    return Mesh(np.asarray(devices).reshape(data, fsdp), BATCH_AXES)


def param_spec(shape: tuple[int, ...], fsdp: int) -> P:
    if fsdp == 1 or len(shape) < 2:
        return P()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % fsdp == 0:
            spec = [None] * len(shape)
            spec[dim] = "fsdp"
            return P(*spec)
    return P()


def place(x, sharding: NamedSharding) -> jax.Array:
    """One array, which every process holds whole, onto a sharding. Across processes
    (multi-host, one process per GPU) each supplies only its own devices' shards. An
    array already spread so across processes is returned as it is (its other shards
    cannot be read here); one this process holds whole is put again, so that every leaf
    comes out with this very sharding (a step compiled for it is not compiled twice)."""
    if (isinstance(x, jax.Array) and not x.is_fully_addressable
            and x.sharding.is_equivalent_to(sharding, x.ndim)):
        return x
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(place(jax.random.key_data(x), sharding),
                                        impl=jax.random.key_impl(x))
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _identity(tree):
    return tree


def to_host(tree):
    """Whole numpy copies of every array leaf on every process, gathering shards that
    live on other processes' devices: one program replicates them all (every process
    calls it), where a gather per leaf would wait on the hosts once per leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    remote = [i for i, x in enumerate(leaves)
              if isinstance(x, jax.Array) and not x.is_fully_addressable]
    keys = {i: jax.random.key_impl(leaves[i]) for i in remote
            if jax.dtypes.issubdtype(leaves[i].dtype, jax.dtypes.prng_key)}
    if remote:
        data = [jax.random.key_data(leaves[i]) if i in keys else leaves[i] for i in remote]
        everywhere = [x.sharding.update(spec=P()) if isinstance(x.sharding, NamedSharding)
                      else NamedSharding(Mesh(np.asarray(x.sharding._device_assignment),
                                              ("all",)), P())
                      for x in data]
        gathered = jax.jit(_identity, out_shardings=everywhere)(data)
        for i, x in zip(remote, gathered):
            host = np.asarray(x.addressable_data(0))
            leaves[i] = jax.random.wrap_key_data(host, impl=keys[i]) if i in keys else host
    return jax.tree.unflatten(treedef, [x if i in remote else jax.device_get(x)
                                        for i, x in enumerate(leaves)])


def shard_tree(tree, mesh: Mesh):
    """Place every array leaf by the fsdp rule."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(
        lambda x: place(x, NamedSharding(mesh, param_spec(x.shape, fsdp)))
        if hasattr(x, "shape") else x, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(local_rows: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows of the global batch -> one array sharded over the batch axes
    (single-process: all rows)."""
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local_rows)
