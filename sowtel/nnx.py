"""Flax NNX: module outputs as sites (``sowtel.nnx.capture``) and ``nnx.jit`` with streaming
(``sowtel.nnx.jit``).

An idiomatic NNX training step updates the model and the optimizer in place. Under
``jax.jit`` (and so under :func:`sowtel.jit`) those updates are lost: the step silently does not
train; NNX steps need ``nnx.jit``. :func:`jit` keeps ``nnx.jit``'s semantics (the modules,
optimizers and RNG streams passed in are updated in place, shared references included) and
streams the step's sites as :func:`sowtel.jit` does: summaries as outputs of the compiled step,
the plain program on steps that log nothing.

:func:`capture` makes the output of every NNX module's ``__call__`` in a model a site named
by the module's attribute path (``blocks/0/__call__``, ``__call__`` for the model itself),
with no ``sow`` in the model's code.

Flax is imported when first needed, so ``import sowtel`` never requires it.

Example:
    >>> import jax.numpy as jnp, optax, sowtel, sowtel.nnx, sowtel.optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, sowtel.optax.watch(optax.sgd(0.1)), wrt=nnx.Param)
    >>> @sowtel.nnx.jit
    ... def step(model, optimizer, x, y):
    ...     def loss(model):
    ...         with sowtel.nnx.capture(model):
    ...             return jnp.mean((model(x) - y) ** 2)
    ...     value, grads = nnx.value_and_grad(loss)(model)
    ...     optimizer.update(model, grads)
    ...     return value
    >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    >>> with sowtel.enable(exporter="memory") as session:
    ...     losses = [float(step(model, optimizer, x, y)) for _ in range(3)]
    ...     _ = sowtel.flush()
    >>> losses[2] < losses[0]  # the model trained in place
    True
    >>> sorted({r.name for r in session.exporters[0].records})[:3]
    ['__call__', 'optim/grads/bias', 'optim/grads/kernel']
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax

from sowtel import _module_sites, errors, naming
from sowtel.jit import Jitted, SplitJitted, name_after

__all__ = ["capture", "jit"]


def _nnx() -> Any:
    try:
        from flax import nnx
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("sowtel.nnx needs Flax: pip install flax (or sowtel[dev])") from err
    return nnx


# -- capture ----------------------------------------------------------------------------------

# Each patched class: [its own __call__ before (or None), how many contexts hold the patch].
_PATCHED: dict[type, list[Any]] = {}
_patch_lock = threading.Lock()

# A captured module carries its site as an attribute, not as its id(): NNX keeps a module's
# non-array attributes in its graph definition (and JAX's pytree metadata), so every copy NNX
# makes (nnx.scan, nnx.vmap, nnx.remat, nnx.jit, split then merge) carries the mark, where a
# copy's id() is new. A mark names an entry of _SITES, alive while its context is open:
# (thread that entered it, site name or None for a module the filter leaves out, prefix,
# options).
_MARK = "_sowtel_capture_site"
_marks = itertools.count()
_SITES: dict[str, tuple[int, str | None, str | None, dict[str, Any]]] = {}
# Per thread: the open contexts, and the ids of the modules whose call is being recorded (a
# subclass's __call__ that calls super().__call__() is one call, one site).
_LOCAL = threading.local()


@dataclasses.dataclass
class _Open:
    """An open context, for telling an unmarked module that looks like a captured one."""

    classes: set[type]
    modules: list[tuple[str, Any]]  # (site name, module)
    shapes: dict[type, dict[Any, str]] | None = None  # by class: structure -> site name
    told: set[str] = dataclasses.field(default_factory=set)


def _open() -> list[_Open]:
    if not hasattr(_LOCAL, "open"):
        _LOCAL.open, _LOCAL.inside = [], set()
    return _LOCAL.open  # type: ignore[no-any-return]


_PLAIN = (bool, int, float, str, type(None))


def _structure(module: Any) -> tuple[Any, ...]:
    """What a module and every copy of it share: the paths and types of its graph's nodes, and
    its plain static attributes (``in_features=4``); not the values of its arrays."""
    return tuple((path, type(node), node if isinstance(node, _PLAIN) else None)
                 for path, node in _nnx().iter_graph(module) if _MARK not in path)


def _site_of(module: Any) -> tuple[str, str | None, dict[str, Any]] | None:
    mark = vars(module).get(_MARK)
    found = _SITES.get(mark) if isinstance(mark, str) else None
    if found is None:
        _tell_unmarked(module)
        return None
    thread, name, base, options = found
    if name is None or thread != threading.get_ident():
        return None  # left out by the filter; or a call in another thread, never recorded
    return name, base, options


def _tell_unmarked(module: Any) -> None:
    """Warns when an open context's class is called on a module that is not marked but has
    the structure of a captured one: a copy made before the context was entered (an
    ``nnx.split`` outside, ``nnx.merge`` inside), or a twin model; its output is not captured."""
    structure = None
    for ctx in _open():
        if type(module) not in ctx.classes:
            continue
        if ctx.shapes is None:
            ctx.shapes = {}
            for site, m in ctx.modules:
                ctx.shapes.setdefault(type(m), {}).setdefault(_structure(m), site)
        structure = _structure(module) if structure is None else structure
        name = ctx.shapes.get(type(module), {}).get(structure)
        if name is None or name in ctx.told:
            continue
        ctx.told.add(name)
        warnings.warn(
            f"sowtel.nnx.capture: a {type(module).__name__} with the structure of the captured "
            f"module {name!r} was called inside the context, but it is neither that module nor "
            "a copy NNX made of it while the context was open, so its output is not captured. "
            "If it is a copy (nnx.split before the context, nnx.merge inside it), enter "
            "sowtel.nnx.capture before splitting; if it is another model, capture it too",
            stacklevel=4)


def _recording_call(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        _open()
        if id(self) in _LOCAL.inside:
            return original(self, *args, **kwargs)
        site = _site_of(self)
        if site is None:
            return original(self, *args, **kwargs)
        name, base, options = site
        _LOCAL.inside.add(id(self))
        try:
            out = original(self, *args, **kwargs)
        finally:
            _LOCAL.inside.discard(id(self))
        return _module_sites.sow_output(out, name, base, **options)

    __call__.__sowtel_original__ = original  # type: ignore[attr-defined]
    return __call__


def _patch(classes: set[type]) -> None:
    with _patch_lock:
        # The originals are looked up before any class is patched: a subclass's must be its own
        # (or its base's unpatched) method, never another patch.
        new = {cls: cls.__dict__.get("__call__") for cls in classes if cls not in _PATCHED}
        for cls in classes:
            if cls in _PATCHED:
                _PATCHED[cls][1] += 1
        for cls, own in new.items():
            original = own if own is not None else cls.__call__
            original = getattr(original, "__sowtel_original__", original)
            _PATCHED[cls] = [own, 1]
            cls.__call__ = _recording_call(original)  # type: ignore[method-assign]


def _unpatch(classes: set[type]) -> None:
    with _patch_lock:
        for cls in classes:
            entry = _PATCHED[cls]
            entry[1] -= 1
            if entry[1] == 0:
                del _PATCHED[cls]
                if entry[0] is None:
                    del cls.__call__  # type: ignore[misc]
                else:
                    cls.__call__ = entry[0]  # type: ignore[method-assign]


@contextmanager
def capture(model: Any, filter: Any = None, *, tag: str = "intermediates",
            summary: str | None = None, every: int | None = None) -> Iterator[None]:
    """Makes the output of every ``__call__`` of ``model``'s NNX modules a site.

    Sites are named by the module's attribute path in ``model``: ``encoder/blocks/0/__call__``,
    and ``__call__`` for ``model`` itself. They stream (with their cotangents under
    ``nnx.grad`` / ``jax.grad``), and :func:`sowtel.save_intermediates` captures them. A module
    called twice gives ``..._0`` and ``..._1``, as repeated sows do; outputs that are not
    pytrees of arrays are left alone.

    Enter it around the model's call (inside the step is the usual place). The context marks
    each module of ``model`` with a static attribute (removed on exit), and NNX carries it into
    every copy it makes while the context is open: the copies that ``nnx.jit``, ``nnx.scan``,
    ``nnx.vmap``, ``nnx.remat`` and ``nnx.split``/``nnx.merge`` hand the code are recorded
    under the module's own name, as a sow there would be (stacked per iteration in
    ``nnx.scan``, the batch axis first in ``nnx.vmap``). A copy made before the context was
    entered (``nnx.split`` outside it, ``nnx.merge`` inside) has no mark: calling one warns
    that its output is not captured. Only calls made in the thread that entered the context
    are recorded. With nothing enabled it adds nothing to the compiled program.

    Args:
      model: an ``nnx.Module``; its submodules are found with ``nnx.iter_modules``.
      filter: ``None`` (every module), a function ``filter(module, "__call__") -> bool``, or
        glob patterns on the site name (as ``enable(include=...)`` matches).
      tag, summary, every: as for :func:`sowtel.sow`, for every site made here.

    Example:
        >>> import jax, jax.numpy as jnp, sowtel, sowtel.nnx
        >>> from flax import nnx
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.hidden = nnx.Linear(2, 3, rngs=rngs)
        ...         self.out = nnx.Linear(3, 1, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.out(nnx.relu(self.hidden(x))).sum()
        >>> model = MLP(nnx.Rngs(0))
        >>> def loss(model, x):
        ...     with sowtel.nnx.capture(model, filter="hidden/*"):
        ...         return model(x)
        >>> _, inter = sowtel.save_intermediates(nnx.grad(loss))(model, jnp.ones(2))
        >>> list(inter), list(inter["hidden/__call__"])
        (['hidden/__call__'], ['primal', 'cotangent'])
    """
    nnx = _nnx()
    if not isinstance(model, nnx.Module):
        raise errors.NotAModuleError("sowtel.nnx.capture", "an nnx.Module", model,
                                     ": for Linen modules use sowtel.flax.capture")
    select = _module_sites.check_filter(filter, "sowtel.nnx.capture")
    _module_sites.check_options(tag, every)
    base = naming.current_prefix()
    options = {"tag": tag, "summary": summary, "every": every}
    thread = threading.get_ident()
    marked: dict[int, tuple[Any, str, Any]] = {}  # id -> (module, its mark, the mark before)
    selected: list[tuple[str, Any]] = []
    for path, module in nnx.iter_modules(model):
        if id(module) in marked:
            continue  # shared: named after its first path
        name = _module_sites.site_name(path, "__call__")
        chosen = callable(module) and select(module, "__call__", name)
        mark = f"sowtel-{next(_marks)}"
        _SITES[mark] = (thread, name if chosen else None, base, options)
        marked[id(module)] = (module, mark, vars(module).get(_MARK, _UNMARKED))
        if chosen:
            selected.append((name, module))
    classes = {type(m) for _, m in selected}
    context = _Open(classes, selected)
    _open().append(context)
    try:
        for module, mark, _ in marked.values():
            # Not setattr: NNX refuses it for a module of an outer trace, and the mark is no
            # state of the module (a static attribute, the same in every copy).
            object.__setattr__(module, _MARK, mark)
        _patch(classes)
        try:
            yield
        finally:
            _unpatch(classes)
    finally:
        _open().remove(context)
        for module, mark, before in marked.values():
            _SITES.pop(mark, None)
            if vars(module).get(_MARK) != mark:
                continue  # re-marked by a context still open, or replaced
            if before is _UNMARKED:
                object.__delattr__(module, _MARK)
            else:
                object.__setattr__(module, _MARK, before)


_UNMARKED = object()


# -- jit --------------------------------------------------------------------------------------


class _Static:
    """A pytree node with no leaves that carries a static value through ``jax.jit``'s outputs."""

    def __init__(self, value: Any) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda v, _: _Static(v))


