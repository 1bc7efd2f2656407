"""LoRA adapters against closed forms: W + (alpha/r) B A written into a plain copy of the model,
the paper's init, exact merge/unmerge, fused q/k/v as separately adapted projections, QLoRA
gradients through a quantized base; DoRA's rows rescaled to their magnitudes, rsLoRA's scaling,
adapters on the embedding and a tied unembedding, and biases and whole modules trained and saved
with the adapters (tests/hf/test_peft.py checks all of them against peft itself)."""

import copy
import math

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.presets import get_preset
from glasslm.transforms.lora import (
    LoRAConfig, LoRALinear, add_lora, lora_layers, lora_state_dict, merge_lora, remove_lora, unmerge_lora,
)
from glasslm.transforms import apply_transform, applied_transforms


def _model(**overrides):
    torch.manual_seed(0)
    config = get_preset("llama-tiny", n_layers=2, vocab_size=97, context_length=32, **overrides)
    return TransformerLM(config).eval()


def _randomize_adapters(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for b in layer.lora_b:
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)


IDS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
ALL_SITES = ("q", "k", "v", "attn_out", "mlp_up", "mlp_gate", "mlp_down", "unembed")


@pytest.mark.parametrize("sites", [("q", "v"), ("k",), ALL_SITES])
def test_adapted_model_equals_the_base_with_the_update_written_into_its_weights(sites):
    base = _model()
    adapted = copy.deepcopy(base)
    config = LoRAConfig(rank=4, alpha=8.0, sites=sites)
    add_lora(adapted, config)
    _randomize_adapters(adapted)
    expected_weights = {name: p.detach().clone() for name, p in base.named_parameters()}
    for name, layer in lora_layers(adapted).items():
        for (start, end), a, b in zip(layer.row_blocks, layer.lora_a, layer.lora_b):
            expected_weights[f"{name}.weight"][start:end] += (config.alpha / config.rank) * (b @ a).detach()
    reference = _model()
    reference.load_state_dict(expected_weights)
    with torch.no_grad():
        torch.testing.assert_close(adapted(IDS), reference(IDS), rtol=1e-5, atol=1e-5)


def test_fused_qkv_adapts_only_the_projections_asked_for():
    model = _model()
    add_lora(model, LoRAConfig(rank=2, sites=("q", "v")))
    _randomize_adapters(model)
    layer = lora_layers(model)["blocks.0.attn.qkv"]
    attn = model.blocks[0].attn
    q_rows, kv_rows = attn.n_heads * attn.d_head, attn.n_kv_heads * attn.d_head
    delta = layer.delta_weight()
    assert delta[:q_rows].abs().sum() > 0 and delta[q_rows + kv_rows:].abs().sum() > 0
    assert torch.equal(delta[q_rows:q_rows + kv_rows], torch.zeros(kv_rows, delta.shape[1]))


def test_starts_equal_to_the_base_with_the_papers_init_and_only_adapters_train():
    base = _model()
    adapted = copy.deepcopy(base)
    add_lora(adapted, LoRAConfig(rank=8, sites=ALL_SITES))
    with torch.no_grad():
        assert torch.equal(adapted(IDS), base(IDS))
    trainable = {name for name, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(adapted)) and trainable
    for layer in lora_layers(adapted).values():
        bound = 1 / math.sqrt(layer.d_in)  # Kaiming-uniform with a = sqrt(5), nn.Linear's init
        for a, b in zip(layer.lora_a, layer.lora_b):
            assert a.abs().max() <= bound and a.std() > bound / math.sqrt(3) * 0.8
            assert torch.equal(b, torch.zeros_like(b))


def test_merge_is_the_same_model_and_unmerge_restores_the_exact_weights():
    model = _model()
    add_lora(model, LoRAConfig(rank=4, sites=ALL_SITES))
    _randomize_adapters(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        unmerged_logits = model(IDS)
        merge_lora(model)
        torch.testing.assert_close(model(IDS), unmerged_logits, rtol=1e-5, atol=1e-5)
        unmerge_lora(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    remove_lora(model)
    assert not lora_layers(model)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), unmerged_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_qlora_gradients_flow_through_the_quantized_base(method):
    fast, readable = _model(), _model(impl="readable")  # readable: plain autograd through the dequantized weight
    apply_transform(fast, method)
    apply_transform(readable, method)
    for model in (fast, readable):
        add_lora(model, LoRAConfig(rank=4, sites=("q", "v", "mlp_down")))
        _randomize_adapters(model)
        model.train()
    readable.load_state_dict(lora_state_dict(fast), strict=False)  # the same adapters in both
    grads = []
    for model in (fast, readable):
        logits = model(IDS)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), IDS.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    first_layer = "blocks.0.attn.qkv.lora_a.0"
    assert grads[0][first_layer].abs().sum() > 0  # reached the first layer through every later base
    for name in grads[1]:  # the fast kernel rounds activations to bf16: the same direction and size
        fast_grad, readable_grad = grads[0][name].flatten(), grads[1][name].flatten()
        assert torch.nn.functional.cosine_similarity(fast_grad, readable_grad, dim=0) > 0.99, name
        assert abs(fast_grad.norm() / readable_grad.norm() - 1) < 0.05, name


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unknown LoRA site"):
        LoRAConfig(sites=("query",))
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="bias must be one of"):
        LoRAConfig(bias="some")
    with pytest.raises(ValueError, match="full modules must be"):
        LoRAConfig(sites=("q", "embed"), full=("embed",))
    quantized = _model()
    apply_transform(quantized, "int8")
    with pytest.raises(ValueError, match="Int8Linear .quantized.., which cannot train whole"):
        add_lora(quantized, LoRAConfig(full=("unembed",)))
    model = _model()
    add_lora(model, LoRAConfig())
    with pytest.raises(ValueError, match="already"):
        add_lora(model, LoRAConfig())
    assert isinstance(lora_layers(model)["blocks.0.attn.qkv"], LoRALinear)


