"""LoRA adapters through PEFT itself (peft 0.21 the reference), both ways, with trained values: every
tensor that trains (A, B, DoRA magnitudes, biases, whole modules) moved well away from its initial value,
where a dropped feature changes the logits (at PEFT's initial values most are no-ops).

- A PEFT adapter made by peft on a transformers model, imported onto the glasslm base, gives peft's
  logits: DoRA, rsLoRA, rank/alpha patterns (regular expressions), bias="all"/"lora_only",
  modules_to_save (lm_head, embed_tokens; on a tied GPT-2 they untie), LoRA on the embedding and on a
  tied lm_head, fused and interleaved q/k/v (GPT-2, GPT-NeoX), Gemma 3's scaled embedding.
- glasslm's adapters of every kind, exported, load in `peft.PeftModel.from_pretrained` with glasslm's
  logits, and import back to the same logits.
- One training step in glasslm and in peft from the same adapter ends at the same logits.
- What glasslm does not implement is refused by name, never loaded as a different model.
"""

import copy
import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.hf import export_hf, import_hf  # noqa: E402
from glasslm.hf.peft import PeftAdapterError, export_peft_adapter, import_peft_adapter  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.transforms import apply_transform  # noqa: E402
from glasslm.transforms.lora import (  # noqa: E402
    LoRAConfig, lora_layers, lora_state_dict, recorded_lora_config, trained_parameters,
)

