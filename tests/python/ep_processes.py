"""The expert-parallel moe_layer with one process per device: jax.distributed with gloo's CPU
collectives, one CPU device per process, experts and tokens sharded over the processes. Each
process checks its part of the output and of every gradient against moe_layer on one device,
computed locally on the same values. Run by test_layer_ep.py:

    python ep_processes.py all_to_all PROCESS_ID PROCESSES PORT [CASE ...]
    mpiexec -n P python ep_processes.py mpi [CASE ...]

all_to_all: the processes started by the test, ep_exchange="all_to_all" (XLA's all_to_all over
gloo). mpi: under mpiexec (jax.distributed finds Open MPI's environment), ep_exchange="mpi"
(moekit's MPI engine), and first a mesh in the wrong order, which must be an error naming
axis_index on every process, not a hang. CASE: names from ep_problem.cases, with ":bf16" for
bfloat16 (default: every case, f32 and bf16). Prints "ok process I of P" when all pass.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import moekit.jax as mj  # noqa: E402
from ep_problem import (cases, compare, frozen, grad_names, layer_kwargs, loss,  # noqa
                        packed, param_specs, problem, reference, trained_grads,  # noqa
                        trained_names)  # noqa: E402


def global_array(mesh, value, pspec):
    """Every process holds the whole value; each gives its part."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, pspec),
                                        lambda index: value[index])


def local_parts(got, want):
    """This process's part of each global array of `got`, and the same part of `want`."""
    shards = [a.addressable_shards[0] for a in jax.tree.leaves(got)]
    mine = [np.asarray(s.data) for s in shards]
    theirs = [np.asarray(w)[s.index] for s, w in zip(shards, jax.tree.leaves(want))]
    tree = jax.tree.structure(got)
    return jax.tree.unflatten(tree, mine), jax.tree.unflatten(tree, theirs)


def sharded_layer(mesh, case, spec, exchange):
    kw = layer_kwargs(case)
    return lambda x, params: jax.shard_map(
        lambda x, p: mj.moe_layer(x, p, ep_axis="ep", ep_exchange=exchange, **kw), mesh=mesh,
        in_specs=(P("ep"), spec), out_specs=(P("ep"), P()))(x, params)


def run_case(name, case, dtype, exchange, mesh):
    n = len(mesh.devices)
    x, params, ct = problem(case, dtype, n)
    spec = param_specs(params)
    g_x, g_ct = global_array(mesh, x, P("ep")), global_array(mesh, ct, P("ep"))
    g_params = jax.tree.map(lambda v, s: global_array(mesh, v, s), params, spec)
    layer = sharded_layer(mesh, case, spec, exchange)
    got = jax.jit(layer)(g_x, g_params)
    g_got = jax.jit(jax.grad(lambda x, p, c: loss(layer, c)(x, p), argnums=(0, 1)))(
        g_x, g_params, g_ct)
    one = reference(case, n)  # the whole layer on this process's own device
    want = jax.jit(one)(x, params)
    g_want = jax.jit(jax.grad(loss(one, ct), argnums=(0, 1)))(x, params)
    (out, aux, grads), (w_out, w_aux, w_grads) = local_parts(
        (*got, jax.tree.leaves(g_got)), (*want, jax.tree.leaves(g_want)))
    how = compare(name, case, dtype, (out, aux, grads), (w_out, w_aux, w_grads),
                  grad_names(params))
    print(f"ok {name} {np.dtype(dtype).name} on {n} processes ({exchange}): {how}", flush=True)