def test_lora_is_a_registered_transform_recorded_after_quantization(tmp_path):
    from glasslm.io.checkpoint import load_checkpoint, save_checkpoint

    model = _model()
    apply_transform(model, "int4")
    apply_transform(model, "lora", LoRAConfig(rank=2, sites=("q", "mlp_down")))
    _randomize_adapters(model)
    assert applied_transforms(model) == [
        {"name": "int4"}, {"name": "lora", "rank": 2, "alpha": 16.0, "dropout": 0.0, "sites": ("q", "mlp_down"),
                           "rslora": False, "dora": False, "bias": "none", "full": ()}]
    save_checkpoint(tmp_path / "ckpt", model)
    loaded, _, _ = load_checkpoint(tmp_path / "ckpt")
    assert [r["name"] for r in applied_transforms(loaded)] == ["int4", "lora"]
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(IDS), model.eval()(IDS), rtol=0, atol=0)


# ----- DoRA, rsLoRA, the embedding and a tied unembedding, and what trains beside the adapters -----

def _perturb_trained(model, seed=2):
    """Every trained tensor (A, B, magnitudes, biases, whole modules) moved well off its initial value."""
    from glasslm.transforms.lora import recorded_lora_config, trained_parameters

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trained_parameters(model, recorded_lora_config(model)).items():
            noise = torch.randn(p.shape, generator=generator)
            p.add_(noise * 0.2 * p.abs().mean() if "magnitude" in name else noise * 0.2)


def _tied_gpt2():
    torch.manual_seed(0)
    return TransformerLM(get_preset("gpt2-small", n_layers=2, d_model=32, n_heads=2, vocab_size=97,
                                    context_length=32)).eval()


def test_dora_rslora_equals_the_base_with_each_adapted_row_rescaled_to_its_magnitude():
    base = _model()
    adapted = copy.deepcopy(base)
    config = LoRAConfig(rank=4, alpha=6.0, sites=("q", "v", "mlp_down"), dora=True, rslora=True)
    apply_transform(adapted, "lora", config)
    _perturb_trained(adapted)
    scaling = 6.0 / math.sqrt(4)  # rsLoRA
    expected = {name: p.detach().clone() for name, p in base.named_parameters()}
    for name, layer in lora_layers(adapted).items():
        weight = expected[f"{name}.weight"]
        for (start, end), a, b, m in zip(layer.row_blocks, layer.lora_a, layer.lora_b, layer.magnitude):
            rows = weight[start:end] + scaling * (b @ a).detach()
            weight[start:end] = m.detach()[:, None] * rows / rows.norm(dim=1, keepdim=True)  # m * direction
    reference = _model()
    reference.load_state_dict(expected)
    with torch.no_grad():
        assert (adapted(IDS) - base(IDS)).abs().max() > 1e-2
        torch.testing.assert_close(adapted(IDS), reference(IDS), rtol=1e-5, atol=1e-5)
        merge_lora(adapted)
        torch.testing.assert_close(adapted(IDS), reference(IDS), rtol=1e-5, atol=1e-5)
        unmerge_lora(adapted)
    assert all(torch.equal(p, base.get_parameter(n.replace(".base.", "."))) for n, p in adapted.named_parameters()
               if ".base." in n)


def test_a_tied_models_embedding_and_unembedding_adapt_apart():
    """LoRA on the embedding changes the lookup only; on a tied unembedding, the logits only: the
    reference is the untied model with each table changed on its own."""
    base = _tied_gpt2()
    adapted = copy.deepcopy(base)
    apply_transform(adapted, "lora", LoRAConfig(rank=3, alpha=3.0, sites=("embed", "unembed"), dora=True))
    _perturb_trained(adapted)
    layers = lora_layers(adapted)
    table = base.embed.weight.detach()
    embed_rows = table.T + (layers["embed"].lora_b[0] @ layers["embed"].lora_a[0]).detach()        # (d, vocab)
    embed_rows = layers["embed"].magnitude[0].detach()[:, None] * embed_rows / embed_rows.norm(dim=1, keepdim=True)
    unembed = table + (layers["unembed"].lora_b[0] @ layers["unembed"].lora_a[0]).detach()         # (vocab, d)
    unembed = layers["unembed"].magnitude[0].detach()[:, None] * unembed / unembed.norm(dim=1, keepdim=True)
    reference = copy.deepcopy(base)
    reference.config = reference.config.replace(tie_embeddings=False)
    reference.unembed = torch.nn.Linear(32, 97, bias=False)
    with torch.no_grad():
        reference.embed.weight.copy_(embed_rows.T)
        reference.unembed.weight.copy_(unembed)
        torch.testing.assert_close(adapted(IDS), reference(IDS), rtol=1e-5, atol=1e-5)
        remove_lora(adapted)  # merging unties: the two tables are now different
        assert not adapted.config.tie_embeddings
        torch.testing.assert_close(adapted(IDS), reference(IDS), rtol=1e-5, atol=1e-5)