VOCAB = 96
IDS = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
SMALL = dict(vocab_size=VOCAB, context_length=32, n_layers=2)
CONFIGS = {
    "llama": lambda: get_preset("llama-tiny", **SMALL),
    "llama-bias": lambda: get_preset("llama-tiny", bias=True, **SMALL),
    "gpt2": lambda: get_preset("gpt2-small", d_model=64, n_heads=4, **SMALL),  # tied, Conv1D, fused c_attn
    "neox": lambda: get_preset("pythia-160m", d_model=64, n_heads=4, **SMALL),  # q/k/v interleaved per head
    "gemma3": lambda: get_preset("gemma3-270m", d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_mlp=96,
                                 global_layers=(1,), sliding_window=8, **SMALL),  # scaled embedding, tied
    # Mixtures of experts: adapters on attention (peft's q_proj ... o_proj) and on the experts' fused stacks
    # (peft's target_parameters mlp.experts.gate_up_proj / down_proj).
    "mixtral": lambda: get_preset("llama-tiny", n_experts=4, experts_per_token=2, **SMALL),
    "qwen3-moe": lambda: get_preset("llama-tiny", n_experts=4, experts_per_token=2, d_expert=48, qk_norm=True,
                                    moe_every=2, **SMALL),  # layer 0 dense
    "olmoe": lambda: get_preset("llama-tiny", n_experts=4, experts_per_token=2, qk_norm=True, qk_norm_whole=True,
                                router_renormalize=False, **SMALL),
    "qwen2-moe": lambda: get_preset("llama-tiny", n_experts=4, experts_per_token=2, d_expert=48, d_shared_expert=64,
                                    attn_qkv_bias=True, router_renormalize=False, **SMALL),
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # peft's names of transformers 5's fused stacks


def _tolerance(reference: torch.Tensor) -> float:
    # fp32 through two implementations: a few ulps of the largest logit, as the family tests use.
    return 2e-5 * max(1.0, reference.abs().max().item())


def _own_rounding(peft_model, ids: torch.Tensor, logits: torch.Tensor) -> float:
    """How far peft's float32 logits are from its own float64 run (experts looped, as grouped_mm has
    no float64): part of what two float32 implementations may differ by. On an AMD EPYC without
    AVX-512, peft's olmoe down-only rsLoRA logits were 2.0e-5 from float64 and glasslm's 1.7e-6."""
    exact = copy.deepcopy(peft_model).double()
    for module in exact.modules():
        if hasattr(getattr(module, "config", None), "_experts_implementation"):
            module.config._experts_implementation = "eager"
    return (exact(ids).logits - logits.double()).abs().max().item()


def _base(family, directory):
    torch.manual_seed(0)
    model = TransformerLM(CONFIGS[family]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:  # routing by clear margins: near-ties would be decided by rounding
                p.normal_(0, 1.0)
    export_hf(model, directory)
    return model


def _perturb(named_parameters, seed=5):
    """Every trainable tensor moved far from its init (magnitudes by up to ~30% of their size)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_parameters:
            noise = torch.randn(p.shape, generator=generator)
            p.add_(noise * 0.3 * p.abs().mean() if "magnitude" in name else noise * 0.3)


def _peft_adapter(family, tmp_path, **options):
    """(base directory, peft model with trained values, adapter directory) for a LoraConfig."""
    _base(family, tmp_path / "base")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    config = peft.LoraConfig(**{"r": 3, "lora_alpha": 5, "init_lora_weights": False, **options})
    peft_model = peft.get_peft_model(hf_model, config).eval()
    _perturb((n, p) for n, p in peft_model.named_parameters() if p.requires_grad)
    peft_model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "base", peft_model, tmp_path / "adapter"


IMPORTS = {
    "llama-dora": ("llama", dict(target_modules=["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"], use_dora=True)),
    "llama-rslora-patterns": ("llama", dict(
        target_modules=["q_proj", "v_proj", "up_proj"], use_rslora=True, lora_alpha=6,
        rank_pattern={r"layers\.1\.self_attn\.v_proj": 2, "up_proj": 4},
        alpha_pattern={r"layers\.[01]\.self_attn\.q_proj": 11})),
    "llama-bias-all": ("llama-bias", dict(target_modules=["q_proj", "v_proj"], bias="all")),
    "llama-bias-lora-only-dora": ("llama-bias", dict(target_modules=["k_proj", "gate_proj"], bias="lora_only",
                                                     use_dora=True)),
    "llama-modules-to-save": ("llama", dict(target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"])),
    "llama-embedding-dora": ("llama", dict(target_modules=["embed_tokens", "q_proj"], use_dora=True)),
    "gpt2-dora-bias-all": ("gpt2", dict(target_modules=["c_attn", "c_fc"], use_dora=True, bias="all",
                                        fan_in_fan_out=True)),
    "gpt2-bias-lora-only": ("gpt2", dict(target_modules=["c_attn"], bias="lora_only", fan_in_fan_out=True)),
    "gpt2-tied-lm-head-saved": ("gpt2", dict(target_modules=["c_attn"], modules_to_save=["lm_head"],
                                             fan_in_fan_out=True)),
    "gpt2-tied-wte-saved": ("gpt2", dict(target_modules=["c_proj"], modules_to_save=["wte"], fan_in_fan_out=True)),
    "gpt2-tied-both-saved": ("gpt2", dict(target_modules=["c_fc"], modules_to_save=["wte", "lm_head"],
                                          fan_in_fan_out=True)),
    "gpt2-lora-on-tied-lm-head-and-wte": ("gpt2", dict(target_modules=["lm_head", "wte"])),
    "neox-dora-bias-lora-only": ("neox", dict(target_modules=["query_key_value", "dense_4h_to_h"], use_dora=True,
                                              bias="lora_only")),
    "gemma3-embedding-dora": ("gemma3", dict(target_modules=["embed_tokens", "q_proj", "o_proj"], use_dora=True)),
    "mixtral-attention-dora": ("mixtral", dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_dora=True)),
    "qwen3-moe-attention": ("qwen3-moe", dict(target_modules=["q_proj", "v_proj"])),
    "mixtral-experts": ("mixtral", dict(target_modules=["q_proj"], target_parameters=EXPERTS)),
    "olmoe-experts": ("olmoe", dict(target_modules=["k_proj", "o_proj"], target_parameters=EXPERTS, lora_alpha=7)),
    "olmoe-experts-down-only-rslora": ("olmoe", dict(target_modules=[], target_parameters=EXPERTS[1:],
                                                     use_rslora=True)),
    # peft rewrites down_proj on a model with fused experts as target_parameters=['down_proj'] too.
    "qwen3-moe-down-proj": ("qwen3-moe", dict(target_modules=["q_proj", "down_proj"])),
}


@pytest.mark.parametrize("case", IMPORTS)
def test_a_trained_peft_adapter_imports_onto_glasslm_with_peft_logits(case, tmp_path):
    family, options = IMPORTS[case]
    base, peft_model, adapter = _peft_adapter(family, tmp_path, **options)
    ours = import_hf(base).eval()
    import_peft_adapter(ours, adapter)
    with torch.no_grad():
        theirs = peft_model(IDS).logits
        assert (ours(IDS) - theirs).abs().max() <= _tolerance(theirs) + _own_rounding(peft_model, IDS, theirs)
        with peft_model.disable_adapter():
            assert (peft_model(IDS).logits - theirs).abs().max() > 1e-2  # the adapter matters


EXPORTS = {
    "llama-dora": ("llama", dict(sites=("q", "v", "attn_out", "mlp_down"), dora=True)),
    "llama-rslora-dora-embed-unembed": ("llama", dict(sites=("q", "k", "unembed", "embed"), rslora=True, dora=True)),
    "llama-bias-lora-only": ("llama-bias", dict(sites=("q", "v"), bias="lora_only")),
    "llama-bias-all-full": ("llama-bias", dict(sites=("q", "v"), bias="all", full=("embed", "unembed"))),
    "gpt2-dora-bias-all": ("gpt2", dict(sites=("q", "v", "mlp_up"), dora=True, bias="all")),
    "gpt2-tied-embed-and-unembed": ("gpt2", dict(sites=("q", "unembed", "embed"))),
    "gpt2-tied-full-unembed": ("gpt2", dict(sites=("v",), full=("unembed",))),
    "gpt2-tied-full-embed": ("gpt2", dict(sites=("v",), full=("embed",))),
    "neox-dora-bias-lora-only": ("neox", dict(sites=("q", "v", "mlp_down"), dora=True, bias="lora_only")),
    "gemma3-dora-embed-unembed": ("gemma3", dict(sites=("q", "v", "embed", "unembed"), dora=True)),
    "mixtral-attention": ("mixtral", dict(sites=("q", "k", "v", "attn_out"))),
    "qwen3-moe-dora": ("qwen3-moe", dict(sites=("q", "v"), dora=True)),
    "mixtral-experts": ("mixtral", dict(sites=("q", "mlp_gate", "mlp_up", "mlp_down"))),
    "olmoe-experts-rslora": ("olmoe", dict(sites=("q", "k", "mlp_gate", "mlp_up"), rslora=True)),
    "olmoe-experts-only": ("olmoe", dict(sites=("mlp_down",))),
}


@pytest.mark.parametrize("case", EXPORTS)
def test_glasslms_trained_adapter_loads_in_peft_with_its_logits_and_imports_back(case, tmp_path):
    family, options = EXPORTS[case]
    base = _base(family, tmp_path / "base")
    adapted = copy.deepcopy(base)
    apply_transform(adapted, "lora", LoRAConfig(rank=3, alpha=5.0, **options))
    _perturb(trained_parameters(adapted, recorded_lora_config(adapted)).items(), seed=7)
    export_peft_adapter(adapted, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    back = copy.deepcopy(base)
    import_peft_adapter(back, tmp_path / "adapter")
    with torch.no_grad():
        ours, theirs = adapted(IDS), peft_model(IDS).logits
        assert (ours - base(IDS)).abs().max() > 1e-2  # the adapter matters
        assert (ours - theirs).abs().max() <= _tolerance(theirs)
        assert (back(IDS) - ours).abs().max() <= _tolerance(ours)


@pytest.mark.parametrize("family, options", [
    ("llama-bias", dict(sites=("embed", "k", "q"), dora=True, bias="all", full=("unembed",))),
    # peft's expert layout (A rows expert-major, B columns rank-major) read back into glasslm's stacks.
    ("olmoe", dict(sites=("mlp_down", "mlp_gate", "mlp_up", "q"))),
], ids=["llama-bias", "olmoe-experts"])
def test_an_adapter_of_one_shape_comes_back_as_the_same_tensors(family, options, tmp_path):
    base = _base(family, tmp_path / "base")
    adapted = copy.deepcopy(base)
    apply_transform(adapted, "lora", LoRAConfig(rank=3, alpha=5.0, **options))
    _perturb(trained_parameters(adapted, recorded_lora_config(adapted)).items(), seed=7)
    export_peft_adapter(adapted, tmp_path / "adapter")
    back = copy.deepcopy(base)
    import_peft_adapter(back, tmp_path / "adapter")
    assert recorded_lora_config(back) == recorded_lora_config(adapted)
    ours, again = lora_state_dict(adapted), lora_state_dict(back)
    assert ours.keys() == again.keys() and all(torch.allclose(ours[k], again[k], atol=1e-6) for k in ours)


def _sgd_step(model, parameters):
    optimizer = torch.optim.SGD(parameters, lr=0.05)
    model.train()
    logits = model(IDS) if isinstance(model, TransformerLM) else model(IDS).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten()).backward()
    optimizer.step()
    return model.eval()


@pytest.mark.parametrize("family,options", [
    ("llama-bias", dict(target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True, use_rslora=True,
                        bias="all", modules_to_save=["lm_head"])),
    ("gpt2", dict(target_modules=["c_attn", "lm_head"], use_dora=True, bias="lora_only", fan_in_fan_out=True,
                  modules_to_save=["wte"])),
], ids=["llama", "gpt2-tied"])
def test_one_training_step_in_glasslm_and_in_peft_ends_at_the_same_logits(family, options, tmp_path):
    base, peft_model, adapter = _peft_adapter(family, tmp_path, **options)
    ours = import_hf(base)
    import_peft_adapter(ours, adapter)
    theirs_trained = [p for p in peft_model.parameters() if p.requires_grad]
    ours_trained = [p for p in ours.parameters() if p.requires_grad]
    assert set(trained_parameters(ours, recorded_lora_config(ours)).values()) == set(ours_trained)
    _sgd_step(peft_model, theirs_trained)
    _sgd_step(ours, ours_trained)
    with torch.no_grad():
        theirs = peft_model(IDS).logits
        assert (ours(IDS) - theirs).abs().max() <= 5 * _tolerance(theirs)


def _saved_config(adapter, **changes):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("change, message", [
    (dict(lora_bias=True), r"lora_bias=True \(a bias on each lora_B\)"),
    (dict(trainable_token_indices=[1, 2]), r"trainable_token_indices=\[1, 2\] \(trainable rows of the embedding\)"),
    (dict(layer_replication=[[0, 2], [1, 2]]), r"layer_replication=.* \(layers repeated from others\)"),
    (dict(a_future_option=3), r"a_future_option=3 \(an option glasslm does not know\)"),
    (dict(peft_type="IA3"), "glasslm reads LoRA adapters, this one is IA3"),
    (dict(use_dora=True), "do not fit a DoRA adapter"),
])
def test_what_glasslm_does_not_implement_is_refused_by_name(change, message, tmp_path):
    base, _, adapter = _peft_adapter("llama", tmp_path, target_modules=["q_proj"])
    _saved_config(adapter, **change)
    with pytest.raises(PeftAdapterError, match=message):
        import_peft_adapter(import_hf(base), adapter)


@pytest.mark.parametrize("options, message", [
    (dict(target_modules=["wpe"]), r"adapters on modules glasslm cannot adapt in this model: \['transformer.wpe'\]"),
    (dict(target_modules=["c_attn"], modules_to_save=["ln_f"], fan_in_fan_out=True),
     "modules_to_save 'ln_f'.*glasslm trains whole only the embedding and the unembedding"),
    (dict(target_modules=["c_attn"], modules_to_save=["wte"], ensure_weight_tying=True, fan_in_fan_out=True),
     "ensure_weight_tying"),
])
def test_adapters_on_what_glasslm_cannot_adapt_are_refused_by_name(options, message, tmp_path):
    base, _, adapter = _peft_adapter("gpt2", tmp_path, **options)
    with pytest.raises(PeftAdapterError, match=message):
        import_peft_adapter(import_hf(base), adapter)


def test_an_adapter_saved_for_a_resized_vocabulary_is_refused(tmp_path):
    _base("llama", tmp_path / "base")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    hf_model.resize_token_embeddings(VOCAB + 4)  # two new chat tokens, say
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    peft.get_peft_model(hf_model, config).save_pretrained(tmp_path / "adapter")
    with pytest.raises(PeftAdapterError, match=r"shape \(100, 128\), the base's \(96, 128\).*resized vocabulary"):
        import_peft_adapter(import_hf(tmp_path / "base"), tmp_path / "adapter")


def test_not_an_adapter_directory_is_named(tmp_path):
    model = TransformerLM(CONFIGS["llama"]())
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        import_peft_adapter(model, tmp_path)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        export_peft_adapter(model, tmp_path / "out")
    assert not lora_layers(model)


@pytest.mark.parametrize("options, message", [
    (dict(sites=("q", "mlp_gate")), "adapts mlp_gate and mlp_up together"),
    (dict(sites=("mlp_down",), dropout=0.1), "not supported with dropout"),
    (dict(sites=("mlp_down",), dora=True), "not supported with DoRA"),
])
def test_what_adapters_on_experts_cannot_be_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        apply_transform(TransformerLM(CONFIGS["olmoe"]()), "lora", LoRAConfig(**options))
    with pytest.raises(ValueError, match="not supported with a shared expert"):
        apply_transform(TransformerLM(CONFIGS["qwen2-moe"]()), "lora", LoRAConfig(sites=("mlp_down",)))


def test_expert_and_dense_mlp_adapters_in_one_model_are_refused_on_export(tmp_path):
    """peft rewrites gate_proj / up_proj / down_proj target modules on a model with fused experts into
    target_parameters of its own ranks; a Qwen3-MoE with dense layers between cannot say both apart."""
    adapted = copy.deepcopy(_base("qwen3-moe", tmp_path / "base"))
    apply_transform(adapted, "lora", LoRAConfig(rank=3, sites=("v", "mlp_gate", "mlp_up", "mlp_down")))
    with pytest.raises(ValueError, match=r"adapters on both the experts and dense MLP layers \(blocks.0.mlp.down"):
        export_peft_adapter(adapted, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_an_expert_adapter_on_other_parameters_is_refused_by_name(tmp_path):
    base, _, adapter = _peft_adapter("olmoe", tmp_path, target_modules=["q_proj"], target_parameters=EXPERTS)
    _saved_config(adapter, target_parameters=[*EXPERTS, "mlp.gate.weight"])
    with pytest.raises(PeftAdapterError, match=r"target_parameters \['mlp.gate.weight'\]"):
        import_peft_adapter(import_hf(base), adapter)