def _graph_nodes(tree: Any) -> list[Any]:
    """The NNX graph nodes (modules, optimizers, RNG streams, variables) in ``tree``, in order:
    what a step can update in place (arrays and Python values beside them cannot be)."""
    from flax.nnx import graph

    is_node = getattr(graph, "is_graph_node", None) or graph.is_node
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_node) if is_node(x)]


class _Hole:
    """Where a static argument was, in the arguments that are split (it has no state)."""


_HOLE = _Hole()


def _argument_sets(fun: Callable[..., Any], nums: Any, names: Any, what: str
                   ) -> tuple[frozenset[int], frozenset[str]]:
    """``nnx.jit``'s (and ``jax.jit``'s) ``*_argnums`` / ``*_argnames`` as sets of positions
    and names; each completes the other through ``fun``'s signature where only one is given."""
    def as_set(value: Any, kind: type, option: str) -> frozenset[Any]:
        if value is None:
            return frozenset()
        items = (value,) if isinstance(value, kind) else tuple(value)
        if not all(isinstance(i, kind) and not isinstance(i, bool) for i in items):
            raise errors.BadOptionTypeError(f"sowtel.nnx.jit {option}", value, f"must be "
                            f"{'an int or ints' if kind is int else 'a str or strs'}")
        return frozenset(items)

    positions = as_set(nums, int, f"{what}_argnums")
    keywords = as_set(names, str, f"{what}_argnames")
    if (nums is None) == (names is None):
        return positions, keywords
    try:
        parameters = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return positions, keywords
    positional = [q for q in parameters if q.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if names is None:
        keywords = frozenset(positional[i].name for i in positions
                             if -len(positional) <= i < len(positional)
                             and positional[i].kind is not inspect.Parameter.POSITIONAL_ONLY)
    else:
        positions = frozenset(i for i, q in enumerate(positional) if q.name in keywords)
    return positions, keywords


class NnxJitted(SplitJitted):
    """What :func:`jit` returns: call it as the ``nnx.jit`` function it stands for."""

    _label = "sowtel.nnx.jit"

    def __init__(self, fun: Callable[..., Any], donate_state: bool,
                 options: dict[str, Any]) -> None:
        nnx = _nnx()
        self._static = _argument_sets(fun, options.pop("static_argnums", None),
                                      options.pop("static_argnames", None), "static")
        self._donated = _argument_sets(fun, options.pop("donate_argnums", None),
                                       options.pop("donate_argnames", None), "donate")
        for option in ("graph", "graph_updates"):  # graph mode is the one both modes agree on
            value = options.pop(option, None)
            if value is not None and not isinstance(value, bool):
                raise errors.BadOptionTypeError(
                    f"sowtel.nnx.jit {option}", value, "must be True, False or None")

        def pure(graphdef: Any, statics: tuple[tuple[Any, Any], ...], donated: Any,
                 kept: Any) -> tuple[Any, Any, _Static]:
            args, kwargs = self._fill(nnx.merge(graphdef, donated, kept), statics)
            out = fun(*args, **kwargs)
            _, state_out = nnx.split(_graph_nodes((args, kwargs)))
            out_graphdef, out_state = nnx.split(out)
            return state_out, out_state, _Static(out_graphdef)

        name_after(pure, fun)
        self._fun = fun
        self._donate = donate_state or bool(self._donated[0] or self._donated[1])
        self._donate_all = donate_state
        self._jitted: Jitted = Jitted(
            pure, {**options, "static_argnums": (0, 1),
                   **({"donate_argnums": 2} if self._donate else {})})
        functools.update_wrapper(self, fun)

    @staticmethod
    def _among(chosen: tuple[frozenset[int], frozenset[str]], where: int | str,
               nargs: int) -> bool:
        """Whether argument ``where`` (a position among ``nargs``, or a keyword) is chosen;
        negative positions count from the end, as ``jax.jit`` counts them."""
        positions, names = chosen
        if isinstance(where, str):
            return where in names
        return where in positions or where - nargs in positions

    def _fill(self, split: Any, statics: tuple[tuple[Any, Any], ...]) -> tuple[Any, Any]:
        args, kwargs = list(split[0]), dict(split[1])
        for where, value in statics:
            if isinstance(where, str):
                kwargs[where] = value
            else:
                args[where] = value
        return args, kwargs

    def _split(self, args: Any, kwargs: Any) -> tuple[Any, ...]:
        n = len(args)
        static = [i for i in range(n) if self._among(self._static, i, n)] + [
            k for k in kwargs if self._among(self._static, k, n)]
        statics = tuple((w, args[w] if isinstance(w, int) else kwargs[w]) for w in static)
        args = tuple(_HOLE if i in static else a for i, a in enumerate(args))
        kwargs = {k: _HOLE if k in static else v for k, v in kwargs.items()}

        def donated(path: tuple[Any, ...], _: Any) -> bool:  # path: (0, position) or (1, name)
            return self._donate_all or self._among(self._donated, path[1], n)

        graphdef, donated_state, kept = _nnx().split((args, kwargs), donated, ...)
        return graphdef, statics, donated_state, kept

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        nnx = _nnx()
        split = self._split(args, kwargs)
        with warnings.catch_warnings():
            if self._donate:  # state no output can reuse (a step counter's int): expected
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            state_out, out_state, out_graphdef = self._jitted(*split)
        nnx.update(_graph_nodes((args, kwargs)), state_out)
        return nnx.merge(out_graphdef.value, out_state)


def jit(fun: Callable[..., Any] | None = None, /, *, donate_state: bool = False,
        **jax_jit_options: Any) -> Any:
    """``nnx.jit`` that streams: NNX modules passed in are updated in place, sites stream.

    The arguments may hold NNX modules, optimizers and ``nnx.Rngs`` (shared references
    included), arrays, and Python values (numbers, strings: static, part of the cache key;
    under ``nnx.jit`` a number is traced and a string must be marked static). After the call
    every module passed in holds the state the step left it in, exactly as under ``nnx.jit``;
    the result may hold arrays and modules (new objects).
    Streaming is :func:`sowtel.jit`'s: with no session, or on a step that logs nothing, the
    program is the plain one; on a logging step the summaries come back as outputs.

    Called as ``nnx.jit`` is: ``@jit``, ``@jit(...)`` or ``jit(fun, ...)``, on a function or
    a method (the instance is its first argument), with positional and keyword arguments.

    Args:
      fun: the step.
      donate_state: donate the buffers of all the state passed in, so the update can reuse
        them.
      jax_jit_options: ``nnx.jit``'s options: ``static_argnums`` / ``static_argnames`` (those
        arguments are static whatever they hold; they must be hashable), ``donate_argnums`` /
        ``donate_argnames`` (the state of those arguments is donated), ``keep_unused``,
        ``device``, ``backend``, ``inline``; ``graph`` and ``graph_updates`` are accepted and
        the step runs in graph mode (whose results tree mode shares). ``in_shardings`` and
        ``out_shardings`` are refused with an error saying what to do instead.

    Example:
        >>> import jax.numpy as jnp, sowtel, sowtel.nnx
        >>> from flax import nnx
        >>> class Counter(nnx.Module):
        ...     def __init__(self):
        ...         self.count = nnx.Variable(jnp.zeros(()))
        >>> @sowtel.nnx.jit
        ... def bump(counter, by):
        ...     counter.count[...] += sowtel.sow(jnp.float32(by), "by")
        ...     return counter.count[...]
        >>> counter = Counter()
        >>> _ = bump(counter, 2), bump(counter, 3)
        >>> float(counter.count[...])
        5.0
    """
    if fun is None:
        return lambda f: jit(f, donate_state=donate_state, **jax_jit_options)
    if not callable(fun):
        raise errors.NotCallableError(fun, "sowtel.nnx.jit", "sowtel.nnx.jit(train_step)")
    if not isinstance(donate_state, bool):
        raise errors.BadOptionTypeError(
            "sowtel.nnx.jit donate_state", donate_state, "must be True or False")
    for option in ("in_shardings", "out_shardings"):
        if jax_jit_options.get(option) is not None:
            raise errors.UnsupportedOptionError(
                "sowtel.nnx.jit", option, "shard the state itself (nnx.with_partitioning and "
                "jax.device_put before the step) or constrain values inside it with "
                "jax.lax.with_sharding_constraint")
        jax_jit_options.pop(option, None)
    return NnxJitted(fun, donate_state, jax_jit_options)
