"""The tree attention's Triton kernel against its reference (``decoding.forward.tree_attention``), as a script.

``python -m tests.decoding.forward.tree_triton_check`` under ``TRITON_INTERPRET=1`` (Triton's interpreter: the
kernel on the CPU) checks a grid of shapes (grouped heads of 1 to 3, a step of 1 to 40 tokens over key blocks
smaller than it, empty and filled prefixes, random trees with padding), every token bucket of the static step in
the default model's head layout, and then a greedy decode through the static
step's CUDA path, lookahead and plain, with the kernel in every layer; it prints each check and exits 1 on a
mismatch. ``tests/decoding/forward/test_tree_attention.py`` runs it in a subprocess (the interpreter is chosen
when Triton is imported); ``tests/decoding/test_cuda.py`` calls the same checks on a GPU.
"""

from __future__ import annotations

import sys

import torch

from decoding.forward import tree_attention

# (sequences, tokens, heads, kv heads, head size, cached lengths)
CASES = [
    (1, 1, 3, 1, 16, [5]),
    (1, 8, 3, 1, 16, [20]),
    (2, 8, 4, 2, 16, [0, 33]),
    (2, 13, 9, 3, 16, [40, 17]),
    (1, 40, 6, 2, 32, [50]),
    (3, 5, 2, 2, 64, [0, 1, 70]),
]


def random_case(sequences: int, tokens: int, heads: int, kv_heads: int, dim: int, lengths: list[int],
                device: torch.device, seed: int = 0, slots: int = 128) -> tuple[tuple, torch.Tensor]:
    """The attention op's arguments for one random step (its reach by the reference) and the parents: a random tree
    per sequence (each token's parent an earlier token or none; the last two tokens padding), distinct pool rows,
    random cached keys in rows of ``slots`` slots."""
    generator = torch.Generator().manual_seed(seed)
    count = sequences * tokens
    states = torch.randn(count, (heads + 2 * kv_heads) * dim, generator=generator)
    positions = torch.randint(0, 200, (count,), generator=generator).float()
    inverse = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[:, None] * inverse
    angles = torch.cat((angles, angles), dim=-1)
    rotation = torch.stack((angles.cos(), angles.sin()), dim=1)
    cache = torch.randn(sequences + 1, 2 * kv_heads, slots, dim, generator=generator)
    parents = torch.full((sequences, tokens), -1, dtype=torch.long)
    for sequence in range(sequences):
        for token in range(1, max(1, tokens - 2)):
            parents[sequence, token] = int(torch.randint(-1, token, (), generator=generator))
    rows = torch.randperm(sequences + 1, generator=generator)[:sequences]
    moved = (states, rotation, cache, tree_attention.reference_reach(parents), torch.tensor(lengths), rows)
    return (*(tensor.to(device).contiguous() for tensor in moved), heads, 0.125), parents.to(device)


def mismatches(device: torch.device, tolerance: float = 1e-4) -> list[str]:
    """Every case of ``CASES`` run through the kernels (key blocks of 16) and the references: a line per case whose
    reach differs, or whose outputs or written caches differ by more than ``tolerance``."""
    failed = []
    for case in CASES:
        (states, rotation, cache, reach, lengths, rows, heads, scaling), parents = random_case(*case, device=device)
        walked = tree_attention.launch_reach(parents, block_rows=4, block_keys=16)
        if not torch.equal(walked, reach):
            failed.append(f"{case}: the walked reach differs from the closure's")
        expected_cache, kernel_cache = cache.clone(), cache.clone()
        expected = tree_attention.reference(states, rotation, expected_cache, reach, lengths, rows, heads, scaling)
        output = tree_attention.launch(states, rotation, kernel_cache, reach, lengths, rows, heads, scaling,
                                       block_keys=16)
        error = (output - expected).abs().max().item()
        cache_error = (kernel_cache - expected_cache).abs().max().item()
        print(f"case {case}: output off by {error:.2e}, cache by {cache_error:.2e}")
        if not error <= tolerance or not cache_error <= tolerance:
            failed.append(f"{case}: output {error:.2e}, cache {cache_error:.2e}")
    return failed


