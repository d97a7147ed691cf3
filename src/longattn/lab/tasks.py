"""Synthetic retrieval tasks (passkey, RULER niah / vt) with the needle at a chosen distance.

Definitions follow ../shared/TASKS.md (RULER at c3f5e3b, Landmark passkey at 78ec517):
templates, needle sentences, key/value kinds, answer prefixes, tokens to generate and the
scoring (passkey: first integer match; RULER: ``string_match_all``/``string_match_part`` on
the post-processed prediction). What differs here, on purpose:

* **Placement by distance, not depth.** The experiment asks how far back a windowed model can
  still read, so the needle (for multi-needle tasks: the block of answer needles) is placed
  so that ``distance`` prompt tokens -- counted from the needle's first token to the end of
  the prompt, answer prefix included -- separate it from the point where generation starts.
  The resolution is one haystack unit (a sentence of the essay haystack, a line of the noise
  haystack); ``Sample.needle_distance`` is the measured value.
* **Haystacks.** The Paul Graham essays RULER uses are copyrighted and absent: the essay
  haystack is consecutive sentences of a public-domain book shipped with longattn
  (``longattn.data``), split on sentence punctuation (no NLTK). The noise haystack and the
  passkey filler are the published strings. The passkey filler is cut at sentence
  boundaries instead of Landmark's character slice.
* **Keys.** RULER draws "adjective-noun" keys from the ``wonderwords`` word lists, which are
  not shipped here; a fixed list of common English adjectives and nouns stands in.
* **Length.** The haystack before the needle is grown until the prompt holds at most
  ``length`` tokens (RULER also subtracts the tokens to generate; we do not).
* **Multi-needle tasks.** The answer needles (multivalue: the 4 values, multiquery: the 4
  queried keys) sit together in one block at the distance, shuffled; multikey distractor
  needles sit at seeded random places in the haystack. In ``vt`` the chain's first statement
  (the one holding the value) is at the distance; the later hops follow at random places
  after it, in order.

Everything is deterministic given ``seed`` (Python ``random.Random(seed)``), for any
tokenizer given as ``encode(text) -> list[int]``.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence

from ..errors import LongattnError

Encode = Callable[[str], List[int]]

# ----------------------------------------------------------------------------------- strings

NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_DESCRIPTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
                       "memorize them. I will quiz you about the important information there.")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER_PREFIX = " The pass key is"

NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize "
                 "it. I will quiz you about the {type_v} afterwards.\n{context}\nWhat are all the special "
                 "magic {type_v} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"

VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                    "variables are assigned the value {query}, they are: ")

# Stand-in for wonderwords' adjective and noun lists (not shipped): common English words.
ADJECTIVES = (
    "able acid angry bitter black blue bold brave brief bright broad calm cheap clean clear cold cool "
    "crisp curly damp dark deep dry dull eager early easy empty even faint fair fancy fast fierce firm "
    "flat fresh fuzzy gentle giant glad golden grand green grey happy hard heavy hollow huge humble "
    "icy jolly kind large late lazy light little lively lone long loud lucky mild misty modern narrow "
    "neat noisy odd old pale plain polite proud quick quiet rapid rare raw red rich rough round royal "
    "rusty sad salty sharp shiny short shy silent silly simple slow small smooth soft solid sour spicy "
    "square steep sticky stiff strange strong sunny sweet swift tall tame tender thick thin tidy tiny "
    "tough vast warm weak wet white wide wild windy wise witty young").split()
NOUNS = (
    "anchor apple arrow badge barn basket beach bell bicycle blanket boat bottle bridge brush bucket "
    "button cabin camera candle canyon carpet castle cave chair cheese cherry chimney cloud clock coin "
    "comet cookie copper crayon crown cup desert diamond dolphin door dragon drum eagle engine feather "
    "fence field flag flute forest fountain garden gate glove harbor hammer helmet hill honey horse "
    "island jacket jungle kettle kite ladder lamp lantern lemon library lion magnet maple meadow mirror "
    "monkey mountain needle ocean orchard owl paddle palace panda pebble pencil piano pillow planet "
    "pocket pond puzzle rabbit river rocket saddle sandal shadow shell ship shovel signal spoon stable "
    "statue storm stream sugar tiger tower train tunnel turtle valley violin wagon wallet whistle window "
    "wizard zebra").split()
WORD_KEYS = sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS})

TOKENS_TO_GENERATE = {"passkey": 10, "niah": 128, "vt": 30}

# task -> (haystack, key kind, value kind, keys, values per key, queries); TASKS.md table.
NIAH_CONFIGS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}
TASKS = ("passkey",) + tuple(NIAH_CONFIGS) + ("vt",)


@dataclass
class Sample:
    """One prompt. The model reads ``input + answer_prefix`` (``prompt``) and continues it."""

    task: str
    input: str
    answer_prefix: str
    outputs: list                 # reference strings (passkey: one decimal integer)
    metric: str                   # "passkey" | "string_match_all" | "string_match_part"
    max_new_tokens: int
    distance: int                 # requested: tokens from the needle's first token to prompt end
    needle_distance: int = 0      # measured with the encoder
    length: int = 0               # prompt tokens (measured)
    seed: int = 0
    haystack: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return self.input + self.answer_prefix

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("input")
        return d


# ----------------------------------------------------------------------------------- scoring

def postprocess_pred(pred: str) -> str:
    """RULER: strip, control characters -> newline, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """Fraction of references found (case-insensitive substring) in the prediction."""
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """1 if any reference is found (case-insensitive substring), else 0."""
    p = pred.lower()
    return float(any(r.lower() in p for r in refs))


