"""Tests for glasslm.tokenizers: the char and BPE tokenizers, BPE training, GPT-2's files.

The core BPE tests need no external files. Tests against GPT-2's released vocabulary, tiktoken
and tiny Shakespeare read $GLASSLM_DATA_DIR (layout: gpt2/gpt2_vocab.json, gpt2/gpt2_merges.txt,
tinyshakespeare.txt, tiktoken_cache/) and are skipped, saying why, when it is not there.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tracemalloc
from array import array
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glasslm.tokenizers import trainer as bpe
from glasslm.tokenizers.pretokens import PRETOKEN_PATTERN
from glasslm.tokenizers.trainer import train_bpe
from glasslm.tokenizers import (
    BPE_DESCRIPTOR_FILE,
    ENDOFTEXT,
    GPT2_SHA256,
    BPETokenizer,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    bytes_to_unicode,
    find_gpt2_files,
    get_tokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    to_hf_json,
    train_tokenizer,
    train_tokenizer_from_text,
)

EOT = "<|endoftext|>"  # written out: the tests check ENDOFTEXT against it
DATA_DIR = os.environ.get("GLASSLM_DATA_DIR")

# --------------------------------------------------------------------------- corpora and helpers

WORDS = ["the", "cat", "sat", "on", "mat", "low", "lower", "newest", "widest", "it's", "we've", "I'LL",
         "naïve", "café", "über", "日本語", "テキスト", "🙂", "👍🏽", "e\u0301", "3.14", "2024", "x", "-->", "  ", "\t"]


def make_corpus(n_words: int, seed: int = 0, specials: bool = True) -> str:
    """Deterministic mixed text: words, Unicode, numbers, whitespace runs, newlines, CRLF, specials."""
    rng = random.Random(seed)
    parts = []
    for _ in range(n_words):
        r = rng.random()
        if r < 0.08:
            parts.append("\n")
        elif r < 0.10:
            parts.append("\r\n")
        elif specials and r < 0.12:
            parts.append(EOT)
        else:
            parts.append(rng.choice(WORDS) + rng.choice([" ", " ", " ", "", ", ", ".  "]))
    return "".join(parts)


def naive_bpe(text: str, vocab_size: int, special_tokens: list[str]) -> list[tuple[bytes, bytes]]:
    """Reference trainer: recount every pair after every merge; ties -> greater (bytes, bytes)."""
    if special_tokens:
        pieces = regex.split("|".join(regex.escape(s) for s in sorted(special_tokens, key=len, reverse=True)), text)
    else:
        pieces = [text]
    words: Counter[tuple[bytes, ...]] = Counter()
    for piece in pieces:
        for pre in regex.findall(PRETOKEN_PATTERN, piece):
            words[tuple(bytes([b]) for b in pre.encode("utf-8"))] += 1
    merges = []
    while len(merges) < vocab_size - 256 - len(special_tokens):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        new_words: Counter[tuple[bytes, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return merges


@pytest.fixture(scope="module")
def small_bpe() -> BPETokenizer:
    return train_tokenizer_from_text(make_corpus(4000, seed=1), vocab_size=400, special_tokens=[EOT])


@pytest.fixture(scope="module")
def plain_bpe() -> BPETokenizer:
    """No special tokens: the stream can cut much closer to the end of what it has seen."""
    return train_tokenizer_from_text(make_corpus(4000, seed=1), vocab_size=400, special_tokens=[])


def data_file(*parts: str) -> Path:
    if not DATA_DIR:
        pytest.skip("GLASSLM_DATA_DIR is not set (it should point at the shared data directory)")
    path = Path(DATA_DIR, *parts)
    if not path.exists():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="module")
def gpt2_glasslm() -> BPETokenizer:
    return gpt2_tokenizer(data_file("gpt2").parent, backend="glasslm")


@pytest.fixture(scope="module")
def tiktoken_gpt2():
    """tiktoken's own GPT-2 encoding (the independent reference), loaded offline."""
    tiktoken = pytest.importorskip("tiktoken")
    cache = data_file("tiktoken_cache")
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as err:  # no cached files and no network
        pytest.skip(f"tiktoken could not load gpt2 offline from {cache}: {err}")
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_CACHE_DIR", None)
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


