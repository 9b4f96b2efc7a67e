"""Constrained decoding with xgrammar (the library vLLM uses): a request's StructuredOutput becomes a grammar matcher
on its sequence, and each sampling row's logits are masked to the tokens the grammar allows next. Draft trees are
masked node by node, so verification never accepts a token the grammar rejects. xgrammar is imported on first use."""
import json
import threading

import torch

from llmc.core.errors import LlmcError
from llmc.runtime.engine.draft_tree import DraftTree
from llmc.runtime.sampling_params import StructuredOutput


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise LlmcError("structured output (response_format, tool_choice) needs xgrammar: pip install 'llmc-toolchain[serve]'") from None
    return xgrammar


GRAMMAR_CACHE_BYTES = 256 * 2**20  # compiled grammars kept for reuse; the least recently used go past this


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer. xgrammar caches each distinct spec, up to GRAMMAR_CACHE_BYTES."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self._tokenizer, self._vocab_size, self._stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # requests are checked on several threads; the compiler is made once

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgrammar = import_xgrammar()
                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                               stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        return self._compiler

    def compile(self, output: StructuredOutput):
        compiler = self._xgrammar_compiler()
        try:
            if output.kind == "json_object":
                return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
            if output.kind == "json_schema":
                return compiler.compile_json_schema(output.spec, any_whitespace=False)
            return compiler.compile_structural_tag(output.spec)
        except Exception as error:  # noqa: BLE001 - xgrammar's errors for a schema it cannot take have no common type
            raise LlmcError(f"{output.field}: cannot be compiled to a grammar: {str(error).splitlines()[-1]}") from None

    def matcher(self, output: StructuredOutput):
        return import_xgrammar().GrammarMatcher(self.compile(output))


def masked_logits(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """logits [rows, vocab] as float32, each row with a matcher (None: unconstrained) masked to what it allows next."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(logits), logits.shape[-1])
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    masked = logits.float().clone()
    xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(masked.device), indices=rows)
    return masked


def masked_tree_logits(logits: torch.Tensor, matcher, tree: DraftTree) -> torch.Tensor:
    """logits: row 0 after the last token, row 1 + n after draft node n. Each row is masked to what the grammar allows
    after that node's path; a node the grammar rejects is unreachable (its parent's row excludes it), so its row and
    its subtree's stay unmasked."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(logits), logits.shape[-1])
    matcher.fill_next_token_bitmask(bitmask, 0)
    rows = [0]
    for node in range(len(tree)):
        num_accepted = 0
        for ancestor in tree.path(node):
            if not matcher.accept_token(tree.tokens[ancestor]):
                break
            num_accepted += 1
        else:
            matcher.fill_next_token_bitmask(bitmask, node + 1)
            rows.append(node + 1)
        matcher.rollback(num_accepted)
    masked = logits.float().clone()
    xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(masked.device), indices=rows)
    return masked
