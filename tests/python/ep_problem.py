"""The expert-parallel layer's test problems, references and comparison, shared by
ep_layer_cases.py (several devices of one process) and ep_processes.py (one process per device,
jax.distributed): import after XLA_FLAGS is set."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import moekit.jax as mj

T_LOC = 9  # tokens per device


def problem(case, dtype, devices, seed=0):
    """x [devices*T_LOC, H], MoeParams over all E experts, and a cotangent for out, from one
    seed."""
    H, F, E, Fs = case["H"], case["F"], case["E"], case.get("Fs", 0)
    gated = case.get("activation_kind", "swiglu") in ("swiglu", "geglu")
    ks = jax.random.split(jax.random.key(seed), 7)
    n = lambda k, shape, s: (jax.random.normal(k, shape) * s).astype(dtype)  # noqa: E731
    params = mj.MoeParams(n(ks[1], (H, E), 0.5), n(ks[2], (E, H, (2 if gated else 1) * F), 0.3),
                          n(ks[3], (E, F, H), 0.3),
                          n(ks[4], (H, (2 if gated else 1) * Fs), 0.3) if Fs else None,
                          n(ks[5], (Fs, H), 0.3) if Fs else None)
    if case.get("biases"):  # the expert FFNs' biases, split with their experts
        kb = jax.random.split(ks[0], 2)
        params = params._replace(b_in=n(kb[0], (E, params.w_in.shape[2]), 0.3),
                                 b_out=n(kb[1], (E, H), 0.3))
    if case.get("expert_weights_transposed"):  # [E, out, in], split over E as before
        params = params._replace(w_in=jnp.swapaxes(params.w_in, 1, 2),
                                 w_out=jnp.swapaxes(params.w_out, 1, 2))
    x = n(ks[0], (devices * T_LOC, H), 1.0)
    ct = n(ks[6], (devices * T_LOC, H), 1.0)
    if case.get("sequences"):  # [devices * sequences, S, H]: each device's own sequences
        x, ct = (a.reshape(devices * case["sequences"], -1, H) for a in (x, ct))
    return x, params, ct


def param_specs(params):
    """The shard_map specs of params: the experts' weights (and biases) split over "ep", the
    router and the shared expert replicated, absent weights absent."""
    split = {"w_in", "w_out", "b_in", "b_out"}
    return mj.MoeParams(*(None if v is None else P("ep") if f in split else P()
                          for f, v in zip(mj.MoeParams._fields, params)))


def packed(params):
    """params with the experts' weights packed with their transposes (pack_ragged_rhs(...,
    input_gradient=True)): frozen experts."""
    return params._replace(w_in=mj.pack_ragged_rhs(params.w_in, input_gradient=True),
                           w_out=mj.pack_ragged_rhs(params.w_out, input_gradient=True))


def frozen(params):
    """params with the experts' weights taking no gradient (packed weights take none)."""
    return params._replace(w_in=jax.lax.stop_gradient(params.w_in),
                           w_out=jax.lax.stop_gradient(params.w_out))


def trained_names(params):
    """The gradients of (x, params) that frozen experts leave: x's and the other weights'."""
    return ["d_x"] + [f"d_{f}" for f, v in zip(mj.MoeParams._fields, params)
                      if v is not None and f not in ("w_in", "w_out")]


def trained_grads(grads, names):
    """(d_x, d_params) -> the gradients `names` lists, in its order."""
    d_x, d_p = grads
    return [d_x] + [getattr(d_p, n[2:]) for n in names[1:]]


def grad_names(params):
    """The names of the gradients of (x, params), in jax.tree.leaves order."""
    return ["d_x"] + [f"d_{f}" for f, v in zip(mj.MoeParams._fields, params) if v is not None]


def layer_kwargs(case):
    keep = ("k", "score", "pre_softmax", "expert_bias", "activation_kind", "capacity_factor",
            "drop_policy", "aux_loss_coeff", "z_loss_coeff", "batch_invariant",
            "expert_weights_transposed")
    kw = {key: case[key] for key in keep if key in case}
    if case.get("sequences"):
        kw["aux_loss_per_sequence"] = True
    return kw


