"""LlamaModel against Hugging Face's LlamaForCausalLM on tiny random checkpoints: full prefill,
and ragged batches mixing prefill chunks, decode steps and verify steps through a paged cache."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from verispec.model import AttentionMetadata, LlamaModel, load_model
from verispec.model import attention as attention_module
from verispec.model import linear as linear_module
from verispec.model.llama import rms_norm

BLOCK_SIZE = 4
NUM_BLOCKS = 64


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] float32
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run_schedule(model: LlamaModel, prompts: list[list[int]], schedule: list[list[int]],
                 seed: int = 0) -> list[torch.Tensor]:
    """Feed each prompt in the chunk sizes `schedule` gives (one row per step, one entry per
    sequence, 0 = sits the step out), all live sequences in one batch per step, over shuffled
    non-contiguous block tables. Returns each sequence's logits for all its positions."""
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(p) // BLOCK_SIZE))] for p in prompts]
    caches = model.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in schedule:
        seqs = [b for b, n in enumerate(step) if n]
        ids = [t for b in seqs for t in prompts[b][done[b] : done[b] + step[b]]]
        attn = AttentionMetadata.build([step[b] for b in seqs], [done[b] + step[b] for b in seqs],
                                       [tables[b] for b in seqs], BLOCK_SIZE, model.device)
        out = model(torch.tensor(ids, device=model.device), attn.positions(), attn, caches,
                    torch.arange(len(ids), device=model.device)).cpu()
        for b, rows in zip(seqs, out.split([step[b] for b in seqs])):
            logits[b].append(rows)
            done[b] += step[b]
    assert done == [len(p) for p in prompts]
    return [torch.cat(rows) for rows in logits]


@pytest.fixture(scope="module")
def ours(tiny_checkpoint) -> LlamaModel:
    return load_model(str(tiny_checkpoint[1]), progress=False)[0]


@pytest.mark.parametrize("length", [1, 37, 90])  # 90 > SKINNY_MAX_ROWS: the F.linear path
def test_prefill_matches_hf(tiny_checkpoint, ours, length) -> None:
    hf, _ = tiny_checkpoint
    ids = torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    (logits,) = run_schedule(ours, [ids], [[length]])
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=2e-5, rtol=1e-5)


# Sequences of 40, 23, 30 and 19 tokens. Chunks above MAX_PADDED_QUERY_LEN (16) take the one-at-
# a-time path, with (step 2: 17, 18) and without (step 1: 20) cached context; the rest share a
# padded call: prefill chunks, decode tokens (1) and verify steps (3-5), sequences sitting out.
SCHEDULE = [
    [20, 5, 1, 0],
    [1, 17, 3, 12],
    [4, 1, 18, 1],
    [1, 0, 3, 5],
    [14, 0, 5, 1],
]
LENGTHS = [sum(col) for col in zip(*SCHEDULE)]


@pytest.mark.parametrize("max_padded", [16, 0, 1000], ids=["mixed", "all-single", "all-padded"])
def test_ragged_paged_batches_match_hf(tiny_checkpoint, ours, monkeypatch, max_padded) -> None:
    hf, _ = tiny_checkpoint
    monkeypatch.setattr(attention_module, "MAX_PADDED_QUERY_LEN", max_padded)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in LENGTHS]
    for prompt, logits in zip(prompts, run_schedule(ours, prompts, SCHEDULE, seed=max_padded)):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=2e-5, rtol=1e-5)


