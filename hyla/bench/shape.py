"""`hyla bench shape`: a servable directory for a named model shape (hyla.models.presets'
RANDOM_CONFIGS) without its weights: config.json plus a synthetic tokenizer over the shape's whole
vocabulary, for `hyla serve DIR --load-format dummy` (random weights) and `hyla bench serve`.

    hyla bench shape /data/kimi-48b --random-config kimi-linear-48b-a3b [--layers N]
    hyla serve /data/kimi-48b --load-format dummy &
    hyla bench serve --tokenizer /data/kimi-48b --random-input-len 1024 --random-output-len 256

config.json is `random_config_dict(name, layers)`, as `hyla bench throughput` writes it. The
tokenizer (tokenizer.json for the `tokenizers` library + tokenizer_config.json, which hyla's
loader and transformers' PreTrainedTokenizerFast both read) is a WordLevel model: id i is the
word "w<i>" written SentencePiece-style ("▁w<i>", the "▁" a leading space), except the special
tokens: BOS / EOS / PAD at the ids the model's config names (an EOS near the top of the
vocabulary when it names none), and <|unk|> and the chat roles <|system|>, <|user|>,
<|assistant|>, <|tool|> at the highest free ids. Text splits at spaces (Metaspace); decoding
turns "▁" back into a space and keeps it, so every decoded text starts with one and the texts
of two id lists, put one after the other, encode to the two lists one after the other (the
benchmark joins prompt parts as texts). No BOS is added to a text, so a text of N words is N
tokens: `hyla bench serve` writes prompts of exactly the lengths asked for. The chat template
writes each message as <|role|> content EOS and ends with <|assistant|>.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SPACE = "\u2581"  # SentencePiece's word marker: a space before the word
UNK, ROLES = "<|unk|>", ("system", "user", "assistant", "tool")
# Each message as <|role|> content EOS (content: a string or a list of text parts); then the
# assistant's turn. __EOS__ is replaced by the EOS token's text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '__EOS__' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}")


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def special_tokens(vocab_size: int, bos_token_id, eos_token_id, pad_token_id) -> tuple[dict[int, str], dict]:
    """({id: special token text}, the tokenizer_config.json entries naming bos / eos / pad / unk).
    The config's ids keep their places (every id of a list of EOS ids is special); an EOS, when
    the config names none, and <|unk|> and the role tokens go to the highest ids still free."""
    names: dict[int, str] = {}

    def place(i: int, text: str) -> str:
        if not 0 <= i < vocab_size:
            raise ValueError(f"special token id {i} outside the vocabulary of {vocab_size}")
        return names.setdefault(i, text)  # an id named twice (pad = eos, say) keeps its first name

    roles = {}
    eos_ids, bos_ids, pad_ids = _ids(eos_token_id), _ids(bos_token_id), _ids(pad_token_id)
    eos = [place(i, "<|eos|>" if k == 0 else f"<|eos_{k}|>") for k, i in enumerate(eos_ids)]
    bos = [place(i, "<|bos|>") for i in bos_ids[:1]]
    pad = [place(i, "<|pad|>") for i in pad_ids[:1]]
    free = (i for i in range(vocab_size - 1, -1, -1) if i not in names)
    needed = ([] if eos else ["<|eos|>"]) + [UNK] + [f"<|{r}|>" for r in ROLES]
    if vocab_size < len(names) + len(needed) + 1:
        raise ValueError(f"a vocabulary of {vocab_size} has no room for the special tokens")
    for text in needed:
        roles[text] = place(next(free), text)
    entries = {"bos_token": bos[0] if bos else None, "eos_token": eos[0] if eos else roles["<|eos|>"],
               "pad_token": pad[0] if pad else None, "unk_token": UNK}
    return names, entries


def build_tokenizer(vocab_size: int, specials: dict[int, str]):
    """The `tokenizers.Tokenizer` over ids 0..vocab_size-1 (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"{SPACE}w{i}": i for i in range(vocab_size)}
    for i, text in specials.items():
        del vocab[f"{SPACE}w{i}"]
        vocab[text] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    # Llama-2's decoder less its final Strip: "▁" -> " " kept at the start (ByteFallback: the
    # vocabulary type xgrammar reads "▁" in; no <0xXX> piece here)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for _, t in sorted(specials.items())])
    return tokenizer


def write_tokenizer(directory, vocab_size: int, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None) -> None:
    """tokenizer.json and tokenizer_config.json of a synthetic vocabulary of `vocab_size` ids
    into `directory` (see the module docstring)."""
    directory = Path(directory)
    specials, entries = special_tokens(vocab_size, bos_token_id, eos_token_id, pad_token_id)
    build_tokenizer(vocab_size, specials).save(str(directory / "tokenizer.json"), pretty=False)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **entries, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE.replace("__EOS__", entries["eos_token"])}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_shape(directory, name: str, layers: int | None = None) -> Path:
    """config.json of shape `name` (cut to `layers`) and its synthetic tokenizer in `directory`
    (created; a directory holding weights is refused). Returns the directory."""
    from hyla.models.loader import family_classes
    from hyla.models.presets import random_config_dict

    directory = Path(directory)
    if any(directory.glob("*.safetensors")) or (directory / "model.safetensors.index.json").exists():
        raise ValueError(f"{directory} holds weights: write the shape into a directory of its own")
    config_dict = random_config_dict(name, layers)
    config = family_classes(config_dict["model_type"])[0].from_hf_dict(config_dict)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    write_tokenizer(directory, config.vocab_size, getattr(config, "bos_token_id", None),
                    getattr(config, "eos_token_id", None), getattr(config, "pad_token_id", None))
    return directory


def main(argv: list[str] | None = None) -> Path:
    from hyla.models.presets import RANDOM_CONFIGS

    p = argparse.ArgumentParser(prog="hyla bench shape", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="the directory to write (created)")
    p.add_argument("--random-config", required=True, choices=list(RANDOM_CONFIGS), help="the shape")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers of the shape")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        path = write_shape(args.out_dir, args.random_config, args.layers)
    except ValueError as e:
        p.error(str(e))
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"{path}: {args.random_config}" + (f", first {args.layers} layers" if args.layers else "")
          + f" (config.json, tokenizer.json, tokenizer_config.json; {size / 1e6:.1f} MB, "
          f"{time.perf_counter() - start:.1f} s)")
    print(f"serve it:  hyla serve {path} --load-format dummy")
    print(f"load it:   hyla bench serve --tokenizer {path} ...")
    return path


if __name__ == "__main__":
    main()
