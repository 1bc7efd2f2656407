"""Generation: cached decoding equals full forward passes, batching equals one-at-a-time, every
sampling control keeps exactly the support it defines, stopping cuts exactly, the CLI streams."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from glasslm.generation import streaming
from glasslm.io.checkpoint import save_checkpoint
from glasslm.cli import main
from glasslm.presets import get_preset
from glasslm.generation import (
    GenerationConfig, TextStreamer, apply_repetition_penalty, decode_steps, filter_logits, generate,
    generate_text, generate_tokens, optimize_for_decoding, sample_next, settled_length, stream_text,
)
from glasslm.core.model import TransformerLM
from glasslm.tokenizers import CharTokenizer
from peaked import peak_weights

CONTEXT = 16

# Learned positions (GPT-2), rotary + grouped-query attention (Llama), sinusoidal + post-norm (Vaswani).
FAMILIES = {
    "gpt2": dict(preset="gpt2-small", vocab_size=97, n_heads=4),
    "llama": dict(preset="llama-tiny", vocab_size=97, n_heads=4, n_kv_heads=2, d_mlp=96),
    "vaswani": dict(preset="vaswani-decoder", vocab_size=97, n_heads=4, d_mlp=128),
}


def tiny_model(family: str, context: int = CONTEXT, seed: int = 0, **overrides) -> TransformerLM:
    spec = dict(FAMILIES[family])
    preset = spec.pop("preset")
    cfg = get_preset(preset, n_layers=2, d_model=64, context_length=context, **{**spec, **overrides})
    torch.manual_seed(seed)
    return peak_weights(TransformerLM(cfg).eval())  # peaked logits: greedy choices never hinge on float noise


def assert_close_to_reference(actual, reference, scale=None, what="logits"):
    """float32 results against a float64 reference, within a tolerance relative to the logits'
    scale: float32 rounding is relative, so a fixed absolute tolerance passes or fails by scale.
    Measured float32 error here is <= 2.2e-6 of the scale (AVX-512, AVX2 and generic kernels, 1 and
    2 threads); a real bug (a wrong position, mask or cache slot) moves logits by ~1e-1 of it."""
    scale = reference.abs().amax().item() if scale is None else scale
    torch.testing.assert_close(actual.double(), reference.double(), rtol=0, atol=2e-5 * scale,
                               msg=lambda m: f"{what} differ from the float64 reference: {m}")


def float64_copy(model: TransformerLM) -> TransformerLM:
    return copy.deepcopy(model).double()


def reference_steps(model, prompt, n_new, keep):
    """Greedy decoding with no cache at all: a full forward pass over the current window each step,
    sliding the window exactly as the cached loop does (keep the last `keep` tokens when full)."""
    context = model.config.context_length
    history = list(prompt)
    window = history[-context:]
    logits_per_step, tokens = [], []
    with torch.no_grad():
        for step in range(n_new):
            logits = model(torch.tensor([window]))[0, -1]
            token = int(logits.argmax())
            logits_per_step.append(logits)
            tokens.append(token)
            history.append(token)
            window = history[-keep:] if len(window) >= context else window + [token]
    return tokens, torch.stack(logits_per_step)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_equals_full_forward_across_the_context_boundary(family):
    model = tiny_model(family)
    prompt = [5, 17, 3, 42, 8]
    config = GenerationConfig(max_new_tokens=40, temperature=0.0, window_keep=10)
    steps = list(decode_steps(model, [prompt], config))
    tokens = [int(s.tokens[0]) for s in steps]
    logits = torch.stack([s.logits[0] for s in steps])
    ref_tokens, ref_logits = reference_steps(float64_copy(model), prompt, 40, keep=10)
    assert tokens == ref_tokens
    assert_close_to_reference(logits, ref_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_longer_than_the_context_keeps_its_last_part(family):
    model = tiny_model(family)
    prompt = list(range(1, 30))  # 29 tokens > context 16
    config = GenerationConfig(max_new_tokens=12, temperature=0.0)  # default keep = context // 2
    tokens = list(generate_tokens(model, prompt, config=config))
    assert tokens == reference_steps(model, prompt, 12, keep=CONTEXT // 2)[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["fast", "readable"])
def test_batched_rows_equal_each_row_alone(family, impl):
    model = tiny_model(family, impl=impl)
    prompts = [[7, 1, 2], [3, 9, 27, 81, 4, 12, 6], [50], list(range(20, 32))]
    config = GenerationConfig(max_new_tokens=20, temperature=0.0, window_keep=6, logprobs=True)
    batched = list(decode_steps(model, prompts, config))  # 12 + 20 > 16: slides with padding too
    model64 = float64_copy(model)
    for row, prompt in enumerate(prompts):
        alone = list(decode_steps(model64, [prompt], config))
        assert [int(s.tokens[row]) for s in batched] == [int(s.tokens[0]) for s in alone]
        ref_logits = torch.stack([s.logits[0] for s in alone])
        assert_close_to_reference(torch.stack([s.logits[row] for s in batched]), ref_logits)
        # A log-probability is a logit minus a log-sum-exp: its rounding scales with the logits.
        assert_close_to_reference(torch.stack([s.logprobs[row] for s in batched]),
                                  torch.stack([s.logprobs[0] for s in alone]), ref_logits.abs().amax().item(),
                                  "log-probabilities")


def test_each_row_stops_on_its_own_token():
    model = tiny_model("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    free = generate(model, prompts, temperature=0.0, max_new_tokens=12)
    stop = free[0].tokens[4]  # a token row 0 produces; row 1 may or may not
    stopped = generate(model, prompts, temperature=0.0, max_new_tokens=12, stop_tokens=[stop])
    for before, after in zip(free, stopped):
        if stop in before.tokens:
            assert after.tokens == before.tokens[:before.tokens.index(stop)]
            assert after.finish_reason == "stop_token"
        else:
            assert after.tokens == before.tokens and after.finish_reason == "length"
    assert stopped[0].finish_reason == "stop_token"
    assert list(generate_tokens(model, prompts[0], 12, temperature=0.0, stop_tokens=[stop])) == stopped[0].tokens


def char_model_and_tokenizer():
    # No <|endoftext|>: these random weights would sample it and stop before what the tests look at.
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .\n", special_tokens=())
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2, d_model=32,
                                     n_heads=2, context_length=CONTEXT))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval(), tok


def test_stop_strings_cut_the_text_exactly():
    model, tok = char_model_and_tokenizer()
    full = generate_text(model, tok, "hello", max_new_tokens=30, seed=1)
    stop = full[7:9]
    expected = full[:full.find(stop)]  # the first occurrence, which may be before index 7
    assert generate_text(model, tok, "hello", max_new_tokens=30, seed=1, stop_strings=[stop]) == expected
    [result] = generate(model, [tok.encode("hello")], tokenizer=tok, max_new_tokens=30, seed=1, stop_strings=[stop])
    assert result.text == expected and result.finish_reason == "stop_string"
    assert tok.decode(result.tokens).startswith(expected + stop)  # tokens run up to the stop string's end
    # Two stop strings: the earliest match wins.
    assert generate_text(model, tok, "hello", max_new_tokens=30, seed=1, stop_strings=[full[20:22], stop]) == expected


def test_stop_strings_need_a_tokenizer():
    model, tok = char_model_and_tokenizer()
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, [tok.encode("ab")], stop_strings=["x"])


class ByteTokenizer:
    """Byte-level: one token per UTF-8 byte, like the base alphabet of GPT-2's BPE."""

    vocab_size = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_streamed_text_never_shows_half_a_character(monkeypatch):
    text = "héllo wörld — ☃ done"
    tokens = ByteTokenizer().encode(text)
    monkeypatch.setattr(streaming, "generate_tokens", lambda model, prompt, config: iter(tokens))
    pieces = list(stream_text(None, ByteTokenizer(), "x", max_new_tokens=len(tokens)))
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert len(pieces) > 5  # it really streamed
    pieces = list(stream_text(None, ByteTokenizer(), "x", stop_strings=["☃"]))
    assert "".join(pieces) == "héllo wörld — "


