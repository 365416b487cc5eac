"""One streaming client of bench/serve_profile.py, in its own process (a real client does not
share the server's interpreter): requests c, c + clients, ... back to back, greedy, printing one
JSON line per request with the time.monotonic of its start and of every content chunk's arrival.

    python bench/serve_client.py URL CLIENT_INDEX CLIENTS REQUESTS MAX_TOKENS
"""

from __future__ import annotations

import json
import sys
import time

import openai

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain what a hash table is in two sentences.",
    "Give three tips for learning a new language.",
    "List the planets of the solar system in order.",
]


def main() -> None:
    url, index, clients, requests, max_tokens = sys.argv[1], *map(int, sys.argv[2:6])
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    for i in range(index, requests, clients):
        start = time.monotonic()
        arrivals = []
        tokens = 0
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        print(json.dumps({"start": start, "arrivals": arrivals, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
