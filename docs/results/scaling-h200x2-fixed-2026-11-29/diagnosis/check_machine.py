"""Two-GPU diagnosis: device-to-device copies and collectives, JAX and torch.
Run from the repo root on the two-GPU machine: python3 check_machine.py jax|torch
(also with NCCL_P2P_DISABLE=1 and NCCL_P2P_LEVEL=LOC; all three matched).
"""
import json, os, sys
import numpy as np

def jax_checks():
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    d0, d1 = jax.devices()[:2]
    rep = {}
    for mib in (0.004, 4, 256):
        n = max(1, int(mib * 2**20 / 4))
        host = np.random.default_rng(1).standard_normal(n).astype(np.float32)
        x0 = jax.device_put(host, d0)
        y = jax.device_put(x0, d1)  # device-to-device
        rep[f"d2d_{mib}MiB_equal"] = bool(np.array_equal(np.asarray(y), host))
        rep[f"d2d_{mib}MiB_nonzero_frac"] = float(np.mean(np.asarray(y) != 0))
        z = jax.device_put(host, d1)  # host-to-device
        rep[f"h2d_{mib}MiB_equal"] = bool(np.array_equal(np.asarray(z), host))
        # a computed array on d0, then moved
        c0 = jax.jit(lambda a: a * 2.0 + 1.0)(x0)
        c1 = jax.device_put(c0, d1)
        rep[f"d2d_computed_{mib}MiB_equal"] = bool(np.array_equal(np.asarray(c1), host * 2 + 1))
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("d",))
    host = np.random.default_rng(2).standard_normal((2, 1 << 20)).astype(np.float32)
    for name, src in (("from_host", host), ("from_dev0", jax.device_put(host, d0))):
        r = jax.device_put(src, NamedSharding(mesh, P()))
        rep[f"replicated_{name}"] = [bool(np.array_equal(np.asarray(s.data), host)) for s in r.addressable_shards]
        s_ = jax.device_put(src, NamedSharding(mesh, P("d")))
        rep[f"split_{name}"] = [bool(np.array_equal(np.asarray(s.data), host[i:i+1])) for i, s in enumerate(s_.addressable_shards)]
        summed = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))(s_)
        ref = host.astype(np.float64).sum(0)
        rep[f"allreduce_{name}_err"] = [float(np.max(np.abs(np.asarray(s.data) - ref))) for s in summed.addressable_shards]
        g = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))(s_)
        rep[f"allgather_{name}"] = [bool(np.array_equal(np.asarray(s.data), host)) for s in g.addressable_shards]
        # a matmul with replicated weights on split rows (data parallel), grad all-reduce
        w = jax.device_put(src[:, :512].T.copy() if name == "from_host" else jax.device_put(host[:, :512].T.copy(), d0), NamedSharding(mesh, P()))
        xs = jax.device_put(np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32), NamedSharding(mesh, P("d")))
        loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
        gw = jax.jit(jax.grad(loss))(w, xs)
        gref = jax.grad(loss)(jax.device_put(np.asarray(w.addressable_shards[0].data), d0), jax.device_put(np.asarray(xs), d0))
        rep[f"dp_grad_{name}_err"] = float(np.max(np.abs(np.asarray(gw) - np.asarray(gref))) / np.max(np.abs(np.asarray(gref))))
    return rep

def torch_checks():
    import torch
    rep = {"peer_0_1": torch.cuda.can_device_access_peer(0, 1)}
    x = torch.randn(64 << 20 // 4 * 4, device="cuda:0")
    y = x.to("cuda:1")
    rep["torch_d2d_equal"] = bool(torch.equal(x.cpu(), y.cpu()))
    return rep

if __name__ == "__main__":
    which = sys.argv[1]
    out = jax_checks() if which == "jax" else torch_checks()
    print("RESULT", json.dumps(out))
