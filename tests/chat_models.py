"""A tiny Llama chat model as a transformers user has it: weights, a tokenizer whose eos is `</s>`
(id 2), a generation_config.json listing two eos ids (`</s>` and `<|eot|>`, as Llama 3 lists two),
and a chat template, all saved by transformers' own `save_pretrained`.

The random weights are picked (seed, and a scale on the eos rows of the output matrix) so that
transformers' greedy `generate` reaches an eos within a few tokens of each of the given prompts:
the tests then check that glasslm stops at the same place.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS_IDS = [2, 3]


def hf_tokenizer(template: str | None = TEMPLATE):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz .,!?\n")
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", additional_special_tokens=SPECIALS[3:])
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def stops_within(model, tokenizer, prompt_ids: list[int], low: int, high: int) -> bool:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=high, do_sample=False)
    new = out[0, len(prompt_ids):].tolist()
    return low <= len(new) - 1 < high and new[-1] in EOS_IDS


def llama_chat_dir(directory: Path, prompts: list[str], template: str | None = TEMPLATE, low: int = 1,
                   high: int = 16):
    """Save a Llama + tokenizer (+ template) to `directory`; (directory, model, tokenizer).

    Greedy decoding from every text of `prompts` (the empty text: from bos; messages lists are
    rendered with the template) stops at an eos after `low` to `high` tokens in transformers.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = hf_tokenizer(template)
    ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if isinstance(p, list) else p
           for p in prompts]
    ids = [tokenizer.encode(t, add_special_tokens=False) if t else [tokenizer.bos_token_id] for t in ids]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    for seed in range(200):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight[EOS_IDS] *= 1.0 + (seed % 4)
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=EOS_IDS, pad_token_id=0)
        if all(stops_within(model, tokenizer, p, low, high) for p in ids):
            break
    else:
        raise RuntimeError("no seed gave a model that reaches eos early from every prompt")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer


def hf_llama(seed: int):
    """A tiny transformers Llama with random weights, drawn from `seed` (no two alike)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(hf_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # initial Llama weights are small; these give log-probabilities far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model
