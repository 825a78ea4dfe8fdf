"""A higher-order primitive defined through ``jax.extend``, as libraries define their own.

``opaque_call(fn, *args)`` runs ``fn`` as one ``opaque_call`` equation holding ``fn``'s jaxpr in
a parameter. sowtel has no rule for it (whatever it is named): ``sowtel.jit`` must bind it as it
is, ``save_intermediates`` evaluate what it runs. Its rules keep it a primitive under every
transformation, as a solver's do: jvp binds it twice (the primal, then the tangents, whose
jaxpr re-runs the function's sows on the primals as JAX's own ``jvp_jaxpr`` would), transpose
binds it on the transposed tangent function, batching on the vmapped function. With
``implemented=False`` it has no ``impl`` (only a lowering): nothing can look inside it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend as jex
from jax.interpreters import ad, batching, mlir


def _fun(jaxpr: Any) -> Any:
    return jex.core.jaxpr_as_fun(jaxpr)


def _type(x: Any) -> Any:
    """The type to trace a function on for ``x`` (a value or an aval): its sharding where it is
    laid out on explicit mesh axes, as transposition must give the same type back."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = mesh is not None and not mesh.empty and any(
        t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                sharding=sharding if explicit else None)


def _closed(fn: Any, *args: Any) -> Any:
    # Traced on types, not on the arguments: a tracer of the caller's trace must not end up
    # in the jaxpr (jax.checkpoint's partial evaluation would find it leaked).
    types = [_type(a) for a in args]
    return jax.make_jaxpr(lambda *a: list(fn(*a)))(*types)


def _impl(*args: Any, jaxpr: Any) -> list[Any]:
    return list(_fun(jaxpr)(*args))


def _abstract_eval(*avals: Any, jaxpr: Any) -> tuple[list[Any], Any]:
    return list(jaxpr.out_avals), jaxpr.effects


def _define(name: str, implemented: bool) -> Any:
    prim = jex.core.Primitive(name)
    prim.multiple_results = True
    if implemented:
        prim.def_impl(_impl)
    prim.def_effectful_abstract_eval(_abstract_eval)
    # JAX >= 0.12 calls a primitive whose jaxpr holds a hi primitive (0.12's custom_root) high,
    # and expands it before lowering: here, to its body.
    prim.to_lojax = _impl
    mlir.register_lowering(prim, mlir.lower_fun(_impl, multiple_results=True))

    def jvp(primals: Any, tangents: Any, *, jaxpr: Any) -> tuple[list[Any], list[Any]]:
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        outs = prim.bind(*primals, jaxpr=jaxpr)
        n = len(primals)

        def tangent_fn(*args: Any) -> Any:
            return jax.jvp(_fun(jaxpr), list(args[:n]), list(args[n:]))[1]

        outs_dot = prim.bind(*primals, *tangents,
                             jaxpr=_closed(tangent_fn, *primals, *tangents))
        return outs, outs_dot

    def transpose(cts: Any, *args: Any, jaxpr: Any) -> list[Any]:
        linear = [ad.is_undefined_primal(a) for a in args]
        known = [a for a, lin in zip(args, linear, strict=True) if not lin]
        types = [_type(a.aval) for a in args if ad.is_undefined_primal(a)]
        cts = [ad.instantiate_zeros(ct) for ct in cts]

        def transposed(*kc: Any) -> Any:
            ks, cs = kc[:len(known)], kc[len(known):]

            def on_linear(*lin: Any) -> Any:
                it_k, it_l = iter(ks), iter(lin)
                return _fun(jaxpr)(*[next(it_l) if li else next(it_k) for li in linear])

            # Transposed, not differentiated: a custom_vjp's tangent (custom_lin) has no
            # derivative, only a transpose.
            return jax.linear_transpose(on_linear, *types)(list(cs))

        lin_cts = iter(prim.bind(*known, *cts, jaxpr=_closed(transposed, *known, *cts)))
        return [next(lin_cts) if lin else None for lin in linear]

    def batch(args: Any, dims: Any, *, jaxpr: Any) -> tuple[list[Any], list[int]]:
        axes = list(dims)  # None: not mapped
        batched = _closed(jax.vmap(lambda *a: list(_fun(jaxpr)(*a)), in_axes=axes), *args)
        outs = prim.bind(*args, jaxpr=batched)
        return outs, [0] * len(outs)

    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = batch
    return prim


opaque_call_p = _define("opaque_call", implemented=True)
sealed_call_p = _define("sealed_call", implemented=False)


def opaque_call(fn: Any, *args: Any, implemented: bool = True) -> list[Any]:
    """``fn(*args)`` (a list of arrays) run as one equation of a library-defined primitive."""
    prim = opaque_call_p if implemented else sealed_call_p
    return prim.bind(*args, jaxpr=_closed(fn, *args))  # type: ignore[no-any-return]
