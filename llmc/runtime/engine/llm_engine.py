import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from llmc.core.errors import LlmcError
from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.engine_stats import EngineStats
from llmc.runtime.engine.kernel_policy import dense_copy_kernels, dense_copy_rows
from llmc.runtime.engine.model_runner import ModelRunner, Speculator
from llmc.runtime.engine.request_checks import RequestChecks, eos_token_ids
from llmc.runtime.engine.scheduler import Scheduler
from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.layers.sampler import SampledToken
from llmc.runtime.models.loader import WeightLoader
from llmc.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    num_prompt_tokens: int = 0
    prompt_logprobs: list[SampledToken | None] | None = None  # on a request's first output, when its params ask
    error: str | None = None  # with finish_reason "error": what went wrong


def failed_output(request_id: str, error: BaseException | str) -> RequestOutput:
    """The last output of a request that an error ended."""
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return RequestOutput(request_id, [], "", finish_reason="error", error=message)


SpeculatorFactory = Callable[[Path, ModelRunner, EngineConfig], Speculator]


class LLMEngine:
    """The engine core. It decodes with drafts only through the speculator its subclass provides
    (llmc.runtime.llm.LLM provides the speculative decoder), so the engine does not depend on the drafts."""

    speculator_factory: SpeculatorFactory | None = None

    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        from llmc.checkpoints.spec import resolve_model

        config = config or EngineConfig()
        folder = resolve_model(str(model))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        weights = WeightLoader(folder, config.dtype, config.device, config.dense_weights, dense_copy_rows(config),
                               dense_copy_kernels(config))
        runner = ModelRunner(AutoConfig.from_pretrained(folder), weights, config)
        self._start(str(model), runner, tokenizer, config, eos_token_ids(tokenizer, folder))

    @classmethod
    def from_runner(cls, name: str, runner: ModelRunner, tokenizer, config: EngineConfig) -> "LLMEngine":
        """An engine over a model built elsewhere (e.g. random weights for a benchmark)."""
        engine = cls.__new__(cls)
        engine._start(name, runner, tokenizer, config, {tokenizer.eos_token_id} - {None})
        return engine

    def _start(self, name: str, runner: ModelRunner, tokenizer, config: EngineConfig, eos_ids: set[int]) -> None:
        self.config, self.model_name, self.runner, self.tokenizer = config, name, runner, tokenizer
        if config.speculative is not None and runner.speculator is None:
            if self.speculator_factory is None:
                raise LlmcError(f"{type(self).__name__} decodes without drafts; llmc.runtime.llm.LLM serves speculative configs")
            runner.speculator = self.speculator_factory(config.speculative, runner, config)
        self.max_model_len = runner.max_model_len
        self.block_manager = BlockManager(runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          runner.model.arch.min_window)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sequences: dict[str, Sequence] = {}
        self.checks = RequestChecks(tokenizer, runner.hf_config.vocab_size, self.max_model_len, eos_ids)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.checks.tokenize(prompt)

    def stats(self) -> EngineStats:
        scheduler, blocks, speculator = self.scheduler, self.block_manager, self.runner.speculator
        return EngineStats(len(scheduler.running), len(scheduler.waiting), blocks.num_used_blocks, blocks.num_blocks,
                           blocks.num_prefix_query_tokens, blocks.num_prefix_hit_tokens, scheduler.num_preemptions,
                           dict(scheduler.num_finished), speculator.stats if speculator is not None else None)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        token_ids = self.tokenize(prompt)
        self.checks.check_prompt(token_ids)
        seq = Sequence(token_ids, params, self.config.block_size, request_id)
        if seq.request_id in self.sequences:
            raise LlmcError(f"request id {seq.request_id!r} is already in use")
        if params.structured_output is not None:
            seq.grammar = self.checks.grammars.matcher(params.structured_output)
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def count_abandoned(self) -> None:
        """A request its caller gave up on before the engine admitted it: counted as aborted all the same."""
        self.scheduler.num_finished["abort"] += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled sequences. An error ends the requests it comes from alone: when the batch's
        forward fails, each sequence is run again on its own, and those that fail alone end with finish_reason
        "error"; the others go on."""
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        try:
            return self._advance(seqs, self.runner.run(seqs))
        except Exception as error:  # noqa: BLE001 - whatever one request's step raises must not stop the engine
            if len(seqs) == 1:
                return [self._fail(seqs[0], error)]
            logger.warning("a step of %d sequences failed (%s); running each on its own", len(seqs), error)
        outputs = []
        for seq in seqs:
            try:
                outputs += self._advance([seq], self.runner.run([seq]))
            except Exception as error:  # noqa: BLE001
                outputs.append(self._fail(seq, error))
        return outputs

    def _advance(self, seqs: list[Sequence], sampled: dict[Sequence, list[SampledToken]]) -> list[RequestOutput]:
        outputs = []
        for seq in seqs:
            try:
                outputs += self._advance_one(seq, sampled.get(seq, []))
            except Exception as error:  # noqa: BLE001 - a token the request's grammar or stop strings choke on
                outputs.append(self._fail(seq, error))
        return outputs

    def _advance_one(self, seq: Sequence, tokens: list[SampledToken]) -> list[RequestOutput]:
        seq.num_computed_tokens += seq.num_scheduled_tokens
        if tokens:  # K/V past the accepted drafts is stale, and their slots are given back
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq) + len(tokens) - 1)
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.release_out_of_window(seq)
        if tokens and seq.params.max_tokens == 0:
            return [self._finish_at_prompt(seq)]
        outputs = []
        for token in tokens:
            outputs.append(self._append(seq, token))
            if seq.is_finished:
                break
        if not seq.is_finished:
            self.block_manager.trim(seq)
        return outputs

    def _fail(self, seq: Sequence, error: BaseException) -> RequestOutput:
        logger.error("request %s failed: %s", seq.request_id, error, exc_info=error)
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        self.sequences.pop(seq.request_id, None)
        return failed_output(seq.request_id, error)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.cache_full_blocks(seq)
        self.scheduler.finish(seq, reason)
        del self.sequences[seq.request_id]

    def _finish_at_prompt(self, seq: Sequence) -> RequestOutput:
        """A request for nothing past its prompt (max_tokens 0: its prompt logprobs, say) ends once the prompt is in."""
        self._finish(seq, "length")
        return RequestOutput(seq.request_id, [], "", finish_reason="length", num_prompt_tokens=seq.num_prompt_tokens,
                             prompt_logprobs=self._prompt_logprobs(seq))

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> list[SampledToken | None] | None:
        return seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None

    def _append(self, seq: Sequence, token: SampledToken) -> RequestOutput:
        params = seq.params
        seq.append_token(token.token_id)
        if seq.grammar is not None and not seq.grammar.accept_token(token.token_id):
            raise RuntimeError(f"token {token.token_id} was sampled against the grammar of request {seq.request_id}")
        if params.logprobs is not None:
            seq.logprobs.append(token)
        seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        reason = None
        if token.token_id in params.stop_token_ids or (token.token_id in self.checks.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.is_terminated():
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        hits = [i for stop in params.stop if (i := seq.text.find(stop, max(0, seq.num_emitted_chars - len(stop)))) != -1]
        if hits:
            seq.text, reason = seq.text[: min(hits)], "stop"
        if reason:
            self._finish(seq, reason)
            visible_end = len(seq.text)
        else:  # hold back what may still become a stop string or complete a multi-byte character
            holdback = max((len(stop) - 1 for stop in params.stop), default=0)
            visible_end = len(seq.text[: len(seq.text) - holdback].removesuffix("\ufffd"))
        new_text = seq.text[seq.num_emitted_chars : visible_end]
        seq.num_emitted_chars = max(seq.num_emitted_chars, visible_end)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token.token_id],
            new_text=new_text,
            new_logprobs=[token] if params.logprobs is not None else [],
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            prompt_logprobs=self._prompt_logprobs(seq) if seq.num_output_tokens == 1 else None,
        )

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Run many prompts to completion (offline batch inference)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(prompt, p) for prompt, p in zip(prompts, params_list)]
        while self.has_unfinished():
            self.step()
        return [
            {"text": seq.text, "token_ids": seq.output_token_ids, "finish_reason": seq.finish_reason, "logprobs": seq.logprobs,
             "prompt_logprobs": self._prompt_logprobs(seq)}
            for seq in seqs
        ]
