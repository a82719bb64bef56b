"""The official openai client against specd's OpenAI-compatible API: completions and chat,
streaming and not.

    python benchmarks/openai_client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--prompt", default="abcabcabc")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    chat = [{"role": "user", "content": "hi"}]
    print("models:", [m.id for m in client.models.list().data])
    r = client.completions.create(model="m", prompt=args.prompt, max_tokens=16, temperature=0)
    print("completion:", repr(r.choices[0].text), r.usage, "tau", r.model_extra["specd"]["tau"])
    r = client.chat.completions.create(model="m", messages=chat, max_tokens=16, temperature=0)
    print("chat:", repr(r.choices[0].message.content), r.choices[0].finish_reason, r.usage)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=chat, max_tokens=16, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    print("chat stream:", len(chunks), "chunks ->", repr(text))
    chunks = list(
        client.completions.create(
            model="m", prompt=args.prompt, max_tokens=16, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    print("completion stream:", len(chunks), "chunks ->", repr(text))


if __name__ == "__main__":
    main()
