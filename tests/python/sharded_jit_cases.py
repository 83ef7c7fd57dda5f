"""moekit.jax's token-by-token ops under `jit` with the tokens sharded over a 2 x 2 CPU mesh
("data", "fsdp"): over one axis, the other, or both. Each case compares the values and the
gradients with the same function on one device, and reads the compiled program: it must gather
no token-indexed array. Run by test_sharded_jit.py in a fresh process (XLA_FLAGS must be set
before JAX starts):

    python sharded_jit_cases.py [CASE ...]

Prints "ok" when every case passes.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import moekit.jax as mj  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
TOKEN_AXES = {"data": "data", "fsdp": "fsdp", "both": ("data", "fsdp")}
rng = np.random.default_rng(0)


def normal(shape, dtype=F32, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def sharded(f, shardings, *args):
    """f's results under jit with the arguments placed by `shardings` (None: replicated), and
    the compiled program's text."""
    specs = tuple(NamedSharding(MESH, P() if s is None else s) for s in shardings)
    g = jax.jit(f, in_shardings=specs)
    placed = [jax.device_put(a, s) for a, s in zip(args, specs)]
    return g(*placed), g.lower(*placed).compile().as_text()


def no_gathers(hlo, what):
    gathers = [line.strip() for line in hlo.splitlines() if " all-gather(" in line
               or "all-gather-start(" in line]
    assert not gathers, (what, gathers[:3])


def equal(got, want, what, exact=True, rtol=1e-6, atol=1e-7):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype)
        if exact:
            np.testing.assert_array_equal(g, w, err_msg=what)
        else:
            np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=rtol, atol=atol,
                                       err_msg=what)


def check(name, f, args, token_args, exact=True, gathers_allowed=False, **tol):
    """f's value and its gradients to every float argument, under jit on one device and with the
    token arguments' first dimension sharded over each choice of axes."""
    def value_and_grads(*a):
        floats = [i for i, x in enumerate(a) if jnp.issubdtype(x.dtype, jnp.floating)]

        def scalar(*fa):
            full = list(a)
            for i, x in zip(floats, fa):
                full[i] = x
            out = f(*full)
            return sum(jnp.sum(jnp.sin(o.astype(F32))) for o in jax.tree.leaves(out)
                       if jnp.issubdtype(o.dtype, jnp.floating)), out
        (_, out), grads = jax.value_and_grad(scalar, argnums=tuple(range(len(floats))),
                                             has_aux=True)(*[a[i] for i in floats])
        return out, grads

    want = jax.jit(value_and_grads)(*args)
    for label, axes in TOKEN_AXES.items():
        shardings = [P(axes) if i in token_args else None for i in range(len(args))]
        got, hlo = sharded(value_and_grads, shardings, *args)
        equal(got, want, f"{name}, tokens over {label}", exact, **tol)
        if not gathers_allowed:
            no_gathers(hlo, f"{name}, tokens over {label}")


def case_route():
    for dtype in (F32, BF16):
        logits = normal((16, 12), dtype)
        check("route softmax", lambda l: mj.route(l, 3), (logits,), {0})
        check("route pre_softmax", lambda l: mj.route(l, 2, pre_softmax=True), (logits,), {0})
        bias = jnp.asarray(rng.uniform(-0.1, 0.1, 12), F32)
        check("route sigmoid, groups, bias",
              lambda l, b: mj.route(l, 4, score="sigmoid", num_groups=4, group_topk=2,
                                    scaling_factor=2.5, expert_bias=b), (logits, bias), {0})


def case_aux_scores():
    logits = normal((16, 12))
    check("aux_loss_scores", lambda l: mj.aux_loss_scores(l, 3), (logits,), {0})
    check("aux_loss_scores sqrtsoftplus",
          lambda l: mj.aux_loss_scores(l, 2, score="sqrtsoftplus"), (logits,), {0})


def case_activation():
    for kind, width in (("swiglu", 10), ("geglu", 10), ("gelu", 5), ("relu", 5)):
        for dtype in (F32, BF16):
            h = normal((24, width), dtype)
            check(f"activation {kind}", lambda h: mj.activation(h, kind), (h,), {0})
            # A traced row count: each device's piece computes its rows below it (15 of 24:
            # the second piece of four is cut inside, the last two are empty).
            check(f"activation {kind}, rows", lambda h, r: mj.activation(h, kind, rows=r),
                  (h, jnp.int32(15)), {0})


