"""LoRA adapters through PEFT itself: glasslm's adapters exported and loaded by
`peft.PeftModel.from_pretrained` on the exported base give glasslm's logits, and a PEFT adapter made
by peft on a transformers model, imported onto the glasslm base, gives peft's logits."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.hf import export_hf, import_hf  # noqa: E402
from glasslm.hf.peft import export_peft_adapter, import_peft_adapter  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.transforms import apply_transform  # noqa: E402
from glasslm.transforms.lora import LoRAConfig, lora_layers  # noqa: E402

IDS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
CONFIGS = {
    "llama": lambda: get_preset("llama-tiny", vocab_size=96, context_length=32, n_layers=2),
    "gpt2": lambda: get_preset("gpt2-small", vocab_size=96, context_length=32, n_layers=2, d_model=64, n_heads=4),
}
SITES = {"llama": ("q", "k", "v", "attn_out", "mlp_gate", "mlp_up", "mlp_down", "unembed"),
         "gpt2": ("q", "v", "attn_out", "mlp_up", "mlp_down")}


def _tolerance(reference: torch.Tensor) -> float:
    # fp32 through two implementations: a few ulps of the largest logit, as the family tests use.
    return 2e-5 * max(1.0, reference.abs().max().item())


def _random_adapters(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for b in layer.lora_b:
                b.copy_(torch.randn(b.shape, generator=generator) * 0.2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_exported_adapter_loads_in_peft_with_glasslms_logits(family, tmp_path):
    torch.manual_seed(0)
    base = TransformerLM(CONFIGS[family]()).eval()
    export_hf(base, tmp_path / "base")
    adapted = copy.deepcopy(base)
    apply_transform(adapted, "lora", LoRAConfig(rank=4, alpha=8.0, sites=SITES[family]))
    _random_adapters(adapted)
    export_peft_adapter(adapted, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours, theirs, plain = adapted(IDS), peft_model(IDS).logits, base(IDS)
    assert (ours - plain).abs().max() > 1e-2  # the adapters matter
    assert (ours - theirs).abs().max() <= _tolerance(theirs)


@pytest.mark.parametrize("family,targets", [("llama", ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"]),
                                            ("gpt2", ["c_attn", "c_fc"])])
def test_a_peft_adapter_imports_onto_glasslm_with_peft_logits(family, targets, tmp_path):
    torch.manual_seed(0)
    export_hf(TransformerLM(CONFIGS[family]()).eval(), tmp_path / "base")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=targets, init_lora_weights=False,
                             fan_in_fan_out=family == "gpt2", rank_pattern={"v_proj": 2}, alpha_pattern={"v_proj": 7})
    peft_model = peft.get_peft_model(hf_model, config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    ours = import_hf(tmp_path / "base").eval()
    import_peft_adapter(ours, tmp_path / "adapter")
    with torch.no_grad():
        theirs = peft_model(IDS).logits
        assert (ours(IDS) - theirs).abs().max() <= _tolerance(theirs)
        with peft_model.disable_adapter():
            assert (peft_model(IDS).logits - theirs).abs().max() > 1e-2  # the adapters matter


def test_not_an_adapter_directory_is_named(tmp_path):
    model = TransformerLM(CONFIGS["llama"]())
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        import_peft_adapter(model, tmp_path)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        export_peft_adapter(model, tmp_path / "out")
