#!/usr/bin/env python3
"""Tokenizes JSON lines of text or chat messages into a moetrain token file (docs/data_format.md).

    scripts/tokenize_data.py --tokenizer Qwen3-30B-A3B/ --input data.jsonl --output data.tok

Each input line is a document:
  {"text": "..."}                              pre-training: every token counts, EOS appended
  {"messages": [{"role": ..., "content": ...}]} chat (SFT): rendered with the tokenizer's chat
                                               template, only the assistant turns' tokens count
A file with any chat line is written with a loss mask (text lines then count every token).

The tokenizer directory is a Hugging Face one: tokenizer.json, and tokenizer_config.json with the
chat template and special tokens (or the template in chat_template.jinja). The template is
rendered as transformers' apply_chat_template renders it (a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, loop controls, tojson, raise_exception, strftime_now, the special
tokens as variables) and the text is tokenized without adding special tokens, so the ids are
apply_chat_template's. The assistant tokens are found one of two ways:
  - the template marks them with {% generation %} ... {% endgeneration %} (transformers'
    return_assistant_tokens_mask): exactly those characters count;
  - otherwise, for each assistant message i, the characters that rendering messages[:i+1] adds to
    rendering messages[:i] with the generation prompt: the reply and its end-of-turn tokens.
    This needs each rendering to be a prefix of the next; a template that rewrites earlier turns
    (Qwen3's drops the reasoning of turns before the last user message) fails that check for
    multi-turn conversations with reasoning, and the line is refused with that explanation.
    --per-turn handles those: each assistant turn becomes its own document, the conversation up
    to it rendered as the template renders it when that turn is last, only that turn counting
    (what the model sees when it writes the turn).
A token counts when its characters overlap an assistant span.

Errors name the input line and exit with code 3 (moetrain's code for bad data); no output file is
left behind. Needs the Python packages `tokenizers` and `jinja2` (scripts/setup.sh installs them,
pinned, into .deps/python).
"""
import argparse
import json
import os
import sys
from datetime import datetime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
_DEPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".deps", "python")
if os.path.isdir(_DEPS):
    sys.path.insert(0, _DEPS)

from moetrain_tokens import TokenFileWriter  # noqa: E402

EXIT_DATA = 3


class DataError(Exception):
    pass


