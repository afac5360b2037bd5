"""The context-parallel sequence splitter (single process): token ownership, global label shift against HF's own
causal-LM loss, packed-document ids against HF's packed-sequence detection, the inverse, and the one-line errors."""

from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import find_packed_sequence_indices

from mindspeed_hf.parallel.context import padded_length, segment_ids, shard_indices, split_batch, unshard
from mindspeed_hf.parallel.context.split import PAD_SEGMENT

VOCAB = 11


def test_padded_length():
    assert padded_length(13, 2) == 14
    assert padded_length(13, 2, zigzag=True) == 16
    assert padded_length(16, 4, zigzag=True) == 16
    with pytest.raises(ValueError, match=r"shorter than 2 \* cp=8"):
        padded_length(7, 4, zigzag=True)


def test_zigzag_chunks_head_and_tail():
    # 2 * cp = 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert shard_indices(8, 2, 0, zigzag=True).tolist() == [0, 1, 6, 7]
    assert shard_indices(8, 2, 1, zigzag=True).tolist() == [2, 3, 4, 5]
    assert shard_indices(8, 2, 1).tolist() == [4, 5, 6, 7]
    # hybrid ring 2 x Ulysses 2: each ring piece cut in 2 contiguous parts, Ulysses innermost
    assert [shard_indices(8, 4, r, zigzag=True, ulysses=2).tolist() for r in range(4)] == [
        [0, 1], [6, 7], [2, 3], [4, 5]]


@pytest.mark.parametrize("cp,zigzag,ulysses", [(2, False, 1), (4, True, 1), (4, True, 2), (4, False, 4)])
def test_ranks_partition_the_sequence(cp, zigzag, ulysses):
    length = padded_length(21, cp, zigzag)
    parts = [shard_indices(length, cp, r, zigzag, ulysses) for r in range(cp)]
    assert len({len(p) for p in parts}) == 1
    assert sorted(torch.cat(parts).tolist()) == list(range(length))
    x = torch.randn(3, 21, 5)
    pieces = [torch.nn.functional.pad(x, (0, 0, 0, length - 21))[:, p] for p in parts]
    assert torch.equal(unshard(pieces, 21, zigzag=zigzag, ulysses=ulysses), x)


