"""Drawing a composite strategy whose arguments change with every call, without building a strategy each time
(issue 51: the campaign's own time per example).

``draw(shared_prefixes(table, ctx_lens, block_size))`` builds a new strategy on every batch (a lazy strategy
around a composite one, since its arguments are this batch's lists), and Hypothesis validates a strategy the first
time it is drawn from: it computes whether it is empty and whether its values are reusable by a fixed-point pass
over it, which costs more than the draw (~0.15 ms of a small example's ~1.2 ms draw on a 2-core CPU).
:func:`per_call` gives the same draw for the cost of one small object: a strategy already validated (a composite is
never empty, its values never reusable: what Hypothesis computes for one) that starts the composite's span, with
the composite's label, and runs the composite's function with ``draw`` and the arguments. The choices, the spans and
their labels are those of the composite (tests/strategies/test_per_call.py compares them), so a seed draws the same
examples and Hypothesis's mutator, which groups spans by label, picks the same groups.
"""

from __future__ import annotations

from typing import Any, Callable

from hypothesis.strategies import SearchStrategy
from hypothesis.strategies._internal.core import CompositeStrategy
from hypothesis.strategies._internal.lazy import unwrap_strategies


class PerCall(SearchStrategy):
    """One call of a composite's function: ``definition(draw, *args, **kwargs)`` inside a span labeled ``label``
    (the composite's), validated from the start."""

    #: a composite is never empty and never has reusable values (CompositeStrategy does not override
    #: SearchStrategy's calc_is_empty / calc_has_reusable_values, both False): read by Hypothesis's
    #: recursive_property before it computes anything
    force_is_empty = False
    force_has_reusable_values = False

    def __init__(self, definition: Callable, label: int, args: tuple, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.definition, self._per_call_label, self.args, self.kwargs = definition, label, args, kwargs

    def validate(self) -> None:  # nothing to validate: the arguments are the function's, as a composite's
        return None

    def calc_label(self) -> int:
        return self._per_call_label

    def do_draw(self, data):
        return self.definition(data.draw, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"per_call({self.definition.__name__})"


def per_call(composite: Callable[..., SearchStrategy], *example_args: Any) -> Callable[..., SearchStrategy]:
    """``composite`` (a function decorated with ``@st.composite``) as a factory of :class:`PerCall` strategies;
    ``example_args``: any arguments its signature accepts (the composite is built once from them, never drawn, to
    read its function and label). Raises TypeError where ``composite`` does not build a composite strategy."""
    inner = unwrap_strategies(composite(*example_args))
    if not isinstance(inner, CompositeStrategy):
        raise TypeError(f"per_call: {composite!r} does not build a composite strategy")
    definition, label = inner.definition, inner.label

    def build(*args: Any, **kwargs: Any) -> PerCall:
        return PerCall(definition, label, args, kwargs)

    build.__name__ = build.__qualname__ = getattr(composite, "__name__", "per_call")
    build.__module__ = getattr(composite, "__module__", __name__)  # it lives where the composite does
    build.__doc__ = composite.__doc__
    return build


__all__ = ["PerCall", "per_call"]