def special_token(value):
    """tokenizer_config.json holds a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class ChatTemplate:
    """A chat template compiled as transformers compiles it."""

    def __init__(self, source, special_tokens):
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = self

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                call = self.call_method("_mark", [])
                return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

            def _mark(self, caller):
                text = caller()
                if template._chunks is not None:
                    start = sum(len(c) for c in template._chunks)
                    template._spans.append((start, start + len(text)))
                return text

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.has_generation_marks = "generation" in source and "endgeneration" in source
        self._template = env.from_string(source)
        self._special = special_tokens
        self._chunks = None
        self._spans = []

    def render(self, messages, add_generation_prompt=False):
        """The text, and the character spans inside {% generation %} blocks."""
        self._chunks, self._spans = [], []
        try:
            for chunk in self._template.generate(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **self._special):
                self._chunks.append(chunk)
            return "".join(self._chunks), list(self._spans)
        finally:
            self._chunks = None


class Tokenizer:
    def __init__(self, directory):
        from tokenizers import Tokenizer as HfTokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"{directory}: no tokenizer.json (a Hugging Face tokenizer directory)")
        self.tok = HfTokenizer.from_file(path)
        config = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
        special = {k: special_token(config.get(k))
                   for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                             "cls_token", "mask_token")}
        for name in config.get("additional_special_tokens") or []:
            special.setdefault("additional_special_tokens", []).append(special_token(name))
        self.eos_id = None
        if special["eos_token"] is not None:
            self.eos_id = self.tok.token_to_id(special["eos_token"])
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: transformers takes "default"
            source = {t["name"]: t["template"] for t in source}.get("default")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                source = f.read()
        self.template = ChatTemplate(source, special) if source else None

    def encode(self, text, add_special_tokens):
        e = self.tok.encode(text, add_special_tokens=add_special_tokens)
        return e.ids, e.offsets


def assistant_spans(template, messages, last_only=False):
    """The rendering of `messages` and its character spans that the loss counts: every assistant
    turn's, or the last message's."""
    text, marked = template.render(messages)
    if template.has_generation_marks:
        return text, marked[-1:] if last_only else marked
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant" or (last_only and i + 1 < len(messages)):
            continue
        before, _ = template.render(messages[:i], add_generation_prompt=True)
        upto, _ = template.render(messages[: i + 1])
        if not upto.startswith(before) or not text.startswith(upto):
            raise DataError(
                f"message {i}: the chat template renders the conversation up to this assistant "
                "turn differently from the whole conversation (it rewrites earlier turns, as "
                "Qwen3's does with the reasoning of turns before the last user message), so the "
                "assistant's tokens cannot be found by rendering prefixes; use --per-turn (a "
                "document per assistant turn) or a template with {% generation %} marks")
        spans.append((len(before), len(upto)))
    return text, spans


def tokens_and_mask(tokenizer, text, spans):
    ids, offsets = tokenizer.encode(text, add_special_tokens=False)
    mask = [int(any(s < b and a < e for s, e in spans)) for a, b in offsets]
    if not any(mask[1:]):  # a document's first token is never a target
        raise DataError("no assistant token is a target (the assistant turns render empty)")
    return ids, mask


def chat_documents(tokenizer, messages, per_turn):
    """[(ids, mask)]: one document, or with per_turn one per assistant turn."""
    if tokenizer.template is None:
        raise DataError("a chat line, and the tokenizer has no chat template")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise DataError('"messages" must be a list of objects with a "role"')
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("the conversation has no assistant turn: nothing would count")
    if not per_turn:
        return [tokens_and_mask(tokenizer, *assistant_spans(tokenizer.template, messages))]
    docs = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        docs.append(tokens_and_mask(
            tokenizer, *assistant_spans(tokenizer.template, messages[: i + 1], last_only=True)))
    return docs


def text_document(tokenizer, text, eos):
    if not isinstance(text, str) or not text:
        raise DataError('"text" must be a non-empty string')
    ids, _ = tokenizer.encode(text, add_special_tokens=True)
    if eos and tokenizer.eos_id is not None and (not ids or ids[-1] != tokenizer.eos_id):
        ids.append(tokenizer.eos_id)
    if not ids:
        raise DataError("the text tokenizes to nothing")
    return ids


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    p.add_argument("--input", required=True, help="JSON lines: {text} or {messages}")
    p.add_argument("--output", required=True, help="the token file to write")
    p.add_argument("--no-eos", action="store_true", help="do not end text documents with EOS")
    p.add_argument("--per-turn", action="store_true",
                   help="a document per assistant turn (templates that rewrite earlier turns)")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="refuse ids >= this (the model's vocab_size)")
    a = p.parse_args()
    try:
        tokenizer = Tokenizer(a.tokenizer)
        # One pass to learn whether the file needs a loss mask (any chat line).
        chat = False
        for number, line in read_lines(a.input):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{a.input}:{number}: not JSON: {e}")
            if not isinstance(item, dict) or ("text" in item) == ("messages" in item):
                raise DataError(f'{a.input}:{number}: expected an object with "text" or '
                                f'"messages" (one of them)')
            chat = chat or "messages" in item
        counted = 0
        with TokenFileWriter(a.output, loss_mask=chat) as w:
            for number, line in read_lines(a.input):
                item = json.loads(line)
                try:
                    if "messages" in item:
                        docs = chat_documents(tokenizer, item["messages"], a.per_turn)
                    else:
                        docs = [(text_document(tokenizer, item["text"], not a.no_eos), None)]
                except DataError as e:
                    raise DataError(f"{a.input}:{number}: {e}")
                for ids, mask in docs:
                    if a.vocab_size and max(ids) >= a.vocab_size:
                        raise DataError(f"{a.input}:{number}: token id {max(ids)} >= "
                                        f"--vocab-size {a.vocab_size}")
                    w.add(ids, mask)
                    counted += sum(mask[1:]) if mask else len(ids) - 1
            if w.num_docs == 0:
                raise DataError(f"{a.input}: no documents")
    except (DataError, OSError, ValueError) as e:
        print(f"tokenize_data: {e}", file=sys.stderr)
        sys.exit(EXIT_DATA)
    print(json.dumps({"output": a.output, "documents": w.num_docs, "tokens": w.num_tokens,
                      "counted_targets": counted, "loss_mask": chat}))


if __name__ == "__main__":
    main()
