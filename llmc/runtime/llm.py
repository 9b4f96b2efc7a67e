"""The runtime's entry point: the engine with the speculative decoder wired in."""
from llmc.runtime.engine.llm_engine import LLMEngine
from llmc.runtime.speculative.decoder import SpeculativeDecoder


class LLM(LLMEngine):
    speculator_factory = SpeculativeDecoder
