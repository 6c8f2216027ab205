"""A small real tokenizer for a random-weight checkpoint, so that generation and the chat server
turn text into ids and ids back into text without downloading anything.

A byte-level BPE (GPT-2's pre-tokenizer and decoder), trained by the `tokenizers` library on a
few built-in paragraphs (`TEXT`) up to the checkpoint's `vocab_size`, saved the way
`transformers` saves a fast tokenizer (`tokenizer.json`, `tokenizer_config.json` and
`chat_template.jinja` in transformers 5), so `AutoTokenizer.from_pretrained(checkpoint)` loads it.

Special tokens come first, with the same ids for every vocab size (`SPECIAL_IDS`): pad 0, bos 1,
eos 2 (`<|im_end|>`, which also ends a chat turn, so `generate` stops where a reply ends),
`<|im_start|>` 3, unk 4. The chat template is ChatML's.

How the vocab size shapes it:
- `vocab_size >= BYTE_LEVEL_MIN_VOCAB` (261): all 256 bytes are tokens, so any text encodes
  and decodes back exactly; `<|unk|>` is never produced.
- `MIN_VOCAB` (32) to 260: the 256 bytes do not fit, so the base alphabet is `ALPHABET`'s first
  `vocab_size - 5` characters (all 49 from 54 up: lowercase letters, space, newline, digits and
  common punctuation). Text is lowercased first; every other character becomes `<|unk|>` (a
  run of them inside a word becomes one), which decodes as the literal `<|unk|>`, or as nothing
  with `skip_special_tokens`. Text made of the alphabet round-trips exactly.
- Below 32 there is no useful tokenizer: `CheckpointShape` refuses it unless `tokenizer=False`.

Whatever the vocab size, every id is below it; a tokenizer can hold fewer tokens than
`vocab_size` when the built-in text runs out of pairs to merge (large vocabs): the embedding
rows past it are never used, as in real models whose vocab is padded to a round size.
Deterministic: the same vocab size gives byte-identical files.

One exception to "loads it as written": transformers 5.23's `AutoTokenizer` gives `qwen2`
checkpoints its own `Qwen2Tokenizer` whatever tokenizer_config.json names, and that class
rebuilds the pipeline from the vocab and merges (NFC, Qwen's split, no unk). Byte-level
tokenizers still round-trip any text; below 261, text of the alphabet still round-trips, but
other characters (uppercase included) are dropped instead of lowercased or made `<|unk|>`.
`PreTrainedTokenizerFast.from_pretrained(checkpoint)` loads tokenizer.json as written for every
family.
"""

from __future__ import annotations

from pathlib import Path

from offload.errors import ConfigError

PAD, BOS, EOS, IM_START, UNK = "<|pad|>", "<|bos|>", "<|im_end|>", "<|im_start|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, UNK)  # ids 0..4, in this order
# In config.json's names: what the model's embedding and `generate` know them by.
SPECIAL_IDS = {
    f"{kind}_token_id": SPECIAL_TOKENS.index(token)
    for kind, token in (("pad", PAD), ("bos", BOS), ("eos", EOS))
}
# Ordered by need: the letters and space alone make a tokenizer; the rest as the vocab allows.
ALPHABET = " abcdefghijklmnopqrstuvwxyz\n.,?!'0123456789-:;\"()"
MIN_VOCAB = len(SPECIAL_TOKENS) + 27  # space and a-z
BYTE_LEVEL_MIN_VOCAB = len(SPECIAL_TOKENS) + 256
# What `AutoTokenizer` reads from a directory, in transformers 5 and earlier versions: any of
# them left by an earlier write would describe another vocab.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEXT = """\
The little town sat between the hills and the sea. Every morning the fishing boats went out
before the sun was up, and every evening they came back with the tide. Children ran down to
the harbour to meet them, and the old men on the wall told the same stories they had told the
day before. Nobody minded. It was a quiet place, and the people who lived there liked it that
way.

In the spring the fields above the town turned green, then yellow with flowers. Farmers walked
their dogs along the paths, and the bakery on the corner opened its windows so that the smell
of fresh bread filled the street. On market days there were tables of fruit and cheese, honey
and eggs, and a man who sold old books for a few coins each. "Read this one," he would say,
"and tell me what you think of it next week."

