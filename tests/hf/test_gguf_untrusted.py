"""A GGUF file is untrusted input: the hostile files issue 46 found (each once a traceback, a hang or
a 34 GB allocation) give one line naming what is wrong from `glasslm info`, `generate` and `convert
--from-gguf`; and 300 random mutations of two small valid files (tests/hf/gguf_fuzz.py) give no
traceback, no hang and no allocation past a fixed allowance, in a child process that enforces both."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from glasslm.cli import main
from glasslm.hf.gguf.exporter import export_gguf
from glasslm.presets import get_preset
from tests.hf.gguf_bytes import FLOAT32, STRING, UINT32, UINT64, parse
from tests.hf.test_gguf import TEMPLATE, bpe, perturbed  # noqa: F401 (bpe: the shared fixture)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_file(bpe, tmp_path_factory):
    """A small valid GGUF: a Llama with grouped heads, Llama 3's rope scaling (rope_freqs), q8_0
    matrices and f32 norms, a BPE vocabulary and a chat template (118 KB)."""
    model = perturbed(get_preset("llama-tiny", vocab_size=bpe.vocab_size, n_layers=2, d_model=64, n_heads=4,
                                 n_kv_heads=2, d_mlp=96, context_length=64, rope_scaling="llama3",
                                 rope_original_context=16))
    return export_gguf(model, tmp_path_factory.mktemp("base") / "base.gguf", bpe, "q8_0", chat_template=TEMPLATE)


def _drop_key_length(raw):
    raw.drop("llama.attention.key_length")  # (then head_count divides the width: 0 was a ZeroDivisionError)
    raw.set("llama.attention.head_count", UINT32, 0)


CASES = {
    # (change to a valid file's parts, what the one line says)
    "alignment 0": (lambda raw: raw.set("general.alignment", UINT32, 0), "general.alignment is 0; it must be a power of two"),
    "head count 0": (_drop_key_length, "llama.attention.head_count is 0; it must be a whole number from 1"),
    "no token embedding": (lambda raw: setattr(raw, "tensors", [t for t in raw.tensors if t.name != "token_embd.weight"]),
                           "has no tensor 'token_embd.weight'"),
    "2**31 blocks": (lambda raw: raw.set("llama.block_count", UINT32, 2 ** 31),
                     "llama.block_count is 2147483648; it must be a whole number from 1 to 4,096"),
    "blocks as a float": (lambda raw: raw.set("llama.block_count", FLOAT32, 2.0), "llama.block_count is 2.0"),
    "more blocks than tensors": (lambda raw: raw.set("llama.block_count", UINT32, 4000),
                                 "llama.block_count is 4,000, but the file holds 22 tensors"),
    # (2**32, 2**32) f32 elements: 2**66 bytes, 0 in 64-bit arithmetic, which passed the bounds check.
    "byte count wraps": (lambda raw: setattr(raw.tensor("blk.0.ffn_up.weight"), "dims", [2 ** 32, 2 ** 32]),
                         "tensor blk.0.ffn_up.weight (19,599,665,578,316,398,592 bytes at"),
    "context of 2**40": (lambda raw: raw.set("llama.context_length", UINT64, 2 ** 40),
                         "llama.context_length is 1,099,511,627,776, past the 1,048,576 glasslm reads unasked"),
    "width past the tensors": (lambda raw: raw.set("llama.embedding_length", UINT32, 128),
                               "the metadata describes a model whose embed.weight is (320, 128), but the file holds "
                               "token_embd.weight (320, 64)"),
    "tokens without types": (lambda raw: raw.set("tokenizer.ggml.token_type", 9, (5, [1, 1])),
                             "tokenizer.ggml.token_type has 2 entries for 320 tokens"),
    # (glasslm's exporter wrote this before issue 46; llama.cpp stops at an unknown type: refused by name)
    "a rope scaling llama.cpp lacks": (lambda raw: raw.set("llama.rope.scaling.type", STRING, "llama3"),
                                       "rope.scaling.type 'llama3' is not supported"),
    "linear scaling without a factor": (lambda raw: raw.set("llama.rope.scaling.type", STRING, "linear"),
                                        "rope.scaling.type is 'linear' but the file states no rope.scaling.factor"),
    "unknown ggml type": (lambda raw: setattr(raw.tensor("blk.0.ffn_up.weight"), "ggml_type", 33),
                          "tensor blk.0.ffn_up.weight has ggml type 33, which the gguf package does not know"),
}
COMMANDS = {
    "info": lambda path, out: ["info", "--checkpoint", str(path)],
    "generate": lambda path, out: ["generate", "--checkpoint", str(path), "--prompt", "ab", "--max-new-tokens", "2"],
    "convert": lambda path, out: ["convert", "--from-gguf", str(path), "--out", str(out)],
}


@pytest.mark.parametrize("case", CASES)
def test_the_hostile_files_issue_46_found_get_one_line_naming_the_fault(case, base_file, tmp_path, capsys):
    raw = parse(base_file.read_bytes())
    change, message = CASES[case]
    change(raw)
    path = tmp_path / "hostile.gguf"
    path.write_bytes(raw.to_bytes())
    for command, argv in COMMANDS.items():
        assert main(argv(path, tmp_path / "out")) == 1, command
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"glasslm {command}: error: {path}"), err
        assert message in err[0], err[0]
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("content", [b"", b"GGUX" + b"\0" * 60, b"GG"])
def test_an_empty_file_or_bad_magic_is_not_a_gguf_file(content, tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    for command, argv in COMMANDS.items():
        assert main(argv(path, tmp_path / "out")) == 1
        err = capsys.readouterr().err.strip()
        expected = "it is empty" if not content else "it does not start with the bytes 'GGUF'"
        assert err == f"glasslm {command}: error: {path} is not a GGUF file ({expected})"


def test_a_file_named_by_its_context_length_loads_with_a_shorter_one(base_file, tmp_path, capsys):
    """A context past the cap is read when the caller chooses one (the error says how)."""
    raw = parse(base_file.read_bytes())
    raw.set("llama.context_length", UINT64, 2 ** 21)
    path = tmp_path / "long.gguf"
    path.write_bytes(raw.to_bytes())
    assert main(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "out"), "--context-length", "64"]) == 0
    assert "kept in their blocks" in capsys.readouterr().out


STRING_ARRAYS = {
    # (the strings' bytes, whether they are read at once; else by the one-at-a-time loop)
    "plain and empty": ([b"a", b"", b"\xc4\xa0the", "\u6771\u4eac".encode(), b"", b"x" * 70_000], True),
    "a zero byte inside": ([b"a", b"b\0c", b"d"], False),
    "bytes that are not UTF-8": ([b"a", b"\xff", b"\xe2\x82", b"\xe2\x82\xac"], False),
}


@pytest.mark.parametrize("case", STRING_ARRAYS)
def test_a_string_array_reads_as_each_string_decoded_alone(case):
    """A vocabulary's strings (read at once where that is exact) are each one's bytes decoded on its
    own, invalid UTF-8 as replacement characters, and the next value is read from where they end."""
    from glasslm.hf.gguf.reader import _Cursor

    items, at_once = STRING_ARRAYS[case]
    raw = b"".join(struct.pack("<Q", len(item)) + item for item in items) + struct.pack("<I", 7)
    cursor = _Cursor(memoryview(raw))
    assert (cursor._joined_strings(len(items)) is not None) == at_once
    cursor.offset = 0
    assert cursor.strings(len(items)) == [item.decode("utf-8", errors="replace") for item in items]
    assert cursor.take("<I") == 7


@pytest.mark.parametrize("cut", [3, 12, "huge"])  # inside a length; inside the last string; a length 2**64 - 1
def test_a_string_array_running_past_the_end_is_refused_by_name(cut):
    from glasslm.hf.gguf.reader import _Cursor

    raw = b"".join(struct.pack("<Q", len(item)) + item for item in (b"ab", b"cdef"))
    raw = struct.pack("<Q", 2 ** 64 - 1) + raw if cut == "huge" else raw[:-cut]
    with pytest.raises(ValueError, match="runs past the end|needs more bytes than the file has left"):
        _Cursor(memoryview(raw)).strings(2)


@pytest.fixture(scope="module")
def gemma2_file(bpe, tmp_path_factory):
    """A second shape for the mutations: Gemma 2 (soft-caps, windows on even layers, 1 + w norm gains), f16."""
    model = perturbed(get_preset("gemma3-270m", vocab_size=bpe.vocab_size, n_layers=2, d_model=32, n_heads=2,
                                 n_kv_heads=1, d_head=16, d_mlp=64, context_length=64, qk_norm=False,
                                 rope_local_theta=None, sliding_window=8, global_layers=(1,), attn_scale=None, attn_softcap=20.0,
                                 logit_softcap=10.0))
    return export_gguf(model, tmp_path_factory.mktemp("gemma2") / "gemma2.gguf", bpe, "f16")


@pytest.mark.slow  # ~2.5 minutes: 300 files, each through info and generate, every fourth through convert
def test_random_mutations_give_no_traceback_hang_or_oversized_allocation(base_file, gemma2_file, tmp_path):
    from tests.hf.gguf_fuzz import mutant

    raws = [parse(base_file.read_bytes()), parse(gemma2_file.read_bytes())]
    files, changes = [], {}
    for seed in range(300):  # two of three from the Llama 3 file, one from the Gemma 2 file
        data, change = mutant(raws[seed % 3 == 2], seed)
        path = tmp_path / f"mutant-{seed:03d}.gguf"
        path.write_bytes(data)
        files.append(str(path))
        changes[str(path)] = change
    results = tmp_path / "results.jsonl"
    # The child allows itself 256 MiB past what it held before the first file (the largest allocation
    # a valid file of this model makes is its float32 copy and rotary tables, a few MiB) and 20 s a
    # file (0.2 s is typical; 20 s leaves room for a loaded machine).
    child = subprocess.run([sys.executable, "-m", "tests.hf.gguf_fuzz", *files, "--results", str(results),
                            "--warm", str(base_file), "--memory-mib", "256", "--seconds", "20"],
                           cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert child.returncode == 0, f"the child stopped (a hang or a crash) at:\n{child.stderr[-3000:]}"
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(records) == len(files)
    outcomes = {"refused": 0, "loaded": 0}
    for record in records:
        change = changes[record["file"]]
        for run in record["runs"]:
            what = f"{Path(record['file']).name} ({change}), {run['argv']}: {run}"
            assert run["escaped"] is None, f"a traceback: {what}"
            assert run["code"] in (0, 1), what
            errors = [line for line in run["stderr"] if "error" in line.lower() or "Traceback" in line]
            if run["code"] == 1:
                assert len(errors) == 1 and errors[0].startswith(f"glasslm {run['argv']}: error: "), what
                assert "allocate" not in errors[0] and "MemoryError" not in errors[0], f"an oversized allocation: {what}"
            else:
                assert not errors, what
        outcomes["refused" if record["runs"][0]["code"] else "loaded"] += 1
    # The mutations reach past the header checks: many files are refused, and some still load.
    assert outcomes["refused"] > 150 and outcomes["loaded"] > 30, outcomes