TORTURE = [
    "",
    " ",
    "Hello, world! It's 2024 — naïve café façade. Ünïcödé!",
    "emoji 🙂🙂 👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✨sparkles✨",
    "CJK 日本語のテキスト、中文字符，한국어 텍스트",
    "combining e\u0301 a\u0308 o\u0302\u0323 zalgo Z\u0351\u034b\u0352a\u0344l\u0303g\u0311o",
    "line one\r\nline two\r\n\r\nthree\rfour\n",
    "runs of spaces:     x      \t\t\ttabs\n\n\n\nnewlines   \n  \n\t \n",
    "contractions: it's we've they're I'm he'd she'll 'S 'VE 'LL 'Re don't y'all ''s",
    "numbers 3.14159 1,000,000 0x1F 1e-9 ١٢٣ ½ ²³ 10000000000",
    "symbols <<>> !== ->> ... --- ### @@@ $$$ %%% ^^^ &&& *** (((",
    "   leading and trailing   ",
    "\u00a0nbsp\u00a0 \u2028line sep\u2029para\u3000ideo\u200bzwsp\ufeffbom \x1c\x1d\x1e\x1f \x85 \x0b\x0c",
    "control \x00\x01\x07\x1b[31m ansi \x7f del",
    "mixed<|endoftext|>special<|endoftext|><|endoftext|> tokens <|endoftext|>",
    "<|endoftext|>",
    "almost <|endoftext| special <|endoftext|",
    "😀" * 50 + " " + "a" * 300 + " " + "1" * 40,
    "Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬…æ œ∑´®†¥¨ˆøπ“‘ ¡™£¢∞§¶•ªº–≠",
    "Cyrillic Привет мир, Greek Γειά σου, Arabic مرحبا بالعالم, Hebrew שלום, Hindi नमस्ते, Thai สวัสดี",
]

# --------------------------------------------------------------------------- interface, char


def test_all_kinds_satisfy_the_interface(small_bpe):
    assert isinstance(CharTokenizer.from_text("ab"), Tokenizer)
    assert isinstance(small_bpe, Tokenizer)


def test_endoftext_is_gpt2s_token_and_the_default_special():
    assert ENDOFTEXT == EOT
    assert train_tokenizer_from_text("ab ab ab", vocab_size=258).special_tokens == {EOT: 257}


def test_every_kind_refuses_ids_outside_its_vocabulary(small_bpe):
    hf = HFTokenizer.from_json(to_hf_json(CharTokenizer.from_text("abc")))
    for tok in (CharTokenizer.from_text("abc"), small_bpe, hf):
        for bad in ([tok.vocab_size], [-1]):
            with pytest.raises(ValueError, match=f"outside the vocabulary \\(size {tok.vocab_size}\\)"):
                tok.decode(bad)


@given(st.text(min_size=1))
@settings(max_examples=100, deadline=None)
def test_char_round_trip(text):
    tok = CharTokenizer.from_text(text)
    assert tok.decode(tok.encode(text)) == text
    assert list(tok.encode_iterable([text[:3], text[3:]])) == tok.encode(text)


def test_char_save_load_keeps_old_format(tmp_path):
    tok = CharTokenizer.from_text("hello wörld")
    tok.save(tmp_path)
    assert json.loads((tmp_path / "glasslm_char_tokenizer.json").read_text())["kind"] == "char"
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CharTokenizer) and again.chars == tok.chars
    with pytest.raises(ValueError, match="not in this tokenizer's vocabulary"):
        tok.encode("z")


def test_a_char_tokenizer_from_text_ends_with_endoftext_and_saves_it(tmp_path):
    tok = CharTokenizer.from_text("hello wörld")
    end = len(set("hello wörld"))
    assert tok.special_tokens == {EOT: end} and tok.vocab_size == end + 1
    # The special token's text is its one id, as in the BPE tokenizer; its characters need not be in the vocabulary.
    assert tok.encode(f"he{EOT}lo{EOT}") == tok.encode("he") + [end] + tok.encode("lo") + [end]
    assert tok.decode([0, end, 1]) == tok.chars[0] + EOT + tok.chars[1]
    tok.save(tmp_path)
    saved = json.loads((tmp_path / "glasslm_char_tokenizer.json").read_text())
    assert saved == {"kind": "char", "chars": tok.chars, "special_tokens": {EOT: end}}
    again = load_tokenizer(tmp_path)
    assert isinstance(again, CharTokenizer) and again.special_tokens == tok.special_tokens
    assert again.encode(f"ol{EOT}") == tok.encode(f"ol{EOT}") and again.vocab_size == tok.vocab_size
    small = BPETokenizer({i: bytes([i]) for i in range(256)}, [], special_tokens=[EOT])
    brackets = CharTokenizer.from_text("<|>endoftxh")
    for text in (f"{EOT}h{EOT}{EOT}", "<|endoftext|", f"<{EOT}>"):  # the same cut as BPE's
        ids = brackets.encode(text)
        assert [i == brackets.vocab_size - 1 for i in ids] == [i == 256 for i in small.encode(text)]