def bucket_mismatches(device: torch.device, tolerance: float = 1e-4) -> list[str]:
    """Both kernels, launched as the ops launch them (key blocks of 64), against the references at every token bucket
    of the static step (``TOKEN_BUCKETS``, one sequence) and at a batched one, in the default model's head layout (9
    query heads over 3 key heads of 64) over 300 cached slots: the shapes a server warms at start. A line per bucket
    that differs."""
    from decoding.forward.static import TOKEN_BUCKETS

    failed = []
    for sequences, tokens in [(1, size) for size in TOKEN_BUCKETS] + [(4, 64)]:
        (states, rotation, cache, reach, lengths, rows, heads, scaling), parents = random_case(
            sequences, tokens, 9, 3, 64, [300] * sequences, device, slots=300 + tokens)
        expected_cache, kernel_cache = cache.clone(), cache.clone()
        expected = tree_attention.reference(states, rotation, expected_cache, reach, lengths, rows, heads, scaling)
        output = tree_attention.launch(states, rotation, kernel_cache, reach, lengths, rows, heads, scaling)
        walked = tree_attention.launch_reach(parents)
        error = (output - expected).abs().max().item()
        cache_error = (kernel_cache - expected_cache).abs().max().item()
        print(f"bucket {sequences} x {tokens}: output off by {error:.2e}, cache by {cache_error:.2e}", flush=True)
        if not (error <= tolerance and cache_error <= tolerance and torch.equal(walked, reach)):
            failed.append(f"bucket {sequences} x {tokens}: output {error:.2e}, cache {cache_error:.2e}")
    return failed


def decode_mismatches(device: torch.device) -> list[str]:
    """Greedy decodes through the static step's CUDA path on a tiny LLaMA with 16-wide heads (the kernel in every
    layer): lookahead at two configurations equals plain greedy, and greedy equals the eager loop."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoding.batch import BatchEngine
    from decoding.forward.kv_cache import KVPool
    from decoding.forward.static import StaticStep
    from decoding.params import LookaheadConfig, StopCriteria
    from decoding.step.stream import generate_autoregressive
    from tests.decoding.forward.test_static import decode
    from tests.decoding.test_batch import PROMPTS, tokens_of

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512)).eval().to(device)
    runner = StaticStep(model, KVPool(model, 2, 256, scratch_tokens=64), "graphs")
    if not runner.weights.tree_kernel:
        return ["the static step did not take the tree kernel"]
    prompts, failed = PROMPTS[:2], []
    with torch.inference_mode():
        expected = [tokens_of(generate_autoregressive(model, prompt, StopCriteria(16))) for prompt in prompts]
        greedy = decode(BatchEngine(model, static=runner), prompts, [None] * len(prompts), 16)
        if greedy != expected:
            failed.append(f"greedy through the kernel {greedy} != eager {expected}")
        for config in (LookaheadConfig(4, 4, 4), LookaheadConfig(7, 5, 7)):
            found = decode(BatchEngine(model, static=runner), prompts, [config] * len(prompts), 16)
            print(f"lookahead {config.window_size}-{config.ngram_size}-{config.guess_set_size}: "
                  f"{'same' if found == greedy else 'DIFFERENT'} tokens as greedy")
            if found != greedy:
                failed.append(f"lookahead {config} {found} != greedy {greedy}")
    return failed


def index_scalars_in_the_interpreter() -> None:
    """Triton 3.6's interpreter makes a scalar into an index (a loop bound, ``range(0, length, ...)``) with ``int()``
    of a one-element array, which numpy 2 refuses; numpy 1 took it. Index through ``.item()`` instead: a fix to the
    interpreter for this run, the kernel as compiled for a GPU is untouched."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch


def main() -> int:
    index_scalars_in_the_interpreter()
    cpu = torch.device("cpu")
    failed = mismatches(cpu) + bucket_mismatches(cpu) + decode_mismatches(cpu)
    for line in failed:
        print("MISMATCH", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