def cases(devices):
    E = 2 * devices  # two experts per device
    base = dict(H=16, F=8, E=E, k=2)
    return {
        "uneven_routing": dict(base, aux_loss_coeff=0.01, z_loss_coeff=0.001),
        # A bias that sends every token to device 0's experts (sigmoid routing takes it).
        "all_to_device0": dict(base, score="sigmoid", aux_loss_coeff=0.01,
                               expert_bias=jnp.array([4.0] * 2 + [-4.0] * (E - 2))),
        "one_expert_per_device": dict(base, E=devices, k=1, activation_kind="relu"),
        "shared_expert_geglu": dict(base, k=3, Fs=6, activation_kind="geglu",
                                    pre_softmax=True, aux_loss_coeff=0.02),
        "capacity": dict(base, capacity_factor=1.0, drop_policy="position"),
        # x [B, S, H], B sharded: the per-sequence loss over every device's sequences.
        "per_sequence_loss": dict(base, sequences=3, aux_loss_coeff=0.05),
        # EP-invariance: out and d_x bit-equal to the one-device layer's, with a shared expert
        # and both losses. (On XLA:CPU the default mode's are too at these sizes, each expert
        # seeing the same rows on any number of devices; test_layer.py's batch-invariance test
        # is the one that tells the modes apart.)
        "batch_invariant": dict(base, H=128, F=40, k=3, Fs=24, aux_loss_coeff=0.01,
                                z_loss_coeff=0.001, batch_invariant=True),
        # The expert FFNs' biases live with their experts (gpt-oss).
        "biases": dict(base, k=3, Fs=6, aux_loss_coeff=0.01, biases=True),
        # The experts' weights stored [E, out, in], each device's read as they lie.
        "expert_weights_transposed": dict(base, k=3, Fs=6, aux_loss_coeff=0.01, biases=True,
                                          expert_weights_transposed=True),
    }




def reference(case, devices):
    """moe_layer on one device for the whole batch. With a capacity each device drops its own
    tokens, so then the one-device layer runs on each device's tokens alone."""
    kw = layer_kwargs(case)

    def one(x, params):
        if "capacity_factor" not in case:
            return mj.moe_layer(x, params, **kw)
        outs = [mj.moe_layer(x[d * T_LOC:(d + 1) * T_LOC], params, **kw) for d in range(devices)]
        out = jnp.concatenate([o for o, _ in outs])
        return out, mj.MoeAux(sum(a.aux_loss for _, a in outs), sum(a.z_loss for _, a in outs),
                              sum(a.tokens_per_expert for _, a in outs))
    return one


def loss(layer, ct):
    """The scalar whose gradients the tests compare: out against a cotangent, plus the losses."""
    def value(x, params):
        out, aux = layer(x, params)
        return (jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)) + aux.aux_loss
                + aux.z_loss)
    return value


def compare(name, case, dtype, got, want, names):
    """got and want: (out, MoeAux, grads) as NumPy arrays (or the parts of them one process
    holds, both the same parts), names the gradients' (grad_names). Dropless: equal within f32
    rounding (bf16: one bf16 rounding). Raises AssertionError; returns a line saying how close."""
    (out, aux, grads), (w_out, w_aux, w_grads) = got, want
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(w_out), **tol, err_msg=f"{name}: out")
    np.testing.assert_array_equal(aux.tokens_per_expert, w_aux.tokens_per_expert,
                                  err_msg=f"{name}: tokens_per_expert")
    if "capacity_factor" not in case:  # per-device references have per-device losses
        np.testing.assert_allclose(f32(aux.aux_loss), f32(w_aux.aux_loss), rtol=1e-5,
                                   atol=1e-7, err_msg=f"{name}: aux_loss")
        np.testing.assert_allclose(f32(aux.z_loss), f32(w_aux.z_loss), rtol=1e-5,
                                   atol=1e-7, err_msg=f"{name}: z_loss")
    worst = []
    assert len(names) == len(grads) == len(w_grads), (names, len(grads), len(w_grads))
    for n, g, w in zip(names, grads, w_grads):
        scale = float(np.abs(f32(w)).max()) or 1.0
        np.testing.assert_allclose(f32(g), f32(w), rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   err_msg=f"{name}: {n}")
        worst.append(f"{n} {float(np.abs(f32(g) - f32(w)).max()):.1e}")
    if case.get("batch_invariant"):
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8),
                                      np.asarray(w_out).view(np.uint8),
                                      err_msg=f"{name}: out not bit-equal")
        np.testing.assert_array_equal(np.asarray(grads[0]).view(np.uint8),
                                      np.asarray(w_grads[0]).view(np.uint8),
                                      err_msg=f"{name}: d_x not bit-equal")
    exact = float(np.abs(f32(out) - f32(w_out)).max()) == 0.0
    return (f"out {'bit-exact' if exact else 'within tolerance'}; max |diff| "
            f"{', '.join(worst)}")
