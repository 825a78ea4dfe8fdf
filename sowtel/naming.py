"""Naming sites: ``scope`` prefixes, numbering a name sown more than once in one program, and
the loops that index a site's records.

A site's name is the name given to :func:`sowtel.sow`, prefixed by every enclosing
:func:`scope` (joined with ``/``). Scopes are read when the sow is traced, so they work the same
in eager code, inside ``jax.jit``, for streaming and for :func:`sowtel.save_intermediates`; the
current scope is part of the jit cache key, so a jitted function called under two scopes is
traced (and named) once under each.

A name sown more than once in one traced program (a block called three times) is never merged
into one series: ``save_intermediates(duplicates="number")``, ``sowtel.jit`` and the host
callbacks all name the occurrences ``name_0``, ``name_1``, ... in trace order by one rule,
:func:`occurrence_name` (cotangents carry the number of their primal), and streaming warns once
per name. Occurrences of a sow inside one separately jitted
function that is called several times share one compiled body: they cannot be told apart while
streaming, so give them distinct names with :func:`scope`.

A site's records are indexed by the scans around it where it runs in the program
(:func:`program_loops`), by the host callbacks and ``sowtel.jit`` alike.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def block(x):
    ...     return jnp.tanh(sowtel.sow(x, "act"))
    >>> def model(x):
    ...     for i in range(2):
    ...         with sowtel.scope(f"block{i}"):
    ...             x = block(x)
    ...     return x.sum()
    >>> _, inter = sowtel.save_intermediates(model)(jnp.ones(2))
    >>> list(inter)
    ['block0/act', 'block1/act']
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar, cast

import jax

from sowtel import _exit, errors
from sowtel import _jax_compat as jc

__all__ = ["check_name", "check_tag", "leaf_segment", "leaf_name", "scope", "scoped",
           "runs_backward", "numbered", "number_in_program", "occurrence_name", "occurrence_names",
           "occurrence_slots", "program_loops", "ProgramNames", "Site", "renamed"]


# -- THE name rule -------------------------------------------------------------------------------

_NAME_CHARS = re.compile(r"[A-Za-z0-9_\-./]+")


def check_name(name: Any, what: str = "sow name") -> str:
    """THE name rule, for every name a user gives: ``sow``, ``log``, ``scope``, ``export``,
    ``optax.watch``'s prefix. Returns ``name``, else raises ``ValueError`` naming the value and
    the rule; ``what`` says which name it was (``"sow name"``, ``"sowtel.export site name"``).

    A name is segments of letters, digits and ``_ - .`` joined by ``/`` (which makes
    hierarchy); no empty, ``.`` or ``..`` segment, no leading ``/``: names are never paths, and
    they need no escaping in a TensorBoard tag, a file, a URL or a metric.

    Example:
        >>> check_name("block0/attn")
        'block0/attn'
        >>> check_name("../etc/x")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        sowtel.errors.BadNameError: sow name '../etc/x' has a '..' segment, which is not ...
    """
    if not isinstance(name, str):
        raise errors.BadNameError(what, name, "type")
    if not name:
        raise errors.BadNameError(what, name, "empty")
    if not _NAME_CHARS.fullmatch(name):
        bad = sorted({c for c in name if not _NAME_CHARS.fullmatch(c)})
        raise errors.BadNameError(what, name, "chars:" + "".join(bad))
    if name.startswith("/"):
        raise errors.BadNameError(what, name, "leading")
    for segment in name.split("/"):
        if segment == "":
            raise errors.BadNameError(what, name, "empty segment")
        if segment in (".", ".."):
            raise errors.BadNameError(what, name, segment)
    return name


def check_tag(tag: Any) -> str:
    """THE tag rule: a tag (``sow(tag=...)``, ``save_intermediates(tag=...)``) is a non-empty
    str. Returns ``tag``, else raises ``ValueError`` naming the value.

    Example:
        >>> check_tag("intermediates")
        'intermediates'
    """
    if not isinstance(tag, str) or not tag:
        raise errors.BadTagError(tag)
    return tag


_KEY_ENTRIES = tuple(getattr(jax.tree_util, k) for k in
                     ("DictKey", "SequenceKey", "GetAttrKey", "FlattenedIndexKey")
                     if hasattr(jax.tree_util, k))
_SEGMENT_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")


def leaf_segment(key: Any) -> str:
    """THE rule for a pytree key in a record name: one segment, escaped so that two leaves of
    one value never share a name.

    A key is its text (a dict key, a list or tuple position, an attribute's name, as
    :func:`jax.tree_util.tree_flatten_with_path` gives them: ``DictKey``, ``SequenceKey``,
    ``GetAttrKey``, ``FlattenedIndexKey``). Letters, digits and ``_ - .`` stay as they are;
    every other character is written ``%XX`` (each byte of its UTF-8, as in a URL), so ``/``
    becomes ``%2F`` and makes no hierarchy, ``[`` ``]`` become ``%5B`` ``%5D`` and never read as
    a scan index, and ``%`` itself becomes ``%25``. A ``.`` or ``..`` key is ``%2E`` or
    ``%2E%2E``, the empty key ``%``. Distinct keys give distinct segments.

    Example:
        >>> [leaf_segment(k) for k in ("w", 0, "a/b", "k[0]", "a b", "..", "%")]
        ['w', '0', 'a%2Fb', 'k%5B0%5D', 'a%20b', '%2E%2E', '%25']
    """
    if isinstance(key, _KEY_ENTRIES):  # a path entry of jax's: the key it stands for
        key = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
    text = key if isinstance(key, str) else str(key)
    if not text:
        return "%"
    if text in (".", ".."):
        return "%2E" * len(text)
    if all(c in _SEGMENT_SAFE for c in text):
        return text
    return "".join(c if c in _SEGMENT_SAFE else "".join(f"%{b:02X}" for b in c.encode())
                   for c in text)


def leaf_name(site: str, path: Sequence[Any]) -> str:
    """THE record name of a leaf of a sown value: the site's name, then one
    :func:`leaf_segment` per key on the leaf's path, joined with ``/``.

    Example:
        >>> leaf_name("params", ("w",)), leaf_name("pair", (0,)), leaf_name("h", ())
        ('params/w', 'pair/0', 'h')
        >>> leaf_name("v", ("a/b",)), leaf_name("v", ("a", "b"))
        ('v/a%2Fb', 'v/a/b')
    """
    return "/".join([site, *(leaf_segment(k) for k in path)])

# The current prefix is part of every jit cache key: a jitted function called under two scopes
# is traced once per scope, so its sites get both names rather than the first one twice.
_PREFIX = jax.make_user_context(None)
_open = 0  # scopes open in all threads together
_open_lock = threading.Lock()


def current_prefix() -> str | None:
    """The prefix that sows traced now get (``None`` outside any scope)."""
    if not _open:
        return None
    value = _PREFIX.value
    return value if isinstance(value, str) else None


def scoped(name: str) -> str:
    """``name`` under the current scope (``name`` itself outside any scope)."""
    if not _open:  # no scope open in any thread: the common case costs one global read
        return name
    prefix = current_prefix()
    return name if prefix is None else f"{prefix}/{name}"


@contextmanager
def scope(prefix: str) -> Iterator[None]:
    """Names every sow traced inside ``<prefix>/<name>``; scopes nest with ``/``.

    ``prefix`` follows the rules of sow names (letters, digits, ``_ - . /``; no empty, ``.`` or
    ``..`` segment, no leading ``/``). The scope is read when a sow is traced: wrap the code that
    calls the sows (inside the jitted function, or around a module's call), in eager code and
    traced code alike; it names streamed records and :func:`sowtel.save_intermediates` keys the
    same way.

    Example:
        >>> import jax.numpy as jnp, sowtel
        >>> def f(x):
        ...     with sowtel.scope("encoder"):
        ...         with sowtel.scope("layer0"):
        ...             x = sowtel.sow(x * 2.0, "act")
        ...     return x.sum()
        >>> _, inter = sowtel.save_intermediates(f)(jnp.ones(2))
        >>> list(inter)
        ['encoder/layer0/act']
    """
    check_name(prefix, "sowtel.scope prefix")
    with absolute_prefix(scoped(prefix)):
        if getattr(_marking, "on", 0):
            with jax.named_scope(SCOPE_MARK + prefix):
                yield
        else:
            yield


# While sowtel.locate_nonfinite traces, a scope also enters JAX's name stack (as
# ``SCOPE_MARK + prefix``), so that every equation traced inside knows its scope. Only then: the
# name stack reaches the compiled program's metadata, which is otherwise left as it was.
SCOPE_MARK = "sowtel.scope:"
_marking = threading.local()


@contextmanager
def scopes_in_name_stack() -> Iterator[None]:
    """Scopes entered in this thread inside also enter JAX's name stack (see ``SCOPE_MARK``)."""
    _marking.on = getattr(_marking, "on", 0) + 1
    try:
        yield
    finally:
        _marking.on -= 1


@contextmanager
def absolute_prefix(prefix: str | None) -> Iterator[None]:
    """Sows traced inside are named ``<prefix>/<name>``, whatever scopes enclose this one."""
    global _open
    with _open_lock:
        _open += 1
    try:
        with _PREFIX(prefix):
            yield
    finally:
        with _open_lock:
            _open -= 1


# ---------------------------------------------------------------------------------------------
# Repeated names: one rule for capture and for streaming.


def runs_backward(mode: str) -> bool:
    """Backward passes run sites in reverse, so these modes are numbered from the end."""
    return "cotangent" in mode.split(".")


def forward_mode(mode: str) -> bool:
    """A mode of forward code: the primal and its tangents (no cotangent in it). Such a site
    run in a backward pass is a recomputation, silent (see ``sowtel.capture``)."""
    return not runs_backward(mode)


def numbered(name: str, occurrence: int) -> str:
    """The name of occurrence ``occurrence`` of a repeated ``name``."""
    return f"{name}_{occurrence}"


def occurrence_name(name: str, mode: str, slot: int, counts: Mapping[str, int]) -> str:
    """THE numbering of repeated names, for one site: the name it is reported under.

    ``slot`` is the site's place among the sites of ``(name, mode)`` in trace order, ``counts``
    the number of sites of ``name`` in each mode of the program. A name that occurs more than
    once in any mode is numbered in every mode (``name_0``, ``name_1``, ...), in trace order;
    modes that run backward count from the end, so a cotangent carries its primal's number.
    ``save_intermediates(duplicates="number")``, ``sowtel.jit`` and the host callbacks all
    name sites with it (see :func:`occurrence_names`).

    Example:
      >>> counts = {"primal": 2, "cotangent": 2}
      >>> occurrence_name("h", "primal", 0, counts), occurrence_name("h", "cotangent", 0, counts)
      ('h_0', 'h_1')
      >>> occurrence_name("h", "primal", 0, {"primal": 1})
      'h'
    """
    if all(n < 2 for n in counts.values()):
        return name
    count = counts.get(mode, 0)
    return numbered(name, count - 1 - slot if runs_backward(mode) else slot)


def occurrence_slots(keys: Sequence[tuple[str, str]]) -> list[int]:
    """Per ``(name, mode)`` in trace order, how many sites of that name and mode came before.

    Capture unites the sites of sibling cond branches that share a name, mode and slot.

    Example:
      >>> occurrence_slots([("h", "primal"), ("g", "primal"), ("h", "primal")])
      [0, 0, 1]
    """
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    slots = []
    for key in keys:
        slots.append(seen[key])
        seen[key] += 1
    return slots


def occurrence_names(keys: Sequence[tuple[str, str]]) -> list[str]:
    """The reported names of a program's sites, given their ``(name, mode)`` in trace order.

    Example:
      >>> occurrence_names([("h", "primal"), ("h", "primal"), ("h", "cotangent"),
      ...                   ("h", "cotangent"), ("g", "primal")])
      ['h_0', 'h_1', 'h_1', 'h_0', 'g']
    """
    counts: dict[str, collections.Counter[str]] = {}
    for name, mode in keys:
        counts.setdefault(name, collections.Counter())[mode] += 1
    return [occurrence_name(name, mode, slot, counts[name])
            for (name, mode), slot in zip(keys, occurrence_slots(keys), strict=True)]


def program_loops(enclosing: Sequence[tuple[Any, ...]]
                  ) -> tuple[tuple[int, bool], ...] | None:
    """THE indexing rule: the loops that index a site's records, from the loops around the
    site in the program that runs (``("scan", length, reverse, ...)`` or
    ``("while", 0, False, ...)``, outermost first; what follows is not read here).

    Records are indexed by the scans inside the innermost ``while_loop`` around the site (a
    while loop's iterations are not static: they have no index). ``None`` directly inside a
    while body. Where the site sits in the program, not where its ``sow`` was called: a
    function traced once and evaluated elsewhere (``closure_convert``, as ``odeint`` does) is
    indexed where it runs. The host callbacks read the loops while the program is lowered,
    ``sowtel.jit``'s summaries while its pass evaluates the program; both call this.

    Example:
      >>> program_loops([("scan", 3, False), ("while", 0, False), ("scan", 6, True)])
      ((6, True),)
      >>> program_loops([("scan", 3, False), ("while", 0, False)]) is None
      True
      >>> program_loops([])
      ()
    """
    loops: list[tuple[int, bool]] = []
    in_while = False
    for kind, length, reverse, *_ in enclosing:
        if kind == "while":
            loops, in_while = [], True
        else:
            loops.append((int(length), bool(reverse)))
    return None if in_while and not loops else tuple(loops)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _renew_locks() -> None:
    global _open_lock, _warned_lock
    _open_lock, _warned_lock = threading.Lock(), threading.Lock()  # in a forked child


_exit.after_fork(_renew_locks)


def warn_repeated(name: str) -> None:
    """Warns once per name that streaming numbers its occurrences."""
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(
        f"sow name {name!r} is used more than once in one program: streaming names the "
        f"occurrences {numbered(name, 0)!r}, {numbered(name, 1)!r}, ... in trace order (as "
        "save_intermediates(duplicates='number') does). Give each a distinct name with "
        "sowtel.scope or sowtel.flax.sow. A sow inside one separately jitted function that is "
        "called several times is compiled once, so its occurrences cannot be told apart: they "
        "stream as one site",
        stacklevel=2,
    )


class Site(Protocol):
    """What naming reads of a streaming site (a frozen dataclass, ``sowtel.sites.StreamSite``)."""

    @property
    def name(self) -> str: ...

    @property
    def mode(self) -> str: ...

    @property
    def leaf_names(self) -> tuple[str, ...]: ...


S = TypeVar("S", bound=Site)


def renamed(site: S, name: str) -> S:
    """THE site renaming: ``site`` reported as ``name`` (a repeated name's occurrence, see
    :func:`occurrence_name`), its leaves' names following (``h/w`` becomes ``h_0/w``).

    Example:
      >>> import dataclasses
      >>> @dataclasses.dataclass(frozen=True)
      ... class Streamed:
      ...     name: str
      ...     mode: str
      ...     leaf_names: tuple[str, ...]
      >>> renamed(Streamed("h", "primal", ("h/w", "h/b")), "h_0").leaf_names
      ('h_0/w', 'h_0/b')
    """
    if name == site.name:
        return site
    return cast(S, dataclasses.replace(
        cast(Any, site), name=name,
        leaf_names=tuple(name + leaf[len(site.name):] for leaf in site.leaf_names)))


class ProgramNames:
    """The names a ``sowtel.jit`` logging program gives its sites that stream through host
    callbacks (in ``while_loop`` bodies), per ``(name, mode)`` in program order.

    Its summary pass numbers every site of the program, those it returns and those that call
    back, by :func:`occurrence_names`; the callbacks' lowering (:func:`number_in_program`)
    then takes the names from here, rather than numbering the callback sites among themselves.

    Example:
      >>> names = ProgramNames()
      >>> names.settle([("h", "primal"), ("h", "primal")], ["h_0", "h_1"], [False, True])
      >>> names.get("h", "primal", 0), names.get("h", "primal", 1)
      ('h_1', None)
    """

    __slots__ = ("_names",)

    def __init__(self) -> None:
        self._names: dict[tuple[str, str], list[str]] = {}

    def settle(self, keys: Sequence[tuple[str, str]], names: Sequence[str],
               calls_back: Sequence[bool]) -> None:
        """Keeps the final ``names`` of the sites (``keys`` in program order) that call back."""
        self._names.clear()
        for key, name, back in zip(keys, names, calls_back, strict=True):
            if back:
                self._names.setdefault(key, []).append(name)

    def get(self, name: str, mode: str, slot: int) -> str | None:
        """The name of the ``slot``-th site of ``(name, mode)`` that calls back, if settled."""
        settled = self._names.get((name, mode), ())
        return settled[slot] if slot < len(settled) else None


class NumberedSite(Generic[S]):
    """A streaming site and the others of its name in the same program.

    Its name is settled on the first callback, when the whole program has been lowered: until
    then it is not known whether the name repeats.
    """

    __slots__ = ("_site", "_slot", "_counts", "_resolved", "_names")

    def __init__(self, site: S, slot: int, counts: dict[str, list[int]],
                 names: ProgramNames | None = None) -> None:
        self._site = site
        self._slot = slot
        # {mode: [sites of the name in that mode]} of the program, shared by its sites
        self._counts = counts
        self._resolved: S | None = None
        self._names = names

    def __call__(self) -> S:
        resolved = self._resolved
        if resolved is None:
            resolved = self._resolved = self._resolve()
        return resolved

    def _resolve(self) -> S:
        site = self._site
        name = None if self._names is None else self._names.get(site.name, site.mode,
                                                                   self._slot)
        if name is None:
            counts = {mode: n[0] for mode, n in self._counts.items()}
            name = occurrence_name(site.name, site.mode, self._slot, counts)
        return renamed(site, name)


def _occurrence(earlier: list[tuple[Any, tuple[int, ...], int]],
                path: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], int | None]:
    """Per branch level, how many earlier sites share the branch; and the occurrence this site
    shares with a site in a sibling branch of the same cond (as capture unites branches)."""
    counts = tuple(
        sum(1 for p, _, _ in earlier if p[:level + 1] == path[:level + 1])
        for level in range(len(path)))
    for p, c, slot in earlier:
        for level in range(min(len(p), len(path))):
            if p[:level] != path[:level]:
                break
            if p[level][0] == path[level][0] and p[level][1] != path[level][1]:
                if c[level] == counts[level]:
                    return counts, slot
                break
    return counts, None


