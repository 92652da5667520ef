"""A request's stop set (its stop_token_ids and every EOS id of the model) on a real engine: the
sampler's min_tokens mask and the scheduler's finish check read the same set, so no EOS id can
slip through as text before min_tokens, and each one ends the request after it."""
import json
import shutil

import pytest

from trillm import SamplingParams
from trillm.config import EngineArgs
from trillm.engine.core import EngineCore

EOS_IDS = [2, 5]  # as Llama 3 lists <|eot_id|> beside <|end_of_text|>


@pytest.fixture(scope="module")
def core(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("two-eos")
    shutil.copytree(tiny_model_dir("llama"), path, dirs_exist_ok=True)
    with open(path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": EOS_IDS, "bos_token_id": 1}, f)
    return EngineCore(EngineArgs(model=str(path), num_kv_blocks=32, max_model_len=64))


def run(core: EngineCore, params: SamplingParams) -> tuple[list[int], str]:
    core.add_request("r", [7, 8, 9], params)
    tokens = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
            if out.finished:
                reason = out.finish_reason
    return tokens, reason


@pytest.mark.parametrize("eos", EOS_IDS)
def test_every_eos_id_waits_for_min_tokens_then_ends_the_request(core, eos):
    assert core.config.eos_token_ids == tuple(EOS_IDS)
    favoured = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={eos: 100})
    tokens, reason = run(core, favoured)
    assert tokens[:3] and not set(tokens[:3]) & set(EOS_IDS), "no EOS id before min_tokens"
    assert (tokens[3:], reason) == ([eos], "stop")


def test_ignore_eos_makes_every_eos_id_a_plain_token(core):
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, ignore_eos=True, logit_bias={5: 100})
    tokens, reason = run(core, params)
    assert (tokens, reason) == ([5, 5, 5, 5], "length")
