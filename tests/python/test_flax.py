"""moekit.flax.MoeLayer: the Flax NNX module over moe_layer, against moe_layer itself on the same
weights (values and gradients bit for bit), its partitioning metadata, dtypes, the expert bias
and its errors. scripts/python-env installs flax, so these run in `make test`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moekit.jax as mj
from moekit.flax import ExpertBias, MoeLayer

F32, BF16 = jnp.float32, jnp.bfloat16


def x_of(shape, dtype=F32, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("shared_ffn,use_bias", [(0, False), (6, False), (0, True)],
                         ids=["routed", "shared", "biases"])
def test_module_is_moe_layer_on_its_weights(shared_ffn, use_bias):
    kw = dict(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    layer = MoeLayer(8, 5, 4, 2, shared_ffn=shared_ffn, use_bias=use_bias, rngs=nnx.Rngs(0),
                     **kw)
    if use_bias:  # zeros at first: made nonzero, so that a dropped bias would show
        layer.b_in[...] = x_of((4, 10), seed=3)
        layer.b_out[...] = x_of((4, 8), seed=4)
    x = x_of((3, 5, 8))  # [B, S, H]
    out, aux = layer(x)
    params = layer.params(F32)
    want_out, want_aux = mj.moe_layer(x, params, k=2, **kw)
    np.testing.assert_array_equal(out, want_out)
    for got, want in zip(aux, want_aux):
        np.testing.assert_array_equal(got, want)
    assert params.w_in.shape == (4, 8, 10) and params.w_out.shape == (4, 5, 8)
    assert (params.shared_in is None) == (shared_ffn == 0)
    assert (params.b_in is None) == (not use_bias) and (params.b_out is None) == (not use_bias)

    # Gradients to every weight through nnx.grad equal moe_layer's through jax.grad.
    ct = x_of((3, 5, 8), seed=2)

    def loss_of(out, aux):
        return jnp.sum(out * ct) + aux.aux_loss + aux.z_loss

    grads = nnx.grad(lambda m: loss_of(*m(x)))(layer)
    want = jax.grad(lambda p: loss_of(*mj.moe_layer(x, p, k=2, **kw)))(params)
    for name in mj.MoeParams._fields:
        g, w = getattr(grads, name, None), getattr(want, name)
        if w is None:
            assert g is None, name
            continue
        np.testing.assert_array_equal(g[...], w, err_msg=name)


def test_weights_are_initialised_by_fan_in_with_partitioning_metadata():
    layer = MoeLayer(64, 16, 4, 2, shared_ffn=8, use_bias=True, rngs=nnx.Rngs(0),
                     expert_axis="exp")
    specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
    assert tuple(specs["router"].get_value()) == ("embed", None)
    assert tuple(specs["w_in"].get_value()) == ("exp", "embed", "mlp")
    assert tuple(specs["w_out"].get_value()) == ("exp", "mlp", "embed")
    assert tuple(specs["shared_in"].get_value()) == ("embed", "mlp")
    assert tuple(specs["shared_out"].get_value()) == ("mlp", "embed")
    assert tuple(specs["b_in"].get_value()) == ("exp", "mlp")
    assert tuple(specs["b_out"].get_value()) == ("exp", "embed")
    # Lecun normal per expert: each expert's matrix has variance about 1 / fan_in, which is H for
    # w_in and F for w_out (not E * H: the experts are a batch axis).
    w_in, w_out = layer.w_in[...], layer.w_out[...]
    assert 0.7 < float(jnp.var(w_in)) * 64 < 1.3
    assert 0.7 < float(jnp.var(w_out)) * 16 < 1.3
    # Non-gated activations take [E, H, F].
    assert MoeLayer(8, 5, 4, 2, activation_kind="gelu", rngs=nnx.Rngs(0)).w_in.shape == (4, 8, 5)


def test_expert_weights_transposed_are_held_out_by_in():
    # [E, out, in] weights, each expert scaled by its own fan-in (the last axis now), with the
    # metadata in that order; the module is moe_layer on them.
    layer = MoeLayer(64, 16, 4, 2, expert_weights_transposed=True, rngs=nnx.Rngs(0))
    assert layer.w_in.shape == (4, 32, 64) and layer.w_out.shape == (4, 64, 16)
    specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
    assert tuple(specs["w_in"].get_value()) == ("expert", "mlp", "embed")
    assert tuple(specs["w_out"].get_value()) == ("expert", "embed", "mlp")
    assert 0.7 < float(jnp.var(layer.w_in[...])) * 64 < 1.3
    assert 0.7 < float(jnp.var(layer.w_out[...])) * 16 < 1.3
    x = x_of((6, 64))
    out, _ = layer(x)
    np.testing.assert_array_equal(
        out, mj.moe_layer(x, layer.params(F32), k=2, expert_weights_transposed=True)[0])


def test_dtypes():
    # bf16 weights with f32 x: computed in x's dtype by default, or in `dtype`.
    layer = MoeLayer(8, 5, 4, 2, param_dtype=BF16, rngs=nnx.Rngs(0))
    assert layer.w_in.dtype == BF16
    x = x_of((6, 8))
    out, _ = layer(x)
    assert out.dtype == F32
    np.testing.assert_array_equal(out, mj.moe_layer(x, layer.params(F32), k=2)[0])
    layer.dtype = BF16
    out, _ = layer(x)
    assert out.dtype == BF16
    np.testing.assert_array_equal(out, mj.moe_layer(x.astype(BF16), layer.params(BF16), k=2)[0])


def test_expert_bias_is_moved_by_update_bias_not_by_gradients():
    layer = MoeLayer(8, 5, 4, 2, score="sigmoid", use_expert_bias=True, aux_loss_coeff=0.1,
                     rngs=nnx.Rngs(0))
    assert isinstance(layer.expert_bias, ExpertBias)
    np.testing.assert_array_equal(layer.expert_bias[...], np.zeros(4, np.float32))
    x = x_of((12, 8))
    # Every expert but 0 gets a bias: routing changes with it.
    layer.expert_bias[...] = jnp.asarray([0.0, 1.0, 1.0, 1.0], F32)
    out, aux = layer(x)
    want = mj.moe_layer(x, layer.params(F32), k=2, score="sigmoid", aux_loss_coeff=0.1,
                        expert_bias=layer.expert_bias[...])
    np.testing.assert_array_equal(out, want[0])
    assert int(aux.tokens_per_expert[0]) == 0  # outbid by the others on every token
    before = layer.expert_bias[...]
    layer.update_bias(aux.tokens_per_expert, 0.01)
    np.testing.assert_array_equal(
        layer.expert_bias[...], mj.update_expert_bias(before, aux.tokens_per_expert, 0.01))
    assert float(layer.expert_bias[0]) == pytest.approx(0.01)  # chosen less than the mean: up
    # nnx.grad (over nnx.Param) leaves the bias out.
    grads = nnx.grad(lambda m: jnp.sum(m(x)[0]))(layer)
    assert "expert_bias" not in nnx.to_pure_dict(grads)

    # Under nnx.jit, a training step updates the bias in the module.
    @nnx.jit
    def step(m, x):
        _, aux = m(x)
        m.update_bias(aux.tokens_per_expert, 0.5)

    before = layer.expert_bias[...]
    step(layer, x)
    assert not np.array_equal(layer.expert_bias[...], before)


def test_errors():
    with pytest.raises(ValueError, match="holds no expert bias"):
        MoeLayer(8, 5, 4, 2, rngs=nnx.Rngs(0)).update_bias(jnp.zeros(4, jnp.int32), 0.1)
    with pytest.raises(TypeError, match="expert_bias is the module's own"):
        MoeLayer(8, 5, 4, 2, expert_bias=jnp.zeros(4), rngs=nnx.Rngs(0))
    # moe_layer's own checks name moe_layer and the option.
    with pytest.raises(ValueError, match="moe_layer: k = 5"):
        MoeLayer(8, 5, 4, 5, rngs=nnx.Rngs(0))(x_of((2, 8)))
    with pytest.raises(ValueError, match="expert_bias needs score"):
        MoeLayer(8, 5, 4, 2, use_expert_bias=True, rngs=nnx.Rngs(0))(x_of((2, 8)))
