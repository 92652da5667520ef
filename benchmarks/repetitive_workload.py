"""A workload that repeats itself, for speculative decoding: code edits that copy most of their
input, extraction that quotes its input as JSON, and an agent transcript whose next tool call
repeats earlier ones. Written as `vllm bench serve`'s custom dataset (JSON lines of `prompt`
and `output_tokens`); every text here is original and deterministic.

    python -m benchmarks.repetitive_workload --out benchmarks/data/repetitive.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

CODE = [
    '''def load_orders(path):
    orders = []
    with open(path) as handle:
        for line in handle:
            fields = line.strip().split(",")
            orders.append({"id": int(fields[0]), "total": float(fields[1]), "city": fields[2]})
    return orders


def total_by_city(orders):
    totals = {}
    for order in orders:
        totals[order["city"]] = totals.get(order["city"], 0.0) + order["total"]
    return totals
''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def report(self):
        return sorted(self.items.items())
''',
    '''def parse_duration(text):
    units = {"s": 1, "m": 60, "h": 3600}
    number = ""
    seconds = 0
    for char in text:
        if char.isdigit():
            number += char
        else:
            seconds += int(number) * units[char]
            number = ""
    return seconds
''',
    '''def merge_intervals(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''',
]
EDITS = [("orders", "records"), ("items", "stock"), ("seconds", "total"), ("merged", "result")]

PASSAGES = [
    ("The museum opened three new rooms this spring. The first shows river maps drawn by hand. The second "
     "holds ceramic bowls from coastal villages. The third is a reading room with old ship logs. Visitors "
     "can book a guided tour on weekends, and school groups enter free on Tuesdays.", "rooms"),
    ("Our team ships four services: the billing service sends invoices, the search service indexes product "
     "pages, the mail service delivers receipts, and the report service builds the monthly summary. Each "
     "service writes its logs to the shared bucket and pages the on-call engineer when it fails.", "services"),
    ("The recipe needs two cups of flour, one cup of warm milk, three eggs, a spoon of sugar and a pinch of "
     "salt. Whisk the eggs with the milk, fold in the flour, rest the batter for ten minutes, then cook thin "
     "pancakes in a hot pan with a little butter.", "ingredients"),
    ("The station reported the following readings at noon: temperature 21 degrees, humidity 64 percent, wind "
     "from the north-west at 12 kilometres per hour, pressure 1014 hectopascals, and no rain in the last "
     "six hours. The evening readings will be posted at six.", "readings"),
]

TRANSCRIPT_FILES = ["src/app.py", "src/models.py", "src/views.py", "tests/test_app.py", "tests/test_models.py"]


def code_edit(code: str, old: str, new: str) -> str:
    return (f"Rename every `{old}` to `{new}` in this Python code. Reply with the whole code and nothing "
            f"else.\n\n```python\n{code}```")


def extraction(passage: str, field: str) -> str:
    return (f"Read the text and list the {field} it names, each copied word for word from the text, as a "
            f'JSON object {{"{field}": [...]}}. Then quote the whole text again under "source".\n\nText: {passage}')


def agent_turn(index: int) -> str:
    lines = ["You are a coding agent. Each turn, call the tool exactly as in earlier turns, for the next file.",
             "Tool: read_file(path) returns the file's text.", ""]
    for path in TRANSCRIPT_FILES[:index]:
        call = json.dumps({"tool": "read_file", "arguments": {"path": path, "start_line": 1, "end_line": 200}})
        lines += [f"Assistant: {call}", f"Tool result: (200 lines of {path})"]
    lines.append(f"User: now read {TRANSCRIPT_FILES[index]} the same way, then the remaining files one per line.")
    return "\n".join(lines)


def workload() -> list[dict]:
    items = [{"prompt": code_edit(code, old, new), "output_tokens": 256} for code, (old, new) in zip(CODE, EDITS)]
    items += [{"prompt": extraction(passage, field), "output_tokens": 256} for passage, field in PASSAGES]
    items += [{"prompt": agent_turn(i), "output_tokens": 192} for i in range(2, 5)]
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/data/repetitive.jsonl")
    args = parser.parse_args()
    lines = [json.dumps(item) for item in workload()]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
