"""Build datagen's remote-code test tokenizer: a folder shaped like Kimi K2's.

Usage: ``python -m ops.build_remote_tokenizer --out DIR``

Some target models ship no ``tokenizer.json``: their tokenizer is a Python class beside
``tiktoken.model`` ranks, named by ``auto_map`` in ``tokenizer_config.json``, with the chat
template in ``chat_template.jinja``, and transformers loads it only with
``trust_remote_code=True``. This writes a small folder of that shape, all of it datagen's
own: ranks trained on ``ops.build_tokenizer``'s corpus, the class in
``ops/tokenization_datagen.py``, and a template with tools, tool calls and a reasoning
opener. Same corpus, same files: the build is deterministic. Loading the folder needs
``tiktoken``, which datagen depends on for such tokenizers.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from ops import tokenization_datagen
from ops.build_tokenizer import corpus
from ops.tokenization_datagen import byte_names

RANKS = 1024  # ordinary tokens; the added ones follow
CLASS_FILE = "tokenization_datagen.py"
CLASS_NAME = "DatagenTikTokenizer"
SPECIAL_TOKENS = ["<|begin|>", "<|sep|>", "<|end|>", "<|tools|>", "<|/tools|>", "<|calls|>",
                  "<|call|>", "<|args|>", "<|/call|>", "<|/calls|>"]
REASONING_TOKENS = ["<think>", "</think>"]  # not special: decoding keeps them
EOS_TOKEN = "<|end|>"

# Tools first, as a system turn; a tool reply names its function and call; an assistant
# turn may carry reasoning, content and calls (arguments as given: a JSON string as is,
# an object as JSON); the generation prompt opens the reasoning.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|begin|>system<|sep|><|tools|>' + (tools | tojson) + '<|/tools|><|end|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|begin|>' + message['role'] }}"
    "{%- if message['role'] == 'tool' %}"
    "{{- ':' + (message.name or '') + ':' + (message.tool_call_id or '') }}"
    "{%- endif %}"
    "{{- '<|sep|>' }}"
    "{%- if message['role'] == 'assistant' and message.reasoning_content %}"
    "{{- '<think>' + message.reasoning_content + '</think>' }}"
    "{%- endif %}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{{- '<|calls|>' }}"
    "{%- for call in message.tool_calls %}"
    "{%- set arguments = call.function.arguments %}"
    "{{- '<|call|>' + (call.id or '') + ':' + call.function.name + '<|args|>' }}"
    "{{- arguments if arguments is string else (arguments | tojson) }}"
    "{{- '<|/call|>' }}"
    "{%- endfor %}"
    "{{- '<|/calls|>' }}"
    "{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|begin|>assistant<|sep|><think>' }}{%- endif %}"
)


def ranks() -> dict[bytes, int]:
    """Every byte, then each merge a byte-level BPE learns from the corpus, in order."""
    trainer = BpeTrainer(vocab_size=RANKS, min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.train_from_iterator(corpus(2000), trainer=trainer)
    to_byte = {name: b for b, name in byte_names().items()}
    table = {bytes([b]): b for b in range(256)}
    for merge in json.loads(bpe.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(to_byte[c] for c in left + right)
        table.setdefault(token, len(table))
    return table


def tokenizer_config(first_added: int) -> dict[str, object]:
    added = [(t, True) for t in SPECIAL_TOKENS] + [(t, False) for t in REASONING_TOKENS]
    return {
        "tokenizer_class": CLASS_NAME,
        "auto_map": {"AutoTokenizer": [f"{CLASS_FILE.removesuffix('.py')}.{CLASS_NAME}", None]},
        "added_tokens_decoder": {
            str(first_added + i): {"content": token, "special": special, "lstrip": False,
                                   "rstrip": False, "normalized": False, "single_word": False}
            for i, (token, special) in enumerate(added)
        },
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": None,
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
    }


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    table = ranks()
    model = out / "tiktoken.model"
    model.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n"
                             for token, rank in sorted(table.items(), key=lambda kv: kv[1])),
                     encoding="utf-8")
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps(tokenizer_config(len(table)), indent=2) + "\n",
                      encoding="utf-8")
    template = out / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    code = out / CLASS_FILE
    shutil.copyfile(tokenization_datagen.__file__, code)
    return [model, config, template, code]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
