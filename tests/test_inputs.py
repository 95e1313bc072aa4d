"""base_moe.inputs: the token-id checks and the context warning shared by calibration and evaluation."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from base_moe.inputs import check_token_ids, context_length, vocab_size, warn_past_context


def model_with(**config):
    return SimpleNamespace(config=SimpleNamespace(**config))


def test_vocab_size_and_context_length_read_the_config():
    model = model_with(vocab_size=151936, max_position_embeddings=4096)
    assert (vocab_size(model), context_length(model)) == (151936, 4096)
    for missing in (model_with(), SimpleNamespace(), model_with(vocab_size=True, max_position_embeddings=0),
                    model_with(vocab_size="x", max_position_embeddings=-1)):
        assert vocab_size(missing) is None and context_length(missing) is None


def test_a_multimodal_config_answers_from_its_text_config():
    text = SimpleNamespace(vocab_size=1000, max_position_embeddings=512)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text, vocab_size=7))
    assert (vocab_size(model), context_length(model)) == (1000, 512)


@pytest.mark.parametrize("seed", range(5))
def test_check_token_ids_accepts_every_integer_dtype_in_range_and_names_the_range_outside(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(2, 300, (1,), generator=g))
    ids = torch.randint(0, vocab, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g)
    for dtype in (torch.int64, torch.int32, torch.int16):
        check_token_ids(ids.to(dtype), vocab)
    check_token_ids(ids, None)
    wrong = ids.clone()
    wrong[int(torch.randint(0, ids.numel(), (1,), generator=g))] = vocab + int(torch.randint(0, 5, (1,), generator=g))
    with pytest.raises(ValueError, match=f"in \\[0, {vocab}\\), got ids from {int(wrong.min())} to {int(wrong.max())}"):
        check_token_ids(wrong, vocab)
    check_token_ids(wrong, None)  # without a vocabulary only negative ids are refused
    wrong[0] = -1
    with pytest.raises(ValueError, match="got ids from -1 to"):
        check_token_ids(wrong, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64])
def test_check_token_ids_refuses_ids_that_are_not_integers(dtype):
    with pytest.raises(TypeError, match=f"got dtype {dtype}"):
        check_token_ids(torch.zeros(3, dtype=dtype), 10)


def test_warn_past_context():
    model = model_with(max_position_embeddings=64)
    with pytest.warns(UserWarning, match="seq=65 is longer than the model's context \\(max_position_embeddings 64\\)"):
        warn_past_context(model, 65)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_past_context(model, 64)
        warn_past_context(model_with(), 10**6)  # no context known: nothing to say