def test_settled_length_holds_back_what_may_change():
    assert settled_length("abc") == 3
    assert settled_length("ab\ufffd\ufffd") == 2
    assert settled_length("say STO", ["STOP"]) == 4
    assert settled_length("say ST", ["STOP", "T!"]) == 4
    assert settled_length("say T", ["STOP", "T!"]) == 4
    assert settled_length("say", ["STOP"]) == 3


def test_a_seed_reproduces_a_sample_and_different_seeds_differ():
    model = tiny_model("gpt2")
    config = GenerationConfig(max_new_tokens=30, temperature=1.5)
    first = list(generate_tokens(model, [1, 2], config=config, seed=123))
    again = list(generate_tokens(model, [1, 2], config=config, seed=123))
    other = list(generate_tokens(model, [1, 2], config=config, seed=124))
    assert first == again
    assert first != other


def test_logprobs_are_the_models_log_softmax():
    model = tiny_model("llama")
    [result] = generate(model, [[3, 1, 4]], temperature=0.0, max_new_tokens=6, logprobs=True)
    sequence = [3, 1, 4] + result.tokens
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([sequence[:-1]]))[0], dim=-1)
    expected = [float(log_probs[2 + i, t]) for i, t in enumerate(result.tokens)]
    assert result.logprobs == pytest.approx(expected, abs=1e-4)


