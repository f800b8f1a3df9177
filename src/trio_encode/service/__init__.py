"""The encode service: owns the service nursery, the scope registry, the encoder and the engine.

The HTTP layer calls :meth:`EncodeService.encode`, :meth:`EncodeService.pull` and
:meth:`EncodeService.send` and maps what they return or raise; it never touches a scope's
internals or a transfer. The service nursery is opened by :func:`EncodeService.running` around
the whole server's life, so request scopes outlive the handlers that create them and end only
by their own rules, or at shutdown.

Its modules, one concern each: ``core`` (the service: encode, pull, send, what a failure
ends, arena registration, shutdown), ``admission`` (capacity limits before a request costs
anything), ``requests`` (what is kept beside each request: its part, bound endpoints, prefill
host), ``messages`` (what a request tells its prefill ranks), ``parts`` (SGLang's parts and
completion endpoints), ``encoder_api`` (the encoder as the service sees it) and ``settings``.
How a request itself is and ended lives below, in its scope's state
(:mod:`trio_encode.request_state`).
"""

from trio_encode.service.core import EncodeReport, EncodeService, ShutdownReport
from trio_encode.service.encoder_api import Encoder, PassThroughEncoder
from trio_encode.service.parts import MAX_ENDPOINTS, UNKNOWN_CLIENT, Notify, Part
from trio_encode.service.settings import ServiceSettings

__all__ = [
    "MAX_ENDPOINTS",
    "UNKNOWN_CLIENT",
    "EncodeReport",
    "EncodeService",
    "Encoder",
    "Notify",
    "Part",
    "PassThroughEncoder",
    "ServiceSettings",
    "ShutdownReport",
]
