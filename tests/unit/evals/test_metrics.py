import pytest

from llmc.evals.business_set import parse_item
from llmc.evals.metrics import contains, exact, json_match, regex, rouge_l


def test_exact_ignores_case_spacing_and_outer_punctuation():
    assert exact("  Yes. ", ["yes"]) == 1.0
    assert exact("Portland", ["Seattle", "portland"]) == 1.0
    assert exact("Yes, you can.", ["yes"]) == 0.0


def test_contains_finds_any_reference():
    assert contains("You have 30 Days to return it.", ["30 days"]) == 1.0
    assert contains("You have thirty days.", ["30 days", "31 days"]) == 0.0


def test_regex_searches_case_insensitively():
    assert regex("NO, we do not.", [r"^\W*no\b"]) == 1.0
    assert regex("Not at all", [r"^\W*no\b"]) == 0.0


def test_rouge_l_is_lcs_f1_on_words():
    assert rouge_l("the cat sat", ["the cat sat"]) == 1.0
    assert rouge_l("a b c d", ["a x c"]) == pytest.approx(2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3))
    assert rouge_l("", ["anything"]) == 0.0
    assert rouge_l("x y", ["z", "y x y"]) == pytest.approx(0.8)


def test_json_match_parses_embedded_json_and_gives_key_credit():
    assert json_match('Sure: ```json\n{"days": 30}\n```', [{"days": 30}]) == 1.0
    assert json_match('{"tent": 25, "kayak": 41}', [{"tent": 25, "kayak": 40}]) == 0.5
    assert json_match("thirty days", [{"days": 30}]) == 0.0
    assert json_match("[1, 2]", [[1, 2]]) == 1.0


def test_choice_items_score_the_likeliest_option(tiny_llama):
    from llmc.evals.business import run_business
    from llmc.evals.generation import make_generator
    from llmc.evals.loading import load_model

    item = parse_item('{"prompt": "Return window?", "choices": ["30 days", "60 days"], "reference": "B", "metric": "choice"}', "x")
    assert item.answer_index == 1 and item.reference_text == "60 days"
    assert "- 30 days\n- 60 days" in item.prompt_messages[-1]["content"]
    generator = make_generator(load_model(str(tiny_llama)))
    chosen = generator.choose(item.prompt_messages, item.choices)
    [result] = run_business(generator, [item]).items
    assert result.output == item.choices[chosen] and result.score == float(chosen == 1)