def test_uniform_decode_batch_and_logits_indices(tiny_checkpoint, ours) -> None:
    """Equal-length steps take the unpadded fast path; logits_indices picks rows."""
    hf, _ = tiny_checkpoint
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (11, 15, 8)]
    steps = [[5, 9, 2]] + [[1, 1, 1]] * 3 + [[3, 3, 3]]  # prefill, decode x3, verify
    for prompt, logits in zip(prompts, run_schedule(ours, prompts, steps)):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=2e-5, rtol=1e-5)

    caches = ours.allocate_kv_cache(8, BLOCK_SIZE)
    attn = AttentionMetadata.build([9, 6], [9, 6], [[0, 1, 2], [5, 4]], BLOCK_SIZE)
    ids = torch.tensor(prompts[0][:9] + prompts[2][:6])
    rows = torch.tensor([8, 14, 3])
    out = ours(ids, attn.positions(), attn, caches, rows)
    assert out.shape == (3, 128) and out.dtype == torch.float32
    expected = torch.stack([hf_logits(hf, prompts[0][:9])[8], hf_logits(hf, prompts[2][:6])[5],
                            hf_logits(hf, prompts[0][:9])[3]])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_bfloat16_stays_close_to_float32(tiny_checkpoint, ours) -> None:
    _, directory = tiny_checkpoint
    bf16, _ = load_model(str(directory), dtype=torch.bfloat16, progress=False)
    assert bf16.embed_tokens.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in LENGTHS]
    for low, full in zip(run_schedule(bf16, prompts, SCHEDULE), run_schedule(ours, prompts, SCHEDULE)):
        assert low.dtype == torch.float32
        scale = full.abs().max()
        assert (low - full).abs().max() < 0.05 * scale
        agree = (low.argmax(-1) == full.argmax(-1)).float().mean()
        assert agree > 0.9


def test_bfloat16_widened_matches_bfloat16_native(tiny_checkpoint, monkeypatch) -> None:
    """The float32 products and decode attention that bf16 models use on CPUs without bf16
    arithmetic compute what oneDNN's bf16 computes, up to rounding order."""
    _, directory = tiny_checkpoint
    models = {}
    for native in (False, True):
        monkeypatch.setattr(linear_module, "cpu_has_bf16_arithmetic", lambda: native)
        models[native] = load_model(str(directory), dtype=torch.bfloat16, progress=False)[0]
    assert models[False].widening is not None and models[True].widening is None
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (17, 39, 12)]
    # Decode-only steps (attended in float32 when widened), verify-like steps, and a prefill
    # chunk attended on its own beside two decode tokens.
    steps = [[6, 10, 3]] + [[1, 1, 1]] * 3 + [[4, 4, 4], [1, 1, 1], [2, 1, 0], [1, 20, 1]]
    for widened, native in zip(run_schedule(models[False], prompts, steps),
                               run_schedule(models[True], prompts, steps)):
        assert (widened - native).abs().max() < 0.02 * native.abs().max()
        assert (widened.argmax(-1) == native.argmax(-1)).float().mean() > 0.9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 0.05)])
def test_cuda_matches_cpu(tiny_checkpoint, ours, dtype, tolerance) -> None:
    _, directory = tiny_checkpoint
    gpu, _ = load_model(str(directory), dtype=dtype, device="cuda", progress=False)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in LENGTHS]
    on_cpu_all = run_schedule(ours, prompts, SCHEDULE)
    for on_gpu, on_cpu in zip(run_schedule(gpu, prompts, SCHEDULE), on_cpu_all):
        assert (on_gpu - on_cpu).abs().max() < tolerance * on_cpu.abs().max()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_torch(dtype, tolerance) -> None:
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(7, 48, generator=gen) * torch.logspace(-3, 2, 7)[:, None]).to(dtype)
    x[3] = 0  # an all-zero row stays zero
    weight = torch.randn(48, generator=gen).to(dtype)
    ours = rms_norm(x, weight.repeat(2), 1e-5)
    expected = F.rms_norm(x.float(), (48,), weight.float(), 1e-5)
    assert ours.dtype == dtype and ours.shape == x.shape
    torch.testing.assert_close(ours.float(), expected, atol=tolerance, rtol=tolerance)


def test_attention_metadata_build_checks_lengths() -> None:
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([5], [4], [[0, 1]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="blocks"):
        AttentionMetadata.build([1], [9], [[0, 1]], BLOCK_SIZE)
    attn = AttentionMetadata.build([2, 1], [6, 1], [[3, 7], [2]], BLOCK_SIZE)
    assert attn.slot_mapping.tolist() == [7 * 4 + 0, 7 * 4 + 1, 2 * 4 + 0]
    assert attn.positions().tolist() == [4, 5, 0]
    assert attn.block_tables.tolist() == [[3, 7], [2, 0]]
    # Host-side lists are recovered from the tensors when left out.
    bare = AttentionMetadata(attn.query_start_loc, attn.seq_lens, attn.slot_mapping, attn.block_tables)
    assert bare.query_lens_list == [2, 1] and bare.seq_lens_list == [6, 1]
