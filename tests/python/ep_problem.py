"""The expert-parallel layer's test problems, shared by ep_layer_cases.py (several devices of one
process) and ep_two_processes.py (jax.distributed): import after XLA_FLAGS is set."""

import jax
import jax.numpy as jnp

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
    x = n(ks[0], (devices * T_LOC, H), 1.0)
    ct = n(ks[6], (devices * T_LOC, H), 1.0)
    return x, params, ct


def layer_kwargs(case):
    keep = ("k", "score", "pre_softmax", "expert_bias", "activation_kind", "capacity_factor",
            "drop_policy", "aux_loss_coeff", "z_loss_coeff")
    return {key: case[key] for key in keep if key in case}


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
    }


