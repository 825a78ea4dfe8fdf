"""sowtel.sow inside Flax Linen modules: model.apply, jit and grad."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import sowtel


class MLP(nn.Module):
    use_perturb: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(16)(x))
        h = self.perturb("act", h) if self.use_perturb else sowtel.sow(h, "mlp/act")
        return nn.Dense(1)(h)


def _loss(model, params, x, y, perturbations=None):
    variables = {"params": params}
    if perturbations is not None:
        variables["perturbations"] = perturbations
    pred = model.apply(variables, x)
    return jnp.mean((pred[:, 0] - y) ** 2)


def test_flax_cotangent_equals_module_perturb_gradient() -> None:
    x = jax.random.normal(jax.random.key(0), (8, 4))
    y = jnp.sin(x[:, 0])
    params = MLP().init(jax.random.key(1), x)["params"]

    loss = lambda p: _loss(MLP(), p, x, y)  # noqa: E731
    for wrapped in (sowtel.save_intermediates(jax.grad(loss)),
                    jax.jit(sowtel.save_intermediates(jax.grad(loss))),
                    sowtel.save_intermediates(jax.jit(jax.grad(loss)))):
        grads, inter = wrapped(params)
        assert list(inter) == ["mlp/act"]
        assert list(inter["mlp/act"]) == ["primal", "cotangent"]

        # Flax's own way: a zero perturbation collection and the gradient with respect to it.
        perturbed = MLP(use_perturb=True)
        zeros = perturbed.init(jax.random.key(1), x)["perturbations"]
        expected = jax.grad(lambda pert, m=perturbed: _loss(m, params, x, y, pert))(zeros)
        np.testing.assert_allclose(inter["mlp/act"]["cotangent"], expected["act"], rtol=1e-5,
                                   atol=1e-7)
        # And the primal is the activation itself.
        dense = params["Dense_0"]
        np.testing.assert_allclose(
            inter["mlp/act"]["primal"], np.tanh(np.asarray(x) @ dense["kernel"] + dense["bias"]),
            rtol=1e-5, atol=1e-6)
        reference = jax.grad(loss)(params)
        np.testing.assert_allclose(grads["Dense_1"]["kernel"], reference["Dense_1"]["kernel"],
                                   rtol=1e-5)


def test_flax_apply_streams_under_jit() -> None:
    x = jnp.ones((2, 4))
    model = MLP()
    params = model.init(jax.random.key(0), x)["params"]
    apply = jax.jit(model.apply)
    with sowtel.enable(exporter="memory") as session:
        out = apply({"params": params}, x)
        assert sowtel.flush()
    [record] = session.exporters[0].records
    assert (record.name, record.mode, record.shape) == ("mlp/act", "primal", (2, 16))
    h = np.tanh(np.asarray(x) @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    np.testing.assert_allclose(record.stats["mean"], h.mean(), rtol=1e-5)
    assert out.shape == (2, 1)