def number_in_program(ctx: Any, site: S) -> NumberedSite[S]:
    """Notes ``site`` among the sites of the program being lowered (lowering follows trace order).

    Called by the streaming lowering with the lowering context of the sow; returns what the host
    callback calls to get the site under its final name. Sites of one name in sibling branches
    of a cond/switch are one occurrence, as ``save_intermediates`` unites them.
    """
    program = jc.module_state(ctx)
    path = program.pop(("branch_path", site), None) or ()
    names = program.pop(("numbering", site), None)
    earlier = program.setdefault((site.name, site.mode), [])
    modes = program.setdefault(("modes", site.name), {})
    slots = modes.setdefault(site.mode, [0])
    counts, slot = _occurrence(earlier, path)
    if slot is None:
        slot = slots[0]
        slots[0] += 1
        if slot == 1:
            warn_repeated(site.name)
    earlier.append((path, counts, slot))
    return NumberedSite(site, slot, modes, names)


def note_branches(ctx: Any, site: Site, names: ProgramNames | None = None) -> None:
    """Notes which cond/switch branches enclose ``site`` (for :func:`number_in_program`), and
    the names its program settled (``sowtel.jit``'s, see :class:`ProgramNames`)."""
    program = jc.module_state(ctx)
    program[("branch_path", site)] = jc.branch_path(ctx)
    if names is not None:
        program[("numbering", site)] = names
