"""The detokenizer process: scheduler token ids in, text chunks out to the tokenizer process."""

from __future__ import annotations

import logging
import threading

import zmq

from detokenizer_proc.detokenizer import Detokenizer
from engine import child
from engine.config import EngineConfig
from engine.ipc import Endpoints, PullQueue, PushQueue
from engine.messages.to_detokenizer import (
    Register,
    SchedulerExited,
    StepOutputs,
    ToDetokenizer,
)
from engine.messages.to_launcher import SchedulerFacts
from engine.messages.to_scheduler import Abort, ToScheduler
from engine.messages.to_tokenizer import Chunks, FromEngine, PipelineDrained, RequestFailed
from engine.tokenizer_loader import load_tokenizer

log = logging.getLogger("detokenizer")


def run(config: EngineConfig, endpoints: Endpoints, parent_pid: int, facts: SchedulerFacts) -> None:
    child.setup("detokenizer", config.log_level)
    me = child.Child("detokenizer", endpoints.launcher, parent_pid)
    with me.starting():
        tokenizer = load_tokenizer(facts.model_dir, facts.tokenizer_defaults)
        process = DetokenizerProcess(endpoints, tokenizer)
    me.ready()
    process.serve(me.orphaned)
    me.close()


class DetokenizerProcess:
    def __init__(self, endpoints: Endpoints, tokenizer: object) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        self.detok = Detokenizer(tokenizer)
        self.inbox: PullQueue[ToDetokenizer] = PullQueue(ctx, endpoints.detokenizer, ToDetokenizer)
        self.to_tokenizer: PushQueue[FromEngine] = PushQueue(ctx, endpoints.tokenizer, FromEngine)
        self.to_scheduler: PushQueue[ToScheduler] = PushQueue(ctx, endpoints.scheduler, ToScheduler)

    def serve(self, orphaned: threading.Event) -> None:
        while not orphaned.is_set():
            msg = self.inbox.get(timeout=0.5)
            if msg is not None and not self._handle_safely(msg):
                break
        self.close()

    def _handle_safely(self, msg: ToDetokenizer) -> bool:
        try:
            return self.handle(msg)
        except Exception:  # NOTE: a bad output is logged; the other requests keep streaming
            log.exception("error handling %s", type(msg).__name__)
            return True

    def handle(self, msg: ToDetokenizer) -> bool:
        """Handle one message; False once the scheduler has exited."""
        if isinstance(msg, StepOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, Register):
            self.detok.register(msg.rid, msg.stop)
        elif isinstance(msg, SchedulerExited):
            self.to_tokenizer.put(PipelineDrained())
            return False
        else:
            self._forward(msg)
        return True

    def _on_outputs(self, msg: StepOutputs) -> None:
        chunks, stopped = self.detok.process(msg.outputs)
        for rid in stopped:
            self.to_scheduler.put(Abort(rid))
        if chunks:
            self.to_tokenizer.put(Chunks(chunks))

    def _forward(self, msg: FromEngine) -> None:
        if isinstance(msg, RequestFailed):
            self.detok.drop(msg.failure.rid)
        self.to_tokenizer.put(msg)

    def close(self) -> None:
        for q in (self.inbox, self.to_tokenizer, self.to_scheduler):
            q.close()
