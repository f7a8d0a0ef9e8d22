"""Write ShareGPT's assistant answers as a plain-text corpus: one ``{"id", "text"}`` JSON line per conversation,
its answers joined by blank lines (ids kept, so the held-out split of the documents is the held-out split of the
conversations). The corpus the Gemma 3 270M base's heads train on, and the source of the frozen document-continuation
prompt set (benchmarks/prompts/documents-held-out.jsonl).

    .venv/bin/python scripts/sharegpt_text.py --out data/sharegpt-text.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from train.data import load_conversations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="sharegpt", help="chat dataset (as for medusa train --data)")
    parser.add_argument("--out", required=True, help="JSON-lines file to write")
    parser.add_argument("--min-chars", type=int, default=200, help="leave out shorter documents")
    args = parser.parse_args()
    convs, _ = load_conversations(args.data)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for conv in convs:
            text = "\n\n".join(m["content"].strip() for m in conv.messages if m["role"] == "assistant")
            if len(text) >= args.min_chars:
                f.write(json.dumps({"id": conv.id, "text": text}, ensure_ascii=False) + "\n")
                written += 1
    print(f"wrote {written} documents to {args.out}")


if __name__ == "__main__":
    main()
