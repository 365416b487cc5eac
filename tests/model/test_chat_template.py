"""Chat templates render as in transformers, and a crafted template cannot hang or exhaust the
process: every limit fails with a ValueError naming the chat template and the limit."""

from __future__ import annotations

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from verispec.model import chat_template
from verispec.model.chat_template import CHATML_TEMPLATE, render_chat

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
# Meta-Llama-3-8B-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Loops with loop variables, macros, namespaces, filters and whitespace control.
FEATURES_TEMPLATE = (
    "{% macro turn(m) %}[{{ m.role | upper }}]{{ m.content }}{% endmacro %}"
    "{% set ns = namespace(n=0) %}{% for m in messages if m.role != 'system' %}"
    "{{ loop.index }}/{{ loop.length }}{{ turn(m) }}{% set ns.n = ns.n + 1 %}"
    "{% if loop.last %}|{% endif %}{% endfor %}\n  {%- for i in range(3) %}{{ i }}{% endfor %}"
    "{{ ns.n }}{{ messages | map(attribute='content') | join(',') }}{{ messages[0] | tojson }}"
)


def _plain_render(template: str) -> str:
    # Jinja's sandbox as transformers configures it, without verispec's limits.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = chat_template._tojson
    return env.from_string(template).render(messages=MESSAGES, add_generation_prompt=True,
                                            bos_token="<s>")


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA3_TEMPLATE, FEATURES_TEMPLATE],
                         ids=["chatml", "llama3", "features"])
def test_limits_do_not_change_what_a_template_renders(template) -> None:
    assert render_chat(template, MESSAGES, True, bos_token="<s>") == _plain_render(template)


def test_smollm2_template_renders_as_without_limits(embedded) -> None:
    template = embedded[1].chat_template
    assert "im_start" in template
    assert render_chat(template, MESSAGES, True, bos_token="<s>") == _plain_render(template)


@pytest.mark.parametrize("template,expected", [
    ("{{ 'a' * 4000000000 }}", "'\\*' would build a sequence of 4000000000 items: the limit is 1000000"),
    ("{{ [0] * 2000000 }}", "sequence of 2000000 items"),
    ("{% set s = 'a' * 600000 %}{{ s + s }}", "'\\+' would build a sequence of 1200000 items"),
    ("{{ 2 ** 100000000 }}", "would have more than"),
    ("{% for i in range(100000) %}{% endfor %}", r"range\(100000,\) has 100000 items: the limit is 10000"),
    ("{% for i in range(10000) %}{{ 'a' * 1000 }}{% endfor %}", "output exceeds the limit of 4000000"),
    ("{% set s = 'a' * 1000000 %}{% macro f() %}{% for i in range(10) %}{{ s }}{% endfor %}"
     "{% endmacro %}{{ f() | length }}", "output exceeds the limit"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ raise_exception('roles must alternate') }}", "TemplateError: roles must alternate"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for %}", "TemplateSyntaxError"),
])
def test_violations_name_the_chat_template_and_the_limit(template, expected) -> None:
    with pytest.raises(ValueError, match=f"the chat template failed: .*{expected}"):
        render_chat(template, MESSAGES, True)


@pytest.mark.parametrize("template", [
    # Nested loops that write nothing: only the deadline can stop them.
    "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
    # Exponentially many macro calls, no loop and no output.
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    # Nested loops over a string.
    "{% set s = 'ab' * 50000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
])
def test_rendering_stops_at_the_deadline(template, monkeypatch) -> None:
    monkeypatch.setattr(chat_template, "DEADLINE_S", 0.2)
    with pytest.raises(ValueError, match=r"the chat template failed: .*longer than the limit of 0.2 s"):
        render_chat(template, MESSAGES, True)


def test_each_rendering_gets_a_fresh_budget() -> None:
    template = "{% for i in range(3000) %}{{ 'a' * 1000 }}{% endfor %}"  # 3 MB of the 4 MB limit
    assert render_chat(template, MESSAGES, True) == render_chat(template, MESSAGES, True)