def test_a_char_tokenizer_file_from_before_special_tokens_loads_unchanged(tmp_path):
    chars = ["\n", " ", "a", "b"]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": chars}))
    tok = load_tokenizer(tmp_path)
    assert tok.special_tokens == {} and tok.vocab_size == 4
    assert tok.encode("ab \n") == [2, 3, 1, 0]
    with pytest.raises(ValueError, match="'<' is not in this tokenizer's vocabulary"):
        tok.encode(EOT)  # no end-of-text: its text is characters it does not have
    before = (tmp_path / "tokenizer.json").read_bytes()
    tok.save(tmp_path / "again")  # saved as it was, under the descriptor's own name now
    assert json.loads((tmp_path / "again" / "glasslm_char_tokenizer.json").read_bytes()) == json.loads(before)


@pytest.mark.parametrize("bad, message", [
    ({"<|endoftext|>": 3}, r"special token ids must follow the 2 characters \(2..2\), got"),
    ({"<|endoftext|>": "2"}, "special token ids must follow"),
    (["<|endoftext|>"], "\"special_tokens\" must map each special token to its id; got list"),
    ({"x": 2}, "special tokens must be distinct strings of two or more characters"),
])
def test_a_bad_char_tokenizer_file_is_named(tmp_path, bad, message):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": ["a", "b"], "special_tokens": bad}))
    with pytest.raises(ValueError, match=f"tokenizer.json: {message}"):
        load_tokenizer(tmp_path)


@given(st.lists(st.sampled_from(["a", "<", "|", "<|end", "oftext|>", EOT, "\n"]), max_size=12), st.data())
@settings(max_examples=200, deadline=None)
def test_char_encode_iterable_finds_special_tokens_cut_across_chunks(pieces, data):
    tok = CharTokenizer.from_text("a<|endoftext>\n")
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4)))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    assert list(tok.encode_iterable(chunks)) == tok.encode(text)
    assert tok.decode(tok.encode(text)) == text


# --------------------------------------------------------------------------- BPE training


def test_train_matches_naive_reference_without_specials():
    text = make_corpus(1500, seed=2, specials=False)
    vocab, merges = train_bpe(text, 256 + 150, num_workers=1)
    assert merges == naive_bpe(text, 256 + 150, [])
    assert len(vocab) == 256 + 150
    assert all(vocab[256 + r] == a + b for r, (a, b) in enumerate(merges))


def test_train_matches_naive_reference_with_specials():
    specials = [EOT, "<|pad|>"]
    text = make_corpus(1500, seed=3).replace("x", "<|pad|>")
    vocab, merges = train_bpe(text, 256 + 120 + 2, special_tokens=specials, num_workers=1)
    assert merges == naive_bpe(text, 256 + 120 + 2, specials)
    # Layout: bytes, merges, then specials in the order given.
    assert vocab[256 + 120] == EOT.encode() and vocab[256 + 121] == b"<|pad|>"
    # Special tokens were cut out before counting: no learned token holds a piece of one across text.
    assert not any(b"|>" in vocab[i] and len(vocab[i]) > 2 for i in range(256, 256 + 120))


@given(st.text(alphabet="ab c\n'sl", max_size=60), st.integers(0, 30))
@settings(max_examples=80, deadline=None)
def test_train_matches_naive_reference_on_random_tie_heavy_text(text, n_merges):
    # A tiny alphabet makes ties in pair counts common: the tie-break must match exactly.
    _, merges = train_bpe(text, 256 + n_merges, num_workers=1)
    assert merges == naive_bpe(text, 256 + n_merges, [])


