"""The rollout engine (model/rollout.py): prompts of different lengths decoded together give, greedily, what the
model's own generate gives each alone (the cache, the positions and the mask are right); a row's sample is the same
alone or beside other prompts (its own random stream); forced ids are read into a row's cache and the row goes on
as if the model had read them from the start; the labels are the sampled ids only."""

from __future__ import annotations

import pytest
import torch

from model.model import CausalLM, LMConfig
from model.rollout import rollout, trained_batch
from test_dpo import TINY

EOS = 2


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, as the training children (conftest.child_env): on 2 busy cores two threads of these tiny matrix
    products waited on each other, some 50 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def model(request) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(LMConfig(vocab_size=64, use_moe=request.param, num_experts=3, num_experts_per_tok=2, **TINY))


def prompts_of(*lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(3, 64, (n,), generator=generator) for n in lengths]


def test_greedy_rows_of_different_lengths_equal_the_models_own_generate_of_each_alone(model):
    prompts = prompts_of(3, 9, 5)
    done = rollout(model, prompts, 2, 12, 0.0, [1, 2, 3], eos_id=EOS)
    for r, completion in enumerate(done):
        prompt = prompts[r // 2]
        alone = model.generate(prompt[None], 12, temperature=0.0, eos_token_id=EOS)[0, len(prompt):]
        alone = alone[:int((alone == EOS).nonzero()[0]) + 1] if (alone == EOS).any() else alone
        assert completion.ids.tolist() == alone.tolist() and completion.sampled.all()


def test_a_prompts_group_is_the_same_alone_or_beside_other_prompts(model):
    short, long, other = prompts_of(4, 11, 7)
    alone = rollout(model, [long], 3, 10, 1.0, [77], eos_id=EOS)
    beside = rollout(model, [short, long, other], 3, 10, 1.0, [5, 77, 9], eos_id=EOS)
    assert [c.ids.tolist() for c in alone] == [c.ids.tolist() for c in beside[3:6]]
    assert len({tuple(c.ids.tolist()) for c in alone}) > 1  # the rows of a group differ: each its own stream
    again = rollout(model, [long], 3, 10, 1.0, [78], eos_id=EOS)  # another seed: other samples
    assert [c.ids.tolist() for c in again] != [c.ids.tolist() for c in alone]


def test_forced_ids_enter_a_rows_cache_and_the_row_goes_on_as_if_it_had_read_them_from_the_start(model):
    prompt = prompts_of(6)[0]
    free = model.generate(prompt[None], 8, temperature=0.0)[0, len(prompt):].tolist()
    end = free[3]  # a token greedy decoding writes: the turn ends at it
    forced, asked = [7, 8, 9, 10], []

    def after_turn(row: int, turn: list[int], ended: bool) -> list[int] | None:
        asked.append((row, turn, ended))
        return forced if len(asked) == 1 else None

    (done,) = rollout(model, [prompt], 1, 30, 0.0, [0], eos_id=end, after_turn=after_turn)
    first = free[:free.index(end) + 1]
    so_far = torch.cat([prompt, torch.tensor(first + forced)])
    second = model.generate(so_far[None], 30 - len(so_far) + len(prompt), temperature=0.0,
                            eos_token_id=end)[0, len(so_far):].tolist()
    second = second[:second.index(end) + 1] if end in second else second
    assert done.ids.tolist() == first + forced + second
    assert done.sampled.tolist() == [True] * len(first) + [False] * len(forced) + [True] * len(second)
    assert asked[0] == (0, first, True) and asked[1][1] == second

    input_ids, labels = trained_batch([prompt], [done], pad_id=0)
    assert input_ids[0].tolist() == prompt.tolist() + done.ids.tolist()
    assert labels[0].tolist() == [-100] * len(prompt) + first + [-100] * len(forced) + second


def test_a_placeholder_prompt_gives_empty_rows_that_train_nothing(model):
    done = rollout(model, [torch.zeros(0, dtype=torch.long), prompts_of(5)[0]], 2, 6, 1.0, [1, 2], eos_id=EOS)
    assert [len(c.ids) for c in done[:2]] == [0, 0] and all(len(c.ids) for c in done[2:])
    input_ids, labels = trained_batch([torch.zeros(0, dtype=torch.long), prompts_of(5)[0]], done, pad_id=0)
    assert (labels[:2] == -100).all() and (labels[2:] != -100).any()
