"""Rendering a model's chat template (Jinja2), the way Hugging Face transformers does.

Templates come from checkpoints, so they are untrusted code: they run in Jinja's immutable
sandbox. The environment matches transformers' (trim_blocks, lstrip_blocks, loop controls, a
`tojson` that does not escape HTML, `raise_exception`, `strftime_now`) so that templates written
for it render the same here.

The sandbox stops a template from touching the process, not from hanging or exhausting it, so
rendering is bounded too (a crafted file fails with a ValueError instead):
- range() yields at most MAX_RANGE items, and `*` / `+` build no string or list longer than
  MAX_SIZE (checked before the operation runs, so nothing huge is ever allocated);
- every piece of text a template writes, at any depth (macro bodies, {% set %} blocks, the
  final output), counts towards MAX_OUTPUT characters;
- a wall clock of DEADLINE_S seconds is checked at every loop iteration, call, operator and
  piece of output; the parsed template is rewritten so that every {% for %} and every output
  passes through those checks, which makes the bounds hold without any cooperation from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a checkpoint ships no template: ChatML, what SmolLM2 and many others speak.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


MAX_RANGE = 10_000
MAX_SIZE = 1_000_000
MAX_OUTPUT = 4_000_000
DEADLINE_S = 5.0

_LOOP_FILTER, _OUTPUT_FILTER = "verispec_bounded_loop", "verispec_counted_output"


class _Budget:
    """What one rendering may still spend: a deadline and the output characters left."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + DEADLINE_S
        self.output_left = MAX_OUTPUT

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ValueError(f"rendering took longer than the limit of {DEADLINE_S} s")


_budget: ContextVar[_Budget] = ContextVar("chat_template_budget")


def _bounded_range(*args: int) -> range:
    items = range(*args)
    if len(items) > MAX_RANGE:
        raise ValueError(f"range{args} has {len(items)} items: the limit is {MAX_RANGE}")
    return items


# pass_context keeps Jinja's optimizer from running these at compile time on constants.
@jinja2.pass_context
def _bounded_loop(_: jinja2.runtime.Context, iterable: Any) -> Iterator[Any]:
    budget = _budget.get()
    for item in iterable:
        budget.tick()
        yield item


@jinja2.pass_context
def _counted_output(_: jinja2.runtime.Context, value: Any) -> Any:
    budget = _budget.get()
    budget.tick()
    budget.output_left -= len(str(value))
    if budget.output_left < 0:
        raise ValueError(f"the output exceeds the limit of {MAX_OUTPUT} characters")
    return value


def _result_size(operator: str, left: Any, right: Any) -> int:
    """Length of the str/list/tuple that `left operator right` would build (0 for anything
    else), computed without building it."""
    sized = (str, list, tuple)
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, sized) and isinstance(times, int):
                return len(seq) * max(times, 0)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    return 0


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        _budget.get().tick()
        size = _result_size(operator, left, right)
        if size > MAX_SIZE:
            raise ValueError(f"{operator!r} would build a sequence of {size} items: the limit "
                             f"is {MAX_SIZE}")
        if (operator == "**" and isinstance(left, int) and isinstance(right, int)
                and right * abs(left).bit_length() > 8 * MAX_SIZE):
            raise ValueError(f"{left} ** {right} would have more than {8 * MAX_SIZE} bits")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any,  # noqa: N805
             **kwargs: Any) -> Any:
        _budget.get().tick()
        return super().call(__context, __obj, *args, **kwargs)


def _instrument(tree: nodes.Template) -> nodes.Template:
    """Route every loop and every output expression through the budget checks."""
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.lineno)
    for output in tree.find_all(nodes.Output):
        output.nodes = [
            node if isinstance(node, nodes.TemplateData)
            else nodes.Filter(node, _OUTPUT_FILTER, [], [], None, None, lineno=node.lineno)
            for node in output.nodes
        ]
    return tree


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters[_LOOP_FILTER] = _bounded_loop
    env.filters[_OUTPUT_FILTER] = _counted_output
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    return env.from_string(_instrument(env.parse(template)))


# What a template can make rendering raise: its own errors (raise_exception, syntax, undefined
# names, the sandbox's refusals, the limits above) and the Python errors of the operations it
# runs (1 / 0, 'a' + 1, unbounded macro recursion, ...).
_TEMPLATE_ERRORS = (jinja2.TemplateError, ArithmeticError, AttributeError, LookupError,
                    RecursionError, TypeError, ValueError)


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                **variables: Any) -> str:
    """Render `messages` (each a dict with at least 'role' and 'content') into a prompt.

    Extra keyword variables (bos_token, eos_token, tools, ...) are passed to the template.
    Raises ValueError when the template fails or exceeds a limit (see the module docstring)."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(f"messages={messages!r} is invalid: expected a list of dicts, each with "
                         f"'role' and 'content'")
    token = _budget.set(_Budget())
    try:
        return _compile(template).render(messages=messages,
                                         add_generation_prompt=add_generation_prompt, **variables)
    except _TEMPLATE_ERRORS as error:
        raise ValueError(f"the chat template failed: {type(error).__name__}: {error}") from None
    finally:
        _budget.reset(token)