def test_train_stops_when_pairs_run_out_and_rejects_tiny_vocab():
    vocab, merges = train_bpe("ab ab", 1000, num_workers=1)
    assert merges == naive_bpe("ab ab", 1000, []) and len(vocab) == 256 + len(merges)
    with pytest.raises(ValueError, match="smaller than 256"):
        train_bpe("ab", 256, special_tokens=[EOT])


@pytest.mark.slow
def test_training_is_deterministic_across_worker_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(bpe, "_PIECE_BYTES", 2000)  # force several pieces on a small corpus
    text = make_corpus(12000, seed=4)
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode("utf-8"))  # keep \r\n as is
    for specials in ([EOT], []):
        jobs = bpe._make_jobs([path], specials, n_pieces_hint=8)
        assert len(jobs) >= 4, "the corpus should be cut into several pieces"
        results = [train_bpe(text, 600, specials, num_workers=1)]
        for workers in (1, 2, 4):
            results.append(train_bpe(path, 600, specials, num_workers=workers))
            results.append(train_bpe(text, 600, specials, num_workers=workers))
        assert all(r == results[0] for r in results)
        assert results[0][1] == naive_bpe(text, 600, specials)


def test_file_and_text_cut_points_are_safe(tmp_path):
    # Counting piece by piece must give exactly the whole-text counts.
    text = make_corpus(5000, seed=5)
    path = tmp_path / "c.txt"
    path.write_bytes(text.encode())
    for specials in ([EOT], []):
        whole = bpe.count_pretokens(text, specials)
        cuts = bpe._cut_points_in_file(path, 16, specials)
        data = path.read_bytes()
        assert len(cuts) > 8
        pieces = Counter()
        for a, b in zip(cuts, cuts[1:]):
            pieces.update(bpe.count_pretokens(data[a:b].decode(), specials))
        assert pieces == whole
        text_cuts = bpe._cut_points_in_text(text, 16, specials)
        assert sum((bpe.count_pretokens(text[a:b], specials) for a, b in zip(text_cuts, text_cuts[1:])), Counter()) == whole


def test_train_tokenizer_writes_a_loadable_directory(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(make_corpus(2000, seed=6), encoding="utf-8")
    tok = train_tokenizer([str(corpus)], 350, [EOT], out_dir=tmp_path / "tok", num_workers=1)
    assert tok.vocab_size == 350 and tok.special_tokens == {EOT: 349}
    again = load_tokenizer(tmp_path / "tok")
    sample = make_corpus(300, seed=7)
    assert again.encode(sample) == tok.encode(sample)


def test_train_tokenizer_refuses_a_non_empty_out_dir_unless_overwrite(tmp_path):
    # As `glasslm train-tokenizer` does: refused before training, nothing in the directory touched.
    corpus = tmp_path / "c.txt"
    corpus.write_text(make_corpus(500, seed=8), encoding="utf-8")
    out = tmp_path / "tok"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"tokenizer directory .* is not empty \(notes\.txt\)"):
        train_tokenizer([corpus], 300, [EOT], out_dir=out, num_workers=1)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    with pytest.raises(ValueError, match="would overwrite the input"):
        train_tokenizer([corpus], 300, [EOT], out_dir=tmp_path, num_workers=1, overwrite=True)
    tok = train_tokenizer([corpus], 300, [EOT], out_dir=out, num_workers=1, overwrite=True)
    assert load_tokenizer(out).encode("the cat sat") == tok.encode("the cat sat")
    assert (out / "notes.txt").read_text() == "keep me"  # overwrite replaces files by name only
    # Saving again over its own earlier files also needs overwrite=True.
    with pytest.raises(ValueError, match="is not empty"):
        train_tokenizer([corpus], 300, [EOT], out_dir=out, num_workers=1)


# --------------------------------------------------------------------------- BPE encoding


