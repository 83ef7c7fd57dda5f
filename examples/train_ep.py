"""Training a small MoE language model with expert parallelism, and without.

The model: a token embedding, a few pre-norm MoE blocks (x + moe_layer(rmsnorm(x))), a final
norm and a head, trained with Adam for next-token prediction on synthetic sequences (each token
a fixed function of the one before, with some noise), with the load-balancing loss.

It trains twice from the same initial weights on the same batches: on one device with
`moe_layer`, and on two processes (jax.distributed; one CPU device each), with the batch and the
experts split between them and `moe_layer(..., ep_axis="ep")`. The two loss curves must agree;
the script prints how closely, and saves both as a plot and as JSON.

The two processes exchange rows one of two ways (`--exchange`): "mpi" starts them under
`mpiexec` and moves only the routed rows with moekit's MPI engine (`moekit.jax.ep_mpi`);
"all_to_all" starts them itself, with gloo CPU collectives and XLA's padded all-to-all. The
default takes "mpi" where moekit was built with it and `mpiexec` is on the PATH.

Run:  python examples/train_ep.py [--steps 300] [--exchange mpi|all_to_all]
                                  [--out bench/results/train_ep-cpu-DATE]
(it starts the two processes itself)
"""

import argparse
import datetime
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

V, H, F, E, K, BLOCKS = 64, 32, 32, 8, 2, 2  # vocabulary, width, FFN width, experts, k, blocks
B, S = 16, 32  # sequences per batch (split between the processes), tokens per sequence
LR, AUX = 3e-3, 1e-2
PROCESSES = 2


def build(jax, jnp, mj):
    """init(key) -> params, batch(step) -> tokens [B, S + 1], loss(params, tokens, ep_axis)."""

    def init(key):
        ks = iter(jax.random.split(key, 3 + 3 * BLOCKS))
        normal = lambda shape, scale: jax.random.normal(next(ks), shape) * scale  # noqa: E731
        blocks = [dict(norm=jnp.ones(H),
                       moe=mj.MoeParams(normal((H, E), H**-0.5), normal((E, H, 2 * F), H**-0.5),
                                        normal((E, F, H), F**-0.5)))
                  for _ in range(BLOCKS)]
        return dict(embed=normal((V, H), 1.0), blocks=blocks, norm=jnp.ones(H),
                    head=normal((H, V), H**-0.5))

    def batch(step):
        """Each next token is (5 * token + 3) mod V, or, one time in eight, a random one."""
        key = jax.random.fold_in(jax.random.key(1), step)
        k1, k2, k3 = jax.random.split(key, 3)
        first = jax.random.randint(k1, (B,), 0, V)

        def next_token(t, keys):
            noise, pick = keys
            t = jnp.where(jax.random.uniform(noise, t.shape) < 0.125,
                          jax.random.randint(pick, t.shape, 0, V), (5 * t + 3) % V)
            return t, t

        keys = (jax.random.split(k2, S), jax.random.split(k3, S))
        _, rest = jax.lax.scan(next_token, first, keys)
        return jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, S + 1]

    def rmsnorm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w

    def loss(params, tokens, ep_axis=None, total_sequences=B, ep_exchange="auto"):
        """Mean next-token cross-entropy over the batch (these tokens, over all devices), plus
        the load-balancing losses. Under ep_axis, tokens are this device's sequences."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = params["embed"][inputs].reshape(-1, H)  # [b * S, H]
        aux = 0.0
        for blk in params["blocks"]:
            y, a = mj.moe_layer(rmsnorm(x, blk["norm"]), blk["moe"], k=K, aux_loss_coeff=AUX,
                                ep_axis=ep_axis, ep_exchange=ep_exchange)
            x, aux = x + y, aux + a.aux_loss
        logits = rmsnorm(x, params["norm"]) @ params["head"]  # [b * S, V]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets.reshape(-1, 1), axis=1)
        total = jnp.sum(nll) / (total_sequences * S)
        if ep_axis is not None:
            total = jax.lax.psum(total, ep_axis)
        return total + aux

    return init, batch, loss


def adam(jax, jnp):
    """Adam without weight decay: (init(params) -> state, update(params, grads, state, step))."""
    b1, b2, eps = 0.9, 0.999, 1e-8

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return zeros, zeros

    def update(params, grads, state, step):
        m, v = state
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        params = jax.tree.map(lambda p, m, v: p - LR * (m / c1) / (jnp.sqrt(v / c2) + eps),
                              params, m, v)
        return params, (m, v)

    return init, update


def train_one_device(steps):
    import jax
    import jax.numpy as jnp
    import moekit.jax as mj

    init, batch, loss = build(jax, jnp, mj)
    opt_init, opt_update = adam(jax, jnp)
    params = init(jax.random.key(0))
    state = opt_init(params)

    @jax.jit
    def step(params, state, i):
        value, grads = jax.value_and_grad(loss)(params, batch(i))
        params, state = opt_update(params, grads, state, i)
        return params, state, value

    losses = []
    for i in range(steps):
        params, state, value = step(params, state, i)
        losses.append(float(value))
    return losses


def train_expert_parallel(exchange, process_id, port, steps, out_file):
    """One of the two processes: the batch split by sequence, the experts by expert. Under
    mpiexec (exchange "mpi") jax.distributed finds the processes in Open MPI's environment."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import moekit.jax as mj

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if exchange == "mpi":
        jax.distributed.initialize(initialization_timeout=120)
    else:
        jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                                   num_processes=PROCESSES, process_id=process_id,
                                   initialization_timeout=120)
    process_id = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    init, batch, loss = build(jax, jnp, mj)
    opt_init, opt_update = adam(jax, jnp)

    # Expert weights split over "ep" by expert, everything else on every process.
    def spec_of(path, _):
        names = [getattr(k, "name", getattr(k, "key", None)) for k in path]
        return P("ep") if ("w_in" in names or "w_out" in names) else P()

    params0 = init(jax.random.key(0))
    specs = jax.tree_util.tree_map_with_path(spec_of, params0)

    def global_array(value, spec):  # every process computes the whole value, gives its part
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                            lambda index: value[index])

    params = jax.tree.map(global_array, params0, specs)
    state = jax.tree.map(global_array, opt_init(params0), (specs, specs))
    sharded_loss = jax.shard_map(lambda p, t: loss(p, t, ep_axis="ep", ep_exchange=exchange),
                                 mesh=mesh,
                                 in_specs=(specs, P("ep")), out_specs=P())

    @jax.jit
    def step(params, state, tokens, i):
        value, grads = jax.value_and_grad(sharded_loss)(params, tokens)
        params, state = opt_update(params, grads, state, i)
        return params, state, value

    losses = []
    for i in range(steps):
        tokens = global_array(batch(i), P("ep"))  # [B, S + 1], sequences split over "ep"
        params, state, value = step(params, state, tokens, i)
        losses.append(float(np.asarray(value.addressable_shards[0].data)))
    if process_id == 0:
        pathlib.Path(out_file).write_text(json.dumps(losses))
    jax.distributed.shutdown()


