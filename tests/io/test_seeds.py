"""Every seed system reproduced exactly, and checkpoints from other codebases loaded exactly.

The foreign models are rebuilt in tests/seed_models.py from their public descriptions (plain
torch.nn, no glasslm code). Each is saved the way its own code saves, converted with
`glasslm.io.formats`, and compared: fp32 logits within 1e-5 and 20 greedy tokens identical.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

import seed_models as sm  # noqa: E402

from glasslm.presets import get_preset
from glasslm.training.config import get_recipe# noqa: E402
from glasslm.io.formats import FormatError, load_foreign  # noqa: E402
from glasslm.generation import generate  # noqa: E402
from glasslm.core.model import TransformerLM  # noqa: E402


def _reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(prompt):].tolist()


def _compare(foreign: torch.nn.Module, ours: TransformerLM, vocab: int, seq: int = 12) -> float:
    """Max |logit difference| on a random batch; also checks 20 greedy tokens agree."""
    foreign.eval()
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = foreign(tokens), ours(tokens)
    diff = (expected - got).abs().max().item()
    assert diff < 1e-5, diff
    prompt = tokens[0, :4].tolist()
    assert generate(ours, [prompt], max_new_tokens=20, temperature=0)[0].tokens == _reference_greedy(foreign, prompt, 20)
    return diff


# --- the seed presets: parameter counts equal the seed code's -----------------------------------

def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_arena_gpt2_matches_seed_000_at_gpt2_small_sizes():
    with torch.device("meta"):
        seed = sm.Seed000GPT(50257, 1024, 768, 12, 12)
        ours = TransformerLM(get_preset("arena-gpt2"))
    assert _count(seed) == ours.num_parameters() == 163_087_441


def test_tiny_transformer_matches_seed_004_at_vocab_65():
    seed, ours = sm.Seed004Model(vocab_size=65), TransformerLM(get_preset("tiny-transformer"))
    assert _count(seed) == ours.num_parameters() == 2_366_975


@pytest.mark.parametrize("preset, build", [
    ("lightning-char-gpt", lambda c: sm.Seed001GPT(c.vocab_size, c.context_length, c.d_model, c.n_layers, c.n_heads)),
    ("aiayn-decoder-prenorm", lambda c: sm.Seed002Decoder(c.vocab_size, c.context_length, c.d_model, c.n_layers,
                                                          c.n_heads, c.d_mlp)),
    ("cs336-lm", lambda c: sm.CS336LM(c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.d_mlp)),
])
def test_seed_presets_have_the_seed_codes_parameter_count(preset, build):
    cfg = get_preset(preset)
    with torch.device("meta"):
        seed, ours = build(cfg), TransformerLM(cfg)
    # seed 001 stores its position indices as a (frozen, integer) parameter; it is not a weight.
    assert sum(p.numel() for n, p in seed.named_parameters() if n != "pos_idxs") == ours.num_parameters()


def test_seed_recipes_are_in_the_one_registry():
    tiny = get_recipe("tiny-transformer")
    assert (tiny.batch_size, tiny.lr, tiny.max_steps, tiny.eval_interval) == (64, 9e-4, 5000, 300)
    assert get_preset("tiny-transformer").context_length == 256
    adam = get_recipe("lightning-char-gpt")  # plain Adam (no decay), constant learning rate
    assert adam.weight_decay == 0 and adam.min_lr == adam.lr and adam.warmup_steps == 0 and adam.grad_clip == 0
    for name in ("arena-gpt2", "aiayn-decoder-prenorm", "cs336-lm"):
        with pytest.raises(ValueError, match="has no training recipe"):
            get_recipe(name)


def test_init_statistics_follow_each_seed():
    torch.manual_seed(0)
    # seed 004: PyTorch defaults: embeddings N(0, 1), Linear weights U(+-1/sqrt(fan_in)).
    ours = TransformerLM(get_preset("tiny-transformer"))
    ref = sm.Seed004Model()
    assert ours.embed.weight.std().item() == pytest.approx(ref.stack.tok_embs.weight.std().item(), rel=0.05)
    assert ours.blocks[0].mlp.up.weight.std().item() == pytest.approx(ref.stack.blocks[0].ffn[0].weight.std().item(), rel=0.05)
    # seed 003: truncated normal per q/k/v matrix.
    cs = TransformerLM(get_preset("cs336-lm", vocab_size=500))
    ref3 = sm.CS336LM(500, 512, 1, 16, 1344)
    q = cs.blocks[0].attn.qkv.weight[:512]
    assert q.std().item() == pytest.approx(ref3.layers[0].attn.q_proj.weight.std().item(), rel=0.05)
    # seed 002: Xavier-uniform on every matrix, the embedding table and the projection included.
    aiayn = TransformerLM(get_preset("aiayn-decoder-prenorm", vocab_size=500, n_layers=1))
    ref2 = sm.Seed002Decoder(500, 16, 512, 1, 8, 2048)
    for mine, theirs in ((aiayn.embed.weight, ref2.word_embedding.embedding.weight),
                         (aiayn.unembed.weight, ref2.projection_layer.proj.weight),
                         (aiayn.blocks[0].attn.qkv.weight[:512], ref2.decoder.layers[0].self_attention_block.w_q.weight),
                         (aiayn.blocks[0].mlp.up.weight, ref2.decoder.layers[0].feed_forward_block.linear_1.weight)):
        assert mine.std().item() == pytest.approx(theirs.std().item(), rel=0.05)
        assert mine.abs().max() <= theirs.abs().max() * 1.01  # the same uniform bound
    # Xavier touches only matrices: the FFN's and the projection's biases keep nn.Linear's U(+-1/sqrt(fan_in)).
    layer = ref2.decoder.layers[0].feed_forward_block
    for mine, theirs, fan_in in ((aiayn.blocks[0].mlp.up.bias, layer.linear_1.bias, 512),
                                 (aiayn.blocks[0].mlp.down.bias, layer.linear_2.bias, 2048),
                                 (aiayn.unembed_bias, ref2.projection_layer.proj.bias, 512)):
        bound = fan_in ** -0.5
        assert theirs.abs().max() <= bound and mine.abs().max() <= bound
        assert mine.abs().max() > 0.9 * bound  # not zeros, nor a narrower distribution
        assert mine.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)  # uniform's std
        assert mine.std().item() == pytest.approx(theirs.std().item(), rel=0.15)
    # seed 000: every weight normal(0.02), the output projections included.
    arena = TransformerLM(get_preset("arena-gpt2", vocab_size=500, n_layers=2))
    assert arena.blocks[0].attn.out.weight.std().item() == pytest.approx(0.02, rel=0.05)


# --- loading checkpoints the seeds' and others' code saved ------------------------------------

def test_seed000_transformerlens_state_dict(tmp_path):
    torch.manual_seed(0)
    seed = sm.randomize_(sm.Seed000GPT(97, 32, 48, 2, 4))
    torch.save(seed.state_dict(), tmp_path / "model.pt")
    ours = load_foreign(tmp_path / "model.pt", "transformerlens")
    assert ours.num_parameters() == _count(seed) and ours.config.unembed_bias
    print("seed000 / transformerlens max logit diff", _compare(seed, ours, 97))


def test_seed001_state_dict_and_lightning_checkpoint(tmp_path):
    torch.manual_seed(0)
    seed = sm.randomize_(sm.Seed001GPT(65, 32, 48, 2, 4))
    # Lightning keeps the LightningModule's state dict (the GPT is its `model`) under "state_dict".
    torch.save({"epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0",
                "state_dict": {f"model.{k}": v for k, v in seed.state_dict().items()}}, tmp_path / "last.ckpt")
    ours = load_foreign(tmp_path / "last.ckpt", "seed001", n_heads=4)
    assert ours.num_parameters() == _count(seed) - 32  # less the integer position indices
    print("seed001 max logit diff", _compare(seed, ours, 65))
    with pytest.raises(FormatError, match="n_heads"):
        load_foreign(tmp_path / "last.ckpt", "seed001")


def test_seed002_state_dict(tmp_path):
    torch.manual_seed(0)
    seed = sm.randomize_(sm.Seed002Decoder(89, 40, 48, 2, 4, 96))
    torch.save(seed.state_dict(), tmp_path / "decoder.pt")
    ours = load_foreign(tmp_path / "decoder.pt", "seed002", n_heads=4)
    assert ours.config.context_length == 40 and ours.config.norm_unbiased_std
    print("seed002 max logit diff", _compare(seed, ours, 89))


def test_seed003_cs336_checkpoint(tmp_path):
    torch.manual_seed(0)
    seed = sm.randomize_(sm.CS336LM(101, 64, 2, 4, 172))
    # CS336's save_checkpoint writes {"model": ..., "optimizer": ..., "iteration": ...}.
    optimizer = torch.optim.AdamW(seed.parameters())
    torch.save({"model": seed.state_dict(), "optimizer": optimizer.state_dict(), "iteration": 7}, tmp_path / "ck.pt")
    ours = load_foreign(tmp_path / "ck.pt", "cs336", n_heads=4, context_length=64)
    print("seed003 / cs336 max logit diff", _compare(seed, ours, 101))


def test_seed004_state_dict(tmp_path):
    torch.manual_seed(0)
    seed = sm.randomize_(sm.Seed004Model(vocab_size=65, block_size=32, embeds_size=45, num_heads=5, num_layers=2))
    torch.save(seed.state_dict(), tmp_path / "tiny.pt")
    ours = load_foreign(tmp_path / "tiny.pt", "seed004")
    assert ours.config.attn_score_scale == 45 ** -0.5 or abs(ours.config.attn_score_scale - 45 ** -0.5) < 1e-15
    assert ours.num_parameters() == _count(seed)
    print("seed004 max logit diff", _compare(seed, ours, 65))


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_ckpt_with_compile_prefixes(tmp_path, bias):
    torch.manual_seed(0)
    args = dict(n_layer=2, n_head=4, n_embd=48, block_size=32, bias=bias, vocab_size=97, dropout=0.0)
    model = sm.randomize_(sm.NanoGPT(**args))
    # train.py saves the (possibly torch.compile'd) model's state dict with its model_args.
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    torch.save({"model": state, "optimizer": torch.optim.AdamW(model.parameters()).state_dict(),
                "model_args": args, "iter_num": 10, "best_val_loss": torch.tensor(2.5).item(),
                "config": {"dataset": "shakespeare_char"}}, tmp_path / "ckpt.pt")
    ours = load_foreign(tmp_path / "ckpt.pt", "nanogpt")
    assert ours.config.tie_embeddings and ours.config.bias == bias
    print(f"nanogpt bias={bias} max logit diff", _compare(model, ours, 97))


def test_bad_foreign_files_are_named(tmp_path):
    torch.save({"weird.weight": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(FormatError, match="not a seed004 checkpoint"):
        load_foreign(tmp_path / "x.pt", "seed004")
    with pytest.raises(ValueError, match="unknown format"):
        load_foreign(tmp_path / "x.pt", "keras")
    with pytest.raises(FileNotFoundError):
        load_foreign(tmp_path / "missing.pt", "nanogpt")

    import argparse  # any class instance is pickled code: refused, never run

    torch.save({"model": {"w": torch.zeros(1)}, "obj": argparse.Namespace(x=1)}, tmp_path / "pickled.pt")
    with pytest.raises(FormatError, match="without running pickled code"):
        load_foreign(tmp_path / "pickled.pt", "nanogpt")
    seed = sm.Seed004Model(vocab_size=65, block_size=8, embeds_size=20, num_heads=2, num_layers=1)
    state = seed.state_dict()
    state["stack.extra.weight"] = torch.zeros(3)
    torch.save(state, tmp_path / "extra.pt")
    with pytest.raises(FormatError, match="no place in the model: stack.extra.weight"):
        load_foreign(tmp_path / "extra.pt", "seed004")


def test_convert_from_the_command_line(tmp_path, capsys):
    from glasslm.cli import main
    from glasslm.hf import load_model

    torch.manual_seed(0)
    seed = sm.randomize_(sm.CS336LM(101, 64, 2, 4, 172)).eval()
    torch.save(seed.state_dict(), tmp_path / "cs336.pt")
    main(["convert", "--from", "cs336", "--checkpoint", str(tmp_path / "cs336.pt"), "--n-heads", "4",
          "--context-length", "64", "--out", str(tmp_path / "run")])
    assert "-> " in capsys.readouterr().out
    model, _ = load_model(tmp_path / "run")
    tokens = torch.randint(0, 101, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), seed(tokens), rtol=0, atol=1e-5)
    # A missing head count is one clear line, and nothing is written.
    assert main(["convert", "--from", "cs336", "--checkpoint", str(tmp_path / "cs336.pt"), "--out",
                 str(tmp_path / "b")]) != 0
    assert "pass n_heads (--n-heads)" in capsys.readouterr().err and not (tmp_path / "b").exists()


def _saved_the_foreign_way(fmt: str, path: Path) -> tuple[torch.nn.Module, int, list[str]]:
    """(foreign model, vocab, extra convert flags), saved as that codebase saves it."""
    torch.manual_seed(0)
    if fmt == "nanogpt":
        args = dict(n_layer=2, n_head=4, n_embd=48, block_size=32, bias=True, vocab_size=97, dropout=0.0)
        model = sm.randomize_(sm.NanoGPT(**args))
        torch.save({"model": {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}, "model_args": args,
                    "iter_num": 10}, path)
        return model, 97, []
    if fmt == "transformerlens":
        model = sm.randomize_(sm.Seed000GPT(97, 32, 48, 2, 4))
        torch.save(model.state_dict(), path)
        return model, 97, []
    if fmt == "seed001":
        model = sm.randomize_(sm.Seed001GPT(65, 32, 48, 2, 4))
        torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
        return model, 65, ["--n-heads", "4"]
    if fmt == "seed002":
        model = sm.randomize_(sm.Seed002Decoder(89, 40, 48, 2, 4, 96))
        torch.save(model.state_dict(), path)
        return model, 89, ["--n-heads", "4"]
    model = sm.randomize_(sm.Seed004Model(vocab_size=65, block_size=32, embeds_size=45, num_heads=5, num_layers=2))
    torch.save(model.state_dict(), path)
    return model, 65, []


@pytest.mark.parametrize("fmt", ["nanogpt", "transformerlens", "seed001", "seed002", "seed004"])
def test_every_format_converts_from_the_command_line(tmp_path, capsys, fmt):
    from glasslm.cli import main
    from glasslm.hf import load_model

    foreign, vocab, flags = _saved_the_foreign_way(fmt, tmp_path / "saved.pt")
    assert main(["convert", "--from", fmt, "--checkpoint", str(tmp_path / "saved.pt"), *flags,
                 "--out", str(tmp_path / "run")]) in (0, None)
    assert "-> " in capsys.readouterr().out
    model, _ = load_model(tmp_path / "run")  # a glasslm checkpoint now, read back from disk
    assert _compare(foreign, model.eval(), vocab) < 1e-5


def test_recompute_window_is_seed_004s_autocomplete(tmp_path):
    """Past the context, window="recompute" re-runs the last context_length tokens every step."""
    torch.manual_seed(0)
    seed = sm.randomize_(sm.Seed004Model(vocab_size=65, block_size=8, embeds_size=20, num_heads=2, num_layers=2))
    torch.save(seed.state_dict(), tmp_path / "tiny.pt")
    ours = load_foreign(tmp_path / "tiny.pt", "seed004")
    prompt = [3, 1, 4, 1, 5]
    expected = seed.eval().autocomplete_greedy(torch.tensor([prompt]), 20)[0, len(prompt):].tolist()
    got = generate(ours, [prompt], max_new_tokens=20, temperature=0, window="recompute")[0].tokens
    assert got == expected
    # The default cache-refill window is a different (cheaper) approximation past the context.
    refill = generate(ours, [prompt], max_new_tokens=20, temperature=0)[0].tokens
    assert refill[:4] == expected[:4]  # identical while everything fits in the context


def test_readme_seed_table_is_true():
    """Each row of the README's seed table: the preset exists, has that count, and that recipe status."""
    from glasslm.presets import PRESETS
    from glasslm.io.formats import FORMATS

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    rows = [line.split("|")[1:-1] for line in readme.splitlines() if line.startswith("| 00")]
    assert [r[0].split()[0] for r in rows] == ["000", "001", "002", "003", "004"]
    for _seed, preset, count, recipe, fmt in rows:
        name, fmt = preset.strip().strip("`"), fmt.strip().strip("`")
        with torch.device("meta"):
            params = TransformerLM(get_preset(name)).num_parameters()
        assert f"{params:,}" == count.split()[0], (name, params)
        assert ("refused" in recipe) == (PRESETS[name].recipe is None), name
        assert FORMATS[fmt].preset == name


