"""The expert-parallel moe_layer across two processes: jax.distributed with gloo's CPU
collectives, one CPU device per process, experts and tokens sharded over the two. Each process
checks its half of the output and of every gradient against moe_layer on one device, computed
locally on the same values. Run by test_layer_ep.py, one process per rank:

    python ep_two_processes.py PROCESS_ID PORT
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import moekit.jax as mj  # noqa: E402
from ep_problem import T_LOC, cases, layer_kwargs, problem  # noqa: E402

PROCESSES = 2


def main(process_id, port):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=PROCESSES, process_id=process_id,
                               initialization_timeout=120)
    assert jax.process_count() == PROCESSES and len(jax.devices()) == PROCESSES, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    case = cases(PROCESSES)["shared_expert_geglu"]
    x, params, ct = problem(case, jnp.float32, PROCESSES)
    kw = layer_kwargs(case)
    spec = mj.MoeParams(P(), P("ep"), P("ep"), P(), P())

    def global_array(value, pspec):  # every process holds the whole value; each gives its part
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, NamedSharding(mesh, pspec),
                                            lambda index: value[index])

    g_x, g_ct = global_array(x, P("ep")), global_array(ct, P("ep"))
    g_params = jax.tree.map(global_array, params, spec)

    def layer(x, params):
        return jax.shard_map(lambda x, p: mj.moe_layer(x, p, ep_axis="ep", **kw), mesh=mesh,
                             in_specs=(P("ep"), spec), out_specs=(P("ep"), P()))(x, params)

    def loss(f, ct):
        def value(x, params):
            out, aux = f(x, params)
            return jnp.sum(out * ct) + aux.aux_loss + aux.z_loss
        return value

    out, aux = jax.jit(layer)(g_x, g_params)
    grads = jax.jit(jax.grad(lambda x, p, c: loss(layer, c)(x, p), argnums=(0, 1)))(
        g_x, g_params, g_ct)
    # The reference: the whole layer on this process's own device.
    want, want_aux = jax.jit(lambda x, p: mj.moe_layer(x, p, **kw))(x, params)
    want_grads = jax.jit(jax.grad(loss(lambda x, p: mj.moe_layer(x, p, **kw), ct),
                                  argnums=(0, 1)))(x, params)

    def local(a):  # this process's part of a global array, and where it sits
        shard = a.addressable_shards[0]
        return np.asarray(shard.data), shard.index

    mine, index = local(out)
    np.testing.assert_allclose(mine, np.asarray(want)[index], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(float(local(aux.aux_loss)[0]), float(want_aux.aux_loss), rtol=1e-5)
    names = ["d_x", "d_router", "d_w_in", "d_w_out", "d_shared_in", "d_shared_out"]
    for n, g, w in zip(names, jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        mine, index = local(g)
        w = np.asarray(w)[index]
        np.testing.assert_allclose(mine, w, rtol=2e-5, atol=2e-5 * float(np.abs(w).max()),
                                   err_msg=n)
    print(f"ok process {process_id} of {PROCESSES}: rows {T_LOC * process_id}.."
          f"{T_LOC * (process_id + 1)} and every gradient equal moe_layer on one device")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