# --- sampling controls on hand-made distributions ------------------------------------------------

def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_top_k_keeps_the_k_largest_and_their_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    assert kept(filter_logits(logits, top_k=1)) == [1]
    assert kept(filter_logits(logits, top_k=2)) == [1, 2, 3]  # 2.0 is tied for second place
    assert kept(filter_logits(logits, top_k=3)) == [1, 2, 3]
    assert kept(filter_logits(logits, top_k=4)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, top_k=99)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = log_probs(0.125, 0.5, 0.125, 0.25)  # sorted mass: 0.5, 0.75, 0.875, 1.0
    assert kept(filter_logits(logits, top_p=0.3)) == [1]
    assert kept(filter_logits(logits, top_p=0.6)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.7)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.8)) == [0, 1, 2, 3]  # needs one 0.125: its tie comes too
    # Just either side of a boundary (0.75 reached by two tokens): tight to 1e-3.
    assert kept(filter_logits(logits, top_p=0.749)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.751)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, top_p=0.499)) == [1]
    assert kept(filter_logits(logits, top_p=0.501)) == [1, 3]
    assert kept(filter_logits(logits, top_p=1.0)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, top_p=1e-9)) == [1]  # the top token always stays
    # Tokens already excluded stay excluded, even at top_p = 1.
    assert kept(filter_logits(torch.tensor([[0.0, float("-inf"), 1.0]]), top_p=1.0)) == [0, 2]
    # Top-p acts on what top-k left, renormalized: of {0.5, 0.25} the 0.5 is 2/3 of the mass.
    assert kept(filter_logits(logits, top_k=2, top_p=0.6)) == [1]
    assert kept(filter_logits(logits, top_k=2, top_p=0.7)) == [1, 3]


def test_min_p_keeps_tokens_near_the_top_probability():
    logits = log_probs(0.125, 0.5, 0.125, 0.25)
    assert kept(filter_logits(logits, min_p=0.6)) == [1]
    assert kept(filter_logits(logits, min_p=0.3)) == [1, 3]
    assert kept(filter_logits(logits, min_p=0.2)) == [0, 1, 2, 3]  # exactly 0.25 * 0.5 = 0.125 stays
    assert kept(filter_logits(logits, min_p=0.0)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, min_p=0.249)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, min_p=0.251)) == [1, 3]


