#!/usr/bin/env python3
"""Makes tests/fixtures/tokenizer: a small byte-level BPE tokenizer with ChatML special tokens in
three Hugging Face tokenizer directories that differ in their chat template, sample JSON lines,
and what transformers makes of them (expected.json), for tests/test_data.cpp's checks of
scripts/tokenize_data.py.

  chatml/     a ChatML template without marks: tokenize_data finds the assistant turns by
              rendering prefixes
  marked/     the same text with {% generation %} marks around each reply and its end of turn
  reasoning/  drops <think>...</think> from assistant turns before the last user message (as
              Qwen3's template does with reasoning): prefixes cannot find the turns, --per-turn
              makes a document per assistant turn
  reasoning_marked/  the same with {% generation %} marks (the reference for --per-turn)

expected.json holds, per sample line, transformers' ids (apply_chat_template(tokenize=True) for
chat lines, tokenizer(text) + EOS for text lines) and the assistant mask transformers returns for
the marked template (return_assistant_tokens_mask): tokenize_data must give the same ids for every
template that renders the same text and that mask for chatml and marked alike. Per chat line,
`per_turn` holds the reasoning template's documents for --per-turn: for each assistant turn,
transformers' ids of the conversation up to it and reasoning_marked's assistant mask limited to
the tokens past the conversation before it (with the generation prompt).

    pip install tokenizers==0.23.3 transformers==4.57.1   (no torch needed)
    scripts/make_tokenizer_fixture.py tests/fixtures/tokenizer
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TURN_START = "{{ '<|im_start|>' + message['role'] + '\\n' }}"
GEN_PROMPT = ("{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}" + TURN_START +
        "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}" + GEN_PROMPT),
    "marked": (
        "{% for message in messages %}" + TURN_START +
        "{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
        "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}" + GEN_PROMPT),
}
REASONING = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}" + TURN_START +
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.index0 < ns.last_user "
    "and '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip() %}"
    "{% endif %}{% if message['role'] == 'assistant' %}OPEN{{ content + '<|im_end|>\\n' }}CLOSE"
    "{% else %}{{ content + '<|im_end|>\\n' }}{% endif %}{% endfor %}" + GEN_PROMPT)
TEMPLATES["reasoning"] = REASONING.replace("OPEN", "").replace("CLOSE", "")
TEMPLATES["reasoning_marked"] = (REASONING.replace("OPEN", "{% generation %}")
                                 .replace("CLOSE", "{% endgeneration %}"))

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-experts models route each token to a few experts.",
    "Expert parallelism places experts on different GPUs; tokens travel to them.",
    "Fully sharded data parallelism gathers parameters before each layer.",
    "You are a helpful assistant. Answer briefly and correctly.",
    "What is the capital of France? The capital of France is Paris.",
    "<think>The user asks for a sum.</think> Two plus two is four.",
    "Ünïcödé: naïve café, 東京, emoji 🙂 and tabs\tand\nnewlines.",
]

SAMPLES = [
    {"text": "Experts learn to specialise when the router balances their load."},
    {"text": "東京 and naïve café 🙂"},
    {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."}]},
    {"messages": [
        {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, 🙂"}]},
    {"messages": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>Short.</think> Done."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "<think>Still short.</think> Done again."}]},
]
# Line 5 has reasoning before the last user message: the reasoning template rewrites it.
REWRITTEN_LINE = 5


def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def main():
    out = sys.argv[1]
    tok = build_tokenizer()
    for name, template in TEMPLATES.items():
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                       "pad_token": "<|endoftext|>", "model_max_length": 4096,
                       "chat_template": template}, f, indent=2)
    with open(os.path.join(out, "samples.jsonl"), "w") as f:
        for s in SAMPLES:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")

    from transformers import AutoTokenizer
    hf = {name: AutoTokenizer.from_pretrained(os.path.join(out, name)) for name in TEMPLATES}
    expected = []
    for line, s in enumerate(SAMPLES, 1):
        if "text" in s:
            ids = hf["chatml"](s["text"])["input_ids"] + [hf["chatml"].eos_token_id]
            expected.append({"line": line, "ids": ids})
            continue
        ids = hf["chatml"].apply_chat_template(s["messages"], tokenize=True)
        marked = hf["marked"].apply_chat_template(s["messages"], tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True)
        assert marked["input_ids"] == ids, "the marked template must render chatml's text"
        per_turn = []
        for i, m in enumerate(s["messages"]):
            if m["role"] != "assistant":
                continue
            upto = hf["reasoning_marked"].apply_chat_template(
                s["messages"][: i + 1], tokenize=True, return_dict=True,
                return_assistant_tokens_mask=True)
            assert upto["input_ids"] == hf["reasoning"].apply_chat_template(
                s["messages"][: i + 1], tokenize=True)
            before = len(hf["reasoning"].apply_chat_template(
                s["messages"][:i], tokenize=True, add_generation_prompt=True))
            mask = [v if k >= before else 0 for k, v in enumerate(upto["assistant_masks"])]
            per_turn.append({"ids": upto["input_ids"], "mask": mask})
        expected.append({"line": line, "ids": ids, "assistant_mask": marked["assistant_masks"],
                         "per_turn": per_turn, "reasoning_rewrites": line == REWRITTEN_LINE})
    with open(os.path.join(out, "expected.json"), "w") as f:
        f.write('{"made_by": "transformers %s", "samples": [\n' %
                __import__("transformers").__version__)
        f.write(",\n".join(json.dumps(e) for e in expected) + "\n]}\n")
    print(f"wrote {out}: {len(SAMPLES)} samples, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
