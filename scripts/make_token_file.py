#!/usr/bin/env python3
"""Writes a moetrain token file (docs/data_format.md) from JSON lines of pre-tokenised documents.

Each input line is either a list of token ids, or an object {"tokens": [...], "loss_mask": [...]}
(SFT: 1 where the token is a target that counts). A file holding any loss mask is written with
one; documents without a mask then count every token.

    scripts/make_token_file.py docs.jsonl out.tok [--vocab-size V]
"""
import argparse
import json
import sys

from moetrain_tokens import TokenFileWriter


def read_documents(path, vocab_size):
    docs, masks, any_mask = [], [], False
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            tokens = item if isinstance(item, list) else item.get("tokens")
            mask = None if isinstance(item, list) else item.get("loss_mask")
            if not isinstance(tokens, list) or not tokens:
                sys.exit(f"{path}:{line_no}: expected a non-empty list of token ids")
            for t in tokens:
                if not isinstance(t, int) or t < 0 or t >= 2**32 or (vocab_size and t >= vocab_size):
                    sys.exit(f"{path}:{line_no}: token {t!r} is not an id in [0, {vocab_size or 2**32})")
            if mask is not None:
                if len(mask) != len(tokens) or any(m not in (0, 1) for m in mask):
                    sys.exit(f"{path}:{line_no}: loss_mask must be 0/1, one per token")
                any_mask = True
            docs.append(tokens)
            masks.append(mask)
    if not docs:
        sys.exit(f"{path}: no documents")
    return docs, masks, any_mask


def write(out, docs, masks, any_mask):
    with TokenFileWriter(out, loss_mask=any_mask) as w:
        for d, m in zip(docs, masks):
            w.add(d, m)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--vocab-size", type=int, default=0, help="reject ids >= this")
    a = p.parse_args()
    docs, masks, any_mask = read_documents(a.input, a.vocab_size)
    write(a.output, docs, masks, any_mask)
    print(f"wrote {a.output}: {len(docs)} documents, {sum(map(len, docs))} tokens"
          f"{', with loss mask' if any_mask else ''}")


if __name__ == "__main__":
    main()