def case_losses():
    logits = normal((16, 12))
    check("z_loss", lambda l: mj.z_loss(l, 0.1), (logits,), {0}, exact=False)
    counts = jnp.asarray(rng.integers(0, 9, 12), jnp.int32)
    scores = jax.nn.softmax(normal((16, 12)))
    check("load_balancing_loss", lambda s, c: mj.load_balancing_loss(s, c, k=3, coeff=0.5),
          (scores, counts), {0}, exact=False)
    check("load_balancing_loss, total_tokens",
          lambda s, c: mj.load_balancing_loss(s, c, k=3, total_tokens=64), (scores, counts), {0},
          exact=False)
    # Per sequence: 4 sequences of 4 tokens; the counts [4, E] split with the tokens.
    per_seq = jnp.asarray(rng.integers(0, 4, (4, 12)), jnp.int32)
    check("load_balancing_loss per sequence",
          lambda s, c: mj.load_balancing_loss(s, c, k=3, coeff=0.5), (scores, per_seq), {0, 1},
          exact=False)


def case_counts():
    routing_map = jnp.asarray(rng.random((16, 12)) < 0.25)
    for name, f in (("count_tokens_per_expert", mj.count_tokens_per_expert),
                    ("count_tokens_per_expert per sequence",
                     lambda m: mj.count_tokens_per_expert(m, num_sequences=4))):
        want = jax.jit(f)(routing_map)
        for label, axes in TOKEN_AXES.items():
            got, hlo = sharded(f, (P(axes),), routing_map)
            equal(got, want, f"{name}, tokens over {label}")
            no_gathers(hlo, f"{name}, tokens over {label}")


def case_uneven():
    # 6 of 8 sharded tokens: XLA may split the 6 unevenly; the ops then take them whole
    # (gathered, as XLA would), with the one-device result.
    logits = normal((8, 8))
    check("route, 6 of 8 tokens", lambda l: mj.route(l[:6], 2), (logits,), {0},
          gathers_allowed=True)
    check("z_loss, 6 of 8 tokens", lambda l: mj.z_loss(l[:6]), (logits,), {0}, exact=False,
          gathers_allowed=True)


def case_permute_gathers():
    # permute lays rows out across all tokens: under jit it keeps the one-device result, and
    # XLA gathers the tokens (the positive control of no_gathers).
    x, idx = normal((16, 6)), jnp.asarray(rng.integers(0, 4, (16, 2)), jnp.int32)

    def f(x, idx):
        p = mj.permute(x, idx, num_experts=4)
        return p.x, p.tokens_per_expert
    want = jax.jit(f)(x, idx)
    got, hlo = sharded(f, (P("data"), P("data")), x, idx)
    equal(got, want, "permute, tokens over data")
    try:
        no_gathers(hlo, "permute")
    except AssertionError:
        return
    raise AssertionError("permute on sharded tokens compiled without an all-gather")


def layer_problem(T, H, F, E, dtype, shared=False, biases=False):
    x = normal((T, H), dtype, 0.5)
    params = mj.MoeParams(normal((H, E), dtype, H**-0.5), normal((E, H, 2 * F), dtype, H**-0.5),
                          normal((E, F, H), dtype, F**-0.5),
                          normal((H, 2 * F), dtype, H**-0.5) if shared else None,
                          normal((F, H), dtype, F**-0.5) if shared else None,
                          normal((E, 2 * F), dtype, 0.1) if biases else None,
                          normal((E, H), dtype, 0.1) if biases else None)
    return x, params, normal((T, H), F32)


