"""Structured output: every response parses and validates against its schema, greedy and sampled, many requests in
one batch, with and without speculative decoding. The tiny model has random weights and a byte-level vocabulary, so
the grammar alone makes its output JSON; the schemas bound every string, number and array so each output ends."""
import json

import jsonschema
import pytest
import torch
from helpers import CORPUS

from llmc.core.errors import LlmcError
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.draft_tree import DraftTree
from llmc.runtime.engine.grammar import GrammarCompiler, masked_tree_logits
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams, StructuredOutput

PROMPT = " ".join(CORPUS.split()[:10])
# strings bounded by pattern: xgrammar 0.2.9 lowers minLength/maxLength to a character class that admits raw control
# characters (invalid JSON) and no escapes (mlc-ai/xgrammar#800)
NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}
SCORE = {"type": "integer", "minimum": 0, "maximum": 100}
LEAF = {"$ref": "#/$defs/leaf"}


def strict_object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS = [
    strict_object({"name": NAME}),
    strict_object({"name": NAME, "age": SCORE}),
    strict_object({"ok": {"type": "boolean"}}),
    strict_object({"colour": {"enum": ["red", "green", "blue"]}}),
    strict_object({"version": {"const": "v1"}, "count": SCORE}),
    strict_object({"tags": {"type": "array", "items": NAME, "maxItems": 3}}),
    strict_object({"scores": {"type": "array", "items": SCORE, "minItems": 1, "maxItems": 4}}),
    strict_object({"user": strict_object({"id": SCORE, "name": NAME})}),
    strict_object({"note": {"type": ["string", "null"], "pattern": "^[A-Za-z ]{0,6}$"}}),
    strict_object({"value": {"anyOf": [SCORE, {"type": "boolean"}]}}),
    strict_object({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    strict_object({"name": NAME, "nickname": NAME}, required=["name"]),
    strict_object({"items": {"type": "array", "maxItems": 2, "items": strict_object({"sku": NAME, "qty": SCORE})}}),
    strict_object({"flag": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}, "label": NAME}),
    strict_object({"point": {"type": "array", "prefixItems": [SCORE, SCORE], "items": False, "minItems": 2}}),
    strict_object({"nothing": {"type": "null"}, "id": SCORE}),
    strict_object({"step": {"type": "integer", "minimum": 0, "maximum": 50, "multipleOf": 5}}),
    {"$defs": {"leaf": strict_object({"v": SCORE})}, **strict_object({"left": LEAF, "right": LEAF})},
    strict_object({"answer": {"enum": ["yes", "no"]}, "why": {"type": "string", "format": "date"}}),
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 5},
]
MAX_TOKENS = 300


def requests(schemas: list[dict]) -> list[SamplingParams]:
    """Each schema twice: greedy, then sampled with its own seed."""
    return [SamplingParams(temperature=temperature, seed=index, max_tokens=MAX_TOKENS,
                           structured_output=StructuredOutput("json_schema", json.dumps(schema)))
            for index, schema in enumerate(schemas) for temperature in (0.0, 1.0)]


def assert_valid(outputs: list[dict], schemas: list[dict]) -> None:
    for index, output in enumerate(outputs):
        schema = schemas[index // 2]
        assert output["finish_reason"] == "stop", (schema, output["text"])
        jsonschema.validate(json.loads(output["text"]), schema)


def engine(model, **overrides) -> LLM:
    return LLM(model, EngineConfig(dtype=torch.float32, max_num_seqs=2 * len(SCHEMAS), **overrides))


def test_twenty_schemas_greedy_and_sampled_in_one_batch_all_validate(tiny_llama):
    llm = engine(tiny_llama)
    outputs = llm.generate([PROMPT] * 2 * len(SCHEMAS), requests(SCHEMAS))
    assert_valid(outputs, SCHEMAS)
    unconstrained = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0]["text"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(unconstrained)  # without the grammar this model writes no JSON
    any_object = llm.generate([PROMPT] * 4, [SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
                                                            structured_output=StructuredOutput("json_object")) for seed in range(4)])
    # json_object bounds nothing, so a random model may still be writing when max_tokens runs out
    assert all(isinstance(json.loads(out["text"]), dict) for out in any_object if out["finish_reason"] == "stop")
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.slow
def test_speculative_decoding_never_accepts_a_draft_token_the_grammar_rejects(tiny_llama, trained):
    draft, _ = trained
    schemas = SCHEMAS[:8]
    settings = dict(num_kv_blocks=512, speculative_max_num_seqs=len(schemas) * 2, adaptive_speculation=False,
                    speculative_min_confidence=0.0)
    plain = engine(tiny_llama).generate([PROMPT] * 2 * len(schemas), requests(schemas))
    speculative_engine = engine(tiny_llama, speculative=draft, speculative_tree_nodes=6, **settings)
    speculative = speculative_engine.generate([PROMPT] * 2 * len(schemas), requests(schemas))
    assert_valid(speculative, schemas)
    greedy = slice(0, None, 2)  # greedy speculative decoding is exact: the same tokens as without drafts
    assert [out["token_ids"] for out in speculative[greedy]] == [out["token_ids"] for out in plain[greedy]]
    assert speculative_engine.runner.speculator.stats.num_drafts > 0


def test_a_tree_row_is_masked_after_its_path_and_a_rejected_node_is_unreachable(tiny_llama):
    llm = engine(tiny_llama)
    matcher = llm.checks.grammars.matcher(StructuredOutput("json_schema", json.dumps(SCHEMAS[2])))  # {"ok": true|false}
    brace, quote, letter = (llm.tokenizer.convert_tokens_to_ids(token) for token in ("{", '"', "x"))
    tree = DraftTree(tokens=[brace, letter, quote], parents=[-1, -1, 0])  # "{", "x" (rejected), "{" then '"'
    masked = masked_tree_logits(torch.zeros(4, llm.runner.hf_config.vocab_size), matcher, tree)
    allowed = masked > float("-inf")
    assert allowed[0].sum() == 1 and allowed[0, brace] and not allowed[0, letter]  # the root allows only "{"
    assert allowed[1, quote] and not allowed[1, brace]  # after "{": a key's quote
    assert allowed[2].all()  # after "x": never reached, left unmasked
    assert not allowed[3, quote]  # after '{"': the key's letters, not another quote
    assert matcher.accept_token(brace) and not matcher.is_terminated()  # the matcher is back where it started


def test_a_schema_the_compiler_refuses_is_a_clear_error(tiny_llama):
    grammars = GrammarCompiler(engine(tiny_llama).tokenizer, 400, {0})
    with pytest.raises(LlmcError, match="response_format: cannot be compiled to a grammar"):
        grammars.compile(StructuredOutput("json_schema", json.dumps({"type": "no-such-type"})))