@pytest.mark.parametrize("name", ["lightning-char-gpt", "tiny-transformer"])
def test_char_seed_presets_train_on_the_seeds_vocabulary(name, shakespeare_text):
    """The seeds' vocabulary 65 is tiny Shakespeare's characters with no end-of-text; glasslm's char
    tokenizer adds <|endoftext|> for other presets, but a seed preset keeps the seed's count."""
    from glasslm.data import load_training_data
    from glasslm.presets import PRESETS

    own = load_training_data("tinyshakespeare", char_end_of_text=PRESETS[name].char_end_of_text).tokenizer
    default = load_training_data("tinyshakespeare").tokenizer
    assert own.vocab_size == len(set(shakespeare_text)) == 65 and own.special_tokens == {}
    assert default.vocab_size == 66
    with torch.device("meta"):
        model = TransformerLM(get_preset(name, vocab_size=own.vocab_size))
    assert model.num_parameters() == TransformerLM(get_preset(name)).num_parameters()


def test_glasslm_train_builds_a_seed_presets_vocabulary_without_end_of_text(tmp_path, shakespeare_text):
    from glasslm.cli import main
    from glasslm.io.checkpoint import load_checkpoint

    text = tmp_path / "text.txt"
    text.write_text(shakespeare_text[:5_000])
    runs = {}
    for name in ("tiny-transformer", "shakespeare-char-cpu"):
        assert main(["train", "--preset", name, "--data", str(text), "--out", str(tmp_path / name), "--max-steps", "1",
                     "--n-layers", "1", "--d-model", "20", "--n-heads", "2", "--context-length", "16", "--batch-size",
                     "2", "--eval-iters", "1", "--no-progress", "--sample-tokens", "0"]) == 0
        model, tokenizer, _ = load_checkpoint(tmp_path / name)
        runs[name] = (model.config.vocab_size, tokenizer.vocab_size, dict(tokenizer.special_tokens))
    chars = len(set(shakespeare_text[:5_000]))
    assert runs["tiny-transformer"] == (chars, chars, {})
    assert runs["shakespeare-char-cpu"] == (chars + 1, chars + 1, {"<|endoftext|>": chars})