def first_int_match(pred: str) -> Optional[int]:
    """InfiniteBench / Landmark: the first run of digits in the prediction, as an int."""
    for part in re.split(r"[^0-9]", pred):
        if part:
            return int(part)
    return None


def score(sample: Sample, pred: str) -> float:
    """Score in [0, 1] of a continuation ``pred`` (post-processed as RULER does)."""
    p = postprocess_pred(pred)
    if sample.metric == "passkey":
        return float(first_int_match(p) == int(sample.outputs[0]))
    if sample.metric == "string_match_all":
        return string_match_all(p, sample.outputs)
    if sample.metric == "string_match_part":
        return string_match_part(p, sample.outputs)
    raise LongattnError(f"unknown metric '{sample.metric}'")


def settled(sample: Sample, pred: str) -> bool:
    """True when more generated text cannot change ``score(sample, pred)``.

    Passkey: the first digit run has ended (a non-digit follows it). Substring metrics: every
    reference is already present (score 1 can only stay 1). Used to stop decoding early with
    exactly the score the full ``max_new_tokens`` would get.
    """
    p = postprocess_pred(pred)
    if sample.metric == "passkey":
        return re.search(r"[0-9]+[^0-9]", p) is not None
    if sample.metric == "string_match_all":
        return string_match_all(p, sample.outputs) == 1.0
    if sample.metric == "string_match_part":
        return string_match_part(p, sample.outputs) == 1.0
    return False


# ----------------------------------------------------------------------------------- text

_SENT_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z])")


def split_sentences(text: str, max_words: int = 60) -> list:
    """Whitespace-normalized sentences of ``text`` (split after . ! ? before a capital).

    Sentences longer than ``max_words`` words are dropped, which keeps the placement
    resolution (one sentence) fine.
    """
    flat = " ".join(text.split())
    out = []
    for s in _SENT_END.split(flat):
        s = s.strip()
        if s and len(s.split()) <= max_words and re.search(r"[A-Za-z]", s):
            out.append(s)
    return out


def essay_sentences(rng: random.Random, count: int, book: Optional[str] = None) -> tuple:
    """``count`` consecutive sentences from a (seeded) random place in a bundled book; the
    book is cycled when it runs out (as RULER repeats its essays)."""
    from ..data import book_names
    name = book or rng.choice(book_names())
    sents = _book_sentences(name)
    start = rng.randrange(len(sents))
    return [sents[(start + i) % len(sents)] for i in range(count)], name