def naive_encode(tok: BPETokenizer, text: str) -> list[int]:
    """Reference encoder: split specials (longest first), pre-tokenize, merge lowest rank first."""
    ids = []
    special_re = "|".join(regex.escape(s) for s in sorted(tok.special_tokens, key=len, reverse=True))
    pos = 0
    matches = list(regex.finditer(special_re, text)) if tok.special_tokens else []
    segments = []
    for m in matches:
        segments += [("text", text[pos:m.start()]), ("special", m.group())]
        pos = m.end()
    segments.append(("text", text[pos:]))
    rank = {pair: r for r, pair in enumerate(tok.merges)}
    to_id = {tok.token_bytes(i): i for i in reversed(range(tok.vocab_size)) if i not in tok.special_tokens.values()}
    for kind, seg in segments:
        if kind == "special":
            ids.append(tok.special_tokens[seg])
            continue
        for pre in regex.findall(PRETOKEN_PATTERN, seg):
            parts = [bytes([b]) for b in pre.encode()]
            while True:
                pairs = [(rank.get(p, 1 << 60), i) for i, p in enumerate(zip(parts, parts[1:]))]
                if not pairs or min(pairs)[0] == 1 << 60:
                    break
                _, i = min(pairs)
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            ids += [to_id[p] for p in parts]
    return ids


unicode_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)
tricky_text = st.lists(st.sampled_from(
    [EOT, "<|", "endoftext", "|>", " ", "  ", "\t", "\n", "\r\n", "'s", "'ll", "'", "s", "l", "e\u0301",
     "🙂", "👍🏽", "日本", "a", "the", " cat", "1", "23", "!", "\u00a0", "\u3000"]), max_size=40).map("".join)


@given(st.one_of(unicode_text, tricky_text))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_bpe_round_trip_and_matches_reference_encoder(small_bpe, text):
    ids = small_bpe.encode(text)
    assert small_bpe.decode(ids) == text
    assert ids == naive_encode(small_bpe, text)
    assert all(0 <= i < small_bpe.vocab_size for i in ids)


@pytest.mark.parametrize("which", ["specials", "plain"])
@given(text=st.one_of(unicode_text, tricky_text, st.lists(tricky_text, max_size=6).map("".join)),
       cuts=st.lists(st.integers(0, 240), max_size=10), flush=st.integers(1, 24))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_encode_iterable_equals_encode_for_any_chunking(small_bpe, plain_bpe, which, text, cuts, flush):
    # A tiny flush size makes the stream cut after nearly every chunk, so pre-tokens and special
    # tokens straddling chunk edges are exercised constantly.
    tok = small_bpe if which == "specials" else plain_bpe
    cuts = sorted(min(c, len(text)) for c in cuts)
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert list(tok.encode_iterable(chunks, flush_chars=flush)) == tok.encode(text)


def test_stream_holds_back_what_more_text_could_change(small_bpe, plain_bpe):
    # Prefixes that look complete but are not: "'l" + "l", whitespace runs, partial specials,
    # " \n" (one pre-token at the end of text, two before a letter), digit runs.
    for text in ["ab'l" + "l x", "a b   " + "  c", "x<|endof" + "text|>y", "x\n" + "\ny", "1 2" + "34",
                 "lower, \nlow café", "it's \n\n  \t'll\r\n'LL"]:
        text = "filler words here. " * 2 + text
        for tok in (small_bpe, plain_bpe):
            for k in range(len(text) + 1):
                got = list(tok.encode_iterable([text[:k], text[k:]], flush_chars=1))
                assert got == tok.encode(text), (text, k)


def test_special_tokens_longest_match_wins_and_never_merge():
    vocab = {i: bytes([i]) for i in range(256)}
    tok = BPETokenizer(vocab, [], special_tokens=[EOT, EOT + EOT, "<|end"])
    single, double, prefix = tok.special_tokens[EOT], tok.special_tokens[EOT + EOT], tok.special_tokens["<|end"]
    assert len({single, double, prefix}) == 3 and min(single, double, prefix) >= 256
    assert tok.encode(EOT * 3) == [double, single]
    assert tok.encode("a" + EOT * 2 + "b") == [97, double, 98]
    assert tok.encode("<|endo") == [prefix, 111]
    assert tok.decode(tok.encode("x" + EOT * 5 + "<|end")) == "x" + EOT * 5 + "<|end"
    # Text around a special never merges with it, even where merges exist for those bytes.
    trained = train_tokenizer_from_text(("hi" + EOT) * 200, 300, [EOT])
    ids = trained.encode("hi" + EOT + "hi")
    assert ids[1] == trained.special_tokens[EOT] and ids[0] == ids[2]