def run_packed_case(name, case, dtype, exchange, mesh):
    """The experts' weights packed with their transposes (frozen experts), each process its own
    experts': this process's part of the output, the losses and the gradients to x, the router
    and the shared expert against the one-device layer on the same weights unpacked (its
    experts' gradients left out)."""
    n = len(mesh.devices)
    x, params, ct = problem(case, dtype, n)
    spec = param_specs(params)

    def shard(v, s):  # a PackedRhs's arrays split as the weights they hold
        if isinstance(v, mj.PackedRhs):
            return mj.PackedRhs(global_array(mesh, v.data, s), v.k, v.n,
                                global_array(mesh, v.data_t, s))
        return None if v is None else global_array(mesh, v, s)

    g_packed = mj.MoeParams(*(shard(v, s) for v, s in zip(packed(params), spec)))
    g_x, g_ct = global_array(mesh, x, P("ep")), global_array(mesh, ct, P("ep"))
    layer = sharded_layer(mesh, case, spec, exchange)
    sharded = lambda x, p: layer(x, frozen(p))  # noqa: E731
    trained = trained_names(params)
    got = jax.jit(sharded)(g_x, g_packed)
    g_got = jax.jit(jax.grad(lambda x, p, c: loss(sharded, c)(x, p), argnums=(0, 1)))(
        g_x, g_packed, g_ct)
    one = reference(case, n)
    want = jax.jit(one)(x, params)
    g_want = jax.jit(jax.grad(loss(one, ct), argnums=(0, 1)))(x, params)
    (out, aux, grads), (w_out, w_aux, w_grads) = local_parts(
        (*got, trained_grads(g_got, trained)), (*want, trained_grads(g_want, trained)))
    how = compare(name, case, dtype, (out, aux, grads), (w_out, w_aux, w_grads), trained)
    print(f"ok packed {name} {np.dtype(dtype).name} on {n} processes ({exchange}): {how}",
          flush=True)


def check_wrong_order(mesh_devices):
    """A mesh whose axis order is not the MPI ranks' sends rows to the wrong device: every
    process must raise, naming axis_index."""
    n = len(mesh_devices)
    case = cases(n)["uneven_routing"]
    mesh = Mesh(np.array(mesh_devices[::-1]), ("ep",))
    x, params, _ = problem(case, jnp.float32, n)
    spec = mj.MoeParams(P(), P("ep"), P("ep"))
    g_params = jax.tree.map(lambda v, s: global_array(mesh, v, s), params, spec)
    try:
        jax.block_until_ready(jax.jit(sharded_layer(mesh, case, spec, "mpi"))(
            global_array(mesh, x, P("ep")), g_params))
    except jax.errors.JaxRuntimeError as e:
        assert "axis_index" in str(e), str(e)
        print(f"ok error on a mesh in the wrong order: {str(e).splitlines()[0][:300]}",
              flush=True)
        return
    raise AssertionError("a mesh in the wrong order ran")


def check_auto(mesh, exchange):
    """ep_exchange="auto" takes the MPI exchange under mpiexec, the all_to_all otherwise."""
    n = len(mesh.devices)
    case = cases(n)["uneven_routing"]
    x, params, _ = problem(case, jnp.float32, n)
    spec = mj.MoeParams(P(), P("ep"), P("ep"))
    g_params = jax.tree.map(lambda v, s: global_array(mesh, v, s), params, spec)
    hlo = jax.jit(sharded_layer(mesh, case, spec, "auto")).lower(
        global_array(mesh, x, P("ep")), g_params).as_text()
    assert ("moekit_ep_mpi_dispatch" in hlo) == (exchange == "mpi"), exchange
    assert ("all-to-all" in hlo or "all_to_all" in hlo) == (exchange == "all_to_all"), exchange
    print(f"ok auto is {exchange}", flush=True)


def main(argv):
    exchange = argv[1]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if exchange == "mpi":
        jax.distributed.initialize(initialization_timeout=120)  # from Open MPI's environment
        names = argv[2:]
    else:
        process_id, processes, port = (int(a) for a in argv[2:5])
        jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                                   num_processes=processes, process_id=process_id,
                                   initialization_timeout=120)
        names = argv[5:]
    n = jax.process_count()
    assert len(jax.devices()) == n, jax.devices()
    all_cases = cases(n)
    names = names or [f"{c}{d}" for d in ("", ":bf16") for c in all_cases]
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    check_auto(mesh, exchange)
    if exchange == "mpi":
        check_wrong_order(jax.devices())
    for name in names:
        case, _, dtype = name.partition(":")
        run_case(case, all_cases[case], jnp.bfloat16 if dtype == "bf16" else jnp.float32,
                 exchange, mesh)
    if exchange == "mpi":  # frozen experts, packed, over moekit's MPI exchange
        for dtype in (jnp.float32, jnp.bfloat16):
            for name in ("uneven_routing", "shared_expert_geglu"):
                run_packed_case(name, all_cases[name], dtype, exchange, mesh)
    print(f"ok process {jax.process_index()} of {n}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv)
