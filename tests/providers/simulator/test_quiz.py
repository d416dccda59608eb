"""The built-in question set is reproducible and its answers are computed; the simulator's quiz mode answers it
correctly alone and, with merge degradation, worse the larger the merged batch."""

from __future__ import annotations

import random

import aiohttp

from mergebroker.merge.prompt import MergeMember, build_combined_messages, new_batch_ids
from mergebroker.merge.split import split_reply
from mergebroker.providers.simulator.quiz_mode import is_degraded
from mergebroker.providers.simulator.quiz_set import builtin_set, solve
from mergebroker.providers.simulator.server import SimulatorConfig, start_simulator


def test_the_same_seed_gives_the_same_200_distinct_questions_with_computed_answers():
    items = builtin_set(200, seed=7)
    assert items == builtin_set(200, seed=7) != builtin_set(200, seed=8)
    assert len({i.question for i in items}) == 200
    assert {i.kind for i in items} == {"arithmetic", "units", "capital", "letters", "weekday", "reverse"}
    assert all(i.expected and solve(i.question) == i.expected for i in items)


def test_answers_are_computed_by_code():
    assert solve("What is 12 * 11? Answer with the number only.") == "132"
    assert solve("How many meters are in 3 kilometers? Answer with the number only.") == "3000"
    assert solve("What is the capital of Japan? Answer with the city name only.") == "Tokyo"
    assert solve("How many times does the letter 'r' appear in 'strawberry'? Answer with the number only.") == "3"
    assert solve("What day of the week was 2000-01-01? Answer with the weekday name only.") == "Saturday"
    assert solve("Reverse the word 'planet'. Answer with the reversed word only.") == "tenalp"
    assert solve("What is the meaning of life?") is None


def test_a_question_wrong_in_a_small_batch_stays_wrong_in_larger_ones():
    questions = [i.question for i in builtin_set(200)]
    wrong = {n: {q for q in questions if is_degraded(q, n, 0.05)} for n in (1, 2, 4, 8)}
    assert wrong[1] == set()
    assert wrong[2] <= wrong[4] <= wrong[8]
    assert 0 < len(wrong[2]) < len(wrong[4]) < len(wrong[8]) < 200


async def _ask(url: str, content: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/chat/completions",
                             json={"model": "sim-small", "messages": [{"role": "user", "content": content}]}) as r:
            return (await r.json())["choices"][0]["message"]["content"]


async def test_the_simulator_in_quiz_mode_answers_alone_correctly_and_merged_worse_with_batch_size():
    items = builtin_set(16)
    async with await start_simulator(SimulatorConfig(quiz=True, merge_degrade=0.2)) as sim:
        assert await _ask(sim.url, items[0].question) == items[0].expected
        wrong = {}
        for n in (2, 8):
            members = [MergeMember(i, item.question, 50) for i, item in zip(new_batch_ids(n, random.Random(n)), items)]
            reply = await _ask(sim.url, build_combined_messages(members, system_prompt=None)[0]["content"])
            answers = split_reply(reply, [m.id for m in members], finish_reason="stop")
            wrong[n] = sum(answers[m.id] != item.expected for m, item in zip(members, items))
        assert wrong[2] / 2 < wrong[8] / 8