def test_decode_invalid_bytes_gives_replacement_character(small_bpe):
    assert small_bpe.decode([0xFF]) == "\ufffd"
    assert small_bpe.decode([ord("a"), 0xE2, 0x82, ord("b")]) == "a\ufffdb"  # truncated 3-byte char
    assert small_bpe.decode([0xC0, 0x80]) == "\ufffd\ufffd"  # overlong encoding
    assert small_bpe.decode(list("🙂".encode())[:2] + [ord("!")]) == "\ufffd!"  # half an emoji


def test_decode_rejects_ids_outside_vocab(small_bpe):
    for bad in ([small_bpe.vocab_size], [-1], [3, 10**9]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            small_bpe.decode(bad)
    with pytest.raises(ValueError, match="integers"):
        small_bpe.decode([1.5])


def test_decode_accepts_tensors(small_bpe):
    torch = pytest.importorskip("torch")
    ids = small_bpe.encode("the cat sat")
    assert small_bpe.decode(torch.tensor(ids)) == "the cat sat"


def test_pre_token_cache_is_bounded():
    tok = BPETokenizer({i: bytes([i]) for i in range(256)}, [], cache_size=10)
    tok.encode(" ".join(f"w{i}" for i in range(100)))
    assert len(tok._cache) <= 10


def test_constructor_validates_inputs():
    vocab = {i: bytes([i]) for i in range(256)}
    with pytest.raises(ValueError, match="0..len"):
        BPETokenizer({**vocab, 300: b"ab"}, [])
    with pytest.raises(ValueError, match="missing from vocab"):
        BPETokenizer(vocab, [(b"a", b"b")])
    with pytest.raises(ValueError, match="single-byte"):
        BPETokenizer({i: bytes([i + 1]) for i in range(255)}, [])


@pytest.mark.slow
def test_encode_iterable_streams_a_large_file_in_bounded_memory(small_bpe, tmp_path):
    path = tmp_path / "big.txt"
    rng = random.Random(8)
    with open(path, "w", encoding="utf-8", newline="") as f:
        for _ in range(40):
            f.write(make_corpus(25000, seed=rng.randrange(1 << 30)))
    size = path.stat().st_size
    bound = 1 << 20  # 1 MiB of Python allocations, against a file several times larger
    assert size > 4 * bound

    def digest(ids) -> tuple[str, int]:
        h, n = hashlib.sha256(), 0
        it = iter(ids)
        while batch := list(islice(it, 4096)):
            h.update(array("I", batch).tobytes())
            n += len(batch)
        return h.hexdigest(), n

    small_bpe.encode(make_corpus(3000, seed=9))  # warm the pre-token cache outside the measurement
    whole = digest(small_bpe.encode(path.read_bytes().decode("utf-8")))
    with open(path, encoding="utf-8", newline="") as f:
        tracemalloc.start()
        try:
            streamed = digest(small_bpe.encode_iterable(f))  # line by line
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < bound, f"peak {peak} bytes while streaming a {size}-byte file"
    assert streamed == whole
    with open(path, encoding="utf-8", newline="") as f:  # fixed-size blocks cut anywhere
        assert digest(small_bpe.encode_iterable(iter(lambda: f.read(10_000), ""))) == whole


# --------------------------------------------------------------------------- save / load / HF


def test_bpe_save_load_round_trip(small_bpe, tmp_path):
    small_bpe.save(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([BPE_DESCRIPTOR_FILE, "merges.txt", "vocab.json"])
    assert (tmp_path / "merges.txt").read_text().splitlines()[0] == "#version: 0.2"
    again = load_tokenizer(tmp_path)
    assert isinstance(again, BPETokenizer)
    assert again.merges == small_bpe.merges and again.special_tokens == small_bpe.special_tokens
    assert [again.token_bytes(i) for i in range(again.vocab_size)] == [small_bpe.token_bytes(i) for i in range(small_bpe.vocab_size)]
    text = make_corpus(500, seed=10)
    assert again.encode(text) == small_bpe.encode(text)
    assert get_tokenizer(tmp_path).encode(text) == small_bpe.encode(text)


def test_hugging_face_reads_our_files_with_identical_ids(small_bpe, tmp_path):
    hf = pytest.importorskip("tokenizers")
    small_bpe.save(tmp_path)
    theirs = hf.ByteLevelBPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    for text in [make_corpus(800, seed=11, specials=False)] + [t for t in TORTURE if EOT not in t]:
        assert theirs.encode(text).ids == small_bpe.encode_ordinary(text), text


def test_load_names_a_broken_hugging_face_tokenizer_json(tmp_path):
    # A readable one loads (tests/hf/test_hf_interop.py); a broken one is named, not a traceback.
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    with pytest.raises(ValueError, match="tokenizer.json: not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer found"):
        load_tokenizer(tmp_path / "nowhere")


def test_bytes_to_unicode_is_gpt2s_map():
    m = bytes_to_unicode()
    assert len(set(m.values())) == 256
    assert m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ" and m[0] == "Ā" and m[ord("A")] == "A"
    assert all(not c.isspace() and c.isprintable() for c in m.values())


def test_get_tokenizer_specs():
    assert isinstance(get_tokenizer("char", text="abc"), CharTokenizer)
    with pytest.raises(ValueError, match="text="):
        get_tokenizer("char")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("no-such-thing")


def test_missing_gpt2_files_say_what_to_put_where(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"gpt2_vocab\.json"):
        find_gpt2_files(tmp_path)
    monkeypatch.delenv("GLASSLM_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the rule's last resort, ~/.cache/glasslm, is empty
    with pytest.raises(FileNotFoundError, match="GLASSLM_DATA_DIR"):
        find_gpt2_files()
    (tmp_path / "encoder.json").write_text("{}")
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    assert find_gpt2_files(tmp_path) == (tmp_path / "encoder.json", tmp_path / "vocab.bpe")


# --------------------------------------------------------------------------- GPT-2 (shared data)


def test_shared_gpt2_files_are_the_released_ones():
    vocab_file, merges_file = find_gpt2_files(data_file("gpt2").parent)
    assert hashlib.sha256(vocab_file.read_bytes()).hexdigest() == GPT2_SHA256["encoder.json"]
    assert hashlib.sha256(merges_file.read_bytes()).hexdigest() in (GPT2_SHA256["vocab.bpe"], GPT2_SHA256["vocab.bpe (no header)"])


def test_gpt2_layout(gpt2_glasslm):
    assert gpt2_glasslm.vocab_size == 50257
    assert gpt2_glasslm.special_tokens == {EOT: 50256}
    assert gpt2_glasslm.encode("Hello world" + EOT) == [15496, 995, 50256]
    assert len(gpt2_glasslm.merges) == 50000


def test_gpt2_matches_tiktoken_on_tiny_shakespeare(gpt2_glasslm, tiktoken_gpt2):
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    expected = tiktoken_gpt2.encode(text)
    assert gpt2_glasslm.encode(text) == expected
    fast = gpt2_tokenizer(data_file("gpt2").parent, backend="tiktoken")
    assert fast.backend == "tiktoken" and fast.encode(text) == expected
    assert gpt2_glasslm.decode(expected) == text


@pytest.mark.parametrize("text", TORTURE)
def test_gpt2_matches_tiktoken_on_torture_set(gpt2_glasslm, tiktoken_gpt2, text):
    assert gpt2_glasslm.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all")
    assert gpt2_glasslm.encode_ordinary(text) == tiktoken_gpt2.encode_ordinary(text)
    assert gpt2_glasslm.decode(gpt2_glasslm.encode(text)) == text


def test_gpt2_backends_agree_and_auto_picks_tiktoken(gpt2_glasslm):
    pytest.importorskip("tiktoken")
    auto = gpt2_tokenizer(data_file("gpt2").parent)
    assert auto.backend == "tiktoken"
    text = "".join(TORTURE) * 3
    assert auto.encode(text) == gpt2_glasslm.encode(text)
    assert list(auto.encode_iterable(text.splitlines(keepends=True), flush_chars=64)) == gpt2_glasslm.encode(text)


def test_gpt2_save_load_and_hugging_face(gpt2_glasslm, tmp_path):
    hf = pytest.importorskip("tokenizers")
    gpt2_glasslm.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.name == "gpt2" and again.vocab_size == 50257 and again.special_tokens == {EOT: 50256}
    text = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:20000] + "".join(t for t in TORTURE if EOT not in t)
    theirs = hf.ByteLevelBPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert again.encode(text) == gpt2_glasslm.encode(text) == theirs.encode(text).ids
    assert get_tokenizer("gpt2", data_dir=data_file("gpt2").parent, backend="glasslm").encode(text) == again.encode(text)