def check_layer(name, x, params, ct, kw, exact_out=False, tol=1e-5, sharded_dims=1,
                gathers_allowed=False):
    """moe_layer's output, losses, counts and gradients (to x and every weight, through the
    losses too) with x's tokens sharded, against the one-device layer; no all-gather. With an
    align_size each device pads its own blocks: tokens_per_expert is the sum of each piece's
    padded counts."""
    def f(x, params):
        def loss(x, params):
            out, aux = mj.moe_layer(x, params, **kw)
            value = jnp.sum(out.astype(F32).reshape(ct.shape) * ct) + aux.aux_loss + aux.z_loss
            return value, (out, aux)
        (_, (out, aux)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, params)
        return out, aux, grads

    want = jax.jit(f)(x, params)
    for label, axes in TOKEN_AXES.items():
        spec = P(axes) if sharded_dims == 1 else P(*((axes,) + (None,) * (sharded_dims - 1)))
        got, hlo = sharded(f, (spec, None), x, params)
        what = f"{name}, tokens over {label}"
        out, aux, (d_x, d_params) = got
        w_out, w_aux, (w_d_x, w_d_params) = want
        counts = w_aux.tokens_per_expert
        if kw.get("align_size"):  # each piece's own counts, padded to the alignment, summed
            a = kw["align_size"]
            pieces = int(np.prod([MESH.shape[n] for n in
                                  ((axes,) if isinstance(axes, str) else axes)]))
            unaligned = {**kw, "align_size": None}
            counts = sum(-(-mj.moe_layer(piece, params, **unaligned)[1].tokens_per_expert // a)
                         * a for piece in np.split(np.asarray(x), pieces))
        equal(aux.tokens_per_expert, counts, what + ": tokens_per_expert")
        equal(out, w_out, what + ": out", exact_out, rtol=tol, atol=tol)
        equal((aux.aux_loss, aux.z_loss), (w_aux.aux_loss, w_aux.z_loss), what + ": losses",
              False, rtol=1e-5, atol=1e-7)
        equal((d_x, d_params), (w_d_x, w_d_params), what + ": gradients", False, rtol=tol,
              atol=tol)
        if not gathers_allowed:
            no_gathers(hlo, what)
            assert "all-reduce" in hlo, what  # the weight gradients summed over the pieces


def case_layer():
    losses = dict(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    for fused in (True, False):
        x, params, ct = layer_problem(32, 8, 6, 8, F32, shared=True)
        check_layer(f"moe_layer fused={fused}, shared expert, losses", x, params, ct,
                    dict(k=2, fused=fused, **losses))
        x, params, ct = layer_problem(32, 8, 6, 8, F32, biases=True)
        check_layer(f"moe_layer fused={fused}, expert FFN biases", x, params, ct,
                    dict(k=2, fused=fused, **losses))
        x, params, ct = layer_problem(16, 8, 5, 4, F32)
        routing = dict(k=2, score="sigmoid", num_groups=2, group_topk=1,
                       expert_bias=jnp.asarray([0.1, -0.1, 0.0, 0.05], F32))
        check_layer(f"moe_layer fused={fused}, sigmoid, groups, bias, align", x, params, ct,
                    dict(align_size=4, fused=fused, **routing, **losses))
        # A capacity ranks every token of an expert: the tokens are gathered, the result the
        # one-device layer's.
        check_layer(f"moe_layer fused={fused}, capacity", x, params, ct,
                    dict(capacity_factor=1.0, fused=fused, **routing, **losses),
                    gathers_allowed=True)
        # [B, S, H], the per-sequence loss: 4 sequences of 4 tokens, split with their tokens.
        x, params, ct = layer_problem(16, 8, 6, 8, F32)
        check_layer(f"moe_layer fused={fused}, [B, S, H], per-sequence loss",
                    x.reshape(4, 4, 8), params, ct,
                    dict(k=2, fused=fused, aux_loss_per_sequence=True, **losses),
                    sharded_dims=3)
    x, params, ct = layer_problem(32, 8, 6, 8, BF16, shared=True)
    check_layer("moe_layer bf16", x, params, ct, dict(k=2, **losses), tol=2e-2)
    # Every token on one expert (a router whose column 2 dominates): the other experts' groups
    # are empty on every device, their gradients (and biases') 0.
    x, params, ct = layer_problem(32, 8, 6, 8, F32, biases=True)
    params = params._replace(router=jnp.zeros((8, 8), F32).at[:, 2].set(1.0))
    for fused in (True, False):
        check_layer(f"moe_layer fused={fused}, every token on one expert", jnp.abs(x), params, ct,
                    dict(k=1, fused=fused, **losses))
    # No tokens: nothing to split (the one-device call), zeros and the shapes back.
    for fused in (True, False):
        f = jax.jit(lambda x, p: mj.moe_layer(x, p, k=2, fused=fused, **losses))
        out, aux = f(jnp.zeros((0, 8), F32), params)
        assert out.shape == (0, 8) and int(aux.tokens_per_expert.sum()) == 0
        assert float(aux.aux_loss) == 0.0 and float(aux.z_loss) == 0.0


def case_layer_batch_invariant():
    # The mode's promise spans a split of the tokens: a token's output and its d_x are the
    # one-device layer's bits (no losses: their gradients depend on the batch by definition).
    x, params, ct = layer_problem(32, 16, 12, 8, F32, shared=True)
    check_layer("moe_layer batch_invariant", x, params, ct, dict(k=2, batch_invariant=True),
                exact_out=True)

    # Step by step the losses' gradients reach the logits beside the router's, as on one device
    # (each piece's share takes the batch's counts and token count): d_x keeps its bits with
    # the losses too, the pieces being a power of two.
    for kw in ({}, dict(aux_loss_coeff=0.1, z_loss_coeff=0.01)):
        def d_x(x, params):
            def loss(x):
                out, aux = mj.moe_layer(x, params, k=2, batch_invariant=True, **kw)
                return jnp.sum(out * ct) + aux.aux_loss + aux.z_loss
            return jax.grad(loss)(x)
        want = jax.jit(d_x)(x, params)
        for label, axes in TOKEN_AXES.items():
            got, _ = sharded(d_x, (P(axes), None), x, params)
            equal(got, want, f"batch_invariant d_x {sorted(kw)}, tokens over {label}")


def case_layer_token_axes():
    """Inside shard_map, tokens split over several mesh axes: experts over "fsdp" (ep_axis) and
    the tokens over ("data", "fsdp") with token_axes="data"; or no ep_axis, every device all the
    experts, token_axes both axes. The losses and counts are the batch's, the gradients the
    one-device layer's."""
    losses = dict(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x, params, ct = layer_problem(32, 8, 6, 8, F32, shared=True)
    cases = [("ep over fsdp, token_axes data", dict(ep_axis="fsdp", token_axes="data"),
              mj.MoeParams(P(), P("fsdp"), P("fsdp"), P(), P())),
             ("ep over fsdp, token_axes data, per-sequence loss",
              dict(ep_axis="fsdp", token_axes=("data",), aux_loss_per_sequence=True),
              mj.MoeParams(P(), P("fsdp"), P("fsdp"), P(), P()))]
    for fused in (None, False):
        cases.append((f"data parallel over both, fused={fused}",
                      dict(token_axes=("data", "fsdp"), fused=fused), mj.MoeParams(*[P()] * 5)))
    for name, kw, param_specs in cases:
        per_seq = kw.get("aux_loss_per_sequence")
        xs = x.reshape(8, 4, 8) if per_seq else x  # 8 sequences of 4 tokens

        def one(x, params):
            kw1 = {k: v for k, v in kw.items() if k not in ("ep_axis", "token_axes")}
            return mj.moe_layer(x, params, k=2, **kw1, **losses)

        def f(layer):
            def loss(x, params):
                out, aux = layer(x, params)
                value = jnp.sum(out.astype(F32).reshape(ct.shape) * ct) + aux.aux_loss + aux.z_loss
                return value, (out, aux)
            return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))

        xspec = P(("data", "fsdp"))
        layer = jax.shard_map(lambda x, p: mj.moe_layer(x, p, k=2, **kw, **losses), mesh=MESH,
                              in_specs=(xspec, param_specs), out_specs=(xspec, P()))
        (_, got), got_grads = f(layer)(xs, params)
        (_, want), want_grads = f(one)(xs, params)
        equal(got[1].tokens_per_expert, want[1].tokens_per_expert, name + ": counts")
        equal((got[0], got[1].aux_loss, got[1].z_loss), (want[0], want[1].aux_loss,
              want[1].z_loss), name + ": out, losses", False, rtol=1e-5, atol=1e-6)
        equal(got_grads, want_grads, name + ": gradients", False, rtol=1e-5, atol=1e-6)


def case_flax():
    """moekit.flax.MoeLayer in a data-parallel step under jit: the weights replicated, the batch
    [B, S, H] over both axes; the loss and every gradient as on one device, nothing gathered."""
    from flax import nnx
    from moekit.flax import MoeLayer
    layer = MoeLayer(8, 6, 8, 2, shared_ffn=4, aux_loss_coeff=0.1, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = normal((4, 4, 8))

    def step(state, x):
        def loss(state):
            out, aux = nnx.merge(graphdef, state)(x)
            return jnp.sum(jnp.sin(out)) + aux.aux_loss
        return jax.value_and_grad(loss)(state)

    want = jax.jit(step)(state, x)
    got, hlo = sharded(step, (None, P(("data", "fsdp"))), state, x)
    equal(got, want, "flax MoeLayer step", False, rtol=1e-5, atol=1e-6)
    no_gathers(hlo, "flax MoeLayer step")


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        CASES[name]()
        print(f"passed {name}", flush=True)
    print("ok")
