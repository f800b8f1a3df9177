"""SGLang's completion message: its bytes (:mod:`.message`), and the ZMQ pushes that deliver
them to prefill ranks, with failure notices bounded per client (:mod:`.pusher`)."""

from trio_encode.completion.message import CompletionMessage
from trio_encode.completion.pusher import CompletionPusher, Endpoint, FailureNotices, Kind, Pusher

__all__ = ["CompletionMessage", "CompletionPusher", "Endpoint", "FailureNotices", "Kind", "Pusher"]
