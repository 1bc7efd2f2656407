"""`glasslm fetch gpt2`: GPT-2's tokenizer files from their public URLs (checked against sha256s
in the dataset registry), or from a local folder, into the place gpt2_tokenizer() looks."""

import io
import shutil
import urllib.request

import pytest

from glasslm.cli import main
from glasslm.data import FILE_SETS, fetch_dataset
from glasslm.tokenizers import gpt2_tokenizer


@pytest.fixture
def released_gpt2(data_dir, tmp_path):
    """GPT-2's two files under the names OpenAI released them with."""
    shared = data_dir / "gpt2"
    if not (shared / "gpt2_vocab.json").is_file():
        pytest.skip(f"{shared} lacks GPT-2's files")
    folder = tmp_path / "release"
    folder.mkdir()
    shutil.copy(shared / "gpt2_vocab.json", folder / "encoder.json")
    shutil.copy(shared / "gpt2_merges.txt", folder / "vocab.bpe")
    return folder


def test_a_fresh_data_directory_gets_gpt2_from_the_public_urls(released_gpt2, tmp_path, monkeypatch):
    asked = []

    def serve_release(url, timeout=None):  # the two public URLs, answered from local copies
        asked.append(url)
        return io.BytesIO((released_gpt2 / url.rsplit("/", 1)[-1]).read_bytes())

    monkeypatch.setattr(urllib.request, "urlopen", serve_release)
    fresh = tmp_path / "fresh"
    with pytest.raises(FileNotFoundError, match="glasslm fetch gpt2"):
        gpt2_tokenizer(fresh)  # the error names the step that fixes it
    assert main(["fetch", "gpt2", "--data-dir", str(fresh)]) == 0
    assert asked == ["https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"]
    # GPT-2's own ids for this text (as tiktoken's "gpt2" encoding gives them).
    assert gpt2_tokenizer(fresh, backend="glasslm").encode("Hello world<|endoftext|>") == [15496, 995, 50256]


def test_fetch_from_a_folder_copies_every_dataset_it_holds(released_gpt2, data_dir, tmp_path, capsys):
    shutil.copy(data_dir / "tinyshakespeare.txt", released_gpt2 / "tinyshakespeare.txt")
    fresh = tmp_path / "fresh"
    assert main(["fetch", "--from", str(released_gpt2), "--data-dir", str(fresh)]) == 0
    out = capsys.readouterr().out
    assert "tinyshakespeare:" in out and "gpt2:" in out
    assert sorted(p.name for p in (fresh / "gpt2").iterdir()) == ["gpt2_merges.txt", "gpt2_vocab.json"]
    assert gpt2_tokenizer(fresh, backend="glasslm").vocab_size == 50257


def test_a_tampered_gpt2_file_is_refused_and_not_kept(released_gpt2, tmp_path):
    (released_gpt2 / "vocab.bpe").write_text("#version: 0.2\nĠ t\n")
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match="vocab.bpe has sha256"):
        fetch_dataset("gpt2", fresh, source_dir=released_gpt2)
    assert [p.name for p in (fresh / "gpt2").iterdir()] == ["gpt2_vocab.json"]  # the good one only
    assert FILE_SETS["gpt2"][1].filename == "gpt2/gpt2_merges.txt"


def test_the_offline_advice_names_both_of_gpt2s_files(tmp_path, monkeypatch, capsys):
    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    assert main(["fetch", "gpt2", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    for info in FILE_SETS["gpt2"]:  # both paths, and both names the files were released under
        assert str(tmp_path / info.filename) in err and info.url.rsplit("/", 1)[-1] in err
