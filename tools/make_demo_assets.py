"""Write the demo tokenizer and the demo SFT data set used by the quickstart and the CPU tests.

    python tools/make_demo_assets.py               # writes recipes/demo/{tokenizer,data}
    python tools/make_demo_assets.py --out /tmp/x  # writes /tmp/x/{tokenizer,data}

The task is *word-list reversal*: the user gives 3 distinct words out of 48 and the assistant
answers "Reversed: " followed by the same words in reverse order. The answer is exactly checkable
(compare strings), and the tiny quickstart MoE (2 layers, 8 experts, hidden 128) learns it on CPU
within a few hundred steps; less signal per step (a lower lr, fewer conversations per step) learns
slower (the runs: docs/log.md). A conversation averages 43 tokens, so pack_length 512 holds ~12
of them.

Why exactly 3 words: each answer word then sits at a fixed distance from its source word, which
rotary attention learns quickly. With 3-4 words the model needs an induction-style circuit, which
did not form within 300 steps; plain copying of 3-5 words did not either (docs/log.md).

Why "Reversed: " precedes the words: every word then carries the same leading space ("Ġcat") in
the prompt and in the answer, so the model copies tokens instead of also learning a second,
space-less spelling for the first word.

Everything is derived from `--seed` with `random.Random`, and the BPE trainer is deterministic,
so rerunning the script reproduces the committed files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Short lowercase words: the BPE below learns each as a single token. 48 words rather than ~100:
# each word is then seen ~230 times per epoch and the copy circuit forms within ~200 steps
# (92 words learned far less by step 300: docs/log.md).
WORDS = (
    "ant apple bell bird boat book bus cake cat cloud cow cup desk dog door drum duck egg "
    "fish fox frog goat hat horse key king kite lake lamp leaf lion map milk moon nest owl "
    "pen pig rain ring rock rose ship shoe star sun tree wolf"
).split()
N_WORDS_PER_LIST = 3

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You follow instructions exactly.",
    "Answer with the reversed list only.",
)

# Several phrasings so the model must read the words, not memorise one prompt string.
PHRASINGS = (
    "Reverse these words: {words}",
    "Reverse: {words}",
    "Please reverse the order of: {words}",
    "Say the words backwards: {words}",
)

# Plain text added to the tokenizer's training corpus (not to the SFT data) so the vocabulary also
# covers ordinary prose, digits and punctuation, as a real tokenizer's would; tests and users can
# then type arbitrary text without it falling apart into single bytes.
TOKENIZER_EXTRA_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?",
    "This is a small demo tokenizer for supervised fine-tuning of mixture-of-experts models.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Symbols: ( ) [ ] { } < > = + - * / % # @ & ! ?",
    "The model reads a question and writes an answer; the loss counts only the answer tokens.",
    "Each expert is a small feed-forward network, and the router sends every token to two experts.",
    "Training runs for a few hundred steps on a laptop and the accuracy on held-out prompts rises.",
    "def main():\n    print('hello')\n    return 0\n",
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML. The assistant's content and its <|im_end|> sit inside {% generation %} so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly the tokens the
# model must learn to produce; the newline after <|im_end|> is outside (never generated).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

N_TRAIN = 3000
N_EVAL = 200
VOCAB_SIZE = 1024  # an upper bound: merges run out first (~600 tokens)


def make_exchange(rng: random.Random) -> tuple[tuple[str, ...], str, str]:
    """One user request and its exact answer.

    The first item, the sorted word set, is the key for held-out-ness: no eval word set appears
    in training in any order, so eval measures reversal, not recall of a seen triple.
    """
    words = rng.sample(WORDS, N_WORDS_PER_LIST)
    user = rng.choice(PHRASINGS).format(words=" ".join(words))
    answer = "Reversed: " + " ".join(reversed(words))
    return tuple(sorted(words)), user, answer


def make_row(rng: random.Random, forbidden: set[tuple[str, ...]]) -> tuple[dict, list[tuple[str, ...]]]:
    """A conversation: 30% have a system prompt; half have 2-3 user/assistant exchanges.

    Multi-turn rows exercise the masking of later turns and give ~1.75 answers per conversation,
    i.e. more signal per step (fewer two-turn rows learned less by step 300: docs/log.md).
    """
    messages: list[dict[str, str]] = []
    if rng.random() < 0.30:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    keys = []
    for _ in range(rng.choice((2, 3)) if rng.random() < 0.5 else 1):
        key, user, answer = make_exchange(rng)
        while key in forbidden or key in keys:
            key, user, answer = make_exchange(rng)
        keys.append(key)
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}, keys


def make_split(rng: random.Random, n_rows: int, forbidden: set[tuple[str, ...]]) -> tuple[list[dict], set]:
    """`n_rows` rows whose word sets avoid `forbidden`; returns the rows and the word sets used."""
    rows, used = [], set()
    for _ in range(n_rows):
        row, keys = make_row(rng, forbidden | used)
        rows.append(row)
        used.update(keys)
    return rows, used


def tokenizer_corpus(rows: list[dict]) -> list[str]:
    """Training text for BPE: the conversations without special tokens.

    Special tokens are added to the vocabulary separately; keeping them out of the corpus keeps
    merges like "|>" from being learnt from their spelling.
    """
    texts = ["".join(f"{m['role']}\n{m['content']}\n" for m in row["messages"]) for row in rows]
    # Twice, because BpeTrainer(min_frequency=2) ignores pairs seen once.
    return texts + list(TOKENIZER_EXTRA_TEXT) * 2


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer, no normalizer) wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    # No ByteLevel post-processor: its trim_offsets would shrink offsets of "Ġword" tokens and
    # break the character → token mapping used for assistant masks.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",  # ends an assistant turn: generation stops here
        pad_token="<|endoftext|>",  # padding and end of a plain document
        extra_special_tokens=["<|im_start|>"],
        model_max_length=1024,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build(out: Path, seed: int) -> None:
    rng = random.Random(seed)
    # Eval first, then train avoiding every eval word set: held-out prompts are unseen.
    eval_rows, eval_keys = make_split(rng, N_EVAL, set())
    train_rows, _ = make_split(rng, N_TRAIN, eval_keys)
    write_jsonl(out / "data" / "train.jsonl", train_rows)
    write_jsonl(out / "data" / "eval.jsonl", eval_rows)
    tok = train_tokenizer(tokenizer_corpus(train_rows), VOCAB_SIZE)
    tok.save_pretrained(str(out / "tokenizer"))
    print(f"wrote {len(train_rows)} train / {len(eval_rows)} eval rows and a {len(tok)}-token tokenizer to {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).resolve().parent.parent / "recipes" / "demo"
    parser.add_argument("--out", type=Path, default=default_out, help="output directory (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1234, help="seed for the data generator")
    args = parser.parse_args(argv)
    build(args.out, args.seed)


if __name__ == "__main__":
    main()
