"""``sowtel.jit``: a drop-in for ``jax.jit`` that streams with no host callback in the program.

With no session active, or on a step that logs nothing, a ``sowtel.jit`` function runs exactly
``jax.jit(fun)``'s program. On a step that logs, it runs a second program compiled from ``fun``
by the capture pass of :func:`sowtel.save_intermediates`, in which every selected site's summary
(``stats``, ``histogram``, ``health``, ``full`` or ``shape``) is computed where the site runs and
returned as extra outputs:

- inside a ``scan`` (``fori_loop``, ``lax.map``): one summary per iteration, never the stacked
  values;
- inside a ``shard_map``: one summary per shard;
- inside a ``cond`` / ``switch``: only the taken branch's sites give records;
- inside a ``while_loop`` body (whose iteration count is not static), or inside a higher-order
  primitive the summary pass has no rule for (``lax.custom_linear_solve``, ``lax.custom_root``
  on JAX >= 0.12, lineax's ``linear_solve``, any primitive a library defines): the site streams
  through a host callback in that same program (carrying the call's step), as the callback
  transport does, and so does every other site of its name; nothing is dropped.

The call returns the function's results at once; the session's dispatcher thread fetches the
summaries when the device has computed them and builds the same records the callback transport
gives. The step is the host-side :func:`sowtel.at_step` around the call, else the number of
calls of this function since the session began. ``every=N`` (the session's or a site's) is
decided on the host: a step at which no site is due runs the plain program (compiled in a
background thread once the first logging step's program has compiled; until it is ready, such
steps run the logging program already compiled for their arguments and drop its summaries, so
that no step waits for the second compilation).
``enable(histogram_every=N)`` (default 100) is too: the logging steps divisible by N, from
step N on, run a second logging program in which sites whose summary is ``stats`` send
``histogram`` (compiled ahead in a background thread, so training does not wait for it).

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> @sowtel.jit
    ... def step(w, x):
    ...     h = sowtel.sow(jnp.tanh(x @ w), "h")
    ...     return (h ** 2).sum()
    >>> with sowtel.enable(exporter="memory") as session:
    ...     _ = step(jnp.ones((3, 2)), jnp.ones((4, 3)))
    ...     _ = sowtel.flush()
    >>> [(r.name, r.mode, r.step, round(r.stats["mean"], 4)) for r in session.exporters[0].records]
    [('h', 'primal', 0, 0.9951)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sowtel import _exit, _interpret, capture, errors, multihost, naming
from sowtel import _jax_compat as jc
from sowtel.context import CONTEXT, Context, StreamConfig, Strides, current_context
from sowtel.sites import StreamSite, stream_site
from sowtel.steps import host_step
from sowtel.summaries import flatten, sites_summary

__all__ = ["jit", "Jitted", "CompiledSummaries", "SplitJitted", "name_after"]


class _NewStride(Exception):
    """A site's ``every=`` was not known when the step's due strides were chosen: trace again."""

    def __init__(self, every: int) -> None:
        super().__init__(every)
        self.every = every


@dataclasses.dataclass(frozen=True)
class SiteSummary:
    """One site of a logging program: its streaming site (final name) and how it was stacked."""

    site: StreamSite
    stacked: capture.Stacking
    n_arrays: int  # summary arrays of all its leaves, then the "ran" flag


class CompiledSummaries:
    """The extra outputs of a logging program: the summary arrays packed into one flat buffer
    per dtype (one transfer each), and (static) what they are and where each one lies."""

    def __init__(self, buffers: list[Any], sites: tuple[SiteSummary, ...],
                 layout: tuple[tuple[int, int, tuple[int, ...]], ...] | None) -> None:
        self.buffers = buffers
        self.sites = sites
        self.layout = layout  # per array: (buffer, offset, shape); None: one buffer per array

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(a, "nbytes", 0)) for a in self.buffers)

    @staticmethod
    def pack(arrays: list[Any]) -> tuple[list[Any], tuple[tuple[int, int, tuple[int, ...]], ...]]:
        """Flattens ``arrays`` into one buffer per dtype; returns the buffers and the layout."""
        groups: dict[str, list[Any]] = {}
        layout = []
        sizes: dict[str, int] = {}
        for a in arrays:
            key = str(a.dtype)
            group = groups.setdefault(key, [])
            layout.append((list(groups).index(key), sizes.get(key, 0), tuple(a.shape)))
            sizes[key] = sizes.get(key, 0) + int(np.prod(a.shape, dtype=np.int64))
            group.append(flatten(a))
        buffers = [jnp.concatenate(g) if len(g) > 1 else g[0] for g in groups.values()]
        return buffers, tuple(layout)

    def unpack(self, host_buffers: list[np.ndarray]) -> list[np.ndarray]:
        """The arrays again, as views of the fetched ``host_buffers``."""
        if self.layout is None:
            return list(host_buffers)
        # math.prod: numpy's prod of a small tuple costs microseconds, a dozen times a step.
        return [host_buffers[b][offset:offset + math.prod(shape)].reshape(shape)
                for b, offset, shape in self.layout]


jax.tree_util.register_pytree_node(
    CompiledSummaries,
    lambda s: (s.buffers, (s.sites, s.layout)),
    lambda aux, buffers: CompiledSummaries(list(buffers), *aux),
)


def _numbered(caps: list[Any], settled: naming.ProgramNames | None = None) -> list[str]:
    """Final names of the program's streamed sites (:func:`sowtel.naming.occurrence_names`):
    those summarised, and those that call back or are not due at this step, which the summary
    pass lists too, so that names are those the host callbacks give. The names of the sites
    that call back go to ``settled``, where their lowering reads them."""
    keys = [(c.name, c.mode) for c in caps]
    names = naming.occurrence_names(keys)
    for c, name in zip(caps, names, strict=True):
        if name != c.name:
            naming.warn_repeated(c.name)
    if settled is not None:
        settled.settle(keys, names, [c.site == _interpret.CALLS_BACK for c in caps])
    return names


class _Programs:
    """The logging programs of one function under one set of ``jax.jit`` options, and what
    their traces taught, shared by every :func:`jit` of that function: ``jax.jit`` keeps each
    program's trace, lowering and executable per argument shapes, so a second ``sowtel.jit`` of
    the same function (a new session with the same settings included) traces nothing again."""

    def __init__(self) -> None:
        # (stream settings, due strides, gather, health, histograms) -> jax.jit
        self.programs: dict[Any, Any] = {}
        self.traced: set[Any] = set()  # keys of the programs traced whole once
        self.strides = Strides()
        # Per stream setting: whether the function has sites that keep their host callbacks
        # (in while_loop bodies, in library primitives), which take the call's step from the
        # host.
        self.callbacks: dict[StreamConfig, bool] = {}


_SHARED: weakref.WeakKeyDictionary[Any, dict[Any, _Programs]] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def _renew_shared_lock() -> None:
    global _SHARED_LOCK
    _SHARED_LOCK = threading.Lock()  # a thread of the parent may have held it at the fork


_exit.after_fork(_renew_shared_lock)


def _shared_programs(fun: Callable[..., Any], options: dict[str, Any]) -> _Programs:
    try:
        key = tuple(sorted(options.items()))
        hash(key)
        with _SHARED_LOCK:
            return _SHARED.setdefault(fun, {}).setdefault(key, _Programs())
    except TypeError:  # an unhashable option, or a function that takes no weak reference
        return _Programs()


_log = logging.getLogger("sowtel")


class Jitted:
    """What :func:`jit` returns: call it as the ``jax.jit`` function it wraps."""

    def __init__(self, fun: Callable[..., Any], options: dict[str, Any]) -> None:
        self._fun = fun
        self._options = dict(options)
        self._plain = jax.jit(fun, **options)  # unknown options fail here, as in jax.jit
        shared = _shared_programs(fun, self._options)
        self._programs = shared.programs
        self._strides = shared.strides
        self._callbacks = shared.callbacks
        self._traced = shared.traced
        self._steps: tuple[int, itertools.count[int]] | None = None  # (session id, counter)
        self._lock = threading.Lock()
        # Argument signatures whose plain program compiles in the background (see _warm_plain),
        # and all those it was started for.
        self._warming: dict[Any, threading.Thread] = {}
        self._warmed: set[Any] = set()
        # Per argument signature, the logging program that last ran with those arguments:
        # while the plain program compiles, steps that log nothing run it (see _stand_in).
        self._ran: dict[Any, tuple[Any, ...]] = {}
        _exit.after_fork(self)
        functools.update_wrapper(self, fun)  # __wrapped__, __name__, __doc__ as jax.jit's

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it

    # -- what jax.jit functions have -------------------------------------------------------------

    def _quiet(self) -> Any:
        ctx = current_context()
        return (CONTEXT(dataclasses.replace(ctx, quiet=True)) if ctx is not None
                else contextlib.nullcontext())

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fun).lower(...)``: the program of a step that logs nothing."""
        with self._quiet():
            return self._plain.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fun).trace(...)``: the program of a step that logs nothing."""
        with self._quiet():
            return self._plain.trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fun).eval_shape(...)``."""
        with self._quiet():
            return self._plain.eval_shape(*args, **kwargs)

    def lower_logging(self, *args: Any, step: int = 0, **kwargs: Any) -> Any:
        """Lowers the program a logging step at ``step`` runs under the active session.

        Example:
            >>> import jax.numpy as jnp, sowtel
            >>> f = sowtel.jit(lambda x: sowtel.sow(x + 1, "y").sum())
            >>> with sowtel.enable(exporter="memory"):
            ...     text = f.lower_logging(jnp.ones(3)).as_text()
            >>> "callback" in text, "callback" in f.lower(jnp.ones(3)).as_text()
            (False, False)
        """
        from sowtel.session import active_session

        session = active_session()
        if session is None:
            raise RuntimeError("lower_logging needs an active session: call sowtel.enable()")
        program = self._logging_program(session.config, step, args, kwargs,
                                        session.histogram_at(step))
        return program.lower(*args, **kwargs)

    def __repr__(self) -> str:
        return f"sowtel.jit({getattr(self._fun, '__qualname__', self._fun)!r})"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)

    # -- the call ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ctx = current_context()
        step = host_step()
        # A host-side at_step at which no site logs runs quiet; this call still decides for
        # itself (its health check, its alerts, its flight recorder), as without at_step.
        quiet_step = ctx is not None and ctx.quiet and step is not None
        if (ctx is None or ctx.stream is None or (ctx.quiet and not quiet_step)
                or ctx.capture is not None):
            return self._plain(*args, **kwargs)
        if jc.is_tracing():
            # Called inside another traced function: its sows belong to that program.
            return self._plain(*args, **kwargs)
        from sowtel.session import active_session

        session = active_session()
        _exit.keep_sigterm()  # a SIGTERM handler set since enable() must not skip the flush
        if session is None:
            with CONTEXT(dataclasses.replace(ctx, quiet=True)):
                return self._plain(*args, **kwargs)
        if quiet_step:
            ctx = dataclasses.replace(ctx, quiet=False)
            with CONTEXT(ctx):
                return self._call(ctx, session, step, args, kwargs)
        return self._call(ctx, session, step, args, kwargs)

    def _call(self, ctx: Context, session: Any, step: int | None, args: Any,
              kwargs: Any) -> Any:
        calls = self._next_step(session.id)  # calls since enable(), at_step or not
        if step is None:
            step = calls
        config = ctx.stream
        assert config is not None, "checked by __call__"
        if config not in self._strides:
            self._strides.of(config)
            self._callbacks[config] = False
            if not self._due(config, step):
                self._discover(config, args, kwargs)
        guard = session.guard  # sowtel.nonfinite: may raise a pending NonFiniteError
        health = guard is not None and guard.health_at(step)
        histogram = session.histogram_at(step)
        if guard is not None:
            guard.before_call(self, step, args, kwargs)  # staged; kept once its records left
        rules = session.alert_rules  # sowtel.alerts: may raise a pending AlertError
        if rules is not None and rules.pending:
            rules.deliver()
        while True:
            due = self._due(config, step)
            if not due and not health:
                if self._warming:
                    out = self._stand_in(config, args, kwargs)
                    if out is not None:
                        return out
                    self._join_warming("plain", args, kwargs)
                with CONTEXT(dataclasses.replace(ctx, quiet=True)):
                    return self._plain(*args, **kwargs)
            gather = multihost.replicated_sharding((args, kwargs))  # several processes only
            key = (config, due, gather, health, histogram and bool(due))
            try:
                if self._warming:  # compiled ahead in a thread: wait for it, not compile again
                    self._join_warming(key, args, kwargs)
                if key not in self._traced:
                    # Traced before the call (jax.jit keeps the trace for it): the trace finds
                    # new every= strides and sites in while_loop bodies.
                    self._program(*key).trace(*args, **kwargs)
                    self._traced.add(key)
                    if self._callbacks.get(config) and self._strided(config):
                        # No stand-in for a program with host callbacks (see _stand_in): the
                        # plain program compiles beside this one, for the steps after.
                        self._warm_plain(args, kwargs)
                every = session.histogram_every
                if every is not None and every > 1:
                    sibling = (*key[:4], not key[4])
                    if sibling not in self._traced and (key[4] or step % every >= every // 2):
                        # Logging steps with and without histograms both come: the other
                        # program compiles off the training thread, the histogram one in the
                        # half stride before its first step (not beside the first logging
                        # step's own compilation).
                        self._warm_logging(sibling, ctx, args, kwargs)
                if self._callbacks.get(config):
                    # Its while-body sites call back later: they read this step on the host.
                    with session.host_step_block(step):
                        out, summaries = self._program(*key)(*args, **kwargs)
                else:
                    out, summaries = self._program(*key)(*args, **kwargs)
                    if self._strided(config) and (self._warming or not self._warmed):
                        # The plain program compiles now that this one has (on few cores the
                        # two compete), while the steps that log nothing run this one.
                        self._remember(key, args, kwargs)
                        self._warm_plain(args, kwargs)
            except _NewStride as new:  # raised while tracing: nothing ran
                self._strides.add(config, new.every)
                continue
            session.receive_compiled(summaries, step)
            if guard is not None and (summaries.sites or self._callbacks.get(config)):
                guard.sent(step)  # its records are on their way: kept until checked
            return out

    def _next_step(self, session_id: int) -> int:
        with self._lock:
            if self._steps is None or self._steps[0] != session_id:
                self._steps = (session_id, itertools.count())
            return next(self._steps[1])

    def _due(self, config: StreamConfig, step: int) -> frozenset[int]:
        return self._strides.due(config, step)

    def _discover(self, config: StreamConfig, args: Any, kwargs: Any) -> None:
        # One trace (no compilation) to learn the every= of the function's sites, and whether
        # some are in while_loop bodies: needed only when the first call's step is due at none
        # of the strides known so far (a logging program's own trace learns them otherwise).
        self._strides.of(config)
        self._callbacks.setdefault(config, False)
        with CONTEXT(Context(stream=config)):
            self._program(config, None).trace(*args, **kwargs)

    @staticmethod
    def _signature(args: Any, kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        return treedef, tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else x
                              for x in leaves)

    def _warm_plain(self, args: Any, kwargs: Any) -> None:
        """Compiles the plain program for these arguments in a thread (XLA compiles without
        the GIL), started once the first logging step's program has compiled: until it is
        ready, steps that log nothing run that program (see :meth:`_stand_in`), so that
        ``every=N`` reaches steady state in about the time of one compilation."""

        def lower() -> Any:
            with self._quiet():
                return self._plain.lower(*args, **kwargs)

        self._warm("plain", lower, args, kwargs)

    def _warm_logging(self, key: tuple[Any, ...], ctx: Context, args: Any,
                      kwargs: Any) -> None:
        """Compiles the logging program ``key`` for these arguments in a thread (traced there
        under the caller's context ``ctx``); the first step that runs it waits for it."""

        def lower() -> Any:
            with CONTEXT(ctx):
                return self._program(*key).lower(*args, **kwargs)

        self._warm(key, lower, args, kwargs)

    def _warm(self, variant: Any, lower: Callable[[], Any], args: Any, kwargs: Any) -> None:
        try:
            key = (variant, self._signature(args, kwargs))
            hash(key)
        except TypeError:  # an unhashable static argument: jax.jit would refuse it anyway
            return
        if key in self._warmed:
            return
        self._warmed.add(key)

        def compile_ahead() -> None:
            # Lowering reads only shapes, dtypes and shardings: the logging step may donate the
            # arguments meanwhile (a deleted array still lowers, on JAX 0.10.2 and 0.12).
            # Through the exit gate: a thread that comes back from XLA's compiler while Python
            # finalizes aborts the process, so exit waits for it and none starts after exit.
            with _exit.FETCHES.entered() as allowed:
                if not allowed:
                    return
                try:
                    lower().compile()
                except Exception as e:  # only a warm-up: the step itself compiles it if need be
                    _log.debug("sowtel.jit: compiling a program ahead failed: %r", e)

        thread = threading.Thread(target=compile_ahead, name="sowtel-compile", daemon=True)
        self._warming[key] = thread
        thread.start()

    def _strided(self, config: StreamConfig) -> bool:
        """Whether some steps log nothing (a stride above 1): they run the plain program."""
        return self._strides.strided(config)

    def _remember(self, key: tuple[Any, ...], args: Any, kwargs: Any) -> None:
        try:
            self._ran[self._signature(args, kwargs)] = key
        except TypeError:  # an unhashable static argument
            pass

    def _stand_in(self, config: StreamConfig, args: Any, kwargs: Any) -> Any:
        """The results of a step that logs nothing, run by the logging program that last ran
        with these arguments (already compiled), its summaries dropped, while the plain
        program still compiles in the background (see :meth:`_warm_plain`): with ``every=N``
        no step waits for the second compilation. None when the plain program is ready (or
        no such logging program ran, or it has host callbacks, which would stream)."""
        try:
            signature = self._signature(args, kwargs)
            thread = self._warming.get(("plain", signature))
            key = self._ran.get(signature)
        except TypeError:  # an unhashable static argument
            return None
        if (thread is None or not thread.is_alive() or key is None or key[0] != config
                or self._callbacks.get(config)):
            self._ran.pop(signature, None)
            return None
        out, _ = self._program(*key)(*args, **kwargs)
        return out

    def _join_warming(self, variant: Any, args: Any, kwargs: Any) -> None:
        try:
            thread = self._warming.pop((variant, self._signature(args, kwargs)), None)
        except TypeError:
            return
        if thread is not None:
            thread.join()

    def _logging_program(self, config: StreamConfig, step: int, args: Any,
                         kwargs: Any, histogram: bool = False) -> Any:
        if config not in self._strides:
            self._discover(config, args, kwargs)
        gather = multihost.replicated_sharding((args, kwargs))
        while True:
            due = self._due(config, step)
            program = self._program(config, due, gather, False, histogram and bool(due))
            try:
                program.trace(*args, **kwargs)
            except _NewStride as new:
                self._strides.add(config, new.every)
                continue
            return program

    def _program(self, config: StreamConfig, due: frozenset[int] | None,
                 gather: Any = None, health: bool = False, histogram: bool = False) -> Any:
        key = (config, due, gather, health, histogram)
        program = self._programs.get(key)
        if program is None:
            program = self._programs.setdefault(
                key, self._build(config, due, gather, health, histogram))
        return program

    def _build(self, config: StreamConfig, due: frozenset[int] | None,
               gather: Any = None, health: bool = False, histogram: bool = False) -> Any:
        # The program is kept in _SHARED, keyed weakly by the function: it must not hold the
        # function (nor this object, which does), or neither would ever be freed. Every call
        # comes through a Jitted, which holds the function.
        fun_ref = weakref.ref(self._fun)
        callbacks = self._callbacks
        strides = self._strides.of(config)
        in_blocks: set[int] = set()  # sites whose stats are summarised per device (multihost)

        def reduce(params: dict[str, Any], leaves: list[Any]) -> tuple[Any, list[Any]] | None:
            every = int(params["every"])
            if due is None:  # the discovery trace
                strides.add(every)
                return None
            if every not in strides:
                raise _NewStride(every)
            summary = params["summary"]
            if every not in due:
                if not health:
                    return None
                summary = "health"  # the health check of enable(health_every=...)
            elif histogram and summary == "stats":
                summary = "histogram"  # a step of enable(histogram_every=...)
            site = params["site"]
            order = next(_order)
            info = stream_site(site, params["mode"], leaves, summary=summary, every=every,
                               loops=site.loops, enclosing=params["enclosing"], order=order)
            arrays = multihost.partial_summaries(leaves, summary, info.bins, gather)
            if arrays is not None:  # finished in logging_step, with every site's
                in_blocks.add(info.order)
            else:
                arrays, packing = sites_summary(leaves, summary, info.bins)
                if packing is not None:
                    info = dataclasses.replace(info, packing=packing)
            return info, [*arrays, jnp.ones((), jnp.int32)]

        def stride(every: int) -> None:
            # A site that keeps its host callback: the host applies its every=, but only on
            # the steps at which the logging program runs, so its stride must be known.
            if due is None:
                strides.add(every)
            elif every not in strides:
                raise _NewStride(every)

        def logging_step(*args: Any, **kwargs: Any) -> tuple[Any, CompiledSummaries]:
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            # Inside jax.jit's trace: what it traced is dynamic, what it was told is static
            # (static_argnums, a NumPy scalar included) stays static (capture.is_dynamic
            # decides for the calls that trace their own arguments).
            dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jc.core.Tracer)]

            def call(*dyn: Any) -> Any:  # fun, with the traced arguments in their places
                full = list(leaves)
                for i, x in zip(dynamic, dyn, strict=True):
                    full[i] = x
                a, k = jax.tree_util.tree_unflatten(treedef, full)
                fun = fun_ref()
                assert fun is not None, "a logging program outlived its function"
                return fun(*a, **k)

            dyn = [leaves[i] for i in dynamic]
            fun = fun_ref()
            assert fun is not None, "a logging program outlived its function"
            jaxpr, consts, out_tree = capture.trace_flat(call, dyn, (fun, args, kwargs, dynamic))
            del fun
            summary_pass = _interpret.SummaryPass(reduce=reduce, stride=stride)
            outs, caps = _interpret.eval_summaries(jaxpr, consts, dyn, summary_pass)
            if summary_pass.callbacks:
                callbacks[config] = True
            names = _numbered(caps, summary_pass.names)
            kept = [i for i, c in enumerate(caps) if not isinstance(c.site, str)]
            caps, names = [caps[i] for i in kept], [names[i] for i in kept]
            if in_blocks:
                caps = multihost.combine_partials(caps, in_blocks, gather)
            sites = []
            arrays: list[Any] = []
            for c, name in zip(caps, names, strict=True):
                sites.append(SiteSummary(naming.renamed(c.site, name), c.stacked,
                                         len(c.leaves)))
                arrays.extend(c.leaves)
            result = jax.tree_util.tree_unflatten(out_tree, outs)
            if multihost.spans_processes():
                # Unpacked, so each keeps its sharding: a shard_map site's per-shard summaries
                # stay with the process that ran the shard (see sowtel.multihost); a global
                # site's full value is gathered (replicated), as the callback transport does.
                arrays = multihost.gather_full_values(sites, arrays, gather)
                return result, CompiledSummaries(arrays, tuple(sites), None)
            buffers, layout = CompiledSummaries.pack(arrays)
            return result, CompiledSummaries(buffers, tuple(sites), layout)

        # static_argnames read its signature; __wrapped__ would hold the function.
        functools.update_wrapper(logging_step, self._fun)
        del logging_step.__wrapped__  # type: ignore[attr-defined]
        try:
            logging_step.__signature__ = inspect.signature(self._fun)  # type: ignore[attr-defined]
        except (TypeError, ValueError):  # no signature to read (some builtins)
            pass
        options = dict(self._options)
        if "out_shardings" in options:
            options["out_shardings"] = (options["out_shardings"], None)
        return jax.jit(logging_step, **options)


