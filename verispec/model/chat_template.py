"""Rendering a model's chat template (Jinja2), the way Hugging Face transformers does.

Templates come from checkpoints, so they are untrusted code: they run in Jinja's immutable
sandbox. The environment matches transformers' (trim_blocks, lstrip_blocks, loop controls, a
`tojson` that does not escape HTML, `raise_exception`, `strftime_now`) so that templates written
for it render the same here.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
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


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                **variables: Any) -> str:
    """Render `messages` (each a dict with at least 'role' and 'content') into a prompt.

    Extra keyword variables (bos_token, eos_token, tools, ...) are passed to the template."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(f"messages={messages!r} is invalid: expected a list of dicts, each with "
                         f"'role' and 'content'")
    return _compile(template).render(messages=messages,
                                     add_generation_prompt=add_generation_prompt, **variables)
