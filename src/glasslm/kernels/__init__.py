"""glasslm's own CPU kernels, in C++, each beside the readable Python it must equal.

- `qmatmul`: int8 activations times 4- or 8-bit block weights (llama.cpp's Q4_0, Q4_1, Q8_0 and
  glasslm's int4 and int8), the product every quantized layer's fast path runs (qmatmul.cpp);
- `decode`: the small steps of a one-token decoding step (RMSNorm with the residual add before it;
  rotary, the cache write and attention over the filled cache slots), one call each (decode.cpp),
  which `glasslm.generation.fast` composes with the model's own layers;
- `block.cpp`: a whole block's decoding step in one call (`glasslm_kernels.Block`), the two above
  joined in C++ where every product of the block is a packed quantized matrix;
- `build`: compiling them on first use into a cache, choosing the CPU's path (AVX-512 VNNI, AVX2,
  plain C++; `$GLASSLM_KERNELS` overrides), and the one-line fallback where no compiler exists.
"""
