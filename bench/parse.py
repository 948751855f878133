"""The openai SDK's ``.parse()`` against a running server: how many answers come back as the pydantic model.

Contract: ``python -m bench.parse --base-url URL`` sends each held-out AlpacaEval and chat prompt (``--limit`` of
each) through ``client.chat.completions.parse`` with ``response_format`` a 3-field pydantic model (``--model``:
``Label``, three short fields, or ``Answer``, a free-text answer; no length bounds: the strict schema the SDK
derives from it), ``max_tokens`` 96, the server's default temperature
and a seed per prompt. It prints per prompt whether the reply parsed (else why: the length limit, or a refusal
to parse) and its completion tokens, then the totals as JSON (``--json`` writes them). Start the server first
(``make serve``); nothing here was tuned on these prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import openai
from pydantic import BaseModel

from bench.datasets import load_split


class Answer(BaseModel):
    """A free-text reply with a number: the ``answer`` string is as long as the model makes it."""

    topic: str
    answer: str
    confidence: float


class Label(BaseModel):
    """Short fields, as the issue's ``City`` (a name, a category, a number)."""

    topic: str
    category: str
    difficulty: int


MODELS: dict[str, tuple[type[BaseModel], str]] = {
    "answer": (Answer, "Reply in JSON with a topic, a short answer and your confidence between 0 and 1.\n\n"),
    "label": (Label, "Reply in JSON with the request's topic, its category and its difficulty from 1 to 5.\n\n"),
}


def request_text(spec) -> str:
    """The prompt's last user text (a chat prompt's) or its text."""
    return spec.text if spec.messages is None else spec.messages[-1]["content"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 (the report says how many parsed)."""
    parser = argparse.ArgumentParser(prog="python -m bench.parse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--api-key", default="none", help="the server's key, if it has one")
    parser.add_argument("--limit", type=int, default=12, help="held-out prompts of each set (12)")
    parser.add_argument("--max-tokens", type=int, default=96, help="max_tokens per request (96)")
    parser.add_argument("--model", choices=sorted(MODELS), default="label",
                        help="label: three short fields (default); answer: a free-text answer field")
    parser.add_argument("--json", help="write the rows and totals here")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    response_format, instruction = MODELS[args.model]
    rows = []
    for name in ("alpacaeval", "chat"):
        for spec in load_split(name, "heldout", args.limit):
            row = {"set": name, "id": spec.id, "seed": len(rows)}
            try:
                completion = client.chat.completions.parse(
                    model=model, messages=[{"role": "user", "content": instruction + request_text(spec)}],
                    response_format=response_format, max_tokens=args.max_tokens, seed=row["seed"])
                row |= {"parsed": completion.choices[0].message.parsed is not None,
                        "tokens": completion.usage.completion_tokens}
            except openai.LengthFinishReasonError as error:
                row |= {"parsed": False, "tokens": error.completion.usage.completion_tokens, "why": "length"}
            except ValueError as error:  # pydantic's validation error: JSON that does not fit the model
                row |= {"parsed": False, "why": type(error).__name__}
            rows.append(row)
            print(*(f"{key}={value}" for key, value in row.items()), flush=True)
    totals = {"prompts": len(rows), "parsed": sum(row["parsed"] for row in rows),
              "by_set": {name: sum(row["parsed"] for row in rows if row["set"] == name)
                         for name in ("alpacaeval", "chat")}}
    print(json.dumps(totals, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "totals": totals}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
