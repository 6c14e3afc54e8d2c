"""Build the small real tokenizer that datagen ships for tests, the simulator and demos.

Usage: ``python -m ops.build_tokenizer [--out DIR]`` (default: ``common/assets/tokenizer``).

The reference target model is a huge Qwen-style reasoning model; its tokenizer cannot be
downloaded offline, so this builds a Qwen3-shaped stand-in: byte-level BPE (any text
round-trips), ChatML special tokens, and ``<think>``/``</think>`` as *non-special* added
tokens so ``decode(skip_special_tokens=True)`` keeps them, exactly like Qwen3. The corpus
is generated from a fixed seed so every run writes byte-identical files. Unlike Qwen3 it
has no NFC normalizer: tokenizing is the producer's bottleneck and NFC costs ~30% of it.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "common" / "assets" / "tokenizer"
VOCAB_SIZE = 4000
SEED = 20240611
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
REASONING_TOKENS = ["<think>", "</think>"]

# A Qwen3-like ChatML template. ``thinking=False`` pre-fills an empty reasoning block,
# which is how Qwen3's ``enable_thinking=False`` switches reasoning off.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('unsupported role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{%- if thinking is defined and not thinking %}\n"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)


def _split(text: str, sep: str = " ") -> tuple[str, ...]:
    # Word lists are kept as long strings so the embedded corpus stays compact and readable.
    return tuple(text.split(sep))


_SUBJECTS = _split(
    "function compiler parser model server worker queue user assistant test loop proof "
    "matrix vector tokenizer database request response thread process cache scheduler "
    "dataset budget counter result student teacher engineer"
)
_VERBS = _split(
    "returns computes parses reads writes sorts filters caches sends receives validates "
    "raises handles counts measures explains solves proves checks merges splits encodes "
    "decodes renders schedules retries cancels stores loads imports exports summarizes"
)
_OBJECTS = _split(
    "a list of integers|the sum of two numbers|a JSON object|the prime factors|an HTTP "
    "request|the shortest path in a graph|a binary tree|the average value|a sorted array|the "
    "token ids|the chat template|an error message|the square root|a random sample|the final "
    "answer|a regular expression|the database schema|a unit test|the derivative of x squared|"
    "the probability of rain|a recursive solution|the output tokens|a dictionary of counts|"
    "the configuration file|a stack trace|the largest element|a linked list|the hash value",
    "|",
)
_ADVERBS = _split(
    "quickly|carefully|correctly|in linear time|without allocating memory|step by step|"
    "in parallel|again after a timeout|only once|for every dataset|before the deadline|"
    "with a clear message|in constant space|using dynamic programming|from the first line",
    "|",
)
_CHAT = _split(
    "Can you help me with this?|Please explain how it works.|What is the time complexity?|"
    "Write a Python function for it.|Let me think about this carefully.|First, we note that|"
    "Therefore, the answer is|Here is a short summary:|Thanks, that was useful!|Why does it "
    "fail with an exception?|Let's verify the result with an example.|Sure! Here's the code:",
    "|",
)
_NAMES = _split(
    "count total items value result index data key name path line text number size "
    "buffer offset limit start end left right node graph tree queue stack token prompt"
)
# Common English and programming words, so everyday prompts and chat roles get whole tokens.
_WORDS = _split(
    "a an the is are was be been not no yes or but if so as at by in on of to for it its "
    "this we you he she they i me my our his her do did has had may hello please thanks "
    "about above after again against all also always among and another answer any appear "
    "area around ask away back because become before begin behind being below best better "
    "between both bring build call came can case cause change check child city clear close "
    "come common complete could country course create current day different does done down "
    "during each early easy either else enough even every example explain fact family far "
    "feel few field find first follow food form found free friend from full game general "
    "give good great group grow hand happen hard have head help here high hold home house "
    "however human idea important include information inside instead into issue just keep "
    "kind know large last later learn least leave less letter life light like little live "
    "local long look made main make many mean might mind more most move much must need "
    "never next night nothing now number often only open order other over own paper part "
    "people perhaps place plan play point possible power present problem program provide "
    "public question quite rather real reason remember report rest right room round rule "
    "same school second seem several should show side simple since small some something "
    "sound space special stand state still story strong such sure system table take tell "
    "than that their them then there these they thing think those though through time "
    "today together tool toward true turn under understand until upon use usually very "
    "want water week well were what when where which while whole why will with within word "
    "work world would write year young your argument boolean branch bytes callback channel "
    "client commit constant container context default deploy docker dependency document "
    "element encoding endpoint environment event exception float framework generator "
    "integer interface iterator kernel keyword lambda library memory method module mutex "
    "object package parameter pointer protocol python redis return runtime script session "
    "socket string struct syntax template timeout tuple type unicode variable version "
    "virtual algebra angle circle equation fraction geometry integral limit polynomial "
    "prime ratio sequence series theorem triangle variance"
)


_SNIPPETS = (
    "def {f}({a}, {b}):\n    return {a} + {b}\n",
    "for {a} in range({n}):\n    {b}.append({a} * {a})\n",
    'if {a} is None:\n    raise ValueError("{a} must not be None")\n',
    "class {C}:\n    def __init__(self, {a}: int) -> None:\n        self.{a} = {a}\n",
    'with open({a}, encoding="utf-8") as fh:\n    {b} = [line.strip() for line in fh]\n',
    "{a} = {{k: v for k, v in {b}.items() if v > {n}}}\nprint(len({a}))\n",
    'try:\n    {a} = int({b})\nexcept ValueError as exc:\n    logger.warning("bad %s", exc)\n',
    "while {a} < {n}:\n    {a} += 1\n    if {a} % 2 == 0:\n        continue\n",
    "import json\n\n{a} = json.loads({b})\nassert isinstance({a}, dict)\n",
    "async def {f}({a}):\n    await asyncio.sleep({n})\n    return {a}\n",
)


def _sentence(rng: random.Random) -> str:
    parts = (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_ADVERBS))
    text = "The {} {} {} {}.".format(*parts)
    return f"{rng.choice(_CHAT)} {text}" if rng.random() < 0.3 else text


def _prose(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(6, 16))
    return " ".join(words).capitalize() + rng.choice((".", "?", "!", ":", ","))


def _math(rng: random.Random) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    return f"Compute {a} * {b} + {b}: we get {a * b} + {b} = {a * b + b}, so x = {a * b + b}."


def _code(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    fields = {
        "f": f"{rng.choice(_VERBS).rstrip('s')}_{rng.choice(_NAMES)}",
        "a": a,
        "b": b,
        "C": rng.choice(_NAMES).capitalize() + rng.choice(("Reader", "Store", "Client", "Error")),
        "n": rng.randint(0, 512),
    }
    return rng.choice(_SNIPPETS).format(**fields)


def corpus(lines: int = 6000) -> Iterator[str]:
    """The training text: same seed, same lines, so the merges never change between runs."""
    rng = random.Random(SEED)
    makers = (_sentence, _prose, _prose, _math, _code, _code)
    for _ in range(lines):
        yield rng.choice(makers)(rng)


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict[str, object]:
    return {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build()
    tok_path = out / "tokenizer.json"
    tok_path.write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config())
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    return [tok_path, out / "tokenizer_config.json", out / "special_tokens_map.json"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