def test_without_merging_a_tied_unembedding_is_tied_again():
    model = _tied_gpt2()
    add_lora(model, LoRAConfig(sites=("unembed",)))
    assert model.unembed is not None and model.config.tie_embeddings  # the adapter reads the embedding's table
    remove_lora(model, merge=False)
    assert model.unembed is None and model.config.tie_embeddings


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_biases_and_whole_modules_train_with_the_adapters_and_are_saved_with_them(bias, tmp_path):
    from glasslm.io.checkpoint import load_checkpoint, save_checkpoint

    model = _tied_gpt2()
    apply_transform(model, "lora", LoRAConfig(rank=2, sites=("q", "mlp_up"), bias=bias, full=("embed",)))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    biases = {name for name in trainable if name.endswith("bias")}
    if bias == "all":
        assert biases == {name for name in model.state_dict() if name.endswith("bias")}
    else:
        assert biases == {"blocks.0.attn.qkv.base.bias", "blocks.1.attn.qkv.base.bias",
                          "blocks.0.mlp.up.base.bias", "blocks.1.mlp.up.base.bias"}
    assert "embed.weight" in trainable and "unembed.weight" not in trainable  # untied: the copy stays the base's
    assert not model.config.tie_embeddings and set(lora_state_dict(model)) == trainable
    _perturb_trained(model)
    save_checkpoint(tmp_path / "ckpt", model)
    loaded, _, _ = load_checkpoint(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(IDS), model(IDS), rtol=0, atol=0)
        torch.testing.assert_close(model.unembed.weight, _tied_gpt2().embed.weight, rtol=0, atol=0)


def test_expert_adapters_are_each_experts_update_written_into_its_stack_and_train():
    """On a mixture of experts, expert e of each stack computes with W_e + s B_e A_e ([gate | up] rows share
    one A): a plain copy with those weights gives the same logits; merge / unmerge / disabling agree; the
    router's aux loss still reaches training, and a step moves the expert adapters."""
    from glasslm.transforms.lora import LoRAExperts, adapters_disabled

    base = _model(n_experts=4, experts_per_token=2, d_expert=24)
    adapted = copy.deepcopy(base)
    config = LoRAConfig(rank=3, alpha=5.0, sites=("mlp_gate", "mlp_up", "mlp_down"))
    add_lora(adapted, config)
    _randomize_adapters(adapted)
    expected = {name: p.detach().clone() for name, p in base.named_parameters()}
    for name, layer in lora_layers(adapted).items():
        assert isinstance(layer, LoRAExperts) and layer.groups == ("gate_up", "down")
        (a_gu, a_d), (b_gu, b_d) = layer.lora_a, layer.lora_b
        for e in range(4):
            update = config.scaling * (b_gu[e] @ a_gu[e]).detach()  # (2 d_expert, d_model)
            expected[f"{name}.gate"][e] += update[:24]
            expected[f"{name}.up"][e] += update[24:]
            expected[f"{name}.down"][e] += config.scaling * (b_d[e] @ a_d[e]).detach()
    reference = _model(n_experts=4, experts_per_token=2, d_expert=24)
    reference.load_state_dict(expected)
    with torch.no_grad():
        ours = adapted(IDS)
        torch.testing.assert_close(ours, reference(IDS), rtol=1e-5, atol=1e-5)
        assert (ours - base(IDS)).abs().max() > 1e-3
        with adapters_disabled(adapted):
            torch.testing.assert_close(adapted(IDS), base(IDS), rtol=0, atol=0)
        merge_lora(adapted)
        torch.testing.assert_close(adapted(IDS), ours, rtol=1e-5, atol=1e-5)
        unmerge_lora(adapted)
        assert all(torch.equal(adapted.blocks[i].mlp.base.up, base.blocks[i].mlp.up) for i in range(2))
    adapted.train()
    loss = torch.nn.functional.cross_entropy(adapted(IDS).flatten(0, 1), IDS.flatten()) + adapted.router_losses()["aux"]
    loss.backward()
    trained = [p for p in adapted.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and p.grad.abs().max() > 0 for p in trained)
    assert not any(p.requires_grad for name, p in adapted.named_parameters() if ".base." in name)