_SENT_CACHE: dict = {}


def _book_sentences(name: str) -> list:
    if name not in _SENT_CACHE:
        from ..data import book_body
        _SENT_CACHE[name] = split_sentences(book_body(name))
    return _SENT_CACHE[name]


def book_passages(encode: Encode, n: int, length: int, skip_chars: int = 2000) -> list:
    """``n`` passages of exactly ``length`` token ids from the bundled books.

    Passage i comes from book ``i mod n_books``, starting at an evenly spaced offset of its
    body (snapped to the next paragraph break), so the set is fixed for a given (n, length,
    tokenizer). Each is ``encode(text)[:length]`` (the tokenizer's BOS, if any, included).
    """
    from ..data import book_body, book_names
    import torch
    if n < 1 or length < 4:
        raise LongattnError("need n >= 1 passages of length >= 4 tokens")
    names = book_names()
    per_book = -(-n // len(names))
    out = []
    for i in range(n):
        name, k = names[i % len(names)], i // len(names)
        body = book_body(name)
        span = max(1, len(body) - skip_chars)
        off = skip_chars + (k * span) // per_book
        para = body.find("\n\n", off)
        off = para + 2 if 0 <= para < off + 5000 else off
        chars = length * 8
        ids = encode(body[off: off + chars])
        while len(ids) < length and off + chars < len(body):
            chars *= 2
            ids = encode(body[off: off + chars])
        if len(ids) < length:
            ids = encode(body[-length * 8:])
        if len(ids) < length:
            raise LongattnError(f"book {name} is too short for {length}-token passages")
        out.append(torch.tensor(ids[:length], dtype=torch.int64))
    return out


# ----------------------------------------------------------------------------------- layout

def _count(encode: Encode, text: str, base: int) -> int:
    return len(encode(text)) - base


class _Layout:
    """Prompt = head + before-units + needle block + after-units + tail; units are joined by
    ``sep``, the needle block is joined to them by ``needle_sep`` (default ``sep``).

    ``_place`` picks how many units go after the needle (to reach the distance) and before it
    (to fill the length), measuring with the encoder and correcting by whole units.
    """

    def __init__(self, encode: Encode, head: str, tail: str, needle: str, sep: str,
                 needle_sep: Optional[str] = None):
        self.encode, self.head, self.tail, self.needle = encode, head, tail, needle
        self.sep = sep
        self.nsep = sep if needle_sep is None else needle_sep

    def text(self, before: list, after: list) -> tuple:
        """(prompt text, char offset of the needle)."""
        pre = self.head + self.sep.join(before) + (self.nsep if before else "")
        post = (self.nsep if after else "") + self.sep.join(after) + self.tail
        return pre + self.needle + post, len(pre)

    def measure(self, before: list, after: list) -> tuple:
        """(prompt tokens, needle distance in tokens).

        The distance counts from the token holding the needle's first character: the text
        before it is encoded without its trailing spaces, which BPE tokenizers attach to
        the next word (the needle's first token).
        """
        text, at = self.text(before, after)
        n = len(self.encode(text))
        return n, n - len(self.encode(text[:at].rstrip(" ")))


def _place(layout: _Layout, distance: int, length: int, after_pool: list, before_pool: list) -> tuple:
    """Choose (before, after) unit lists; returns (before, after, prompt tokens, needle distance).

    ``after_pool`` is in text order (first = right after the needle); ``before_pool`` is
    nearest-to-the-needle first. Unit token counts are estimated one by one, then the
    distance is measured on the real prompt and corrected by whole units.
    """
    enc = layout.encode
    base = len(enc(""))
    _, d0 = layout.measure([], [])
    k, acc = 0, d0
    while k < len(after_pool):
        est = _count(enc, layout.sep + after_pool[k], base)
        if abs(acc + est - distance) >= abs(acc - distance):
            break
        acc += est
        k += 1
    _, d = layout.measure([], after_pool[:k])
    for _ in range(16):  # correct against the measured distance, one unit at a time
        if d < distance and k < len(after_pool):
            _, d2 = layout.measure([], after_pool[:k + 1])
            if abs(d2 - distance) < abs(d - distance):
                k, d = k + 1, d2
                continue
        if d > distance and k > 0:
            _, d2 = layout.measure([], after_pool[:k - 1])
            if abs(d2 - distance) <= abs(d - distance):
                k, d = k - 1, d2
                continue
        break
    after = after_pool[:k]
    n, d = layout.measure([], after)
    if n > length:
        raise LongattnError(f"a needle at distance {distance} needs a prompt of {n} tokens, more than "
                            f"the length {length}; raise --length or lower the distance")
    j, total = 0, n  # before-units fill up to the length, nearest to the needle first
    while j < len(before_pool):
        est = _count(enc, layout.sep + before_pool[j], base)
        if total + est > length:
            break
        total += est
        j += 1
    before = list(reversed(before_pool[:j]))
    n, d = layout.measure(before, after)
    while n > length and before:  # estimates were short: drop the farthest unit
        before = before[1:]
        n, d = layout.measure(before, after)
    return before, after, n, d


# ----------------------------------------------------------------------------------- tasks

def _key(rng: random.Random, kind: str) -> str:
    if kind == "words":
        return rng.choice(WORD_KEYS)
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise LongattnError(f"unknown key/value kind '{kind}'")


def _haystack(rng: random.Random, haystack: str, count: int) -> tuple:
    """(units in text order, label): ``count`` noise lines or consecutive book sentences."""
    if haystack == "noise":
        return [NOISE_LINE] * count, "noise"
    if haystack == "essay":
        sents, name = essay_sentences(rng, count)
        return sents, f"essay:{name}"
    raise LongattnError(f"unknown haystack '{haystack}'")


def _unit_tokens(encode: Encode, unit: str) -> int:
    return max(1, len(encode(" " + unit)) - len(encode("")))


def _pool_size(encode: Encode, length: int, unit: str) -> int:
    """How many haystack units could fill ``length`` tokens, with slack (units differ)."""
    return int(2 * length / _unit_tokens(encode, unit)) + 16


def _insert(units: list, items: list, rng: random.Random, keep_order: bool = False) -> list:
    """Insert ``items`` at random gaps of ``units`` (gap 0 = before the first unit);
    with ``keep_order`` the items keep their relative order."""
    if not items:
        return list(units)
    gaps = [rng.randrange(len(units) + 1) for _ in items]
    if keep_order:
        gaps.sort()
    out = list(units)
    for idx in sorted(range(len(items)), key=lambda i: (-gaps[i], -i)):
        out.insert(gaps[idx], items[idx])
    return out


def _split_pools(units: list) -> tuple:
    """A contiguous run of units -> (after pool in text order, before pool nearest first),
    so the haystack reads on across the needle."""
    half = len(units) // 2
    return units[half:], list(reversed(units[:half]))


def passkey_sample(encode: Encode, distance: int, length: int, seed: int) -> Sample:
    """Landmark / LongLoRA passkey with the needle line ``distance`` tokens from the end.

    Prompt: description, filler prefix, needle line, filler suffix, question -- joined by
    newlines as in Landmark -- followed by the answer prefix " The pass key is".
    """
    rng = random.Random(seed)
    key = rng.randint(1, 50000)
    filler = [s if s.endswith(".") else s + "." for s in NOISE_LINE.split(". ")]  # its 5 sentences
    n = _pool_size(encode, length, filler[0])
    after_pool = [filler[i % 5] for i in range(n)]            # suffix starts "The grass is green."
    before_pool = [filler[4 - i % 5] for i in range(n)]       # prefix ends "There and back again."
    layout = _Layout(encode, PASSKEY_DESCRIPTION + "\n", "\n" + PASSKEY_QUESTION + PASSKEY_ANSWER_PREFIX,
                     PASSKEY_NEEDLE.format(key=key), " ", needle_sep="\n")
    before, after, n_tok, d = _place(layout, distance, length, after_pool, before_pool)
    text, _ = layout.text(before, after)
    inp = text[: len(text) - len(PASSKEY_ANSWER_PREFIX)]
    return Sample("passkey", inp, PASSKEY_ANSWER_PREFIX, [str(key)], "passkey", TOKENS_TO_GENERATE["passkey"],
                  distance, d, n_tok, seed, "noise")


def niah_sample(task: str, encode: Encode, distance: int, length: int, seed: int) -> Sample:
    """RULER niah_* (TASKS.md) with the block of answer needles ``distance`` tokens from the end."""
    if task not in NIAH_CONFIGS:
        raise LongattnError(f"unknown niah task '{task}'; known: {', '.join(NIAH_CONFIGS)}")
    hay, kk, vk, num_k, num_v, num_q = NIAH_CONFIGS[task]
    num_k = max(num_k, num_q)
    rng = random.Random(seed)
    keys: list = []
    while len(keys) < num_k:
        k = _key(rng, kk)
        if k not in keys:
            keys.append(k)
    values = [[_key(rng, vk) for _ in range(num_v)] for _ in keys]
    queried = sorted(rng.sample(range(num_k), num_q))
    type_v = vk
    needles = {(i, j): NIAH_NEEDLE.format(type_v=type_v, key=keys[i], value=values[i][j])
               for i in range(num_k) for j in range(num_v)}
    answer_needles = [needles[(i, j)] for i in queried for j in range(num_v)]
    rng.shuffle(answer_needles)
    distractors = [needles[(i, j)] for i in range(num_k) if i not in queried for j in range(num_v)]
    qkeys = [keys[q] for q in queried]
    query = qkeys[0] if num_q == 1 else ", ".join(qkeys[:-1]) + ", and " + qkeys[-1]
    outputs = [values[i][j] for i in queried for j in range(num_v)]
    template, prefix = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
    if num_q * num_v == 1:  # RULER's singular rewrite
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is") \
            .replace("answers", "answer")
        prefix = prefix.replace("are", "is")
        type_v = type_v[:-1]
    template = template.replace("{type_v}", type_v)
    prefix = prefix.format(type_v=type_v, query=query)
    head, tail = template.split("{context}")
    tail = tail.format(query=query)
    sep = "\n" if hay == "noise" else " "
    unit = NOISE_LINE if hay == "noise" else "A book sentence is about this long, give or take a few words."
    units, hname = _haystack(rng, hay, 2 * _pool_size(encode, length, unit))
    after_pool, before_pool = _split_pools(units)
    # distractor needles (multikey) at random gaps near the block, on both sides
    near = max(1, len(after_pool) // 8)
    nd = len(distractors) // 2
    after_pool = _insert(after_pool[:near], distractors[:nd], rng) + after_pool[near:]
    before_pool = _insert(before_pool[:near], distractors[nd:], rng) + before_pool[near:]
    layout = _Layout(encode, head, tail + prefix, sep.join(answer_needles), sep)
    before, after, n_tok, d = _place(layout, distance, length, after_pool, before_pool)
    text, _ = layout.text(before, after)
    inp = text[: len(text) - len(prefix)]
    present = sum(t in before or t in after for t in distractors)
    return Sample(task, inp, prefix, outputs, "string_match_all", TOKENS_TO_GENERATE["niah"], distance, d,
                  n_tok, seed, hname, {"keys": keys, "query": query, "distractors_in_prompt": present})


def _var_name(rng: random.Random, n: int, taken: set) -> str:
    while True:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(n))
        if v not in taken:
            taken.add(v)
            return v


def _vt_chain(rng: random.Random, hops: int, name_len: int, value: int) -> tuple:
    """(names, statements): ``VAR A = value``, then ``VAR B = VAR A `` (trailing space) ..."""
    taken: set = set()
    names = [_var_name(rng, name_len, taken) for _ in range(hops + 1)]
    stmts = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]} " for i in range(hops)]
    return names, stmts