Hello! How are you today? I am well, thank you. What would you like to do? We could walk to
the lighthouse, or take the train into the city. The train leaves at nine and comes back at
six. It is a short ride: only forty minutes, with three stops on the way. Do you want a cup of
tea first? Yes, please. No, thank you. Good morning, good night, see you soon.

A computer follows simple rules, one step at a time. It reads a number, adds another number,
and writes the result in its memory. Many small steps, done very fast, can answer hard
questions. A model that writes text looks at the words so far and guesses which word should
come next; then it looks again, with that word added, and guesses the one after it. When it
writes the word that means "the end", it stops.

My friend keeps a garden behind her house. She grows beans, tomatoes, potatoes and herbs, and
she knows the name of every bird that visits. In the summer we sit outside until it gets dark,
talking about the weather, our families and the places we want to see. Last year she planted
an apple tree. It is still very small, but she says that in ten years it will give us more
apples than we can eat.

Winter is different. The wind comes from the north, cold and strong, and the waves break high
over the harbour wall. Most shops close early. People stay at home by the fire, cooking soup,
mending nets, writing letters or playing cards with their neighbours. Sometimes snow falls
during the night, and in the morning everything is white and silent, as if the whole world
were holding its breath. Then the children wake up, shout with joy and rush outside.

Questions are good. Why is the sky blue? How far away is the moon? Which animals sleep through
the winter, and why do leaves change colour before they drop? Every answer brings new
questions, and that is how we learn. Teachers, parents and scientists all began by asking
something simple, then listening carefully, trying things out, making mistakes and trying
again. Nobody knows everything, but anyone can be curious.

To make pancakes, mix two cups of flour with one egg, a spoon of sugar and a pinch of salt.
Pour in milk slowly, stirring all the time, until the batter is smooth. Heat a pan with a
little butter, cook each pancake for about a minute on each side, and serve it warm with
lemon, jam or maple syrup. They taste best when shared with friends.
"""


def alphabet_for(vocab_size: int) -> str | None:
    """The base characters of a `vocab_size` tokenizer; None: all 256 bytes (byte-level)."""
    if vocab_size >= BYTE_LEVEL_MIN_VOCAB:
        return None
    if vocab_size < MIN_VOCAB:
        raise ConfigError(
            f"vocab_size={vocab_size} is too small for a tokenizer (needs >= "
            f"{MIN_VOCAB}: {len(SPECIAL_TOKENS)} special tokens, space and a-z)"
        )
    return ALPHABET[: vocab_size - len(SPECIAL_TOKENS)]


def train(vocab_size: int):
    """The `tokenizers.Tokenizer` for `vocab_size`, trained on `TEXT`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    alphabet = alphabet_for(vocab_size)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)  # no space added: round-trips
    tokenizer = Tokenizer(models.BPE(unk_token=UNK if alphabet else None, fuse_unk=True))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    paragraphs = TEXT.split("\n\n")
    if alphabet:
        # Byte-level BPE sees text as bytes mapped to printable characters (space as "Ġ"): the
        # base tokens are those of the alphabet's one-byte characters, in a fixed order.
        initial = sorted(byte_level.pre_tokenize_str(c)[0][0] for c in alphabet)
        tokenizer.normalizer = normalizers.Lowercase()  # "Hello" is "hello", not "<|unk|>ello"
        # A character the trainer meets becomes a token: keep the text inside the alphabet.
        paragraphs = ["".join(c if c in alphabet else " " for c in p.lower()) for p in paragraphs]
    else:
        initial = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=initial,
        show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs, trainer)
    assert tokenizer.get_vocab_size() <= vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS))), ids  # SPECIAL_IDS relies on it
    return tokenizer


def remove_tokenizer_files(out: Path) -> list[str]:
    """Delete the tokenizer files in `out` (a checkpoint being overwritten); returns their
    names."""
    removed = [name for name in TOKENIZER_FILES if (out / name).is_file()]
    for name in removed:
        (out / name).unlink()
    return removed


def write_tokenizer(out: str | Path, *, vocab_size: int, max_positions: int) -> None:
    """Train the tokenizer for `vocab_size` and save it into the checkpoint directory `out`."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=train(vocab_size),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_positions,
        padding_side="left",  # a batch of prompts for a decoder: the new tokens line up
        clean_up_tokenization_spaces=False,  # would turn "a ." into "a.": no exact round-trip
    )
    wrapped.save_pretrained(out)
