from collections import Counter, deque

from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.config import EngineConfig
from llmc.runtime.engine.draft_tree import DraftTree
from llmc.runtime.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Continuous batching: every step, running sequences go first (decodes and unfinished prefill chunks), then
    waiting ones join while the token budget, the sequence limit and the KV blocks allow."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_finished: Counter[str] = Counter()  # by finish reason

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens + len(seq.draft), budget)
            while not self.block_manager.ensure_blocks(seq, seq.num_computed_tokens + num_tokens):
                preempted = True
                if self.preempt(self.running[-1]) is seq:
                    break
            else:
                seq.num_scheduled_tokens = num_tokens
                budget -= num_tokens
                scheduled.append(seq)
                index += 1
        while not preempted and self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seq.num_scheduled_tokens = min(seq.num_uncomputed_tokens, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
        return scheduled

    def preempt(self, seq: Sequence) -> Sequence:
        """Free a running sequence's blocks and requeue it first: its tokens are recomputed when it returns, without
        drafts, so that verification rows always follow a sequence's last token as one-token decodes."""
        self.running.remove(seq)
        seq.draft = DraftTree()
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.num_finished[reason] += 1
