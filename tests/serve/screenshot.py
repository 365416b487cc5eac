"""Takes docs/web-ui.png, the README's picture of the chat page: the embedded SmolLM2 served
with prompt lookup and its shipped EAGLE head, one question answered greedily, in headless Chromium.

    .venv/bin/python -m tests.serve.screenshot [docs/web-ui.png]
"""

from __future__ import annotations

import sys
import time

from verispec import LLM

from .browser import start_chromium
from .conftest import serving

QUESTION = "Write a Python function that tells whether a number is prime, then explain it in two sentences."


def main(path: str = "docs/web-ui.png") -> None:
    # Fixed K: the page shows every step's drafts (adaptive K skips drafting where it does not pay).
    llm = LLM(draft="ngram+eagle", num_speculative_tokens=4, adaptive=False, progress=False)
    with serving(llm, "SmolLM2-135M-Instruct") as url:
        browser = start_chromium()
        try:
            browser.get(url + "/")
            browser.execute_script(
                "for (const [id, value] of Object.entries(arguments[0])) document.getElementById(id).value = value;",
                {"system": "You are a concise assistant.", "temperature": "0", "max_tokens": "200", "prompt": QUESTION})
            browser.execute_script("document.getElementById('send').click()")
            deadline = time.monotonic() + 600
            while browser.execute_script("const a = document.querySelector('.message.assistant');"
                                         "return a ? a.dataset.state : 'waiting'") in ("waiting", "streaming"):
                assert time.monotonic() < deadline, "no answer in time"
                time.sleep(0.2)
            # One step's tokens outlined, as hovering a token shows them.
            browser.execute_script("""
                const spans = [...document.querySelectorAll('.message.assistant .tok.accepted')];
                const step = spans[Math.floor(spans.length / 3)].dataset.step;
                for (const s of document.querySelectorAll(`.tok[data-step="${step}"]`)) s.classList.add('same-step');""")
            browser.save_screenshot(path)
        finally:
            browser.quit()


if __name__ == "__main__":
    main(*sys.argv[1:])