def plot(one, ep, exchange, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(one, label="one device (moe_layer)", linewidth=2.5, alpha=0.6)
    ax.plot(ep, label=f"{PROCESSES} processes, expert-parallel (ep_axis, {exchange} exchange)",
            linewidth=1, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy + load balancing)")
    ax.set_title(f"MoE LM: V={V} H={H} E={E} k={K}, {BLOCKS} blocks, batch {B}x{S}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def default_exchange():
    """"mpi" where moekit was built with the MPI exchange and mpiexec is on the PATH."""
    from moekit.jax import ep_mpi

    return "mpi" if ep_mpi.available() and shutil.which("mpiexec") else "all_to_all"


def start_processes(exchange, args, curve):
    """The two expert-parallel processes, in a session of their own (to stop them all)."""
    me = [sys.executable, __file__, "--exchange", exchange, "--steps", str(args.steps),
          "--curve", str(curve)]
    if exchange == "mpi":
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return [subprocess.Popen(["mpiexec", "-n", str(PROCESSES), "--oversubscribe", *me,
                                  "--process", "-1"], env=env, start_new_session=True)]
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    return [subprocess.Popen([*me, "--process", str(i), "--port", str(port)],
                             start_new_session=True)
            for i in range(PROCESSES)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--exchange", choices=("mpi", "all_to_all"), default=None,
                        help="how the two processes exchange rows (default: mpi where built "
                        "with it and mpiexec is found, else all_to_all)")
    parser.add_argument("--out", default=None, help="the folder for the plot and the curves "
                        "(default bench/results/train_ep-cpu-DATE)")
    parser.add_argument("--process", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--curve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.process is not None:  # one of the two expert-parallel processes
        train_expert_parallel(args.exchange, args.process, args.port, args.steps, args.curve)
        return 0

    exchange = args.exchange or default_exchange()
    root = pathlib.Path(__file__).resolve().parents[1]
    day = datetime.date.today().isoformat()
    out = pathlib.Path(args.out or root / "bench" / "results" / f"train_ep-cpu-{day}")
    out.mkdir(parents=True, exist_ok=True)
    curve = out / "expert_parallel.json"
    procs = start_processes(exchange, args, curve)
    print(f"training {args.steps} steps on one device, and on {PROCESSES} processes beside it "
          f"({exchange} exchange)")
    try:
        one = train_one_device(args.steps)
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # mpiexec and its ranks too
            except ProcessLookupError:
                pass
    if any(codes):
        print(f"the expert-parallel processes failed: exit codes {codes}")
        return 1
    ep = json.loads(curve.read_text())
    (out / "one_device.json").write_text(json.dumps(one))
    plot(one, ep, exchange, out / "loss.png")
    diff = max(abs(a - b) for a, b in zip(one, ep))
    print(f"loss: step 0 {one[0]:.4f} (one device) {ep[0]:.4f} ({PROCESSES} processes); "
          f"step {args.steps - 1} {one[-1]:.4f} {ep[-1]:.4f}")
    print(f"max |difference| between the curves over {args.steps} steps: {diff:.2e}")
    print(f"plot: {out / 'loss.png'}")
    if not (one[-1] < 0.6 * one[0] and diff < 1e-3 * one[0]):
        print("the curves do not agree, or the model did not learn")
        return 1
    print("the expert-parallel training follows the one-device training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