@pytest.mark.parametrize("zigzag", [False, True])
def test_shift_labels_give_hf_loss(zigzag):
    """Per-rank summed losses on the shifted, split labels add up to HF's own loss on the whole batch."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 13), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    logits = torch.randn(2, 13, VOCAB, generator=g)
    want = ForCausalLMLoss(logits, labels, VOCAB)
    cp, total, count, pieces = 2, 0.0, 0, []
    length = padded_length(13, cp, zigzag)
    padded_logits = torch.nn.functional.pad(logits, (0, 0, 0, length - 13))
    for rank in range(cp):
        part = split_batch(ids, labels, cp=cp, rank=rank, zigzag=zigzag)
        pieces.append(part["input_ids"])
        local = padded_logits[:, shard_indices(length, cp, rank, zigzag)]
        n = int((part["shift_labels"] != -100).sum())
        total = total + ForCausalLMLoss(local, None, VOCAB, num_items_in_batch=torch.tensor(1),
                                        shift_labels=part["shift_labels"])
        count += n
    assert torch.equal(unshard(pieces, 13, zigzag=zigzag), ids)
    assert count == int((labels[:, 1:] != -100).sum())
    assert abs(float(total) / count - float(want)) <= 1e-5


def test_packed_positions_and_segments():
    docs = [3, 6, 4]
    pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    hf = find_packed_sequence_indices(pos)
    assert torch.equal(segment_ids(pos), hf)
    cp = 2
    length = padded_length(13, cp, zigzag=True)
    got_pos, got_seg = [], []
    for rank in range(cp):
        part = split_batch(pos.clone(), position_ids=pos, cp=cp, rank=rank, zigzag=True)
        got_pos.append(part["position_ids"])
        got_seg.append(part["segment_ids"])
    assert torch.equal(unshard(got_pos, 13, zigzag=True), pos)  # global positions: RoPE unchanged
    full_seg = unshard(got_seg, length, zigzag=True)
    assert torch.equal(full_seg[:, :13], hf)
    assert (full_seg[:, 13:] == PAD_SEGMENT).all()
    unpacked = split_batch(torch.zeros(1, 13, dtype=torch.long), cp=cp, rank=0)
    assert unpacked["segment_ids"] is None and unpacked["position_ids"].tolist() == [list(range(7))]


def test_bad_sizes_fail_clearly():
    with pytest.raises(ValueError, match="multiple of cp_ulysses=3"):
        shard_indices(12, 4, 0, ulysses=3)
    with pytest.raises(ValueError, match="outside the cp group"):
        shard_indices(12, 4, 4)
    with pytest.raises(ValueError, match="labels must be"):
        split_batch(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long), cp=2, rank=0)


# ----------------------------------------------------------------------- vision-language models (multimodal.py)


def test_language_model_slice_is_the_text_splitters_slice():
    """The hook inside a vision-language model hands its language model the same tokens split_batch gives a text
    model: embeddings, 3-D positions (tail counting on), cache positions, deepstack masks and features, no mask."""
    from torch import nn

    from mindspeed_hf.parallel.context.multimodal import make_slice_hook

    batch, seq, cp, hidden = 2, 13, 2, 3
    embeds = torch.randn(batch, seq, hidden)
    positions = torch.arange(seq).expand(4, batch, seq) + torch.arange(4).view(4, 1, 1)
    visual = torch.zeros(batch, seq, dtype=torch.bool)
    visual[0, 2:6] = visual[1, 9:12] = True
    features = [torch.arange(7 * hidden, dtype=torch.float).view(7, hidden)]
    for rank in range(cp):
        kwargs = {"inputs_embeds": embeds, "position_ids": positions, "attention_mask": torch.ones(batch, seq),
                  "cache_position": torch.arange(seq), "visual_pos_masks": visual,
                  "deepstack_visual_embeds": features, "segment_ids": None}
        _, got = make_slice_hook(cp, rank, True, 1)(nn.Identity(), (), kwargs)
        text = split_batch(torch.arange(seq).expand(batch, seq), cp=cp, rank=rank, zigzag=True)
        idx = text["position_ids"][0]
        length = padded_length(seq, cp, zigzag=True)
        assert torch.equal(got["position_ids"][1], text["position_ids"] + 1)  # every rope row, tail counting on
        assert torch.equal(got["cache_position"], idx) and got["attention_mask"] is None
        padded = torch.cat([embeds, embeds.new_zeros(batch, length - seq, hidden)], 1)
        assert torch.equal(got["inputs_embeds"], padded[:, idx])
        mine = torch.cat([visual, visual.new_zeros(batch, length - seq)], 1)[:, idx]
        assert torch.equal(got["visual_pos_masks"], mine)
        order = torch.cat([visual, visual.new_zeros(batch, length - seq)], 1).reshape(-1).long().cumsum(0) - 1
        rows = order.view(batch, length)[:, idx][mine]
        assert torch.equal(got["deepstack_visual_embeds"][0], features[0][rows])
    untouched = {"inputs_embeds": embeds}
    assert make_slice_hook(cp, 0, True, 1)(nn.Identity(), (), untouched) is None  # not a split batch


def test_frames_are_shared_whole_and_balanced():
    from mindspeed_hf.parallel.context.multimodal import _frames, frame_shares

    assert frame_shares([64, 16, 32], 2) == [(0, 1), (1, 3)]
    assert frame_shares([1, 1, 1, 100], 2) == [(0, 3), (3, 4)]
    assert frame_shares([100, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]  # every rank at least one frame
    assert frame_shares([5], 2) is None  # fewer frames than ranks: the tower runs whole on every rank
    # an image is one frame, a video one frame per temporal patch (the towers attend within a frame)
    assert _frames(torch.tensor([[1, 4, 8], [3, 2, 4]])).tolist() == [[1, 4, 8], [1, 2, 4], [1, 2, 4], [1, 2, 4]]


def test_cp_vision_settings_fail_in_one_line():
    from mindspeed_hf.config import ParallelConfig
    from mindspeed_hf.parallel.context import ContextParallel, check_context_parallel

    with pytest.raises(ValueError, match=r"parallel.cp_vision=true .* needs parallel.cp > 1"):
        ParallelConfig(cp_vision=True)
    assert ParallelConfig(cp=2, cp_vision=True).cp_vision
    from tiny_models import tiny_model

    with pytest.raises(ValueError, match=r"parallel.cp_vision=true: llama has no Qwen-VL vision tower"):
        check_context_parallel(tiny_model("llama"), 1, vision=True)
    assert ContextParallel(2, 1, True, 0, None, None).inside is False
