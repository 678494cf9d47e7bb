"""A 3-billion-parameter GPT's profile (embedding, 32 layers, head), as `hetrain profile` would describe it."""

from hetrain.workload.profile import BlockProfile, WorkloadProfile


def gpt_3b(layers: int = 32, hidden: int = 2560, vocab: int = 50257, seq: int = 1024, heads: int = 32
           ) -> WorkloadProfile:
    h, s = hidden, seq
    boundary = 2.0 * s * h                     # one 16-bit hidden state per token
    layer_params = 12 * h * h
    layer_forward = 2.0 * s * layer_params + 4.0 * s * s * h
    head_forward = 2.0 * s * h * vocab
    blocks = [BlockProfile(name="embed", params=vocab * h + s * h, flops_per_sample=0.0,
                           activation_bytes_per_sample=boundary, output_bytes_per_sample=boundary)]
    blocks += [BlockProfile(name=f"layer{i}", params=layer_params, flops_per_sample=3 * layer_forward,
                            activation_bytes_per_sample=s * h * (34 + 5 * heads * s / h),
                            output_bytes_per_sample=boundary) for i in range(layers)]
    blocks.append(BlockProfile(name="head", params=1, flops_per_sample=3 * head_forward,
                               activation_bytes_per_sample=6.0 * s * vocab, output_bytes_per_sample=4.0 * s))
    return WorkloadProfile(
        name="gpt-3b", kind="transformer", params=sum(b.params for b in blocks),
        flops_per_sample=sum(b.flops_per_sample for b in blocks),
        activation_bytes_per_sample=sum(b.activation_bytes_per_sample for b in blocks), activation_dtype_bytes=2,
        seq_len=s, matrix_shapes=[(vocab, h)] + layers * ([(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]), blocks=blocks,
        source="tests: a 3B GPT")