def filtered_distribution_by_hand(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Plain-Python statement of temperature, then top-k, then top-p, renormalizing after each."""
    weights = [math.exp(x / temperature) for x in logits]
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    support = set(order[:top_k])
    total = sum(weights[i] for i in support)
    mass, nucleus = 0.0, set()
    for i in order:
        if i in support and mass < top_p:
            nucleus.add(i)
            mass += weights[i] / total
    total = sum(weights[i] for i in nucleus)
    return [weights[i] / total if i in nucleus else 0.0 for i in range(len(weights))]


def test_sampling_frequencies_match_the_filtered_distribution():
    logits = [2.0, 0.1, 1.2, -1.0, 0.7, 1.5, -0.3]
    expected = torch.tensor(filtered_distribution_by_hand(logits, 0.8, 5, 0.9))
    assert (expected == 0).sum() == 3  # both filters bite: two tokens cut by top-k, one by top-p
    n = 40_000
    generator = torch.Generator().manual_seed(0)
    draws = sample_next(torch.tensor([logits]).expand(n, -1), temperature=0.8, top_k=5, top_p=0.9,
                        generator=generator)
    frequencies = torch.bincount(draws, minlength=len(logits)).double() / n
    assert (frequencies[expected == 0] == 0).all()  # filtered tokens are never drawn
    # Each frequency is a mean of n Bernoulli(p) draws: standard error sqrt(p (1 - p) / n) <= 0.0025.
    # Five standard errors is a failure chance below 1e-6 per token for a correct sampler.
    tolerance = 5 * (expected * (1 - expected) / n).sqrt() + 1e-12
    assert ((frequencies - expected.double()).abs() <= tolerance).all(), (frequencies, expected)


def test_greedy_ignores_the_filters_and_takes_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    assert sample_next(logits, temperature=0.0, top_k=1, top_p=0.1).tolist() == [1, 0]


def test_repetition_penalty_matches_its_definition():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0]])
    seen = torch.tensor([[True, True, False, False, True]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    # Seen: positive logits divided by 2, negative multiplied by 2; unseen untouched.
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0, 2.0]]


def test_repetition_penalty_agrees_with_hugging_face():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    previous = torch.tensor([[3, 7, 7, 49], [0, 1, 2, 3]])
    seen = torch.zeros(2, 50, dtype=torch.bool).scatter_(1, previous, True)
    theirs = transformers.RepetitionPenaltyLogitsProcessor(1.3)(previous, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.3), theirs)


def test_repetition_penalty_changes_greedy_output():
    model = tiny_model("gpt2")
    plain = list(generate_tokens(model, [1, 2, 3], 30, temperature=0.0))
    assert len(set(plain)) < len(plain)  # a peaked random model repeats itself
    penalized = list(generate_tokens(model, [1, 2, 3], 30, temperature=0.0, repetition_penalty=1e3))
    # With a huge penalty, a token is only repeated once every unseen token is worse.
    assert len(set(penalized)) > len(set(plain))


def test_config_rejects_nonsense():
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=2.0),
                dict(repetition_penalty=0.0), dict(max_new_tokens=-1), dict(stop_strings=[""])):
        with pytest.raises(ValueError):
            GenerationConfig(**bad)
    assert GenerationConfig(top_k=0).top_k is None  # 0 means off, as it always has on the command line


def test_bf16_weights_generate_close_to_float32():
    model = tiny_model("llama")
    half_model = copy.deepcopy(model).to(torch.bfloat16)
    config = GenerationConfig(max_new_tokens=3, temperature=0.0)
    # Two rows use oneDNN's bf16 matmuls; one row decodes with ATen's own bf16 kernel instead.
    for prompts in ([[1, 2, 3], [4, 5, 6, 7, 8, 9]], [[1, 2, 3]]):
        full = [s.logits for s in decode_steps(model, prompts, config)]
        half = [s.logits for s in decode_steps(half_model, prompts, config)]
        assert half[0].dtype == torch.float32  # logits come back as float32 for sampling
        # bf16 keeps 8 significant bits: relative error ~1e-2 per op, a few per layer.
        assert (half[0] - full[0]).abs().max() < 0.05 * full[0].abs().max()
        assert not torch.equal(half[0], full[0])  # really computed in bf16
    assert torch.backends.mkldnn.enabled  # the switch is put back


def test_optimize_for_decoding_changes_layout_not_results():
    model = tiny_model("gpt2")
    before = list(generate_tokens(model, [1, 2, 3], 10, temperature=0.0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimize_for_decoding(model)
    assert not model.embed.weight.is_contiguous()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert list(generate_tokens(model, [1, 2, 3], 10, temperature=0.0)) == before


# --- command line --------------------------------------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path):
    model, tok = char_model_and_tokenizer()
    return save_checkpoint(tmp_path / "ckpt", model, tok), model, tok


def test_cli_generate_streams_the_continuation(checkpoint, capsys):
    path, model, tok = checkpoint
    assert main(["generate", "--checkpoint", str(path), "--prompt", "hello", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out == "hello" + generate_text(model, tok, "hello", max_new_tokens=12, temperature=0.0) + "\n"
    assert "tokens/s" in err


def test_cli_generate_reads_prompts_from_a_file_and_stdin(checkpoint, capsys, monkeypatch, tmp_path):
    path, model, tok = checkpoint
    expected = generate_text(model, tok, "abc", max_new_tokens=5, seed=4)
    (tmp_path / "prompt.txt").write_text("abc")
    assert main(["generate", "--checkpoint", str(path), "--prompt-file", str(tmp_path / "prompt.txt"),
                 "--max-new-tokens", "5", "--seed", "4", "--top-k", "0", "--temperature", "1"]) == 0
    assert capsys.readouterr().out == "abc" + expected + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("abc"))
    assert main(["generate", "--checkpoint", str(path), "--prompt", "-", "--max-new-tokens", "5", "--seed", "4",
                 "--top-k", "0", "--temperature", "1"]) == 0
    assert capsys.readouterr().out == "abc" + expected + "\n"


def test_cli_interactive_answers_each_line(checkpoint, capsys, monkeypatch):
    path, model, tok = checkpoint
    monkeypatch.setattr("sys.stdin", io.StringIO("ab\nhello\n"))
    assert main(["generate", "--checkpoint", str(path), "--interactive", "--max-new-tokens", "6",
                 "--temperature", "0", "--stop", "q"]) == 0
    out = capsys.readouterr().out
    for prompt in ("ab", "hello"):
        assert generate_text(model, tok, prompt, max_new_tokens=6, temperature=0.0, stop_strings=["q"]) in out
