"""Token-in/token-out, append-only episodes: each turn's request is the trajectory so far, sampled
ids sit where the loss mask is 1 and nowhere else, environment text is encoded on its own, and the
chat renderer's ids equal the chat template's rendering of the whole conversation."""

from __future__ import annotations

import pytest
from agent_support import engine, runner, specs, tiny_checkpoint, tokenizer

from sparserl_mcore.agent import Env, Reply, Turn
from sparserl_mcore.agent.render import ChatRenderer, PlainRenderer
from sparserl_mcore.agent.trajectory import Trajectory
from sparserl_mcore.rollout.protocol import Sample


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("agent") / "hf")


class Scripted(Env):
    """Two observations, then done; records every turn it saw."""

    stop = (";",)
    seen: list[Turn] = []

    def reset(self, row):
        return row["prompt"]

    async def step(self, turn: Turn) -> Reply:
        Scripted.seen.append(turn)
        if turn.index < 2:
            return Reply(observation=f"={turn.index + 4} r{1 - turn.index}\n", reward=0.25)
        return Reply(done=True, reward=1.0)


class SpyRenderer(PlainRenderer):
    texts: list[str] = []

    def prompt(self, text):
        SpyRenderer.texts.append(text)
        return super().prompt(text)

    def observation(self, text, sampled):
        SpyRenderer.texts.append(text)
        return super().observation(text, sampled)


def test_turns_append_and_the_mask_covers_exactly_the_sampled_ids(hf):
    tok = tokenizer(hf)
    run = runner(
        {"e0": engine(hf)}, Scripted, tok, renderer=SpyRenderer(tok), max_turns=4, max_tokens_per_turn=6
    )
    episodes = run.run(specs([{"prompt": "hop 2 from 7\n"}, {"prompt": "hop 1 from 3\n"}], group_size=2))
    assert len(episodes) == 4
    for ep in episodes:
        assert ep.end_reason == "done" and ep.reward == 1.5 and len(ep.turns) == 3
        mask = [0] * len(ep.tokens)
        for k, turn in enumerate(ep.turns):
            n = len(turn.prompt_ids)
            assert turn.prompt_ids == ep.tokens[:n]  # the request was the whole trajectory so far
            assert ep.tokens[n : n + len(turn.output_ids)] == turn.output_ids
            assert ep.logprobs[n : n + len(turn.output_ids)] == turn.output_logprobs
            assert ep.versions[n : n + len(turn.output_ids)] == turn.token_versions()
            assert set(ep.turn_of[n : n + len(turn.output_ids)]) == {k}
            mask[n : n + len(turn.output_ids)] = [1] * len(turn.output_ids)
            if k < 2:  # what follows the sampled ids is exactly the observation, encoded alone
                obs = tok(f"={k + 4} r{1 - k}\n", add_special_tokens=False)["input_ids"]
                end = n + len(turn.output_ids)
                assert list(ep.tokens[end : end + len(obs)]) == obs
                assert ep.turns[k + 1].prompt_ids == ep.tokens[: end + len(obs)]
        assert list(ep.loss_mask) == mask and mask[0] == 0
        off = [i for i, m in enumerate(mask) if not m]
        assert all(ep.logprobs[i] == 0.0 and ep.versions[i] == 0 and ep.turn_of[i] == -1 for i in off)
    # the renderer saw only prompt and environment text, never sampled text
    assert sorted(set(SpyRenderer.texts)) == ["=4 r1\n", "=5 r0\n", "hop 1 from 3\n", "hop 2 from 7\n"]
    assert all(t.finish_reason in ("stop", "eos", "length") for t in Scripted.seen)


def test_a_re_encoded_history_is_refused(hf):
    tok = tokenizer(hf)
    traj = Trajectory(tok("hop 1 from 3\n", add_special_tokens=False)["input_ids"])
    out = (*tok("?3;", add_special_tokens=False)["input_ids"], tok.eos_token_id)
    traj.append_sampled(
        Sample(
            rid="a",
            prompt_ids=tuple(traj.tokens),
            output_ids=out,
            output_logprobs=(-1.0,) * len(out),
            finish_reason="stop",
        ),
        0,
    )
    traj.append_env(tok("=4 r0\n", add_special_tokens=False)["input_ids"])
    # decode(skip_special_tokens) + encode drops the EOS: the next request is not the trajectory
    round_trip = tok(tok.decode(traj.tokens, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
    assert len(round_trip) == len(traj) - 1
    bad = Sample(
        rid="b", prompt_ids=tuple(round_trip), output_ids=(5,), output_logprobs=(-1.0,), finish_reason="stop"
    )
    with pytest.raises(ValueError, match="never re-encoded or re-rendered"):
        traj.append_sampled(bad, 1)


def test_chat_renderer_equals_the_template_on_the_whole_conversation(hf):
    tok = tokenizer(hf, chat=True)
    r = ChatRenderer(tok, tool_role="tool")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert r.stop_token_ids == (im_end,)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = r.prompt("What is 3*17?")
    turns = [("[3*17]", True), ("[51+1]", False), ("52", True)]  # closed by <|im_end|>, or cut at "]"
    messages = [{"role": "user", "content": "What is 3*17?"}]
    for k, (text, closed) in enumerate(turns):
        sampled = enc(text) + ([im_end] if closed else [])
        ids = ids + sampled
        messages.append({"role": "assistant", "content": text})
        if k < len(turns) - 1:
            ids = ids + r.observation(f"={k}", sampled)
            messages.append({"role": "tool", "content": f"={k}"})
    reference = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ids == enc(reference.removesuffix("\n"))  # the last turn's closing "\n" comes next turn


def test_chat_renderer_refuses_a_template_that_rewrites_history(hf):
    tok = tokenizer(hf)
    tok.chat_template = (  # past assistant turns lose their content once another message follows
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="could not be append-only"):
        ChatRenderer(tok).observation("=4", [5])


def test_chat_episodes_on_the_engine_stop_at_im_end(hf):
    tok = tokenizer(hf, chat=True)
    run = runner(
        {"e0": engine(hf)}, Scripted, tok, renderer=ChatRenderer(tok), max_turns=3, max_tokens_per_turn=6
    )
    (ep,) = run.run(specs([{"prompt": "hi"}], group_size=1))
    for k, turn in enumerate(ep.turns):
        assert turn.prompt_ids == ep.tokens[: len(turn.prompt_ids)]
        if k:  # the previous turn is closed, then the tool message and the next generation prompt
            before = ep.turns[k - 1]
            obs = tok.decode(list(turn.prompt_ids[len(before.prompt_ids) + len(before.output_ids) :]))
            closed = before.output_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
            bridge = "\n" if closed else "<|im_end|>\n"
            assert obs == f"{bridge}<|im_start|>tool\n={k + 3} r{2 - k}\n<|im_end|>\n<|im_start|>assistant\n"
