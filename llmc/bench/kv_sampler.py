"""How full the in-process engine's KV cache gets under load."""
import asyncio

from llmc.runtime.serving.async_engine import AsyncLLMEngine


class KvSampler:
    """Polls the in-process engine: peak KV usage, and at that peak, tokens held ÷ slots of the blocks in use."""

    def __init__(self, engine: AsyncLLMEngine):
        self.llm = engine.engine
        self.peak_blocks = 0
        self.occupancy_at_peak = 0.0

    async def run(self) -> None:
        manager = self.llm.block_manager
        while True:
            used = manager.num_used_blocks
            if used > self.peak_blocks:
                self.peak_blocks, self.occupancy_at_peak = used, self._occupancy()
            await asyncio.sleep(0.01)

    def _occupancy(self) -> float:
        """Tokens ÷ slots over the blocks running sequences hold (a shared prefix block counts once). Counted from
        the sequence's length, not its computed tokens: the sampler runs beside the engine thread and may look
        between a step's block allocation and its forward."""
        block_size = self.llm.block_manager.block_size
        filled: dict[int, int] = {}
        for seq in list(self.llm.scheduler.running):
            for index, block_id in enumerate(list(seq.block_table)):
                tokens = min(block_size, max(0, len(seq) - index * block_size))
                filled[block_id] = max(filled.get(block_id, 0), tokens)
        return sum(filled.values()) / (len(filled) * block_size) if filled else 0.0

    def report(self) -> dict:
        manager = self.llm.block_manager
        return {"kv_blocks_total": manager.num_blocks, "kv_peak_blocks_used": self.peak_blocks,
                "kv_peak_usage": self.peak_blocks / manager.num_blocks, "kv_token_occupancy_at_peak": self.occupancy_at_peak,
                "leaked_blocks": manager.num_used_blocks, "preemptions": self.llm.scheduler.num_preemptions}