_order = itertools.count()


class SplitJitted:
    """Base of the framework wrappers (``sowtel.nnx.jit``, ``sowtel.equinox.filter_jit``): a
    :class:`Jitted` (``_jitted``) of a pure function, called with the arguments that
    ``_split`` makes of the user's call; ``_label`` names the wrapper in its ``repr``.

    Example:
        >>> class Doubled(SplitJitted):
        ...     _label = "doubled"
        ...     def __init__(self, fun):
        ...         self._fun, self._jitted = fun, Jitted(fun, {})
        ...     def _split(self, args, kwargs):
        ...         return tuple(2 * a for a in args)
        >>> def f(x): return x + 1
        >>> Doubled(f)
        doubled('f')
        >>> Doubled(f).lower(1.0).out_info.shape
        ()
    """

    _label = "sowtel.jit"
    _fun: Callable[..., Any]
    _jitted: Jitted

    def _split(self, args: Any, kwargs: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The lowered program of a step that logs nothing (``jax.jit``'s ``Lowered``)."""
        return self._jitted.lower(*self._split(args, kwargs))

    def lower_logging(self, *args: Any, step: int = 0, **kwargs: Any) -> Any:
        """The lowered program of a logging step at ``step`` (see ``sowtel.jit``)."""
        return self._jitted.lower_logging(*self._split(args, kwargs), step=step)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"{self._label}({getattr(self._fun, '__qualname__', self._fun)!r})"


def name_after(pure: Callable[..., Any], fun: Callable[..., Any]) -> None:
    """Gives ``pure`` the names of ``fun``, and ``fun`` as its ``__wrapped__``: errors raised
    while tracing it name ``fun`` and its source line, as ``jax.jit(fun)``'s do. Not ``fun``'s
    signature: ``pure`` keeps its own (``__signature__``), which ``jax.jit`` reads to bind the
    arguments that a wrapper's pure function takes.

    Example:
        >>> import inspect
        >>> def pure(a, b): return a
        >>> def step(x): return x
        >>> name_after(pure, step); pure.__name__, inspect.signature(pure)
        ('step', <Signature (a, b)>)
    """
    try:
        signature = inspect.signature(pure)
    except (TypeError, ValueError):  # no signature to keep: leave it unwrapped
        signature = None
    for attr in ("__name__", "__qualname__", "__module__"):
        if hasattr(fun, attr):
            setattr(pure, attr, getattr(fun, attr))
    if signature is not None:
        pure.__signature__ = signature  # type: ignore[attr-defined]
        pure.__wrapped__ = fun  # type: ignore[attr-defined]


def jit(fun: Callable[..., Any] | None = None, /, **jax_jit_options: Any) -> Any:
    """``jax.jit`` for training steps: streams the step's sows as outputs, not host callbacks.

    Takes ``jax.jit``'s options (``static_argnums``, ``donate_argnums``, shardings, ...) and
    handles them as ``jax.jit`` does; ``.lower``, ``.trace``, ``.eval_shape`` and ``__wrapped__``
    behave as on ``jax.jit(fun)``. Usable as a decorator, with or without options
    (``@sowtel.jit(donate_argnums=0)``).

    With no session, or on a step that logs nothing, the call runs ``jax.jit(fun)``'s own
    program. On a logging step the summaries of the selected sites come back as outputs of the
    compiled program; the call returns at once and the session's dispatcher thread turns them
    into records (see the module docs). ``lower_logging(*args, step=k)`` lowers the program a
    logging step runs.

    Raises:
      TypeError: ``fun`` is not callable, or an option ``jax.jit`` does not take.

    Example:
        >>> import jax.numpy as jnp, sowtel
        >>> @sowtel.jit(static_argnums=1)
        ... def scaled(x, k):
        ...     return sowtel.sow(x * k, "scaled").sum()
        >>> with sowtel.enable(exporter="memory", every=2) as session:
        ...     for step in range(4):
        ...         _ = scaled(jnp.arange(3.0), 2)
        ...     _ = sowtel.flush()
        >>> [(r.step, r.stats["max"]) for r in session.exporters[0].records]
        [(0, 4.0), (2, 4.0)]
    """
    if fun is None:
        return lambda f: jit(f, **jax_jit_options)
    if not callable(fun):
        raise errors.NotCallableError(fun, "sowtel.jit",
                                      "sowtel.jit(train_step, donate_argnums=0)")
    return Jitted(fun, jax_jit_options)