def _vt_example(rng: random.Random, hops: int = 4) -> str:
    """RULER's one in-context example (short noise context, 3-letter names, random value),
    as full prompt + " " + answer names + newline."""
    value = rng.randint(10000, 99999)
    names, stmts = _vt_chain(rng, hops, 3, value)
    ctx = "\n".join(_insert([NOISE_LINE] * 6, stmts, rng, keep_order=True))
    q = VT_TEMPLATE.format(context=ctx, query=value)
    return q + VT_ANSWER_PREFIX.format(num_v=hops + 1, query=value) + " " + " ".join(names) + "\n"


def vt_sample(encode: Encode, distance: int, length: int, seed: int, hops: int = 4) -> Sample:
    """RULER variable tracking (1 chain, 4 hops, noise haystack) with the chain's first
    statement ``distance`` tokens from the end; the other hops follow it, in order, at
    random lines between it and the question.

    (RULER replaces ". \\n" with ".\\n" in the context; no line here ends that way.)
    """
    rng = random.Random(seed)
    example = _vt_example(rng, hops)
    value = rng.randint(10000, 99999)
    names, stmts = _vt_chain(rng, hops, 5, value)
    prefix = VT_ANSWER_PREFIX.format(num_v=hops + 1, query=value)
    head, tail = VT_TEMPLATE.split("{context}")
    tail = tail.format(query=value)
    n = _pool_size(encode, length, NOISE_LINE)
    layout = _Layout(encode, example + head, tail + prefix, stmts[0], "\n")
    _, d0 = layout.measure([], [])
    hop_tok = sum(_unit_tokens(encode, s) for s in stmts[1:])
    span = max(0, (distance - d0 - hop_tok) // _unit_tokens(encode, NOISE_LINE))
    after_pool = _insert([NOISE_LINE] * span, stmts[1:], rng, keep_order=True) + [NOISE_LINE] * n
    before, after, n_tok, d = _place(layout, distance, length, after_pool, [NOISE_LINE] * n)
    if any(s not in after for s in stmts[1:]):  # distance too short to hold the chain: keep it all
        after = [u for u in after if u == NOISE_LINE] + stmts[1:]
        n_tok, d = layout.measure(before, after)
        while n_tok > length and before:
            before = before[1:]
            n_tok, d = layout.measure(before, after)
    text, _ = layout.text(before, after)
    inp = text[: len(text) - len(prefix)]
    return Sample("vt", inp, prefix, names, "string_match_all", TOKENS_TO_GENERATE["vt"], distance, d,
                  n_tok, seed, "noise", {"value": value})


def make_sample(task: str, encode: Encode, distance: int, length: int, seed: int = 42) -> Sample:
    """One deterministic sample of ``task`` (see ``TASKS``) for this tokenizer.

    Args:
        task: "passkey", a niah_* name, or "vt".
        encode: ``text -> token ids`` (the model's tokenizer, BOS included if it adds one).
        distance: tokens from the needle's first token to the end of the prompt.
        length: maximum prompt tokens; the haystack before the needle fills up to it.
        seed: Python ``random`` seed (RULER's default base seed is 42).
    """
    if isinstance(distance, bool) or not isinstance(distance, int) or distance < 1:
        raise LongattnError(f"distance must be a positive integer, got {distance!r}")
    if length < distance:
        raise LongattnError(f"length {length} is shorter than the needle distance {distance}")
    if task == "passkey":
        return passkey_sample(encode, distance, length, seed)
    if task == "vt":
        return vt_sample(encode, distance, length, seed)
    if task in NIAH_CONFIGS:
        return niah_sample(task, encode, distance, length, seed)
    raise LongattnError(f"unknown task '{task}'; known: {', '.join(TASKS)}")
