"""Byte-level BPE training from scratch (`train_bpe`), and `train_tokenizer`, which makes the trained
vocabulary a `BPETokenizer` and saves it.

Training has three stages:

1. **Chunking.** The corpus is cut into pieces at points where pre-tokenization cannot differ from
   doing the whole text at once: the start of a special token, or just after a newline that sits
   between two printable ASCII characters (`"x\\ny"`); see `safe_cut_pattern`.
2. **Counting** (in parallel worker processes): each piece is split at special tokens, the rest is
   cut into pre-tokens with GPT-2's regex (`glasslm.tokenizers.pretokens`), and counted once into a
   `Counter[str]`. Merges never cross a pre-token, so the corpus is just "unique pre-token x count".
3. **Merging.** Each unique pre-token becomes a list of token ids (its UTF-8 bytes at first). Pair
   counts are kept in a dict and updated incrementally: a merge only touches the words that contain
   the merged pair (found through a pair -> word-indices index). The most frequent pair comes from a
   heap with lazy invalidation; ties go to the lexicographically greater `(bytes_a, bytes_b)`.

Vocabulary id layout: ids `0..255` are the single bytes (id == byte value), then one id per merge
in the order learned (`256 + rank`), then the special tokens in the order given. This is GPT-2's
shape too (bytes, 50000 merges, then `<|endoftext|>` = 50256), though GPT-2 numbers its 256 byte
tokens in a different order. ("(l,o)" and "(o,w)" tie below; the greater pair wins.)

Example:
    >>> vocab, merges = train_bpe("low lower lowest low low", vocab_size=259, num_workers=1)
    >>> merges
    [(b'o', b'w'), (b'l', b'ow'), (b' ', b'low')]
    >>> vocab[258]
    b' low'
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from glasslm.locations import check_output_dir
from glasslm.tokenizers.base import ENDOFTEXT
from glasslm.tokenizers.bpe import BPETokenizer
from glasslm.tokenizers import pretokens
from glasslm.tokenizers.pretokens import safe_cut_pattern, special_split_pattern

# Files are counted in pieces of roughly this many bytes, so workers stay balanced.
_PIECE_BYTES = 1 << 20
# Below this many bytes of input, starting worker processes costs more than it saves.
_PARALLEL_MIN_BYTES = 4 << 20


# --------------------------------------------------------------------------- counting


def count_pretokens(text: str, special_tokens: Sequence[str] = ()) -> Counter[str]:
    """Counts of GPT-2 pre-tokens in `text`, after removing (and splitting at) special tokens.

    Example:
        >>> count_pretokens("the cat<|eot|>the", ["<|eot|>"])
        Counter({'the': 2, ' cat': 1})
    """
    splitter = special_split_pattern(special_tokens)
    pieces = splitter.split(text) if splitter else [text]
    counts: Counter[str] = Counter()
    for piece in pieces:
        counts.update(pretokens.PRETOKEN_RE.findall(piece))
    return counts


# --------------------------------------------------------------------------- chunking


def _cut_points_in_text(text: str, n_pieces: int, special_tokens: Sequence[str]) -> list[int]:
    """Safe cut positions near `len(text) * k / n_pieces` (always including 0 and len(text))."""
    pattern = safe_cut_pattern(special_tokens)
    cuts = [0]
    for k in range(1, n_pieces):
        target = max(cuts[-1], len(text) * k // n_pieces)
        match = pattern.search(text, target)
        if match is None:
            break
        if match.start() > cuts[-1]:
            cuts.append(match.start())
    cuts.append(len(text))
    return cuts


def _cut_points_in_file(path: Path, n_pieces: int, special_tokens: Sequence[str]) -> list[int]:
    """Byte offsets of safe cuts in a UTF-8 file, found by seeking near evenly spaced targets and
    scanning forward in blocks (overlapping by the longest special token) to the next safe cut."""
    pattern = safe_cut_pattern(special_tokens, as_bytes=True)
    overlap = max([len(s.encode()) for s in special_tokens] + [2])
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, n_pieces):
            pos = max(cuts[-1], size * k // n_pieces)
            found = None
            while found is None and pos < size:
                # Start one byte early so the newline rule can see the character before `pos`.
                start = max(pos - 1, 0)
                f.seek(start)
                block = f.read(1 << 16)
                match = pattern.search(block, pos - start)
                if match is not None:
                    found = start + match.start()
                elif len(block) < (1 << 16):
                    break
                else:
                    pos = start + len(block) - overlap
            if found is None:
                break
            if found > cuts[-1]:
                cuts.append(found)
    cuts.append(size)
    return cuts


def _count_job(job: tuple) -> Counter[str]:
    """Worker: count pre-tokens in one piece, given as ("text", str) or ("file", path, start, end)."""
    if job[0] == "text":
        _, text, specials = job
    else:
        _, path, start, end, specials = job
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} is not valid UTF-8 (byte {start + err.start}): {err.reason}") from None
    return count_pretokens(text, specials)


def _make_jobs(sources: list[str | Path], special_tokens: Sequence[str], n_pieces_hint: int) -> list[tuple]:
    jobs: list[tuple] = []
    specials = tuple(special_tokens)
    for source in sources:
        if isinstance(source, Path):
            size = source.stat().st_size
            n = max(1, min(n_pieces_hint, size // _PIECE_BYTES + 1)) if n_pieces_hint > 1 else 1
            cuts = _cut_points_in_file(source, n, specials)
            jobs += [("file", str(source), a, b, specials) for a, b in zip(cuts, cuts[1:])]
        else:
            n = max(1, min(n_pieces_hint, len(source) // _PIECE_BYTES + 1)) if n_pieces_hint > 1 else 1
            cuts = _cut_points_in_text(source, n, specials)
            jobs += [("text", source[a:b], specials) for a, b in zip(cuts, cuts[1:])]
    return jobs


_FILE_SUFFIXES = (".txt", ".text", ".md", ".json", ".jsonl", ".csv", ".tsv", ".xml", ".html", ".py")


def _resolve_str(item: str) -> str | Path:
    """A str naming an existing file is that file; one that only looks like a file name is refused."""
    if len(item) < 4096 and "\n" not in item and os.path.isfile(item):
        return Path(item)
    looks_like_path = (item.strip() == item and item and not any(c.isspace() for c in item)
                       and (os.sep in item or "/" in item or item.lower().endswith(_FILE_SUFFIXES)))
    if looks_like_path:
        raise FileNotFoundError(f"no file {item} to train on; to train on this string itself, pass text=...")
    return item


def _normalize_sources(text_or_paths) -> list[str | Path]:
    if isinstance(text_or_paths, (str, os.PathLike)):
        text_or_paths = [text_or_paths]
    sources: list[str | Path] = []
    for item in text_or_paths:
        if isinstance(item, os.PathLike):
            path = Path(item)
            if not path.is_file():
                raise FileNotFoundError(f"training file not found: {path}")
            sources.append(path)
        elif isinstance(item, str):
            sources.append(item)
        else:
            raise TypeError(f"expected text (str) or a path (pathlib.Path), got {type(item).__name__}")
    return sources


def count_corpus(text_or_paths, special_tokens: Sequence[str] = (), num_workers: int | None = None) -> Counter[str]:
    """Pre-token counts over a corpus: `str` items are text, `os.PathLike` items are UTF-8 files.

    `num_workers=None` picks one process for small inputs and up to `os.cpu_count()` otherwise; the
    result does not depend on it.

    Example:
        >>> count_corpus(["a b", "a"], num_workers=1)
        Counter({'a': 2, ' b': 1})
    """
    sources = _normalize_sources(text_or_paths)
    total_bytes = sum(s.stat().st_size if isinstance(s, Path) else len(s) for s in sources)
    if num_workers is None:
        num_workers = 1 if total_bytes < _PARALLEL_MIN_BYTES else (os.cpu_count() or 1)
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    # A few pieces per worker so an uneven split does not leave a process idle.
    jobs = _make_jobs(sources, special_tokens, n_pieces_hint=1 if num_workers == 1 else 4 * num_workers)
    if num_workers == 1 or len(jobs) == 1:
        results = map(_count_job, jobs)
        return _sum_counters(results)
    with _worker_context().Pool(min(num_workers, len(jobs))) as pool:
        return _sum_counters(pool.imap_unordered(_count_job, jobs))


def _worker_context() -> multiprocessing.context.BaseContext:
    """A process context that is safe to use from a program that already runs threads.

    Plain fork copies locks held by other threads (tqdm's monitor, a server, BLAS pools) into the
    child, which can then wait on them forever; forkserver forks from a clean single-threaded server
    that imported this module once, so workers still start in milliseconds. Spawn where it is missing.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def _sum_counters(counters: Iterable[Counter[str]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for c in counters:
        total.update(c)
    return total


# --------------------------------------------------------------------------- merging


def _reverse_order_key(token: bytes) -> bytes:
    """A bytes key whose order is the *reverse* of `token`'s lexicographic order.

    `heapq` pops the smallest item, but ties must go to the greatest pair of byte strings. Each
    byte x becomes the two bytes of (256 - x) and a terminator 257 is appended, so a smaller byte
    sorts later and a prefix (which is smaller) sorts after its extensions. Keys of concatenations
    are cheap: key(a + b) == key(a)[:-2] + key(b).
    """
    return b"".join((256 - x).to_bytes(2, "big") for x in token) + (257).to_bytes(2, "big")


def merge_counts(word_counts: dict[bytes, int], num_merges: int) -> list[tuple[bytes, bytes]]:
    """Learn up to `num_merges` BPE merges from pre-tokens (as bytes) and their counts.

    Stops early when no pair occurs any more. Ties in count go to the greater (bytes_a, bytes_b).

    Example:
        >>> merge_counts({b"abab": 2, b"ab": 1}, 2)
        [(b'a', b'b'), (b'ab', b'ab')]
    """
    tokens: list[bytes] = [bytes([i]) for i in range(256)]  # id -> bytes
    keys: list[bytes] = [_reverse_order_key(t) for t in tokens]  # id -> reversed-order key
    words: list[list[int]] = []
    freqs: list[int] = []
    for word, count in word_counts.items():
        if len(word) > 1:  # single bytes never take part in a pair
            words.append(list(word))
            freqs.append(count)

    counts: defaultdict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # may hold stale indices (checked on use)
    for w, (word, f) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            counts[pair] += f
            where[pair].add(w)
    # Heap entries: (-count, key(a), key(b), a, b). An entry may be stale (its pair's count has
    # dropped since); every pair with a positive count has at least one entry whose recorded
    # count is >= its current count, so the first entry popped that is up to date is the maximum.
    heap = [(-c, keys[a], keys[b], a, b) for (a, b), c in counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < num_merges and heap:
        neg, _, _, a, b = heapq.heappop(heap)
        current = counts.get((a, b), 0)
        if current != -neg:
            if 0 < current < -neg:  # count went down: re-file it under its true count
                heapq.heappush(heap, (-current, keys[a], keys[b], a, b))
            continue
        new = len(tokens)
        tokens.append(tokens[a] + tokens[b])
        keys.append(keys[a][:-2] + keys[b])
        merges.append((tokens[a], tokens[b]))
        _apply_merge(words, freqs, counts, where, heap, keys, a, b, new)
    return merges


def _apply_merge(words, freqs, counts, where, heap, keys, a: int, b: int, new: int) -> None:
    """Merge (a, b) -> new in every word that has it, updating pair counts, index and heap.

    Only the pairs beside each merge site change: (left, a) becomes (left, new) and (b, right)
    becomes (new, right). Where two merge sites touch ("a b a b"), the pair between them,
    (b, a) -> (new, new), is handled once, by the second site's left side.
    """
    delta: dict[tuple[int, int], int] = defaultdict(int)
    for w in where.pop((a, b)):
        word = words[w]
        n = len(word)
        f = freqs[w]
        out: list[int] = []
        i = 0
        while i < n:
            if word[i] != a or i + 1 == n or word[i + 1] != b:
                out.append(word[i])
                i += 1
                continue
            if out:
                delta[(word[i - 1], a)] -= f
                pair = (out[-1], new)
                delta[pair] += f
                where[pair].add(w)
            j = i + 2
            if j < n and not (word[j] == a and j + 1 < n and word[j + 1] == b):
                right = word[j]
                delta[(b, right)] -= f
                pair = (new, right)
                delta[pair] += f
                where[pair].add(w)
            out.append(new)
            i = j
        if len(out) < n:  # else a stale index entry: the word no longer has the pair
            words[w] = out
    # Every occurrence was merged, and merging left to right leaves no (a, b) behind.
    counts.pop((a, b), None)
    delta.pop((a, b), None)
    for pair, d in delta.items():
        if d == 0:
            continue
        c = counts.get(pair, 0) + d
        if c > 0:
            counts[pair] = c
            if d > 0:
                heapq.heappush(heap, (-c, keys[pair[0]], keys[pair[1]], pair[0], pair[1]))
        else:
            counts.pop(pair, None)


def train_bpe(
    text_or_paths=None,
    vocab_size: int | None = None,
    special_tokens: Sequence[str] = (),
    num_workers: int | None = None,
    *,
    text: str | None = None,
    path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE vocabulary.

    Args:
        text_or_paths: a file path (`pathlib.Path` or other `os.PathLike`), text (`str`), or a list
            mixing both. A `str` that names an existing file is that file; a `str` that looks like
            a file name (no whitespace, with a path separator or a suffix such as .txt) but names no
            file is refused, so a mistyped path never trains on its own characters. To say which one
            you mean, pass `text=` or `path=` instead.
        vocab_size: total size including the 256 bytes and the special tokens. Training stops
            early (smaller vocabulary) if the corpus runs out of pairs.
        special_tokens: strings removed from the training text before counting (never merged
            across, never part of a learned token); they get the last ids.
        num_workers: processes for pre-tokenization (None: automatic). Results never depend on it.
        text: the training text itself (never read as a file name).
        path: a file (str or path) or a list of files to train on.

    Returns:
        (vocab, merges): vocab maps id -> bytes with the layout described in the module docstring;
        merges lists the learned pairs in order, merge r producing id 256 + r.

    Example:
        >>> vocab, merges = train_bpe(text="aaab<|x|>aaab", vocab_size=258, special_tokens=["<|x|>"], num_workers=1)
        >>> merges, vocab[257]
        ([(b'a', b'a')], b'<|x|>')
        >>> train_bpe("corpus/missing.txt", 300)
        Traceback (most recent call last):
        ...
        FileNotFoundError: no file corpus/missing.txt to train on; to train on this string itself, pass text=...
    """
    if vocab_size is None:
        raise TypeError("train_bpe needs vocab_size")
    sources = _training_sources(text_or_paths, text, path)
    specials = list(dict.fromkeys(special_tokens))
    num_merges = vocab_size - 256 - len(specials)
    if num_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than 256 bytes + {len(specials)} special tokens")
    counts = count_corpus(sources, specials, num_workers)
    merges = merge_counts({piece.encode("utf-8"): c for piece, c in counts.items()}, num_merges)
    return bpe_vocabulary(merges, specials), merges


def _training_sources(text_or_paths, text: str | None, path) -> list[str | os.PathLike]:
    """The one corpus argument `train_bpe` was given, as a list of texts (str) and files (Path)."""
    given = [name for name, value in (("text_or_paths", text_or_paths), ("text", text), ("path", path))
             if value is not None]
    if len(given) != 1:
        raise TypeError(f"train_bpe takes exactly one of text_or_paths, text= or path=; got {given or 'none'}")
    if text is not None:
        if not isinstance(text, str):
            raise TypeError(f"text= takes a str, got {type(text).__name__}")
        return [text]
    if path is not None:
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        return [Path(p) for p in paths]
    items = [text_or_paths] if isinstance(text_or_paths, (str, os.PathLike)) else text_or_paths
    return [_resolve_str(item) if isinstance(item, str) else item for item in items]


def bpe_vocabulary(merges: Sequence[tuple[bytes, bytes]], special_tokens: Sequence[str] = ()) -> dict[int, bytes]:
    """The id -> bytes layout of a trained BPE: the 256 bytes, one id per merge, then the specials.

    Example:
        >>> vocab = bpe_vocabulary([(b"a", b"b")], ["<s>"])
        >>> len(vocab), vocab[97], vocab[256], vocab[257]
        (258, b'a', b'ab', b'<s>')
    """
    vocab = {i: bytes([i]) for i in range(256)}
    for r, (x, y) in enumerate(merges):
        vocab[256 + r] = x + y
    for s in special_tokens:
        vocab[len(vocab)] = s.encode("utf-8")
    return vocab


# --------------------------------------------------------------------------- tokenizers


def train_tokenizer(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    vocab_size: int,
    special_tokens: Sequence[str] = (ENDOFTEXT,),
    out_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
    overwrite: bool = False,
) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on UTF-8 text files and (if `out_dir`) save it there.

    `paths` are file names (plain strings here mean paths); see `train_bpe`. Like
    `glasslm train-tokenizer`, this refuses, before training, an `out_dir` that is a file, holds an
    input, or is a non-empty directory, unless `overwrite=True` (then the tokenizer's files are
    written over whatever has their names).

    Example:
        >>> import tempfile, pathlib
        >>> from glasslm.tokenizers import load_tokenizer
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "a.txt").write_text("to be or not to be " * 50)
        >>> tok = train_tokenizer([d / "a.txt"], vocab_size=300, out_dir=d / "tok")
        >>> load_tokenizer(d / "tok").encode("to be") == tok.encode("to be")
        True
        >>> train_tokenizer([d / "a.txt"], vocab_size=300, out_dir=d / "tok")
        Traceback (most recent call last):
        ...
        ValueError: tokenizer directory ... is not empty (glasslm_tokenizer.json, merges.txt, vocab.json); ...
    """
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    if out_dir is not None:
        check_output_dir(out_dir, overwrite, inputs=paths, what="tokenizer")
    tok = BPETokenizer(*train_bpe(paths, vocab_size, special_tokens, num_workers), list(special_tokens))
    if out_dir is not None:
        tok.save(out_dir)
    return tok


def train_tokenizer_from_text(text: str, vocab_size: int, special_tokens: Sequence[str] = (ENDOFTEXT,)) -> BPETokenizer:
    """Like `train_tokenizer`, for text already in memory (handy in tests and notebooks).

    Example:
        >>> tok = train_tokenizer_from_text("the cat sat on the mat " * 20, vocab_size=270)
        >>> tok.decode(tok.encode("the rat<|endoftext|>"))
        'the rat<|endoftext|>'
    """
    vocab, merges = train_bpe(text=text, vocab_size=vocab_size, special_tokens=special_tokens, num_workers=1)
    return BPETokenizer(vocab, merges, list(special_tokens))
