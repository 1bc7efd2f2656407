"""The readable core: everything one forward pass needs, and nothing else.

`config` (ModelConfig and the presets), `layers` (Linear, norms, activations, MLPs, dropout,
cross-entropy), `positions` (learned, sinusoidal, rotary), `attention` (softmax, masks, scaled
dot-product attention, KV caches, multi-head attention) and `model` (Block, TransformerLM, init).
Read them in that order; the rest of glasslm (training, generation, tokenizers, interop, serving)
is built on these five modules.
"""
